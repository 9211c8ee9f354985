"""Shared builders for the linear LoRA layer tests: layer kinds, meshes, a dense oracle."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax as lj

IN, HEAD, HEADS, KV = 32, 8, 8, 2
MAX_LORAS, MAX_RANK = 4, 16
TOL = {jnp.float32: (2e-4, 2e-4), jnp.bfloat16: (3e-2, 3e-2)}


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    lora_cls: type
    make_base: object  # (rules, dtype) -> base layer

    @property
    def row(self) -> bool:
        return issubclass(self.lora_cls, lj.RowParallelLinearWithLoRA)


def _kw(rules, dtype):
    return dict(rules=rules, param_dtype=dtype, dtype=dtype, use_bias=True, rngs=nnx.Rngs(0))


def _qkv(rules, dtype):
    return lj.QKVParallelLinear(IN, HEAD, HEADS, KV, **_kw(rules, dtype))


KINDS = [
    Kind(
        "replicated",
        lj.ReplicatedLinearWithLoRA,
        lambda r, d: lj.ReplicatedLinear(IN, 24, **_kw(r, d)),
    ),
    Kind(  # an MoE router whose logits come out in f32 whatever the input's dtype
        "gate",
        lj.GateLinearWithLoRA,
        lambda r, d: lj.GateLinear(IN, 24, out_dtype=jnp.float32, **_kw(r, d)),
    ),
    Kind(
        "merged_replicated",
        lj.MergedReplicatedLinearWithLoRA,
        lambda r, d: lj.MergedReplicatedLinear(IN, [16, 24], **_kw(r, d)),
    ),
    Kind(
        "column",
        lj.ColumnParallelLinearWithLoRA,
        lambda r, d: lj.ColumnParallelLinear(IN, 64, **_kw(r, d)),
    ),
    Kind(
        "merged",
        lj.MergedColumnParallelLinearWithLoRA,
        lambda r, d: lj.MergedColumnParallelLinear(IN, [64, 64], **_kw(r, d)),
    ),
    Kind(
        "variable_slice",
        lj.MergedColumnParallelLinearVariableSliceWithLoRA,
        lambda r, d: lj.MergedColumnParallelLinear(IN, [32, 48, 64], **_kw(r, d)),
    ),
    Kind("qkv", lj.QKVParallelLinearWithLoRA, _qkv),
    Kind("merged_qkv", lj.MergedQKVParallelLinearWithLoRA, _qkv),
    Kind(
        "row", lj.RowParallelLinearWithLoRA, lambda r, d: lj.RowParallelLinear(64, 24, **_kw(r, d))
    ),
    Kind(
        "column_sharded",
        lj.ColumnParallelLinearWithShardedLoRA,
        lambda r, d: lj.ColumnParallelLinear(IN, 64, **_kw(r, d)),
    ),
    Kind(
        "merged_sharded",
        lj.MergedColumnParallelLinearWithShardedLoRA,
        lambda r, d: lj.MergedColumnParallelLinear(IN, [64, 64], **_kw(r, d)),
    ),
    Kind("qkv_sharded", lj.QKVParallelLinearWithShardedLoRA, _qkv),
    Kind("merged_qkv_sharded", lj.MergedQKVParallelLinearWithShardedLoRA, _qkv),
    Kind(
        "row_sharded",
        lj.RowParallelLinearWithShardedLoRA,
        lambda r, d: lj.RowParallelLinear(64, 24, **_kw(r, d)),
    ),
]
KIND_BY_NAME = {k.name: k for k in KINDS}


def output_dtype(layer, dtype):
    """The dtype a layer's output has for inputs of `dtype` (a router's may be its own)."""
    return getattr(layer.base_layer, "out_dtype", None) or jnp.dtype(dtype)


def make_mesh(dp: int, tp: int, explicit: bool = True):
    if dp * tp > jax.device_count():
        pytest.skip(f"mesh dp={dp} x tp={tp} needs {dp * tp} devices, {jax.device_count()} visible")
    types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((dp, tp), ("dp", "tp"), devices=jax.devices()[: dp * tp], axis_types=types)


@dataclasses.dataclass
class Adapter:
    a: list  # per slice [r, in]
    b: list  # per slice [out_s (logical), r]


def random_weights(base, seed=0):
    """Logical per-slice kernels `[in, n]` and biases."""
    rng = np.random.default_rng(seed)
    ks = [rng.normal(0, 0.2, (base.in_features, n)).astype(np.float32) for n in base.output_sizes]
    bs = [rng.normal(0, 0.1, (n,)).astype(np.float32) for n in base.output_sizes]
    return ks, bs


def random_adapter(layer, rank, seed):
    rng = np.random.default_rng(100 + seed)
    n_in = layer.base_layer.in_features
    a = [rng.normal(0, 0.3, (rank, n_in)).astype(np.float32) for _ in range(layer.n_slices)]
    b = [rng.normal(0, 0.3, (n, rank)).astype(np.float32) for n in layer.logical_slice_sizes]
    return Adapter(a, b)


def build(
    kind: Kind,
    rules,
    dtype=jnp.float32,
    *,
    adapters=None,
    seed=0,
    max_loras=MAX_LORAS,
    lora_dtype=None,
):
    """Base + LoRA layer with fixed random weights and adapters {slot: rank}; the adapters
    are stored in ``lora_dtype`` (default: the base's ``dtype``)."""
    base = kind.make_base(rules, dtype)
    ks, bs = random_weights(base, seed)
    base.load_kernel(ks, bs)
    cfg = lj.LoRAConfig(max_loras=max_loras, max_lora_rank=MAX_RANK, lora_dtype=lora_dtype or dtype)
    layer = kind.lora_cls(base, cfg, lj.LoRAContext(None))
    written = {}
    for slot, rank in (adapters or {}).items():
        ad = random_adapter(layer, rank, slot + 1000 * seed)
        layer.set_lora(slot, ad.a, ad.b)
        written[slot] = ad
    return layer, (ks, bs), written


def forward(layer, x, idx):
    # A `lora_mapping` block, not `set_lora_mapping`: a mapping left in the layer is
    # returned by nnx.jit, so XLA would compile all of it (work lists included) too,
    # ~3 x this step's compile on CPU.
    @nnx.jit
    def f(layer, x, idx):
        with lj.lora_mapping(layer, idx):
            return layer(x)

    return f(layer, x, idx)


def logical_output(layer, y):
    """Packed physical output → logical `[T, sum(output_sizes)]` (kv replicas dropped)."""
    base = layer.base_layer
    parts = base.split_output(jnp.asarray(y))
    out = []
    for i, p in enumerate(parts):
        p = np.asarray(p, np.float32)
        if isinstance(base, lj.QKVParallelLinear) and i > 0 and base.num_kv_head_replicas > 1:
            r = base.num_kv_head_replicas
            p = p.reshape(p.shape[0], base.total_num_kv_heads, r, base.head_size)[:, :, 0]
            p = p.reshape(p.shape[0], -1)
        out.append(p)
    return np.concatenate(out, axis=-1)


def dense_reference(layer, weights, adapters, x, idx):
    """`x @ W + b + x @ A_iᵀ @ B_iᵀ` per token, in float64 numpy, logical layout."""
    ks, bs = weights
    x = np.asarray(x, np.float64)
    y = x @ np.concatenate(ks, axis=1).astype(np.float64) + np.concatenate(bs)
    sizes = layer.logical_slice_sizes
    offs = np.concatenate([[0], np.cumsum(sizes)])
    for t, slot in enumerate(np.asarray(idx)):
        if slot < 0 or slot not in adapters:
            continue
        ad = adapters[slot]
        for s in range(layer.n_slices):
            y[t, offs[s] : offs[s + 1]] += x[t] @ ad.a[s].T.astype(np.float64) @ ad.b[s].T
    return y
