"""Slot semantics of DESIGN §3: validation, isolation, no recompiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from layer_cases import KIND_BY_NAME, KINDS, MAX_LORAS, MAX_RANK, build, make_mesh, random_adapter

import lora_jax as lj


def _snapshot(layer):
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(layer, nnx.LoRAParam))] + [
        np.asarray(layer.slot_ranks[...])
    ]


def _assert_unchanged(layer, before):
    for a, b in zip(_snapshot(layer), before):
        np.testing.assert_array_equal(a, b)


def _bad_inputs(layer):
    ad = random_adapter(layer, 8, seed=1)
    n_in = layer.base_layer.in_features
    big = random_adapter(layer, MAX_RANK * 2, seed=2)
    cases = {
        "rank": (0, big.a, big.b, "max_lora_rank"),
        "index_high": (MAX_LORAS, ad.a, ad.b, "outside"),
        "index_negative": (-1, ad.a, ad.b, "outside"),
        "in_size": (0, [np.zeros((8, n_in + 1))] * layer.n_slices, ad.b, "lora_a must be"),
        "out_size": (0, ad.a, [np.zeros((b.shape[0] + 2, 8)) for b in ad.b], "lora_b must be"),
    }
    inf_a = [np.array(a, np.float64) for a in ad.a]
    inf_a[-1][0, 0] = np.inf
    nan_b = [np.array(b, np.float64) for b in ad.b]
    nan_b[0][1, 1] = np.nan
    huge_b = [np.array(b, np.float64) for b in ad.b]
    huge_b[0][0, 0] = 1e39  # finite in float64, inf once the stacks hold it (f32)
    cases["inf_a"] = (0, inf_a, ad.b, r"lora_a \(slice \d\) holds values that are not finite")
    cases["nan_b"] = (0, ad.a, nan_b, r"lora_b \(slice 0\) holds values that are not finite")
    cases["huge_b"] = (0, ad.a, huge_b, "not finite in float32")
    if layer.n_slices > 1:
        cases["slice_count"] = (0, ad.a[:-1], ad.b[:-1], "slice")
    else:
        cases["slice_count"] = (0, ad.a * 2, ad.b * 2, "slice")
    return cases


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_bad_set_lora_raises_naming_the_layer_and_changes_nothing(kind):
    layer, *_ = build(kind, lj.ShardingRules(make_mesh(1, 2)), adapters={0: 16, 1: 4})
    before = _snapshot(layer)
    for what, (index, a, b, msg) in _bad_inputs(layer).items():
        with pytest.raises(ValueError, match=msg) as info:
            layer.set_lora(index, a, b)
        assert type(layer).__name__ in str(info.value), what
        _assert_unchanged(layer, before)


def test_non_finite_adapters_are_refused_on_every_layer_kind():
    """Vocab embedding, lm_head and MoE experts refuse inf / NaN too, and a value past
    float16's range when the stacks are float16; nothing is written."""
    from lora_jax.layers.moe import FusedMoEWithLoRA

    cfg16 = lj.LoRAConfig(max_loras=2, max_lora_rank=8, lora_dtype="float16")
    emb = lj.VocabParallelEmbeddingWithLoRA(
        lj.layers.embedding.VocabParallelEmbedding(50, 16, rngs=nnx.Rngs(0)), cfg16
    )
    head = lj.ParallelLMHeadWithLoRA(lj.vocab.ParallelLMHead(50, 16, rngs=nnx.Rngs(0)), cfg16)
    moe = FusedMoEWithLoRA(lj.FusedMoE(4, 2, 16, 8, rngs=nnx.Rngs(0)), cfg16)
    a_e, b_e = np.ones((4, 50)), np.ones((16, 4))
    a_h, b_h = np.ones((4, 16)), np.ones((50, 4))
    moe_a = [np.ones((4, 4, 16)), np.ones((4, 4, 8)), np.ones((4, 4, 16))]
    moe_b = [np.ones((4, 8, 4)), np.ones((4, 16, 4)), np.ones((4, 8, 4))]
    for layer, a, b in ((emb, a_e, b_e), (head, a_h, b_h), (moe, moe_a, moe_b)):
        before = [np.asarray(v) for v in jax.tree.leaves(nnx.state(layer, nnx.LoRAParam))]
        bad_b = [x.copy() for x in b] if isinstance(b, list) else b.copy()
        (bad_b[0] if isinstance(b, list) else bad_b)[..., 0] = 7e4  # past float16's 65504
        with pytest.raises(ValueError, match="not finite in float16"):
            layer.set_lora(1, a, bad_b)
        after = [np.asarray(v) for v in jax.tree.leaves(nnx.state(layer, nnx.LoRAParam))]
        for x, y in zip(before, after):
            np.testing.assert_array_equal(x, y)
        layer.set_lora(1, a, b)  # the same adapter within range is fine


def test_rank_is_zero_padded_and_recorded():
    layer, *_ = build(KIND_BY_NAME["merged"], lj.ShardingRules())
    ad = random_adapter(layer, 4, seed=0)
    layer.set_lora(2, ad.a, ad.b)
    a0 = np.asarray(layer.lora_a[0][...])  # [L, R, in]
    np.testing.assert_allclose(a0[2, :4], ad.a[0])
    assert not a0[2, 4:].any()
    assert np.asarray(layer.slot_ranks[...])[:, 2].tolist() == [4, 4]


def test_variable_slice_accepts_single_tensor_checkpoint():
    layer, *_ = build(KIND_BY_NAME["variable_slice"], lj.ShardingRules())
    rng = np.random.default_rng(0)
    a = rng.normal(size=(8, layer.base_layer.in_features))
    b = rng.normal(size=(sum(layer.logical_slice_sizes), 8))
    layer.set_lora(1, a, b)
    cuts = np.cumsum(layer.logical_slice_sizes)[:-1]
    for s, part in enumerate(np.split(b, cuts)):
        np.testing.assert_allclose(np.asarray(layer.lora_a[s][...])[1, :8], a, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(layer.lora_b[s][...])[1, :, :8], part, rtol=1e-6)


def test_missing_packed_slice_is_zero():
    layer, *_ = build(KIND_BY_NAME["merged"], lj.ShardingRules())
    ad = random_adapter(layer, 8, seed=0)
    layer.set_lora(0, [None, ad.a[1]], [None, ad.b[1]])
    assert not np.asarray(layer.lora_b[0][...])[0].any()
    assert np.asarray(layer.slot_ranks[...])[:, 0].tolist() == [0, 8]


def test_new_mapping_or_new_weights_never_recompile():
    layer, *_ = build(KIND_BY_NAME["qkv"], lj.ShardingRules(make_mesh(1, 2)), adapters={0: 8})
    graphdef, state = nnx.split(layer)
    traces = []

    @jax.jit
    def step(state, x, idx):
        traces.append(1)
        model = nnx.merge(graphdef, state)
        lj.set_lora_mapping(model, idx)
        return model(x)

    x = jnp.ones((8, layer.base_layer.in_features))
    step(state, x, jnp.zeros(8, jnp.int32))
    step(state, x, jnp.array([3, -1, 1, 1, 0, 2, -1, 3], jnp.int32))
    ad = random_adapter(layer, 16, seed=5)
    layer.set_lora(3, ad.a, ad.b)
    layer.reset_lora(0)
    _, state = nnx.split(layer)
    step(state, x, jnp.full((8,), -1, jnp.int32))
    assert len(traces) == 1


def test_config_checks():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        lj.LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        lj.LoRAConfig(max_lora_rank=7)
    with pytest.raises(ValueError, match="max_loras"):
        lj.LoRAConfig(max_loras=0)
    for bad in (jnp.int32, jnp.float8_e4m3fn, np.float64):  # fp8 / f64: kernels take neither
        with pytest.raises(ValueError, match="lora_dtype must be one of bfloat16"):
            lj.LoRAConfig(lora_dtype=bad)
    assert lj.LoRAConfig(max_loras=3).max_cpu_loras == 3
    # vLLM's defaults and numpy ints are taken; floats and bools are not ints here
    assert lj.LoRAConfig(lora_dtype="auto").lora_dtype is None
    cfg = lj.LoRAConfig(max_loras=np.int64(2), max_lora_rank=np.int64(8), max_cpu_loras=np.int32(4))
    assert (cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (2, 8, 4)
    assert all(type(v) is int for v in (cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras))
    for kw in ({"max_lora_rank": 8.0}, {"max_lora_rank": True}, {"max_cpu_loras": 2.5},
               {"max_cpu_loras": "4"}, {"max_loras": 2.0}):  # fmt: skip
        with pytest.raises(ValueError, match=f"LoRAConfig.{next(iter(kw))} must be an int"):
            lj.LoRAConfig(**kw)
    assert lj.LoRAConfig(max_lora_trainable_tokens=np.int64(3)).max_lora_trainable_tokens == 3
    for bad in (-1, True, 2.0, "4"):
        with pytest.raises(ValueError, match="max_lora_trainable_tokens must be an int >= 0"):
            lj.LoRAConfig(max_lora_trainable_tokens=bad)
    with pytest.raises(ValueError, match="lora_dtype='fp33' is not a dtype"):
        lj.LoRAConfig(lora_dtype="fp33")


def test_fully_sharded_rank_must_divide_tp():
    rules = lj.ShardingRules(make_mesh(1, 8))
    base = lj.ColumnParallelLinear(16, 16, rules=rules, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="divisible"):
        lj.ColumnParallelLinearWithShardedLoRA(base, lj.LoRAConfig(max_lora_rank=1))


@pytest.mark.parametrize("skip", [False, True])
def test_skip_bias_add_and_return_bias(skip):
    rules = lj.ShardingRules(make_mesh(1, 2))
    base = lj.ColumnParallelLinear(
        16, 8, use_bias=True, skip_bias_add=skip, return_bias=True, rules=rules, rngs=nnx.Rngs(0)
    )
    base.load_kernel([np.eye(16, 8, dtype=np.float32)], [np.arange(8, dtype=np.float32)])
    layer = lj.ColumnParallelLinearWithLoRA(base, lj.LoRAConfig(max_loras=2, max_lora_rank=8))
    layer.set_lora(0, np.ones((8, 16)), np.ones((8, 8)))
    x = jnp.ones((4, 16))
    y, bias = jax.jit(lambda m, x: (lj.set_lora_mapping(m, jnp.zeros(4, jnp.int32)), m(x))[1])(
        layer, x
    )
    lora = 16.0 * 8.0  # x @ A.T = 16 per rank row, times 8 ranks of B=1
    expected = 1.0 + lora + (0 if skip else np.arange(8))
    np.testing.assert_allclose(np.asarray(y), np.broadcast_to(expected, (4, 8)), rtol=1e-6)
    if skip:
        np.testing.assert_allclose(np.asarray(bias), np.arange(8))
    else:
        assert bias is None


def test_lora_wrapper_keeps_a_subclassed_base_matmul():
    """vLLM checks that the wrapper calls the base layer's own forward (DeepSeek's
    fused_qkv_a_proj); here a subclass overriding `local_matmul` must be honoured."""

    class PlusOne(lj.ReplicatedLinear):
        def local_matmul(self, x, kernel):
            return super().local_matmul(x, kernel) + 1.0

    base = PlusOne(16, 8, rngs=nnx.Rngs(0))
    layer = lj.ReplicatedLinearWithLoRA(base, lj.LoRAConfig(max_loras=1, max_lora_rank=8))
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(8, 16)), rng.normal(size=(8, 8))
    layer.set_lora(0, a, b)
    x = jnp.asarray(rng.normal(size=(3, 16)), jnp.float32)
    lj.set_lora_mapping(layer, jnp.zeros(3, jnp.int32))
    y = np.asarray(layer(x))
    w = np.asarray(base.kernel[...])
    merged = np.asarray(x) @ (w + (b @ a).T) + 1.0
    np.testing.assert_allclose(y, merged, rtol=1e-4, atol=1e-4)


def test_config_flags_must_be_bools():
    """`fully_sharded_loras="false"` or None (from a YAML / CLI file) matched no linear
    LoRA class, so `wrap_model` left every linear without LoRA."""
    for field in ("fully_sharded_loras", "bias_enabled"):
        for bad in (None, "false", 1):
            with pytest.raises(ValueError, match=f"LoRAConfig.{field} must be a bool"):
                lj.LoRAConfig(**{field: bad})
    cfg = lj.LoRAConfig(fully_sharded_loras=np.bool_(True))
    assert cfg.fully_sharded_loras is True


def test_a_bad_ops_backend_variable_is_named_at_import():
    import os
    import subprocess
    import sys

    env = {**os.environ, "LORA_JAX_OPS_BACKEND": "Pallas", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", "import lora_jax"], env=env, capture_output=True, text=True
    )
    assert run.returncode != 0
    assert "LORA_JAX_OPS_BACKEND='Pallas': must be one of" in run.stderr
