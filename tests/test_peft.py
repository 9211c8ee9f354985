"""PEFT loader: config rules (scaling, rsLoRA, rank/alpha patterns, targets), packing,
numerics against a numpy oracle, strict safetensors reading and clean errors."""

import json
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from serving_toy import SHAPES, ToyLM, peft_tensors

import lora_jax as lj
from lora_jax.serving.manager import LRUCacheLoRAModelManager
from lora_jax.serving.peft import (
    PEFTConfig,
    adapter_from_tensors,
    load_peft_adapter,
    read_safetensors,
    write_safetensors,
)
from lora_jax.serving.wrap import lora_layers, wrap_model

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CFG = lj.LoRAConfig(max_loras=2, max_lora_rank=16)
PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def model():
    m = ToyLM(n_layers=2)
    wrap_model(m, CFG, packed_modules_mapping=PACKED)
    return m


def _dir(tmp_path, config, tensors, name="adapter"):
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "bias": "none", **config})
    )
    if tensors is not None:
        write_safetensors(d / "adapter_model.safetensors", tensors)
    return d


def _key(layer, module, ab):
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"{PREFIX}.{layer}.{parent}.{module}.lora_{ab}.weight"


# -- config semantics ----------------------------------------------------------------------
def test_scaling_is_folded_into_b(tmp_path, model):
    tensors = peft_tensors(ALL, 8, seed=1)
    d = _dir(tmp_path, {"r": 8, "lora_alpha": 32, "target_modules": ALL}, tensors)
    a = load_peft_adapter(d, model, CFG, adapter_id=3)
    assert (a.id, a.name, a.rank) == (3, "adapter", 8)
    for key, m in a.modules.items():
        assert m.module_name == key and m.rank == 8
        assert all(x.shape[0] == y.shape[1] == 8 for x, y in zip(m.lora_a, m.lora_b))
    qkv = a.get_lora("model.layers.1.self_attn.qkv_proj")
    for i, m in enumerate(("q_proj", "k_proj", "v_proj")):
        np.testing.assert_array_equal(qkv.lora_a[i], tensors[_key(1, m, "A")])
        np.testing.assert_allclose(qkv.lora_b[i], 4.0 * tensors[_key(1, m, "B")], rtol=1e-6)
    assert sorted(a.modules) == sorted(
        f"model.layers.{i}.{m}"
        for i in range(2)
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    )


def test_rslora_scaling(tmp_path, model):
    tensors = peft_tensors(["o_proj"], 16, seed=2)
    config = {"r": 16, "lora_alpha": 8, "use_rslora": True, "target_modules": ["o_proj"]}
    d = _dir(tmp_path, config, tensors)
    a = load_peft_adapter(d, model, CFG)
    b = a.get_lora("model.layers.0.self_attn.o_proj").lora_b[0]
    np.testing.assert_allclose(b, 8 / math.sqrt(16) * tensors[_key(0, "o_proj", "B")], rtol=1e-6)
    assert PEFTConfig(r=16, lora_alpha=8, use_rslora=True).scaling_for("x") == pytest.approx(2.0)


def test_rank_and_alpha_patterns(tmp_path, model):
    config = {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        # PEFT matches a key as a suffix after a dot, or as a regex over the name.
        "rank_pattern": {"q_proj": 4, r"layers\.1\.mlp\.down_proj": 2},
        "alpha_pattern": {"v_proj": 2, "down_proj": 4},
    }
    ranks = {"q_proj": 4, "v_proj": 8}
    tensors = peft_tensors(["q_proj", "v_proj"], 8, seed=3, ranks=ranks)
    rng = np.random.default_rng(0)
    for layer, r in ((0, 8), (1, 2)):
        tensors[_key(layer, "down_proj", "A")] = rng.normal(size=(r, SHAPES["down_proj"][0]))
        tensors[_key(layer, "down_proj", "B")] = rng.normal(size=(SHAPES["down_proj"][1], r))
    tensors = {k: np.asarray(v, np.float32) for k, v in tensors.items()}
    a = load_peft_adapter(_dir(tmp_path, config, tensors), model, CFG)
    qkv = a.get_lora("model.layers.0.self_attn.qkv_proj")
    assert qkv.lora_a[0].shape == (4, 32) and qkv.lora_a[1] is None
    np.testing.assert_allclose(qkv.lora_b[0], 16 / 4 * tensors[_key(0, "q_proj", "B")], rtol=1e-6)
    np.testing.assert_allclose(qkv.lora_b[2], 2 / 8 * tensors[_key(0, "v_proj", "B")], rtol=1e-6)
    for layer, r in ((0, 8), (1, 2)):
        down = a.get_lora(f"model.layers.{layer}.mlp.down_proj")
        assert down.rank == r
        np.testing.assert_allclose(
            down.lora_b[0], 4 / r * tensors[_key(layer, "down_proj", "B")], rtol=1e-6
        )


def test_target_modules_regex_string(tmp_path, model):
    tensors = peft_tensors(["o_proj"], 4, seed=4)
    d = _dir(tmp_path, {"r": 4, "lora_alpha": 4, "target_modules": r".*\.o_proj"}, tensors)
    assert list(load_peft_adapter(d, model, CFG).modules) == [
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.o_proj",
    ]


# -- numerics --------------------------------------------------------------------------------
def test_untargeted_or_excluded_tensors_are_ignored_as_peft_does(tmp_path, model):
    """PEFT builds LoRA layers from the config and ignores tensors of other modules: a
    file with q/v/down tensors served under `target_modules=[q, v]`, or with
    `exclude_modules` (a list, or a regex on layer 1), gives only the targeted ones. A list
    naming modules of other architectures too is fine while one of them matches."""
    tensors = peft_tensors(["q_proj", "v_proj", "down_proj"], 8, n_layers=2, seed=4)
    qkv = [f"model.layers.{i}.self_attn.qkv_proj" for i in (0, 1)]
    cases = {
        "targets": ({"target_modules": ["q_proj", "v_proj", "c_attn"]}, qkv),
        "exclude": (
            {"target_modules": ["q_proj", "v_proj", "down_proj"], "exclude_modules": ["down_proj"]},
            qkv,
        ),
        "exclude_regex": (
            {
                "target_modules": ["q_proj", "v_proj", "down_proj"],
                "exclude_modules": r".*layers\.1\..*",
            },
            [qkv[0], "model.layers.0.mlp.down_proj"],
        ),  # fmt: skip
    }
    full = load_peft_adapter(
        _dir(tmp_path, {"r": 8, "lora_alpha": 16, "target_modules": ALL}, tensors, "full"),
        model,
        CFG,
    )
    assert len(full.modules) == 4
    for name, (config, want) in cases.items():
        d = _dir(tmp_path, {"r": 8, "lora_alpha": 16, **config}, tensors, name)
        with pytest.warns(UserWarning, match="does not target .* ignored"):
            got = load_peft_adapter(d, model, CFG)
        assert sorted(got.modules) == sorted(want), name
        for key, m in got.modules.items():
            for x, y in zip(m.lora_b, full.modules[key].lora_b):
                np.testing.assert_array_equal(x, y)


def test_velora_adapter_serves_as_the_same_plain_lora(tmp_path, model):
    """PEFT's VeLoRA compresses the activations kept for the backward pass; its forward is
    plain LoRA. Its saved file adds a `lora_velora_embed` buffer per module (and the config
    a `velora_config`): it was refused as "not a LoRA weight"; it serves as the same
    adapter without those buffers."""
    tensors = peft_tensors(["q_proj", "down_proj"], 8, seed=9)
    rng = np.random.default_rng(9)
    embeds = {
        k.replace(".lora_A.weight", ".lora_velora_embed"): rng.normal(
            size=-(-v.shape[1] // 64)
        ).astype(np.float32)
        for k, v in tensors.items()
        if k.endswith(".lora_A.weight")
    }
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "down_proj"]}
    plain = load_peft_adapter(_dir(tmp_path, config, tensors, "plain"), model, CFG)
    velora_config = {"num_groups": 64, "init_type": "batch_average", "scale": 1.0}
    d = _dir(tmp_path, {**config, "velora_config": velora_config}, {**tensors, **embeds}, "ve")
    got = load_peft_adapter(d, model, CFG)
    assert sorted(got.modules) == sorted(plain.modules) and len(got.modules) == 4
    for key, m in plain.modules.items():
        np.testing.assert_equal(
            (got.modules[key].lora_a, got.modules[key].lora_b), (m.lora_a, m.lora_b)
        )


@pytest.fixture(scope="module")
def decoder():
    """A wrapped tiny Llama (model_type "llama"): embedding and lm_head LoRA layers too."""
    from flax import nnx

    from lora_jax.models import DecoderConfig, DecoderForCausalLM

    m = DecoderForCausalLM(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
    wrap_model(m, CFG)
    return m


def _decoder_tensors(modules, rank, seed=0):
    """PEFT-keyed random LoRA tensors for `DecoderConfig.tiny()`: linear leaves of both
    layers, `embed_tokens` (`lora_embedding_A [r, V]` / `_B [D, r]`) and `lm_head`."""
    from lora_jax.models import DecoderConfig

    c = DecoderConfig.tiny()
    D, V, F, q, kv = (
        c.hidden_size,
        c.vocab_size,
        c.intermediate_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    )
    shapes = {
        "q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
        "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D),
    }  # fmt: skip
    rng = np.random.default_rng(seed)
    out = {}

    def pair(key, n_in, n_out, a="lora_A.weight", b="lora_B.weight"):
        out[f"base_model.model.{key}.{a}"] = rng.normal(size=(rank, n_in)).astype(np.float32)
        out[f"base_model.model.{key}.{b}"] = rng.normal(size=(n_out, rank)).astype(np.float32)

    for m in modules:
        if m == "embed_tokens":
            pair("model.embed_tokens", V, D, "lora_embedding_A", "lora_embedding_B")
        elif m == "lm_head":
            pair("lm_head", D, V)
        else:
            for i in range(c.num_hidden_layers):
                parent = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                pair(f"model.layers.{i}.{parent}.{m}", *shapes[m])
    return out


def _same_modules(got, want):
    assert sorted(got.modules) == sorted(want.modules)
    for key, m in want.modules.items():
        for x, y in zip(m.lora_a + m.lora_b, got.modules[key].lora_a + got.modules[key].lora_b):
            np.testing.assert_array_equal(x, y, err_msg=key)


@pytest.mark.parametrize("shorthand", ["all-linear", "ALL-LINEAR", "All-Linear"])
def test_all_linear_never_targets_the_embedding_or_lm_head(tmp_path, decoder, shorthand):
    """PEFT's `target_modules="all-linear"` (any case: PEFT compares it lower-cased) is
    every linear but the output layer: a file's embed_tokens / lm_head LoRA tensors are
    ignored with a warning, the linear ones serve as under a list naming them. (They were
    served: logits off by 6.2 / 0.7 against PEFT; "ALL-LINEAR" was refused as a regex.)"""
    tensors = _decoder_tensors(["q_proj", "down_proj", "embed_tokens", "lm_head"], 8, seed=6)
    linear = {k: v for k, v in tensors.items() if "embed_tokens" not in k and "lm_head" not in k}
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "down_proj"]}
    want = load_peft_adapter(_dir(tmp_path, config, linear, "list"), decoder, CFG)
    config = {**config, "target_modules": shorthand}
    d = _dir(tmp_path, config, tensors, "all_linear")
    with pytest.warns(UserWarning, match=r"4 tensors .* ignored.*(embed_tokens|lm_head)"):
        got = load_peft_adapter(d, decoder, CFG)
    _same_modules(got, want)
    assert PEFTConfig.from_dict(config).target_modules == "all-linear"


def test_null_target_modules_is_the_model_types_default(tmp_path, decoder, model):
    """A null (or absent) `target_modules` is PEFT's default for the model type (q_proj,
    v_proj for Llama): the file's other tensors are ignored with a warning, and the adapter
    serves as under that list (every tensor was served). A model of no known type (a
    user's model) is refused naming the file, as PEFT refuses the config."""
    tensors = _decoder_tensors(["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], 4, seed=2)
    qv = {k: v for k, v in tensors.items() if ".q_proj." in k or ".v_proj." in k}
    config = {"r": 4, "lora_alpha": 8}
    listed = {**config, "target_modules": ["q_proj", "v_proj"]}
    want = load_peft_adapter(_dir(tmp_path, listed, qv, "list"), decoder, CFG)
    for name, extra in (("null", {"target_modules": None}), ("absent", {})):
        d = _dir(tmp_path, {**config, **extra}, tensors, name)
        with pytest.warns(UserWarning, match=r"null target_modules .*'llama'.*ignored"):
            got = load_peft_adapter(d, decoder, CFG)
        _same_modules(got, want)
    d = _dir(tmp_path, config, peft_tensors(["q_proj"], 4), "toy")
    with pytest.raises(ValueError, match="target_modules is null.*give target_modules") as e:
        load_peft_adapter(d, model, CFG)
    assert "adapter_config.json" in str(e.value)


def test_null_target_modules_default_by_model_type():
    """`for_model_type`: the dense types have PEFT's q_proj / v_proj default, also beside
    `target_parameters`; the MoE types (an MoE model's type, not its attention family's)
    have none on transformers 5, so only `target_parameters` are targeted, or without
    them the config is refused."""
    null = PEFTConfig.from_dict({"r": 4, "lora_alpha": 8, "target_modules": None})
    params = {"r": 4, "lora_alpha": 8, "target_parameters": ["experts.down_proj"]}
    for model_type, default in (("qwen2", True), ("mixtral", False), ("qwen3_moe", False)):
        cfg = PEFTConfig.from_dict(params).for_model_type(model_type)
        assert cfg.targets("model.layers.0.self_attn.q_proj") is default
        assert not cfg.targets("model.layers.0.self_attn.k_proj")
        assert cfg.targets_parameter("model.layers.0.mlp.experts.down_proj")
        if default:
            assert null.for_model_type(model_type).target_modules == ("q_proj", "v_proj")
        else:
            with pytest.raises(ValueError, match=f"'{model_type}'.*give target_modules"):
                null.for_model_type(model_type)
    listed = PEFTConfig(r=4, lora_alpha=8, target_modules=("o_proj",))
    assert listed.for_model_type(None) is listed
    assert PEFTConfig(r=4, lora_alpha=8).for_model_type(None).targets("x.o_proj")  # in code


def test_a_saved_base_table_must_be_the_models(tmp_path):
    """PEFT saves the embedding table of an adapter on `embed_tokens` and loads it back:
    the same table as the model's (also in bf16) is fine; one with changed token rows
    (an adapter trained with new tokens) is refused, and no slot changes."""
    from flax import nnx

    from lora_jax.models import DecoderConfig, DecoderForCausalLM

    config = DecoderConfig.tiny()
    m = DecoderForCausalLM(config, rngs=nnx.Rngs(0))
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8)
    wrap_model(m, cfg, target_modules=["embed_tokens"])
    rng = np.random.default_rng(0)
    table = np.asarray(m.model.embed_tokens.base_layer.embedding[...])[: config.vocab_size]
    key = "base_model.model.model.embed_tokens"
    tensors = {
        f"{key}.lora_embedding_A": rng.normal(size=(4, config.vocab_size)).astype(np.float32),
        f"{key}.lora_embedding_B": rng.normal(size=(64, 4)).astype(np.float32),
    }
    peft_cfg = {"r": 4, "lora_alpha": 8, "target_modules": ["embed_tokens"]}
    for dtype in (np.float32, ml_dtypes.bfloat16):
        t = {**tensors, f"{key}.base_layer.weight": table.astype(dtype)}
        load_peft_adapter(_dir(tmp_path, peft_cfg, t, f"same_{np.dtype(dtype).name}"), m, cfg)
    changed = table.copy()
    changed[[5, 77]] += 0.5
    mgr = LRUCacheLoRAModelManager(m, cfg)
    before = jnp.asarray(m.model.embed_tokens.lora_a[...])
    d = _dir(tmp_path, peft_cfg, {**tensors, f"{key}.base_layer.weight": changed}, "changed")
    with pytest.raises(ValueError, match=r"base_layer.weight.*rows \(token ids\) \[5, 77\]"):
        mgr.load_adapters({"x": d}, activate=True, progress=False)
    np.testing.assert_array_equal(m.model.embed_tokens.lora_a[...], before)


def _member_deltas(model, adapter, seed):
    """Serves `adapter` (id 1) to tokens 0 and 2 of 3 random ones in every decoder LoRA
    layer; yields (layer index, HF member, x, the member's output delta over the base)."""
    mgr = LRUCacheLoRAModelManager(model)
    mgr.set_active_adapters([adapter])
    rng = np.random.default_rng(seed)
    for name, layer in lora_layers(model).items():
        if name == "model.proj":
            continue
        x = jnp.asarray(rng.normal(size=(3, layer.base_layer.in_features)), jnp.float32)
        lj.set_lora_mapping(layer, jnp.asarray(mgr.token_mapping([1, None, 1])))
        delta = np.asarray(layer(x)) - np.asarray(layer.base_layer(x))
        parts = layer.base_layer.split_output(jnp.asarray(delta))
        members = layer.packed_modules
        parts = parts if len(parts) == len(members) else [delta]
        for m, part in zip(members, parts):
            yield int(name.split(".")[2]), m, x, np.asarray(part)


def test_loaded_adapter_matches_numpy_oracle(tmp_path, model):
    """Each HF module's output delta equals scale * x @ A.T @ B.T (ranks 8 and 4 mixed)."""
    ranks = {"q_proj": 4, "gate_proj": 4}
    tensors = peft_tensors(ALL, 8, seed=5, ranks=ranks)
    config = {"r": 8, "lora_alpha": 12, "rank_pattern": ranks, "target_modules": ALL}
    a = load_peft_adapter(_dir(tmp_path, config, tensors), model, CFG, adapter_id=1)
    for i, m, x, part in _member_deltas(model, a, seed=9):
        A, B = tensors[_key(i, m, "A")], tensors[_key(i, m, "B")]
        scale = 12 / A.shape[0]
        want = scale * np.asarray(x, np.float64) @ A.T @ B.T
        np.testing.assert_allclose(np.asarray(part)[[0, 2]], want[[0, 2]], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(np.asarray(part)[1], 0.0)  # no adapter: exact base
    lj.set_lora_mapping(model, jnp.zeros((1,), jnp.int32))


def _blocks_forward(x, stacked, n):
    """PEFT's BlockDiagonalLinear forward: x's n column chunks, each through its own block
    of the stacked `[out, in / n]` weight (an oracle apart from the loader's dense matrix)."""
    rows = stacked.shape[0] // n
    w = stacked.reshape(n, rows, stacked.shape[1])
    return np.einsum("bim,inm->bin", x.reshape(x.shape[0], n, -1), w).reshape(x.shape[0], -1)


def test_bdlora_factors_serve_as_peft_s_block_forward(tmp_path, model):
    """BD-LoRA (`use_bdlora`): the column layers' B and the row layers' A are saved as their
    diagonal blocks; served, each module's delta is PEFT's block forward."""
    bd_b, bd_a, n, r = ["q_proj", "v_proj", "up_proj"], ["o_proj", "down_proj"], 2, 8
    rng = np.random.default_rng(3)
    tensors = {}
    for i in range(2):
        for m in bd_b + bd_a + ["k_proj"]:  # k_proj: a plain factor pair beside them
            n_in, n_out = SHAPES[m]
            cols_a = n_in // n if m in bd_a else n_in
            cols_b = r // n if m in bd_b else r
            tensors[_key(i, m, "A")] = rng.normal(size=(r, cols_a)).astype(np.float32) / 4
            tensors[_key(i, m, "B")] = rng.normal(size=(n_out, cols_b)).astype(np.float32) / 4
    use = {"target_modules_bd_a": bd_a, "target_modules_bd_b": bd_b, "nblocks": n}
    config = {"r": r, "lora_alpha": 16, "target_modules": bd_b + bd_a + ["k_proj"]}
    a = load_peft_adapter(
        _dir(tmp_path, {**config, "use_bdlora": use}, tensors), model, CFG, adapter_id=1
    )
    checked = 0
    for i, m, x, part in _member_deltas(model, a, seed=4):
        xs = np.asarray(x, np.float64)
        if _key(i, m, "A") not in tensors:
            np.testing.assert_array_equal(np.asarray(part), 0.0)
            continue
        A, B = tensors[_key(i, m, "A")], tensors[_key(i, m, "B")]
        h = _blocks_forward(xs, A, n) if m in bd_a else xs @ A.T  # [T, r]
        want = (16 / r) * (_blocks_forward(h, B, n) if m in bd_b else h @ B.T)
        np.testing.assert_allclose(np.asarray(part)[[0, 2]], want[[0, 2]], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(np.asarray(part)[1], 0.0)
        checked += 1
    assert checked == 2 * 6
    lj.set_lora_mapping(model, jnp.zeros((1,), jnp.int32))
    # a module in both lists, blocks that do not divide, a bad config: refused by name
    both = {**use, "target_modules_bd_a": bd_a + ["q_proj"]}
    with pytest.raises(ValueError, match=r"names \['q_proj'\] in both A and B lists"):
        PEFTConfig.from_dict({**config, "use_bdlora": both})
    with pytest.raises(ValueError, match=r"nblocks=3 blocks needs 2 dims, the first divisible"):
        load_peft_adapter(
            _dir(tmp_path, {**config, "use_bdlora": {**use, "nblocks": 3}}, tensors, "three"),
            model,
            CFG,
        )
    for bad in (True, {"nblocks": 0}, {"target_modules_bd_a": "o_proj"}):
        with pytest.raises(ValueError, match="use_bdlora"):
            PEFTConfig.from_dict({**config, "use_bdlora": bad})


def test_name_map_rewrites_checkpoint_names(tmp_path, model):
    """`name_map` (vLLM's `WeightsMapper`): a checkpoint saved under other module names
    loads to the same adapter as one saved under the model's; a map to no module fails
    naming the module."""
    tensors = peft_tensors(ALL, 8, seed=4)
    config = {"r": 8, "lora_alpha": 16, "target_modules": ALL}
    want = load_peft_adapter(_dir(tmp_path, config, tensors, "plain"), model, CFG)
    renamed = {
        k.replace("model.layers.", "transformer.h.").replace(".self_attn.", ".attn."): v
        for k, v in tensors.items()
    }
    assert not set(renamed) & set(tensors)
    back = lambda n: n.replace("transformer.h.", "model.layers.").replace(".attn.", ".self_attn.")
    d = _dir(tmp_path, config, renamed, "renamed")
    got = load_peft_adapter(d, model, CFG, name_map=back)
    assert set(got.modules) == set(want.modules)
    for key, m in want.modules.items():
        for x, y in zip(m.lora_a + m.lora_b, got.modules[key].lora_a + got.modules[key].lora_b):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.attn\.\w+' is not a LoRA module"):
        load_peft_adapter(d, model, CFG)  # no map: names the unknown module
    with pytest.raises(ValueError, match="nowhere"):
        load_peft_adapter(d, model, CFG, name_map=lambda n: "nowhere." + n)
    # PEFT's patterns name the checkpoint's modules: they match before the rewrite
    patterned = {**config, "alpha_pattern": {r"h\.0\.attn\.q_proj": 64}}
    d = _dir(tmp_path, patterned, renamed, "patterned")
    got = load_peft_adapter(d, model, CFG, name_map=back)
    for key, m in want.modules.items():
        scale = 64 / 16 if key == "model.layers.0.self_attn.qkv_proj" else 1.0
        for i, (x, y) in enumerate(zip(m.lora_b, got.modules[key].lora_b)):
            s = scale if i == 0 else 1.0  # q is member 0 of the packed qkv
            np.testing.assert_allclose(y, s * x, rtol=1e-6, err_msg=f"{key}[{i}]")


# -- errors ------------------------------------------------------------------------------------
BAD_CONFIGS = {
    "dora_without_magnitudes": ({"use_dora": True}, "no lora_magnitude_vector"),
    "dora_not_bool": ({"use_dora": "yes"}, "use_dora='yes' must be true or false"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "bias": ({"bias": "all"}, "bias"),
    "r0": ({"r": 0}, "positive integer"),
    "r_neg": ({"r": -8}, "positive integer"),
    "unknown_target": (
        {"target_modules": ["qq_proj", "zz_proj"]},
        r"\['qq_proj', 'zz_proj'\] match no",
    ),
    "pissa": ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4'"),
    "olora": ({"init_lora_weights": "olora"}, "path_initial_model_for_weight_conversion"),
    "loftq": ({"init_lora_weights": "loftq"}, "changed base model"),
    "expert_suffix": ({"target_parameters": ["up_proj"]}, r"target_parameters \['up_proj'\]"),
    "unknown_regex": ({"target_modules": r".*\.nothing"}, "matches no model module"),
    "layers_to_transform": ({"layers_to_transform": "0"}, "an int or a list of ints"),
    "layers_to_transform_bool": ({"layers_to_transform": [True]}, "an int or a list of ints"),
    "layers_pattern": ({"layers_pattern": 3}, "layers_pattern=3 must be a string"),
    "trainable_tokens_repeat": ({"trainable_token_indices": [3, 3]}, "repeats an id"),
    "qalora": ({"use_qalora": True}, "QALoRA"),
    "layer_replication": ({"layer_replication": [[0, 2], [1, 2]]}, "layer replication"),
    "arrow": ({"arrow_config": {"top_k": 2}}, "Arrow"),
    "kasa": ({"kasa_config": {"a": 1}}, "KaSA"),
    "monteclora": ({"monteclora_config": {"n": 2}}, "MonteCLoRA"),
    "prefix_tuning": ({"peft_type": "PREFIX_TUNING"}, "peft_type"),
    # ill-typed values and bad regexes: they gave a bare TypeError / AttributeError /
    # re.error (or a ValueError without the file) from deep inside the parsing
    "targets_int": ({"target_modules": 5}, "target_modules=5 must be a string"),
    "targets_not_str": ({"target_modules": ["q_proj", 1]}, "a list of module names"),
    "targets_bad_regex": ({"target_modules": "("}, r"target_modules='\(' is not a valid regular"),
    "excludes_int": ({"exclude_modules": 5}, "exclude_modules=5 must be a string"),
    "excludes_bad_regex": ({"exclude_modules": "q_proj["}, "not a valid regular expression"),
    "params_str": ({"target_parameters": "gate_up_proj"}, "must be a list of strings"),
    "rank_pattern_list": ({"rank_pattern": ["q_proj"]}, "rank_pattern=.* must be an object"),
    "rank_pattern_bad_regex": ({"rank_pattern": {"(": 2}}, r"rank_pattern key '\(' is not"),
    "alpha_pattern_str": ({"alpha_pattern": {"q_proj": "x"}}, r"alpha_pattern\['q_proj'\]='x'"),
    "alpha_pattern_bad_regex": ({"alpha_pattern": {"q_proj)": 2}}, "not a valid regular"),
    "alpha_none": ({"lora_alpha": None}, "lora_alpha=None must be a finite number"),
    "alpha_str": ({"lora_alpha": "x"}, "lora_alpha='x' must be a finite number"),
    # PEFT's LoraConfig refuses a layer filter with a string target_modules, and a
    # layers_pattern without layers_to_transform
    "regex_with_layers": (
        {"target_modules": r".*\.q_proj", "layers_to_transform": [0]},
        "layers_to_transform=.* string target_modules",
    ),
    "all_linear_with_layers": (
        {"target_modules": "all-linear", "layers_to_transform": 0},
        "layers_to_transform=0 with target_modules='all-linear'",
    ),
    "regex_with_pattern": (
        {"target_modules": r".*\.q_proj", "layers_pattern": "layers"},
        "layers_pattern='layers' with target_modules",
    ),
    "pattern_without_layers": (
        {"layers_pattern": "layers"},
        "layers_pattern='layers' without layers_to_transform",
    ),
    "layers_pattern_bad_regex": (
        {"layers_pattern": "(", "layers_to_transform": [0]},
        r"layers_pattern '\(' is not",
    ),
}


def test_name_map_targets_name_the_checkpoints_modules(tmp_path, model):
    """With `name_map`, `target_modules` (a regex or dotted names) names the checkpoint's
    modules, as PEFT trained them: it is not checked against the model's names; a config
    with only `target_parameters` targets no dense module."""
    tensors = peft_tensors(["q_proj", "v_proj"], 8, seed=5)
    renamed = {k.replace("model.layers.", "transformer.h."): v for k, v in tensors.items()}
    back = lambda n: n.replace("transformer.h.", "model.layers.")  # noqa: E731
    for targets in (r"transformer\.h\.\d+\.self_attn\.(q|v)_proj", ["self_attn.q_proj", "v_proj"]):
        config = {"r": 8, "lora_alpha": 16, "target_modules": targets}
        d = _dir(tmp_path, config, renamed, f"t{len(str(targets))}")
        got = load_peft_adapter(d, model, CFG, name_map=back)
        assert sorted(got.modules) == [f"model.layers.{i}.self_attn.qkv_proj" for i in (0, 1)]
    cfg = PEFTConfig(r=8, lora_alpha=8, target_parameters=("experts.down_proj",))
    assert not cfg.targets("model.layers.0.self_attn.q_proj")


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_raises_naming_the_file(tmp_path, model, case):
    extra, match = BAD_CONFIGS[case]
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **extra}
    d = _dir(tmp_path, config, peft_tensors(["q_proj"], 8))
    with pytest.raises(ValueError, match=match) as e:
        load_peft_adapter(d, model, CFG)
    assert "adapter_config.json" in str(e.value)


def test_an_unreadable_config_raises_naming_the_file(tmp_path):
    """A config of deeply nested JSON raised a bare RecursionError (not a ValueError) and
    one that is not UTF-8 a bare UnicodeDecodeError, neither naming the file; both are a
    `ValueError` naming it, and a manager asked to load one changes nothing."""
    m = ToyLM(n_layers=2)
    wrap_model(m, CFG, packed_modules_mapping=PACKED)
    mgr = LRUCacheLoRAModelManager(m, CFG)
    config = {"r": 8, "lora_alpha": 16, "target_modules": ALL}
    mgr.load_adapters({"good": _dir(tmp_path, config, peft_tensors(ALL, 8), "good")}, activate=True)
    before = sorted(mgr.list_adapters()), list(mgr.lora_index_to_id)
    arrays = [
        np.asarray(v[...]) for la in lora_layers(m).values() for v in (*la.lora_a, *la.lora_b)
    ]
    cases = {
        "deep": b'{"r": 8, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "latin1": '{"r": 8, "lora_alpha": 16, "base_model_name_or_path": "caf\u00e9"}'.encode(
            "latin-1"
        ),
    }
    for name, raw in cases.items():
        with pytest.raises((RecursionError, UnicodeDecodeError)):  # the reference: json's own
            json.loads(raw.decode("utf-8"))
        d = _dir(tmp_path, {}, peft_tensors(ALL, 8), name)
        (d / "adapter_config.json").write_bytes(raw)
        match = f"{name}/adapter_config.json: cannot read the adapter config"
        with pytest.raises(ValueError, match=match):
            load_peft_adapter(d, m, CFG)
        with pytest.raises(ValueError, match=match):
            mgr.load_adapters({name: d}, activate=True)
        assert (sorted(mgr.list_adapters()), list(mgr.lora_index_to_id)) == before
        now = [
            np.asarray(v[...]) for la in lora_layers(m).values() for v in (*la.lora_a, *la.lora_b)
        ]
        for x, y in zip(arrays, now, strict=True):
            np.testing.assert_array_equal(x, y)


def test_a_config_made_in_code_refuses_the_layer_filters_peft_refuses():
    """Only `from_dict` refused them: a `PEFTConfig` made in code with a regex and
    `layers_to_transform` served every layer (the filter silently dropped)."""
    for kw, match in [
        (dict(target_modules=r".*q_proj", layers_to_transform=(0,)), "layers_to_transform"),
        (dict(target_modules="all-linear", layers_pattern=("layers",)), "layers_pattern"),
        (dict(target_modules=("q_proj",), layers_pattern=("layers",)), "without layers_to"),
    ]:
        with pytest.raises(ValueError, match=f"{match}.*PEFT|PEFT refuses"):
            PEFTConfig(r=4, lora_alpha=8, **kw)
    listed = PEFTConfig(r=4, lora_alpha=8, target_modules=("q_proj",), layers_to_transform=(0,))
    assert listed.targets("model.layers.0.self_attn.q_proj")
    assert not listed.targets("model.layers.1.self_attn.q_proj")


def test_a_config_made_in_code_takes_peft_s_dict_patterns(model):
    """PEFT's `rank_pattern` / `alpha_pattern` are dicts: made in code they failed with
    "too many values to unpack"; they serve as the pairs form and as the same file."""
    kw = dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        rank_pattern={"q_proj": 4},
        alpha_pattern={"v_proj": 2},
    )
    tensors = peft_tensors(["q_proj", "v_proj"], 8, seed=3, ranks={"q_proj": 4, "v_proj": 8})
    tensors = {k: np.asarray(v, np.float32) for k, v in tensors.items()}
    pairs = {k: tuple(v.items()) for k, v in kw.items() if k.endswith("_pattern")}
    want = adapter_from_tensors(tensors, PEFTConfig.from_dict(kw), model, CFG, adapter_id=1)
    for cfg in (PEFTConfig(**kw), PEFTConfig(**{**kw, **pairs})):
        got = adapter_from_tensors(tensors, cfg, model, CFG, adapter_id=1)
        _same_modules(got, want)
    assert PEFTConfig(**kw) == PEFTConfig(**{**kw, **pairs})
    hash(PEFTConfig(**kw))


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(lora_alpha="16"), "lora_alpha='16' must be a finite number"),
        (dict(lora_alpha=None), "lora_alpha=None must be a finite number"),
        (dict(lora_alpha=True), "lora_alpha=True must be a finite number"),  # was alpha 1
        (dict(lora_alpha=float("nan")), "lora_alpha=nan must be a finite number"),
        (dict(alpha_pattern={"q_proj": "8"}), r"alpha_pattern\['q_proj'\]='8' must be a finite"),
        (dict(use_rslora="false"), "use_rslora='false' must be a bool"),  # was rsLoRA on
        (dict(ensure_weight_tying=1), "ensure_weight_tying=1 must be a bool"),
        (dict(target_modules=5), "target_modules=5 must be a string"),
        (dict(target_modules=["q_proj", 5]), "target_modules=.* must be a string"),
        (dict(exclude_modules=5), "exclude_modules=5 must be a string"),
        (dict(layers_to_transform="0"), "layers_to_transform='0' must be an int or a list"),
        (dict(layers_to_transform=(0, True)), "layers_to_transform=.* must be an int or a list"),
        (dict(rank_pattern=(("q_proj", 4, 1),)), "rank_pattern=.* must be a dict"),
        (dict(rank_pattern={3: 4}), "rank_pattern=.* must be a dict"),
        (dict(alpha_pattern=5), "alpha_pattern=5 must be a dict"),
    ],
)
def test_a_config_made_in_code_checks_its_fields_as_from_dict(bad, match):
    """Only `r` and the ranks were checked in code: the rest failed later as raw
    TypeErrors, or served another scaling silently."""
    kw = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **bad}
    with pytest.raises(ValueError, match=match):
        PEFTConfig(**kw)


def test_max_lora_rank_bounds_only_the_ranks_served(tmp_path, model):
    """A served module's rank above `max_lora_rank` is refused, naming the module and the
    config; a rank (`r` or a `rank_pattern` value) that no served module has loads, as
    PEFT loads it, and serves as the config without it (it was refused up front)."""
    for name, config, rank in (
        ("r", {"r": 32, "lora_alpha": 32}, 32),
        ("pattern", {"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 32}}, 32),
    ):
        d = _dir(
            tmp_path, {**config, "target_modules": ["q_proj"]}, peft_tensors(["q_proj"], rank), name
        )
        with pytest.raises(
            ValueError,
            match=r"'model.layers.0.self_attn.qkv_proj' has rank 32 "
            r"\(from .*adapter_config.json\), greater than max_lora_rank=16",
        ):
            load_peft_adapter(d, model, CFG)
    tensors = peft_tensors(["q_proj"], 8, seed=3)
    for name, config, same in (
        ("unused_pattern", {"r": 8, "lora_alpha": 16, "rank_pattern": {"down_proj": 32}},
         {"r": 8, "lora_alpha": 16}),
        ("unused_r", {"r": 32, "lora_alpha": 32, "rank_pattern": {"q_proj": 8}},
         {"r": 8, "lora_alpha": 32}),
    ):  # fmt: skip
        targets = {"target_modules": ["q_proj"]}
        got = load_peft_adapter(_dir(tmp_path, {**config, **targets}, tensors, name), model, CFG)
        want = load_peft_adapter(
            _dir(tmp_path, {**same, **targets}, tensors, f"{name}_ref"), model, CFG
        )
        _same_modules(got, want)


def _bad_tensors(case):
    t = peft_tensors(["q_proj", "down_proj"], 8)
    if case == "b_out":
        t[_key(0, "q_proj", "B")] = np.zeros((31, 8), np.float32)
    elif case == "a_in":
        t[_key(1, "down_proj", "A")] = np.zeros((8, 47), np.float32)
    elif case == "rank_mismatch_ab":
        t[_key(0, "q_proj", "B")] = np.zeros((32, 4), np.float32)
    elif case == "rank_vs_config":
        t[_key(0, "q_proj", "A")] = np.zeros((4, 32), np.float32)
        t[_key(0, "q_proj", "B")] = np.zeros((32, 4), np.float32)
    elif case == "unknown_module":
        # targeted by name (`*.q_proj`) but no module of the model
        t[f"{PREFIX}.0.mlp.w9.q_proj.lora_A.weight"] = np.zeros((8, 32), np.float32)
    elif case == "not_lora_key":
        t[f"{PREFIX}.0.self_attn.q_proj.lora_C.weight"] = np.zeros((32,), np.float32)
    elif case == "missing_b":
        del t[_key(1, "down_proj", "B")]
    elif case == "empty":
        t = {}
    return t


BAD_TENSORS = {
    "b_out": "q_proj",
    "a_in": "down_proj",
    "rank_mismatch_ab": "same r",
    "rank_vs_config": "r=8",
    "unknown_module": "w9",
    "not_lora_key": "lora_C",
    "missing_b": "lora_A/lora_B pair",
    "empty": "no LoRA tensors",
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_bad_tensors_raise_naming_file_and_tensor(tmp_path, model, case):
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "down_proj"]}
    d = _dir(tmp_path, config, _bad_tensors(case))
    with pytest.raises(ValueError, match=BAD_TENSORS[case]) as e:
        load_peft_adapter(d, model, CFG)
    assert "adapter_model.safetensors" in str(e.value)


def test_pickle_checkpoint_is_refused(tmp_path, model):
    d = _dir(tmp_path, {"r": 8, "lora_alpha": 8}, None)
    (d / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match="pickle"):
        load_peft_adapter(d, model, CFG)
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_peft_adapter(tmp_path, model, CFG)


@pytest.mark.parametrize("cut", ["header", "data", "garbage"])
def test_truncated_or_corrupt_safetensors(tmp_path, model, cut):
    d = _dir(tmp_path, {"r": 8, "lora_alpha": 8}, peft_tensors(["q_proj"], 8))
    f = d / "adapter_model.safetensors"
    raw = f.read_bytes()
    if cut == "header":
        raw = raw[:20]
    elif cut == "data":
        raw = raw[:-100]
    else:
        raw = raw[:8] + b"{" * (len(raw) - 8)
    f.write_bytes(raw)
    with pytest.raises(ValueError, match="adapter_model.safetensors.*(truncated|corrupt)"):
        load_peft_adapter(d, model, CFG)


def test_read_safetensors_matches_library_and_reads_bf16(tmp_path):
    from safetensors.numpy import load_file

    tensors = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.ones((2,), np.float16),
        "c": np.arange(5, dtype=np.int64),
    }
    write_safetensors(tmp_path / "x.safetensors", tensors)
    got, ref = read_safetensors(tmp_path / "x.safetensors"), load_file(tmp_path / "x.safetensors")
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].dtype == ref[k].dtype
        np.testing.assert_array_equal(got[k], ref[k])
    # bf16 by hand (numpy has no bf16 writer): the format is 8-byte length + JSON + data.
    value = np.array([[1.5, -2.0], [3.25, 0.0]], ml_dtypes.bfloat16)
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "bf.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + value.tobytes()
    )
    got = read_safetensors(tmp_path / "bf.safetensors")["w"]
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), value.astype(np.float32))


def _st_file(path, header: str, data: bytes) -> str:
    raw = header.encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return str(path)


HOSTILE_HEADERS = {
    "float_offsets": ('{"w":{"dtype":"U8","shape":[4],"data_offsets":[0.0,4.0]}}', 4),
    "str_offsets": ('{"w":{"dtype":"U8","shape":[4],"data_offsets":["0",4]}}', 4),
    "list_dtype": ('{"w":{"dtype":["U8"],"shape":[4],"data_offsets":[0,4]}}', 4),
    "huge_shape": ('{"w":{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,4]}}', 4),
    "inf_shape": ('{"w":{"dtype":"U8","shape":[Infinity],"data_offsets":[0,4]}}', 4),
    "negative_shape": ('{"w":{"dtype":"U8","shape":[-4],"data_offsets":[0,4]}}', 4),
    "str_shape": ('{"w":{"dtype":"U8","shape":"4","data_offsets":[0,4]}}', 4),
    "bool_shape": ('{"w":{"dtype":"U8","shape":[true,4],"data_offsets":[0,4]}}', 4),
    "deep_nesting": ("[" * 100_000 + "]" * 100_000, 0),
    "duplicate_keys": (
        '{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
        '"w":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}',
        4,
    ),
    "overlap": (
        '{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
        '"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}',
        4,
    ),
    "gap": ('{"w":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}', 4),
    "trailing": ('{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', 4),
    "metadata_not_str": (
        '{"__metadata__":{"k":1},"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}',
        4,
    ),
    "ndim_65": (
        '{"w":{"dtype":"U8","shape":[' + ",".join(["1"] * 65) + '],"data_offsets":[0,1]}}',
        1,
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_HEADERS))
def test_hostile_safetensors_headers_are_refused_naming_the_file(tmp_path, case):
    """Headers the reference reader refuses (ill-typed entries, overflowing shapes, deep
    JSON, duplicate keys, spans that overlap, leave gaps or trailing bytes — which would
    let a small file expand into any amount of memory — and more dimensions than numpy
    allows) give a `ValueError` naming the file, never another exception."""
    header, size = HOSTILE_HEADERS[case]
    f = _st_file(tmp_path / f"{case}.safetensors", header, bytes(range(size)))
    with pytest.raises(ValueError, match=f"{case}.safetensors"):
        read_safetensors(f)


def test_duplicate_safetensors_keys_are_found_in_one_pass(tmp_path):
    """The duplicate-key check counted each key over the whole list, quadratic: a 2 MB
    header with one duplicate took ~40 s, the 100 MB one allowed would take days. It is
    one pass now, counted here by key comparisons rather than by time."""
    from safetensors.numpy import load_file

    from lora_jax.serving.safetensors_io import _no_duplicates

    class Key(str):
        compared = 0

        def __eq__(self, other):
            Key.compared += 1
            return str.__eq__(self, other)

        __hash__ = str.__hash__

    n = 2_000
    pairs = [(Key(f"t{i}"), None) for i in range(n)] + [(Key("t7"), None)]
    with pytest.raises(ValueError, match=r"duplicate keys \['t7'\]"):
        _no_duplicates(pairs)
    assert Key.compared < n  # the duplicate found by hash, not by comparing every pair

    entry = '"t{}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'
    keys = ",".join(entry.format(i) for i in range(20_000))
    ok = _st_file(tmp_path / "keys.safetensors", "{" + keys + "}", b"")
    assert sorted(read_safetensors(ok)) == sorted(load_file(ok))
    dup = _st_file(tmp_path / "dup.safetensors", "{" + keys + "," + entry.format(7) + "}", b"")
    with pytest.raises(ValueError, match=r"dup.safetensors: .*duplicate keys \['t7'\]"):
        read_safetensors(dup)


def test_safetensors_round_trip_every_dtype_and_a_scalar(tmp_path):
    """What `write_safetensors` writes reads back (unsigned ints and 0-d arrays too), and
    the reference reader agrees with ours."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(0)
    tensors = {
        f"t_{dt}": rng.integers(0, 100, (2, 3)).astype(dt)
        for dt in ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")
    }
    tensors |= {"f16": np.float16([1.5, -2]), "f64": np.float64([1e300]), "s": np.float32(3.0)}
    tensors |= {"bf16": np.array([1.5, -2], ml_dtypes.bfloat16), "empty": np.zeros((0, 4))}
    f = tmp_path / "all.safetensors"
    write_safetensors(f, tensors)
    got = read_safetensors(f)
    plain = {k: v for k, v in tensors.items() if k != "bf16"}  # beyond safetensors.numpy
    write_safetensors(tmp_path / "plain.safetensors", plain)
    ref = load_file(str(tmp_path / "plain.safetensors"))
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == np.shape(v), k
        np.testing.assert_array_equal(got[k], v)
        if k in ref:
            np.testing.assert_array_equal(ref[k], got[k])


def test_null_safetensors_metadata_reads_as_the_reference_reader_does(tmp_path):
    """`"__metadata__": null` is valid (the reference reader's metadata is optional) and
    reads as no metadata; it was refused as not a map of strings."""
    from safetensors.numpy import load_file

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    header = '{"__metadata__":null,"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}'
    f = _st_file(tmp_path / "null_meta.safetensors", header, x.tobytes())
    ref, got = load_file(f), read_safetensors(f)
    assert list(got) == list(ref) == ["w"]
    np.testing.assert_array_equal(got["w"], ref["w"])
