"""The decoder's KV cache: one `[B, kv_phys, max_len, hd]` key and value array per layer.

Heads before positions: attention contracts each (batch, kv head) pair's keys as one
batched matmul, so this layout feeds it without a transposed copy of the whole cache
per layer and step (with the former `[B, max_len, kv, hd]`, transposes took ~43 µs per
layer of a batch-64 decode step on an H200, benchmarks/RESULTS.md "ops").

A registered pytree dataclass, so it passes through `jax.jit` (and can be donated).
`kv_phys = max(num_kv_heads, tp)`: under tensor parallelism with fewer kv heads than
shards each shard keeps its own replica of its kv head, as `QKVParallelLinear` does.
Sharded on heads over "tensor" and on batch over "batch" (when B divides evenly).

Slot `j` of a row holds the key/value of position `j`. The decoder writes the tokens of
a step at their positions and attends to every slot `<= ` the query position, so the
rows must be filled contiguously from position 0 (right padding is fine: pad slots are
overwritten by later tokens before any query can see them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lora_jax.models.config import DecoderConfig
from lora_jax.sharding import ShardingRules


def cache_batch_axis(rules: ShardingRules, batch: int) -> str | None:
    """Logical batch axis of a `[B, ...]` array: "batch" when B divides evenly."""
    return "batch" if batch % rules.size("batch") == 0 else None


def physical_kv_heads(config: DecoderConfig, rules: ShardingRules) -> int:
    """kv heads as stored: replicated up to the tensor axis size when it is larger."""
    return max(config.num_key_value_heads, rules.size("tensor"))


def float_cache_dtype(dtype, name: str) -> jnp.dtype:
    """``dtype`` as a `jnp.dtype`; a ValueError naming ``name`` unless it is a floating
    dtype (an integer or bool cache truncates keys and values: wrong tokens, no error).

    Example:
        >>> float_cache_dtype("bfloat16", "cache_dtype")
        dtype(bfloat16)
    """
    allowed = "a floating dtype (float32, bfloat16, float16, ...)"
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"{name} must be {allowed}, got {dtype!r}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{name} must be {allowed}, got {dt}")
    return dt


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer key and value caches.

    Example:
        >>> cache = KVCache.init(DecoderConfig.tiny(), batch=2, max_len=16)
        >>> len(cache.k), cache.k[0].shape
        (2, (2, 2, 16, 16))
    """

    k: tuple[jax.Array, ...]  # per layer [B, kv_phys, max_len, hd]
    v: tuple[jax.Array, ...]  # per layer [B, kv_phys, max_len, hd]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @classmethod
    def init(
        cls,
        config: DecoderConfig,
        batch: int,
        max_len: int,
        *,
        rules: ShardingRules | None = None,
        dtype=jnp.float32,
    ) -> KVCache:
        """Zeros, placed on the mesh (eager) with heads on "tensor", batch on "batch"."""
        dtype = float_cache_dtype(dtype, "KVCache.init: dtype")
        rules = rules if rules is not None else ShardingRules()
        shape = (batch, physical_kv_heads(config, rules), max_len, config.head_dim)
        b = cache_batch_axis(rules, batch)
        sharding = rules.named(b, "tensor", None, None)
        n = config.num_hidden_layers
        arrays = _zeros(shape, dtype, sharding, 2 * n)()
        return cls(k=tuple(arrays[:n]), v=tuple(arrays[n:]))


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype, sharding, count: int):
    """One jitted call that makes ``count`` zero arrays (one dispatch, where ``count``
    eager `jnp.zeros` cost ~0.3 ms each on a CPU host: 17 ms for a 32-layer cache)."""
    return jax.jit(
        lambda: tuple(jnp.zeros(shape, dtype) for _ in range(count)),
        out_shardings=(sharding,) * count,
    )
