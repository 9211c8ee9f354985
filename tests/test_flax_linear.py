"""`wrap_model` on a plain Flax NNX model built from `nnx.Linear` (not lora_jax's linears):
the base forward unchanged, per-token LoRA against a numpy oracle, PEFT loading through
the manager, merging, and `unwrap_model` giving back the very same modules."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax as lj
from lora_jax.serving.manager import LRUCacheLoRAModelManager
from lora_jax.serving.merge import merge_adapter, unmerge_adapter
from lora_jax.serving.peft import write_safetensors
from lora_jax.serving.wrap import lora_layers, unwrap_model, wrap_model

D, F = 16, 32


class Block(nnx.Module):
    """A user's own block: attention-like projections and an MLP, plain `nnx.Linear`s
    (one in bf16 compute with f32 weights, one without a bias)."""

    def __init__(self, rngs: nnx.Rngs):
        self.q_proj = nnx.Linear(D, D, rngs=rngs)
        self.v_proj = nnx.Linear(D, D, dtype=jnp.bfloat16, rngs=rngs)
        self.up_proj = nnx.Linear(D, F, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(F, D, rngs=rngs)

    def __call__(self, x):
        h = self.q_proj(x) + self.v_proj(x).astype(jnp.float32)
        return self.down_proj(jax.nn.relu(self.up_proj(h)))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([Block(rngs), Block(rngs)])

    def __call__(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


CFG = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
MODULES = ("q_proj", "v_proj", "up_proj", "down_proj")


def _adapter(seed, rank=4):
    """{module path: (A [r, in], B [out, r])} for every linear of the model."""
    rng = np.random.default_rng(seed)
    sizes = {"q_proj": (D, D), "v_proj": (D, D), "up_proj": (D, F), "down_proj": (F, D)}
    return {
        f"layers.{i}.{m}": (
            rng.normal(0, 0.3, (rank, sizes[m][0])).astype(np.float32),
            rng.normal(0, 0.3, (sizes[m][1], rank)).astype(np.float32),
        )
        for i in range(2)
        for m in MODULES
    }


def _oracle(model, adapters, x, slots):
    """Each token through the unwrapped math with its adapter's `B @ A` added to the
    kernels (float64 numpy; bf16 compute rounded as the layer does)."""
    out = []
    for t, slot in enumerate(slots):
        h = np.asarray(x[t], np.float64)
        for i, block in enumerate(model.layers):

            def lin(name, v, block=block, i=i, slot=slot):
                base = getattr(block, name)
                base = getattr(base, "base_layer", base)
                base = getattr(base, "source", base)
                w = np.asarray(base.kernel[...], np.float64)
                key = f"layers.{i}.{name}"
                if slot >= 0 and key in adapters[slot]:
                    a, b = adapters[slot][key]
                    w = w + (b.astype(np.float64) @ a.astype(np.float64)).T
                y = v @ w
                if base.bias is not None:
                    y = y + np.asarray(base.bias[...], np.float64)
                return y

            z = lin("q_proj", h) + lin("v_proj", h)
            h = h + lin("down_proj", np.maximum(lin("up_proj", z), 0.0))
        out.append(h)
    return np.stack(out)


@nnx.jit
def _step(model, x, idx):
    with lj.lora_mapping(model, idx):
        return model(x)


def test_plain_flax_model_wraps_serves_and_unwraps():
    model = Model(nnx.Rngs(0))
    originals = {(n, m): getattr(b, m) for n, b in enumerate(model.layers) for m in MODULES}
    x = jnp.asarray(np.random.default_rng(1).normal(size=(6, D)), jnp.float32)
    y_base = np.asarray(nnx.jit(lambda m, x: m(x))(model, x))
    wrap_model(model, CFG)
    layers = lora_layers(model)
    assert sorted(layers) == sorted(f"layers.{i}.{m}" for i in range(2) for m in MODULES)
    assert all(type(v) is lj.FlaxLinearWithLoRA for v in layers.values())
    kernel = originals[0, "q_proj"].kernel
    assert layers["layers.0.q_proj"].base_layer.kernel is kernel  # shared, not copied
    # no adapter anywhere: exactly the base forward (bf16 compute included)
    np.testing.assert_array_equal(np.asarray(_step(model, x, jnp.full(6, -1, jnp.int32))), y_base)
    adapters = {0: _adapter(1), 1: _adapter(2, rank=8)}
    for slot, ad in adapters.items():
        for name, (a, b) in ad.items():
            layers[name].set_lora(slot, a, b)
    slots = np.array([1, -1, 0, 1, 0, -1], np.int32)
    got = np.asarray(_step(model, x, jnp.asarray(slots)))
    want = _oracle(model, adapters, np.asarray(x), slots)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    np.testing.assert_array_equal(got[slots < 0], y_base[slots < 0])
    assert unwrap_model(model) == 8
    for (n, m), module in originals.items():
        assert getattr(model.layers[n], m) is module
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(model, x)), y_base)


def test_plain_flax_model_loads_peft_adapters_and_merges(tmp_path):
    """PEFT checkpoints keyed by the model's own module paths load through the manager
    (scaling folded into B); merging a slot gives that adapter's outputs with the base
    matmuls only, and unmerging restores the kernels bit for bit."""
    model = Model(nnx.Rngs(3))
    wrap_model(model, CFG, target_modules=["q_proj", "down_proj"])
    assert sorted(lora_layers(model)) == [
        "layers.0.down_proj", "layers.0.q_proj", "layers.1.down_proj", "layers.1.q_proj",
    ]  # fmt: skip
    raw = {k: v for k, v in _adapter(5).items() if k.endswith(("q_proj", "down_proj"))}
    tensors = {}
    for name, (a, b) in raw.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
    d = tmp_path / "mine"
    d.mkdir()
    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "down_proj"],
    }
    (d / "adapter_config.json").write_text(json.dumps(config))
    write_safetensors(d / "adapter_model.safetensors", tensors)
    mgr = LRUCacheLoRAModelManager(model, CFG)
    (adapter,) = mgr.load_adapters({"mine": d}, activate=True, progress=False)
    slot = mgr.slot_of(adapter.id)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, D)), jnp.float32)
    slots = np.array([slot, -1, slot, slot], np.int32)
    got = np.asarray(_step(model, x, jnp.asarray(slots)))
    scaled = {k: (a, b * 2.0) for k, (a, b) in raw.items()}  # alpha / r = 2
    want = _oracle(model, {slot: scaled}, np.asarray(x), slots)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    kernel = np.asarray(model.layers[0].q_proj.base_layer.kernel[...])
    assert merge_adapter(model, slot) == 4
    merged = np.asarray(nnx.jit(lambda m, x: m(x))(model, x))
    np.testing.assert_allclose(merged[0], got[0], rtol=1e-4, atol=1e-4 * np.abs(got).max())
    unmerge_adapter(model)
    np.testing.assert_array_equal(np.asarray(model.layers[0].q_proj.base_layer.kernel[...]), kernel)


def test_a_wrapper_refuses_what_is_not_an_nnx_linear():
    with pytest.raises(ValueError, match="flax.nnx.Linear"):
        lj.FlaxLinearWithLoRA(lj.ReplicatedLinear(4, 4, rngs=nnx.Rngs(0)), CFG)


def test_out_sharding_calls_on_explicit_and_auto_meshes():
    """A model that calls its `nnx.Linear` with `out_sharding` (Explicit axes need it when
    the contracting dim is sharded) keeps working once wrapped, LoRA included, and gives
    the per-token numpy oracle's outputs; on Auto axes too."""
    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, {jax.device_count()} visible")
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(1)
    a1, b1 = rng.normal(size=(4, 16)) * 0.3, rng.normal(size=(32, 4)) * 0.3
    a2, b2 = rng.normal(size=(4, 32)) * 0.3, rng.normal(size=(16, 4)) * 0.3
    idx = np.array([1, -1, 1, 1, -1, 1, 0, 1], np.int32)
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))

        class Sharded(nnx.Module):
            out = P("data", None) if kind == AxisType.Explicit else None

            def __init__(self, rngs):
                self.up = nnx.Linear(16, 32, rngs=rngs)
                self.down = nnx.Linear(32, 16, rngs=rngs)

            def __call__(self, x):
                return self.down(jax.nn.relu(self.up(x)), out_sharding=self.out)

        with jax.set_mesh(mesh):
            model = Sharded(nnx.Rngs(0))
            for lin, spec in ((model.up, P(None, "model")), (model.down, P("model", None))):
                lin.kernel.set_value(jax.device_put(lin.kernel[...], NamedSharding(mesh, spec)))
            x = jax.device_put(
                jnp.asarray(rng.normal(size=(8, 16)), jnp.float32), NamedSharding(mesh, P("data"))
            )
            wrap_model(model, CFG)
            model.up.set_lora(1, a1, b1)
            model.down.set_lora(1, a2, b2)
            got = np.asarray(_step(model, x, jnp.asarray(idx)))
        k = {n: getattr(model, n).base_layer.source for n in ("up", "down")}
        w_up, w_down = (np.asarray(k[n].kernel[...], np.float64) for n in ("up", "down"))
        c_up, c_down = (np.asarray(k[n].bias[...], np.float64) for n in ("up", "down"))
        want, xs = [], np.asarray(x, np.float64)
        for t, slot in enumerate(idx):
            on = slot == 1
            h = xs[t] @ (w_up + ((b1 @ a1).T if on else 0)) + c_up
            want.append(np.maximum(h, 0) @ (w_down + ((b2 @ a2).T if on else 0)) + c_down)
        np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-5)


def test_wrap_takes_fused_names_dicts_and_refuses_tuples_before_any_change():
    """An `nnx.Linear` named like a packed module (`qkv_proj`) is one checkpoint module of
    its own; layers held in a dict are wrapped; a model with layers in a tuple is refused
    before anything is swapped; a tied-looking plain model (`nnx.Embed`, `lm_head=None`)
    gets its linears and its embedding wrapped (`FlaxEmbedWithLoRA`), no lm_head made up."""

    class Fused(nnx.Module):
        def __init__(self, rngs):
            self.qkv_proj = nnx.Linear(D, 3 * D, rngs=rngs)
            self.heads = nnx.data({"x": nnx.Linear(D, D, rngs=rngs)})

    model = Fused(nnx.Rngs(0))
    wrap_model(model, CFG)
    assert sorted(lora_layers(model)) == ["heads.x", "qkv_proj"]
    assert lora_layers(model)["qkv_proj"].packed_modules == ("qkv_proj",)

    class InTuple(nnx.Module):
        def __init__(self, rngs):
            self.o_proj = nnx.Linear(D, D, rngs=rngs)
            self.pair = nnx.data((nnx.Linear(D, D, rngs=rngs), nnx.Linear(D, D, rngs=rngs)))

    model = InTuple(nnx.Rngs(0))
    o_proj = model.o_proj
    with pytest.raises(ValueError, match="sits in a tuple"):
        wrap_model(model, CFG)
    assert model.o_proj is o_proj  # nothing swapped

    class Inner(nnx.Module):
        def __init__(self, rngs):
            self.embed_tokens = nnx.Embed(64, D, rngs=rngs)
            self.q_proj = nnx.Linear(D, D, rngs=rngs)

    class TiedLooking(nnx.Module):
        def __init__(self, rngs):
            self.model = Inner(rngs)
            self.lm_head = None

    model = TiedLooking(nnx.Rngs(0))
    wrap_model(model, CFG)
    assert sorted(lora_layers(model)) == ["model.embed_tokens", "model.q_proj"]
    assert type(model.model.embed_tokens) is lj.FlaxEmbedWithLoRA and model.lm_head is None


def test_merge_refuses_a_slot_on_tied_kernels():
    """Two `nnx.Linear`s sharing one kernel: an adapter on one of them cannot be merged
    into the shared kernel (it would reach the other); refused with nothing changed."""

    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.enc = nnx.Linear(8, 8, rngs=rngs)
            self.dec = nnx.Linear(8, 8, rngs=rngs)
            self.dec.kernel = self.enc.kernel

    model = Tied(nnx.Rngs(0))
    wrap_model(model, CFG)
    model.dec.set_lora(0, np.ones((2, 8), np.float32), np.ones((8, 2), np.float32))
    kernel = np.asarray(model.enc.base_layer.kernel[...])
    with pytest.raises(
        ValueError, match=r"share one weight with each other and \['dec'\] hold an adapter"
    ):
        merge_adapter(model, 0)
    np.testing.assert_array_equal(np.asarray(model.enc.base_layer.kernel[...]), kernel)
    assert merge_adapter(model, 1) == 0  # an empty slot: nothing to merge, nothing changed
    np.testing.assert_array_equal(np.asarray(model.enc.base_layer.kernel[...]), kernel)
    unmerge_adapter(model)


def test_shared_and_stacked_linears_are_refused_and_outside_kernels_never_merged():
    """One `nnx.Linear` reached from two attributes would get LoRA at one place only:
    refused, naming both (nothing swapped). Stacked layers (`nnx.vmap`, kernel
    `[L, in, out]`) are refused. A kernel that an unwrapped module also holds is never
    merged: the slot is refused while it has an adapter there."""

    class Shared(nnx.Module):
        def __init__(self, rngs):
            lin = nnx.Linear(D, D, rngs=rngs)
            self.enc, self.dec = lin, lin

    model = Shared(nnx.Rngs(0))
    lin = model.enc
    with pytest.raises(ValueError, match=r"reached from 2 places \['dec', 'enc'\]"):
        wrap_model(model, CFG)
    assert model.enc is lin and model.dec is lin

    @nnx.vmap(in_axes=0, out_axes=0)
    def stacked(key):
        return nnx.Linear(D, D, rngs=nnx.Rngs(key))

    class Scanned(nnx.Module):
        def __init__(self):
            self.q_proj = stacked(jax.random.split(jax.random.key(0), 3))

    with pytest.raises(ValueError, match=r"q_proj: .*kernel of shape \(3, 16, 16\): stacked"):
        wrap_model(Scanned(), CFG)

    class TiedKernel(nnx.Module):
        def __init__(self, rngs):
            self.q_proj = nnx.Linear(D, D, rngs=rngs)
            self.v_proj = nnx.Linear(D, D, rngs=rngs)
            self.v_proj.kernel = self.q_proj.kernel  # v_proj will not be wrapped

    model = TiedKernel(nnx.Rngs(0))
    wrap_model(model, CFG, target_modules=["q_proj"])
    rng = np.random.default_rng(0)
    model.q_proj.set_lora(0, rng.normal(size=(4, D)), rng.normal(size=(D, 4)))
    before = np.asarray(model.v_proj.kernel[...])
    with pytest.raises(ValueError, match="share one weight with modules outside the LoRA layers"):
        merge_adapter(model, 0)
    np.testing.assert_array_equal(np.asarray(model.v_proj.kernel[...]), before)
    assert merge_adapter(model, 1) == 0  # an empty slot: nothing to merge there
    unmerge_adapter(model)


def test_rewrapping_with_other_slots_and_merging_a_custom_dot_general_are_refused():
    """`wrap_model` again with another slot count / rank would mix layers of two configs:
    refused (the same config adds layers, as before). An `nnx.Linear` with its own
    `dot_general` (a scaled or quantized matmul) cannot take B @ A into its kernel."""
    model = Model(nnx.Rngs(0))
    wrap_model(model, CFG, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"built with .* = \(2, 8, False, None\), not \(4, 16"):
        wrap_model(model, lj.LoRAConfig(max_loras=4, max_lora_rank=16))
    wrap_model(model, CFG, target_modules=["v_proj"])  # the same config: more layers
    assert len(lora_layers(model)) == 4

    def half_dot(x, k, *args, **kwargs):
        return 0.5 * jax.lax.dot_general(x, k, *args, **kwargs)

    class Scaled(nnx.Module):
        def __init__(self, rngs):
            self.q_proj = nnx.Linear(D, D, dot_general=half_dot, rngs=rngs)
            self.v_proj = nnx.Linear(D, D, rngs=rngs)

    model = Scaled(nnx.Rngs(0))
    wrap_model(model, CFG)
    rng = np.random.default_rng(0)
    model.q_proj.set_lora(0, rng.normal(size=(4, D)), rng.normal(size=(D, 4)))
    model.v_proj.set_lora(1, rng.normal(size=(4, D)), rng.normal(size=(D, 4)))
    with pytest.raises(ValueError, match="'q_proj' .* own dot_general"):
        merge_adapter(model, 0)
    assert merge_adapter(model, 1) == 1  # the plain one merges; q_proj's slot 1 is empty
    unmerge_adapter(model)


def test_a_wrapped_linear_reads_as_the_nnx_linear_it_wraps():
    """User code reading the layer's fields (`h @ layer.kernel[...].T`, a tied decode)
    runs unchanged after `wrap_model`: every public field of the `nnx.Linear` reads the
    very same object through its LoRA layer; setting one there is refused (a new kernel
    would part the served weight from the LoRA's base), except nnx's `set_attributes`,
    which sets the source first and then passes the same value on."""

    class TiedProj(nnx.Module):
        def __init__(self, rngs):
            self.inp = nnx.Linear(D, F, rngs=rngs)

        def __call__(self, x):
            return self.inp(x) @ self.inp.kernel[...].T  # decode with the input projection

    model = TiedProj(nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, D)), jnp.float32)
    before = model(x)
    source = model.inp
    wrap_model(model, CFG)
    assert isinstance(model.inp, lj.FlaxLinearWithLoRA)
    for name in sorted(k for k in vars(source) if not k.startswith("_")):
        assert getattr(model.inp, name) is getattr(source, name), name
    np.testing.assert_array_equal(model(x), before)  # no mapping set: the base output
    with pytest.raises(AttributeError, match=r"inp: \.kernel is read from the wrapped Linear"):
        model.inp.kernel = nnx.Param(jnp.zeros((D, F)))
    assert model.inp.kernel is source.kernel
    graphdef, state = nnx.split(model)  # the fields are not graph attributes of the wrapper
    merged = nnx.merge(graphdef, state)
    assert merged.inp.kernel is merged.inp.base_layer.kernel
    np.testing.assert_array_equal(merged(x), before)
    model.set_attributes(precision=jax.lax.Precision.HIGHEST)
    assert model.inp.precision is source.precision is jax.lax.Precision.HIGHEST
