"""`wrap_model` on Flax models built from `nnx.LinearGeneral` (as `nnx.MultiHeadAttention`
is) and `nnx.Einsum`: the flat LoRA (`A [r, in]`, `B [out, r]` over the contracted / kept
kernel axes in kernel order) against numpy oracles that fold `B @ A` into the kernels,
against an `nnx.Linear` holding the same kernel flattened, PEFT loading, merging, and the
layouts that are refused."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax as lj
from lora_jax.layers.flax_general import parse_einsum
from lora_jax.serving.manager import LRUCacheLoRAModelManager
from lora_jax.serving.merge import merge_adapter, unmerge_adapter
from lora_jax.serving.peft import write_safetensors
from lora_jax.serving.wrap import lora_layers, unwrap_model, wrap_model

E, HEADS, HD = 16, 4, 4
CFG = lj.LoRAConfig(max_loras=3, max_lora_rank=8)


class Attn(nnx.Module):
    """Flax's own attention, then an einsum projection that keeps the head axis in the
    middle of its output, then an ellipsis einsum."""

    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=E, qkv_features=E, decode=False, rngs=rngs
        )
        self.heads = nnx.Einsum("btd,ndh->bnth", (HEADS, E, HD), (HEADS, HD), rngs=rngs)
        self.mix = nnx.Einsum("...d,df->...f", (E, E), rngs=rngs)

    def __call__(self, x):
        h = self.attn(x)
        g = self.heads(h).transpose(0, 2, 1, 3).reshape(x.shape)
        return self.mix(g + h)


def _adapter(model, seed, rank=4):
    """{layer name: (A [r, in], B [out, r])} over the flat sizes of every LoRA layer."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, la in lora_layers(model).items():
        n_in, n_out = la.base_layer.in_features, la.base_layer.output_sizes[0]
        out[name] = (
            rng.normal(0, 0.3, (rank, n_in)).astype(np.float32),
            rng.normal(0, 0.3, (n_out, rank)).astype(np.float32),
        )
    return out


def _fold(kernel, equation, a, b):
    """The kernel with `B @ A` added, the flat map laid back by hand: contracted kernel
    axes (in kernel order) are the rows, kept ones the columns (numpy, float64)."""
    inp, rest = equation.split(",")
    ker, out = rest.split("->")
    con = [i for i, c in enumerate(ker) if c in inp]
    feat = [i for i, c in enumerate(ker) if c in out]
    k = np.asarray(kernel, np.float64).transpose(con + feat)
    flat = k.reshape(int(np.prod(k.shape[: len(con)])), -1)
    flat = flat + (b.astype(np.float64) @ a.astype(np.float64)).T
    back = np.argsort(con + feat)
    return flat.reshape(k.shape).transpose(back)


EQUATIONS = {  # each layer of `Attn` as an einsum of its kernel
    "attn.query": "td,dnh->tnh",
    "attn.key": "td,dnh->tnh",
    "attn.value": "td,dnh->tnh",
    "attn.out": "tnh,nhd->td",
    "heads": "btd,ndh->bnth",
    "mix": "td,df->tf",
}


def _oracle(model, adapters, x, seq_slots):
    """Each sequence through a fresh `Attn` whose kernels hold its adapter folded in by
    `_fold` (an unwrapped copy: attention mixes a sequence's tokens)."""
    outs = []
    for row, slot in enumerate(seq_slots):
        ref = Attn(nnx.Rngs(0))
        for name, la in lora_layers(model).items():
            src = la.base_layer.source
            dst = ref
            for part in name.split("."):
                dst = getattr(dst, part)
            k = np.asarray(src.kernel[...])
            if slot >= 0:
                k = _fold(k, EQUATIONS[name], *adapters[slot][name])
            dst.kernel.set_value(jnp.asarray(k, jnp.float32))
            if src.bias is not None:
                dst.bias.set_value(src.bias[...])
        outs.append(np.asarray(ref(x[row : row + 1]))[0])
    return np.stack(outs)


@nnx.jit
def _step(model, x, idx):
    with lj.lora_mapping(model, idx):
        return model(x)


def test_attention_and_einsum_models_wrap_serve_merge_and_unwrap():
    model = Attn(nnx.Rngs(0))
    originals = {n: m for n, m in [("query", model.attn.query), ("heads", model.heads)]}
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, E)), jnp.float32)
    y_base = np.asarray(nnx.jit(lambda m, x: m(x))(model, x))
    wrap_model(model, CFG)
    layers = lora_layers(model)
    assert sorted(layers) == sorted(EQUATIONS)
    assert type(layers["attn.query"]) is lj.FlaxLinearGeneralWithLoRA
    assert type(layers["heads"]) is lj.FlaxEinsumWithLoRA
    assert layers["heads"].base_layer.kernel is originals["heads"].kernel  # shared
    assert (layers["attn.out"].base_layer.in_features, layers["heads"].base_layer.in_features) == (
        E,
        E,
    )
    # exact on a CPU; a GPU's XLA fuses the base matmuls otherwise beside the LoRA ops
    exact = dict(rtol=0, atol=0 if jax.default_backend() == "cpu" else 1e-6)
    np.testing.assert_allclose(
        np.asarray(_step(model, x, jnp.full(15, -1, jnp.int32))), y_base, **exact
    )
    adapters = {0: _adapter(model, 1), 1: _adapter(model, 2, rank=8)}
    for slot, ad in adapters.items():
        for name, (a, b) in ad.items():
            layers[name].set_lora(slot, a, b)
    seq_slots = np.array([1, -1, 0], np.int32)
    got = np.asarray(_step(model, x, jnp.asarray(np.repeat(seq_slots, 5))))
    want = _oracle(model, adapters, np.asarray(x), seq_slots)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(got[1], y_base[1], **exact)  # the -1 sequence: the base
    kernels = {n: np.asarray(la.base_layer.kernel[...]) for n, la in layers.items()}
    assert merge_adapter(model, 1) == len(EQUATIONS)
    merged = np.asarray(nnx.jit(lambda m, x: m(x))(model, x))
    np.testing.assert_allclose(merged[0], got[0], rtol=1e-4, atol=1e-4 * np.abs(got).max())
    unmerge_adapter(model)
    for n, la in layers.items():
        np.testing.assert_array_equal(np.asarray(la.base_layer.kernel[...]), kernels[n])
    assert unwrap_model(model) == len(EQUATIONS)
    assert model.attn.query is originals["query"] and model.heads is originals["heads"]
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(model, x)), y_base)


def test_linear_general_is_the_flat_nn_linear_per_token():
    """`LinearGeneral(E, (N, H))` with per-token slots equals an `nnx.Linear(E, N * H)`
    holding the same kernel flattened and the same adapters; a contraction over a middle
    and the last axis (`axis=(1, -1)`, and `(-1, 1)`, which Flax pairs in ascending order:
    the LoRA paired them as named, off by 15) matches the folded-kernel oracle."""
    rng = np.random.default_rng(0)
    lg = nnx.LinearGeneral(E, (HEADS, HD), rngs=nnx.Rngs(0))
    lin = nnx.Linear(E, HEADS * HD, rngs=nnx.Rngs(1))
    lin.kernel.set_value(lg.kernel[...].reshape(E, HEADS * HD))
    lin.bias.set_value(lg.bias[...].reshape(-1))
    a_lg = lj.FlaxLinearGeneralWithLoRA(lg, CFG)
    a_lin = lj.FlaxLinearWithLoRA(lin, CFG, a_lg.lora_context)
    for slot in range(2):
        a, b = rng.normal(size=(3 + slot, E)), rng.normal(size=(HEADS * HD, 3 + slot))
        a_lg.set_lora(slot, a, b)
        a_lin.set_lora(slot, a, b)
    x = jnp.asarray(rng.normal(size=(2, 3, E)), jnp.float32)
    a_lg.lora_context.set_value(lj.make_lora_mapping(jnp.array([0, 1, -1, 1, 1, 0]), 3))
    np.testing.assert_allclose(
        np.asarray(a_lg(x)).reshape(2, 3, -1), np.asarray(a_lin(x)), rtol=1e-5, atol=1e-5
    )

    for axis in ((1, -1), (-1, 1)):  # Flax pairs kernel and x axes in ascending order
        _check_mid_axes(rng, axis)


def _check_mid_axes(rng, axis):
    mid = nnx.LinearGeneral((2, 3), (4,), axis=axis, rngs=nnx.Rngs(2))
    layer = lj.FlaxLinearGeneralWithLoRA(mid, CFG)
    a, b = rng.normal(size=(2, 6)), rng.normal(size=(4, 2))
    layer.set_lora(2, a, b)
    x = jnp.asarray(rng.normal(size=(5, 2, 7, 3)), jnp.float32)  # tokens: axes 0 and 2
    slots = rng.choice([2, -1], size=35)
    layer.lora_context.set_value(lj.make_lora_mapping(jnp.asarray(slots, jnp.int32), 3))
    got = np.asarray(layer(x))
    folded = _fold(mid.kernel[...], "bicj,ijf->bcf", a, b)
    plain = np.asarray(mid.kernel[...], np.float64)
    xs = np.asarray(x, np.float64)
    want = np.where(
        (slots.reshape(5, 7) >= 0)[..., None],
        np.einsum("bicj,ijf->bcf", xs, folded),
        np.einsum("bicj,ijf->bcf", xs, plain),
    ) + np.asarray(mid.bias[...])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_attention_loads_peft_adapters_through_the_manager(tmp_path):
    """A PEFT checkpoint keyed by the model's module paths, with flat A / B, loads through
    the manager (alpha / r folded into B) and serves the folded-kernel oracle."""
    model = Attn(nnx.Rngs(0))
    wrap_model(model, CFG, target_modules=["query", "value", "heads"])
    assert sorted(lora_layers(model)) == ["attn.query", "attn.value", "heads"]
    raw = _adapter(model, 7)
    tensors = {}
    for name, (a, b) in raw.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
    d = tmp_path / "mine"
    d.mkdir()
    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 2,
        "target_modules": ["query", "value", "heads"],
    }
    (d / "adapter_config.json").write_text(json.dumps(config))
    write_safetensors(d / "adapter_model.safetensors", tensors)
    mgr = LRUCacheLoRAModelManager(model, CFG)
    (adapter,) = mgr.load_adapters({"mine": d}, activate=True, progress=False)
    slot = mgr.slot_of(adapter.id)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, E)), jnp.float32)
    got = np.asarray(_step(model, x, jnp.asarray(np.repeat([slot, -1], 5), jnp.int32)))
    scaled = {k: (a, b * 0.5) for k, (a, b) in raw.items()}  # alpha / r = 0.5
    want = _oracle(model, {slot: scaled}, np.asarray(x), [slot, -1])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_layouts_that_are_not_one_flat_linear_are_refused_or_left_alone():
    class Odd(nnx.Module):
        def __init__(self, rngs):
            # a kernel per head (n in x, kernel and output): not one flat linear map
            self.grouped = nnx.Einsum("bnd,ndh->bnh", (2, E, 4), rngs=rngs)
            self.per_batch = nnx.LinearGeneral(E, 4, batch_axis={0: 2}, rngs=rngs)
            self.fine = nnx.Einsum("td,df->tf", (E, 4), rngs=rngs)

    model = Odd(nnx.Rngs(0))
    wrap_model(model, CFG)  # every supported module: the two odd ones stay as they are
    assert sorted(lora_layers(model)) == ["fine"]
    for name, match in [
        ("grouped", "in x, kernel and output"),
        ("per_batch", "batch_axis"),
    ]:
        with pytest.raises(ValueError, match=match):
            (lj.FlaxLinearGeneralWithLoRA if name == "per_batch" else lj.FlaxEinsumWithLoRA)(
                getattr(model, name), CFG, name=name
            )
    with pytest.raises(ValueError, match="match no supported module.*grouped: einsum 'bnd,ndh"):
        wrap_model(model, CFG, target_modules=["grouped"])
    for eq, match in [
        ("ii,ij->ij", "distinct letters"),
        ("td,df->t", "summed out"),
        ("td,...f->tf", "ellipsis in the kernel"),
        ("td,df", "x,kernel->out"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_einsum(eq, 2)
    # a call-time equation that contracts the other kernel axis is refused by name
    fine = model.fine
    fine.set_lora(0, np.ones((2, E)), np.ones((4, 2)))
    fine.lora_context.set_value(lj.make_lora_mapping(jnp.zeros((3,), jnp.int32), 3))
    with pytest.raises(ValueError, match="fine: einsum 'tf,df->td' contracts kernel axes"):
        fine(jnp.ones((3, 4)), "tf,df->td")


def test_merging_a_custom_einsum_op_or_dot_general_is_refused():
    def half(eq, *ops, **kw):
        return 0.5 * jnp.einsum(eq, *ops, **kw)

    def half_dot(x, k, *args, **kwargs):
        return 0.5 * jax.lax.dot_general(x, k, *args, **kwargs)

    class Scaled(nnx.Module):
        def __init__(self, rngs):
            self.e = nnx.Einsum("td,df->tf", (E, 4), einsum_op=half, rngs=rngs)
            self.g = nnx.LinearGeneral(E, 4, dot_general=half_dot, rngs=rngs)

    model = Scaled(nnx.Rngs(0))
    wrap_model(model, CFG)
    model.e.set_lora(0, np.ones((2, E)), np.ones((4, 2)))
    model.g.set_lora(1, np.ones((2, E)), np.ones((4, 2)))
    with pytest.raises(ValueError, match="own einsum_op"):
        merge_adapter(model, 0)
    with pytest.raises(ValueError, match="own dot_general"):
        merge_adapter(model, 1)


def test_multi_head_projections_on_an_explicit_mesh():
    """Batch-sharded x through `nnx.MultiHeadAttention` on an Explicit mesh, and a
    `LinearGeneral` with its own `out_sharding` over the heads: flattening tokens and
    heads in one reshape was refused there; the LoRA path now equals the base for -1
    tokens and the unsharded LoRA run for an adapter."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(4, 3, E)).astype(np.float32)
    a, b = rng.normal(size=(4, E)) * 0.3, rng.normal(size=(E, 4)) * 0.3

    def build():
        m = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=E, qkv_features=E, decode=False, rngs=nnx.Rngs(0)
        )
        wrap_model(m, CFG)
        m.query.set_lora(1, a, b)
        return m

    @nnx.jit
    def step(m, x, idx):
        with lj.lora_mapping(m, idx):
            return m(x)

    slots = jnp.asarray(np.tile([1, -1, 1], 4), jnp.int32)
    want = np.asarray(step(build(), jnp.asarray(xs), slots))  # unsharded
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.asarray(xs), NamedSharding(mesh, P("data")))
        got = np.asarray(step(build(), x, slots))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        lg = nnx.LinearGeneral(E, (HEADS, HD), rngs=nnx.Rngs(0))
        layer = lj.FlaxLinearGeneralWithLoRA(lg, CFG)
        heads = P(None, None, "model", None)
        base = nnx.jit(lambda lin, x: lin(x, out_sharding=heads))(lg, jnp.asarray(xs))

        @nnx.jit
        def f(lin, x, idx):
            with lj.lora_mapping(lin, idx):
                return lin(x, out_sharding=heads)

        out = f(layer, jnp.asarray(xs), jnp.full((12,), -1, jnp.int32))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(base))


@pytest.mark.parametrize("axis", [(1, -2), (-2, 1)])
def test_a_linear_general_whose_axes_mix_signs_wraps_and_matches_the_oracle(axis):
    """`axis=(1, -2)` contracts x axes 1 and 2 of a 4-D x (axes 1 and 3 of a 5-D one): a
    valid layer, wrapped with every supported module, whose per-token LoRA matches the
    folded-kernel oracle (numpy, float64) for either x rank."""

    class Net(nnx.Module):
        def __init__(self):
            self.g = nnx.LinearGeneral((3, 5), (2,), axis=axis, rngs=nnx.Rngs(0))

    model = Net()
    src = model.g
    wrap_model(model, CFG)
    assert list(lora_layers(model)) == ["g"] and model.g.base_layer.source is src
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 15)), rng.normal(size=(2, 4))
    model.g.set_lora(1, a, b)
    folded = _fold(src.kernel[...], "bijt,ijf->btf", a, b)
    plain = np.asarray(src.kernel[...], np.float64)
    for x_shape, eq in [((2, 3, 5, 7), "bijt,ijf->btf"), ((2, 3, 4, 5, 6), "bisjt,ijf->bstf")]:
        x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
        tokens = [n for i, n in enumerate(x_shape) if i not in (1, len(x_shape) - 2)]
        slots = rng.choice([1, -1], size=int(np.prod(tokens)))
        model.g.lora_context.set_value(lj.make_lora_mapping(jnp.asarray(slots, jnp.int32), 3))
        got = np.asarray(model.g(x))
        xs = np.asarray(x, np.float64)
        want = np.where(
            (slots.reshape(tokens) >= 0)[..., None],
            np.einsum(eq, xs, folded),
            np.einsum(eq, xs, plain),
        ) + np.asarray(src.bias[...])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["LinearGeneral", "Einsum"])
def test_stacked_linear_general_and_einsum_are_refused_by_name(kind):
    """Stacked layers (`nnx.vmap`: a kernel with a leading layer axis) are refused naming
    them, as stacked `nnx.Linear` / `nnx.Embed` are, not silently left without LoRA."""

    def make(rngs):
        if kind == "LinearGeneral":
            return nnx.LinearGeneral(E, (2, 2), rngs=rngs)
        return nnx.Einsum("td,df->tf", (E, 4), rngs=rngs)

    class Scanned(nnx.Module):
        def __init__(self):
            self.stacked = nnx.vmap(make, in_axes=0, out_axes=0)(nnx.Rngs(0).split(3))
            self.other = nnx.Linear(E, E, rngs=nnx.Rngs(1))

    model = Scanned()
    other = model.other
    with pytest.raises(ValueError, match=rf"stacked: an nnx\.{kind}.*kernel of shape \(3, 16,"):
        wrap_model(model, CFG)
    assert model.other is other and lora_layers(model) == {}
    wrap_model(model, CFG, target_modules=["other"])  # left out by name: the rest wraps
    assert list(lora_layers(model)) == ["other"]


def test_wrapped_linear_general_and_einsum_read_as_their_sources():
    """Every public field of the source `nnx.LinearGeneral` / `nnx.Einsum` reads the very
    same object through its LoRA layer (`layer.kernel[...]` is the source's kernel)."""
    lg = nnx.LinearGeneral(E, (HEADS, HD), rngs=nnx.Rngs(0))
    ein = nnx.Einsum("btd,ndh->btnh", (HEADS, E, HD), rngs=nnx.Rngs(1))
    for source, cls in [(lg, lj.FlaxLinearGeneralWithLoRA), (ein, lj.FlaxEinsumWithLoRA)]:
        layer = cls(source, CFG)
        for name in sorted(k for k in vars(source) if not k.startswith("_")):
            assert getattr(layer, name) is getattr(source, name), (cls.__name__, name)
        np.testing.assert_array_equal(layer.kernel[...], np.asarray(source.kernel[...]))
        with pytest.raises(AttributeError, match="cannot be set on its LoRA layer"):
            layer.kernel = nnx.Param(jnp.zeros(source.kernel.shape))
        assert layer.kernel is source.kernel
