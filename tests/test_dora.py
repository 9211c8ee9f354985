"""DoRA (`lora_jax.layers.dora`) in every linear LoRA kind against a float64 numpy oracle:
`y = g ⊙ (x @ (W + (B @ A)ᵀ)) + bias`, `g = magnitude / ||W + (B @ A)ᵀ||` per output unit;
and in the token embeddings (the norm over the vocab) and the lm_head (over the hidden
dim). HF peft is the oracle in test_dora_hf.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from layer_cases import KINDS, Kind, logical_output, make_mesh, random_weights

import lora_jax as lj
from lora_jax.layers.embedding import VocabParallelEmbeddingWithLoRA
from lora_jax.layers.flax_embed import FlaxEmbedWithLoRA
from lora_jax.layers.logits import ParallelLMHeadWithLoRA
from lora_jax.serving.export import adapter_from_slot
from lora_jax.serving.manager import LoRAModelManager
from lora_jax.serving.merge import merge_adapter, unmerge_adapter
from lora_jax.serving.peft import LoRAAdapter, ModuleLoRA
from lora_jax.vocab import ParallelLMHead, VocabParallelEmbedding

_FAST = {"replicated", "merged_qkv", "row", "merged_qkv_sharded", "row_sharded", "qkv"}
KIND_PARAMS = [
    pytest.param(k, id=k.name, marks=() if k.name in _FAST else pytest.mark.slow) for k in KINDS
]
IDX = np.array([1, -1, 1, 0, 1, 2, -1, 1], np.int32)


def _layer(kind: Kind, mesh, enable=True):
    rules = lj.ShardingRules(make_mesh(*mesh)) if mesh else lj.ShardingRules()
    base = kind.make_base(rules, jnp.float32)
    ks, bs = random_weights(base, 0)
    base.load_kernel(ks, bs)
    cfg = lj.LoRAConfig(max_loras=3, max_lora_rank=8, enable_dora=enable)
    return kind.lora_cls(base, cfg, lj.LoRAContext(None)), ks, bs


def _adapter(layer, seed):
    rng = np.random.default_rng(seed)
    n_in = layer.base_layer.in_features
    a = [rng.normal(0, 0.3, (4, n_in)).astype(np.float32) for _ in range(layer.n_slices)]
    b = [rng.normal(0, 0.3, (n, 4)).astype(np.float32) for n in layer.logical_slice_sizes]
    m = [rng.uniform(0.5, 2.0, (n,)).astype(np.float32) for n in layer.logical_slice_sizes]
    return a, b, m


def _oracle(layer, ks, bs, x, adapters, idx=IDX):
    W = np.concatenate(ks, 1).astype(np.float64)
    y = x @ W + np.concatenate(bs)
    offs = np.concatenate([[0], np.cumsum(layer.logical_slice_sizes)])
    for t, slot in enumerate(idx):
        if slot not in adapters:
            continue
        a, b, m = adapters[slot]
        delta = np.zeros_like(W)
        for s in range(layer.n_slices):
            delta[:, offs[s] : offs[s + 1]] = (b[s] @ a[s]).T
        g = 1.0 if m is None else np.concatenate(m) / np.linalg.norm(W + delta, axis=0)
        y[t] = g * (x[t] @ (W + delta)) + np.concatenate(bs)
    return y


@nnx.jit
def _forward(layer, x, idx):
    with lj.lora_mapping(layer, idx):
        return layer(x)


@pytest.mark.parametrize("mesh", [None, (2, 4)], ids=["one_device", "dp2tp4"])
@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_every_kind_scales_its_dora_slots(kind, mesh):
    """Slot 1 DoRA, slot 2 plain LoRA, slot 0 empty: each token as the oracle says, on one
    device and on a dp x tp mesh (kv head replicas, per-shard packing, the row reduction,
    the S-LoRA layouts)."""
    layer, ks, bs = _layer(kind, mesh)
    dora, plain = _adapter(layer, 1), _adapter(layer, 2)
    layer.set_lora(1, dora[0], dora[1])
    layer.set_dora(1, dora[2])
    layer.set_lora(2, plain[0], plain[1])
    x = np.random.default_rng(3).normal(size=(len(IDX), layer.base_layer.in_features))
    y = _forward(layer, jnp.asarray(x, jnp.float32), jnp.asarray(IDX))
    want = _oracle(layer, ks, bs, x, {1: dora, 2: (*plain[:2], None)})
    np.testing.assert_allclose(logical_output(layer, y), want, rtol=2e-5, atol=2e-5)
    # set_lora makes the slot plain LoRA again
    layer.set_lora(1, dora[0], dora[1])
    y = _forward(layer, jnp.asarray(x, jnp.float32), jnp.asarray(IDX))
    want = _oracle(layer, ks, bs, x, {1: (*dora[:2], None), 2: (*plain[:2], None)})
    np.testing.assert_allclose(logical_output(layer, y), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mesh", [None, (2, 4)], ids=["one_device", "dp2tp4"])
@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_every_kind_merges_and_exports_its_dora_slots(kind, mesh):
    """merge_adapter of a DoRA slot gives its tokens' outputs with no mapping (PEFT's DoRA
    merge, `g ⊙ (W + B @ A)`); adapter_from_slot reads back PEFT's magnitudes, none for
    a plain LoRA slot; unmerge_adapter puts the kernel back."""
    layer, ks, bs = _layer(kind, mesh)
    model = nnx.Dict(proj=layer)
    dora, plain = _adapter(layer, 1), _adapter(layer, 2)
    layer.set_lora(1, dora[0], dora[1])
    layer.set_dora(1, dora[2])
    layer.set_lora(2, plain[0], plain[1])
    got = adapter_from_slot(model, 1).modules["proj"]
    for g, m in zip(got.magnitude, dora[2]):
        np.testing.assert_allclose(g, m, rtol=1e-5)
    assert adapter_from_slot(model, 2).modules["proj"].magnitude is None
    kernel = np.asarray(layer.base_layer.kernel[...])
    x = np.random.default_rng(3).normal(size=(len(IDX), layer.base_layer.in_features))
    for slot, adapter in ((1, dora), (2, (*plain[:2], None))):
        merge_adapter(model, slot)
        y = jax.jit(lambda x: layer(x))(jnp.asarray(x, jnp.float32))  # no mapping: base only
        want = _oracle(layer, ks, bs, x, {slot: adapter}, np.full(len(IDX), slot))
        np.testing.assert_allclose(logical_output(layer, y), want, rtol=2e-5, atol=2e-5)
        unmerge_adapter(model)
        np.testing.assert_array_equal(np.asarray(layer.base_layer.kernel[...]), kernel)


def test_a_dora_slot_with_lora_on_a_layer_without_dora_is_not_exported():
    """PEFT's use_dora is the whole adapter's: a slot with DoRA in one layer and LoRA in a
    plain Flax layer (no DoRA scale) is refused by name, not written half DoRA."""
    kind = next(k for k in KINDS if k.name == "row")
    proj = kind.make_base(lj.ShardingRules(), jnp.float32)
    model = nnx.Dict(proj=proj, lin=nnx.Linear(16, 8, rngs=nnx.Rngs(0)))
    model["proj"].load_kernel(*random_weights(model["proj"], 0))
    lj.serving.wrap.wrap_model(model, lj.LoRAConfig(max_loras=2, max_lora_rank=8, enable_dora=True))
    layer, lin = model["proj"], model["lin"]
    assert lin.dora_norm is None and lin.dora_magnitude is None
    a, b, m = _adapter(layer, 4)
    layer.set_lora(1, a, b)
    layer.set_dora(1, m)
    lin.set_lora(1, np.ones((2, 16), np.float32), np.ones((8, 2), np.float32))
    with pytest.raises(ValueError, match=r"slot 1 holds a DoRA adapter .*'proj'.* LoRA in lin"):
        adapter_from_slot(model, 1)
    lin.reset_lora(1)
    assert adapter_from_slot(model, 1).modules["proj"].magnitude is not None


def test_bad_magnitudes_are_refused_and_change_nothing():
    kind = next(k for k in KINDS if k.name == "merged_qkv")
    layer, *_ = _layer(kind, None)
    a, b, m = _adapter(layer, 1)
    layer.set_lora(1, a, b)
    layer.set_dora(1, m)
    before = [np.asarray(v[...]) for v in (layer.dora_magnitude, layer.dora_norm)]
    for bad, msg in (
        ([m[0][:-1], m[1], m[2]], r"magnitude of slice 0 must be \[\d+\] finite"),
        ([m[0], np.full_like(m[1], np.nan), m[2]], "slice 1 must be"),
        (m[:2], "2 DoRA magnitudes for 3 slices"),
    ):
        with pytest.raises(ValueError, match=msg):
            layer.set_dora(1, bad)
    for v, was in zip((layer.dora_magnitude, layer.dora_norm), before):
        np.testing.assert_array_equal(np.asarray(v[...]), was)
    off, *_ = _layer(kind, None, enable=False)
    assert off.dora_norm is None and off.dora_magnitude is None  # nothing without enable_dora
    with pytest.raises(ValueError, match=r"enable_dora=True"):
        off.set_dora(0, m)


def test_the_manager_writes_dora_and_a_refused_adapter_changes_nothing():
    """Through the manager's one write: a DoRA adapter serves as the layer's own
    set_lora + set_dora; a bad one (a magnitude of the wrong width) is refused before any
    slot changes."""
    kind = next(k for k in KINDS if k.name == "row")

    class Tiny(nnx.Module):
        def __init__(self):
            self.proj = kind.make_base(lj.ShardingRules(), jnp.float32)
            self.proj.load_kernel(*random_weights(self.proj, 0))  # the weights _layer loads

    model = Tiny()
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, enable_dora=True)
    lj.serving.wrap.wrap_model(model, cfg)
    layer = model.proj
    a, b, m = _adapter(layer, 4)
    good = LoRAAdapter(1, "good", 4, {"proj": ModuleLoRA("proj", (a[0],), (b[0],), (m[0],))})
    bad = LoRAAdapter(2, "bad", 4, {"proj": ModuleLoRA("proj", (a[0],), (b[0],), (m[0][:3],))})
    mgr = LoRAModelManager(model, cfg)
    mgr.add_adapter(good)
    mgr.activate_adapter(1)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(len(IDX), layer.base_layer.in_features)))
    slots = np.where(IDX >= 0, mgr.lora_index_to_id.index(1), -1).astype(np.int32)
    y = np.asarray(_forward(layer, x, jnp.asarray(slots)))
    state = [
        np.asarray(v[...])
        for v in (*layer.lora_a, *layer.lora_b, layer.dora_magnitude, layer.dora_norm)
    ]
    with pytest.raises(ValueError, match="magnitude of slice 0"):
        mgr.add_adapter(bad)
        mgr.activate_adapter(2)
    for v, s in zip((*layer.lora_a, *layer.lora_b, layer.dora_magnitude, layer.dora_norm), state):
        np.testing.assert_array_equal(np.asarray(v[...]), s)
    ref, *_ = _layer(kind, None)
    ref.set_lora(0, a, b)
    ref.set_dora(0, m)
    want = np.asarray(_forward(ref, x, jnp.asarray(np.where(IDX >= 0, 0, -1).astype(np.int32))))
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)


def _embedding(flax_embed: bool, mesh, V=50, D=16):
    """A token embedding with DoRA (`VocabParallelEmbedding`, vocab split on tp; or a plain
    `nnx.Embed`) over a table of scale 1, and that table `[V, D]`."""
    table = np.random.default_rng(7).normal(size=(V, D)).astype(np.float32)
    cfg = lj.LoRAConfig(max_loras=3, max_lora_rank=8, enable_dora=True)
    if flax_embed:
        base = nnx.Embed(V, D, rngs=nnx.Rngs(0))
        base.embedding.set_value(jnp.asarray(table))
        return FlaxEmbedWithLoRA(base, cfg), table
    rules = lj.ShardingRules(make_mesh(*mesh)) if mesh else lj.ShardingRules()
    base = VocabParallelEmbedding(V, D, rules=rules, rngs=nnx.Rngs(0))
    base.load_table(table)
    return VocabParallelEmbeddingWithLoRA(base, cfg, lj.LoRAContext(None)), table


def _dora_and_plain(layer, rng, k: int, n: int):
    """Slot 1: a rank-4 DoRA adapter `(A [4, k], B [n, 4], magnitude [n])`; slot 2: a
    rank-2 plain one `(A, B)`. Returns both."""
    dora = (rng.normal(0, 0.5, (4, k)), rng.normal(0, 0.5, (n, 4)), rng.uniform(0.5, 2, n))
    dora = tuple(v.astype(np.float32) for v in dora)
    plain = tuple(rng.normal(0, 0.5, s).astype(np.float32) for s in ((2, k), (n, 2)))
    layer.set_lora(1, *dora[:2])
    layer.set_dora(1, [dora[2]])
    layer.set_lora(2, *plain)
    return dora, plain


def _embedding_oracle(table, ids, idx, adapters):
    """PEFT's DoRA embedding in float64: `g ⊙ (W + (B @ A)ᵀ)[id]`, `g = m / ||W + (B @ A)ᵀ||`
    over the vocab per embedding unit (`g = 1` for a plain slot: m None)."""
    W = table.astype(np.float64)
    y = W[ids].copy()
    for t, (i, slot) in enumerate(zip(ids, idx)):
        if slot in adapters:
            a, b, m = adapters[slot]
            merged = W + (b.astype(np.float64) @ a).T  # [V, D]
            g = 1.0 if m is None else m / np.linalg.norm(merged, axis=0)
            y[t] = g * merged[i]
    return y


@pytest.mark.parametrize(
    "flax_embed, mesh",
    [(False, None), (False, (2, 4)), (True, None)],
    ids=["vocab_parallel", "vocab_parallel_dp2tp4", "flax_embed"],
)
def test_token_embeddings_scale_merge_and_export_their_dora_slots(flax_embed, mesh):
    """PEFT's DoRA on a token embedding (a gain per embedding unit, the norm over the
    vocab; padded rows and vocab shards left out of it): slot 1 DoRA, slot 2 plain LoRA,
    each token as the oracle says; adapter_from_slot reads back the magnitudes; merged,
    the table gives them with no mapping, and unmerged it is as it was; bad magnitudes
    change nothing; set_lora makes the slot plain again."""
    layer, table = _embedding(flax_embed, mesh)
    V, D = table.shape
    rng = np.random.default_rng(1)
    dora, plain = _dora_and_plain(layer, rng, V, D)
    ids = rng.integers(0, V, len(IDX)).astype(np.int32)
    want = _embedding_oracle(table, ids, IDX, {1: dora, 2: (*plain, None)})
    got = _forward(layer, jnp.asarray(ids), jnp.asarray(IDX))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    model = nnx.Dict(emb=layer)
    (mag,) = adapter_from_slot(model, 1).modules["emb"].magnitude
    np.testing.assert_allclose(mag, dora[2], rtol=1e-6)
    assert adapter_from_slot(model, 2).modules["emb"].magnitude is None
    norms = np.asarray(layer.dora_norm[...])
    for bad, msg in (([dora[2][:-1]], r"must be \[16\] finite"), ([dora[2]] * 2, "2 DoRA")):
        with pytest.raises(ValueError, match=msg):
            layer.set_dora(1, bad)
    np.testing.assert_array_equal(np.asarray(layer.dora_norm[...]), norms)
    if not flax_embed:  # (a plain nnx.Embed's table may be a tied lm_head: not merged)
        before = np.asarray(layer.base_layer.embedding[...])
        merge_adapter(model, 1)
        y = jax.jit(lambda i: layer(i))(jnp.asarray(ids))  # no mapping: the table only
        want1 = _embedding_oracle(table, ids, np.ones_like(IDX), {1: dora})
        np.testing.assert_allclose(np.asarray(y), want1, rtol=2e-5, atol=2e-5)
        unmerge_adapter(model)
        np.testing.assert_array_equal(np.asarray(layer.base_layer.embedding[...]), before)
    layer.set_lora(1, *dora[:2])
    got = _forward(layer, jnp.asarray(ids), jnp.asarray(IDX))
    want = _embedding_oracle(table, ids, IDX, {1: (*dora[:2], None), 2: (*plain, None)})
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mesh", [None, (2, 4)], ids=["one_device", "dp2tp4"])
def test_an_lm_head_scales_merges_and_exports_its_dora_slots(mesh):
    """PEFT's DoRA on the lm_head (a Linear: a gain per vocab row, the norm over the
    hidden dim; padded rows left out): slot 1 DoRA, slot 2 plain LoRA, each row's logits
    as the oracle says (vocab split on tp); adapter_from_slot reads the magnitudes back
    in token order; merged, the table gives them with no mapping, and unmerged it is as
    it was."""
    V, D = 50, 16
    rules = lj.ShardingRules(make_mesh(*mesh)) if mesh else lj.ShardingRules()
    head = ParallelLMHead(V, D, rules=rules, rngs=nnx.Rngs(0))
    W = np.random.default_rng(7).normal(size=(V, D)).astype(np.float32)
    head.load_table(W)
    cfg = lj.LoRAConfig(max_loras=3, max_lora_rank=8, enable_dora=True)
    layer = ParallelLMHeadWithLoRA(head, cfg)
    rng = np.random.default_rng(1)
    dora, plain = _dora_and_plain(layer, rng, D, V)
    x = rng.normal(size=(len(IDX), D))

    def oracle(idx, adapters):
        y = x @ W.T.astype(np.float64)
        for t, slot in enumerate(idx):
            if slot in adapters:
                a, b, m = adapters[slot]
                merged = W + b.astype(np.float64) @ a  # [V, D]
                g = 1.0 if m is None else m / np.linalg.norm(merged, axis=1)
                y[t] = g * (x[t] @ merged.T)
        return y

    got = _forward(layer, jnp.asarray(x, jnp.float32), jnp.asarray(IDX))
    want = oracle(IDX, {1: dora, 2: (*plain, None)})
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    model = nnx.Dict(lm_head=layer)
    (mag,) = adapter_from_slot(model, 1).modules["lm_head"].magnitude
    np.testing.assert_allclose(mag, dora[2], rtol=1e-6)
    before = np.asarray(head.embedding[...])
    merge_adapter(model, 1)
    y = jax.jit(lambda h: layer(h))(jnp.asarray(x, jnp.float32))  # no mapping: the table only
    np.testing.assert_allclose(
        np.asarray(y), oracle(np.ones_like(IDX), {1: dora}), rtol=2e-5, atol=2e-5
    )
    unmerge_adapter(model)
    np.testing.assert_array_equal(np.asarray(head.embedding[...]), before)
