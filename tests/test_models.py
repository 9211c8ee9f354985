"""Decoder models: HF transformers logits as the oracle, mesh runs vs the unsharded run,
KV-cache decode vs a full forward, and the checkpoint loader's errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lora_jax.models import (
    PACKED_MODULES_MAPPING,
    DecoderConfig,
    DecoderForCausalLM,
    KVCache,
    RopeScaling,
    load_hf_model,
)
from lora_jax.models.rope import rope_inv_freq
from lora_jax.sharding import ShardingRules

TINY = dict(
    vocab_size=120,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)


def _mesh(shape):
    """A ("dp", "tp") mesh, or a skip where fewer devices are visible (one GPU; CPU runs
    have 8 simulated devices, tests/conftest.py)."""
    if jax.device_count() < shape[0] * shape[1]:
        pytest.skip(f"mesh {shape} needs more than the {jax.device_count()} visible devices")
    return jax.make_mesh(shape, ("dp", "tp"))


# -- HF oracle helpers ----------------------------------------------------------------------
def _hf_model(model_type, **overrides):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cls_cfg = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[model_type]
    kw = dict(TINY)
    kw.update(overrides)
    cfg = cls_cfg(**kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    # HF inits biases to 0 and norms to 1: randomize everything so a mis-loaded bias or
    # norm weight changes the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn_like(p) * (0.1 if "norm" in name else 0.08)
            p.copy_(1.0 + noise if "norm" in name else noise)
    return model


def _save(model, path, **kw):
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    return str(path)


def _hf_logits(model, ids, mask=None):
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(np.asarray(ids), dtype=torch.long),
            attention_mask=None if mask is None else torch.tensor(np.asarray(mask)),
        )
    return out.logits.float().numpy()


@nnx.jit
def _fwd(model, ids, pos, mask=None):
    """Jitted full forward (eager op-by-op dispatch is far slower on CPU)."""
    return model(ids, pos, attention_mask=mask)[0]


def _positions(B, S):
    return jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))


def _ids(B, S, V, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, S), 0, V, dtype=jnp.int32)


def _compare_with_hf(hf, path, *, B=3, S=10, mask=None):
    model = load_hf_model(path)
    ids = _ids(B, S, TINY["vocab_size"])
    ours = _fwd(model, ids, _positions(B, S), mask)
    ref = _hf_logits(hf, ids, mask)
    ours = np.asarray(ours)
    if mask is not None:  # pad positions are garbage in both; compare real tokens
        keep = np.asarray(mask).astype(bool)
        ours, ref = ours[keep], ref[keep]
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=2e-4)
    return model


# -- HF oracle tests ------------------------------------------------------------------------
@pytest.mark.oracle
@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {}),
        ("llama", dict(attention_bias=True, mlp_bias=True)),
        ("qwen2", {}),  # qkv bias, no o bias
        ("qwen3", dict(head_dim=24)),  # q/k norm, head_dim != D / H
        ("mistral", dict(sliding_window=4)),  # window shorter than the sequence
    ],
    ids=["llama", "llama-bias", "qwen2", "qwen3", "mistral-window"],
)
def test_logits_match_hf(tmp_path, model_type, overrides):
    hf = _hf_model(model_type, **overrides)
    model = _compare_with_hf(hf, _save(hf, tmp_path))
    c = model.config
    assert c.model_type == model_type
    assert c.qkv_bias == (model_type == "qwen2" or bool(overrides.get("attention_bias")))
    assert c.qk_norm == (model_type == "qwen3")


@pytest.mark.oracle
def test_mistral_layer_types_window_only_sliding_layers(tmp_path):
    """A *mistral* config.json with `layer_types` loads in transformers as Ministral,
    which honours them (unlike Mixtral, tests/test_moe_model.py): only the
    "sliding_attention" layers get the window."""
    path = _save(_hf_model("mistral", sliding_window=4), tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["layer_types"] = ["full_attention", "sliding_attention"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    _compare_with_hf(hf, path)


@pytest.mark.oracle
def test_right_padded_batch_matches_hf(tmp_path):
    hf = _hf_model("llama")
    mask = jnp.array([[1] * 10, [1] * 6 + [0] * 4, [1] * 3 + [0] * 7], jnp.int32)
    _compare_with_hf(hf, _save(hf, tmp_path), mask=mask)


@pytest.mark.oracle
@pytest.mark.parametrize(
    "rope",
    [
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        dict(rope_type="linear", factor=3.0),
    ],
    ids=["llama3", "linear"],
)
def test_rope_scaling_matches_hf(tmp_path, rope):
    hf = _hf_model("llama", rope_parameters=dict(rope, rope_theta=10000.0))
    model = _compare_with_hf(hf, _save(hf, tmp_path), S=24)
    assert model.config.rope_scaling.rope_type == rope["rope_type"]


@pytest.mark.oracle
def test_sharded_checkpoint_matches_hf(tmp_path):
    hf = _hf_model("qwen2")
    path = _save(hf, tmp_path, max_shard_size="40KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
    _compare_with_hf(hf, path)


@pytest.mark.oracle
def test_tied_lm_head_matches_hf(tmp_path):
    hf = _hf_model("llama", tie_word_embeddings=True)
    model = _compare_with_hf(hf, _save(hf, tmp_path))
    assert model.lm_head is None


@pytest.mark.oracle
def test_hf_model_on_mesh_matches_hf(tmp_path):
    hf = _hf_model("qwen3", head_dim=16, num_key_value_heads=1)  # kv heads replicated
    path = _save(hf, tmp_path)
    rules = ShardingRules(_mesh((2, 4)))
    model = load_hf_model(path, rules=rules)
    ids = _ids(4, 8, TINY["vocab_size"])
    ours = _fwd(model, ids, _positions(4, 8))
    np.testing.assert_allclose(np.asarray(ours), _hf_logits(hf, ids), atol=2e-4, rtol=2e-4)


# -- config ---------------------------------------------------------------------------------
def _hf_dict(**kw):
    d = dict(TINY, model_type="llama")
    d.update(kw)
    return d


def test_from_hf_reads_both_rope_layouts():
    v5 = DecoderConfig.from_hf(
        _hf_dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=5e5))
    )
    v4 = DecoderConfig.from_hf(
        _hf_dict(rope_theta=5e5, rope_scaling=dict(type="linear", factor=2.0))
    )
    assert v5 == v4
    assert v5.rope_theta == 5e5 and v5.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    plain = DecoderConfig.from_hf(
        _hf_dict(rope_parameters=dict(rope_type="default", rope_theta=7.0))
    )
    assert plain.rope_scaling is None and plain.rope_theta == 7.0
    assert plain.head_dim == 16
    hash(v5)  # lives in jit static args via the NNX graphdef


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(model_type="gpt2"), "model_type"),
        (dict(rope_parameters=dict(rope_type="yarn", factor=4.0)), "yarn"),
        (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "dynamic"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(vocab_size=None), "vocab_size"),
    ],
)
def test_from_hf_rejects_bad_configs(bad, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig.from_hf(_hf_dict(**bad))


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(vocab_size=True), "vocab_size must be an int >= 1"),  # was a 1-token vocab
        (dict(num_hidden_layers=True), "num_hidden_layers must be an int >= 1"),
        (dict(rope_theta=0.0), "rope_theta must be a finite number > 0"),
        (dict(rope_theta=-1e4), "rope_theta must be a finite number > 0"),
        (dict(rope_theta=float("inf")), "rope_theta must be a finite number > 0"),
        (dict(rope_theta=True), "rope_theta must be a finite number > 0"),
        (dict(rope_theta="1e4"), "rope_theta must be a finite number > 0"),
        (dict(rms_norm_eps=-1.0), "rms_norm_eps must be a finite number >= 0"),
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number >= 0"),
    ],
)
def test_decoder_config_refuses_bools_and_non_finite_rope_and_norm(bad, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig.tiny(**bad)


def test_decoder_config_takes_int_theta_and_zero_eps():
    cfg = DecoderConfig.tiny(rope_theta=10000, rms_norm_eps=0.0)
    assert np.isfinite(rope_inv_freq(cfg.head_dim, cfg.rope_theta)).all()


LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
# config.json rope fields: (fields, None if transformers loads them, else the ValueError
# lora_jax raises where transformers raises too)
ROPE_CONFIGS = {
    # transformers 5 writes partial_rotary_factor inside rope_parameters
    "partial-in-rope_parameters": (
        dict(rope_parameters=dict(rope_type="linear", factor=2.0, partial_rotary_factor=0.5)),
        r"rope_parameters.partial_rotary_factor=0.5 is not supported",
    ),
    "linear-without-factor": (
        dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4)),
        r"rope_parameters of rope_type 'linear' lacks required fields \['factor'\]",
    ),
    "llama3-without-factor": (
        dict(rope_parameters={k: v for k, v in LLAMA3.items() if k != "factor"}),
        r"rope_type 'llama3' lacks required fields \['factor'\]",
    ),
    "legacy-llama3-without-low_freq_factor": (
        dict(rope_scaling={k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}),
        r"rope_scaling of rope_type 'llama3' lacks required fields \['low_freq_factor'\]",
    ),
    # both layouts: the legacy rope_scaling wins whole, rope_parameters' theta included
    "legacy-llama3-over-linear": (
        dict(
            rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=5e5),
            rope_scaling=LLAMA3,
        ),
        None,
    ),
    "legacy-linear-over-default": (
        dict(
            rope_theta=2e4,
            rope_parameters=dict(rope_type="default", rope_theta=5e5),
            rope_scaling=dict(type="linear", factor=4.0),
        ),
        None,
    ),
    # llama3 without original_max_position_embeddings and no max_position_embeddings:
    # transformers takes LlamaConfig's default (2048) for both (a TypeError here before)
    "llama3-without-any-max-positions": (
        dict(
            rope_scaling={
                k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"
            },
            max_position_embeddings=None,
        ),
        None,
    ),
    "legacy-default-over-linear": (
        dict(
            rope_parameters=dict(rope_type="linear", factor=2.0), rope_scaling=dict(type="default")
        ),
        None,
    ),
}


@pytest.mark.oracle
@pytest.mark.parametrize("name", list(ROPE_CONFIGS))
def test_rope_fields_read_as_transformers_reads_them(tmp_path, name):
    """Inverse frequencies of the model transformers builds from the same config.json, or
    a ValueError naming the field where transformers fails (lora_jax read a missing
    factor as 1.0, ignored an inner partial_rotary_factor and preferred rope_parameters
    over a legacy rope_scaling)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields, error = ROPE_CONFIGS[name]
    d = {k: v for k, v in _hf_dict(**fields).items() if v is not None}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(d, f)

    def hf_inv_freq():
        cfg = transformers.AutoConfig.from_pretrained(str(tmp_path))
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
        hf(torch.tensor([[1, 2, 3]]))  # a partial rotary factor fails only here
        return hf.model.rotary_emb.inv_freq.numpy()

    if error is not None:
        with pytest.raises((KeyError, RuntimeError)):  # missing key / shape mismatch
            hf_inv_freq()
        with pytest.raises(ValueError, match=error):
            DecoderConfig.from_hf(d)
        return
    ours = DecoderConfig.from_hf(d)
    got = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    np.testing.assert_allclose(got, hf_inv_freq(), rtol=1e-6)


def test_qwen2_sliding_layers_follow_max_window_layers():
    cfg = DecoderConfig.from_hf(
        _hf_dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    )
    assert [cfg.layer_window(i) for i in range(2)] == [None, 8]
    off = DecoderConfig.from_hf(_hf_dict(model_type="qwen2", sliding_window=8))
    assert off.layer_window(1) is None


WINDOW_DEFAULTS = [
    # (model_type, fields of config.json; a field left out takes transformers' default)
    ("qwen2", dict(use_sliding_window=True, sliding_window=4)),  # max_window_layers: 28
    ("qwen2", dict(use_sliding_window=True, max_window_layers=1)),  # sliding_window: 4096
    ("qwen3", dict(use_sliding_window=True, sliding_window=4)),
    ("qwen3", dict(use_sliding_window=True, max_window_layers=1)),
    ("mistral", dict()),  # sliding_window: 4096
    ("mistral", dict(sliding_window=None)),  # none
    ("mixtral", dict()),  # none (Mixtral's default)
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4)),  # every layer
    ("qwen3_moe", dict(use_sliding_window=True, max_window_layers=1)),  # still every layer
    ("qwen3_moe", dict(sliding_window=4)),  # use_sliding_window False: none
]
MOE_FIELDS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
}


@pytest.mark.parametrize("model_type,fields", WINDOW_DEFAULTS)
def test_missing_window_fields_take_transformers_defaults(model_type, fields):
    """Each layer's attention window as transformers builds it from the same config.json
    (the fields it leaves out take the config class's defaults)."""
    transformers = pytest.importorskip("transformers")
    from lora_jax.models.moe_decoder import MoEConfig

    d = {k: v for k, v in TINY.items() if k != "model_type"}
    d |= dict(model_type=model_type, **fields)
    if model_type in MOE_FIELDS:
        d |= MOE_FIELDS[model_type]
        ours = MoEConfig.from_hf(d)[0]
    else:
        ours = DecoderConfig.from_hf(d)
    hf = transformers.AutoConfig.for_model(**d)
    types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    want = [hf.sliding_window if t == "sliding_attention" else None for t in types]
    assert [ours.layer_window(i) for i in range(ours.num_hidden_layers)] == want


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_moe_configs_missing_fields_take_transformers_defaults(model_type):
    """rope_theta and rms_norm_eps left out of config.json: the MoE type's own defaults
    (Mixtral: 1e6 and 1e-5, not the dense 1e4 / 1e-6); a missing expert count is a
    clear error."""
    transformers = pytest.importorskip("transformers")
    from lora_jax.models.moe_decoder import MoEConfig

    d = {k: v for k, v in TINY.items() if k not in ("model_type", "rope_theta", "rms_norm_eps")}
    d |= dict(model_type=model_type, **MOE_FIELDS[model_type])
    ours = MoEConfig.from_hf(d)[0]
    hf = transformers.AutoConfig.for_model(**d)
    theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta") or hf.rope_theta
    assert (ours.rope_theta, ours.rms_norm_eps) == (theta, hf.rms_norm_eps)
    key = "num_local_experts" if model_type == "mixtral" else "num_experts"
    with pytest.raises(ValueError, match=r"lacks required MoE fields \[.*num_local_experts"):
        MoEConfig.from_hf({k: v for k, v in d.items() if k != key})


# (model_type, head_dim, kv heads) of the attention transformers builds from a config.json
# without head_dim and num_key_value_heads (D=256, H=64): its config classes' defaults
# (Qwen3 head_dim 128; kv heads 32 for Qwen2/3, 8 for Mistral/Mixtral, 4 for Qwen3-MoE,
# H for Llama). Cross-checked against transformers 5.25's models by the test below
# wherever torch is installed.
SHAPE_DEFAULTS = [
    ("llama", 4, 64),
    ("mistral", 4, 8),
    ("qwen2", 4, 32),
    ("qwen3", 128, 32),
    ("mixtral", 4, 8),
    ("qwen3_moe", 4, 4),
]


def _hf_attention_shape(d):
    """(head_dim, kv heads) of the first attention of the HF model built from ``d``; None
    without torch / transformers."""
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError:
        return None
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**d))
    attn = hf.model.layers[0].self_attn
    return attn.head_dim, attn.k_proj.out_features // attn.head_dim


@pytest.mark.parametrize("model_type,head_dim,kv", SHAPE_DEFAULTS)
def test_missing_shape_fields_take_transformers_defaults(model_type, head_dim, kv):
    """head_dim / num_key_value_heads left out of config.json: the attention shapes
    transformers builds from the same file; an explicit null is derived (D // H, H)."""
    from lora_jax.models.moe_decoder import MoEConfig

    d = dict(TINY, model_type=model_type, hidden_size=256, num_attention_heads=64)
    d |= MOE_FIELDS.get(model_type, {})
    del d["num_key_value_heads"]
    read = (
        (lambda d: MoEConfig.from_hf(d)[0]) if model_type in MOE_FIELDS else DecoderConfig.from_hf
    )
    want = _hf_attention_shape(d)
    if want is not None:
        assert want == (head_dim, kv)  # the table, for runs without torch
    ours = read(d)
    assert (ours.head_dim, ours.num_key_value_heads) == (head_dim, kv)
    null = read(d | dict(head_dim=None, num_key_value_heads=None))
    heads = d["num_attention_heads"]
    assert (null.head_dim, null.num_key_value_heads) == (d["hidden_size"] // heads, heads)


def test_presets_and_packed_mapping():
    big = DecoderConfig.llama3_8b()
    assert (big.hidden_size, big.num_key_value_heads, big.vocab_size) == (4096, 8, 128256)
    assert big.rope_scaling.rope_type == "llama3"
    assert PACKED_MODULES_MAPPING["qkv_proj"] == ["q_proj", "k_proj", "v_proj"]
    assert PACKED_MODULES_MAPPING["gate_up_proj"] == ["gate_proj", "up_proj"]


def test_llama3_rope_keeps_high_and_scales_low_frequencies():
    scaling = RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=64)
    base, scaled = rope_inv_freq(16, 1e4), rope_inv_freq(16, 1e4, scaling)
    wavelen = 2 * np.pi / base
    np.testing.assert_array_equal(scaled[wavelen < 16], base[wavelen < 16])
    np.testing.assert_allclose(scaled[wavelen > 64], base[wavelen > 64] / 8.0, rtol=1e-6)


# -- model structure, cache, mesh (no torch) -------------------------------------------------
def test_module_paths_mirror_hf_names():
    cfg = DecoderConfig.tiny(qk_norm=True, model_type="qwen3")
    model = DecoderForCausalLM(cfg, rngs=nnx.Rngs(0))
    paths = {".".join(map(str, p)) for p, _ in nnx.iter_graph(model) if p}
    for name in (
        "model.embed_tokens",
        "model.layers.1.self_attn.qkv_proj",
        "model.layers.1.self_attn.o_proj",
        "model.layers.0.self_attn.q_norm",
        "model.layers.0.self_attn.k_norm",
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.norm",
        "lm_head",
    ):
        assert name in paths, name


def _random_model(cfg, rules=None, seed=0, dtype=jnp.float32):
    model = DecoderForCausalLM(cfg, rules=rules, dtype=dtype, rngs=nnx.Rngs(seed))
    # Non-trivial norm weights and biases, identical for every mesh (drawn logically).
    key = jax.random.key(seed + 1)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and path[-1] == "weight":
            key, k = jax.random.split(key)
            w = 1.0 + 0.1 * jax.random.normal(k, var.shape)
            var.set_value(jax.device_put(w, var[...].sharding))
    return model


TP_CFG = DecoderConfig.tiny(
    qkv_bias=True, sliding_window=3, layer_types=("full_attention", "sliding_attention")
)


KV1_CFG = DecoderConfig.tiny(
    num_key_value_heads=1, tie_word_embeddings=True, model_type="qwen3", qk_norm=True
)


@pytest.mark.parametrize(
    "cfg,mesh_shape",
    [(TP_CFG, (1, 2)), (TP_CFG, (2, 4)), (KV1_CFG, (1, 4)), (KV1_CFG, (2, 2))],
    ids=["gqa2-window-tp2", "gqa2-window-dp2tp4", "kv1-tied-qknorm-tp4", "kv1-tied-qknorm-dp2tp2"],
)
def test_mesh_matches_unsharded(cfg, mesh_shape):
    B, S = 4, 7
    ids, pos = _ids(B, S, cfg.vocab_size, seed=3), _positions(B, S)
    ref = _fwd(_random_model(cfg), ids, pos)
    rules = ShardingRules(_mesh(mesh_shape))
    model = _random_model(cfg, rules)
    out = _fwd(model, ids, pos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    hidden = nnx.jit(lambda m, i, p: m.model(i, p)[0])(model, ids, pos)  # [B, S, D] path
    assert hidden.shape == (B, S, cfg.hidden_size)


def _decode_by_steps(model, ids, prompt_len, cache):
    """Prefill `ids[:, :prompt_len]` then feed the rest one token at a time."""
    B, S = ids.shape
    step = nnx.jit(lambda m, i, p, c: m(i, p, c))
    pos = _positions(B, S)
    logits, cache = step(model, ids[:, :prompt_len], pos[:, :prompt_len], cache)
    outs = [logits]
    for t in range(prompt_len, S):
        logits, cache = step(model, ids[:, t : t + 1], pos[:, t : t + 1], cache)
        outs.append(logits)
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_kv_cache_decode_matches_full_forward(mesh_shape):
    cfg = TP_CFG
    rules = ShardingRules(_mesh(mesh_shape)) if mesh_shape else None
    model = _random_model(cfg, rules)
    B, S = 2, 9
    ids = _ids(B, S, cfg.vocab_size, seed=5)
    full = _fwd(model, ids, _positions(B, S))
    cache = KVCache.init(cfg, B, 16, rules=rules)
    stepped = _decode_by_steps(model, ids, 4, cache)
    np.testing.assert_allclose(np.asarray(stepped), np.asarray(full), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.bool_, "int32", jnp.complex64])
def test_kv_cache_refuses_non_floating_dtypes(dtype):
    """Keys and values stored as integers are truncated: a ValueError, not wrong tokens."""
    with pytest.raises(ValueError, match="KVCache.init: dtype must be a floating dtype"):
        KVCache.init(DecoderConfig.tiny(), 1, 8, dtype=dtype)
    assert KVCache.init(DecoderConfig.tiny(), 1, 8, dtype="bfloat16").k[0].dtype == jnp.bfloat16


def test_right_padded_prefill_then_decode_matches_unpadded():
    """A pad token written at a slot is overwritten before any query can see it."""
    cfg = TP_CFG
    model = _random_model(cfg)
    ids = _ids(1, 8, cfg.vocab_size, seed=6)
    full = _fwd(model, ids, _positions(1, 8))
    padded = jnp.concatenate([ids[:, :5], jnp.zeros((1, 3), jnp.int32)], axis=1)
    cache = KVCache.init(cfg, 1, 8)
    step = nnx.jit(lambda m, i, p, c: m(i, p, c))
    _, cache = step(model, padded, _positions(1, 8), cache)
    for t in range(5, 8):
        logits, cache = step(model, ids[:, t : t + 1], jnp.full((1, 1), t, jnp.int32), cache)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), np.asarray(full[:, t]), atol=2e-5)


def test_positions_past_the_cache_are_refused():
    """The cache write drops slots >= max_len (meant for pad tokens): a real token there
    lost its key and value silently. Whatever fits still matches a cache-free forward."""
    cfg = TP_CFG
    model = _random_model(cfg)
    ids = _ids(1, 6, cfg.vocab_size, seed=7)
    pos = _positions(1, 6)
    full = _fwd(model, ids, pos)
    step = nnx.jit(lambda m, i, p, c, mask=None: m(i, p, c, attention_mask=mask))
    # S > max_len: refused eager and jitted (S is static in both)
    with pytest.raises(ValueError, match=r"S=6 exceeds cache.max_len=4"):
        model(ids, pos, KVCache.init(cfg, 1, 4))
    with pytest.raises(ValueError, match=r"S=6 exceeds cache.max_len=4"):
        step(model, ids, pos, KVCache.init(cfg, 1, 4))
    # a full cache: decoding position 5 has no slot; position 4, the last slot, has
    _, cache4 = step(model, ids[:, :4], pos[:, :4], KVCache.init(cfg, 1, 5))
    last, cache5 = model(ids[:, 4:5], pos[:, 4:5], cache4)
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full[:, 4]), atol=2e-5)
    with pytest.raises(ValueError, match=r"position 5 does not fit cache.max_len=5"):
        model(ids[:, 5:], pos[:, 5:], cache5)
    # pad tokens may carry any position: they are never written
    mask = jnp.array([[1, 1, 1, 0, 0, 0]], jnp.int32)
    pad_pos = jnp.array([[0, 1, 2, 9, 10, 11]], jnp.int32)
    logits, _ = model(ids, pad_pos, KVCache.init(cfg, 1, 6), attention_mask=mask)
    np.testing.assert_allclose(np.asarray(logits[:, :3]), np.asarray(full[:, :3]), atol=2e-5)


def test_bf16_model_close_to_f32():
    cfg = DecoderConfig.tiny()
    ids, pos = _ids(2, 6, cfg.vocab_size), _positions(2, 6)
    ref = _fwd(_random_model(cfg), ids, pos)
    out = _fwd(_random_model(cfg, dtype=jnp.bfloat16), ids, pos)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=0.1)


# -- loader without torch: a numpy-written HF-layout checkpoint -----------------------------
def _export_hf(model, path):
    """Writes `model` (unsharded) as an HF-named safetensors checkpoint (test helper)."""
    from safetensors.numpy import save_file

    c = model.config
    hd = c.head_dim
    sizes = [c.num_attention_heads * hd, c.num_key_value_heads * hd, c.num_key_value_heads * hd]
    t = {"model.embed_tokens.weight": model.model.embed_tokens.embedding[...][: c.vocab_size]}
    t["model.norm.weight"] = model.model.norm.weight[...]
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = layer.input_layernorm.weight[...]
        t[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight[...]
        qkv = layer.self_attn.qkv_proj
        cuts = np.cumsum(sizes)[:-1]
        for s, w in zip("qkv", np.split(np.asarray(qkv.kernel[...]), cuts, axis=1)):
            t[f"{p}self_attn.{s}_proj.weight"] = w.T
        if qkv.bias is not None:
            for s, b in zip("qkv", np.split(np.asarray(qkv.bias[...]), cuts)):
                t[f"{p}self_attn.{s}_proj.bias"] = b
        t[p + "self_attn.o_proj.weight"] = layer.self_attn.o_proj.kernel[...].T
        gate, up = np.split(np.asarray(layer.mlp.gate_up_proj.kernel[...]), 2, axis=1)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = gate.T, up.T
        t[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.kernel[...].T
    if model.lm_head is not None:
        t["lm_head.weight"] = model.lm_head.embedding[...][: c.vocab_size]
    t = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in t.items()}
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "model.safetensors"))
    hf_cfg = dict(
        model_type=c.model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=hd, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings,
    )  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f)
    return t


@pytest.fixture
def exported(tmp_path):
    cfg = DecoderConfig.tiny(model_type="qwen2", qkv_bias=True)
    model = _random_model(cfg)
    tensors = _export_hf(model, tmp_path)
    return model, tensors, str(tmp_path)


def test_loader_roundtrip_on_mesh(exported):
    model, _, path = exported
    ids, pos = _ids(2, 5, model.config.vocab_size), _positions(2, 5)
    ref = _fwd(model, ids, pos)
    rules = ShardingRules(_mesh((1, 4)))
    loaded = load_hf_model(path, rules=rules)
    out = _fwd(loaded, ids, pos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def _rewrite(path, tensors):
    from safetensors.numpy import save_file

    save_file(tensors, os.path.join(path, "model.safetensors"))


def test_loader_names_missing_tensor(exported):
    _, tensors, path = exported
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*missing"):
        load_hf_model(path)


def test_loader_names_mismatched_tensor(exported):
    _, tensors, path = exported
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((7, 64), np.float32)
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match=r"model\.safetensors.*up_proj\.weight.*\(7, 64\)"):
        load_hf_model(path)


def test_loader_rejects_unused_tensor_and_missing_files(exported, tmp_path_factory):
    _, tensors, path = exported
    tensors["model.layers.0.self_attn.extra.weight"] = np.zeros((2,), np.float32)
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match="extra.weight"):
        load_hf_model(path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="safetensors"):
        load_hf_model(path)
    with pytest.raises(ValueError, match="config.json"):
        load_hf_model(str(tmp_path_factory.mktemp("empty")))


def test_checkpoint_reader_returns_bfloat16_tensors(tmp_path):
    """HF checkpoints are mostly bf16, which safetensors' numpy reader cannot return."""
    from safetensors.flax import save_file

    from lora_jax.models import SafetensorsCheckpoint

    w = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3) / 4
    save_file({"model.norm.weight": w}, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    got = ckpt.get("model.norm.weight", (2, 3))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(w, np.float32))
    with pytest.raises(ValueError, match="shape"):
        ckpt.get("model.norm.weight", (3, 2))


def test_checkpoint_index_must_name_shards_in_the_directory_and_wide_dtypes_stay_exact(tmp_path):
    """A sharded checkpoint's index names file names inside the directory (no `..`, no
    absolute path, strings only) and is an object; 64-bit tensors are read exactly even
    with jax's x64 off (the flax reader would narrow them)."""
    import json

    from lora_jax.models.loading import SafetensorsCheckpoint
    from lora_jax.serving.peft import write_safetensors

    write_safetensors(
        tmp_path / "model.safetensors",
        {"w": np.array([2**31 + 5, -3], np.int64), "f": np.array([1e300, 1.5])},
    )
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    np.testing.assert_array_equal(ckpt.get("w", (2,)), [2**31 + 5, -3])
    np.testing.assert_array_equal(ckpt.get("f", (2,)), [1e300, 1.5])
    index = tmp_path / "model.safetensors.index.json"
    for bad in (
        {"weight_map": {"w": "../model.safetensors"}},
        {"weight_map": {"w": str(tmp_path / "model.safetensors")}},
        {"weight_map": {"w": ["model.safetensors"]}},
        {"weight_map": {"w": 3}},
        ["weight_map"],
        None,
    ):
        index.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="index.json"):
            SafetensorsCheckpoint(str(tmp_path))


def test_a_bf16_decoder_generates_batches_on_the_cpu():
    """XLA's CPU runtime has no bf16 x bf16 -> f32 dot for attention's output layout at
    batch > 1 ("Unsupported element type for DotThunk", and every later call in the
    process failed); the CPU path takes the dot in its own layout. Greedy tokens of a
    batch equal each request's alone."""
    from lora_jax.serving.generate import generate

    cfg = DecoderConfig.tiny()
    model = DecoderForCausalLM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    prompts = [[1, 2, 3], [4, 5]]
    both = generate(model, prompts, [-1, -1], max_new_tokens=4).tokens
    for i, p in enumerate(prompts):
        alone = generate(model, [p], [-1], max_new_tokens=4).tokens
        assert list(both[i]) == list(alone[0])


def test_a_checkpoint_file_named_relative_to_the_working_directory(exported, monkeypatch):
    """`config.json` (or a weights file) named from inside the checkpoint: its directory is
    the working directory (os.path.dirname gave "", which named no checkpoint)."""
    from lora_jax.models.loading import read_config_json

    model, _, path = exported
    monkeypatch.chdir(path)
    for name in ("config.json", "model.safetensors"):
        directory, config = read_config_json(name)
        assert os.path.samefile(directory, path)
        with open(os.path.join(path, "config.json")) as f:
            assert config == json.load(f)
    ids, pos = _ids(1, 4, model.config.vocab_size), _positions(1, 4)
    np.testing.assert_allclose(
        np.asarray(_fwd(load_hf_model("config.json"), ids, pos)),
        np.asarray(_fwd(model, ids, pos)),
        atol=2e-5,
        rtol=2e-5,
    )


def test_checkpoint_index_reads_each_shard_s_names_once(tmp_path, monkeypatch):
    """The index check took a shard's name list per tensor (quadratic: 5 s for an
    18,912-tensor index); each shard's names are read once, and a tensor its shard lacks
    is still named."""
    import collections

    import safetensors
    from safetensors.numpy import save_file

    from lora_jax.models.loading import SafetensorsCheckpoint

    tensors, weight_map = {}, {}
    for s in range(3):
        fname = f"model-{s + 1:05d}-of-00003.safetensors"
        shard = {f"t.{s}.{i}": np.full((2,), s * 100 + i, np.float32) for i in range(40)}
        save_file(shard, str(tmp_path / fname))
        tensors.update(shard)
        weight_map.update(dict.fromkeys(shard, fname))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    calls = collections.Counter()
    real = safetensors.safe_open

    class Counted:  # safe_open's handle, counting keys()
        def __init__(self, path, **kw):
            self._path, self._handle = path, real(path, **kw)

        def keys(self):
            calls[os.path.basename(self._path)] += 1
            return self._handle.keys()

        def __getattr__(self, name):
            return getattr(self._handle, name)

    monkeypatch.setattr(safetensors, "safe_open", Counted)
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    assert sorted(calls) == sorted(set(weight_map.values()))
    assert max(calls.values()) == 1
    for name, want in tensors.items():
        np.testing.assert_array_equal(ckpt.get(name, (2,)), want)
    index.write_text(json.dumps({"weight_map": {**weight_map, "t.extra": weight_map["t.0.0"]}}))
    with pytest.raises(ValueError, match=r"'t\.extra' to 'model-00001-of-00003\.safetensors'"):
        SafetensorsCheckpoint(str(tmp_path))
