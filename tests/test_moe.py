"""FusedMoE and its LoRA layers against a per-(token, expert) numpy loop.

The oracle knows nothing of the layer's layouts: logical gate/up/down weights, logical
adapters, a softmax-top-k router and, for every token and chosen expert, the expert MLP
with that token's adapter applied. Meshes with tp and ep in {1, 2, 4, 8} (and dp) run
on 8 simulated CPU devices.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lora_jax.config import LoRAConfig
from lora_jax.layers.moe import FusedMoE3DWithLoRA, FusedMoEWithLoRA
from lora_jax.mapping import make_lora_mapping
from lora_jax.moe import FusedMoE, select_experts
from lora_jax.sharding import ShardingRules

E, K, H, INTER, T, L, R = 8, 2, 16, 16, 12, 4, 8

_ACT = {
    "silu": lambda v: v / (1 + np.exp(-v)),
    "relu2": lambda v: np.maximum(v, 0) ** 2,
}


# -- oracle ---------------------------------------------------------------------------------
def interleave(gate, up):
    """[..., I] x 2 -> [..., 2I] with gate on even, up on odd columns."""
    out = np.empty(gate.shape[:-1] + (2 * gate.shape[-1],), gate.dtype)
    out[..., 0::2], out[..., 1::2] = gate, up
    return out


def oracle(x, logits, w, adapters, idx, *, gated, layout, act="silu", renormalize=True):
    """y[t] = sum_k weight * (act(x W1 + dW1) * (x W3 + dW3)) W2 + dW2) for expert e_k."""
    y = np.zeros((x.shape[0], H))
    f = _ACT[act]
    for t in range(x.shape[0]):
        z = logits[t] - logits[t].max()
        p = np.exp(z) / np.exp(z).sum()
        top = np.argsort(-p, kind="stable")[:K]
        wts = p[top] / p[top].sum() if renormalize else p[top]
        ad = adapters.get(int(idx[t])) if idx[t] >= 0 else None
        for e, wt in zip(top, wts):
            gate = x[t] @ w["w1"][e]
            up = x[t] @ w["w3"][e] if gated else None
            if ad is not None and "w13" in ad:
                a, b = ad["w13"]
                d = (a[e] @ x[t]) @ b[e].T
                if not gated:
                    gate = gate + d
                elif layout == "interleaved":
                    gate, up = gate + d[0::2], up + d[1::2]
                else:
                    gate, up = gate + d[:INTER], up + d[INTER:]
            elif ad is not None:
                for name in ("w1", "w3"):
                    if name in ad and (gated or name == "w1"):
                        a, b = ad[name]
                        d = (a[e] @ x[t]) @ b[e].T
                        gate, up = (gate + d, up) if name == "w1" else (gate, up + d)
            h = f(gate) * up if gated else f(gate)
            o = h @ w["w2"][e]
            if ad is not None and "w2" in ad:
                a, b = ad["w2"]
                o = o + (a[e] @ h) @ b[e].T
            y[t] += wt * o
    return y


# -- fixtures -------------------------------------------------------------------------------
def make_weights(rng, gated):
    s = 0.3
    w = {"w1": rng.normal(0, s, (E, H, INTER)), "w2": rng.normal(0, s, (E, INTER, H))}
    if gated:
        w["w3"] = rng.normal(0, s, (E, H, INTER))
    return w


def make_adapter(rng, *, gated, fused_w13, rank, gate_up_w13=None):
    """Logical adapter: name -> (A [E, r, in], B [E, out, r])."""
    s = 0.3
    pair = lambda n_in, n_out: (  # noqa: E731
        rng.normal(0, s, (E, rank, n_in)),
        rng.normal(0, s, (E, n_out, rank)),
    )
    ad = {"w2": pair(INTER, H)}
    if fused_w13:
        ad["w13"] = pair(H, 2 * INTER if gated else INTER)
    else:
        ad["w1"] = pair(H, INTER)
        if gated:
            ad["w3"] = pair(H, INTER)
    return ad


def to_set_lora(ad, layer):
    names = layer.projections
    return [ad[n][0] if n in ad else None for n in names], [
        ad[n][1] if n in ad else None for n in names
    ]


def make_mesh(dp=1, tp=1, ep=1, explicit=True):
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh((dp, tp, ep), ("dp", "tp", "ep"), axis_types=(kind,) * 3)


def build(
    rng,
    *,
    gated=True,
    layout="concat",
    act="silu",
    fused_w13=False,
    impl="grouped",
    lora_impl="ops",
    mesh=None,
    fully_sharded=False,
    renormalize=True,
    dtype=None,
    param_dtype=jnp.float32,
    ops_backend=None,
    tokens=T,
    lora_dtype=None,
):
    rules = ShardingRules(mesh)
    base = FusedMoE(
        E, K, H, INTER, renormalize=renormalize, activation=act, is_act_and_mul=gated,
        gate_up_layout=layout, impl=impl, rules=rules, dtype=dtype, param_dtype=param_dtype,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    w = make_weights(rng, gated)
    if gated and layout == "interleaved":
        base.load_weights(w13=interleave(w["w1"], w["w3"]), w2=w["w2"])
    elif gated:
        base.load_weights(w13=np.concatenate([w["w1"], w["w3"]], -1), w2=w["w2"])
    else:
        base.load_weights(w1=w["w1"], w2=w["w2"])
    cls = FusedMoE3DWithLoRA if fused_w13 else FusedMoEWithLoRA
    cfg = LoRAConfig(
        max_loras=L, max_lora_rank=R, fully_sharded_loras=fully_sharded, lora_dtype=lora_dtype
    )
    layer = cls(base, cfg, lora_impl=lora_impl, ops_backend=ops_backend)
    # A mapping from the start keeps the context's pytree structure fixed: no retrace
    # on the second call of `forward`.
    layer.lora_context.set_value(make_lora_mapping(jnp.full((tokens,), -1, jnp.int32), L))
    return layer, w


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, x, logits, idx):
    layer = nnx.merge(graphdef, state)
    layer.lora_context.set_value(make_lora_mapping(idx, L))
    return layer(x, logits)


def forward(layer, x, logits, idx, lower=False):
    """One jitted step; the layer's state is an input only, so its shardings never drift
    between calls (no recompiles)."""
    graphdef, state = nnx.split(layer)
    return (_forward.lower if lower else _forward)(graphdef, state, x, logits, idx)


def inputs(rng, t=T):
    x = rng.normal(0, 1, (t, H)).astype(np.float32)
    logits = rng.normal(0, 2, (t, E)).astype(np.float32)
    return x, logits


IDX = np.array([0, 1, -1, 2, 0, 3, -1, 1, 1, 2, 0, -1], np.int32)  # -1 and repeated slots


def fill(layer, rng, *, gated, fused_w13, ranks=(8, 4, 8)):
    """Slots 0..2 get adapters (rank below max included); slot 3 stays empty."""
    ads = {}
    for slot, r in enumerate(ranks):
        ad = make_adapter(rng, gated=gated, fused_w13=fused_w13, rank=r)
        layer.set_lora(slot, *to_set_lora(ad, layer))
        ads[slot] = ad
    return ads


# -- base layer -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "gated,layout,act,impl,renormalize",
    [
        (True, "concat", "silu", "grouped", True),
        pytest.param(True, "interleaved", "silu", "dense", False, marks=pytest.mark.slow),
        pytest.param(False, "concat", "relu2", "grouped", True, marks=pytest.mark.slow),
        (False, "concat", "silu", "dense", True),
    ],
)
def test_base_matches_oracle(gated, layout, act, impl, renormalize):
    rng = np.random.default_rng(0)
    layer, w = build(rng, gated=gated, layout=layout, act=act, impl=impl, renormalize=renormalize)
    x, logits = inputs(rng)
    y = nnx.jit(lambda m, x, lg: m(x, lg))(layer.base_layer, x, logits)
    ref = oracle(x, logits, w, {}, np.full(T, -1), gated=gated, layout=layout, act=act,
                 renormalize=renormalize)  # fmt: skip
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)


def test_select_experts_softmax_topk_renormalize():
    logits = jnp.array([[0.0, 3.0, 1.0, 2.0]])
    w, ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 3]]
    np.testing.assert_allclose(np.asarray(w), [[1 / (1 + np.exp(-1)), 1 / (1 + np.exp(1))]], 1e-6)
    w2, _ = select_experts(logits, 2, renormalize=False)
    p = np.exp([0.0, 3.0, 1.0, 2.0]) / np.exp([0.0, 3.0, 1.0, 2.0]).sum()
    np.testing.assert_allclose(np.asarray(w2), [[p[1], p[3]]], 1e-6)


# -- LoRA, unsharded ------------------------------------------------------------------------
CASES = [
    # gated, layout, fused_w13, impl, lora_impl
    (True, "concat", False, "grouped", "ops"),
    pytest.param(True, "concat", False, "dense", "ops", marks=pytest.mark.slow),
    (True, "interleaved", False, "grouped", "ragged"),
    pytest.param(True, "concat", True, "grouped", "ragged", marks=pytest.mark.slow),
    (True, "interleaved", True, "grouped", "ops"),
    pytest.param(True, "interleaved", True, "dense", "ops", marks=pytest.mark.slow),
    pytest.param(False, "concat", False, "grouped", "ops", marks=pytest.mark.slow),
    (False, "concat", True, "dense", "ops"),
]


@pytest.mark.parametrize("gated,layout,fused_w13,impl,lora_impl", CASES)
def test_lora_matches_oracle(gated, layout, fused_w13, impl, lora_impl):
    rng = np.random.default_rng(1)
    layer, w = build(rng, gated=gated, layout=layout, fused_w13=fused_w13, impl=impl,
                     lora_impl=lora_impl)  # fmt: skip
    ads = fill(layer, rng, gated=gated, fused_w13=fused_w13)
    x, logits = inputs(rng)
    y = forward(layer, x, logits, IDX)
    ref = oracle(x, logits, w, ads, IDX, gated=gated, layout=layout)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused_w13", [False, True])
def test_ragged_lora_keeps_f32_where_the_ops_do(fused_w13):
    """bf16 adapters in an f32 layer: the ragged path rounded the f32 shrink output (and
    the input) to bf16 (3.7e-3 off); it now rounds as the ops do, and agrees with them."""
    outs = []
    for lora_impl in ("ops", "ragged"):
        rng = np.random.default_rng(7)
        layer, _ = build(rng, fused_w13=fused_w13, lora_impl=lora_impl, lora_dtype=jnp.bfloat16)
        fill(layer, rng, gated=True, fused_w13=fused_w13)
        x, logits = inputs(rng)
        outs.append(np.asarray(forward(layer, x, logits, IDX)))
    assert outs[0].dtype == outs[1].dtype == np.float32
    np.testing.assert_allclose(outs[1], outs[0], rtol=2e-5, atol=2e-5 * np.abs(outs[0]).max())


KERNEL_CASES = [
    # gated, layout, fused_w13, impl, mesh (dp, tp, ep), fully_sharded, tokens
    (True, "concat", False, "grouped", None, False, T),
    (True, "interleaved", True, "dense", None, False, T),
    (False, "concat", False, "grouped", None, False, T),
    (True, "concat", True, "grouped", None, False, 64),  # 128 (token, expert) rows
    pytest.param(
        True, "interleaved", False, "grouped", (1, 2, 2), False, T, marks=pytest.mark.slow
    ),
    (True, "concat", True, "grouped", (2, 2, 2), True, T),
]


@pytest.mark.parametrize("gated,layout,fused_w13,impl,mesh,fully_sharded,tokens", KERNEL_CASES)
def test_lora_through_the_kernels(monkeypatch, gated, layout, fused_w13, impl, mesh,
                                  fully_sharded, tokens):  # fmt: skip
    """The GPU path: the (token, expert) rows' shrink and expand on the Pallas kernels
    (interpret mode, `ops_backend="pallas"`), gated or not, fused w13 or not, grouped or
    dense, on one device and on tp x ep meshes (fully sharded too), against the oracle."""
    from lora_jax import kernels, ops

    monkeypatch.setattr(ops, "PALLAS_INTERPRET", True)
    calls = []
    for name in ("lora_shrink", "lora_expand"):
        fn = getattr(kernels, name)
        spy = lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k)
        monkeypatch.setattr(kernels, name, spy)
    rng = np.random.default_rng(4)
    mesh = None if mesh is None else make_mesh(*mesh)
    layer, w = build(rng, gated=gated, layout=layout, fused_w13=fused_w13, impl=impl, mesh=mesh,
                     fully_sharded=fully_sharded, ops_backend="pallas", tokens=tokens)  # fmt: skip
    ads = fill(layer, rng, gated=gated, fused_w13=fused_w13)
    idx = IDX if tokens == T else rng.integers(-1, L, tokens).astype(np.int32)
    x, logits = inputs(rng, tokens)
    y = forward(layer, x, logits, idx)
    assert {"lora_shrink", "lora_expand"} <= set(calls), calls
    ref = oracle(x, logits, w, ads, idx, gated=gated, layout=layout)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "layout,fused_w13",
    [
        ("concat", False),
        pytest.param("interleaved", False, marks=pytest.mark.slow),
        pytest.param("concat", True, marks=pytest.mark.slow),
    ],
)
def test_lora_gradients_through_the_kernels_equal_xla_s(monkeypatch, layout, fused_w13):
    """Training the experts' LoRA on the GPU path: the gradient of every stack through the
    kernels' own backward pass (interpret mode; the (token, expert) rows as L x E slots,
    the interleaved w13's f32 expand) equals XLA's autodiff of the XLA backend."""
    from lora_jax import ops

    monkeypatch.setattr(ops, "PALLAS_INTERPRET", True)
    grads = []
    for backend in ("xla", "pallas"):
        rng = np.random.default_rng(4)
        layer, _ = build(rng, gated=True, layout=layout, fused_w13=fused_w13,
                         ops_backend=backend)  # fmt: skip
        fill(layer, rng, gated=True, fused_w13=fused_w13)
        x, logits = (jnp.asarray(v) for v in inputs(rng))
        layer.lora_context.set_value(make_lora_mapping(jnp.asarray(IDX), L))

        def loss(layer, x, logits):
            return jnp.sum(jnp.sin(layer(x, logits)))

        g = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(layer, x, logits)
        grads.append(jax.tree.leaves(nnx.state(g, nnx.LoRAParam)))
    assert len(grads[0]) == len(grads[1]) >= 4
    for w, g in zip(*grads):
        assert np.any(np.asarray(w))  # every stack has a gradient
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["grouped", "dense"])
def test_decode_flag_reaches_the_expert_rows(impl, monkeypatch):
    """A decode step's mapping (`is_prefill=False`) makes the expert rows' mappings decode
    ones too (their shrink then skips the prompt-tile kernel), and the output is the same."""
    import lora_jax.layers.moe_hook as moe_mod  # the per-shard hook makes the rows' mappings

    rng = np.random.default_rng(1)
    layer, w = build(rng, gated=True, layout="concat", fused_w13=True, impl=impl,
                     lora_impl="ops")  # fmt: skip
    ads = fill(layer, rng, gated=True, fused_w13=True)
    x, logits = inputs(rng)
    seen = []
    real = moe_mod.make_lora_mapping

    def spy(idx, max_loras, seq=None, *, is_prefill=None):
        seen.append(is_prefill)
        return real(idx, max_loras, seq, is_prefill=is_prefill)

    monkeypatch.setattr(moe_mod, "make_lora_mapping", spy)
    layer.lora_context.set_value(make_lora_mapping(jnp.asarray(IDX), L, is_prefill=False))
    y = layer(jnp.asarray(x), jnp.asarray(logits))
    assert seen and set(seen) == {False}
    ref = oracle(x, logits, w, ads, IDX, gated=True, layout="concat")
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)


def test_lora_only_some_modules():
    """An adapter on w2 only (w1/w3 None) touches only the down projection."""
    rng = np.random.default_rng(2)
    layer, w = build(rng)
    ad = make_adapter(rng, gated=True, fused_w13=False, rank=8)
    ad = {"w2": ad["w2"]}
    layer.set_lora(1, *to_set_lora(ad, layer))
    x, logits = inputs(rng)
    y = forward(layer, x, logits, IDX)
    ref = oracle(x, logits, w, {1: ad}, IDX, gated=True, layout="concat")
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)


def test_non_gated_accepts_vllm_triple():
    rng = np.random.default_rng(3)
    layer, _ = build(rng, gated=False)
    ad = make_adapter(rng, gated=False, fused_w13=False, rank=8)
    layer.set_lora(0, [ad["w1"][0], ad["w2"][0], None], [ad["w1"][1], ad["w2"][1], None])
    assert int(layer.slot_ranks[...][0, 0]) == 8


@pytest.mark.parametrize(
    "impl,dtype",
    # The dense loop in bf16 is left out: XLA's default xla_allow_excess_precision lets
    # the base-only program skip a bf16 rounding of the w13 output that the LoRA program
    # keeps, so bit equality there is not XLA's promise (it holds in f32).
    [
        ("grouped", jnp.bfloat16),
        pytest.param("grouped", jnp.float32, marks=pytest.mark.slow),
        ("dense", jnp.float32),
    ],
)
def test_no_adapter_is_exactly_base(impl, dtype):
    """All -1, and a reset slot, give bit-identical base outputs."""
    rng = np.random.default_rng(4)
    layer, _ = build(rng, impl=impl, dtype=dtype, param_dtype=dtype)
    fill(layer, rng, gated=True, fused_w13=False)
    x, logits = inputs(rng)
    x = x.astype(dtype)
    base = nnx.jit(lambda m, x, lg: m(x, lg))(layer.base_layer, x, logits)
    y = forward(layer, x, logits, np.full(T, -1, np.int32))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(base, np.float32))
    layer.reset_lora(0)
    y0 = forward(layer, x, logits, np.zeros(T, np.int32))
    np.testing.assert_array_equal(np.asarray(y0, np.float32), np.asarray(base, np.float32))
    # Mixed batch: the -1 rows equal the base rows exactly.
    ym = forward(layer, x, logits, IDX)
    keep = IDX < 0
    ym, base = np.asarray(ym, np.float32), np.asarray(base, np.float32)
    np.testing.assert_array_equal(ym[keep], base[keep])
    assert not np.allclose(ym[~keep], base[~keep])


def test_bf16_close_to_oracle():
    rng = np.random.default_rng(5)
    layer, w = build(rng, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    ads = fill(layer, rng, gated=True, fused_w13=False)
    x, logits = inputs(rng)
    y = forward(layer, x.astype(jnp.bfloat16), logits, IDX)
    ref = oracle(x, logits, w, ads, IDX, gated=True, layout="concat")
    err = np.abs(np.asarray(y, np.float32) - ref).max() / np.abs(ref).max()
    assert err < 3e-2, err


@pytest.mark.parametrize(
    "gated,act,renormalize,fused_w13,impl",
    [
        (False, "relu2", True, False, "grouped"),  # Nemotron-H: non-gated relu^2
        (True, "silu", False, True, "grouped"),  # weights not renormalised over the top k
        pytest.param(False, "relu2", False, True, "dense", marks=pytest.mark.slow),
    ],
)
def test_lora_with_other_activations_and_routing(gated, act, renormalize, fused_w13, impl):
    """LoRA under the base layer's other options: relu^2 experts and unrenormalised
    routing weights, against the oracle."""
    rng = np.random.default_rng(6)
    layer, w = build(rng, gated=gated, act=act, renormalize=renormalize, fused_w13=fused_w13,
                     impl=impl)  # fmt: skip
    ads = fill(layer, rng, gated=gated, fused_w13=fused_w13)
    x, logits = inputs(rng)
    y = forward(layer, x, logits, IDX)
    ref = oracle(x, logits, w, ads, IDX, gated=gated, layout="concat", act=act,
                 renormalize=renormalize)  # fmt: skip
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "mesh,impl",
    [
        (None, "grouped"),
        ((1, 2, 4), "grouped"),
        pytest.param((1, 1, 8), "dense", marks=pytest.mark.slow),
    ],
    ids=["one_device", "tp2_ep4", "ep8_dense"],
)
def test_lora_with_64_experts_top6(monkeypatch, mesh, impl):
    """vLLM's MoE LoRA grid scale: 64 experts, 6 a token (72 rows over 12 tokens), every
    expert's adapter its own, on one device and split over tp x ep."""
    import sys

    mod = sys.modules[__name__]
    monkeypatch.setattr(mod, "E", 64)  # the builders and the oracle read these
    monkeypatch.setattr(mod, "K", 6)
    rng = np.random.default_rng(8)
    mesh = None if mesh is None else make_mesh(*mesh)
    layer, w = build(rng, mesh=mesh, impl=impl)
    assert layer.base_layer.num_experts == 64 and layer.base_layer.top_k == 6
    ads = fill(layer, rng, gated=True, fused_w13=False)
    x, logits = inputs(rng)
    y = forward(layer, x, logits, IDX)
    ref = oracle(x, logits, w, ads, IDX, gated=True, layout="concat")
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["lora", "fully_sharded"])
def test_bf16_on_a_tp_ep_mesh_close_to_oracle(fully_sharded):
    """bf16 weights and adapters on a dp 2 x tp 2 x ep 2 mesh, within bf16's error."""
    rng = np.random.default_rng(7)
    layer, w = build(rng, mesh=make_mesh(2, 2, 2), fully_sharded=fully_sharded,
                     dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)  # fmt: skip
    ads = fill(layer, rng, gated=True, fused_w13=False)
    x, logits = inputs(rng)
    y = forward(layer, x.astype(jnp.bfloat16), logits, IDX)
    ref = oracle(x, logits, w, ads, IDX, gated=True, layout="concat")
    err = np.abs(np.asarray(y, np.float32) - ref).max() / np.abs(ref).max()
    assert err < 3e-2, err


def test_slot_write_isolated():
    """Writing slot 2 leaves the outputs of tokens on other slots unchanged."""
    rng = np.random.default_rng(6)
    layer, _ = build(rng, fused_w13=True)
    fill(layer, rng, gated=True, fused_w13=True)
    x, logits = inputs(rng)
    before = np.asarray(forward(layer, x, logits, IDX))
    ad = make_adapter(rng, gated=True, fused_w13=True, rank=8)
    layer.set_lora(2, *to_set_lora(ad, layer))
    after = np.asarray(forward(layer, x, logits, IDX))
    other = IDX != 2
    np.testing.assert_array_equal(after[other], before[other])
    assert not np.allclose(after[~other], before[~other])


# -- errors -----------------------------------------------------------------------------------
def _snapshot(layer):
    stacks = (*layer.w13_lora_a, *layer.w13_lora_b, layer.w2_lora_a, layer.w2_lora_b)
    return [np.asarray(v[...]) for v in (*stacks, layer.slot_ranks)]


@pytest.mark.parametrize(
    "fused_w13,mutate,match",
    [
        (False, lambda a, b: (a, b[:2]), "lists over"),  # wrong slice count
        (True, lambda a, b: (a + [a[0]], b + [b[0]]), "lists over"),  # 3 slices to 3D
        (False, lambda a, b: ([x[:4] for x in a], [x[:4] for x in b]), "num_experts=8"),
        (False, lambda a, b: ([np.zeros((E, 16, H)), *a[1:]], b), "rank 16"),
        (False, lambda a, b: (a, [b[0][:, :, :4], *b[1:]]), "lora_b must be"),
        (True, lambda a, b: (a, [b[0][:, :INTER], b[1]]), "w13 lora_b must be"),
        (False, lambda a, b: ([None, *a[1:]], b), "only one of"),
    ],
)
def test_set_lora_errors_change_nothing(fused_w13, mutate, match):
    rng = np.random.default_rng(7)
    layer, _ = build(rng, fused_w13=fused_w13)
    fill(layer, rng, gated=True, fused_w13=fused_w13)
    snap = _snapshot(layer)
    ad = make_adapter(rng, gated=True, fused_w13=fused_w13, rank=8)
    a, b = mutate(*to_set_lora(ad, layer))
    with pytest.raises(ValueError, match=re.escape(layer.name) + ".*" + re.escape(match)):
        layer.set_lora(3, a, b)
    for old, new in zip(snap, _snapshot(layer)):
        np.testing.assert_array_equal(old, new)


def test_index_errors():
    rng = np.random.default_rng(8)
    layer, _ = build(rng)
    a, b = to_set_lora(make_adapter(rng, gated=True, fused_w13=False, rank=8), layer)
    layer.set_lora(0, a, b)
    ranks = np.asarray(layer.slot_ranks[...]).copy()
    for bad in (-1, L, 1.0, True, np.bool_(False), jnp.int32(1)):
        with pytest.raises(ValueError, match="FusedMoEWithLoRA.set_lora: index"):
            layer.set_lora(bad, a, b)
        with pytest.raises(ValueError, match="FusedMoEWithLoRA.reset_lora: index"):
            layer.reset_lora(bad)
    # a bool wrote slot 1's stacks and, as a numpy mask, every slot's recorded rank
    np.testing.assert_array_equal(np.asarray(layer.slot_ranks[...]), ranks)


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_random_init_is_the_same_model_at_every_tp(layout):
    """The same seed gives the same experts on one device and over tp = 2 x ep = 2 (the
    stored w13 is packed per shard, the draw is logical), as the dense linears do."""
    rng = np.random.default_rng(0)
    x, logits = inputs(rng)
    outs = []
    for mesh in (None, make_mesh(1, 2, 2)):
        base = FusedMoE(E, K, H, INTER, gate_up_layout=layout, rules=ShardingRules(mesh),
                        rngs=nnx.Rngs(3))  # fmt: skip
        outs.append(np.asarray(nnx.jit(lambda m, x, lg: m(x, lg))(base, x, logits)))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_wrap_picks_the_moe_class_for_the_packed_list():
    """`wrap_model` wraps experts named as one fused w13 with the 3D class and experts
    named as separate w1 / w3 with `FusedMoEWithLoRA` (vLLM registers both)."""
    from lora_jax.serving.wrap import _pick_class

    base = FusedMoE(E, K, H, INTER, rngs=nnx.Rngs(0))
    cfg = LoRAConfig(max_loras=L, max_lora_rank=R)
    assert _pick_class(base, cfg, ["experts"]) is FusedMoE3DWithLoRA
    assert _pick_class(base, cfg, ["w1", "w3"]) is FusedMoEWithLoRA


def test_base_config_errors():
    rules = ShardingRules(make_mesh(tp=1, ep=8 // 2 * 2))
    with pytest.raises(ValueError, match="num_experts=6 not divisible by the expert axis"):
        FusedMoE(6, 2, H, INTER, rules=rules, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="gate_up_layout"):
        FusedMoE(E, 2, H, INTER, gate_up_layout="zigzag", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="w13 must be"):
        FusedMoE(E, 2, H, INTER, rngs=nnx.Rngs(0)).load_weights(w13=np.zeros((E, H, INTER)))


# -- meshes -----------------------------------------------------------------------------------
MESHES = [
    # dp, tp, ep, gated, layout, fused_w13, fully_sharded, impl
    pytest.param(1, 2, 1, True, "concat", False, False, "grouped", marks=pytest.mark.slow),
    pytest.param(1, 1, 2, True, "interleaved", True, False, "grouped", marks=pytest.mark.slow),
    (1, 2, 4, True, "interleaved", False, False, "grouped"),
    (1, 8, 1, True, "concat", True, False, "grouped"),
    (1, 1, 8, False, "concat", False, False, "grouped"),
    pytest.param(1, 4, 2, True, "concat", False, True, "grouped", marks=pytest.mark.slow),
    (2, 2, 2, True, "interleaved", True, True, "grouped"),
    pytest.param(1, 4, 1, True, "interleaved", True, True, "dense", marks=pytest.mark.slow),
    pytest.param(2, 1, 4, True, "concat", False, False, "dense", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dp,tp,ep,gated,layout,fused_w13,fully_sharded,impl", MESHES)
def test_sharded_matches_oracle(dp, tp, ep, gated, layout, fused_w13, fully_sharded, impl):
    rng = np.random.default_rng(9)
    mesh = make_mesh(dp, tp, ep, explicit=(tp + ep) % 2 == 0)
    layer, w = build(rng, gated=gated, layout=layout, fused_w13=fused_w13, impl=impl, mesh=mesh,
                     fully_sharded=fully_sharded)  # fmt: skip
    ads = fill(layer, rng, gated=gated, fused_w13=fused_w13)
    x, logits = inputs(rng)
    y = forward(layer, x, logits, IDX)
    ref = oracle(x, logits, w, ads, IDX, gated=gated, layout=layout)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)


def _collectives(layer, x, logits):
    hlo = forward(layer, x, logits, IDX, lower=True).compile().as_text()
    found = []
    for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        for m in re.finditer(r"= (\w+)\[([\d,]*)\][^=]*? " + op + r"(-start)?\(", hlo):
            found.append((op, tuple(int(d) for d in m.group(2).split(",") if d)))
    return found


def test_hlo_one_reduction_for_tp_and_ep():
    """Plain LoRA: one (T, hidden) all-reduce over tp x ep, no LoRA collective."""
    rng = np.random.default_rng(10)
    layer, _ = build(rng, mesh=make_mesh(1, 2, 4))
    fill(layer, rng, gated=True, fused_w13=False)
    found = _collectives(layer, *inputs(rng))
    assert found == [("all-reduce", (T, H))], found


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
def test_hlo_dp_shards_route_their_own_tokens(explicit):
    """dp 2 x ep 4: each dp shard picks the experts of its own tokens (the router logits
    are not gathered over dp); the one all-reduce holds a dp shard's (T / 2, hidden)."""
    rng = np.random.default_rng(12)
    mesh = make_mesh(2, 1, 4, explicit=explicit)
    layer, _ = build(rng, mesh=mesh)
    fill(layer, rng, gated=True, fused_w13=False)
    x, logits = inputs(rng)
    rules = layer.base_layer.rules
    x, logits = (
        rules.place(jnp.asarray(x), "batch", None),
        rules.place(jnp.asarray(logits), "batch", None),
    )
    found = _collectives(layer, x, logits)
    assert found == [("all-reduce", (T // 2, H))], found


def test_hlo_fully_sharded_rank_sized_collectives():
    """S-LoRA: besides the output all-reduce, only (T*k, rank)-sized LoRA collectives."""
    rng = np.random.default_rng(11)
    layer, _ = build(rng, mesh=make_mesh(1, 4, 2), fully_sharded=True)
    fill(layer, rng, gated=True, fused_w13=False)
    found = _collectives(layer, *inputs(rng))
    # w13: all-gather of the rank-split shrink [2 slices, T*k, R]; w2: all-reduce of the
    # partial [1, T*k, R] shrink; then the one (T, hidden) output all-reduce.
    assert sorted(found) == [
        ("all-gather", (2, T * K, R)),
        ("all-reduce", (1, T * K, R)),
        ("all-reduce", (T, H)),
    ], found


def test_auto_impl_is_grouped_off_gpu_and_explicit_impls_are_kept():
    from lora_jax.moe import FusedMoE

    moe = FusedMoE(4, 2, 16, 8, rngs=nnx.Rngs(0))
    assert moe.impl == "auto"
    if jax.default_backend() != "gpu":
        assert moe.resolve_impl(1 << 16) == "grouped"
    assert FusedMoE(4, 2, 16, 8, impl="dense", rngs=nnx.Rngs(0)).resolve_impl(1) == "dense"
    with pytest.raises(ValueError, match="impl"):
        FusedMoE(4, 2, 16, 8, impl="fast", rngs=nnx.Rngs(0))


# -- merge_adapter ----------------------------------------------------------------------------
class _Holder(nnx.Module):
    """`merge_adapter` takes a model: the layer as its only child."""

    def __init__(self, layer):
        self.experts = layer


MERGE_CASES = [
    # dp, tp, ep, gated, layout, fused_w13, fully_sharded
    (1, 1, 1, True, "concat", False, False),
    (1, 1, 1, True, "interleaved", False, False),
    (1, 1, 1, True, "interleaved", True, False),
    (1, 1, 1, False, "concat", False, False),
    (1, 2, 2, True, "concat", False, False),
    (1, 2, 2, True, "interleaved", False, True),
    (2, 2, 2, True, "concat", True, True),
    (1, 4, 1, False, "concat", True, True),
    (1, 2, 1, True, "interleaved", True, False),
]


@pytest.mark.parametrize("dp,tp,ep,gated,layout,fused_w13,fully_sharded", MERGE_CASES)
def test_merge_matches_oracle_and_unmerge_restores(dp, tp, ep, gated, layout, fused_w13,
                                                   fully_sharded):  # fmt: skip
    """Merged experts (no LoRA rows) give the oracle's output with every token on the
    slot; the weights keep their sharding, and unmerge puts them back bit for bit."""
    from lora_jax.serving.merge import merge_adapter, merged_slot, unmerge_adapter

    rng = np.random.default_rng(13)
    mesh = make_mesh(dp, tp, ep, explicit=tp % 2 == 0) if dp * tp * ep > 1 else None
    layer, w = build(rng, gated=gated, layout=layout, fused_w13=fused_w13, mesh=mesh,
                     fully_sharded=fully_sharded)  # fmt: skip
    ads = fill(layer, rng, gated=gated, fused_w13=fused_w13, ranks=(8, 4, 8))
    x, logits = inputs(rng)
    base = layer.base_layer
    before = [base.w13[...], base.w2[...]]
    none = np.full((T,), -1, np.int32)
    slot = 1  # rank 4 < max rank 8
    holder = _Holder(layer)
    assert merge_adapter(holder, slot) == 1 and merged_slot(holder) == slot
    y = forward(layer, x, logits, none)  # base math only, on the merged weights
    ref = oracle(x, logits, w, ads, np.full((T,), slot), gated=gated, layout=layout)
    assert np.abs(ref - oracle(x, logits, w, ads, none, gated=gated, layout=layout)).max() > 1e-2
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)
    for old, var in zip(before, (base.w13, base.w2)):
        assert var[...].sharding.is_equivalent_to(old.sharding, old.ndim)
    assert unmerge_adapter(holder) is True
    np.testing.assert_array_equal(np.asarray(base.w13[...]), np.asarray(before[0]))
    np.testing.assert_array_equal(np.asarray(base.w2[...]), np.asarray(before[1]))


def test_experts_over_the_data_parallel_axis_keep_every_token():
    """Custom rules that put the experts on the "dp" mesh axis (expert parallelism over
    the data-parallel devices): tokens are not split over that axis too (each shard's
    experts need every token), so the LoRA layer still matches the oracle; experts and
    the intermediate dim on one axis are refused."""
    from lora_jax.sharding import DEFAULT_RULES

    rng = np.random.default_rng(21)
    mesh = jax.make_mesh((4, 2), ("dp", "tp"))
    rules = ShardingRules(mesh, rules={**DEFAULT_RULES, "expert": "dp"})
    w = make_weights(rng, True)
    base = FusedMoE(E, K, H, INTER, rules=rules, impl="grouped", rngs=nnx.Rngs(0))
    base.load_weights(w13=np.concatenate([w["w1"], w["w3"]], -1), w2=w["w2"])
    layer = FusedMoEWithLoRA(base, LoRAConfig(max_loras=L, max_lora_rank=R))
    layer.lora_context.set_value(make_lora_mapping(jnp.full((T,), -1, jnp.int32), L))
    ads = fill(layer, rng, gated=True, fused_w13=False)
    x, logits = inputs(rng)
    y = forward(layer, x, logits, IDX)  # T = 12 tokens would split 4 ways over "dp"
    ref = oracle(x, logits, w, ads, IDX, gated=True, layout="concat")
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="'expert' and 'tensor' both map to mesh axis 'tp'"):
        FusedMoE(E, K, H, INTER, rules=ShardingRules(mesh, rules={**DEFAULT_RULES, "expert": "tp"}),
                 rngs=nnx.Rngs(0))  # fmt: skip


def test_batch_and_tensor_on_one_mesh_axis_keep_tokens_whole():
    """Tokens split over the axis that also splits the intermediate dim were summed with
    other tokens' partial outputs (1.7 off); they stay whole there now."""
    from lora_jax.sharding import DEFAULT_RULES

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
    want = FusedMoE(8, 2, 32, 24, rules=ShardingRules(), rngs=nnx.Rngs(0))(x, logits)
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    rules = ShardingRules(mesh, {**DEFAULT_RULES, "batch": "x", "tensor": "x", "expert": None})
    got = FusedMoE(8, 2, 32, 24, rules=rules, rngs=nnx.Rngs(0))(x, logits)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
