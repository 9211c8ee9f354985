"""Every linear LoRA layer against a dense per-token oracle and against its tp=1 run."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from layer_cases import (
    IN,
    KIND_BY_NAME,
    KINDS,
    MAX_LORAS,
    TOL,
    build,
    dense_reference,
    forward,
    logical_output,
    make_mesh,
    output_dtype,
)

import lora_jax as lj

T = 16
# Mixed ranks (16 = max, 8 and 4 need padding), -1 tokens, repeated and unsorted slots.
ADAPTERS = {0: 16, 1: 8, 3: 4}
IDX = np.array([1, -1, 0, 3, 1, 1, -1, 2, 0, 3, 3, -1, 1, 0, 2, 1], np.int32)
MESHES = {"tp1": (1, 1), "tp2": (1, 2), "tp4": (1, 4), "tp8": (1, 8), "dp2tp4": (2, 4)}
# tp=2/4 repeat what tp=8 and dp2xtp4 check; they run in the full (Python 3.11) suite.
_SLOW_MESHES = {"tp2", "tp4"}
MESH_PARAMS = [pytest.param(m, marks=pytest.mark.slow) if m in _SLOW_MESHES else m for m in MESHES]
# The per-kind invariance tests (auto axes, base exactly, slot writes) run every kind in
# the full (Python 3.11) suite; the newest-jax run takes one kind of each family.
_FAST_KINDS = {"replicated", "merged_qkv", "row", "merged_qkv_sharded", "row_sharded"}
KIND_PARAMS = [
    pytest.param(k, id=k.name, marks=() if k.name in _FAST_KINDS else pytest.mark.slow)
    for k in KINDS
]
_UNSHARDED = {}


def _inputs(layer, dtype):
    n_in = layer.base_layer.in_features
    return jnp.asarray(np.random.default_rng(7).normal(size=(T, n_in)), dtype)


def _run(kind, mesh_shape, dtype, explicit=True):
    rules = (
        lj.ShardingRules(make_mesh(*mesh_shape, explicit=explicit))
        if mesh_shape
        else lj.ShardingRules()
    )
    layer, weights, adapters = build(kind, rules, dtype, adapters=ADAPTERS)
    x = _inputs(layer, dtype)
    y = forward(layer, x, jnp.asarray(IDX))
    return layer, weights, adapters, x, y


@pytest.mark.parametrize("mesh", MESH_PARAMS)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_layer_matches_dense_and_tp1(kind, mesh):
    layer, weights, adapters, x, y = _run(kind, MESHES[mesh], jnp.float32)
    ref = dense_reference(layer, weights, adapters, x, IDX)
    got = logical_output(layer, y)
    rtol, atol = TOL[jnp.float32]
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol)
    if mesh != "tp1":
        if kind.name not in _UNSHARDED:
            layer1, *_, y1 = _run(kind, None, jnp.float32)
            _UNSHARDED[kind.name] = logical_output(layer1, y1)
        np.testing.assert_allclose(got, _UNSHARDED[kind.name], rtol=rtol, atol=atol)


@pytest.mark.parametrize("mesh", [pytest.param("tp1", marks=pytest.mark.slow), "dp2tp4"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_layer_bf16(kind, mesh):
    layer, weights, adapters, x, y = _run(kind, MESHES[mesh], jnp.bfloat16)
    assert y.dtype == output_dtype(layer, jnp.bfloat16)
    ref = dense_reference(layer, weights, adapters, np.asarray(x, np.float32), IDX)
    rtol, atol = TOL[jnp.bfloat16]
    scale = np.abs(ref).max()
    np.testing.assert_allclose(logical_output(layer, y), ref, rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_layer_auto_axes_mesh(kind):
    layer, weights, adapters, x, y = _run(kind, (2, 4), jnp.float32, explicit=False)
    ref = dense_reference(layer, weights, adapters, x, IDX)
    np.testing.assert_allclose(logical_output(layer, y), ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_no_adapter_and_reset_give_base_exactly(kind):
    rules = lj.ShardingRules(make_mesh(1, 2))
    layer, *_ = build(kind, rules, adapters=ADAPTERS)
    x = _inputs(layer, jnp.float32)
    base_y = np.asarray(jax.jit(lambda b, x: b(x))(layer.base_layer, x))
    all_none = np.asarray(forward(layer, x, jnp.full((T,), -1, jnp.int32)))
    np.testing.assert_array_equal(all_none, base_y)
    for slot in ADAPTERS:
        layer.reset_lora(slot)
    reset = np.asarray(forward(layer, x, jnp.asarray(np.where(IDX < 0, -1, IDX % MAX_LORAS))))
    np.testing.assert_array_equal(reset, base_y)


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_writing_a_slot_leaves_other_slots_bit_identical(kind):
    layer, *_ = build(kind, lj.ShardingRules(make_mesh(1, 4)), adapters=ADAPTERS)
    x = _inputs(layer, jnp.float32)
    before = np.asarray(forward(layer, x, jnp.asarray(IDX)))
    from layer_cases import random_adapter

    ad = random_adapter(layer, 12, seed=42)
    layer.set_lora(2, ad.a, ad.b)
    after = np.asarray(forward(layer, x, jnp.asarray(IDX)))
    untouched = IDX != 2
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert not np.allclose(after[~untouched], before[~untouched])


@pytest.mark.parametrize("kind", ["merged_qkv", "row_sharded"])
def test_eager_calls_on_a_mesh_compile_once_and_read_the_current_weights(monkeypatch, kind):
    """Outside a jit each call's shard_map is a fresh closure: its program is compiled once
    and found again by what it computes, while a new mapping and a newly written adapter
    (arguments, not constants) are read at every call."""
    from layer_cases import KIND_BY_NAME, random_adapter

    compiles = []
    real = jax.stages.Lowered.compile
    monkeypatch.setattr(
        jax.stages.Lowered,
        "compile",
        lambda self, *a, **k: compiles.append(1) or real(self, *a, **k),
    )
    layer, weights, adapters = build(
        KIND_BY_NAME[kind], lj.ShardingRules(make_mesh(1, 2)), adapters=ADAPTERS
    )
    x = _inputs(layer, jnp.float32)
    rtol, atol = TOL[jnp.float32]
    lj.set_lora_mapping(layer, jnp.asarray(IDX))
    y = layer(x)
    first = len(compiles)
    assert first >= 1
    np.testing.assert_allclose(
        logical_output(layer, y),
        dense_reference(layer, weights, adapters, x, IDX),
        rtol=rtol,
        atol=atol,
    )
    # a new adapter in slot 2, and a new token -> slot mix
    adapters[2] = random_adapter(layer, 16, seed=7)
    layer.set_lora(2, adapters[2].a, adapters[2].b)
    idx = np.roll(IDX, 5)
    lj.set_lora_mapping(layer, jnp.asarray(idx))
    y = layer(x)
    assert len(compiles) == first
    np.testing.assert_allclose(
        logical_output(layer, y),
        dense_reference(layer, weights, adapters, x, idx),
        rtol=rtol,
        atol=atol,
    )
    jitted = forward(layer, x, jnp.asarray(idx))
    np.testing.assert_allclose(np.asarray(y), np.asarray(jitted), rtol=1e-6, atol=1e-6)


def test_eager_shard_maps_on_two_meshes_of_one_shape_run_on_their_own_devices():
    """The lowered text names devices by position only: a program compiled for a mesh
    over devices 0, 1 is not reused for the same shape over devices 2, 3 (or 1, 0)."""
    if jax.device_count() < 4:
        pytest.skip(f"needs 4 devices, {jax.device_count()} visible")
    devs = jax.devices()
    x = np.arange(32.0, dtype=np.float32).reshape(4, 8)
    for ds in ([devs[0], devs[1]], [devs[2], devs[3]], [devs[1], devs[0]]):
        mesh = jax.make_mesh((1, 2), ("dp", "tp"), devices=ds)
        rules = lj.ShardingRules(mesh)
        xs = jax.device_put(x, rules.named(None, "tensor"))
        f = lj.sharding.shard_map(rules, lambda x: x * 2, ((None, "tensor"),), (None, "tensor"))
        y = f(xs)
        assert y.sharding.device_set == set(ds)
        np.testing.assert_array_equal(np.asarray(y), 2 * x)


def test_an_eager_shard_map_is_not_reused_where_its_text_misses_what_it_closes_over():
    """jax >= 0.12 lowers a large closed-over array as an argument of the program, and a
    host callback is named by a handle of this call's closure: the text holds neither, so
    such programs are not reused (stale values, the old callback)."""
    rules = lj.ShardingRules(make_mesh(1, 2))
    x = jnp.zeros((8, 1 << 15), jnp.float32)
    seen = []
    for v in (1.0, 2.0):
        c = jnp.full(x.shape, v)
        f = lj.sharding.shard_map(rules, lambda x, c=c: x + c, ((None, None),), (None, None))
        np.testing.assert_array_equal(np.asarray(f(x)), np.full(x.shape, v, np.float32))

        def body(x, v=v):
            jax.debug.callback(lambda: seen.append(v))
            return x + 1

        lj.sharding.shard_map(rules, body, ((None, "tensor"),), (None, "tensor"))(x[:, :16])
        jax.effects_barrier()
    assert seen == [1.0, 1.0, 2.0, 2.0]  # once a shard


@pytest.mark.parametrize(
    "tokens,want", [(512, "all"), pytest.param(200, None, marks=pytest.mark.slow)]
)
def test_dp_shards_keep_the_steps_flags(monkeypatch, tokens, want):
    """With tokens split over dp = 2, each shard rebuilds its mapping: it keeps the step's
    ``is_prefill``, ``tokens_per_slot`` (a hint; here 64 or 0: many tokens a slot) and
    ``single_slot``, and its ``prompt_tiles`` and ``whole_tiles`` where its share is whole
    128-token tiles (else None: not known); the output still matches the dense reference."""
    import lora_jax.layers.base as base_mod

    kind = KIND_BY_NAME["column"]
    layer, weights, adapters = build(kind, lj.ShardingRules(make_mesh(2, 2)), adapters=ADAPTERS)
    idx = np.repeat(np.array([1, 0, -1, 3], np.int32), tokens // 4)
    mapping = lj.make_lora_mapping(idx, MAX_LORAS, is_prefill=True, host_hints=True)  # host: "all"
    assert mapping.prompt_tiles == "all"
    seen = []
    real = base_mod.make_lora_mapping

    def spy(m, L, **kw):
        seen.append(kw)
        return real(m, L, **kw)

    monkeypatch.setattr(base_mod, "make_lora_mapping", spy)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(tokens, IN)), jnp.float32)

    @nnx.jit
    def f(layer, x, m):
        with lj.lora_mapping(layer, m):
            return layer(x)

    y = f(layer, x, mapping)
    per_slot = 64 if tokens // 4 >= 64 else 0  # the step's 3 mapped slots' tokens each
    assert seen == [
        dict(
            is_prefill=True,
            prompt_tiles=want,
            tokens_per_slot=per_slot,
            whole_tiles=want,
            single_slot=None,  # not said
        )
    ]
    ref = dense_reference(layer, weights, adapters, x, idx)
    rtol, atol = TOL[jnp.float32]
    np.testing.assert_allclose(logical_output(layer, y), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("mesh", ["tp1", "tp8"])
def test_shared_input_barrier_changes_nothing_but_the_graph(monkeypatch, mesh):
    """`SHARE_LAYER_INPUT` puts one optimization barrier on the layer's input (so XLA
    writes it once for the base matmul and the shrink); the values are those of the layer
    without it, and of the dense oracle."""
    from lora_jax.layers import base as lora_base

    kind = next(k for k in KINDS if k.name == "merged_qkv")
    layer, weights, adapters = build(
        kind, lj.ShardingRules(make_mesh(*MESHES[mesh])), jnp.float32, adapters=ADAPTERS
    )
    x = _inputs(layer, jnp.float32)
    idx = jnp.asarray(IDX)

    graph, state = nnx.split(layer)
    got = {}
    for shared in (True, False):
        monkeypatch.setattr(lora_base, "SHARE_LAYER_INPUT", shared)

        def run(x, state):  # a new function each time: make_jaxpr caches its trace by it
            m = nnx.merge(graph, state)
            lj.set_lora_mapping(m, idx)
            return m(x)

        text = str(jax.make_jaxpr(run)(x, state))
        assert ("optimization_barrier" in text) == shared
        got[shared] = np.asarray(forward(layer, x, idx))
    np.testing.assert_array_equal(got[True], got[False])
    want = dense_reference(layer, weights, adapters, x, IDX)
    np.testing.assert_allclose(logical_output(layer, got[True]), want, *TOL[jnp.float32])


def test_s_lora_follows_a_renamed_tensor_axis_and_refuses_what_cannot_split():
    """A rules table that moves "tensor" to another mesh axis moves S-LoRA's rank shards
    with it (A was stored whole while the forward gathered over the tensor axis: a 4 x
    rank and a crash); a table sharding the rank elsewhere, and an S-LoRA row layer whose
    out dim the tensor axis does not divide, are refused by name."""
    from lora_jax.sharding import DEFAULT_RULES

    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    moved = {**DEFAULT_RULES, "batch": "data", "tensor": "model", "vocab": "model"}
    rules = lj.ShardingRules(mesh, moved)
    assert rules.mesh_axis("lora_rank_sharded") == "model"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 32)).astype(np.float32)
    a, b = rng.normal(size=(8, 32)), rng.normal(size=(64, 8))
    w = rng.normal(size=(32, 64)).astype(np.float32)
    slots = np.where(np.arange(16) % 2 == 0, 0, -1).astype(np.int32)
    want = x @ w + (x @ a.T @ b.T) * (slots >= 0)[:, None]
    base = lj.ColumnParallelLinear(32, 64, rules=rules, rngs=nnx.Rngs(0))
    base.load_kernel([w])
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, fully_sharded_loras=True)
    layer = lj.ColumnParallelLinearWithShardedLoRA(base, cfg, lj.LoRAContext(None))
    layer.set_lora(0, a, b)
    assert layer.lora_a[0][...].sharding.spec[1] == "model"

    @nnx.jit
    def f(layer, x, idx):
        with lj.lora_mapping(layer, idx):
            return layer(x)

    got = np.asarray(f(layer, jnp.asarray(x), jnp.asarray(slots)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

    elsewhere = lj.ShardingRules(mesh, {**moved, "lora_rank_sharded": "data"})
    base = lj.ColumnParallelLinear(32, 64, rules=elsewhere, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rank over mesh axis 'data'.*tensor axis is 'model'"):
        lj.ColumnParallelLinearWithShardedLoRA(base, cfg)
    row = lj.RowParallelLinear(64, 34, rules=rules, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"RowParallelLinearWithShardedLoRA: .*out dim \(34\)"):
        lj.RowParallelLinearWithShardedLoRA(row, cfg)
    lj.RowParallelLinearWithLoRA(row, dataclasses.replace(cfg, fully_sharded_loras=False))


def test_a_bool_or_array_slot_index_is_refused_and_changes_no_slot():
    """`True` passed the int check: the stacks were written at slot 1 and, as a numpy
    mask, every slot's recorded rank was overwritten (other slots' outputs changed)."""
    layer, weights, adapters = build(KINDS[0], lj.ShardingRules(), adapters=ADAPTERS)
    ranks = np.asarray(layer.slot_ranks[...]).copy()
    stacks = [np.asarray(v[...]) for v in layer.lora_a]
    a = [np.ones((2, IN)) for _ in range(layer.n_slices)]
    b = [np.ones((n, 2)) for n in layer.logical_slice_sizes]
    for bad in (True, np.bool_(True), jnp.int32(1), np.array(1), 1.0):
        with pytest.raises(ValueError, match="index must be an int"):
            layer.set_lora(bad, a, b)
        with pytest.raises(ValueError, match="index must be an int"):
            layer.reset_lora(bad)
    np.testing.assert_array_equal(np.asarray(layer.slot_ranks[...]), ranks)
    for v, old in zip(layer.lora_a, stacks):
        np.testing.assert_array_equal(np.asarray(v[...]), old)
    layer.set_lora(np.int64(1), a, b)  # numpy integers are ints


def test_set_lora_refuses_complex_or_traced_adapters_and_takes_vllms_model_config():
    layer, _, _ = build(KINDS[0], lj.ShardingRules(), adapters=ADAPTERS)
    ranks = np.asarray(layer.slot_ranks[...]).copy()
    a = [np.ones((2, IN)) for _ in range(layer.n_slices)]
    b = [np.ones((n, 2)) for n in layer.logical_slice_sizes]
    with pytest.raises(ValueError, match="lora_a must be real numbers, got dtype complex128"):
        layer.set_lora(2, [x + 1j for x in a], b)  # was cast to its real part

    @jax.jit
    def inside(a0):
        layer.set_lora(2, [a0, *a[1:]], b)

    with pytest.raises(ValueError, match="lora_a is traced: set_lora checks and pads on the host"):
        inside(jnp.asarray(a[0]))
    np.testing.assert_array_equal(np.asarray(layer.slot_ranks[...]), ranks)
    kind = type(layer)
    assert kind.can_replace_layer(layer.base_layer, layer.lora_config, [], model_config=None)


def test_variable_slice_layer_is_chosen_by_its_sizes_without_packed_names():
    """vLLM picks its variable-slice class for a 3+ slice merged layer with no packed
    names given (it returned False here)."""
    from lora_jax.linear import MergedColumnParallelLinear

    base = MergedColumnParallelLinear(16, [8, 8, 16], rngs=nnx.Rngs(0))
    cfg = lj.LoRAConfig(max_lora_rank=8)
    cls = lj.MergedColumnParallelLinearVariableSliceWithLoRA
    assert cls.can_replace_layer(base, cfg, [])
    assert not lj.MergedColumnParallelLinearWithLoRA.can_replace_layer(base, cfg, [])


def test_adapter_axes_a_layer_cannot_run_are_refused_by_name():
    """A rules table mapping the slot or the plain rank axis to a mesh axis stored the
    stacks split with nothing to sum or gather them (5.6 off the unsharded run); a table
    without `lora_rank_sharded` still builds plain LoRA."""
    from lora_jax.sharding import DEFAULT_RULES

    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    base_rules = {**DEFAULT_RULES, "batch": "data", "tensor": "model", "vocab": "model"}
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    for key in ("lora_rank", "lora_slot"):
        rules = lj.ShardingRules(mesh, {**base_rules, key: "data"})
        base = lj.ColumnParallelLinear(32, 64, rules=rules, rngs=nnx.Rngs(0))
        with pytest.raises(
            ValueError, match=f"ColumnParallelLinearWithLoRA: the rules map '{key}'"
        ):
            lj.ColumnParallelLinearWithLoRA(base, cfg)
    partial = {k: v for k, v in base_rules.items() if k != "lora_rank_sharded"}
    base = lj.ColumnParallelLinear(32, 64, rules=lj.ShardingRules(mesh, partial), rngs=nnx.Rngs(0))
    lj.ColumnParallelLinearWithLoRA(base, cfg)


def test_one_a_with_b_per_slice_and_reset_lora_inside_jit():
    """A merged layer takes one A shared by its slices with a B per slice (vLLM converts
    them independently; it was refused); `reset_lora` under jit names the problem (it was
    a raw tracer error)."""
    from lora_jax.linear import MergedColumnParallelLinear

    base = MergedColumnParallelLinear(16, [8, 8, 16], rngs=nnx.Rngs(0))
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    layer = lj.MergedColumnParallelLinearVariableSliceWithLoRA(base, cfg)
    rng = np.random.default_rng(0)
    a = rng.normal(size=(4, 16))
    bs = [rng.normal(size=(n, 4)) for n in (8, 8, 16)]
    layer.set_lora(1, a, bs)
    shared = lj.MergedColumnParallelLinearVariableSliceWithLoRA(base, cfg)
    shared.set_lora(1, [a, a, a], bs)
    for v, w in zip((*layer.lora_a, *layer.lora_b), (*shared.lora_a, *shared.lora_b)):
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(w[...]))

    @nnx.jit
    def reset(layer):
        layer.reset_lora(1)

    with pytest.raises(ValueError, match="reset_lora: the layer is traced"):
        reset(layer)
    assert np.asarray(layer.slot_ranks[...])[:, 1].tolist() == [4, 4, 4]


def test_plain_lora_runs_on_a_rules_table_without_rank_sharded():
    """A rules table without `lora_rank_sharded` built plain column LoRA that crashed on
    its first forward ("unknown logical axis"); it runs and equals the numpy oracle."""
    from lora_jax.sharding import DEFAULT_RULES

    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    table = {**DEFAULT_RULES, "batch": "data", "tensor": "model", "vocab": "model"}
    del table["lora_rank_sharded"]
    rules = lj.ShardingRules(mesh, table)
    rng = np.random.default_rng(0)
    base = lj.ColumnParallelLinear(32, 64, rules=rules, rngs=nnx.Rngs(0))
    layer = lj.ColumnParallelLinearWithLoRA(base, lj.LoRAConfig(max_loras=2, max_lora_rank=8))
    a, b = rng.normal(size=(4, 32)), rng.normal(size=(64, 4))
    layer.set_lora(1, a, b)
    x = rng.normal(size=(8, 32)).astype(np.float32)
    idx = np.array([1, -1, 0, 1, 1, -1, 0, 1], np.int32)
    with lj.lora_mapping(layer, jnp.asarray(idx)):
        y = np.asarray(layer(jnp.asarray(x)))
    kernel = np.asarray(base.kernel[...])
    want = x @ kernel + np.where((idx == 1)[:, None], x @ a.T @ b.T, 0.0)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_bf16_adapters_are_taken_as_their_f32_values():
    """ml_dtypes' bfloat16 has numpy kind 'V': `set_lora` refused it as "not real
    numbers"; it stores what the same values in f32 store."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(4, 16)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=(32, 4)), jnp.bfloat16)
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    layers = []
    for a_, b_ in ((a, b), (np.asarray(a, np.float32), np.asarray(b, np.float32))):
        base = lj.ReplicatedLinear(16, 32, rngs=nnx.Rngs(0))
        layer = lj.ReplicatedLinearWithLoRA(base, cfg)
        layer.set_lora(1, a_, b_)
        layers.append(layer)
    for v, w in zip((*layers[0].lora_a, *layers[0].lora_b), (*layers[1].lora_a, *layers[1].lora_b)):
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(w[...]))


def _vocab_and_moe_layers():
    from lora_jax.moe import FusedMoE
    from lora_jax.vocab import ParallelLMHead, VocabParallelEmbedding

    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    emb = lj.VocabParallelEmbeddingWithLoRA(VocabParallelEmbedding(64, 16, rngs=nnx.Rngs(0)), cfg)
    head = ParallelLMHead(64, 16, rngs=nnx.Rngs(0))
    logits = lj.LogitsProcessorWithLoRA(lj.LogitsProcessor(64), head, cfg)
    moe = lj.FusedMoEWithLoRA(FusedMoE(4, 2, 16, 24, rngs=nnx.Rngs(0)), cfg)
    rng = np.random.default_rng(0)
    args = {
        "emb": (emb, rng.normal(size=(4, 64)), rng.normal(size=(16, 4))),
        "logits": (logits, rng.normal(size=(4, 16)), rng.normal(size=(64, 4))),
        "moe": (
            moe,
            # vLLM's order: w1, w2, w3; A [E, r, in], B [E, out, r]
            [rng.normal(size=(4, 4, 16)), rng.normal(size=(4, 4, 24)), rng.normal(size=(4, 4, 16))],
            [rng.normal(size=(4, 24, 4)), rng.normal(size=(4, 16, 4)), rng.normal(size=(4, 24, 4))],
        ),
    }
    return args


@pytest.mark.parametrize("kind", ["emb", "logits", "moe", "linear"])
def test_slot_writes_under_jit_and_complex_adapters_are_refused_by_name(kind):
    """MoE / embedding / lm_head slot writes under jit raised raw tracer errors, and their
    `set_lora` dropped a complex adapter's imaginary part; set_lora of host arrays under
    jit did on every layer. Each is refused by name and no slot changes."""
    if kind == "linear":
        base = lj.ReplicatedLinear(16, 32, rngs=nnx.Rngs(0))
        layer = lj.ReplicatedLinearWithLoRA(base, lj.LoRAConfig(max_loras=2, max_lora_rank=8))
        rng = np.random.default_rng(0)
        a, b = rng.normal(size=(4, 16)), rng.normal(size=(32, 4))
    else:
        layer, a, b = _vocab_and_moe_layers()[kind]
    layer.set_lora(1, a, b)
    before = jax.tree.map(np.asarray, nnx.state(layer, nnx.LoRAParam, lj.LoRASlotRanks))
    cplx = [v + 1j for v in a] if isinstance(a, list) else a + 1j
    with pytest.raises(ValueError, match="must be real numbers, got dtype complex128"):
        layer.set_lora(0, cplx, b)

    @nnx.jit
    def reset(layer):
        layer.reset_lora(1)

    @nnx.jit
    def write(layer):
        layer.set_lora(0, a, b)

    with pytest.raises(ValueError, match=r"reset_lora: the layer is traced"):
        reset(layer)
    with pytest.raises(ValueError, match=r"set_lora: the layer is traced"):
        write(layer)
    after = jax.tree.map(np.asarray, nnx.state(layer, nnx.LoRAParam, lj.LoRASlotRanks))
    jax.tree.map(np.testing.assert_array_equal, after, before)


def test_a_mapping_for_other_max_loras_is_refused_on_a_data_parallel_mesh():
    """On a dp mesh the layer rebuilds the mapping from its indices per shard: a mapping
    built for 4 slots gave slot 3's tokens the base output where one device refuses it."""
    mesh = jax.make_mesh((2, 1), ("dp", "tp"), devices=jax.devices()[:2])
    rules = lj.ShardingRules(mesh)
    base = lj.ColumnParallelLinear(16, 32, rules=rules, rngs=nnx.Rngs(0))
    layer = lj.ColumnParallelLinearWithLoRA(base, lj.LoRAConfig(max_loras=2, max_lora_rank=8))
    m = lj.make_lora_mapping(jnp.asarray([3, 3, 1, -1], jnp.int32), 4)
    layer.lora_context.set_value(m)
    with pytest.raises(ValueError, match="built for max_loras=4, the layer has 2 slots"):
        layer(jnp.ones((4, 16)))


def test_batch_and_tensor_on_one_axis_are_refused_by_the_linears():
    """x [T, in] split twice over one mesh axis crashed with a raw DuplicateSpecError."""
    from lora_jax.sharding import DEFAULT_RULES

    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    rules = lj.ShardingRules(mesh, {**DEFAULT_RULES, "batch": "x", "tensor": "x"})
    for cls in (lj.ColumnParallelLinear, lj.RowParallelLinear):
        with pytest.raises(ValueError, match="map 'batch' and 'tensor' to one mesh axis 'x'"):
            cls(16, 32, rules=rules, rngs=nnx.Rngs(0))
    lj.ReplicatedLinear(16, 32, rules=rules, rngs=nnx.Rngs(0))  # nothing split twice


def test_variable_slices_take_a_list_of_a_with_one_b():
    """vLLM converts A and B independently: a list of A with one B split by the output
    sizes was refused ("expected 3 slice(s)")."""
    from lora_jax.linear import MergedColumnParallelLinear

    base = MergedColumnParallelLinear(16, [8, 8, 16], rngs=nnx.Rngs(0))
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    rng = np.random.default_rng(0)
    a = [rng.normal(size=(4, 16)) for _ in range(3)]
    bs = [rng.normal(size=(n, 4)) for n in (8, 8, 16)]
    one_b = lj.MergedColumnParallelLinearVariableSliceWithLoRA(base, cfg)
    one_b.set_lora(1, a, np.concatenate(bs))
    per_slice = lj.MergedColumnParallelLinearVariableSliceWithLoRA(base, cfg)
    per_slice.set_lora(1, a, bs)
    for v, w in zip((*one_b.lora_a, *one_b.lora_b), (*per_slice.lora_a, *per_slice.lora_b)):
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(w[...]))
    with pytest.raises(ValueError, match="expected 3 slice"):
        one_b.set_lora(0, a[:2], np.concatenate(bs))


def test_row_s_lora_takes_a_rank_the_tensor_axis_does_not_divide():
    """The row S-LoRA splits A on its in dim and B on its out dim, never the rank, yet it
    refused max_lora_rank % tp != 0 (vLLM takes any rank there); the column S-LoRA, which
    splits A's rank rows, still refuses it by name."""
    mesh = jax.make_mesh((1, 3), ("dp", "tp"), devices=jax.devices()[:3])
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, fully_sharded_loras=True)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(12, 48)), jnp.float32)
    w = rng.normal(0, 0.2, size=(48, 24)).astype(np.float32)
    a, b = rng.normal(0, 0.3, size=(5, 48)), rng.normal(0, 0.3, size=(24, 5))  # rank 5 < 8
    slots = jnp.asarray(np.where(np.arange(12) % 3 == 0, -1, 1), jnp.int32)
    outs = []
    for rules in (lj.ShardingRules(), lj.ShardingRules(mesh)):
        base = lj.RowParallelLinear(48, 24, rules=rules, rngs=nnx.Rngs(0))
        base.load_kernel([w])
        layer = lj.RowParallelLinearWithShardedLoRA(base, cfg, lj.LoRAContext(None))
        layer.set_lora(1, a, b)
        outs.append(np.asarray(forward(layer, x, slots)))
    assert layer.lora_b[0][...].sharding.spec[1] == "tp"  # B's out dim split, rank 8 whole
    xn = np.asarray(x, np.float64)
    want = xn @ w + (xn @ a.T @ b.T) * (np.asarray(slots) >= 0)[:, None]
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-4)  # the adapter acts
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    column = lj.ColumnParallelLinear(48, 24, rules=lj.ShardingRules(mesh), rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"ColumnParallelLinearWithShardedLoRA: max_lora_rank=8 must be divisible by "
        r"the tensor axis \(3\)",
    ):
        lj.ColumnParallelLinearWithShardedLoRA(column, cfg)


@pytest.mark.parametrize("value", [("x", "y"), ("x",), ["x"], 1])
def test_a_rule_value_that_is_not_one_mesh_axis_is_refused_by_name(value):
    """A tuple of mesh axes (PartitionSpec's multi-axis form) was read as an axis name the
    mesh lacks, so "tensor" ran replicated (tp=1, full weights on every device) without a
    word; every rule value is one mesh axis name or None."""
    from lora_jax.sharding import DEFAULT_RULES

    mesh = jax.make_mesh((2, 2, 2), ("dp", "x", "y"), devices=jax.devices()[:8])
    with pytest.raises(
        ValueError,
        match=rf"logical axis 'tensor' maps to {re.escape(repr(value))}; .*one mesh axis "
        r"name \(a str\) or None",
    ):
        lj.ShardingRules(mesh, {**DEFAULT_RULES, "tensor": value})
    # one axis of the same mesh still shards the layers
    rules = lj.ShardingRules(mesh, {**DEFAULT_RULES, "tensor": "x", "vocab": "x"})
    assert rules.size("tensor") == 2
    base = lj.ColumnParallelLinear(16, 32, rules=rules, rngs=nnx.Rngs(0))
    assert base.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "x")


def test_a_slot_for_a_model_without_lora_layers_is_refused():
    """With wrap_model forgotten (or after unwrap_model) set_lora_mapping and lora_mapping
    did nothing: slot 0 was served by the base model, float indices passed unchecked."""
    from lora_jax.serving.wrap import unwrap_model, wrap_model

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.q_proj = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            return self.q_proj(x)

    model = Block(nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16)), jnp.float32)
    kernel, bias = (np.asarray(v, np.float64) for v in (model.q_proj.kernel, model.q_proj.bias))
    base = np.asarray(x, np.float64) @ kernel + bias
    no_lora = "adapter slots .* outside -1 \\(the model has no LoRA layers"
    for step in range(2):
        if step:  # a model wrapped and unwrapped again has no LoRA layers either
            wrap_model(model, lj.LoRAConfig(max_loras=2, max_lora_rank=8))
            unwrap_model(model)
        for idx in (jnp.array([0, -1], jnp.int32), np.array([-1, 3]), [1, 1]):
            with pytest.raises(ValueError, match=no_lora):
                lj.set_lora_mapping(model, idx)
            with pytest.raises(ValueError, match=no_lora):
                with lj.lora_mapping(model, idx):
                    pass
        with pytest.raises(ValueError, match=f"{no_lora}.*wrap_model"):
            lj.set_lora_mapping(model, lj.make_lora_mapping(jnp.array([0, -1]), 2))
        with pytest.raises(ValueError, match="slots \\[0\\] in seq_lora_indices"):
            lj.set_lora_mapping(model, jnp.array([-1, -1]), jnp.array([0]))
        with pytest.raises(ValueError, match="token_lora_indices must be integers, got float"):
            lj.set_lora_mapping(model, jnp.array([0.5, 7.0]))
        with pytest.raises(ValueError, match="token_lora_indices must be 1-D"):
            lj.set_lora_mapping(model, jnp.array([[-1, -1]]))
        # no adapter anywhere: nothing to set, the base output
        assert lj.set_lora_mapping(model, jnp.array([-1, -1], jnp.int32)) is None
        with lj.lora_mapping(model, np.array([-1, -1])):
            np.testing.assert_allclose(np.asarray(model(x)), base, rtol=1e-5, atol=1e-5)

    @nnx.jit
    def step(model, x, idx):
        with lj.lora_mapping(model, idx):
            return model(x)

    # traced indices cannot be read: only their dtype and shape are checked
    got = step(model, x, jnp.array([0, 0], jnp.int32))
    np.testing.assert_allclose(np.asarray(got), base, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="token_lora_indices must be integers, got float"):
        step(model, x, jnp.array([0.0, 0.0]))
