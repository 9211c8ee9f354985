"""Training a DoRA adapter in a slot (`init_lora_slot(use_dora=True)`, the magnitudes as
`nnx.LoRAParam`s, `refresh_dora_norms` after each update) against a jnp oracle of PEFT's
DoRA on the logical weights: `y = g ⊙ (x @ (W + (B @ A)ᵀ)) + bias`, `g = m / ||W + (B @
A)ᵀ||` with the norm a constant of each forward (PEFT detaches it). HF peft is the oracle
in test_dora_hf.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from layer_cases import KIND_BY_NAME, logical_output, make_mesh, random_weights

import lora_jax as lj
from lora_jax.serving.export import adapter_from_slot
from lora_jax.serving.merge import merge_adapter, unmerge_adapter
from lora_jax.serving.training import (
    init_lora_slot,
    refresh_dora_norms,
    tie_kv_replicas,
    train_only_slots,
)

# jax 0.10.2's compile-cache write segfaulted CI's workers in mesh training tests
# (tests/test_training.py): these compile without the cache too.
pytestmark = pytest.mark.no_compile_cache

IDX = np.array([1, -1, 1, 2, 1, 1, 0, 1], np.int32)  # slot 1 trains; 2 holds plain LoRA
LR, STEPS = 0.3, 3


def _model(kind_name, mesh):
    rules = lj.ShardingRules(make_mesh(*mesh)) if mesh else lj.ShardingRules()
    kind = KIND_BY_NAME[kind_name]
    base = kind.make_base(rules, jnp.float32)
    ks, bs = random_weights(base, 0)
    base.load_kernel(ks, bs)
    cfg = lj.LoRAConfig(max_loras=3, max_lora_rank=8, enable_dora=True)
    layer = kind.lora_cls(base, cfg, lj.LoRAContext(None))
    if layer.n_slices > 1:  # one checkpoint module per slice, as wrap_model names them
        layer.packed_modules = tuple(f"m{s}" for s in range(layer.n_slices))
    return nnx.Dict(proj=layer), np.concatenate(ks, 1), np.concatenate(bs)


def _oracle_loss(a, b, m, W, bias, x, c):
    """PEFT's DoRA forward for the slot's tokens (the others do not depend on it)."""
    delta = jnp.concatenate([(bs @ as_).T for as_, bs in zip(a, b)], axis=1)
    norm = jax.lax.stop_gradient(jnp.linalg.norm(W + delta, axis=0))
    y = (jnp.concatenate(m) / norm) * (x @ (W + delta)) + bias
    return jnp.sum(c * y)


@pytest.mark.parametrize("mesh", [None, (2, 4)], ids=["one_device", "dp2tp4"])
@pytest.mark.parametrize("kind", ["merged_qkv", "row", "qkv_sharded", "merged"])
def test_a_dora_slot_trains_as_peft_s_dora(kind, mesh):
    """init_lora_slot(use_dora=True) starts the slot as the base (magnitudes `||W||`);
    SGD steps through the layer (kv-head replicas tied, norms refreshed after each update)
    move A, B and the magnitudes as the oracle's steps on the logical weights do, and
    leave the plain LoRA slot beside it as it was."""
    model, W, bias = _model(kind, mesh)
    layer = model["proj"]
    n_in = layer.base_layer.in_features
    rng = np.random.default_rng(7)
    other = [rng.normal(0, 0.3, (4, n_in)).astype(np.float32) for _ in range(layer.n_slices)]
    layer.set_lora(2, other, [rng.normal(0, 0.3, (n, 4)) for n in layer.logical_slice_sizes])
    before = [np.asarray(v[...][2]) for v in (*layer.lora_a, *layer.lora_b)]
    init_lora_slot(model, 1, 4, seed=3, use_dora=True)
    start = adapter_from_slot(model, 1).modules["proj"]
    np.testing.assert_allclose(
        np.concatenate(start.magnitude), np.linalg.norm(W, axis=0), rtol=1e-5
    )  # PEFT's start: ||W + 0||
    x = jnp.asarray(rng.normal(size=(len(IDX), n_in)), jnp.float32)
    c = rng.normal(size=(len(IDX), W.shape[1])).astype(np.float32)
    base = IDX != 2  # slot 1 is the base model, as are -1 and the empty slot 0
    y0 = logical_output(layer, _forward(model, x, IDX))[base]
    np.testing.assert_allclose(y0, np.asarray(x)[base] @ W + bias, rtol=2e-5, atol=2e-5)

    tx = optax.chain(tie_kv_replicas(model), optax.sgd(LR), train_only_slots([1]))
    opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, opt, x):
        def loss_fn(model):
            with lj.lora_mapping(model, jnp.asarray(IDX)):
                y = model["proj"](x)
            return jnp.sum(_logical(model["proj"], y) * c)

        opt.update(model, nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model))
        refresh_dora_norms(model, 1)

    for _ in range(STEPS):
        step(model, opt, x)
    got = adapter_from_slot(model, 1).modules["proj"]

    on = IDX == 1
    params = ([jnp.asarray(v) for v in start.lora_a], [jnp.asarray(v) for v in start.lora_b])
    params += ([jnp.asarray(v) for v in start.magnitude],)
    grad = jax.grad(_oracle_loss, argnums=(0, 1, 2))
    for _ in range(STEPS):
        g = grad(*params, W, bias, x[on], c[on])
        params = jax.tree.map(lambda p, d: p - LR * d, params, g)
    for name, ours, want in zip(
        ("A", "B", "magnitude"), (got.lora_a, got.lora_b, got.magnitude), params
    ):
        for s, (o, w) in enumerate(zip(ours, want)):
            np.testing.assert_allclose(o, w, rtol=2e-4, atol=2e-5, err_msg=f"{name} {s}")
    assert np.abs(np.concatenate(got.magnitude) - np.concatenate(start.magnitude)).max() > 1e-3
    # the forward now serves the trained DoRA adapter: the oracle's outputs
    delta = np.concatenate([(b @ a).T for a, b in zip(*params[:2])], axis=1)
    g = np.concatenate(params[2]) / np.linalg.norm(W + delta, axis=0)
    y = logical_output(layer, _forward(model, x, IDX))
    np.testing.assert_allclose(
        y[on], g * (np.asarray(x[on]) @ (W + delta)) + bias, rtol=1e-4, atol=1e-4
    )
    for v, was in zip((*layer.lora_a, *layer.lora_b), before):
        np.testing.assert_array_equal(np.asarray(v[...][2]), was)
    # merge_adapter takes the norm from the merged kernel (PEFT's merge), whatever the
    # stacks hold: here a stale norm
    norms = layer.dora_norm[...]
    layer.dora_norm.set_value(norms * 1.5)
    merge_adapter(model, 1)
    y = logical_output(layer, jax.jit(lambda x: layer(x))(x))  # no mapping: the kernel
    np.testing.assert_allclose(y, g * (np.asarray(x) @ (W + delta)) + bias, rtol=1e-4, atol=1e-4)
    unmerge_adapter(model)


def _logical(layer, y):
    """Traceable `logical_output`: one replica of each kv head."""
    base = layer.base_layer
    parts = base.split_output(base.rules.constrain(y, None, None))  # replicated
    if isinstance(base, lj.QKVParallelLinear) and base.num_kv_head_replicas > 1:
        r, h = base.num_kv_head_replicas, base.total_num_kv_heads
        parts = [parts[0]] + [
            p.reshape(p.shape[0], h, r, base.head_size)[:, :, 0].reshape(p.shape[0], -1)
            for p in parts[1:]
        ]
    return jnp.concatenate(parts, axis=-1)


@nnx.jit
def _forward(model, x, idx):
    with lj.lora_mapping(model, jnp.asarray(idx)):
        return model["proj"](x)


def test_use_dora_is_refused_where_no_layer_keeps_magnitudes_and_changes_nothing():
    """use_dora=True on a model wrapped without enable_dora, or naming a layer that keeps
    no magnitudes (a plain Flax linear), is refused by name before any slot changes."""
    kind = KIND_BY_NAME["row"]
    proj = kind.make_base(lj.ShardingRules(), jnp.float32)
    proj.load_kernel(*random_weights(proj, 0))
    model = nnx.Dict(proj=proj, lin=nnx.Linear(16, 8, rngs=nnx.Rngs(0)))
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, enable_dora=True)
    lj.serving.wrap.wrap_model(model, cfg)
    init_lora_slot(model, 1, 4, seed=1)
    state = jax.tree.map(np.asarray, nnx.state(model, nnx.LoRAParam))
    with pytest.raises(ValueError, match=r"use_dora=True targets \['lin'\].*enable_dora=True"):
        init_lora_slot(model, 1, 4, seed=2, use_dora=True)
    with pytest.raises(ValueError, match="use_dora must be a bool"):
        init_lora_slot(model, 1, 4, use_dora="yes")
    for got, want in zip(
        jax.tree.leaves(jax.tree.map(np.asarray, nnx.state(model, nnx.LoRAParam))),
        jax.tree.leaves(state),
    ):
        np.testing.assert_array_equal(got, want)
    names = init_lora_slot(model, 1, 4, seed=2, use_dora=True, target_modules=["proj"])
    assert names == ["proj"] and adapter_from_slot(model, 1).modules["proj"].magnitude is not None
