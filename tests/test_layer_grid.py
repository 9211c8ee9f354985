"""The linear LoRA layers over the grid vLLM's layer tests sweep and the cases it leaves.

`test_layers.py` runs every layer kind on every mesh with one batch (16 tokens over 4
slots, f32 / bf16). Here, against the same dense float64 oracle:

* decode-sized batches (tokens ≤ slots), where the XLA backend gathers each token's
  adapter instead of multiplying against every slot;
* vLLM's `num_loras` grid (1, 2, 4 slots), two seeds, fp16;
* adapters stored in another dtype than the base layer (`LoRAConfig.lora_dtype`);
* every kind through the Pallas kernels (interpret mode) on a dp × tp mesh;
* which LoRA class `wrap_model` picks for a base layer and its packed module list.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from layer_cases import (
    IN,
    KINDS,
    MAX_LORAS,
    TOL,
    Kind,
    build,
    dense_reference,
    forward,
    logical_output,
    make_mesh,
    output_dtype,
)

import lora_jax as lj
from lora_jax import ops

# One kind of each family in the newest-jax run; every kind in the full (3.11) suite.
_FAST_KINDS = {"replicated", "merged_qkv", "row", "merged_qkv_sharded", "row_sharded"}
KIND_PARAMS = [
    pytest.param(k, id=k.name, marks=() if k.name in _FAST_KINDS else pytest.mark.slow)
    for k in KINDS
]


def _rounded(adapters, dtype):
    """The adapters as the layer stores them (rounded to ``dtype``), for the oracle."""
    rnd = lambda w: np.asarray(jnp.asarray(w, dtype), np.float32)
    for ad in adapters.values():
        ad.a[:] = [rnd(w) for w in ad.a]
        ad.b[:] = [rnd(w) for w in ad.b]
    return adapters


def _inputs(layer, tokens, dtype, seed=7):
    n_in = layer.base_layer.in_features
    return jnp.asarray(np.random.default_rng(seed).normal(size=(tokens, n_in)), dtype)


def _check(layer, weights, adapters, x, idx, y, rtol, atol):
    ref = dense_reference(layer, weights, adapters, np.asarray(x, np.float32), idx)
    scale = max(np.abs(ref).max(), 1.0)
    np.testing.assert_allclose(logical_output(layer, y), ref, rtol=rtol, atol=atol * scale)
    return ref


@pytest.mark.parametrize(
    "tokens,mesh",
    [(3, (1, 1)), (3, (1, 8)), (3, (2, 4)), (1, (1, 8))],
    ids=["3-tp1", "3-tp8", "3-dp2tp4", "1-tp8"],
)
@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_decode_batches_gather_each_tokens_adapter(monkeypatch, kind, tokens, mesh):
    """Fewer tokens than slots: the XLA backend takes each token's adapter by a gather
    (`ops._use_one_hot` says no), and every kind still matches the oracle."""
    seen = []
    use_one_hot = ops._use_one_hot
    monkeypatch.setattr(
        ops, "_use_one_hot", lambda t, s: seen.append(use_one_hot(t, s)) or use_one_hot(t, s)
    )
    layer, weights, adapters = build(
        kind, lj.ShardingRules(make_mesh(*mesh)), adapters={0: 16, 3: 4}
    )
    dp = mesh[0]
    # each dp shard gets `tokens` tokens: slots 3, -1 (base), 0 — the unwritten slot 2 too
    idx = np.resize(np.array([3, -1, 0, 2], np.int32), tokens * dp)
    x = _inputs(layer, tokens * dp, jnp.float32)
    y = forward(layer, x, jnp.asarray(idx))
    assert seen and not any(seen), seen  # traced with the gather only
    _check(layer, weights, adapters, x, idx, y, *TOL[jnp.float32])


@pytest.mark.parametrize("max_loras,seed", [(1, 0), (2, 1), (4, 0)])
@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_num_loras_grid_fp16(kind, max_loras, seed):
    """vLLM's layer grid: 1, 2 and 4 slots, every slot written (ranks 16 and below), two
    seeds, fp16 base and adapters on a tp = 2 mesh; the oracle takes the fp16 values."""
    rng = np.random.default_rng(seed)
    ranks = {slot: int(r) for slot, r in enumerate(rng.choice([4, 8, 16], max_loras))}
    rules = lj.ShardingRules(make_mesh(1, 2))
    layer, (ks, bs), adapters = build(
        kind, rules, jnp.float16, adapters=ranks, seed=seed, max_loras=max_loras
    )
    adapters = _rounded(adapters, jnp.float16)
    weights = ([np.asarray(jnp.asarray(k, jnp.float16), np.float32) for k in ks], bs)
    idx = rng.integers(-1, max_loras, 24).astype(np.int32)
    x = _inputs(layer, 24, jnp.float16, seed)
    y = forward(layer, x, jnp.asarray(idx))
    assert y.dtype == output_dtype(layer, jnp.float16)
    ref = _check(layer, weights, adapters, x, idx, y, 2e-3, 4e-3)
    base = dense_reference(layer, weights, {}, np.asarray(x, np.float32), idx)
    if (idx >= 0).any():  # the adapters changed the mapped tokens' outputs
        assert not np.allclose(ref[idx >= 0], base[idx >= 0], atol=1e-2)


@pytest.mark.parametrize(
    "dtype,lora_dtype",
    [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)],
    ids=["f32_base_bf16_lora", "bf16_base_f32_lora"],
)
@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_adapters_in_another_dtype_than_the_base(kind, dtype, lora_dtype):
    """`LoRAConfig.lora_dtype` apart from the base's dtype: the stacks are stored in it,
    the output keeps the base's dtype, and the sum matches the oracle (tp = 2)."""
    rules = lj.ShardingRules(make_mesh(1, 2))
    layer, (ks, bs), adapters = build(
        kind, rules, dtype, adapters={0: 16, 1: 8, 3: 4}, lora_dtype=lora_dtype
    )
    assert all(a.dtype == lora_dtype for a in layer.lora_a)
    adapters = _rounded(adapters, lora_dtype)
    rnd = lambda w: np.asarray(jnp.asarray(w, dtype), np.float32)
    weights = ([rnd(k) for k in ks], [rnd(b) for b in bs])
    idx = np.array([1, -1, 0, 3, 1, 1, -1, 2, 0, 3, 3, -1, 1, 0, 2, 1], np.int32)
    x = _inputs(layer, len(idx), dtype)
    y = forward(layer, x, jnp.asarray(idx))
    assert y.dtype == output_dtype(layer, dtype)
    _check(layer, weights, adapters, x, idx, y, 2e-2, 2e-2)  # bf16 on one side


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_every_kind_through_the_kernels(monkeypatch, kind):
    """The default GPU path, the Pallas shrink / expand kernels (interpret mode), for
    every kind on a dp = 2 × tp = 4 mesh, column, row and fully sharded alike."""
    from lora_jax import kernels

    monkeypatch.setattr(ops, "PALLAS_INTERPRET", True)
    monkeypatch.setattr(ops, "_default_backend", "pallas")
    calls = []
    for name in ("lora_shrink", "lora_expand"):
        fn = getattr(kernels, name)
        spy = lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k)
        monkeypatch.setattr(kernels, name, spy)
    layer, weights, adapters = build(
        kind, lj.ShardingRules(make_mesh(2, 4)), adapters={0: 16, 1: 8, 3: 4}
    )
    idx = np.array([1, -1, 0, 3, 1, 1, 2, 0, 3, 3, -1, 1, 0, 2, 1, 1], np.int32)
    x = _inputs(layer, len(idx), jnp.float32)
    y = forward(layer, x, jnp.asarray(idx))
    assert {"lora_shrink", "lora_expand"} <= set(calls), calls
    _check(layer, weights, adapters, x, idx, y, *TOL[jnp.float32])


def _pick(base, packed, fully_sharded=False):
    from lora_jax.serving.wrap import _pick_class

    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, fully_sharded_loras=fully_sharded)
    return _pick_class(base, cfg, packed)


def test_wrap_picks_the_class_vllm_picks():
    """`can_replace_layer` over the registered classes, as vLLM's class-selection test:
    3+ slices take the variable-slice class with a 1-item (one checkpoint tensor) or a
    full packed list; 2 slices the merged class with 2 names, the column class with one,
    none with an empty list; the sharded twins only under `fully_sharded_loras`."""
    from flax import nnx

    kw = dict(rngs=nnx.Rngs(0))
    three = lj.MergedColumnParallelLinear(16, [8, 16, 24], **kw)
    two = lj.MergedColumnParallelLinear(16, [8, 8], **kw)
    qkv = lj.QKVParallelLinear(16, 4, 4, 2, **kw)
    variable = lj.MergedColumnParallelLinearVariableSliceWithLoRA
    assert _pick(three, ["fused"]) is variable
    assert _pick(three, ["a", "b", "c"]) is variable
    assert _pick(three, ["a", "b"]) is None
    assert (
        _pick(three, ["a", "b", "c"], True)
        is lj.MergedColumnParallelLinearVariableSliceWithShardedLoRA
    )
    assert _pick(two, ["gate", "up"]) is lj.MergedColumnParallelLinearWithLoRA
    assert _pick(two, ["gate_up"]) is lj.ColumnParallelLinearWithLoRA
    assert _pick(two, []) is None
    assert _pick(two, ["gate", "up"], True) is lj.MergedColumnParallelLinearWithShardedLoRA
    assert _pick(qkv, ["qkv"]) is lj.QKVParallelLinearWithLoRA
    assert _pick(qkv, ["q", "k", "v"]) is lj.MergedQKVParallelLinearWithLoRA
    assert _pick(qkv, ["q", "k", "v"], True) is lj.MergedQKVParallelLinearWithShardedLoRA
    assert _pick(lj.ColumnParallelLinear(16, 8, **kw), []) is lj.ColumnParallelLinearWithLoRA
    assert _pick(lj.RowParallelLinear(16, 8, **kw), []) is lj.RowParallelLinearWithLoRA
    assert _pick(lj.ReplicatedLinear(16, 8, **kw), []) is lj.ReplicatedLinearWithLoRA
    # an MoE router: its own class, with or without fully_sharded_loras (vLLM's rule)
    for sharded in (False, True):
        assert _pick(lj.GateLinear(16, 8, **kw), [], sharded) is lj.GateLinearWithLoRA
    # a merged replicated layer (DeepSeek's fused_qkv_a_proj): a LoRA per packed member, or
    # one over the whole output from one checkpoint tensor; no sharded twin (vLLM's rule)
    fused = lj.MergedReplicatedLinear(16, [8, 24], **kw)
    for sharded in (False, True):
        assert _pick(fused, ["q_a", "kv_a"], sharded) is lj.MergedReplicatedLinearWithLoRA
        assert _pick(fused, ["fused_qkv_a"], sharded) is lj.ReplicatedLinearWithLoRA
    # a 3-slice layer that vLLM wraps with the variable-slice class serves its slices
    layer = variable(three, lj.LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=8))
    assert layer.n_slices == 3 and layer.logical_slice_sizes == (8, 16, 24)


class _PlusOne(lj.MergedColumnParallelLinear):
    """A gate_up-like base with its own per-shard forward (vLLM's DeepSeek case)."""

    def local_matmul(self, x, kernel):
        return super().local_matmul(x, kernel) + 1.0


@pytest.mark.parametrize("sharded", [False, True], ids=["lora", "fully_sharded"])
def test_a_subclassed_merged_base_keeps_its_forward(sharded):
    """`wrap_model` wraps a subclass of a merged layer with the merged LoRA class, and the
    wrapper runs the subclass's own per-shard matmul (tp = 2, plain and S-LoRA)."""
    cls = (
        lj.MergedColumnParallelLinearWithShardedLoRA
        if sharded
        else lj.MergedColumnParallelLinearWithLoRA
    )
    kind = Kind(
        "plus_one",
        cls,
        lambda r, d: _PlusOne(
            IN, [64, 64], rules=r, param_dtype=d, dtype=d, use_bias=True, rngs=nnx.Rngs(0)
        ),
    )
    layer, weights, adapters = build(
        kind, lj.ShardingRules(make_mesh(1, 2)), adapters={0: 16, 2: 8}
    )
    assert _pick(layer.base_layer, ["gate", "up"], sharded) is cls
    idx = np.array([0, -1, 2, 1, 0, 2, -1, 0], np.int32)
    x = _inputs(layer, len(idx), jnp.float32)
    y = forward(layer, x, jnp.asarray(idx))
    ref = dense_reference(layer, weights, adapters, np.asarray(x), idx) + 1.0
    np.testing.assert_allclose(logical_output(layer, y), ref, *TOL[jnp.float32])
