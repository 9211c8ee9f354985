"""Views of an adapter manager's caches, which are plain dicts (`LoRAModelManager`) or
`LRUCache`s (`LRUCacheLoRAModelManager`): reading through these never makes an entry the
most recently used."""

from __future__ import annotations

from lora_jax.serving.lru import LRUCache


def _peek(cache, key):
    """`cache[key]` without making it the most recently used."""
    return cache.cache[key] if isinstance(cache, LRUCache) else cache[key]


def _items(cache):
    return cache.cache.items() if isinstance(cache, LRUCache) else cache.items()


def _keys(cache):
    return list(cache.cache) if isinstance(cache, LRUCache) else list(cache)
