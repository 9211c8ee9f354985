"""`GateLinear` (an MoE router whose logits may be f32 from bf16 inputs) and
`GateLinearWithLoRA`, vLLM's router LoRA class, against float64 numpy oracles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from layer_cases import make_mesh
from serving_toy import tiny_mixtral

import lora_jax as lj
from lora_jax import ops
from lora_jax.serving.wrap import lora_layers, wrap_model

H, E = 32, 16


def _bf16(a):
    """`a` rounded to bf16, as float64 (what a bf16 array holds)."""
    return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)


def _router(rng, **kw):
    gate = lj.GateLinear(H, E, rngs=nnx.Rngs(0), **kw)
    gate.load_kernel([rng.normal(0, 0.5, (H, E)).astype(np.float32)])
    return gate


def _oracle(x, kernel, adapters, idx):
    """float64 `x @ W + x @ Aᵀ @ Bᵀ` per token, from the values the arrays hold."""
    x = np.asarray(x, np.float64)
    y = x @ np.asarray(kernel, np.float64)
    for t, slot in enumerate(idx):
        if slot in adapters:  # -1 and unwritten slots: the base
            a, b = adapters[slot]
            y[t] += x[t] @ a.T @ b.T
    return y


def test_f32_logits_from_bf16_are_not_rounded_to_bf16():
    """bf16 inputs and weights, `out_dtype=f32`: the logits are the f32 sums of the bf16
    products (vLLM's bf16 × bf16 → fp32 GEMM), closer to the exact product than the bf16
    logits a `ReplicatedLinear` with the same weights gives."""
    rng = np.random.default_rng(0)
    kw = dict(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    gate = _router(rng, out_dtype=jnp.float32, **kw)
    plain = lj.ReplicatedLinear(H, E, rngs=nnx.Rngs(0), **kw)
    plain.load_kernel([np.asarray(gate.kernel[...], np.float32)])
    x = jnp.asarray(rng.normal(size=(8, H)), jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ np.asarray(gate.kernel[...], np.float64)
    y = gate(x)
    assert y.dtype == jnp.float32 and plain(x).dtype == jnp.bfloat16
    err = np.abs(np.asarray(y, np.float64) - exact).max()
    err_bf16 = np.abs(np.asarray(plain(x), np.float64) - exact).max()
    assert err < 1e-4 * np.abs(exact).max() and err_bf16 > 10 * err, (err, err_bf16)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_lora_lands_in_the_f32_logits_unrounded(monkeypatch, backend):
    """A bf16 router with f32 logits and bf16 adapters: each token's delta is added to its
    f32 logits without a round trip through bf16, on XLA and through the Pallas kernels
    (interpret mode on a CPU); -1 tokens get the base logits exactly."""
    if jax.default_backend() != "gpu":
        monkeypatch.setattr(ops, "PALLAS_INTERPRET", True)
    monkeypatch.setattr(ops, "_default_backend", backend)
    rng = np.random.default_rng(1)
    gate = _router(rng, out_dtype=jnp.float32, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    layer = lj.GateLinearWithLoRA(gate, lj.LoRAConfig(max_loras=3, max_lora_rank=8))
    assert layer.lora_a[0].dtype == jnp.bfloat16  # the router's weight dtype
    adapters = {}
    for slot, r in ((0, 8), (2, 4)):
        a, b = rng.normal(0, 0.3, (r, H)), rng.normal(0, 0.3, (E, r))
        layer.set_lora(slot, a, b)
        adapters[slot] = (_bf16(a), _bf16(b))
    idx = np.array([0, -1, 2, 2, 0, 1, -1, 0, 2, 0, 0, 2, -1, 2, 0, 1], np.int32)
    x = jnp.asarray(rng.normal(size=(len(idx), H)), jnp.bfloat16)

    @nnx.jit
    def f(layer, x, idx):
        with lj.lora_mapping(layer, idx):
            return layer(x)

    y = f(layer, x, jnp.asarray(idx))
    assert y.dtype == jnp.float32
    ref = _oracle(x, gate.kernel[...], adapters, idx)
    scale = np.abs(ref).max()
    # bf16 logits would be off by up to ~scale / 256; f32 ones by what the f32 sums lose
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=0, atol=2e-5 * scale)
    base = idx < 0
    np.testing.assert_array_equal(np.asarray(y)[base], np.asarray(gate(x))[base])


@pytest.mark.parametrize("lora_dtype", [None, jnp.bfloat16], ids=["f32_lora", "bf16_lora"])
def test_an_f32_router_serves_f32_and_bf16_adapters(lora_dtype):
    """An f32 router (vLLM's `force_fp32_compute`: f32 weights, f32 compute) fed bf16
    hidden states takes f32 adapters (the default: its weights' dtype) or bf16 ones
    (`lora_dtype`), which vLLM's Triton kernels refuse; on a dp = 2 × tp = 2 mesh it is
    replicated like any `ReplicatedLinear`."""
    rng = np.random.default_rng(2)
    rules = lj.ShardingRules(make_mesh(2, 2))
    gate = _router(rng, dtype=jnp.float32, out_dtype=jnp.float32, rules=rules)
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, lora_dtype=lora_dtype)
    layer = lj.GateLinearWithLoRA(gate, cfg)
    assert layer.lora_a[0].dtype == (lora_dtype or jnp.float32)
    a, b = rng.normal(0, 0.3, (8, H)), rng.normal(0, 0.3, (E, 8))
    layer.set_lora(1, a, b)
    held = _bf16 if lora_dtype is not None else (lambda w: np.asarray(w, np.float32))
    idx = np.array([1, -1, 1, 0], np.int32)  # slot 0 was never written: the base
    x = jnp.asarray(rng.normal(size=(4, H)), jnp.bfloat16)
    lj.set_lora_mapping(layer, jnp.asarray(idx))
    y = layer(x)
    assert y.dtype == jnp.float32
    ref = _oracle(x, gate.kernel[...], {1: (held(a), held(b))}, idx)
    np.testing.assert_allclose(
        np.asarray(y, np.float64), ref, rtol=0, atol=1e-5 * np.abs(ref).max()
    )


def test_out_dtype_is_a_float_dtype_set_once():
    gate = lj.GateLinear(H, E, rngs=nnx.Rngs(0))
    assert gate.out_dtype is None
    with pytest.raises(ValueError, match="GateLinear.out_dtype must be a float dtype, got int32"):
        gate.set_out_dtype(jnp.int32)
    with pytest.raises(ValueError, match="GateLinear.out_dtype=.fp33. is not a dtype"):
        gate.set_out_dtype("fp33")
    assert gate.out_dtype is None  # the refused calls left it unset
    gate.set_out_dtype("float32")
    assert gate.out_dtype == jnp.float32
    with pytest.raises(ValueError, match=r"out_dtype is already set \(float32\)"):
        gate.set_out_dtype(jnp.bfloat16)
    with pytest.raises(ValueError, match="base layer must be a GateLinear"):
        lj.GateLinearWithLoRA(lj.ReplicatedLinear(H, E, rngs=nnx.Rngs(0)), lj.LoRAConfig())


def test_the_moe_router_is_wrapped_as_vllm_wraps_it():
    """The MoE decoders' router is a `GateLinear`: `wrap_model` gives it
    `GateLinearWithLoRA` (with `fully_sharded_loras` too: the layer grid's pick test),
    and a slot's router LoRA moves the routing, so the logits differ from the base's."""
    model = tiny_mixtral()
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, fully_sharded_loras=True)
    wrap_model(model, cfg, target_modules=["gate"])
    ((name, router),) = lora_layers(model).items()
    assert name.endswith("mlp.gate") and type(router) is lj.GateLinearWithLoRA
    rng = np.random.default_rng(3)
    router.set_lora(1, rng.normal(0, 1.0, (8, 32)), rng.normal(0, 1.0, (4, 8)))
    ids = jnp.asarray(rng.integers(0, 64, (2, 6)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))

    @nnx.jit
    def logits(model, slots):
        with lj.lora_mapping(model, slots):
            return model(ids, pos)[0]

    # sequence 0 on slot 1 (the router LoRA), sequence 1 on the empty slot 0 (the base)
    out = np.asarray(logits(model, jnp.repeat(jnp.array([1, 0], jnp.int32), 6)))
    base_out = np.asarray(logits(model, jnp.full((12,), -1, jnp.int32)))
    # sequence 1 is the base's; not bit for bit on a GPU, where sequence 0's new routing
    # regroups the experts' tokens and their matmuls round differently (H100: 3e-8)
    np.testing.assert_allclose(out[1], base_out[1], rtol=1e-5, atol=1e-6)
    assert np.abs(out[0] - base_out[0]).max() > 1e-3
