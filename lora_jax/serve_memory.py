"""Whether `lora-jax-serve`'s KV cache fits: its size, the devices' memory, the CLI error.

`lora_jax.serve` checks the size before `generate` allocates the cache, and gives the same
error, with the numbers and the flag to lower, when the device's allocator refuses it.
"""

from __future__ import annotations

import os

import numpy as np


def _cache_bytes(model, batch: int, length: int) -> int:
    """Bytes of `generate`'s KV cache for `batch` rows of `length` positions, before its
    padding to buckets."""
    from lora_jax.models.kv_cache import physical_kv_heads

    c = model.config
    itemsize = np.dtype(getattr(model, "dtype", None) or np.float32).itemsize
    per_position = 2 * c.num_hidden_layers * physical_kv_heads(c, model.rules) * c.head_dim
    return batch * length * per_position * itemsize


def _memory_bytes(model) -> tuple[int | None, str]:
    """The memory the model's arrays can take, and whose it is: the devices' allocator
    limits together (a GPU), else the host's RAM (the CPU backend); None if unknown."""
    import jax

    mesh = model.rules.mesh
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    if None not in limits:
        return sum(limits), "the devices'"
    if all(d.platform == "cpu" for d in devices) and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the host's"
        except (ValueError, OSError):
            pass
    return None, ""


def _cache_error(model, args, token_prompts, what: str) -> ValueError:
    """The CLI error for a KV cache larger than ``what`` (the devices' memory)."""
    longest = max(len(p) for p in token_prompts)
    gib = _cache_bytes(model, len(token_prompts), longest + args.max_new_tokens) / 2**30
    return ValueError(
        f"--max-new-tokens {args.max_new_tokens}: {len(token_prompts)} requests of up to "
        f"{longest} prompt + {args.max_new_tokens} new tokens need a KV cache of at least "
        f"{gib:.3g} GiB, more than {what}; lower --max-new-tokens"
    )
