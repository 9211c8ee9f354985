"""`wrap_model` on a plain Flax model's `nnx.Embed`: the base lookup unchanged, PEFT's
embedding LoRA per token against a numpy oracle and against HF `peft` on a torch
`nn.Embedding`, a tied `attend` left alone, merging refused, `unwrap_model` giving back
the very same module."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax as lj
from lora_jax.serving.manager import LRUCacheLoRAModelManager
from lora_jax.serving.merge import merge_adapter, merged_slot, unmerge_adapter
from lora_jax.serving.peft import write_safetensors
from lora_jax.serving.wrap import lora_layers, unwrap_model, wrap_model

V, D = 50, 16
CFG = lj.LoRAConfig(max_loras=2, max_lora_rank=8)


class TinyLM(nnx.Module):
    """A user's own LM: `nnx.Embed`, one `nnx.Linear`, logits from the tied table."""

    def __init__(self, rngs: nnx.Rngs, dtype=None):
        self.embed = nnx.Embed(V, D, dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, ids):
        h = self.embed(ids).astype(jnp.float32)
        h = h + self.proj(h)
        return self.embed.attend(h)


@nnx.jit
def _step(model, ids, slots):
    with lj.lora_mapping(model, slots.reshape(-1)):
        return model(ids)


@nnx.jit
def _plain(model, ids):
    return model(ids)


def _embedding_adapter(seed, rank=4):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rank, V)).astype(np.float32), rng.normal(0, 0.5, (D, rank)).astype(
        np.float32
    )


def _oracle(table, w, bias, adapters, ids, slots):
    """float64 numpy: `e = table[id] + B @ A[:, id]`, `h = e + proj(e)`, logits `h @ table.T`."""
    table, w, bias = (np.asarray(v, np.float64) for v in (table, w, bias))
    out = []
    for i, s in zip(ids.reshape(-1), slots.reshape(-1)):
        e = table[i].copy()
        if s >= 0:
            a, b = adapters[s]
            e += b @ a[:, i]
        h = e + e @ w + bias
        out.append(h @ table.T)
    return np.stack(out).reshape(*ids.shape, V)


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_plain_embed_wraps_serves_and_unwraps(dtype):
    model = TinyLM(nnx.Rngs(0), dtype=dtype)
    embed = model.embed
    ids = jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 6)), jnp.int32)
    before = np.asarray(_plain(model, ids))
    wrap_model(model, CFG, target_modules=["embed"])
    assert type(model.embed) is lj.FlaxEmbedWithLoRA and model.embed.base_layer.source is embed
    assert model.embed.base_layer.embedding is embed.embedding  # shared, not copied
    np.testing.assert_array_equal(np.asarray(_plain(model, ids)), before)  # no mapping
    none = jnp.full(ids.shape, -1, jnp.int32)
    np.testing.assert_array_equal(np.asarray(_step(model, ids, none)), before)  # slot -1
    adapters = {0: _embedding_adapter(0), 1: _embedding_adapter(1, rank=8)}
    for s, (a, b) in adapters.items():
        model.embed.set_lora(s, a, b)
    slots = jnp.asarray([[0, 1, -1, 1, 0, 0], [-1, -1, 1, 0, 1, 1]], jnp.int32)
    got = np.asarray(_step(model, ids, slots))
    np.testing.assert_array_equal(got[np.asarray(slots) < 0], before[np.asarray(slots) < 0])
    if dtype is None:
        table = np.asarray(embed.embedding[...])
        proj = model.proj  # not targeted: the plain nnx.Linear
        want = _oracle(table, proj.kernel[...], proj.bias[...], adapters, np.asarray(ids),
                       np.asarray(slots))  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    else:  # bf16 lookups: each adapted token moved, by about what its adapter adds
        assert got.dtype == before.dtype
        assert np.abs(got - before)[np.asarray(slots) >= 0].max() > 1e-1
    assert unwrap_model(model) == 1 and model.embed is embed
    np.testing.assert_array_equal(np.asarray(_plain(model, ids)), before)


def test_peft_embedding_adapter_loads_and_merge_is_refused(tmp_path):
    model = TinyLM(nnx.Rngs(3))
    wrap_model(model, CFG, target_modules=["embed", "proj"])
    assert sorted(lora_layers(model)) == ["embed", "proj"]
    a, b = _embedding_adapter(4)
    rng = np.random.default_rng(5)
    pa, pb = rng.normal(0, 0.3, (4, D)), rng.normal(0, 0.3, (D, 4))
    tensors = {
        "base_model.model.embed.lora_embedding_A": a,
        "base_model.model.embed.lora_embedding_B": b,
        "base_model.model.proj.lora_A.weight": pa.astype(np.float32),
        "base_model.model.proj.lora_B.weight": pb.astype(np.float32),
    }
    d = tmp_path / "emb"
    d.mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["embed", "proj"]}
    (d / "adapter_config.json").write_text(json.dumps(config))
    write_safetensors(d / "adapter_model.safetensors", tensors)
    mgr = LRUCacheLoRAModelManager(model, CFG)
    (adapter,) = mgr.load_adapters({"emb": d}, activate=True, progress=False)
    slot = mgr.slot_of(adapter.id)
    ids = jnp.asarray([[3, 7, 49, 0]], jnp.int32)
    slots = jnp.asarray([[slot, -1, slot, slot]], jnp.int32)
    got = np.asarray(_step(model, ids, slots))
    table = np.asarray(model.embed.embedding[...])
    proj = model.proj.base_layer.source
    w = np.asarray(proj.kernel[...], np.float64) + (pb @ pa).T * 2.0  # alpha / r = 2
    adapters = {slot: (a, b * 2.0)}
    want = _oracle(table, w, proj.bias[...], adapters, np.asarray(ids), np.asarray(slots))
    want[0, 1] = _oracle(table, proj.kernel[...], proj.bias[...], {}, np.asarray(ids[:, 1:2]),
                         np.asarray([[-1]]))[0, 0]  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    params = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    with pytest.raises(ValueError, match=r"'embed' \(FlaxEmbedWithLoRA\).*attend\(\)"):
        merge_adapter(model, slot)
    jax.tree.map(np.testing.assert_array_equal, params, nnx.state(model, nnx.Param))
    assert merged_slot(model) is None
    other = 1 - slot  # an empty embedding slot: the linears merge, the table stays
    model.proj.set_lora(other, pa, pb)
    assert merge_adapter(model, other) == 1
    np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]), table)
    unmerge_adapter(model)


def test_against_hf_peft_on_a_torch_embedding(tmp_path):
    """HF peft's embedding LoRA (`init_lora_weights=False`: random A and B) on a torch
    `nn.Embedding` vs the same table and adapter file through lora_jax."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(V, D)

        def forward(self, ids):
            return self.embed(ids)

    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["embed"], init_lora_weights=False)
    net = peft.get_peft_model(Net(), cfg)
    net.save_pretrained(tmp_path / "ad")
    model = TinyLM(nnx.Rngs(0))
    table = net.base_model.model.embed.base_layer.weight.detach().numpy()
    model.embed.embedding.set_value(jnp.asarray(table))
    wrap_model(model, CFG, target_modules=["embed"])
    mgr = LRUCacheLoRAModelManager(model, CFG)
    (adapter,) = mgr.load_adapters({"ad": tmp_path / "ad"}, activate=True, progress=False)
    slot = mgr.slot_of(adapter.id)
    ids = np.random.default_rng(2).integers(0, V, (3, 5))
    with torch.no_grad():
        want = net(torch.as_tensor(ids)).numpy()

    @nnx.jit
    def lookup(model, ids, slots):
        with lj.lora_mapping(model, slots.reshape(-1)):
            return model.embed(ids)

    got = np.asarray(lookup(model, jnp.asarray(ids, jnp.int32), jnp.full(ids.shape, slot)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_batch_sharded_ids_with_out_sharding_on_an_explicit_mesh():
    """ids split over "dp" and `out_sharding` (as `nnx.Embed` takes them on an Explicit
    mesh): the output keeps the asked sharding and equals the unsharded lookup; `attend`
    takes `out_sharding` second, as `nnx.Embed.attend` does."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=explicit)
    a, b = _embedding_adapter(7)
    ids_np = np.random.default_rng(3).integers(0, V, (2, 6)).astype(np.int32)
    slots = jnp.asarray([1, 1, -1, 0, 1, -1] * 2, jnp.int32)
    plain = lj.FlaxEmbedWithLoRA(nnx.Embed(V, D, rngs=nnx.Rngs(0)), CFG)
    plain.set_lora(1, a, b)

    @nnx.jit(static_argnums=3)
    def lookup(layer, ids, slots, out):
        with lj.lora_mapping(layer, slots):
            return layer(ids, out_sharding=out)

    want = np.asarray(lookup(plain, jnp.asarray(ids_np), slots, None))
    with jax.set_mesh(mesh):
        layer = lj.FlaxEmbedWithLoRA(nnx.Embed(V, D, rngs=nnx.Rngs(0)), CFG)
        layer.set_lora(1, a, b)
        ids = jax.device_put(jnp.asarray(ids_np), NamedSharding(mesh, P("dp", None)))
        got = lookup(layer, ids, slots, P("dp", None, None))
        assert jax.typeof(got).sharding.spec == P("dp", None, None)
        h = jax.device_put(jnp.ones((2, D)), NamedSharding(mesh, P()))
        logits = nnx.jit(lambda m, h: m.attend(h, P(None, "dp")))(layer, h)
        assert jax.typeof(logits).sharding.spec == P(None, "dp")  # V = 50 splits in 2
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_a_wrapped_embed_reads_as_the_nnx_embed_it_wraps():
    """Code that reads the table (`layer.embedding[...]`, a hand-tied head) or the sizes
    (`layer.features`) runs unchanged after `wrap_model`: every public field of the
    `nnx.Embed` reads the very same object through its LoRA layer."""

    class HandTied(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, D, rngs=rngs)

        def __call__(self, ids):
            h = self.embed(ids)
            return h @ self.embed.embedding[...].T / self.embed.features  # [.., V]

    model = HandTied(nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 3)), jnp.int32)
    before = model(ids)
    source = model.embed
    wrap_model(model, CFG)
    assert isinstance(model.embed, lj.FlaxEmbedWithLoRA)
    for name in sorted(k for k in vars(source) if not k.startswith("_")):
        assert getattr(model.embed, name) is getattr(source, name), name
    np.testing.assert_array_equal(model(ids), before)  # no mapping set: the base lookup
    with pytest.raises(AttributeError, match=r"embed: \.features is read from the wrapped"):
        model.embed.features = 2 * D
