"""Trainable tokens (PEFT `trainable_token_indices`) in the vocab LoRA layers and the
loader, against numpy oracles; HF peft is the oracle in test_trainable_tokens_hf.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from layer_cases import make_mesh

import lora_jax as lj
from lora_jax.models import DecoderConfig, DecoderForCausalLM
from lora_jax.serving.merge import merge_adapter, unmerge_adapter
from lora_jax.serving.peft import PEFTConfig, adapter_from_tensors
from lora_jax.serving.training import init_lora_slot
from lora_jax.serving.wrap import lora_layers, wrap_model
from lora_jax.vocab import ParallelLMHead, VocabParallelEmbedding

V, D = 50, 16
CFG = lj.LoRAConfig(max_loras=3, max_lora_rank=8, max_lora_trainable_tokens=4)
IDS = np.array([3, 7, 3, 5, 7, 3, 1, 49], np.int32)
SLOTS = np.array([1, 1, 0, 1, -1, 2, 1, 2], np.int32)


def _rules(mesh):
    return lj.ShardingRules(make_mesh(*mesh)) if mesh else lj.ShardingRules()


@pytest.mark.parametrize("mesh", [None, (2, 4)], ids=["one_device", "dp2tp4"])
def test_rows_and_columns_are_each_slot_s_own(mesh):
    """Slot 1's ids 3 and 7 embed to its rows and its logits of 3 and 7 are the hidden
    state's dots with them (the embedding's `attend`, a tied lm_head), as slot 0's of 9;
    slot 2's lm_head rows replace columns 0 and 49; every other row, column and the -1
    token is the base's."""
    rng = np.random.default_rng(0)
    rules = _rules(mesh)
    emb = lj.VocabParallelEmbeddingWithLoRA(
        VocabParallelEmbedding(V, D, rules=rules, rngs=nnx.Rngs(0)), CFG
    )
    rows = rng.normal(size=(2, D)).astype(np.float32)
    emb.set_tokens(1, [3, 7], rows)
    emb.set_tokens(0, [9], rows[:1])  # no token 9 in the batch: slot 0 embeds the base rows
    lj.set_lora_mapping(emb, jnp.asarray(SLOTS))
    y = np.asarray(nnx.jit(lambda e, i: e(i))(emb, jnp.asarray(IDS)))
    table = np.asarray(emb.base_layer.embedding[...])[:V]
    want = table[IDS]
    want[0], want[1] = rows[0], rows[1]
    np.testing.assert_array_equal(y, want)

    x = rng.normal(size=(len(IDS), D)).astype(np.float32)
    logits = np.asarray(nnx.jit(lambda e, x: e.attend(x, gather=True))(emb, jnp.asarray(x)))
    want = x @ table.T
    for n in np.flatnonzero(SLOTS == 1):
        want[n, [3, 7]] = x[n] @ rows.T
    for n in np.flatnonzero(SLOTS == 0):  # slot 0's token 9: its logits column is its row's
        want[n, 9] = x[n] @ rows[0]
    np.testing.assert_allclose(logits[:, :V], want, rtol=1e-5, atol=1e-5)

    head = lj.ParallelLMHeadWithLoRA(ParallelLMHead(V, D, rules=rules, rngs=nnx.Rngs(1)), CFG)
    head.set_tokens(2, [0, 49], rows)
    lj.set_lora_mapping(head, jnp.asarray(SLOTS))
    got = np.asarray(nnx.jit(lambda m, x: m(x))(head, jnp.asarray(x)))
    want = x @ np.asarray(head.base_layer.embedding[...])[:V].T
    for n in np.flatnonzero(SLOTS == 2):
        want[n, [0, 49]] = x[n] @ rows.T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert head.read_tokens(2)[0] == (0, 49) and head.read_tokens(1) is None
    np.testing.assert_array_equal(head.read_tokens(2)[1], rows)


def test_bad_tokens_are_refused_naming_the_layer_and_change_nothing():
    emb = lj.VocabParallelEmbeddingWithLoRA(VocabParallelEmbedding(V, D, rngs=nnx.Rngs(0)), CFG)
    emb.set_tokens(1, [3], np.ones((1, D)))
    before = np.asarray(emb.token_rows[...]), np.asarray(emb.token_ids[...])
    cases = [
        ([1, 2, 3, 4, 5], np.ones((5, D)), "5 trainable tokens, more than LoRAConfig.max_lora"),
        ([3, V], np.ones((2, D)), rf"ids \[{V}\] are outside the vocabulary \[0, {V}\)"),
        ([3, 3], np.ones((2, D)), "repeat an id"),
        ([3, 4], np.ones((2, D + 1)), rf"rows must be \[2, {D}\]"),
        ([], np.ones((0, D)), "non-empty 1-D list of ints"),
        ([3], np.full((1, D), np.inf), "not finite"),
    ]
    for ids, rows, msg in cases:
        with pytest.raises(ValueError, match=msg):
            emb.set_tokens(2, ids, rows)
    with pytest.raises(ValueError, match=r"index 3 outside \[0, 3\)"):
        emb.set_tokens(3, [3], np.ones((1, D)))
    after = np.asarray(emb.token_rows[...]), np.asarray(emb.token_ids[...])
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    plain = lj.VocabParallelEmbeddingWithLoRA(
        VocabParallelEmbedding(V, D, rngs=nnx.Rngs(0)), lj.LoRAConfig(max_loras=2)
    )
    assert plain.token_ids is None  # nothing allocated by default
    with pytest.raises(ValueError, match="max_lora_trainable_tokens=0; set it to at least 2"):
        plain.set_tokens(0, [3, 4], np.ones((2, D)))


@pytest.mark.parametrize(
    "value,want",
    [
        ([4, 2], (("", (4, 2)),)),
        ({"lm_head": [1], "embed_tokens": [2, 3]}, (("embed_tokens", (2, 3)), ("lm_head", (1,)))),
        ([], None),
        (None, None),
    ],
)
def test_the_config_s_trainable_token_indices(value, want):
    cfg = PEFTConfig.from_dict({"r": 4, "lora_alpha": 8, "trainable_token_indices": value})
    assert cfg.trainable_token_indices == want


@pytest.mark.parametrize(
    "value", [[-1], [1, 1], [True], [1.5], ["1"], {"": [1]}, {"embed_tokens": []}, "1", 3]
)
def test_bad_trainable_token_indices_are_refused(value):
    with pytest.raises(ValueError, match="trainable_token_indices"):
        PEFTConfig.from_dict({"r": 4, "lora_alpha": 8, "trainable_token_indices": value})


def _tiny(targets=None, tied=True):
    model = DecoderForCausalLM(DecoderConfig.tiny(tie_word_embeddings=tied), rngs=nnx.Rngs(0))
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, max_lora_trainable_tokens=2)
    wrap_model(model, cfg, target_modules=targets)
    return model, cfg


def _tensors(rows, module="model.embed_tokens"):
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    rng = np.random.default_rng(1)
    return {
        f"{q}.lora_A.weight": rng.normal(size=(4, 64)).astype(np.float32),
        f"{q}.lora_B.weight": rng.normal(size=(64, 4)).astype(np.float32),
        f"base_model.model.{module}.token_adapter.trainable_tokens_delta": rows,
    }


def test_the_loader_checks_tokens_against_the_config_and_the_model():
    model, cfg = _tiny()
    rows = np.ones((2, 64), np.float32)
    spec = dict(r=4, lora_alpha=8, target_modules=("q_proj",))
    with_tokens = PEFTConfig(**spec, trainable_token_indices=(("", (5, 6)),))
    adapter = adapter_from_tensors(_tensors(rows), with_tokens, model, cfg)
    (tokens,) = adapter.trainable_tokens.values()
    assert tokens.module_name == "model.embed_tokens" and tokens.token_ids == (5, 6)
    cases = [  # (tensors, config, what the error says)
        (_tensors(rows), PEFTConfig(**spec), "has no trainable_token_indices"),
        (_tensors(rows[:1]), with_tokens, r"rows must be \[2, 64\]"),
        (
            {k: v for k, v in _tensors(rows).items() if "token_adapter" not in k},
            with_tokens,
            "names .'the input embedding'. but the file has no trainable-tokens tensor",
        ),
        (
            _tensors(rows, "lm_head"),
            PEFTConfig(**spec, trainable_token_indices=(("embed_tokens", (5, 6)),)),
            "names no ids for module 'lm_head'",
        ),
    ]
    cases.append(
        (
            _tensors(rows),
            PEFTConfig(
                **spec, trainable_token_indices=(("", (5, 6)),), alora_invocation_tokens=(1,)
            ),
            "activated LoRA .alora_invocation_tokens. with trainable tokens is not supported",
        )
    )
    for tensors, peft_cfg, msg in cases:
        with pytest.raises(ValueError, match=msg):
            adapter_from_tensors(tensors, peft_cfg, model, cfg)
    unwrapped, cfg = _tiny(targets=["q_proj"])
    with pytest.raises(ValueError, match="'model.embed_tokens' is not one; wrap it"):
        adapter_from_tensors(_tensors(rows), with_tokens, unwrapped, cfg)


@pytest.mark.no_compile_cache  # jax 0.10.2's cache write crashed its CI worker twice
def test_a_tied_model_s_logits_take_the_rows_with_or_without_lm_head_lora():
    """Tied: the embedding's rows give the logits of their ids, through the tied lm_head
    LoRA layer or, without one, through the embedding's `attend`; both agree, and the
    rows change those columns (and only those) for the slot's tokens."""
    rng = np.random.default_rng(2)
    rows = rng.normal(size=(2, 64)).astype(np.float32)
    ids = jnp.asarray(rng.integers(0, 256, (2, 5)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    out = {}
    for targets in (None, ["q_proj", "embed_tokens"]):
        model, _ = _tiny(targets)
        assert ("lm_head" in lora_layers(model)) == (targets is None)
        lora_layers(model)["model.embed_tokens"].set_tokens(1, [5, 200], rows)

        @nnx.jit
        def logits(model, slots):
            with lj.lora_mapping(model, slots):
                return model(ids, pos)[0]

        out[targets is None] = np.asarray(logits(model, jnp.repeat(jnp.array([1, -1]), 5)))
        base = np.asarray(logits(model, jnp.full((10,), -1)))
        np.testing.assert_array_equal(out[targets is None][1], base[1])
        moved = np.abs(out[targets is None][0] - base[0]).max(axis=0) > 1e-6
        assert moved[[5, 200]].all()
    np.testing.assert_allclose(out[True], out[False], rtol=1e-5, atol=1e-5)


def _state(model):
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.Variable))]


@pytest.mark.parametrize("mesh", [None, (2, 4)], ids=["one_device", "dp2tp4"])
def test_init_lora_slot_starts_trainable_tokens_at_the_base_rows_and_trains_them(mesh):
    """init_lora_slot's trainable_token_indices: the slot's rows are copies of the base
    table's (the embedding's and the untied lm_head's), so its logits are the base's; a
    stale token row of the slot is emptied; one SGD step moves the rows as on one
    device. Bad ids, a module it cannot name and too little room change nothing."""
    model = DecoderForCausalLM(
        DecoderConfig.tiny(tie_word_embeddings=False), rules=_rules(mesh), rngs=nnx.Rngs(0)
    )
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, max_lora_trainable_tokens=2)
    wrap_model(model, cfg)
    emb, head = (lora_layers(model)[n] for n in ("model.embed_tokens", "lm_head"))
    emb.set_tokens(1, [4], np.ones((1, 64), np.float32))  # stale: the fresh slot drops it
    init_lora_slot(model, 1, 4, target_modules=["q_proj"])
    assert emb.read_tokens(1) is None and head.read_tokens(1) is None
    spec = {"embed_tokens": [3, 7], "lm_head": [9]}
    init_lora_slot(model, 1, 4, target_modules=["q_proj"], trainable_token_indices=spec)
    for layer, ids in ((emb, (3, 7)), (head, (9,))):
        table = np.asarray(layer.base_layer.embedding[...], np.float32)
        got_ids, rows = layer.read_tokens(1)
        assert got_ids == ids
        np.testing.assert_array_equal(rows, table[list(ids)])
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 5)), jnp.int32)
    ids = ids.at[:, 1].set(3).at[:, 3].set(7)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))

    def loss(m, slots):
        with lj.lora_mapping(m, slots):
            return jnp.mean(m(ids, pos)[0][..., [3, 7, 9, 11]] ** 2)

    @nnx.jit
    def logits(m, slots):
        with lj.lora_mapping(m, slots):
            return m(ids, pos)[0]

    np.testing.assert_allclose(  # the fresh slot is the base model
        logits(model, jnp.full((10,), 1)), logits(model, jnp.full((10,), -1)), rtol=1e-6, atol=1e-6
    )
    grads = nnx.jit(
        lambda m: nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(m, jnp.full((10,), 1))
    )(model)
    moved = {n: np.asarray(g[...])[1] for n, g in nnx.to_flat_state(grads) if "token_rows" in n}
    assert len(moved) == 2 and all(np.abs(g).max() > 0 for g in moved.values())
    if mesh is not None:  # the same gradient as on one device
        one = DecoderForCausalLM(DecoderConfig.tiny(tie_word_embeddings=False), rngs=nnx.Rngs(0))
        wrap_model(one, cfg)
        init_lora_slot(one, 1, 4, target_modules=["q_proj"], trainable_token_indices=spec)
        g1 = nnx.jit(
            lambda m: nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(m, jnp.full((10,), 1))
        )(one)
        want = {n: np.asarray(g[...])[1] for n, g in nnx.to_flat_state(g1) if "token_rows" in n}
        for n in want:
            np.testing.assert_allclose(moved[n], want[n], rtol=1e-5, atol=1e-7)

    state = _state(model)
    for bad, msg in (
        ({"embed_tokens": [3, 7, 8]}, "more than LoRAConfig.max_lora_trainable_tokens=2"),
        ({"nope": [3]}, r"names 'nope', which is none of the model's vocab LoRA layers"),
        ([3, 256], r"trainable token ids \[256\] are outside the vocabulary"),
        ([3, 3], "repeats an id"),
    ):
        with pytest.raises(ValueError, match=msg):
            init_lora_slot(model, 0, 4, target_modules=["q_proj"], trainable_token_indices=bad)
    for a, b in zip(_state(model), state):
        np.testing.assert_array_equal(a, b)


def test_a_tied_lm_head_trains_the_embedding_s_rows():
    """Tied, the lm_head reads the embedding's rows: naming it with the embedding's ids
    is the same as not naming it; with other ids it is refused."""
    model, _ = _tiny()
    init_lora_slot(model, 1, 4, target_modules=["q_proj"],
                   trainable_token_indices={"embed_tokens": [3], "lm_head": [3]})  # fmt: skip
    assert lora_layers(model)["model.embed_tokens"].read_tokens(1)[0] == (3,)
    with pytest.raises(ValueError, match="tied to the embedding.*name the embedding"):
        init_lora_slot(model, 1, 4, target_modules=["q_proj"],
                       trainable_token_indices={"embed_tokens": [3], "lm_head": [5]})  # fmt: skip
    off = DecoderForCausalLM(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
    wrap_model(off, lj.LoRAConfig(max_loras=2, max_lora_rank=8))
    with pytest.raises(ValueError, match="max_lora_trainable_tokens=0; set it to at least 1"):
        init_lora_slot(off, 1, 4, target_modules=["q_proj"], trainable_token_indices=[3])


@pytest.mark.parametrize(
    "tied,mesh", [(False, None), (True, None), (False, (2, 4)), (True, (2, 4))],
    ids=["untied", "tied", "untied_dp2tp4", "tied_dp2tp4"],
)  # fmt: skip
def test_merge_adapter_puts_the_token_rows_in_the_tables(tied, mesh):
    """merge_adapter of a slot with trainable tokens (and LoRA on q_proj) gives, with no
    mapping, the logits the slot serves: its rows replace their ids' rows of the
    embedding table (and of the untied lm_head's; tied, the one table serves both);
    unmerge_adapter puts the tables back bit for bit."""
    model = DecoderForCausalLM(
        DecoderConfig.tiny(tie_word_embeddings=tied), rules=_rules(mesh), rngs=nnx.Rngs(0)
    )
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, max_lora_trainable_tokens=2)
    wrap_model(model, cfg, target_modules=["q_proj", "embed_tokens"] + ["lm_head"] * (not tied))
    spec = [3, 7] if tied else {"embed_tokens": [3, 7], "lm_head": [9, 3]}
    init_lora_slot(model, 1, 4, target_modules=["q_proj"], trainable_token_indices=spec)
    rng = np.random.default_rng(4)
    for name, layer in lora_layers(model).items():  # rows and q_proj's B away from the base
        if layer.read_tokens(1) if hasattr(layer, "read_tokens") else None:
            ids, _ = layer.read_tokens(1)
            layer.set_tokens(1, ids, rng.normal(size=(len(ids), 64)).astype(np.float32))
        if name.endswith("q_proj"):
            a = rng.normal(0, 0.3, (4, 64)).astype(np.float32)
            layer.set_lora(1, [a, None, None], [rng.normal(0, 0.3, (64, 4)), None, None])
    ids = jnp.asarray(rng.integers(0, 256, (2, 5)), jnp.int32).at[:, 1].set(3).at[:, 3].set(7)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))

    @nnx.jit
    def logits(m, slots):
        with lj.lora_mapping(m, slots):
            return m(ids, pos)[0]

    served = np.asarray(logits(model, jnp.full((10,), 1)))
    base = np.asarray(logits(model, jnp.full((10,), -1)))
    assert np.abs(served - base)[:, :, [3, 7]].max() > 1e-2  # the rows matter
    tables = [np.asarray(la.base_layer.embedding[...]) for la in _vocab(model)]
    merge_adapter(model, 1)
    merged = np.asarray(nnx.jit(lambda m: m(ids, pos)[0])(model))  # no mapping: base math
    np.testing.assert_allclose(merged, served, rtol=1e-5, atol=1e-5)
    unmerge_adapter(model)
    for la, t in zip(_vocab(model), tables):
        np.testing.assert_array_equal(np.asarray(la.base_layer.embedding[...]), t)


def _vocab(model):
    layers = lora_layers(model)
    return [layers[n] for n in ("model.embed_tokens", "lm_head") if n in layers]


def test_reset_lora_drops_a_slot_s_trainable_tokens():
    """reset_lora gives the base output: the embedding's and an untied head's token rows
    go with it; a tied head's reset leaves the embedding's rows (its own reset drops them)."""
    rows = np.ones((1, 64), np.float32)
    untied, _ = _tiny(tied=False)
    tied, _ = _tiny()
    for model in (untied, tied):
        emb, head = (lora_layers(model)[n] for n in ("model.embed_tokens", "lm_head"))
        emb.set_tokens(1, [4], rows)
        emb.set_tokens(0, [5], rows)
        if not head.tied:
            head.set_tokens(1, [6], rows)
        head.reset_lora(1)
        assert head.read_tokens(1) is None
        assert emb.read_tokens(1)[0] == (4,)
        emb.reset_lora(1)
        assert emb.read_tokens(1) is None and emb.read_tokens(0)[0] == (5,)


def test_a_plain_flax_embed_refuses_trainable_tokens():
    """A wrapped `nnx.Embed` runs its own lookup and `attend`, which the rows would not
    reach: its adapters with trainable tokens are refused by name, not served without them."""
    emb = lj.FlaxEmbedWithLoRA(nnx.Embed(V, D, rngs=nnx.Rngs(0)), CFG)
    assert emb.token_ids is None and emb.token_updates(None) == []
    with pytest.raises(ValueError, match="not on a plain flax.nnx.Embed"):
        emb.prepare_tokens(0, [3], np.ones((1, D)))


def test_dora_and_trainable_tokens_on_one_embedding_are_refused():
    """A DoRA adapter on the token embedding that also has trainable tokens there is
    refused by name, in the loader and in init_lora_slot (which then changes nothing)."""
    model = DecoderForCausalLM(DecoderConfig.tiny(tie_word_embeddings=False), rngs=nnx.Rngs(0))
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, max_lora_trainable_tokens=2, enable_dora=True)
    wrap_model(model, cfg, target_modules=["embed_tokens", "q_proj"])
    rng = np.random.default_rng(2)
    emb = "base_model.model.model.embed_tokens"
    tensors = {
        f"{emb}.lora_embedding_A": rng.normal(size=(4, 256)).astype(np.float32),
        f"{emb}.lora_embedding_B": rng.normal(size=(64, 4)).astype(np.float32),
        f"{emb}.lora_magnitude_vector": rng.uniform(0.5, 2, 64).astype(np.float32),
        f"{emb}.token_adapter.trainable_tokens_delta": np.ones((2, 64), np.float32),
    }
    spec = PEFTConfig(
        r=4, lora_alpha=8, target_modules=("embed_tokens",), use_dora=True,
        trainable_token_indices=(("", (5, 6)),),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"embed_tokens' has a DoRA adapter .* trainable tok"):
        adapter_from_tensors(tensors, spec, model, cfg)
    state = jax.tree.map(np.asarray, nnx.state(model, nnx.LoRAParam))
    with pytest.raises(ValueError, match=r"use_dora=True and trainable_token_indices both on"):
        init_lora_slot(
            model, 1, 4, target_modules=["embed_tokens"], use_dora=True,
            trainable_token_indices=[5, 6],
        )  # fmt: skip
    for got, want in zip(
        jax.tree.leaves(jax.tree.map(np.asarray, nnx.state(model, nnx.LoRAParam))),
        jax.tree.leaves(state),
    ):
        np.testing.assert_array_equal(got, want)
    # either alone is taken
    init_lora_slot(model, 1, 4, target_modules=["embed_tokens"], use_dora=True)
    assert lora_layers(model)["model.embed_tokens"].dora_norm[...][1].min() > 0
