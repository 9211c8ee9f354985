"""wrap_model / unwrap_model / merge_adapter on a tiny HF-named model, with and without meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from serving_toy import ToyLM, tiny_mixtral

import lora_jax as lj
from lora_jax.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from lora_jax.serving.merge import merge_adapter, merged_slot, unmerge_adapter
from lora_jax.serving.wrap import LORA_LAYER_CLASSES, lora_layers, unwrap_model, wrap_model

# jax 0.10.2 segfaulted in the compile cache on these tests' programs (tests/conftest.py)
pytestmark = pytest.mark.no_compile_cache

CFG = lj.LoRAConfig(max_loras=3, max_lora_rank=8)
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
T = 8


def _mesh(tp, dp=1, explicit=True):
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh((dp, tp), ("dp", "tp"), axis_types=(kind, kind))


def _x(n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(T, n)), jnp.float32)


def _kinds(model):
    return {name: type(layer).__name__ for name, layer in lora_layers(model).items()}


def test_replace_submodules_all_targets():
    model = ToyLM()
    base = {n: getattr(model.model.layers[0].self_attn, n) for n in ("qkv_proj", "o_proj")}
    ctx = wrap_model(model, CFG, packed_modules_mapping=PACKED)
    kinds = _kinds(model)
    assert kinds == {
        **{
            f"model.layers.{i}.{m}": c
            for i in range(2)
            for m, c in [
                ("self_attn.qkv_proj", "MergedQKVParallelLinearWithLoRA"),
                ("self_attn.o_proj", "RowParallelLinearWithLoRA"),
                ("mlp.gate_up_proj", "MergedColumnParallelLinearWithLoRA"),
                ("mlp.down_proj", "RowParallelLinearWithLoRA"),
            ]
        },
        "model.proj": "ReplicatedLinearWithLoRA",
    }
    layers = lora_layers(model)
    assert all(layer.lora_context is ctx for layer in layers.values())
    assert layers["model.layers.0.self_attn.qkv_proj"].packed_modules == (
        "q_proj",
        "k_proj",
        "v_proj",
    )
    assert layers["model.layers.0.self_attn.qkv_proj"].base_layer is base["qkv_proj"]
    assert layers["model.layers.0.self_attn.o_proj"].name == "model.layers.0.self_attn.o_proj"
    assert lj.find_lora_context(model) is ctx


def test_wrapped_model_equals_base_without_adapters():
    x = _x(32)
    ref = ToyLM()(x)
    model = ToyLM()
    wrap_model(model, CFG, packed_modules_mapping=PACKED)
    np.testing.assert_array_equal(model(x), ref)  # no mapping: base path
    lj.set_lora_mapping(model, jnp.full((T,), -1, jnp.int32))
    np.testing.assert_array_equal(model(x), ref)  # -1 tokens: exactly the base output
    lj.set_lora_mapping(model, jnp.zeros((T,), jnp.int32))
    np.testing.assert_array_equal(model(x), ref)  # empty slots: exactly the base output


def test_target_modules_list_and_packed():
    model = ToyLM()
    wrap_model(model, CFG, target_modules=["k_proj", "down_proj"], packed_modules_mapping=PACKED)
    assert sorted(_kinds(model)) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.1.self_attn.qkv_proj",
    ]
    # Full-path names select one layer only.
    model = ToyLM()
    wrap_model(model, CFG, target_modules=["layers.1.mlp.gate_proj"], packed_modules_mapping=PACKED)
    assert list(_kinds(model)) == ["model.layers.1.mlp.gate_up_proj"]


def test_target_modules_regex():
    model = ToyLM()
    wrap_model(
        model,
        CFG,
        target_modules=r"model\.layers\.0\..*(o_proj|up_proj)",
        packed_modules_mapping=PACKED,
    )
    assert sorted(_kinds(model)) == [
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.self_attn.o_proj",
    ]


@pytest.mark.parametrize("targets", [["q_proj", "nonexistent"], r".*\.nothing", ["proj."]])
def test_unknown_targets_raise_and_change_nothing(targets):
    model = ToyLM()
    with pytest.raises(ValueError, match="target_modules"):
        wrap_model(model, CFG, target_modules=targets, packed_modules_mapping=PACKED)
    assert lora_layers(model) == {}
    assert lj.find_lora_context(model) is None


def test_without_packed_mapping_layers_are_single_modules():
    model = ToyLM()
    wrap_model(model, CFG, packed_modules_mapping={})
    kinds = _kinds(model)
    assert kinds["model.layers.0.self_attn.qkv_proj"] == "QKVParallelLinearWithLoRA"
    assert kinds["model.layers.0.mlp.gate_up_proj"] == "ColumnParallelLinearWithLoRA"
    assert lora_layers(model)["model.layers.0.self_attn.qkv_proj"].packed_modules == ("qkv_proj",)


@pytest.mark.parametrize(
    "packed",
    [
        {"qkv_proj": "q_proj"},  # a str was read one character per member
        ["qkv_proj"],
        {"qkv_proj": ["q_proj", 3]},
        {"qkv_proj": []},
        {"qkv_proj": ["q_proj", ""]},
    ],
)
def test_a_packed_mapping_that_is_not_names_to_name_lists_is_refused(packed):
    model = ToyLM()
    with pytest.raises(ValueError, match="wrap_model: packed_modules_mapping"):
        wrap_model(model, CFG, packed_modules_mapping=packed)
    assert lora_layers(model) == {}
    assert lj.find_lora_context(model) is None


def test_a_packed_mapping_of_tuples_wraps_as_one_of_lists():
    want, got = ToyLM(), ToyLM()
    wrap_model(want, CFG, packed_modules_mapping=PACKED)
    wrap_model(got, CFG, packed_modules_mapping={k: tuple(v) for k, v in PACKED.items()})
    assert _kinds(got) == _kinds(want)
    assert {n: m.packed_modules for n, m in lora_layers(got).items()} == {
        n: m.packed_modules for n, m in lora_layers(want).items()
    }


def test_fully_sharded_picks_sharded_classes():
    rules = lj.ShardingRules(_mesh(2))
    model = ToyLM(rules=rules)
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, fully_sharded_loras=True)
    wrap_model(model, cfg, packed_modules_mapping=PACKED)
    kinds = _kinds(model)
    assert kinds["model.layers.0.self_attn.qkv_proj"] == "MergedQKVParallelLinearWithShardedLoRA"
    assert kinds["model.layers.0.self_attn.o_proj"] == "RowParallelLinearWithShardedLoRA"
    assert kinds["model.layers.0.mlp.gate_up_proj"] == "MergedColumnParallelLinearWithShardedLoRA"
    assert kinds["model.proj"] == "ReplicatedLinearWithLoRA"


def test_unwrap_restores_base_layers_and_wrap_is_incremental():
    model = ToyLM()
    originals = [layer.self_attn.o_proj for layer in model.model.layers]
    ctx = wrap_model(model, CFG, target_modules=["o_proj"], packed_modules_mapping=PACKED)
    ctx2 = wrap_model(
        model, CFG, target_modules=["down_proj", "o_proj"], packed_modules_mapping=PACKED
    )
    assert ctx2 is ctx
    assert len(lora_layers(model)) == 4  # o_proj not wrapped twice
    assert unwrap_model(model) == 4
    assert lora_layers(model) == {}
    assert [layer.self_attn.o_proj for layer in model.model.layers] == originals
    assert isinstance(model.model.layers[0].mlp.down_proj, RowParallelLinear)


def test_registry_is_extensible():
    class Marker(lj.ReplicatedLinearWithLoRA):
        @classmethod
        def can_replace_layer(cls, source_layer, lora_config, packed_modules_list=()):
            return isinstance(source_layer, lj.ReplicatedLinear)

    LORA_LAYER_CLASSES.insert(0, Marker)
    try:
        model = ToyLM()
        wrap_model(model, CFG, target_modules=["proj"], packed_modules_mapping=PACKED)
        assert _kinds(model) == {"model.proj": "Marker"}
    finally:
        LORA_LAYER_CLASSES.remove(Marker)


# -- merge ------------------------------------------------------------------------------------
def _fill(model, seed=1):
    """Random adapters of mixed ranks into every slot of every LoRA layer."""
    rng = np.random.default_rng(seed)
    for layer in lora_layers(model).values():
        n_in = layer.base_layer.in_features
        for slot, r in enumerate((8, 4, 2)):
            a = [rng.normal(size=(r, n_in)).astype(np.float32) / 4 for _ in layer.slice_groups]
            b = [rng.normal(size=(n, r)).astype(np.float32) / 4 for n in layer.logical_slice_sizes]
            layer.set_lora(slot, a, b)


@nnx.jit
def _run_layers(model, xs):
    return {name: layer(xs[name]) for name, layer in lora_layers(model).items()}


def _layer_outputs(model):
    """Every LoRA layer on its own input, in one jitted call."""
    xs = {
        name: _x(layer.base_layer.in_features, seed=len(name))
        for name, layer in lora_layers(model).items()
    }
    return jax.tree.map(np.asarray, _run_layers(model, xs))


MERGE_CASES = {
    "nomesh": (None, False, True),
    "tp4": ((4, 1), False, True),  # 2 kv heads on 4 shards: kv replicas
    "dp2tp4-auto": ((4, 2), False, False),
    "tp2-fully-sharded": ((2, 1), True, True),
    "tp4-fully-sharded": ((4, 2), True, True),
}


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_merge_matches_lora_path_and_unmerge_restores(case):
    mesh_shape, fully, explicit = MERGE_CASES[case]
    rules = (
        lj.ShardingRules(_mesh(*mesh_shape, explicit=explicit))
        if mesh_shape
        else lj.ShardingRules()
    )
    model = ToyLM(n_layers=1, rules=rules)
    cfg = lj.LoRAConfig(max_loras=3, max_lora_rank=8, fully_sharded_loras=fully)
    ctx = wrap_model(model, cfg, packed_modules_mapping=PACKED)
    _fill(model)
    layers = lora_layers(model)
    kernels = {n: layer.base_layer.kernel[...] for n, layer in layers.items()}
    ctx.set_value(None)
    base_out = _layer_outputs(model)
    slot = 1
    lj.set_lora_mapping(model, jnp.full((T,), slot, jnp.int32))
    lora_out = _layer_outputs(model)
    assert merge_adapter(model, slot) == len(layers)
    assert merged_slot(model) == slot and ctx.get_value() is None
    merged_out = _layer_outputs(model)
    for name in layers:
        assert np.abs(lora_out[name] - base_out[name]).max() > 1e-2  # the adapter matters
        np.testing.assert_allclose(merged_out[name], lora_out[name], rtol=1e-5, atol=1e-5)
        k = layers[name].base_layer.kernel[...]
        assert k.sharding.is_equivalent_to(kernels[name].sharding, k.ndim)
    with pytest.raises(ValueError, match="already merged"):
        merge_adapter(model, 0)
    assert unmerge_adapter(model) is True
    assert unmerge_adapter(model) is False
    for name, layer in layers.items():
        np.testing.assert_array_equal(layer.base_layer.kernel[...], kernels[name])
    for name, y in _layer_outputs(model).items():
        np.testing.assert_array_equal(y, base_out[name])


def test_merge_bad_slot_changes_nothing():
    model = ToyLM()
    wrap_model(model, CFG, packed_modules_mapping=PACKED)
    before = nnx.state(model, nnx.Param)
    with pytest.raises(ValueError, match="slot"):
        merge_adapter(model, 3)
    after = nnx.state(model, nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert merged_slot(model) is None


def test_merge_whole_model_output():
    """Unsharded whole-model check: merged base path == LoRA path for slot 0."""
    model = ToyLM()
    wrap_model(model, CFG, packed_modules_mapping=PACKED)
    _fill(model, seed=3)
    x = _x(32, seed=5)
    lj.set_lora_mapping(model, jnp.zeros((T,), jnp.int32))
    y_lora = model(x)
    merge_adapter(model, 0)
    scale = float(np.abs(y_lora).max())
    np.testing.assert_allclose(model(x), y_lora, rtol=1e-5, atol=1e-5 * scale)
    unmerge_adapter(model)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.base_layer, QKVParallelLinear)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj.base_layer, MergedColumnParallelLinear)


def test_merge_a_moe_model_whole_output():
    """A Mixtral-shaped model with q_proj and expert LoRA: the merged model (experts
    included) gives the LoRA path's logits, and unmerge restores every weight."""
    model = tiny_mixtral()
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    wrap_model(model, cfg, target_modules=["q_proj", "experts"])
    layers = lora_layers(model)
    (qkv_name,) = [n for n in layers if n.endswith("qkv_proj")]
    (moe_name,) = [n for n in layers if n.endswith("experts")]
    qkv, experts = layers[qkv_name], layers[moe_name]
    rng = np.random.default_rng(0)
    a = [rng.normal(size=(4, 32)).astype(np.float32)] + [None, None]
    b = [rng.normal(size=(32, 4)).astype(np.float32)] + [None, None]
    qkv.set_lora(0, a, b)  # slot 0: q only
    qkv.set_lora(1, a, b)  # slot 1: q and the experts
    E, H, inter = 4, 32, 16
    w13 = (rng.normal(size=(E, 4, H)), rng.normal(size=(E, 2 * inter, 4)))
    w2 = (rng.normal(size=(E, 4, inter)), rng.normal(size=(E, H, 4)))
    experts.set_lora(1, [w13[0], w2[0]], [w13[1], w2[1]])
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    ids = jnp.asarray(rng.integers(0, 64, (2, 6)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))

    @nnx.jit
    def logits(model, slots):
        if slots is not None:
            lj.set_lora_mapping(model, slots)
        return model(ids, pos)[0]

    for slot in (1, np.int32(0)):  # a numpy slot too
        lora = np.asarray(logits(model, jnp.full((12,), slot, jnp.int32)))
        assert merge_adapter(model, slot) == 2 and merged_slot(model) == slot
        np.testing.assert_allclose(np.asarray(logits(model, None)), lora, rtol=1e-4, atol=1e-4)
        assert unmerge_adapter(model)
        jax.tree.map(np.testing.assert_array_equal, before, nnx.state(model, nnx.Param))


@pytest.mark.parametrize("tied", [False, True])
def test_every_module_skips_an_lm_head_past_the_lora_vocab_limit(tied):
    """`target_modules=None` ("every supported module") wraps the rest of a model whose
    vocabulary is past LoRA's lm_head limit (a Gemma-3-sized 262144), with a warning; naming
    lm_head still raises that limit."""
    from lora_jax.models import DecoderConfig, DecoderForCausalLM

    def build():
        cfg = DecoderConfig.tiny(vocab_size=262144, tie_word_embeddings=tied)
        return DecoderForCausalLM(cfg, rngs=nnx.Rngs(0))

    model = build()
    with pytest.warns(UserWarning, match="'lm_head' gets no LoRA: its vocabulary of 262144"):
        wrap_model(model, lj.LoRAConfig(max_loras=2, max_lora_rank=8))
    names = sorted(lora_layers(model))
    assert "lm_head" not in names and "model.embed_tokens" in names
    assert "model.layers.0.self_attn.qkv_proj" in names
    with pytest.raises(ValueError, match="vocab size must be <= 258048"):
        wrap_model(build(), lj.LoRAConfig(max_loras=2, max_lora_rank=8), target_modules=["lm_head"])


def test_a_scoped_mapping_inside_nnx_jit_compiles_once_per_bucket():
    """`lj.lora_mapping` inside `nnx.jit` leaves nothing in the model's context: each token
    bucket compiles once however the buckets alternate, and a later call that sets no
    mapping gives the base. `set_lora_mapping` keeps its mapping (vLLM's persistent
    mapping), which `nnx.jit` writes back, so the next call compiles anew."""
    model = ToyLM()
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    wrap_model(model, cfg)
    rng = np.random.default_rng(0)
    for layer in lora_layers(model).values():
        n = layer.n_slices
        a = [rng.normal(size=(4, layer.base_layer.in_features)) for _ in range(n)]
        b = [rng.normal(size=(w, 4)) for w in layer.logical_slice_sizes]
        layer.set_lora(0, a, b)
    traces = []

    @nnx.jit
    def scoped(model, ids, slots):
        traces.append(ids.shape)
        with lj.lora_mapping(model, slots):
            return model(ids)

    @nnx.jit
    def plain(model, ids):
        return model(ids)

    def ids_of(n):  # ToyLM takes x f32[T, 32]
        return jnp.asarray(rng.normal(size=(n, 32)), jnp.float32)

    for n in (8, 16, 8, 32, 16, 8):
        scoped(model, ids_of(n), jnp.zeros((n,), jnp.int32))
    assert sorted(traces) == [(8, 32), (16, 32), (32, 32)]
    assert lj.find_lora_context(model).get_value() is None
    ids = ids_of(8)
    base = plain(model, ids)
    lora = scoped(model, ids, jnp.zeros((8,), jnp.int32))
    assert float(jnp.abs(lora - base).max()) > 1e-3  # the adapter acts
    np.testing.assert_array_equal(plain(model, ids), base)  # nothing left behind

    @nnx.jit
    def persistent(model, ids, slots):
        traces.append(("persistent", ids.shape))
        lj.set_lora_mapping(model, slots)
        return model(ids)

    traces.clear()
    for _ in range(2):
        persistent(model, ids, jnp.zeros((8,), jnp.int32))
    assert len(traces) == 2  # the mapping written back is in the second call's key
    lj.clear_lora_mapping(model)
    np.testing.assert_array_equal(plain(model, ids), base)


class _Two(nnx.Module):
    """Two plain `nnx.Linear`s, `a` then `b`."""

    def __init__(self):
        self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.b = nnx.Linear(4, 4, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.b(self.a(x))


class _Box(nnx.Pytree):
    """A plain `nnx.Pytree` container (not an `nnx.Module`)."""

    def __init__(self, lin):
        self.lin = lin


@pytest.mark.parametrize("where", ["private", "pytree"])
def test_a_module_shared_through_a_private_attribute_or_a_pytree_is_refused(where):
    """NNX's graph (and so `wrap_model`) walks `_private` attributes and `nnx.Pytree`
    containers: one `nnx.Linear` reached there too would get its LoRA at one place only.
    The places to refuse are those the graph protocol reaches (`nnx.iter_graph`)."""

    class Shared(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            if where == "private":
                self._aux = self.proj
            else:
                self.box = _Box(self.proj)

    model = Shared()
    proj = model.proj
    other = "_aux" if where == "private" else "box.lin"
    seen = [".".join(map(str, p)) for p, n in nnx.iter_graph(model) if n is proj]
    assert seen and set(seen) <= {"proj", other}  # iter_graph names one of the two
    with pytest.raises(ValueError, match=rf"reached from 2 places \['{other}', 'proj'\]"):
        wrap_model(model, CFG)
    assert model.proj is proj and lora_layers(model) == {}
    assert lj.find_lora_context(model) is None


def test_a_second_context_on_a_wrapped_model_is_refused_before_any_change():
    model = _Two()
    ctx = wrap_model(model, CFG, target_modules=["a"])
    b = model.b
    with pytest.raises(ValueError, match="context= is another LoRAContext"):
        wrap_model(model, CFG, target_modules=["b"], context=lj.LoRAContext(None))
    assert model.b is b and list(lora_layers(model)) == ["a"]
    assert wrap_model(model, CFG, target_modules=["b"], context=ctx) is ctx  # its own: fine
    assert lj.find_lora_context(model) is ctx


def test_plain_jax_jit_names_the_copied_context_and_nnx_split_serves():
    """Under a plain `jax.jit` the model is a pytree and each layer gets its own copy of
    the shared context: the error says so; `nnx.split` / `nnx.merge` serves as `nnx.jit`."""
    model = _Two()
    wrap_model(model, CFG)
    rng = np.random.default_rng(0)
    for layer in lora_layers(model).values():
        layer.set_lora(1, rng.normal(size=(2, 4)), rng.normal(size=(4, 2)))
    x, idx = _x(4), jnp.asarray([1, -1] * (T // 2), jnp.int32)

    def step(model, x, idx):
        with lj.lora_mapping(model, idx):
            return model(x)

    with pytest.raises(ValueError, match=r"2 LoRA contexts.*jax\.jit.*use nnx\.jit.*nnx\.split"):
        jax.jit(step)(model, x, idx)
    graphdef, state = nnx.split(model)
    y = jax.jit(lambda state, x, idx: step(nnx.merge(graphdef, state), x, idx))(state, x, idx)
    np.testing.assert_array_equal(y, nnx.jit(step)(model, x, idx))


@pytest.mark.parametrize("targets", [5, {"a": 1}])
def test_target_modules_that_are_not_names_are_refused(targets):
    model = _Two()
    with pytest.raises(ValueError, match="target_modules must be a list of module names"):
        wrap_model(model, CFG, target_modules=targets)
    assert lora_layers(model) == {}


def test_a_layer_as_the_whole_model_is_refused():
    """The root has no parent to take its LoRA layer: refused, not silently left as is."""
    lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="the model is itself a Linear layer.*holds it"):
        wrap_model(lin, CFG)
    assert lj.find_lora_context(lin) is None


def test_merge_takes_a_concrete_integer_scalar_slot():
    """A slot given as a 0-d integer array merges as the same Python int does (oracle: the
    LoRA path on that slot); other types are refused naming what is allowed."""
    model = _Two()
    wrap_model(model, CFG)
    rng = np.random.default_rng(0)
    for layer in lora_layers(model).values():
        layer.set_lora(1, rng.normal(size=(2, 4)), rng.normal(size=(4, 2)))
    x = _x(4)
    with lj.lora_mapping(model, jnp.ones((T,), jnp.int32)):
        y_lora = model(x)
    for bad in (1.0, True, jnp.ones((1,), jnp.int32)):
        with pytest.raises(ValueError, match="slot must be a Python int or a concrete integer"):
            merge_adapter(model, bad)
    assert merged_slot(model) is None
    assert merge_adapter(model, jnp.int32(1)) == 2
    assert merged_slot(model) == 1
    np.testing.assert_allclose(model(x), y_lora, rtol=1e-5, atol=1e-5)
    unmerge_adapter(model)
