"""The ops' own backward pass where every mapped token uses one slot
(`LoRAMapping.single_slot`, a training batch): dense matmuls against that slot's weights,
on the XLA backend and behind the kernels' forward. Oracle: XLA's autodiff of the XLA
backend on the same indices without the hint (its one-hot / gather paths). Also how the
hint is found and checked, and that it leaves the forward's numbers as they were.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax as lj
from lora_jax import ops, ops_grad
from lora_jax.mapping import make_lora_mapping
from lora_jax.models import DecoderConfig, DecoderForCausalLM
from lora_jax.serving.training import init_lora_slot
from lora_jax.serving.wrap import wrap_model


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setattr(ops, "PALLAS_INTERPRET", True)


def _inputs(T=24, H=32, N=(32, 16), R=16, L=4, slot=2, seed=0, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(k[0], (T, H)).astype(dtype)
    a = [(jax.random.normal(k[1 + s], (L, R, H)) / 4).astype(dtype) for s in range(len(N))]
    b = [(jax.random.normal(k[3 + s], (L, n, R)) / 4).astype(dtype) for s, n in enumerate(N)]
    idx = np.full(T, slot, np.int32)
    idx[::5] = -1  # padding tokens without an adapter
    ranks = jnp.asarray(np.resize(np.array([[3, 16, 5, 8], [16, 2, 9, 12]]), (2, L))[: len(N)])
    return x, a, b, idx, ranks


def _pair(idx, L=4):
    """The same indices as a plain device mapping and as one that says single_slot."""
    plain = make_lora_mapping(jnp.asarray(idx), L)
    one = make_lora_mapping(idx, L, single_slot=True)
    assert plain.single_slot is None and one.single_slot is True
    return plain, one


@pytest.mark.parametrize("block_diagonal", [False, True])
@pytest.mark.parametrize("backend", ["xla", "pallas", "pallas_fused"])
@pytest.mark.parametrize("traced_scale", [False, True])
def test_single_slot_gradients_equal_xla_s_autodiff(
    interpret, monkeypatch, backend, traced_scale, block_diagonal
):
    monkeypatch.setattr(ops_grad, "BLOCK_DIAGONAL_SLICES", block_diagonal)
    x, a, b, idx, ranks = _inputs()
    plain, one = _pair(idx)
    y0 = jnp.linspace(-1, 1, 24 * 48).reshape(24, 48)

    def loss(x, a, b, y0, scale, mapping, backend):
        y = ops.add_lora_linear(y0, x, a, b, mapping, scale, slot_ranks=ranks, backend=backend)
        return jnp.sum(jnp.sin(y))

    argnums = (0, 1, 2, 3, 4) if traced_scale else (0, 1, 2, 3)
    f = jax.grad(loss, argnums=argnums)
    if traced_scale:
        f = jax.jit(f, static_argnums=6)
    want = f(x, a, b, y0, 0.7, plain, "xla")
    got = f(x, a, b, y0, 0.7, one, backend)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)
    da, db = got[1], got[2]
    assert not np.any(np.asarray(da[0])[[0, 1, 3]])  # only slot 2 has tokens
    assert np.any(np.asarray(da[0][2])) and np.any(np.asarray(db[1][2]))
    np.testing.assert_array_equal(np.asarray(da[0][2, 5:]), 0.0)  # past slot 2's rank 5


def test_single_slot_backward_is_dense_and_the_knob_turns_it_off():
    """The hinted XLA backward multiplies against one slot (no matmul against every
    slot's L x R rows, which the one-hot VJP has); with `ops.KERNEL_BACKWARD` off it is
    XLA's autodiff again."""
    x, a, b, idx, ranks = _inputs(T=24, L=4, R=16)
    _, one = _pair(idx)

    def grad():  # a new function each time: the knob is read when it is traced
        def loss(a):
            h = ops.lora_shrink(x, a, one, 0.5, slot_ranks=ranks, backend="xla")
            return jnp.sum(h**2)

        return jax.grad(loss)

    def wide_dots(closed) -> int:
        """How many dot_generals give every slot's A gradient at once (L x R = 64 rows by
        H = 32), nested jaxprs (jit, custom_vjp) included."""
        eqns, count = list(closed.jaxpr.eqns), 0
        while eqns:
            e = eqns.pop()
            for v in e.params.values():
                for sub in v if isinstance(v, tuple | list) else (v,):
                    sub = getattr(sub, "jaxpr", sub)
                    eqns.extend(getattr(sub, "eqns", ()))
            if e.primitive.name == "dot_general":
                count += sorted(e.outvars[0].aval.shape) == [32, 4 * 16]
        return count

    dense = jax.make_jaxpr(grad())(a)
    old = ops.KERNEL_BACKWARD
    ops.KERNEL_BACKWARD = False
    try:
        onehot = jax.make_jaxpr(grad())(a)
        want = grad()(a)
    finally:
        ops.KERNEL_BACKWARD = old
    assert wide_dots(dense) == 0 and wide_dots(onehot) == 2  # a dA per slice
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(grad()(a))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_the_hint_leaves_the_forward_bit_for_bit(interpret, backend):
    x, a, b, idx, ranks = _inputs(dtype=jnp.bfloat16)
    plain, one = _pair(idx)
    y0 = jnp.zeros((24, 48), jnp.bfloat16)
    outs = [
        ops.add_lora_linear(y0, x, a, b, m, 0.5, slot_ranks=ranks, backend=backend)
        for m in (plain, one)
    ]
    np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))


def test_bf16_single_slot_gradients_are_xla_s_to_bf16():
    x, a, b, idx, ranks = _inputs(T=40, H=64, N=(48, 32), dtype=jnp.bfloat16, seed=3)
    plain, one = _pair(idx)

    def loss(x, a, b, mapping):
        y0 = jnp.zeros((40, 80), jnp.bfloat16)
        y = ops.add_lora_linear(y0, x, a, b, mapping, 0.5, slot_ranks=ranks, backend="xla")
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for w, g in zip(jax.tree.leaves(f(x, a, b, plain)), jax.tree.leaves(f(x, a, b, one))):
        assert g.dtype == w.dtype == jnp.bfloat16
        w, g = np.asarray(w, np.float32), np.asarray(g, np.float32)
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max())


@pytest.mark.parametrize("block_diagonal", [False, True])
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_single_slot_expand_of_slices_apart_in_y(interpret, monkeypatch, backend, block_diagonal):
    """Three slices of different widths written apart in a wider y (columns before,
    between and after them untouched; QKV's layout with gaps): the hinted backward, a pair
    of matmuls a slice or one block-diagonal pair (`ops_grad.BLOCK_DIAGONAL_SLICES`), gives
    each slice its own dh and dB, and y's cotangent whole."""
    monkeypatch.setattr(ops_grad, "BLOCK_DIAGONAL_SLICES", block_diagonal)
    k = jax.random.split(jax.random.key(5), 5)
    T, R, L, N, offsets = 24, 16, 4, (32, 8, 12), (4, 40, 50)
    h = jax.random.normal(k[0], (3, T, R))
    b = [jax.random.normal(k[1 + s], (L, n, R)) / 4 for s, n in enumerate(N)]
    idx = np.full(T, 1, np.int32)
    idx[::7] = -1
    plain, one = _pair(idx)
    ranks = jnp.asarray([[16, 5, 9, 16], [3, 16, 2, 8], [16, 12, 16, 1]])
    y0 = jax.random.normal(k[4], (T, 64))

    def loss(y0, h, b, mapping, backend):
        y = ops.lora_expand(y0, h, b, mapping, offsets=offsets, slot_ranks=ranks, backend=backend)
        return jnp.sum(jnp.sin(y) * jnp.arange(64.0))

    f = jax.grad(loss, argnums=(0, 1, 2))
    with jax.default_matmul_precision("highest"):
        want = f(y0, h, b, plain, "xla")  # XLA's autodiff, no hint
        got = f(y0, h, b, one, backend)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4)
    db = [np.asarray(d) for d in got[2]]
    assert np.any(db[2][1]) and not np.any(db[2][[0, 2, 3]])  # slot 1's only
    np.testing.assert_array_equal(db[2][1, :, 12:], 0.0)  # past slot 1's rank 12
    np.testing.assert_array_equal(db[0][1, :, 5:], 0.0)  # past slot 1's rank 5


def test_single_slot_is_the_caller_s_and_checked_where_concrete():
    one = np.array([3, -1, 3, 3], np.int32)
    two = np.array([3, -1, 1, 3], np.int32)
    # never looked for, even with the host's hints (a serving step would compile again)
    assert make_lora_mapping(one, 4, host_hints=True).single_slot is None
    assert make_lora_mapping(one, 4, single_slot=True).single_slot is True
    assert make_lora_mapping(jnp.asarray(one), 4, single_slot=True).single_slot is True
    assert make_lora_mapping(np.full(4, -1), 4, single_slot=True).single_slot is True
    assert make_lora_mapping(two, 4, single_slot=False).single_slot is False
    for idx in (two, jnp.asarray(two)):
        with pytest.raises(ValueError, match=r"single_slot=True, but the tokens map to 2"):
            make_lora_mapping(idx, 4, single_slot=True)
    with pytest.raises(ValueError, match="single_slot must be True, False or None"):
        make_lora_mapping(one, 4, single_slot=1)
    # under a trace the caller's word is taken as it is
    traced = jax.jit(lambda i: make_lora_mapping(i, 4, single_slot=True).token_lora_indices)
    np.testing.assert_array_equal(traced(jnp.asarray(two)), two)


def test_a_training_step_with_the_hint_takes_the_gradient_without_it():
    """A model's LoRA gradient (every projection, a slot trained) through `lora_mapping`
    with ``single_slot=True`` equals the one without (XLA's autodiff)."""
    cfg = DecoderConfig.tiny()
    model = DecoderForCausalLM(cfg, rngs=nnx.Rngs(0))
    wrap_model(model, lj.LoRAConfig(max_loras=3, max_lora_rank=8))
    init_lora_slot(model, 1, 8, seed=0)

    def nudge(v):  # B is zero after the init: give slot 1 trained-looking weights
        wave = 0.05 * jnp.cos(jnp.arange(v[1].size)).reshape(v[1].shape)
        return v.at[1].add(wave.astype(v.dtype))

    nnx.update(model, jax.tree.map(nudge, nnx.state(model, nnx.LoRAParam)))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 8)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))

    def loss(model, single_slot):
        with lj.lora_mapping(model, jnp.ones((16,), jnp.int32), single_slot=single_slot):
            return jnp.sum(model(ids, pos)[0].astype(jnp.float32) ** 2) / 1e3

    def grads(single_slot):
        grad = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))
        return nnx.jit(grad, static_argnums=1)(model, single_slot)

    want, got = grads(None), grads(True)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)
    assert any(np.any(np.asarray(g)[1]) for g in jax.tree.leaves(got))
