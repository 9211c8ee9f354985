"""Serving: wrapping, PEFT loading, the adapter manager and generation."""
