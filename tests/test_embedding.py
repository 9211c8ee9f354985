"""VocabParallelEmbeddingWithLoRA against a dense numpy oracle, on 1..8 vocab shards."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax as lj
from lora_jax.vocab import ParallelLMHead, VocabParallelEmbedding

V, D, MAX_LORAS, MAX_RANK = 100, 16, 4, 8
# slot -> rank of the adapter written there; slot 2 stays empty
RANKS = {0: 8, 1: 4, 3: 2}
# (dp, tp, explicit) ; None = no mesh
MESHES = [None, (1, 1, True), (1, 2, True), (1, 4, True), (1, 8, True), (2, 4, False)]


def make_rules(mesh_cfg):
    if mesh_cfg is None:
        return lj.ShardingRules()
    dp, tp, explicit = mesh_cfg
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh(
        (dp, tp), ("dp", "tp"), devices=jax.devices()[: dp * tp], axis_types=(kind, kind)
    )
    return lj.ShardingRules(mesh)


def make_adapters(seed=0, vocab=V, dim=D):
    rng = np.random.default_rng(seed)
    return {
        s: (
            rng.normal(size=(r, vocab)).astype(np.float32),
            0.3 * rng.normal(size=(dim, r)).astype(np.float32),
        )
        for s, r in RANKS.items()
    }


def make_layer(rules, dtype=jnp.float32, adapters=None, vocab=V):
    base = VocabParallelEmbedding(vocab, D, rules=rules, param_dtype=dtype, rngs=nnx.Rngs(0))
    table = np.random.default_rng(1).normal(size=(vocab, D)).astype(np.float32)
    base.load_table(table)
    layer = lj.VocabParallelEmbeddingWithLoRA(
        base, lj.LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=MAX_RANK)
    )
    for s, (a, b) in (adapters or {}).items():
        layer.set_lora(s, a, b)
    return layer, table


def dense(table, adapters, ids, slots):
    """y[t] = table[id] + B_s @ A_s[:, id] for slots with an adapter."""
    out = table[ids].astype(np.float64)
    for t, (i, s) in enumerate(zip(ids, slots)):
        if s in adapters:
            a, b = adapters[s]
            out[t] += b.astype(np.float64) @ a[:, i].astype(np.float64)
    return out


def token_case(T=24, seed=2, vocab=V):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=T).astype(np.int32)
    ids[:3] = [0, vocab - 1, 63]  # both ends and a shard boundary
    slots = rng.choice([-1, 0, 1, 2, 3], size=T).astype(np.int32)
    slots[:5] = [-1, 0, 1, 2, 3]
    return ids, slots


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids, slots):
    layer = nnx.merge(graphdef, state)
    lj.set_lora_mapping(layer, slots)
    return layer(ids)


def run(layer, ids, slots):
    """The layer's output under one jit (eager shard_maps retrace on every call)."""
    graphdef, state = nnx.split(layer)
    return np.asarray(_forward(graphdef, state, jnp.asarray(ids), jnp.asarray(slots)))


@pytest.mark.parametrize("mesh_cfg", MESHES, ids=str)
def test_matches_dense(mesh_cfg):
    adapters = make_adapters()
    layer, table = make_layer(make_rules(mesh_cfg), adapters=adapters)
    assert layer.base_layer.num_embeddings_padded == 128  # V=100 padded
    ids, slots = token_case()
    got = run(layer, ids, slots)
    np.testing.assert_allclose(got, dense(table, adapters, ids, slots), rtol=1e-5, atol=1e-5)
    # -1 tokens and the empty slot 2 give exactly the base embedding
    base = np.asarray(layer.base_layer(jnp.asarray(ids)))
    plain = (slots == -1) | (slots == 2)
    np.testing.assert_array_equal(got[plain], base[plain])


# vLLM's vocabulary sizes: Llama-2's 32000, one that no shard count divides, Gemma's
# 256000 and the largest it takes (258048), padded to 64 x the vocab shards.
REAL_VOCABS = [
    (32000, (1, 2, True)),
    (32003, (1, 8, True)),
    pytest.param(256000, (1, 4, True), marks=pytest.mark.slow),
    (258048, (2, 4, False)),
]


@pytest.mark.parametrize("vocab,mesh_cfg", REAL_VOCABS, ids=str)
def test_real_vocab_sizes_match_dense(vocab, mesh_cfg):
    """The LoRA lookup at real vocabulary sizes: ids at both ends, on every vocab shard's
    edges, and in the padding's last shard, against the oracle."""
    adapters = make_adapters(seed=3, vocab=vocab)
    layer, table = make_layer(make_rules(mesh_cfg), adapters=adapters, vocab=vocab)
    padded = layer.base_layer.num_embeddings_padded
    assert padded >= vocab and padded % 64 == 0
    ids, slots = token_case(T=40, seed=4, vocab=vocab)
    shards = mesh_cfg[1]
    edges = [k * padded // shards + d for k in range(1, shards) for d in (-1, 0)]
    edges = [e for e in edges if e < vocab][: len(ids) - 3]
    ids[3 : 3 + len(edges)] = edges
    got = run(layer, ids, slots)
    np.testing.assert_allclose(got, dense(table, adapters, ids, slots), rtol=1e-5, atol=1e-5)
    for slot in range(MAX_LORAS):  # read back as set, without the vocab padding
        read = layer.read_lora(slot)
        assert (read is None) == (slot not in adapters)
        for got_ab, want_ab in zip(read or (), adapters.get(slot, ())):
            np.testing.assert_array_equal(got_ab, want_ab)


@pytest.mark.parametrize("zero", ["a", "b"])
def test_zero_a_or_b_gives_the_base_exactly(zero):
    """An adapter whose A (or B) is all zeros adds nothing: the base embedding, bit for bit
    (vLLM's embedding test writes such adapters too)."""
    adapters = make_adapters(seed=6)
    a, b = adapters[1]
    adapters[1] = (np.zeros_like(a), b) if zero == "a" else (a, np.zeros_like(b))
    layer, table = make_layer(make_rules((1, 4, True)), adapters=adapters)
    ids, slots = token_case(seed=8)
    got = run(layer, ids, slots)
    base = run(make_layer(make_rules((1, 4, True)))[0], ids, np.full_like(slots, -1))
    np.testing.assert_array_equal(got[slots == 1], base[slots == 1])
    np.testing.assert_allclose(got, dense(table, adapters, ids, slots), rtol=1e-5, atol=1e-5)


def test_sharded_equals_unsharded_2d_ids():
    adapters = make_adapters(seed=5)
    ids, slots = token_case(T=32, seed=7)
    ref = run(make_layer(make_rules(None), adapters=adapters)[0], ids, slots)
    layer, _ = make_layer(make_rules((1, 8, True)), adapters=adapters)
    got = run(layer, ids.reshape(4, 8), slots)
    assert got.shape == (4, 8, D)
    np.testing.assert_allclose(got.reshape(32, D), ref, rtol=1e-6, atol=1e-6)


def test_reset_and_slot_isolation():
    adapters = make_adapters()
    layer, table = make_layer(make_rules((1, 4, True)), adapters=adapters)
    ids, slots = token_case()
    before = run(layer, ids, slots)
    # rewriting slot 1 leaves every other slot's tokens unchanged
    a, b = make_adapters(seed=9)[3]
    layer.set_lora(1, a, b)
    after = run(layer, ids, slots)
    np.testing.assert_array_equal(after[slots != 1], before[slots != 1])
    np.testing.assert_allclose(
        after[slots == 1], dense(table, {1: (a, b)}, ids, slots)[slots == 1], atol=1e-5
    )
    for s in range(MAX_LORAS):
        layer.reset_lora(s)
    np.testing.assert_array_equal(
        run(layer, ids, slots), np.asarray(layer.base_layer(jnp.asarray(ids)))
    )
    assert int(jnp.sum(layer.slot_ranks[...])) == 0


def test_no_mapping_is_base_and_tied_attend():
    layer, _ = make_layer(make_rules((1, 2, True)), adapters=make_adapters())
    ids = jnp.arange(10)
    np.testing.assert_array_equal(np.asarray(layer(ids)), np.asarray(layer.base_layer(ids)))
    x = jnp.ones((3, D))
    np.testing.assert_array_equal(
        np.asarray(layer.attend(x, gather=True)),
        np.asarray(layer.base_layer.attend(x, gather=True)),
    )


def test_bf16_close_to_dense():
    adapters = make_adapters()
    layer, table = make_layer(make_rules((1, 4, True)), dtype=jnp.bfloat16, adapters=adapters)
    assert layer.lora_a.dtype == jnp.bfloat16
    ids, slots = token_case()
    got = run(layer, ids, slots).astype(np.float32)
    np.testing.assert_allclose(got, dense(table, adapters, ids, slots), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16])
def test_an_f32_layer_over_a_narrow_table_adds_the_lora_in_f32(param_dtype):
    """A bf16 / f16 table computed in f32 with f32 adapters: the LoRA was added in the
    table's dtype, then cast (2e-3 off the oracle); it adds in f32, as the linears do."""
    adapters = make_adapters(seed=5)
    base = VocabParallelEmbedding(
        V, D, param_dtype=param_dtype, dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    table = np.random.default_rng(1).normal(size=(V, D)).astype(np.float32)
    base.load_table(table)
    cfg = lj.LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=MAX_RANK, lora_dtype=jnp.float32)
    layer = lj.VocabParallelEmbeddingWithLoRA(base, cfg)
    for s, (a, b) in adapters.items():
        layer.set_lora(s, a, b)
    ids, slots = token_case()
    got = run(layer, ids, slots)
    assert got.dtype == np.float32
    narrow = np.asarray(jnp.asarray(table).astype(param_dtype).astype(jnp.float32))
    want = dense(narrow, adapters, ids, slots)  # the table as stored, the LoRA in f32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_jit_one_compile_for_new_mappings_and_adapters():
    layer, table = make_layer(make_rules((1, 4, True)), adapters=make_adapters())
    graphdef, _ = nnx.split(layer)
    traces = []

    @jax.jit
    def step(state, ids, slots):
        traces.append(1)
        m = nnx.merge(graphdef, state)
        lj.set_lora_mapping(m, slots)
        return m(ids)

    ids, slots = token_case()
    adapters = make_adapters(seed=3)
    for k in range(2):
        for s, (a, b) in adapters.items():
            layer.set_lora(s, a, b)
        got = step(nnx.state(layer), jnp.asarray(ids), jnp.asarray(np.roll(slots, k)))
        np.testing.assert_allclose(
            np.asarray(got), dense(table, adapters, ids, np.roll(slots, k)), rtol=1e-5, atol=1e-5
        )
    assert len(traces) == 1


def _count(hlo: str, op: str) -> int:
    return sum(1 for line in hlo.splitlines() if f" {op}(" in line or f" {op}-start(" in line)


def test_lora_adds_no_collective():
    """The LoRA joins the base embedding's one all-reduce; A is never gathered."""
    layer, _ = make_layer(make_rules((1, 4, True)), adapters=make_adapters())
    graphdef, state = nnx.split(layer)
    ids, slots = token_case()

    def with_lora(state, ids, slots):
        m = nnx.merge(graphdef, state)
        lj.set_lora_mapping(m, slots)
        return m(ids)

    def base_only(state, ids):
        return nnx.merge(graphdef, state).base_layer(ids)

    hlo_lora = jax.jit(with_lora).lower(state, ids, slots).compile().as_text()
    hlo_base = jax.jit(base_only).lower(state, ids).compile().as_text()
    for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert _count(hlo_lora, op) == _count(hlo_base, op), op
    assert _count(hlo_lora, "all-reduce") == 1


# -- bad input ---------------------------------------------------------------------------


def _snapshot(layer):
    return [np.asarray(v[...]) for v in (layer.lora_a, layer.lora_b, layer.slot_ranks)]


@pytest.mark.parametrize(
    "index, a_shape, b_shape, match",
    [
        (4, (4, V), (D, 4), r"index 4 outside \[0, 4\)"),
        (-1, (4, V), (D, 4), r"index -1 outside"),
        (True, (4, V), (D, 4), "must be an int"),
        (0, (4, V + 1), (D, 4), r"lora_embedding_A\) must be \[rank, 100\]"),
        (0, (4, V), (D + 1, 4), r"lora_embedding_B\) must be \[16, rank\]"),
        (0, (4, V), (D, 3), "lora_b has rank 3, lora_a has rank 4"),
        (0, (16, V), (D, 16), r"rank 16 is outside \[1, max_lora_rank=8\]"),
        (0, (V,), (D, 4), "must be"),
    ],
)
def test_bad_set_lora_changes_nothing(index, a_shape, b_shape, match):
    layer, _ = make_layer(make_rules((1, 2, True)), adapters=make_adapters())
    before = _snapshot(layer)
    with pytest.raises(ValueError, match=match):
        layer.set_lora(index, np.ones(a_shape), np.ones(b_shape))
    for x, y in zip(before, _snapshot(layer)):
        np.testing.assert_array_equal(x, y)


def test_bad_construction_and_calls():
    rules = make_rules(None)
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    head = ParallelLMHead(V, D, rules=rules, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="not an lm_head"):
        lj.VocabParallelEmbeddingWithLoRA(head, cfg)
    assert not lj.VocabParallelEmbeddingWithLoRA.can_replace_layer(head, cfg)
    layer, _ = make_layer(rules)
    assert lj.VocabParallelEmbeddingWithLoRA.can_replace_layer(layer.base_layer, cfg)
    with pytest.raises(ValueError, match="reset_lora: index 9"):
        layer.reset_lora(9)
    lj.set_lora_mapping(layer, jnp.zeros(5, jnp.int32))
    with pytest.raises(ValueError, match="mapping has 5 tokens but the input has 6"):
        layer(jnp.arange(6))


def test_peft_embedding_tensors_load_and_bad_vocab_is_refused():
    """PEFT keys `lora_embedding_A [r, V]` / `lora_embedding_B [D, r]` reach the layer with
    the scaling folded into B; the saved base table (the model's) is not served; a wrong
    vocab is refused."""
    from lora_jax.models import DecoderConfig, DecoderForCausalLM
    from lora_jax.serving.peft import PEFTConfig, adapter_from_tensors
    from lora_jax.serving.wrap import lora_layers, wrap_model

    model = DecoderForCausalLM(DecoderConfig.tiny(vocab_size=V), rngs=nnx.Rngs(0))
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    wrap_model(model, cfg, target_modules=["embed_tokens"])
    layer = lora_layers(model)["model.embed_tokens"]
    Dm = model.config.hidden_size
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, V)).astype(np.float32), rng.normal(size=(Dm, 4)).astype(np.float32)
    key = "base_model.model.model.embed_tokens"
    tensors = {
        f"{key}.lora_embedding_A": a,
        f"{key}.lora_embedding_B": b,
        # save_embedding_layers: the base table, the model's own
        f"{key}.base_layer.weight": np.asarray(layer.base_layer.embedding[...])[:V],
    }
    peft_cfg = PEFTConfig(r=4, lora_alpha=8, target_modules=("embed_tokens",))
    adapter = adapter_from_tensors(tensors, peft_cfg, model, cfg, adapter_id=1)
    layer.set_lora(1, *adapter.get_lora("model.embed_tokens").set_lora_args())
    ids = np.arange(0, V, 9, dtype=np.int32)
    table = np.asarray(layer.base_layer.embedding[...])[:V]
    want = dense(table, {1: (a, 2.0 * b)}, ids, np.ones_like(ids))  # alpha / r = 2
    np.testing.assert_allclose(run(layer, ids, np.ones_like(ids)), want, rtol=1e-5, atol=1e-5)
    tensors[f"{key}.lora_embedding_A"] = rng.normal(size=(4, V + 1)).astype(np.float32)
    with pytest.raises(ValueError, match=r"lora_embedding_A\) must be \[rank, 100\]"):
        adapter_from_tensors(tensors, peft_cfg, model, cfg, adapter_id=2)


def test_embed_on_the_vocab_axis_is_refused_by_name_and_on_another_axis_runs():
    """Rules mapping "embed" to the mesh axis of "vocab" split the table `[V_pad, D]` twice
    over one axis: JAX's raw DuplicateSpecError naming no layer. "embed" on another axis
    still gives the unsharded embedding and tied logits."""
    from lora_jax.models import DecoderConfig, DecoderForCausalLM
    from lora_jax.sharding import DEFAULT_RULES

    mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices()[:8])
    clash = lj.ShardingRules(mesh, {**DEFAULT_RULES, "embed": "tp"})
    for cls in (VocabParallelEmbedding, ParallelLMHead):
        with pytest.raises(
            ValueError,
            match=rf"{cls.__name__}: the rules map 'vocab' and 'embed' to one mesh "
            "axis 'tp'",
        ):
            cls(V, D, rules=clash, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="map 'vocab' and 'embed' to one mesh axis 'tp'"):
        DecoderForCausalLM(DecoderConfig.tiny(), rules=clash, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, V, (3, 5)), jnp.int32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(6, D)), jnp.float32)
    outs = []
    for rules in (lj.ShardingRules(), lj.ShardingRules(mesh, {**DEFAULT_RULES, "embed": "dp"})):
        emb = VocabParallelEmbedding(V, D, rules=rules, rngs=nnx.Rngs(0))
        outs.append((np.asarray(emb(ids)), np.asarray(emb.attend(x, gather=True))))
    for got, want in zip(outs[1], outs[0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
