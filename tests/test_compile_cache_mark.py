"""The ``no_compile_cache`` mark (tests/conftest.py): a marked test compiles without the
tests' persistent compilation cache, an unmarked test writes to it (the control)."""

import os

import jax
import jax.numpy as jnp
import pytest


def _entries(prefix: str) -> list[str]:
    """Cache entries of programs whose jit name starts with ``prefix`` (jax names an entry
    ``jit_<function>-<hash>-cache``)."""
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not cache:
        pytest.skip("the tests' compilation cache is off in this run (GPU, or turned off)")
    if not os.path.isdir(cache):
        return []
    return [f for f in os.listdir(cache) if f.startswith(f"jit_{prefix}")]


def _compile(fn):
    """Compiles ``fn`` at a shape no other test uses (a fresh program, written if allowed)."""
    jax.block_until_ready(jax.jit(fn)(jnp.arange(11.0, dtype=jnp.float32)))


def _cache_mark_probe_written(x):
    return x * 3.25 + 1.5


def _cache_mark_probe_kept_out(x):
    return x * 4.25 - 0.5


def test_an_unmarked_test_writes_its_programs():
    for name in _entries("_cache_mark_probe_written"):  # an earlier run's: a hit writes none
        os.remove(os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], name))
    _compile(_cache_mark_probe_written)
    assert _entries("_cache_mark_probe_written")
    assert jax.config.jax_enable_compilation_cache


@pytest.mark.no_compile_cache
def test_a_marked_test_compiles_without_the_cache():
    assert not _entries("_cache_mark_probe_kept_out")
    _compile(_cache_mark_probe_kept_out)
    assert not _entries("_cache_mark_probe_kept_out")
    assert not jax.config.jax_enable_compilation_cache
