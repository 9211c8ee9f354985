"""LogitsProcessor / LogitsProcessorWithLoRA against a dense numpy oracle on 1..8 vocab shards."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax as lj
from lora_jax.config import MAX_LORA_VOCAB_SIZE
from lora_jax.vocab import ParallelLMHead, VocabParallelEmbedding

V, D, MAX_LORAS, MAX_RANK = 100, 16, 4, 8
RANKS = {0: 8, 1: 4, 3: 2}  # slot -> adapter rank; slot 2 stays empty
MESHES = [None, (1, 1, True), (1, 2, True), (1, 4, True), (1, 8, True), (2, 4, False)]
SOFT_CAP, SCALE = 2.0, 0.5  # a small cap so that "LoRA before cap" is visible


def make_rules(mesh_cfg):
    if mesh_cfg is None:
        return lj.ShardingRules()
    dp, tp, explicit = mesh_cfg
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh(
        (dp, tp), ("dp", "tp"), devices=jax.devices()[: dp * tp], axis_types=(kind, kind)
    )
    return lj.ShardingRules(mesh)


def make_adapters(seed=0, vocab=V):
    rng = np.random.default_rng(seed)
    return {
        s: (
            0.3 * rng.normal(size=(r, D)).astype(np.float32),
            0.3 * rng.normal(size=(vocab, r)).astype(np.float32),
        )
        for s, r in RANKS.items()
    }


def make_layer(rules, adapters=None, tied=False, dtype=jnp.float32, vocab=V, **lp_kw):
    cls = VocabParallelEmbedding if tied else ParallelLMHead
    head = cls(vocab, D, rules=rules, param_dtype=dtype, rngs=nnx.Rngs(0))
    w = 0.5 * np.random.default_rng(1).normal(size=(vocab, D)).astype(np.float32)
    head.load_table(w)
    lp_kw = {"soft_cap": SOFT_CAP, "scale": SCALE} | lp_kw
    cfg = lj.LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=MAX_RANK)
    layer = lj.LogitsProcessorWithLoRA(lj.LogitsProcessor(vocab, **lp_kw), head, cfg)
    for s, (a, b) in (adapters or {}).items():
        layer.set_lora(s, a, b)
    return layer, head, w


def dense(w, adapters, x, slots, soft_cap=SOFT_CAP, scale=SCALE):
    """logits = x W^T + (x A^T) B^T per row slot, then soft cap, then scale (vLLM's order)."""
    x = x.astype(np.float64)
    out = x @ w.T.astype(np.float64)
    for n, s in enumerate(slots):
        if s in adapters:
            a, b = adapters[s]
            out[n] += (x[n] @ a.T.astype(np.float64)) @ b.T.astype(np.float64)
    if soft_cap is not None:
        out = np.tanh(out / soft_cap) * soft_cap
    return out * scale


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(graphdef, head_def, state, head_state, x, token_slots, seq_slots, bias):
    layer, head = nnx.merge(graphdef, state), nnx.merge(head_def, head_state)
    lj.set_lora_mapping(layer, token_slots, seq_slots)
    return layer(head, x, bias)


def run(layer, head, x, token_slots, seq_slots=None, bias=None):
    """Logits under one jit (eager shard_maps retrace on every call)."""
    (g, s), (hg, hs) = nnx.split(layer), nnx.split(head)
    seq = None if seq_slots is None else jnp.asarray(seq_slots)
    bias = None if bias is None else jnp.asarray(bias)
    return np.asarray(_forward(g, hg, s, hs, jnp.asarray(x), jnp.asarray(token_slots), seq, bias))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _base_forward(graphdef, head_def, state, head_state, x):
    return nnx.merge(graphdef, state).base_layer(nnx.merge(head_def, head_state), x)


def run_base(layer, head, x):
    """The base processor's logits, jitted like `run` (fusion changes the last ulp)."""
    (g, s), (hg, hs) = nnx.split(layer), nnx.split(head)
    return np.asarray(_base_forward(g, hg, s, hs, jnp.asarray(x)))


def seq_case(B=10, T=23, seed=2):
    """Hidden states of B sequences (last tokens), their slots, and a per-token mapping."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, D)).astype(np.float32)
    seq = rng.choice([-1, 0, 1, 2, 3], size=B).astype(np.int32)
    seq[:5] = [-1, 0, 1, 2, 3]
    tok = rng.choice([0, 1, 2, 3], size=T).astype(np.int32)  # deliberately unrelated
    return x, seq, tok


def test_base_processor_matches_dense_and_tied_head():
    rules = make_rules((1, 4, True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, D)).astype(np.float32)
    for tied in (False, True):
        _, head, w = make_layer(rules, tied=tied)
        bias = rng.normal(size=(V,)).astype(np.float32)
        lp = lj.LogitsProcessor(V, soft_cap=SOFT_CAP, scale=SCALE)
        got = np.asarray(lp(head, jnp.asarray(x), jnp.asarray(bias)))
        assert got.shape == (2, 3, V)
        ref = dense(w, {}, x.reshape(6, D) + 0, [-1] * 6, soft_cap=None, scale=1.0) + bias
        ref = np.tanh(ref / SOFT_CAP) * SOFT_CAP * SCALE
        np.testing.assert_allclose(got.reshape(6, V), ref, rtol=1e-5, atol=1e-5)
    assert lj.LogitsProcessor(V, logits_as_input=True)(None, jnp.ones((2, 5))).shape == (2, 5)
    with pytest.raises(ValueError, match="soft_cap must be > 0"):
        lj.LogitsProcessor(V, soft_cap=0.0)


def test_non_finite_soft_cap_or_scale_is_refused():
    """An infinite soft cap (tanh(l / inf) * inf), a NaN / inf scale, or one past float32's
    range gave all-NaN (or all-inf) logits, and greedy decoding picked token 0 with no error.
    Any finite scale stays allowed, as in vLLM (0 and negative ones included)."""
    _, head, w = make_layer(lj.ShardingRules())
    x = np.random.default_rng(0).normal(size=(3, D)).astype(np.float32)
    for cap in (float("inf"), -float("inf"), float("nan"), 1e39, np.float64("inf"), 1e-45):
        with pytest.raises(ValueError, match="soft_cap must be > 0 and finite"):
            lj.LogitsProcessor(V, soft_cap=cap)
    for scale in (float("nan"), float("inf"), -float("inf"), 1e39, np.float32("nan"), None):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            lj.LogitsProcessor(V, scale=scale)
    for kw in (dict(soft_cap=1e30), dict(scale=0.0), dict(scale=-1.5), dict(soft_cap=3.0)):
        got = np.asarray(lj.LogitsProcessor(V, **kw)(head, jnp.asarray(x)))
        ref = dense(w, {}, x, [-1] * 3, **({"soft_cap": None, "scale": 1.0} | kw))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_cfg", MESHES, ids=str)
def test_per_sequence_lora_matches_dense(mesh_cfg):
    adapters = make_adapters()
    layer, head, w = make_layer(make_rules(mesh_cfg), adapters=adapters)
    assert head.num_embeddings_padded == 128 and layer.lora_b.shape == (MAX_LORAS, 128, MAX_RANK)
    x, seq, tok = seq_case()
    got = run(layer, head, x, tok, seq)
    assert got.shape == (len(seq), V)
    np.testing.assert_allclose(got, dense(w, adapters, x, seq), rtol=1e-5, atol=1e-5)
    # sequences with -1 or the empty slot get exactly the base processor's logits
    base = run_base(layer, head, x)
    plain = (seq == -1) | (seq == 2)
    np.testing.assert_array_equal(got[plain], base[plain])


REAL_VOCABS = [
    (32000, (1, 2, True)),
    (32003, (1, 8, True)),
    pytest.param(256000, (1, 4, True), marks=pytest.mark.slow),
    (258048, (2, 4, False)),
]


@pytest.mark.parametrize("vocab,mesh_cfg", REAL_VOCABS, ids=str)
def test_real_vocab_sizes_match_dense(vocab, mesh_cfg):
    """Per-sequence lm_head LoRA at real vocabulary sizes (one no shard count divides,
    the largest vLLM takes) on vocab-sharded meshes: every logit, the padding cut off."""
    adapters = make_adapters(seed=4, vocab=vocab)
    layer, head, w = make_layer(make_rules(mesh_cfg), adapters=adapters, vocab=vocab)
    assert head.num_embeddings_padded % 64 == 0 and head.num_embeddings_padded >= vocab
    x, seq, tok = seq_case(seed=5)
    got = run(layer, head, x, tok, seq)
    assert got.shape == (len(seq), vocab)
    np.testing.assert_allclose(got, dense(w, adapters, x, seq), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero", ["a", "b"])
def test_zero_a_or_b_gives_the_base_exactly(zero):
    """An lm_head adapter whose A (or B) is all zeros leaves its sequences' logits exactly
    the base processor's."""
    adapters = make_adapters(seed=6)
    a, b = adapters[1]
    adapters[1] = (np.zeros_like(a), b) if zero == "a" else (a, np.zeros_like(b))
    layer, head, w = make_layer(make_rules((1, 4, True)), adapters=adapters)
    x, seq, tok = seq_case(seed=7)
    got = run(layer, head, x, tok, seq)
    base = run_base(layer, head, x)
    np.testing.assert_array_equal(got[seq == 1], base[seq == 1])
    np.testing.assert_allclose(got, dense(w, adapters, x, seq), rtol=1e-5, atol=1e-5)


class _ShuffledHead(ParallelLMHead):
    """An lm_head whose stored rows are not in token order (as vLLM's heads with added
    vocabularies pad each shard): token t lives in row `order[t]` of the padded table,
    the rest of the rows are padding. It says so by `get_sharded_to_full_mapping`."""

    def load_shuffled(self, table, order):
        full = np.zeros((self.num_embeddings_padded, self.embedding_dim), np.float32)
        full[order[: self.num_embeddings]] = table
        self.order = order
        self.embedding.set_value(self.rules.place(jnp.asarray(full), "vocab", "embed"))

    def get_sharded_to_full_mapping(self):
        return self.order


@pytest.mark.parametrize("mesh_cfg", [None, (1, 4, True)], ids=str)
def test_a_head_with_its_own_row_order(mesh_cfg):
    """A head whose gathered columns are not in token order: the base logits and the
    LoRA's (B written in token order, as PEFT stores it) both land on the right tokens."""
    rules = make_rules(mesh_cfg)
    head = _ShuffledHead(V, D, rules=rules, rngs=nnx.Rngs(0))
    w = 0.5 * np.random.default_rng(1).normal(size=(V, D)).astype(np.float32)
    order = np.random.default_rng(2).permutation(head.num_embeddings_padded).astype(np.int32)
    head.load_shuffled(w, order)
    adapters = make_adapters(seed=8)
    cfg = lj.LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=MAX_RANK)
    lp = lj.LogitsProcessor(V, soft_cap=SOFT_CAP, scale=SCALE)
    layer = lj.LogitsProcessorWithLoRA(lp, head, cfg)
    for slot, (a, b) in adapters.items():
        layer.set_lora(slot, a, b)
    x, seq, tok = seq_case(seed=9)
    np.testing.assert_allclose(run_base(layer, head, x), dense(w, {}, x, seq), rtol=1e-5, atol=1e-5)
    got = run(layer, head, x, tok, seq)
    np.testing.assert_allclose(got, dense(w, adapters, x, seq), rtol=1e-5, atol=1e-5)
    for slot in range(MAX_LORAS):  # read back in token order, as PEFT stores B
        read = layer.read_lora(slot)
        assert (read is None) == (slot not in adapters)
        for got_ab, want_ab in zip(read or (), adapters.get(slot, ())):
            np.testing.assert_array_equal(got_ab, want_ab)
    head.order = np.zeros_like(order)  # every token on row 0: refused, naming the rule
    with pytest.raises(ValueError, match="get_sharded_to_full_mapping.*distinct integer rows"):
        lj.LogitsProcessorWithLoRA(lp, head, cfg)


def test_lora_joins_before_soft_cap_and_scale():
    adapters = make_adapters()
    layer, head, w = make_layer(make_rules(None), adapters=adapters)
    x, seq, tok = seq_case()
    got = run(layer, head, x, tok, seq)
    # applying the LoRA after the cap would differ by far more than the tolerance
    wrong = dense(w, {}, x, seq) + SCALE * (dense(w, adapters, x, seq, None, 1.0) - x @ w.T)
    assert np.abs(got - wrong).max() > 0.1
    np.testing.assert_allclose(got, dense(w, adapters, x, seq), rtol=1e-5, atol=1e-5)


def test_token_rows_fall_back_to_token_mapping():
    """Full-sequence logits (one row per token) use the per-token mapping."""
    adapters = make_adapters(seed=4)
    layer, head, w = make_layer(make_rules((1, 8, True)), adapters=adapters)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 4, D)).astype(np.float32)  # [B, S, D]
    tok = np.repeat(np.array([1, -1, 3], np.int32), 4)
    got = run(layer, head, x, tok, np.array([1, -1, 3], np.int32))
    assert got.shape == (3, 4, V)
    np.testing.assert_allclose(
        got.reshape(12, V), dense(w, adapters, x.reshape(12, D), tok), atol=1e-5
    )
    got = run(layer, head, x, tok)  # no per-sequence mapping at all
    np.testing.assert_allclose(
        got.reshape(12, V), dense(w, adapters, x.reshape(12, D), tok), atol=1e-5
    )
    lj.set_lora_mapping(layer, jnp.zeros(5, jnp.int32), jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="3 hidden-state rows match neither"):
        layer(head, jnp.ones((3, D)))


def test_tied_head_through_embedding_lora_and_bias():
    adapters = make_adapters(seed=6)
    layer, emb, w = make_layer(make_rules((1, 2, True)), adapters=adapters, tied=True)
    wrapped = lj.VocabParallelEmbeddingWithLoRA(emb, lj.LoRAConfig(max_loras=MAX_LORAS))
    x, seq, tok = seq_case()
    bias = np.linspace(-1, 1, V).astype(np.float32)
    got = run(layer, wrapped, x, tok, seq, bias)
    ref = dense(w, adapters, x, seq, None, 1.0) + bias
    np.testing.assert_allclose(got, np.tanh(ref / SOFT_CAP) * SOFT_CAP * SCALE, atol=1e-5)


def test_reset_slot_isolation_and_no_mapping():
    adapters = make_adapters()
    layer, head, w = make_layer(make_rules((1, 4, True)), adapters=adapters)
    x, seq, tok = seq_case()
    before = run(layer, head, x, tok, seq)
    a, b = make_adapters(seed=8)[0]
    layer.set_lora(3, a, b)  # rank 8 over a rank-2 slot
    after = run(layer, head, x, tok, seq)
    np.testing.assert_array_equal(after[seq != 3], before[seq != 3])
    np.testing.assert_allclose(after[seq == 3], dense(w, {3: (a, b)}, x, seq)[seq == 3], atol=1e-5)
    for s in range(MAX_LORAS):
        layer.reset_lora(s)
    base = run_base(layer, head, x)
    np.testing.assert_array_equal(run(layer, head, x, tok, seq), base)
    fresh, head2, _ = make_layer(make_rules((1, 4, True)), adapters=adapters)
    xj = jnp.asarray(x)  # no mapping set: exactly the base processor
    np.testing.assert_array_equal(
        np.asarray(fresh(head2, xj)), np.asarray(fresh.base_layer(head2, xj))
    )


def test_bf16_close_to_dense():
    adapters = make_adapters()
    layer, head, w = make_layer(make_rules((1, 4, True)), adapters=adapters, dtype=jnp.bfloat16)
    x, seq, tok = seq_case()
    got = run(layer, head, x.astype(jnp.bfloat16), tok, seq).astype(np.float32)
    np.testing.assert_allclose(got, dense(w, adapters, x, seq), rtol=3e-2, atol=5e-2)


def test_one_all_gather_and_no_lora_collective():
    layer, head, _ = make_layer(make_rules((1, 4, True)), adapters=make_adapters())
    (g, s), (hg, hs) = nnx.split(layer), nnx.split(head)
    x, seq, tok = seq_case()

    def with_lora(s, hs, x, tok, seq):
        lp = nnx.merge(g, s)
        lj.set_lora_mapping(lp, tok, seq)
        return lp(nnx.merge(hg, hs), x)

    def base_only(s, hs, x):
        return nnx.merge(g, s).base_layer(nnx.merge(hg, hs), x)

    hlo_lora = jax.jit(with_lora).lower(s, hs, x, tok, seq).compile().as_text()
    hlo_base = jax.jit(base_only).lower(s, hs, x).compile().as_text()

    def count(hlo, op):
        return sum(1 for ln in hlo.splitlines() if f" {op}(" in ln or f" {op}-start(" in ln)

    for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert count(hlo_lora, op) == count(hlo_base, op), op
    assert count(hlo_lora, "all-gather") == 1


# -- bad input ---------------------------------------------------------------------------


def _snapshot(layer):
    return [np.asarray(v[...]) for v in (layer.lora_a, layer.lora_b, layer.slot_ranks)]


@pytest.mark.parametrize(
    "index, a_shape, b_shape, match",
    [
        (4, (4, D), (V, 4), r"index 4 outside \[0, 4\)"),
        (np.int64(-2), (4, D), (V, 4), "index -2 outside"),
        (1.0, (4, D), (V, 4), "must be an int"),
        (0, (4, D + 1), (V, 4), r"lora_a must be \[rank, 16\]"),
        (0, (4, D), (128, 4), r"lora_b must be \[100, rank\]"),
        (0, (4, D), (V, 2), "lora_b has rank 2, lora_a has rank 4"),
        (0, (9, D), (V, 9), r"rank 9 is outside \[1, max_lora_rank=8\]"),
        (0, (0, D), (V, 0), r"rank 0 is outside"),
    ],
)
def test_bad_set_lora_changes_nothing(index, a_shape, b_shape, match):
    layer, _, _ = make_layer(make_rules((1, 2, True)), adapters=make_adapters())
    before = _snapshot(layer)
    with pytest.raises(ValueError, match=match):
        layer.set_lora(index, np.ones(a_shape), np.ones(b_shape))
    for x, y in zip(before, _snapshot(layer)):
        np.testing.assert_array_equal(x, y)


def test_vocab_size_bounds():
    cfg = lj.LoRAConfig(max_loras=1, max_lora_rank=1)
    rules = make_rules(None)
    big = ParallelLMHead(MAX_LORA_VOCAB_SIZE + 1, 2, rules=rules, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="vocab size must be <= 258048"):
        lj.LogitsProcessorWithLoRA(lj.LogitsProcessor(MAX_LORA_VOCAB_SIZE + 1), big, cfg)
    layer = lj.LogitsProcessorWithLoRA(lj.LogitsProcessor(MAX_LORA_VOCAB_SIZE), big, cfg)
    assert layer.lora_b.shape == (1, big.num_embeddings_padded, 1)
    small = ParallelLMHead(V, D, rules=rules, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="vocab size 101 exceeds the lm_head's 100 rows"):
        lj.LogitsProcessorWithLoRA(lj.LogitsProcessor(V + 1), small, cfg)
    with pytest.raises(ValueError, match="must be a LogitsProcessor"):
        lj.LogitsProcessorWithLoRA(small, small, cfg)
    with pytest.raises(ValueError, match="lm_head must be a ParallelLMHead"):
        lj.LogitsProcessorWithLoRA(lj.LogitsProcessor(V), object(), cfg)


def test_wrong_head_at_call():
    layer, _, _ = make_layer(make_rules(None), adapters=make_adapters())
    other = ParallelLMHead(V + 64, D, rules=make_rules(None), rngs=nnx.Rngs(0))
    lj.set_lora_mapping(layer, jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="built for 128x16"):
        layer(other, jnp.ones((2, D)))
    with pytest.raises(ValueError, match="hidden size 8 != lm_head embedding_dim 16"):
        layer(make_layer(make_rules(None))[1], jnp.ones((2, 8)))


# -- in a decoder model: wrap_model targets lm_head and embed_tokens ---------------------


def _decoder(rules, tied=False, vocab=120):
    from lora_jax.models import DecoderConfig, DecoderForCausalLM

    cfg = DecoderConfig.tiny(vocab_size=vocab, tie_word_embeddings=tied)
    return DecoderForCausalLM(cfg, rules=rules, rngs=nnx.Rngs(0))


def _table(emb) -> np.ndarray:
    return np.asarray(emb.embedding[...])[: emb.num_embeddings]


@functools.partial(jax.jit, static_argnums=0)
def _model_forward(graphdef, state, ids, slots):
    model = nnx.merge(graphdef, state)
    lj.set_lora_mapping(model, slots)
    S = ids.shape[1]
    return model(ids, jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), ids.shape))[0]


def _logits(model, ids, slots):
    graphdef, state = nnx.split(model)
    return np.asarray(_model_forward(graphdef, state, jnp.asarray(ids), jnp.asarray(slots)))


def test_decoder_lm_head_and_embedding_lora_match_merged_weights():
    """Per sequence, the wrapped model equals an unwrapped one whose embedding table and
    lm_head hold that sequence's adapter merged in (-1: the plain model)."""
    from lora_jax.serving.wrap import lora_layers, unwrap_model, wrap_model

    model = _decoder(make_rules((1, 4, True)))
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    wrap_model(model, cfg, target_modules=["lm_head", "embed_tokens"])
    layers = lora_layers(model)
    assert {k: type(v).__name__ for k, v in layers.items()} == {
        "lm_head": "ParallelLMHeadWithLoRA",
        "model.embed_tokens": "VocabParallelEmbeddingWithLoRA",
    }
    Vm, Dm = model.config.vocab_size, model.config.hidden_size
    rng = np.random.default_rng(0)
    adapters = {}
    for slot, r in ((0, 8), (1, 3)):
        emb_ab = (rng.normal(size=(r, Vm)), 0.05 * rng.normal(size=(Dm, r)))  # A [r, V], B [D, r]
        head_ab = (0.2 * rng.normal(size=(r, Dm)), 0.2 * rng.normal(size=(Vm, r)))
        layers["model.embed_tokens"].set_lora(slot, *emb_ab)
        layers["lm_head"].set_lora(slot, *head_ab)
        adapters[slot] = (emb_ab, head_ab)
    ids = np.random.default_rng(1).integers(0, Vm, size=(3, 6)).astype(np.int32)
    seq_slots = np.array([1, -1, 0], np.int32)
    got = _logits(model, ids, np.repeat(seq_slots, 6))
    ref = _decoder(lj.ShardingRules())  # same init as `model`
    emb0, head0 = _table(ref.model.embed_tokens), _table(ref.lm_head)
    for b, slot in enumerate(seq_slots):
        emb, head = emb0, head0
        if slot >= 0:
            (ea, eb), (ha, hb) = adapters[slot]
            emb, head = emb0 + (eb @ ea).T, head0 + hb @ ha
        ref.model.embed_tokens.load_table(emb)
        ref.lm_head.load_table(head)
        want = _logits(ref, ids[b : b + 1], np.full(6, -1, np.int32))[0]
        np.testing.assert_allclose(got[b], want, rtol=2e-4, atol=2e-4)
    assert unwrap_model(model) == 2
    assert isinstance(model.lm_head, ParallelLMHead) and lora_layers(model) == {}


def test_tied_decoder_wraps_and_unwraps_lm_head():
    from lora_jax.serving.wrap import lora_layers, unwrap_model, wrap_model

    model = _decoder(lj.ShardingRules(), tied=True)
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    base = _logits(model, ids, np.full(12, -1, np.int32))
    wrap_model(model, lj.LoRAConfig(max_loras=2, max_lora_rank=8))  # every supported module
    layers = lora_layers(model)
    assert type(layers["lm_head"]).__name__ == "TiedLMHeadWithLoRA"
    assert type(layers["model.embed_tokens"]).__name__ == "VocabParallelEmbeddingWithLoRA"
    # the tied head reads the one shared table
    assert layers["lm_head"].base_layer is layers["model.embed_tokens"].base_layer
    np.testing.assert_allclose(_logits(model, ids, np.zeros(12, np.int32)), base, atol=1e-6)
    a, b = np.ones((2, model.config.hidden_size)), np.ones((model.config.vocab_size, 2))
    layers["lm_head"].set_lora(1, 0.01 * a, b)
    got = _logits(model, ids, np.repeat([1, -1], 6).astype(np.int32))
    np.testing.assert_allclose(got[1], base[1], atol=1e-6)
    assert np.abs(got[0] - base[0]).min() > 1e-3  # every logit moved by 0.02 * sum(h)
    assert unwrap_model(model) == 2 + 4 * model.config.num_hidden_layers  # + qkv, o, gate_up, down
    assert model.lm_head is None and lora_layers(model) == {}
    np.testing.assert_allclose(_logits(model, ids, np.full(12, -1, np.int32)), base, atol=1e-6)


# -- HF transformers + peft oracle -------------------------------------------------------


def _hf_llama(tied: bool):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=120,  # padded to 128 here
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p)
            )
    return model


def _peft_adapters(hf, tmp_path):
    """Two adapters on lm_head + embed_tokens (+ q_proj), random A and B, saved as PEFT dirs."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    # Not "a": peft warns that a name inside its "lora_" prefix may be re-initialised.
    specs = {
        "first": peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=["lm_head", "embed_tokens", "q_proj"]
        ),
        "second": peft.LoraConfig(
            r=4, lora_alpha=8, use_rslora=True, target_modules=["lm_head", "embed_tokens"]
        ),
    }
    model = None
    for name, spec in specs.items():
        if model is None:
            model = peft.get_peft_model(hf, spec, adapter_name=name)
        else:
            model.add_adapter(name, spec)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(tmp_path / "adapters"), safe_serialization=True)
    return model.eval(), {n: str(tmp_path / "adapters" / n) for n in specs}


@functools.partial(jax.jit, static_argnums=0)
def _last_token_logits(graphdef, state, ids, token_slots, seq_slots):
    """Per-sequence logits of the last position: the sampler path (seq mapping)."""
    model = nnx.merge(graphdef, state)
    lj.set_lora_mapping(model, token_slots, seq_slots)
    B, S = ids.shape
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), ids.shape)
    hidden, _ = model.model(ids, pos)  # [B, S, D]
    return model.compute_logits(hidden[:, -1])


@pytest.mark.oracle
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_peft_lm_head_and_embedding_mixed_batch_match_hf(tmp_path, tied):
    torch = pytest.importorskip("torch")
    from lora_jax.models import load_hf_model
    from lora_jax.serving.manager import LoRAModelManager
    from lora_jax.serving.wrap import wrap_model

    hf = _hf_llama(tied)
    hf.save_pretrained(str(tmp_path / "base"), safe_serialization=True)
    peft_model, dirs = _peft_adapters(hf, tmp_path)
    B, S = 4, 7
    ids = np.random.default_rng(0).integers(0, 120, size=(B, S)).astype(np.int32)
    names = ["first", "__base__", "second", "first"]
    with torch.no_grad():
        ref = peft_model(input_ids=torch.tensor(ids, dtype=torch.long), adapter_names=names)
        ref = ref.logits.float().numpy()
        plain = peft_model(
            input_ids=torch.tensor(ids, dtype=torch.long), adapter_names=["__base__"] * B
        )
        plain = plain.logits.float().numpy()
    assert np.abs(ref[[0, 2, 3]] - plain[[0, 2, 3]]).max() > 0.1  # the adapters matter

    model = load_hf_model(str(tmp_path / "base"), rules=make_rules((1, 2, True)))
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    wrap_model(model, cfg, target_modules=["lm_head", "embed_tokens", "q_proj"])
    mgr = LoRAModelManager(model, cfg)
    mgr.load_adapters(dirs, activate=True, progress=False)  # ids 1 (first), 2 (second)
    requests = [1, None, 2, 1]
    tok = mgr.token_mapping(requests, tokens_per_request=S)
    got = _logits(model, ids, tok)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)
    graphdef, state = nnx.split(model)
    last = _last_token_logits(graphdef, state, jnp.asarray(ids), tok, mgr.token_mapping(requests))
    np.testing.assert_allclose(np.asarray(last), ref[:, -1], rtol=2e-4, atol=2e-4)


def test_tied_decoder_wrapped_in_two_calls():
    """lm_head first, embed_tokens later: the shared table is still found and wrapped."""
    from lora_jax.serving.wrap import lora_layers, unwrap_model, wrap_model

    model = _decoder(lj.ShardingRules(), tied=True)
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    wrap_model(model, cfg, target_modules=["lm_head"])
    wrap_model(model, cfg, target_modules=["embed_tokens"])
    layers = lora_layers(model)
    assert sorted(layers) == ["lm_head", "model.embed_tokens"]
    assert layers["lm_head"].base_layer is layers["model.embed_tokens"].base_layer
    wrap_model(model, cfg, target_modules=["lm_head", "embed_tokens"])  # nothing new
    assert len(lora_layers(model)) == 2
    assert unwrap_model(model) == 2 and model.lm_head is None


def test_an_org_vocab_narrower_than_the_head_gives_the_base_width():
    """`LogitsProcessor(V, org_vocab_size=V0 < V)` cuts the logits to V0 columns; its LoRA
    layer does too, so a -1 row equals the base and an adapter row the dense oracle's
    first V0 columns (the LoRA path gave V columns)."""
    V, V0 = 100, 90
    adapters = make_adapters(vocab=V)
    layer, head, w = make_layer(None, adapters=adapters, vocab=V, org_vocab_size=V0)
    x, seq, tok = seq_case()
    got = run(layer, head, x, tok, seq)
    base = run_base(layer, head, x)
    assert got.shape == base.shape == (x.shape[0], V0)
    np.testing.assert_array_equal(got[seq < 0], base[seq < 0])
    want = dense(w, adapters, x, seq)[:, :V0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_a_table_split_on_the_hidden_dim_gives_the_unsharded_logits(tie):
    """Rules mapping "embed" to a mesh axis split the vocab tables (and the embedding /
    lm_head LoRA stacks) on D, but the logits multiplied whole hidden states into the
    local D slice: a shape error in the base model's lm_head / tied `attend`."""
    from lora_jax.models import DecoderConfig, DecoderForCausalLM
    from lora_jax.serving.wrap import lora_layers, wrap_model
    from lora_jax.sharding import DEFAULT_RULES

    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[:4])
    rules = lj.ShardingRules(mesh, {**DEFAULT_RULES, "embed": "dp"})
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 4)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    slots = jnp.asarray([1, 1, 1, 1, -1, 1, -1, 1], jnp.int32)
    outs = []
    for r in (None, rules):
        model = DecoderForCausalLM(
            DecoderConfig.tiny(tie_word_embeddings=tie), rules=r, rngs=nnx.Rngs(0)
        )
        wrap_model(model, lj.LoRAConfig(max_loras=2, max_lora_rank=8))
        rng = np.random.default_rng(1)
        shapes = {"model.embed_tokens": ((4, 256), (64, 4)), "lm_head": ((4, 64), (256, 4))}
        for name, (a_shape, b_shape) in shapes.items():  # PEFT's A [r, in], B [out, r]
            layer = lora_layers(model).get(name)
            if layer is not None:  # tied: no lm_head LoRA layer of its own
                layer.set_lora(1, 0.1 * rng.normal(size=a_shape), 0.1 * rng.normal(size=b_shape))

        @nnx.jit
        def fwd(model):
            with lj.lora_mapping(model, slots):
                return model(ids, pos)[0]

        outs.append(np.asarray(fwd(model)))
    assert np.abs(outs[0][0] - outs[0][1]).max() > 1e-3  # the adapters act
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
