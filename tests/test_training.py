"""Training an adapter in a slot: gradients on every backend, PEFT's initialisation, the
optax slot mask, and exporting a slot as a PEFT adapter that loads back unchanged.

Oracles: the XLA backend's autodiff for the kernels' backward pass (`ops_grad`); the base
model for a freshly initialised slot; the stacks before a step for the slots that must not
move; the slot itself for the exported-and-reloaded adapter (`test_oracle_hf.py` checks the
exported files against HF peft).
"""

import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lora_jax as lj
from lora_jax import ops
from lora_jax.mapping import make_lora_mapping
from lora_jax.models import DecoderConfig, DecoderForCausalLM
from lora_jax.serving.export import adapter_from_slot, save_peft_adapter
from lora_jax.serving.peft import load_peft_adapter, read_safetensors
from lora_jax.serving.training import (
    init_lora_slot,
    is_linear,
    tie_kv_replicas,
    train_only_slots,
    train_slots,
    trainable_layers,
)
from lora_jax.serving.wrap import wrap_model

# jax 0.10.2's compile-cache write (`executable.serialize()`) segfaulted CI's xdist worker 4
# times in sessions 57-58, always in this file's mesh tests: they compile without the cache
# (tests/conftest.py; the file took 10 s longer so, 120 against 110 s on 2 cores).
pytestmark = pytest.mark.no_compile_cache

MAX_RANK = 8


# -- gradients through the ops ----------------------------------------------------------------
@pytest.fixture
def interpret():
    old = ops.PALLAS_INTERPRET
    ops.PALLAS_INTERPRET = True
    yield
    ops.PALLAS_INTERPRET = old


def _op_inputs(T=16, H=32, N=(32, 16), R=16, L=4, seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(k[0], (T, H))
    a = [jax.random.normal(k[1 + s], (L, R, H)) / 4 for s in range(len(N))]
    b = [jax.random.normal(k[3 + s], (L, n, R)) / 4 for s, n in enumerate(N)]
    idx = jnp.asarray(np.random.default_rng(seed).integers(-1, L, T), jnp.int32)
    ranks = np.resize(np.array([[3, 16, 5, 8], [16, 2, 0, 9]]), (2, L))[: len(N)]
    ranks = jnp.asarray(np.minimum(ranks, R), jnp.int32)  # [S, L]: below the max in some
    return x, a, b, make_lora_mapping(idx, L), ranks


@pytest.mark.parametrize("backend", ["pallas", "pallas_fused"])
@pytest.mark.parametrize("traced_scale", [False, True])
@pytest.mark.parametrize("tokens", [3, 16])
def test_op_gradients_on_the_kernels_equal_xla(interpret, backend, traced_scale, tokens):
    """The kernels' backward pass (`lora_jax.ops_grad`: the kernels against the transposed
    stacks, `lora_slot_outer` for the stacks) equals XLA's autodiff of the XLA backend (x,
    every A and B, y, and a traced scale), below and above one token a slot (the XLA
    backend's gather and one-hot paths)."""
    x, a, b, m, ranks = _op_inputs(T=tokens)
    N = sum(v.shape[1] for v in b)
    y0 = jnp.linspace(-1, 1, tokens * N).reshape(tokens, N)

    def loss(x, a, b, y0, scale, backend):
        y = ops.add_lora_linear(y0, x, a, b, m, scale, slot_ranks=ranks, backend=backend)
        return jnp.sum(jnp.sin(y))

    scale = 0.7
    argnums = (0, 1, 2, 3, 4) if traced_scale else (0, 1, 2, 3)
    f = jax.grad(loss, argnums=argnums)
    f = jax.jit(f, static_argnums=5) if traced_scale else f
    want = f(x, a, b, y0, scale, "xla")
    got = f(x, a, b, y0, scale, backend)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)
    # rank columns past a slot's rank get no gradient
    da = got[1][0]
    np.testing.assert_array_equal(np.asarray(da[0, 3:]), 0.0)


@pytest.mark.slow
def test_kernel_gradients_of_prompts_with_the_host_s_hints_equal_xla(interpret):
    """Prompts whose tiles the host found wholly of one slot (``prompt_tiles`` /
    ``whole_tiles`` "all": the shrink reads x in rectangles, no work list): the backward's
    shrink of dy and expand of dx take the same tiles, and the gradient is XLA's."""
    T, H, L = 256, 64, 4
    x, a, b, _, ranks = _op_inputs(T=T, H=H, N=(64, 32), L=L, seed=5)
    idx = np.repeat(np.array([2, 0], np.int32), 128)  # two 128-token prompts
    m = make_lora_mapping(idx, L, host_hints=True)
    assert m.prompt_tiles == "all" and m.whole_tiles == "all"
    plain = make_lora_mapping(jnp.asarray(idx), L)

    def loss(x, a, b, mapping, backend):
        y = ops.add_lora_linear(
            jnp.zeros((T, 96)), x, a, b, mapping, 0.5, slot_ranks=ranks, backend=backend
        )
        return jnp.sum(jnp.sin(y))

    f = jax.grad(loss, argnums=(0, 1, 2))
    want, got = f(x, a, b, plain, "xla"), f(x, a, b, m, "pallas")
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["pallas", "pallas_fused"])
def test_the_kernel_backward_walks_the_slots_and_the_knob_restores_xla_s(interpret, backend):
    """With `ops.KERNEL_BACKWARD` the gradient program runs `lora_slot_outer` (no matmul
    against every slot); turned off it is XLA's VJP again, with the same gradient."""
    x, a, b, m, ranks = _op_inputs()

    def loss(x, a, b):
        y = ops.add_lora_linear(
            jnp.zeros((16, 48)), x, a, b, m, 0.5, slot_ranks=ranks, backend=backend
        )
        return jnp.sum(y**2)

    def grad():  # a new function each time: the knob is read when it is traced
        return jax.grad(lambda *args: loss(*args), argnums=(0, 1, 2))

    got = grad()(x, a, b)
    assert "lora_slot_outer" in str(jax.make_jaxpr(grad())(x, a, b))
    old = ops.KERNEL_BACKWARD
    ops.KERNEL_BACKWARD = False
    try:
        assert "lora_slot_outer" not in str(jax.make_jaxpr(grad())(x, a, b))
        want = grad()(x, a, b)
    finally:
        ops.KERNEL_BACKWARD = old
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


def test_bf16_op_gradients_on_the_kernels_are_xla_s_to_bf16(interpret):
    """bf16 activations and stacks: the kernels' backward rounds as the XLA backend's
    autodiff does (operands in bf16, f32 sums), so they agree to bf16's precision."""
    x, a, b, m, ranks = _op_inputs(T=40, H=64, N=(48, 32), L=4, seed=3)
    x, a, b = jax.tree.map(lambda v: v.astype(jnp.bfloat16), (x, a, b))

    def loss(x, a, b, backend):
        y = ops.add_lora_linear(
            jnp.zeros((40, 80), jnp.bfloat16), x, a, b, m, 0.5, slot_ranks=ranks,
            backend=backend,
        )  # fmt: skip
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    want, got = f(x, a, b, "xla"), f(x, a, b, "pallas")
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert g.dtype == w.dtype == jnp.bfloat16
        w, g = np.asarray(w, np.float32), np.asarray(g, np.float32)
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max())


def test_shrink_and_expand_gradients_on_the_kernels(interpret):
    x, a, b, m, ranks = _op_inputs()
    h = ops.lora_shrink(x, a, m, 0.5, slot_ranks=ranks, backend="xla")

    def shrink(x, a, backend):
        return jnp.sum(ops.lora_shrink(x, a, m, 0.5, slot_ranks=ranks, backend=backend) ** 2)

    def expand(h, b, backend):
        y = ops.lora_expand(jnp.ones((16, 48)), h, b, m, slot_ranks=ranks, backend=backend)
        return jnp.sum(y**2)

    for f, args in ((shrink, (x, a)), (expand, (h, b))):
        want = jax.grad(f, argnums=(0, 1))(*args, "xla")
        got = jax.grad(f, argnums=(0, 1))(*args, "pallas")
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "pallas_fused"])
def test_op_gradients_through_the_gpu_kernels(backend):
    """On the GPU the forward and the backward pass run the compiled kernels (Triton /
    Mosaic GPU, `lora_slot_outer` for the stacks); the gradient is the XLA backend's."""
    x, a, b, m, ranks = _op_inputs(T=512, H=256, N=(256, 128), R=16, L=8)
    y0 = jnp.zeros((512, 384), jnp.float32)

    def loss(x, a, b, backend):
        y = ops.add_lora_linear(y0, x, a, b, m, 0.5, slot_ranks=ranks, backend=backend)
        return jnp.sum(jnp.sin(y))

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    for w, g in zip(jax.tree.leaves(f(x, a, b, "xla")), jax.tree.leaves(f(x, a, b, backend))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-2, atol=1e-2)


# -- a model with a slot to train -------------------------------------------------------------
def _model(rules=None, max_loras=3, tie=False):
    cfg = DecoderConfig.tiny(tie_word_embeddings=tie)
    model = DecoderForCausalLM(cfg, rules=rules, rngs=nnx.Rngs(0))
    wrap_model(model, lj.LoRAConfig(max_loras=max_loras, max_lora_rank=MAX_RANK))
    return model


def _batch(seed=0, B=4, S=8):
    ids = jnp.asarray(np.random.default_rng(seed).integers(0, 256, (B, S)), jnp.int32)
    return ids, jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))


@nnx.jit
def _logits(model, ids, pos, slots):
    with lj.lora_mapping(model, slots):
        return model(ids, pos)[0]


def _loss(model, ids, pos, slots):
    with lj.lora_mapping(model, slots):
        logits = model(ids, pos)[0]
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))


@nnx.jit
def _train_step(model, opt, ids, pos, slots):
    grad_fn = nnx.value_and_grad(_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))
    loss, grads = grad_fn(model, ids, pos, slots)
    opt.update(model, grads)
    return loss


def _linear(model):
    return {n: layer for n, layer in trainable_layers(model).items() if is_linear(layer)}


def _stacks(model):
    return jax.tree.map(np.asarray, nnx.state(model, nnx.LoRAParam, lj.LoRASlotRanks))


def test_init_lora_slot_is_peft_init_and_leaves_the_base_output():
    model = _model()
    ids, pos = _batch()
    base = np.asarray(_logits(model, ids, pos, jnp.full(32, -1, jnp.int32)))
    names = init_lora_slot(model, 1, 4, seed=1, target_modules=["q_proj", "v_proj", "up_proj"])
    assert names == [
        f"model.layers.{i}.{m}"
        for i in range(2)
        for m in ("mlp.up_proj", "self_attn.q_proj", "self_attn.v_proj")
    ]
    qkv = model.model.layers[0].self_attn.qkv_proj
    ranks = np.asarray(qkv.slot_ranks[...])
    assert ranks[:, 1].tolist() == [4, 0, 4] and not ranks[:, [0, 2]].any()
    a_q = np.asarray(qkv.lora_a[0][...][1])  # [R, in]
    assert np.abs(a_q[:4]).max() <= 1 / np.sqrt(64) and np.abs(a_q[:4]).min() > 0
    assert not a_q[4:].any() and not np.asarray(qkv.lora_b[0][...]).any()  # B = 0
    # B = 0: the slot's tokens get exactly the base output
    got = np.asarray(_logits(model, ids, pos, jnp.full(32, 1, jnp.int32)))
    np.testing.assert_array_equal(got, base)


@pytest.mark.parametrize("tie", [False, True])
def test_init_lora_slot_gives_the_embedding_and_lm_head_peft_init(tie):
    """PEFT's init: the embedding's A zero and B N(0, 1), the lm_head's A kaiming-uniform
    and B zero; the slot is the base model until trained, and both train."""
    model = _model(tie=tie)
    ids, pos = _batch()
    base = np.asarray(_logits(model, ids, pos, jnp.full(32, -1, jnp.int32)))
    names = init_lora_slot(model, 1, 6, seed=1, target_modules=["embed_tokens", "lm_head"])
    assert names == ["lm_head", "model.embed_tokens"]
    emb_a, emb_b = model.model.embed_tokens.read_lora(1)
    assert emb_a.shape == (6, 256) and not emb_a.any()
    assert emb_b.shape == (64, 6) and 0.8 < emb_b.std() < 1.2 and abs(emb_b.mean()) < 0.2
    head_a, head_b = model.lm_head.read_lora(1)
    assert head_a.shape == (6, 64) and np.abs(head_a).max() <= 1 / np.sqrt(64)
    assert np.abs(head_a).min() > 0 and head_b.shape == (256, 6) and not head_b.any()
    assert not any(
        np.asarray(layer.slot_ranks[...])[:, 1].any() for layer in _linear(model).values()
    )
    got = np.asarray(_logits(model, ids, pos, jnp.full(32, 1, jnp.int32)))
    np.testing.assert_array_equal(got, base)
    grads = _grads(model, ids, pos, jnp.full(32, 1, jnp.int32))
    emb, head = grads["model"]["embed_tokens"], grads["lm_head"]["logits_processor"]
    # the zero factor gets the first gradient (the other's is 0 until it moves), as in PEFT
    assert np.abs(np.asarray(emb["lora_a"][...])[1, :6]).max() > 0
    assert np.abs(np.asarray(head["lora_b"][...])[1, :, :6]).max() > 0


def test_init_lora_slot_refuses_and_changes_nothing():
    model = _model()
    init_lora_slot(model, 0, 4, seed=1)
    before = _stacks(model)
    bad = [
        (dict(slot=3, rank=4), r"slot must be an int in \[0, 3\)"),
        (dict(slot=1, rank=MAX_RANK + 1), "rank 9 is outside"),
        (dict(slot=1, rank=0), "positive int"),
        (dict(slot=True, rank=4), "slot must be an int"),
        (dict(slot=1, rank=MAX_RANK + 1, target_modules=["embed_tokens"]), "rank 9 is outside"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            init_lora_slot(model, **kw)
    jax.tree.map(np.testing.assert_array_equal, _stacks(model), before)


@pytest.mark.parametrize("targets", [None, ["embed_tokens", "lm_head", "q_proj"]])
def test_training_moves_only_its_slot_and_lowers_the_loss(targets):
    """One slot trains while slot 0 serves an adapter (AdamW with weight decay): slot 0,
    slot 2 and the rank columns past the trained slot's rank keep their exact values, and
    tokens of slot 0 and of no adapter keep their outputs."""
    model = _model()
    init_lora_slot(model, 0, 8, seed=2)
    for layer in _linear(model).values():  # slot 0: a served adapter (B != 0)
        for v in layer.lora_b:
            v.set_value(v[...].at[0].set(0.02))
    init_lora_slot(model, 1, 4, seed=3, target_modules=targets)
    ids, pos = _batch()
    slots = jnp.repeat(jnp.array([1, 1, 0, -1], jnp.int32), 8)
    before_logits = np.asarray(_logits(model, ids, pos, slots))
    before = _stacks(model)
    tx = optax.chain(optax.adamw(1e-2, weight_decay=0.1), train_only_slots([1]))
    opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    losses = [float(_train_step(model, opt, ids, pos, slots)) for _ in range(4)]
    assert losses[-1] < losses[0] - 1e-3, losses
    after = _stacks(model)
    for was, now in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        if was.ndim == 2:  # slot ranks [S, L]
            np.testing.assert_array_equal(now, was)
            continue
        np.testing.assert_array_equal(now[0], was[0])
        np.testing.assert_array_equal(now[2], was[2])
        rank_axis = 1 if was.shape[1] == MAX_RANK else 2  # A [L, R, in], B [L, out, R]
        np.testing.assert_array_equal(np.take(now[1:2], range(4, MAX_RANK), rank_axis + 0), 0.0)
    assert any(
        not np.array_equal(w[1], n[1])
        for w, n in zip(jax.tree.leaves(before), jax.tree.leaves(after))
        if w.ndim == 3
    )
    got = np.asarray(_logits(model, ids, pos, slots))
    np.testing.assert_array_equal(got[2:], before_logits[2:])  # slot 0 and no adapter
    assert not np.allclose(got[:2], before_logits[:2])


def test_train_only_slots_refuses_slots_outside_the_stacks():
    with pytest.raises(ValueError, match="at least one slot"):
        train_only_slots([])
    for good in (np.array([1]), jnp.array([1]), {1}, (1,)):
        assert train_only_slots(good).update({"a": jnp.ones((3, 2))}, None)[0]["a"][1].all()
    for bad in (1, "1", np.array(1), [True], [1.7], [1, None]):  # raw TypeError, or slot 1
        with pytest.raises(ValueError, match="train_only_slots: slots must be"):
            train_only_slots(bad)
    tx = train_only_slots([5])
    with pytest.raises(ValueError, match=r"slots \[5\] outside the 3 slots"):
        tx.update({"a": jnp.ones((3, 2, 2))}, tx.init(None))


def test_train_slots_steps_as_the_masked_chain_with_state_for_its_slots_only():
    """`train_slots(adamw, [1])` moves the model as ``chain(adamw, train_only_slots([1]))``
    does (the same AdamW on slot 1's rows; every other slot exact), with Adam's moments
    holding slot 1's rows alone."""
    ids, pos = _batch()
    slots = jnp.repeat(jnp.array([1, 1, 0, -1], jnp.int32), 8)
    runs = []
    for tx in (
        optax.chain(optax.adamw(1e-2, weight_decay=0.1), train_only_slots([1])),
        train_slots(optax.adamw(1e-2, weight_decay=0.1), [1]),
    ):
        model = _model()
        init_lora_slot(model, 0, 8, seed=2)
        init_lora_slot(model, 1, 4, seed=3)
        before = _stacks(model)
        opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
        losses = [float(_train_step(model, opt, ids, pos, slots)) for _ in range(3)]
        runs.append((losses, before, _stacks(model), opt))
    (want_loss, _, want, _), (got_loss, before, got, opt) = runs
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for w, g, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), jax.tree.leaves(before)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
        if b.ndim == 3:
            np.testing.assert_array_equal(g[[0, 2]], b[[0, 2]])
    moments = [v for v in jax.tree.leaves(nnx.state(opt, nnx.OptState)) if np.ndim(v) == 3]
    stacks = [v for v in jax.tree.leaves(before) if v.ndim == 3]
    assert moments and len(moments) == 2 * len(stacks)  # mu and nu of every stack
    assert all(m.shape[0] == 1 for m in moments)  # slot 1's rows only
    assert sorted(m.shape[1:] for m in moments) == sorted(2 * [s.shape[1:] for s in stacks])


def test_train_slots_on_a_mesh_trains_as_unsharded_and_compiles_its_step_once():
    """The training recipe on a tensor-parallel mesh (`lora_jax.serving.training`):
    `train_slots` after `tie_kv_replicas`, the optimizer built under ``jax.set_mesh``,
    takes the unsharded model's steps (its scatter of the slot's rows was refused on jax
    0.11's Explicit axes). Built there, optax's and `nnx.Optimizer`'s step counts
    (``jnp.zeros([])``) live on the mesh as the first step leaves them, so the step
    compiles once; off the mesh the second step's inputs differ and it compiles again."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.make_mesh((1, 2), ("dp", "tp"), devices=jax.devices()[:2])
    traces = []

    @nnx.jit
    def step(model, opt, ids, pos, slots):
        traces.append(1)
        loss, grads = nnx.value_and_grad(_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(
            model, ids, pos, slots
        )
        opt.update(model, grads)
        return loss

    ids, pos = _batch()
    slots = jnp.repeat(jnp.array([1, 1, 0, 1], jnp.int32), 8)
    runs = []
    for rules in (lj.ShardingRules(mesh), None):
        model = _model(rules)
        init_lora_slot(model, 1, 4, seed=3)
        with jax.set_mesh(mesh) if rules else contextlib.nullcontext():
            tx = optax.chain(tie_kv_replicas(model), train_slots(optax.adam(1e-2), [1]))
            opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
        if rules:
            scalars = [v for v in jax.tree.leaves(nnx.state(opt, nnx.OptState)) if v.ndim == 0]
            assert len(scalars) == 2 and all(c.sharding.mesh == mesh for c in scalars)
        runs.append([float(step(model, opt, ids, pos, slots)) for _ in range(3)])
        runs.append(_stacks(model))
        if rules:
            assert len(traces) == 1
    got_loss, got, want_loss, want = runs
    assert want_loss[2] < want_loss[0]
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_train_slots_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="train_slots: tx must be an optax"):
        train_slots(lambda g: g, [1])
    with pytest.raises(ValueError, match="train_slots: name at least one slot"):
        train_slots(optax.sgd(1.0), [])
    with pytest.raises(ValueError, match="train_slots: slots must be ints"):
        train_slots(optax.sgd(1.0), [1.5])
    with pytest.raises(ValueError, match=r"train_slots: slots \[5\] outside the 3 slots"):
        train_slots(optax.sgd(1.0), [5]).init({"a": jnp.ones((3, 2, 2))})
    tx = train_slots(optax.sgd(1.0), [2, 0])
    params = {"a": jnp.arange(12.0).reshape(3, 4), "n": jnp.float32(1.0)}
    out, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    np.testing.assert_array_equal(out["a"], [[-1.0] * 4, [0.0] * 4, [-1.0] * 4])


# -- export -----------------------------------------------------------------------------------
def _trained(rules=None, tie=False):
    """Slot 1: q, v, down (rank 4); slot 2: o, gate, up, the embedding and the lm_head
    (rank 8); B (the embedding's A) random as if trained."""
    model = _model(rules, tie=tie)
    init_lora_slot(model, 1, 4, seed=4, target_modules=["q_proj", "v_proj", "down_proj"])
    vocab = ["embed_tokens", "lm_head"]
    init_lora_slot(model, 2, 8, seed=5, target_modules=["o_proj", "gate_proj", "up_proj", *vocab])
    rng = np.random.default_rng(6)
    for layer in _linear(model).values():  # a "trained" B: random, rank-limited
        for s, v in enumerate(layer.lora_b):
            r = np.asarray(layer.slot_ranks[...])[s]
            val = np.asarray(v[...]).copy()
            for slot in (1, 2):
                val[slot, :, : r[slot]] = rng.normal(size=(val.shape[1], r[slot])) * 0.1
            v.set_value(jax.device_put(jnp.asarray(val), v[...].sharding))
    emb_a, emb_b = model.model.embed_tokens.read_lora(2)  # A was 0: now random
    model.model.embed_tokens.set_lora(2, rng.normal(size=emb_a.shape) * 0.1, emb_b * 0.1)
    head_a, head_b = model.lm_head.read_lora(2)  # B was 0: now random
    model.lm_head.set_lora(2, head_a, rng.normal(size=head_b.shape) * 0.1)
    return model


@pytest.mark.parametrize("mesh_shape,tie", [(None, False), (None, True), ((1, 2), False)])
def test_exported_slot_loads_back_into_the_same_stacks(tmp_path, mesh_shape, tie):
    if mesh_shape and np.prod(mesh_shape) > jax.device_count():
        pytest.skip(f"needs {np.prod(mesh_shape)} devices")
    rules = lj.ShardingRules(jax.make_mesh(mesh_shape, ("dp", "tp"))) if mesh_shape else None
    model = _trained(rules, tie)
    ids, pos = _batch()
    for slot in (1, 2):
        path = save_peft_adapter(model, slot, tmp_path / f"s{slot}")
        cfg = json.loads((tmp_path / f"s{slot}" / "adapter_config.json").read_text())
        tensors = read_safetensors(tmp_path / f"s{slot}" / "adapter_model.safetensors")
        assert all(v.dtype == np.float32 for v in tensors.values())
        assert cfg["lora_alpha"] == cfg["r"] == (4 if slot == 1 else 8)
        key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
        assert (key in tensors) == (slot == 1) and (slot != 1 or tensors[key].shape == (64, 4))
        emb = "base_model.model.model.embed_tokens.lora_embedding_"
        head = "base_model.model.lm_head.lora_"
        if slot == 2:  # PEFT's keys and layouts: A [r, V] / B [D, r]; A [r, D] / B [V, r]
            assert tensors[emb + "A"].shape == (8, 256) and tensors[emb + "B"].shape == (64, 8)
            assert tensors[head + "A.weight"].shape == (8, 64)
            assert tensors[head + "B.weight"].shape == (256, 8)
            assert sorted(cfg["target_modules"]) == sorted(
                ["embed_tokens", "lm_head", "o_proj", "gate_proj", "up_proj"]
            )
        else:
            assert not any(k.startswith((emb, head)) for k in tensors)
        adapter = load_peft_adapter(path, model, lj.LoRAConfig(max_loras=3, max_lora_rank=8))
        want = adapter_from_slot(model, slot)
        assert set(adapter.modules) == set(want.modules)
        for name, m in adapter.modules.items():
            for got_a, got_b, a, b in zip(
                m.lora_a, m.lora_b, want.modules[name].lora_a, want.modules[name].lora_b
            ):
                assert (got_a is None) == (a is None)
                if a is not None:
                    np.testing.assert_array_equal(got_a, a)
                    np.testing.assert_allclose(got_b, b, rtol=1e-6)
        # served from slot 0, the reloaded adapter gives the slot's logits
        want_logits = np.asarray(_logits(model, ids, pos, jnp.full(32, slot, jnp.int32)))
        for layer in trainable_layers(model).values():
            layer.reset_lora(0)
        for name, m in adapter.modules.items():
            trainable_layers(model)[name].set_lora(0, *m.set_lora_args())
        got_logits = np.asarray(_logits(model, ids, pos, jnp.full(32, 0, jnp.int32)))
        np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)


def test_export_refuses_what_it_cannot_write(tmp_path):
    model = _trained()
    with pytest.raises(ValueError, match="holds no adapter"):
        save_peft_adapter(model, 0, tmp_path / "empty")
    with pytest.raises(ValueError, match=r"slot 3 outside \[0, 3\)"):
        adapter_from_slot(model, 3)


def test_adapter_from_slot_takes_only_an_int_id_of_at_least_one():
    model = _trained()
    for aid in (1.9, True, "7", 0, -3):  # 1.9 was cut to 1, "7" / True read as ids
        with pytest.raises(ValueError, match=r"adapter_from_slot: adapter_id must be an int >= 1"):
            adapter_from_slot(model, 1, adapter_id=aid)
    for aid in (7, np.int64(7)):
        assert adapter_from_slot(model, 1, adapter_id=aid).id == 7


def test_init_lora_slot_takes_only_a_non_negative_int_seed():
    model = _model()
    before = _stacks(model)
    for seed in (1.5, "1", -1, True):  # True was taken as seed 1
        with pytest.raises(ValueError, match=r"init_lora_slot: seed must be an int >= 0"):
            init_lora_slot(model, 1, 4, seed=seed)
    jax.tree.map(np.testing.assert_array_equal, _stacks(model), before)
    init_lora_slot(model, 1, 4, seed=np.int64(1))
    by_np = _stacks(model)
    init_lora_slot(model, 1, 4, seed=1)
    jax.tree.map(np.testing.assert_array_equal, _stacks(model), by_np)


def _moe_model(rules=None, separate=False):
    from lora_jax.models import PACKED_MODULES_MAPPING
    from lora_jax.models.moe_decoder import MoEConfig, MoEDecoderForCausalLM

    moe = MoEConfig(model_type="mixtral", num_experts=4, top_k=2, moe_intermediate_size=32)
    model = MoEDecoderForCausalLM(DecoderConfig.tiny(), moe, rules=rules, rngs=nnx.Rngs(0))
    mapping = {**PACKED_MODULES_MAPPING, "experts": ["w1", "w3"]} if separate else None
    wrap_model(
        model, lj.LoRAConfig(max_loras=3, max_lora_rank=MAX_RANK), packed_modules_mapping=mapping
    )
    return model


@pytest.mark.parametrize(
    "mesh_shape,separate", [(None, False), (None, True), ((1, 2), False)], ids=str
)
def test_moe_experts_train_and_export(tmp_path, mesh_shape, separate):
    """Experts get PEFT's init (A kaiming-uniform per expert, B zero: the slot is the
    base); a slot with trained experts is written as PEFT's fused-expert LoRA and loads
    back with the same logits (w1 / w3 apart: one w13 LoRA of rank r1 + r3)."""
    if mesh_shape and np.prod(mesh_shape) > jax.device_count():
        pytest.skip(f"needs {np.prod(mesh_shape)} devices")
    rules = lj.ShardingRules(jax.make_mesh(mesh_shape, ("dp", "tp"))) if mesh_shape else None
    model = _moe_model(rules, separate)
    experts = model.model.layers[0].mlp.experts
    ids, pos = _batch()
    base = np.asarray(_logits(model, ids, pos, jnp.full(32, -1, jnp.int32)))
    with pytest.raises(ValueError, match="match no LoRA layer"):  # experts are named whole
        init_lora_slot(model, 1, 4, target_modules=["w1", "w3"])
    names = init_lora_slot(model, 1, 4, seed=1, target_modules=["experts", "o_proj"])
    assert "model.layers.0.mlp.experts" in names
    assert init_lora_slot(model, 2, MAX_RANK, target_modules=r".*\.experts") == [
        "model.layers.0.mlp.experts",
        "model.layers.1.mlp.experts",
    ]
    # exact on a CPU; a GPU's XLA fuses the base matmuls otherwise beside a zero delta
    # (2.4e-7 off in f32 on an H100)
    np.testing.assert_allclose(
        np.asarray(_logits(model, ids, pos, jnp.full(32, 1, jnp.int32))),
        base,
        rtol=0,
        atol=0 if jax.default_backend() == "cpu" else 1e-6,
    )
    a_list, b_list = experts.read_lora(1)
    assert len(a_list) == len(experts.projections) and not any(b.any() for b in b_list)
    for proj, a in zip(experts.projections, a_list):  # [E, r, in], U(±1/sqrt(in))
        fan_in = 32 if proj == "w2" else 64
        assert a.shape == (4, 4, fan_in) and 0 < np.abs(a).max() <= 1 / np.sqrt(fan_in)
    rng = np.random.default_rng(2)  # "trained": B random
    for layer in (experts, model.model.layers[1].mlp.experts):
        a_list, b_list = layer.read_lora(1)
        b_list = [rng.normal(size=b.shape) * 0.2 for b in b_list]
        layer.set_lora(1, a_list, b_list)
        for got, want in zip(layer.read_lora(1)[1], b_list):  # read back as written
            np.testing.assert_allclose(got, want, rtol=1e-6)
    want = np.asarray(_logits(model, ids, pos, jnp.full(32, 1, jnp.int32)))
    assert np.abs(want - base).max() > 1e-2
    out = save_peft_adapter(model, 1, tmp_path / "moe")
    cfg = json.loads((tmp_path / "moe" / "adapter_config.json").read_text())
    assert "model.layers.1.mlp.experts.down_proj" in cfg["target_parameters"]
    adapter = load_peft_adapter(out, model, lj.LoRAConfig(max_loras=3, max_lora_rank=MAX_RANK))
    moe_ranks = [a.shape[1] for a in adapter.modules["model.layers.0.mlp.experts"].lora_a]
    assert moe_ranks == [4] * len(experts.projections)  # w1 / w3 apart: r, not r1 + r3
    # a slot at max_lora_rank round-trips too (its w13 LoRA is written at rank 2 * 8)
    save_peft_adapter(model, 2, tmp_path / "full")
    full = load_peft_adapter(tmp_path / "full", model, lj.LoRAConfig(max_loras=3, max_lora_rank=8))
    assert full.rank == MAX_RANK
    for layer in trainable_layers(model).values():
        layer.reset_lora(0)
    for name, m in adapter.modules.items():
        trainable_layers(model)[name].set_lora(0, *m.set_lora_args())
    got = np.asarray(_logits(model, ids, pos, jnp.full(32, 0, jnp.int32)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@nnx.jit
def _grads(model, ids, pos, slots):
    return nnx.grad(_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, ids, pos, slots)


@pytest.mark.parametrize("mesh_shape", [(2, 2)])
def test_gradients_on_a_mesh_equal_the_unsharded_ones(mesh_shape):
    """The sharded layers (shard_map, the tensor-axis all-reduce, S-LoRA off) give the
    LoRA stacks the gradients of the unsharded model."""
    if np.prod(mesh_shape) > jax.device_count():
        pytest.skip(f"needs {np.prod(mesh_shape)} devices")
    ids, pos = _batch()
    slots = jnp.repeat(jnp.array([1, 0, 1, -1], jnp.int32), 8)
    grads = []
    for rules in (None, lj.ShardingRules(jax.make_mesh(mesh_shape, ("dp", "tp")))):
        model = _model(rules)
        init_lora_slot(model, 0, 8, seed=1)
        init_lora_slot(model, 1, 4, seed=2)
        for layer in _linear(model).values():  # B != 0: A gets gradients too
            for v in layer.lora_b:
                v.set_value(v[...] + 0.05 * (v[...] == 0))
        grads.append(jax.tree.map(np.asarray, _grads(model, ids, pos, slots)))
    flat_want, flat_got = jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])
    assert len(flat_want) == len(flat_got) and any(np.abs(g).max() > 1e-4 for g in flat_want)
    for want, got in zip(flat_want, flat_got):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


@nnx.jit(static_argnums=4)
def _grads_one_slot(model, ids, pos, slots, single_slot):
    def loss(model, ids, pos, slots):
        with lj.lora_mapping(model, slots, single_slot=single_slot):
            logits = model(ids, pos)[0]
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

    return nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, ids, pos, slots)


@pytest.mark.slow
@pytest.mark.parametrize("fully_sharded", [False, True])
def test_single_slot_gradients_on_a_mesh_equal_the_unsharded_ones(fully_sharded):
    """A training batch that says ``single_slot=True`` on a dp x tp mesh (each shard's
    dense backward inside shard_map, S-LoRA on or off) gets the unsharded model's
    gradient without the hint."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    ids, pos = _batch()
    slots = jnp.repeat(jnp.array([1, 1, -1, 1], jnp.int32), 8)
    grads = []
    for rules, hint in (
        (None, None),
        (lj.ShardingRules(jax.make_mesh((2, 2), ("dp", "tp"))), True),
    ):
        cfg = DecoderConfig.tiny()
        model = DecoderForCausalLM(cfg, rules=rules, rngs=nnx.Rngs(0))
        wrap_model(model, lj.LoRAConfig(max_loras=3, max_lora_rank=MAX_RANK,
                                         fully_sharded_loras=fully_sharded))  # fmt: skip
        init_lora_slot(model, 1, 4, seed=2)
        for layer in _linear(model).values():  # B != 0: A gets gradients too
            for v in layer.lora_b:
                v.set_value(v[...] + 0.05 * (v[...] == 0))
        grads.append(jax.tree.map(np.asarray, _grads_one_slot(model, ids, pos, slots, hint)))
    flat_want, flat_got = jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])
    assert len(flat_want) == len(flat_got) and any(np.abs(g).max() > 1e-4 for g in flat_want)
    for want, got in zip(flat_want, flat_got):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_init_lora_slot_resets_the_layers_it_does_not_target():
    """A slot re-initialised on fewer modules kept the old adapter in the others (logits
    0.55 off the base, and exported with the new one)."""
    model = _model()
    ids, pos = _batch()
    base = np.asarray(_logits(model, ids, pos, jnp.full(32, -1, jnp.int32)))
    init_lora_slot(model, 1, 8, seed=1)
    for layer in _linear(model).values():  # as if trained: B != 0
        for v in layer.lora_b:
            v.set_value(v[...].at[1].set(0.05))
    model.model.embed_tokens.set_lora(1, np.ones((4, 256)), np.ones((64, 4)))
    init_lora_slot(model, 1, 4, seed=2, target_modules=["q_proj", "v_proj"])
    got = np.asarray(_logits(model, ids, pos, jnp.full(32, 1, jnp.int32)))
    np.testing.assert_array_equal(got, base)
    ranks = {
        name: np.asarray(layer.slot_ranks[...])[..., 1].tolist()
        for name, layer in lj.serving.wrap.lora_layers(model).items()
        if "layers.0" in name or "embed" in name
    }
    assert ranks["model.embed_tokens"] == [0]
    assert ranks["model.layers.0.self_attn.qkv_proj"] == [4, 0, 4]
    assert ranks["model.layers.0.mlp.down_proj"] == [0]


def test_init_lora_slot_takes_peft_s_all_linear_shorthand():
    """PEFT's "all-linear" (any case) trains what None trains; it was read as a regex and
    refused ("match no LoRA layer")."""
    every = init_lora_slot(_model(), 1, 4)
    for shorthand in ("all-linear", "ALL-LINEAR"):
        assert init_lora_slot(_model(), 1, 4, target_modules=shorthand) == every


def test_init_lora_slot_refuses_bad_targets_and_slots_by_name():
    model = _model()
    before = _stacks(model)
    for kw, msg in [
        (dict(target_modules="(q_proj"), "init_lora_slot: target_modules regex"),
        (dict(target_modules=["q_proj", None]), "non-empty strings"),
        (dict(target_modules={"q_proj": 4}), "must be a list of module names"),
        (dict(target_modules=["nothing"]), "match no LoRA layer"),
        (dict(slot=7), r"slot must be an int in \[0, 3\)"),
    ]:
        with pytest.raises(ValueError, match=msg):
            init_lora_slot(model, **{"slot": 1, "rank": 4, **kw})
    jax.tree.map(np.testing.assert_array_equal, _stacks(model), before)


def test_a_module_over_several_slices_is_not_trained():
    """A variable-slice layer saved as one checkpoint module got one A per slice, which
    training moved apart: the export then refused the slot."""
    from lora_jax.linear import MergedColumnParallelLinear

    class Net(nnx.Module):
        def __init__(self):
            self.fused_proj = MergedColumnParallelLinear(16, [8, 8, 16], rngs=nnx.Rngs(0))
            self.out_proj = lj.ReplicatedLinear(32, 16, rngs=nnx.Rngs(1))

    net = Net()
    wrap_model(
        net,
        lj.LoRAConfig(max_loras=2, max_lora_rank=8),
        packed_modules_mapping={"fused_proj": ["fused_proj"]},
    )
    assert net.fused_proj.n_slices == 3
    with pytest.raises(ValueError, match="one checkpoint module .* over 3 LoRA slices"):
        init_lora_slot(net, 1, 4, target_modules=["fused_proj"])
    assert init_lora_slot(net, 1, 4) == ["out_proj"]  # skipped by "all-linear"


def test_export_refuses_bad_dtypes_and_name_maps(tmp_path):
    model = _trained()
    for dtype, msg in [(np.int32, "must be a float dtype"), ("nope", "is not a dtype")]:
        with pytest.raises(ValueError, match=msg):
            save_peft_adapter(model, 1, tmp_path / "x", dtype=dtype)
    layer = model.model.layers[0].mlp.down_proj
    layer.lora_b[0].set_value(layer.lora_b[0][...].at[1].set(7e4))  # past f16's range
    with pytest.raises(ValueError, match="past float16's range"):
        save_peft_adapter(model, 1, tmp_path / "x", dtype=np.float16)
    with pytest.raises(ValueError, match="name_map gives 'same'"):
        save_peft_adapter(model, 1, tmp_path / "x", name_map=lambda n: "same")
    with pytest.raises(ValueError, match="it must give a name"):
        save_peft_adapter(model, 1, tmp_path / "x", name_map=lambda n: None)
    assert not (tmp_path / "x").exists()


def test_exported_task_type_is_a_causal_lm_only_for_the_decoders(tmp_path):
    """A plain Flax model's adapter said CAUSAL_LM, which makes HF peft build a
    PeftModelForCausalLM that a custom torch model cannot take; PEFT leaves it None."""

    class Net(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

    net = Net()
    wrap_model(net, lj.LoRAConfig(max_loras=2, max_lora_rank=8))
    init_lora_slot(net, 1, 4)
    decoder = _trained()
    for model, kw, want in [
        (net, {}, None),
        (decoder, {}, "CAUSAL_LM"),
        (net, {"task_type": "FEATURE_EXTRACTION"}, "FEATURE_EXTRACTION"),
        (decoder, {"task_type": None}, None),
    ]:
        out = save_peft_adapter(model, 1, tmp_path / "t", **kw)
        assert json.loads((tmp_path / "t" / "adapter_config.json").read_text())["task_type"] == want
        assert out == str(tmp_path / "t")
    with pytest.raises(ValueError, match="task_type must be"):
        save_peft_adapter(net, 1, tmp_path / "u", task_type=1)


def test_exported_targets_name_exactly_the_modules_when_others_share_their_leaf(tmp_path):
    """Only layer 0's o_proj wrapped: the leaf list ["o_proj"] made PEFT put empty LoRA on
    layer 1's o_proj too; a regex of exactly the exported modules does not."""
    import re

    model = DecoderForCausalLM(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
    wrap_model(
        model,
        lj.LoRAConfig(max_loras=2, max_lora_rank=8),
        target_modules=r"model\.layers\.0\.self_attn\.o_proj",
    )
    init_lora_slot(model, 1, 4)
    save_peft_adapter(model, 1, tmp_path / "o")
    targets = json.loads((tmp_path / "o" / "adapter_config.json").read_text())["target_modules"]
    assert isinstance(targets, str)
    assert re.fullmatch(targets, "model.layers.0.self_attn.o_proj")
    assert not re.fullmatch(targets, "model.layers.1.self_attn.o_proj")


@pytest.mark.parametrize("tokens", [256, 2048])
def test_the_gradient_through_the_kernels_lowers_for_cuda(tokens):
    """The backward pass of a forward that ran the Triton (and, for prompts, Mosaic GPU)
    kernels lowers for CUDA, through the kernels: the stacks' gradient included."""
    from tests.kernels.shrink_expand_test_base import abstract_gpu_context

    hidden, rank, L = 1024, 64, 4
    idx = jnp.asarray(np.repeat(np.arange(L), tokens // L), jnp.int32)  # L prompts
    m = lj.make_lora_mapping(idx, L)
    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((L, rank, hidden), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((L, hidden, rank), jnp.bfloat16)

    def loss(x, a, b):
        y = ops.add_lora_linear(
            jnp.zeros((tokens, hidden), jnp.bfloat16), x, [a], [b], m, 0.5, backend="pallas"
        )
        return jnp.sum(y.astype(jnp.float32) ** 2)

    with abstract_gpu_context():
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, a, b)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "lora_slot_outer" in text


def test_slot_writes_leave_every_jit_compiled_for_the_model():
    """On one device `set_lora` / `init_lora_slot` committed the slots' ranks to the
    device: every compiled serving program (generate's prefill and decode for every
    bucket) compiled again after a slot write, without tracing again."""
    model = _model()
    count = jax.jit(lambda state: sum(jnp.sum(v) for v in jax.tree.leaves(state)))
    state = lambda: nnx.state(model, nnx.LoRAParam, lj.LoRASlotRanks)  # noqa: E731
    count(state())
    before = count._cache_size()
    init_lora_slot(model, 1, 4, target_modules=["q_proj"])  # writes and resets every layer
    model.model.embed_tokens.set_lora(2, np.ones((4, 256)), np.ones((64, 4)))
    model.model.layers[0].mlp.down_proj.reset_lora(2)
    count(state())
    assert count._cache_size() == before


def test_a_slot_a_manager_serves_is_not_trained_and_a_reserved_one_is_not_taken():
    """`init_lora_slot` on the slot of an adapter a manager serves replaced its weights
    while the manager kept routing its requests there, and the manager's next activation
    took the free slot being trained: the first is now refused (naming the adapter), and
    a slot reserved with `reserve_slot` is never taken. A manager that nothing holds any
    more (it is freed at once) refuses nothing."""
    import weakref

    from lora_jax.serving.manager import LRUCacheLoRAModelManager

    model = _model()
    ids, pos = _batch()

    def logits(slot):
        return np.asarray(_logits(model, ids, pos, jnp.full(32, slot, jnp.int32)))

    init_lora_slot(model, 0, 4, seed=1)
    for layer in _linear(model).values():  # as if trained: B != 0
        for v in layer.lora_b:
            v.set_value(v[...].at[0].set(0.02))
    served = adapter_from_slot(model, 0, adapter_id=1, name="served")
    others = [adapter_from_slot(model, 0, adapter_id=i, name=f"a{i}") for i in (2, 3)]
    want = logits(0)
    dropped = LRUCacheLoRAModelManager(model)
    dropped.set_active_adapters([served])
    gone = weakref.ref(dropped)
    del dropped
    assert gone() is None
    init_lora_slot(model, 0, 4, seed=2)  # no live manager serves slot 0

    mgr = LRUCacheLoRAModelManager(model)
    mgr.set_active_adapters([served])
    slot = mgr.slot_of(1)
    np.testing.assert_array_equal(logits(slot), want)
    before = _stacks(model)
    msg = rf"slot {slot} holds adapter 1 of a LRUCacheLoRAModelManager .*deactivate_adapter\(1\)"
    with pytest.raises(ValueError, match=msg):
        init_lora_slot(model, slot, 4, seed=3)
    jax.tree.map(np.testing.assert_array_equal, _stacks(model), before)

    assert mgr.reserve_slot(1)
    init_lora_slot(model, 1, 4, seed=3)
    for layer in _linear(model).values():
        for v in layer.lora_b:
            v.set_value(v[...].at[1].set(0.03))
    trained = logits(1)
    for adapter in others:  # adapter 3 evicts adapter 1 rather than take slot 1
        mgr.set_active_adapters([adapter])
    assert mgr.lora_index_to_id[1] is None and sorted(mgr.list_adapters()) == [1, 2, 3]
    np.testing.assert_array_equal(logits(1), trained)
    np.testing.assert_array_equal(logits(mgr.slot_of(3)), want)


def _train_slot(model, tx_first, opt, steps=3, mesh=None):
    """Trains slot 1 (all-linear, rank 4, from PEFT's init) a few steps on one batch;
    returns the logits after. The optimizer is built under the model's ``mesh``."""
    init_lora_slot(model, 1, 4, seed=3)
    ids, pos = _batch()
    slots = jnp.repeat(jnp.array([1, 1, 0, 1], jnp.int32), 8)
    tx = optax.chain(*tx_first, opt, train_only_slots([1]))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    for _ in range(steps):
        _train_step(model, optimizer, ids, pos, slots)
    return np.asarray(_logits(model, ids, pos, slots))


@pytest.mark.parametrize(
    "opt",
    [
        optax.adamw(1e-2, weight_decay=0.1),
        pytest.param(optax.sgd(0.5, momentum=0.9), marks=pytest.mark.slow),
    ],
    ids=["adamw", "sgd"],
)
def test_kv_head_replicas_train_as_one_parameter(tmp_path, opt):
    """With tp=4 over 2 kv heads the stacks hold each kv head's B twice, and each copy got
    its own gradient: training moved them apart and the export refused the slot. With
    `tie_kv_replicas` first in the chain the copies share the sum of their gradients, so
    the slot trains as the tp=1 model's one B per kv head (SGD: the sum, not the mean)."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    rules = lj.ShardingRules(jax.make_mesh((2, 4), ("dp", "tp")))
    model = _model(rules)
    qkvs = [layer.self_attn.qkv_proj for layer in model.model.layers]
    assert {q.base_layer.num_kv_head_replicas for q in qkvs} == {2}
    spec = qkvs[0].lora_b[1][...].sharding.spec
    got_logits = _train_slot(model, [tie_kv_replicas(model)], opt, mesh=rules.mesh)
    for qkv in qkvs:
        for s in (1, 2):  # k, v: [L, kv * replicas * head_size, R], each head's copies side by side
            b = np.asarray(qkv.lora_b[s][...])[1].reshape(2, 2, 16, MAX_RANK)
            assert np.abs(b).max() > 1e-3
            np.testing.assert_array_equal(b[:, 0], b[:, 1])
        assert qkv.lora_b[1][...].sharding.spec == spec  # the tie keeps B's sharding
    save_peft_adapter(model, 1, tmp_path / "tied")
    got = load_peft_adapter(tmp_path / "tied", model, lj.LoRAConfig(max_lora_rank=MAX_RANK))

    ref = _model()  # tp=1, no replicas (the tie is the identity): same weights, init, data
    want_logits = _train_slot(ref, [tie_kv_replicas(ref)], opt)
    save_peft_adapter(ref, 1, tmp_path / "ref")
    want = load_peft_adapter(tmp_path / "ref", ref, lj.LoRAConfig(max_lora_rank=MAX_RANK))
    assert set(got.modules) == set(want.modules)
    for name, m in want.modules.items():
        for w, g in zip(
            (*m.lora_a, *m.lora_b), (*got.modules[name].lora_a, *got.modules[name].lora_b)
        ):
            tol = 1e-3 * np.abs(w).max()  # each tensor to its own scale: SGD's kv B is small
            np.testing.assert_allclose(g, w, rtol=0, atol=tol, err_msg=name)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)

    untied = _model(rules)  # without it the copies part, and the export says what to use
    _train_slot(untied, [], opt, mesh=rules.mesh)
    with pytest.raises(ValueError, match="replicas of a kv head's B differ.*tie_kv_replicas"):
        save_peft_adapter(untied, 1, tmp_path / "untied")


def test_tie_kv_replicas_takes_split_state_gradients():
    """Flax's functional loop (`nnx.split` state, `jax.grad` over it: Variables, whose
    leaves' paths end in `.value`) gets the same tied update as `nnx.Optimizer`'s pure
    arrays; the tie's paths missed them and it refused the model's own gradients."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    rules = lj.ShardingRules(jax.make_mesh((1, 4), ("dp", "tp")))
    model = _model(rules)
    init_lora_slot(model, 1, 4, seed=3)
    ids, pos = _batch()
    lj.set_lora_mapping(model, jnp.full(32, 1, jnp.int32))  # in the state split below
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(lora):
        logits = nnx.merge(graphdef, lora, rest)(ids, pos)[0]
        return jnp.mean(jnp.square(logits))

    tx = optax.chain(tie_kv_replicas(model), optax.sgd(0.1), train_only_slots([1]))
    grads = jax.jit(jax.grad(loss))(lora)
    got, _ = tx.update(grads, tx.init(lora), lora)
    pure = nnx.as_pure(grads)
    want, _ = tx.update(pure, tx.init(pure), nnx.as_pure(lora))
    jax.tree.map(np.testing.assert_array_equal, nnx.as_pure(got), want)
    b = np.asarray(nnx.as_pure(got)["model"]["layers"][0]["self_attn"]["qkv_proj"]["lora_b"][1])
    heads = b[1].reshape(2, 2, 16, MAX_RANK)  # k's B, slot 1: each kv head's two copies
    assert np.abs(heads).max() > 0
    np.testing.assert_array_equal(heads[:, 0], heads[:, 1])


def test_tie_kv_replicas_refuses_updates_of_another_model():
    """The tie finds its B stacks by the model's state paths: updates that lack one, or
    hold it in another shape, are refused by name rather than left untied."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    with pytest.raises(ValueError, match="tie_kv_replicas: the model has no LoRA layers"):
        tie_kv_replicas(DecoderForCausalLM(DecoderConfig.tiny(), rngs=nnx.Rngs(0)))
    rules = lj.ShardingRules(jax.make_mesh((1, 4), ("dp", "tp")))
    tx = tie_kv_replicas(_model(rules))
    grads = nnx.as_pure(nnx.state(_model(rules), nnx.LoRAParam))
    with pytest.raises(
        ValueError, match=r"no B \(or DoRA magnitude\) stack at \['model\.layers\.0\.self_attn\.qkv"
    ):
        tx.update({"lm_head": grads["lm_head"]}, tx.init(grads))
    other = nnx.as_pure(nnx.state(_model(rules, max_loras=2), nnx.LoRAParam))
    with pytest.raises(ValueError, match=r"has shape \(2, 64, 8\), but .*qkv_proj's B"):
        tx.update(other, tx.init(other))
