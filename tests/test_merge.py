"""`merge_adapter` on vocab embeddings and lm_heads, through a whole decoder.

The oracle is the LoRA path: the same model with every token on the slot, unmerged.
MoE experts are checked in `tests/test_moe.py`, linears in `tests/test_wrap.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax as lj
from lora_jax.models import DecoderConfig, DecoderForCausalLM
from lora_jax.serving.manager import LoRAModelManager
from lora_jax.serving.merge import merge_adapter, merge_and_unload, merged_slot, unmerge_adapter
from lora_jax.serving.peft import PEFTConfig, adapter_from_tensors
from lora_jax.serving.wrap import lora_layers, unwrap_model, wrap_model

B, S, RANK = 2, 5, 4
PREFIX = "base_model.model"


def _tensors(config, seed: int, *, embed=True, head=True, o_proj=True, rank=RANK):
    """PEFT-named tensors on embed_tokens, lm_head and o_proj."""
    rng = np.random.default_rng(seed)
    V, D = config.vocab_size, config.hidden_size
    t = {}
    if embed:
        t[f"{PREFIX}.model.embed_tokens.lora_embedding_A"] = rng.normal(size=(rank, V))
        t[f"{PREFIX}.model.embed_tokens.lora_embedding_B"] = rng.normal(0, 0.5, (D, rank))
    if head:
        t[f"{PREFIX}.lm_head.lora_A.weight"] = rng.normal(size=(rank, D))
        t[f"{PREFIX}.lm_head.lora_B.weight"] = rng.normal(0, 0.5, (V, rank))
    if o_proj:
        for i in range(config.num_hidden_layers):
            key = f"{PREFIX}.model.layers.{i}.self_attn.o_proj"
            t[f"{key}.lora_A.weight"] = rng.normal(0, 0.3, (rank, D))
            t[f"{key}.lora_B.weight"] = rng.normal(0, 0.3, (D, rank))
    return {k: v.astype(np.float32) for k, v in t.items()}


def _model(*, tie=False, vocab=250, tp=1, targets=("embed_tokens", "lm_head", "o_proj")):
    rules = lj.ShardingRules(jax.make_mesh((1, tp), ("dp", "tp"))) if tp > 1 else None
    config = DecoderConfig.tiny(vocab_size=vocab, tie_word_embeddings=tie)
    model = DecoderForCausalLM(config, rules=rules, rngs=nnx.Rngs(0))
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    wrap_model(model, cfg, target_modules=list(targets))
    return model, config, cfg


def _load(model, config, cfg, adapters):
    """`{adapter_id: tensors}` → active; returns each adapter's slot."""
    mgr = LoRAModelManager(model, cfg)
    for aid, tensors in adapters.items():
        mgr.add_adapter(adapter_from_tensors(tensors, PEFTConfig(r=RANK, lora_alpha=8), model,
                                             cfg, adapter_id=aid))  # fmt: skip
        mgr.activate_adapter(aid)
    return {aid: mgr.slot_of(aid) for aid in adapters}


@nnx.jit
def _logits(model, ids, pos, slots):
    with lj.lora_mapping(model, slots, jnp.full((ids.shape[0],), slots[0])):
        return model(ids, pos)[0]


@nnx.jit
def _base_logits(model, ids, pos):
    return model(ids, pos)[0]


def _inputs(config):
    ids = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (B, S)), jnp.int32)
    return ids, jnp.broadcast_to(jnp.arange(S), (B, S))


@pytest.mark.parametrize("tp", [1, 2])
def test_embedding_and_lm_head_merge_match_the_lora_path(tp):
    """vocab 250 pads to the shards; tp 2 shards both tables on vocab."""
    model, config, cfg = _model(tp=tp)
    slots = _load(model, config, cfg, {1: _tensors(config, 0), 2: _tensors(config, 1)})
    ids, pos = _inputs(config)
    base = np.asarray(_base_logits(model, ids, pos))
    slot = slots[2]
    lora = np.asarray(_logits(model, ids, pos, jnp.full((B * S,), slot, jnp.int32)))
    assert np.abs(lora - base).max() > 1e-1  # the adapter matters
    layers = lora_layers(model)
    tables = {n: la.base_layer.embedding[...] for n, la in layers.items() if "embed" in n}
    tables["lm_head"] = layers["lm_head"].base_layer.embedding[...]
    assert merge_adapter(model, slot) == len(layers) == 4
    assert merged_slot(model) == slot
    merged = np.asarray(_base_logits(model, ids, pos))
    np.testing.assert_allclose(merged, lora, rtol=1e-4, atol=1e-4 * np.abs(lora).max())
    for name, old in tables.items():
        table = (layers[name].base_layer.embedding)[...]
        assert table.sharding.is_equivalent_to(old.sharding, 2)
    assert unmerge_adapter(model)
    for name, old in tables.items():
        np.testing.assert_array_equal(np.asarray(layers[name].base_layer.embedding[...]), old)
    np.testing.assert_array_equal(np.asarray(_base_logits(model, ids, pos)), base)


def _params(model):
    return jax.tree.map(np.asarray, nnx.state(model, nnx.Param))


@pytest.mark.parametrize(
    "targets",
    [("embed_tokens", "lm_head", "o_proj"), ("embed_tokens", "o_proj"), ("lm_head", "o_proj")],
)
def test_tied_embeddings_are_refused_when_the_slot_uses_them(targets):
    """A tied model reads the embedding table as its lm_head: a slot with an embedding or
    lm_head adapter is refused (nothing changes); a slot with neither merges the rest."""
    model, config, cfg = _model(tie=True, targets=targets)
    with_vocab = _tensors(config, 0, embed="embed_tokens" in targets, head="lm_head" in targets)
    o_only = _tensors(config, 1, embed=False, head=False)
    slots = _load(model, config, cfg, {1: with_vocab, 2: o_only})
    before = _params(model)

    class Server(nnx.Module):  # a wrapper holding the model
        def __init__(self, lm):
            self.lm = lm

    # the tie is seen from the backbone or a wrapper too: merged, the embedding's delta
    # reached the tied lm_head's logits (184 off)
    backbone = (model.model,) if "embed_tokens" in targets else ()  # holds the table's LoRA
    for whole in (model, *backbone, Server(model)):
        with pytest.raises(ValueError, match=r"share one weight with .* hold an adapter in"):
            merge_adapter(whole, slots[1])
    jax.tree.map(np.testing.assert_array_equal, before, _params(model))
    assert merged_slot(model) is None
    ids, pos = _inputs(config)
    lora = np.asarray(_logits(model, ids, pos, jnp.full((B * S,), slots[2], jnp.int32)))
    assert merge_adapter(model, slots[2]) == config.num_hidden_layers  # the o_projs only
    merged = np.asarray(_base_logits(model, ids, pos))
    np.testing.assert_allclose(merged, lora, rtol=1e-4, atol=1e-4 * np.abs(lora).max())
    unmerge_adapter(model)
    jax.tree.map(np.testing.assert_array_equal, before, _params(model))


def test_merging_under_jit_is_refused_by_name():
    """Under a jax transform a merge gave a raw tracer error, or merged a traced copy and
    returned as if done while the model kept its weights."""
    model, config, cfg = _model(targets=("o_proj",))
    slots = _load(model, config, cfg, {1: _tensors(config, 0, embed=False, head=False)})
    before = _params(model)
    graphdef, state = nnx.split(model)

    def merge_in_trace(state):
        merge_adapter(nnx.merge(graphdef, state), slots[1])
        return 0

    def unmerge_in_trace(state):
        unmerge_adapter(nnx.merge(graphdef, state))
        return 0

    for fn, what in ((merge_in_trace, "merge_adapter"), (unmerge_in_trace, "unmerge_adapter")):
        with pytest.raises(ValueError, match=f"{what}: layer .* is traced.*outside jit"):
            jax.jit(fn)(state)
    jax.tree.map(np.testing.assert_array_equal, before, _params(model))
    assert merged_slot(model) is None


def test_unwrap_refuses_a_merged_model_unless_asked_to_keep_it():
    """Unwrapping a merged model would drop the saved originals: refused (nothing
    changes) unless `keep_merged=True`; `merge_and_unload` does that as PEFT's does, and
    leaves a plain model computing the LoRA path's logits."""
    model, config, cfg = _model(targets=("lm_head", "o_proj"))
    slots = _load(model, config, cfg, {1: _tensors(config, 0, embed=False)})
    ids, pos = _inputs(config)
    lora = np.asarray(_logits(model, ids, pos, jnp.full((B * S,), slots[1], jnp.int32)))
    merge_adapter(model, slots[1])
    with pytest.raises(ValueError, match="hold a merged adapter"):
        unwrap_model(model)
    assert lora_layers(model) and merged_slot(model) == slots[1]
    unmerge_adapter(model)
    assert merge_and_unload(model, slots[1]) == 3
    assert not lora_layers(model)
    merged = np.asarray(_base_logits(model, ids, pos))
    np.testing.assert_allclose(merged, lora, rtol=1e-4, atol=1e-4 * np.abs(lora).max())


class _Holder(nnx.Pytree):
    """A plain `nnx.Pytree` container (not an `nnx.Module`)."""

    def __init__(self, lin):
        self.lin = lin


@pytest.mark.parametrize("where", ["private", "pytree"])
def test_a_kernel_tied_into_a_private_attribute_or_a_pytree_is_never_merged(where):
    """A kernel that an unwrapped module also reads, held in a `_private` attribute or in
    an `nnx.Pytree` container (both in NNX's graph), cannot take an adapter's delta: the
    slot is refused and every weight is left as it was (oracle: the weights before)."""

    class Tied(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            head = nnx.Linear(4, 4, rngs=nnx.Rngs(1))
            head.kernel = self.proj.kernel  # tied; the head gets no LoRA
            if where == "private":
                self._head = head
            else:
                self.holder = _Holder(head)

    model = Tied()
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    wrap_model(model, cfg, target_modules=["proj"])
    model.proj.set_lora(0, np.ones((2, 4), np.float32), np.ones((4, 2), np.float32))
    before = nnx.state(model, nnx.Param)
    with pytest.raises(ValueError, match="share one weight with modules outside the LoRA layers"):
        merge_adapter(model, 0)
    jax.tree.map(np.testing.assert_array_equal, before, nnx.state(model, nnx.Param))
    assert merged_slot(model) is None
