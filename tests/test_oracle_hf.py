"""HF transformers + peft (torch CPU) as the oracle for multi-LoRA serving.

A tiny random Llama / Qwen3 is saved with safetensors, three PEFT adapters of different
ranks, alphas and targets (one rsLoRA, one with rank/alpha patterns) get random non-zero
A and B and are saved, and lora_jax loads all of them. A mixed batch (A, B, C, none) must
match peft's mixed-batch forward (`adapter_names=[...]`) at prefill and over greedy decode.
Slot churn (activation, LRU eviction), failed loads and merge/unmerge are checked against
the same oracle.
"""

import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import lora_jax as lj  # noqa: E402
from lora_jax.models import load_hf_model  # noqa: E402
from lora_jax.serving.manager import LRUCacheLoRAModelManager  # noqa: E402
from lora_jax.serving.merge import merge_adapter, unmerge_adapter  # noqa: E402
from lora_jax.serving.wrap import wrap_model  # noqa: E402

pytestmark = pytest.mark.oracle

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,  # HF generate would stop at eos; ours runs max_new_tokens
)
ADAPTERS = {
    "A": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "B": dict(
        r=4, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]
    ),
    "C": dict(
        r=16,
        lora_alpha=24,
        target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
        rank_pattern={"v_proj": 4, "down_proj": 2},
        alpha_pattern={"down_proj": 6},
    ),
}
MAX_RANK = 16
B_, S = 4, 7
TOL = dict(rtol=2e-4, atol=2e-4)


def _hf_base(model_type):
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[model_type]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**TINY), dtype=torch.float32)
    with torch.no_grad():  # norms away from 1 so a mis-loaded norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.eval()


def _make_adapter(base_dir, name, spec, out_dir, seed):
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **spec)
    pm = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT inits B to zero: make both factors random and non-zero
        for pname, p in pm.named_parameters():
            if "lora_A" in pname or "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def hf(request, tmp_path_factory):
    """(model_type, base dir, {name: adapter dir}, peft model with every adapter)."""
    root = tmp_path_factory.mktemp(request.param)
    base = _hf_base(request.param)
    base_dir = str(root / "base")
    base.save_pretrained(base_dir, safe_serialization=True)
    dirs = {
        n: _make_adapter(base_dir, n, spec, str(root / n), seed=i)
        for i, (n, spec) in enumerate(ADAPTERS.items())
    }
    pm = peft.PeftModel.from_pretrained(base, dirs["A"], adapter_name="A")
    for n in ("B", "C"):
        pm.load_adapter(dirs[n], adapter_name=n)
    pm.eval()
    return request.param, base_dir, dirs, pm


def _ids(seed=0, shape=(B_, S)):
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], shape).astype(np.int32)


def _hf_logits(pm, ids, names):
    with torch.no_grad():
        out = pm(input_ids=torch.tensor(ids, dtype=torch.long), adapter_names=names)
    return out.logits.float().numpy()


def _serve(base_dir, max_loras=4, max_cpu_loras=None):
    model = load_hf_model(base_dir)
    cfg = lj.LoRAConfig(max_loras=max_loras, max_lora_rank=MAX_RANK, max_cpu_loras=max_cpu_loras)
    wrap_model(model, cfg)
    return model, LRUCacheLoRAModelManager(model, cfg)


@nnx.jit
def _forward(model, ids, token_slots):
    with lj.lora_mapping(model, token_slots):
        B, S_ = ids.shape
        pos = jnp.broadcast_to(jnp.arange(S_, dtype=jnp.int32), (B, S_))
        return model(ids, pos)[0]


@nnx.jit
def _forward_no_mapping(model, ids):
    B, S_ = ids.shape
    pos = jnp.broadcast_to(jnp.arange(S_, dtype=jnp.int32), (B, S_))
    return model(ids, pos)[0]


def _logits(model, mgr, ids, adapter_ids):
    slots = mgr.token_mapping(adapter_ids, tokens_per_request=ids.shape[1])
    return np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(slots)))


def _lora_state(model):
    return jax.tree.map(np.asarray, nnx.state(model, nnx.LoRAParam, lj.LoRASlotRanks))


# -- tests ------------------------------------------------------------------------------------
def test_mixed_batch_prefill_matches_peft(hf):
    _, base_dir, dirs, pm = hf
    model, mgr = _serve(base_dir)
    loaded = mgr.load_adapters(dirs, activate=True, progress=False)
    ids_of = {a.name: a.id for a in loaded}
    ids = _ids()
    names = ["A", "B", "C", "__base__"]
    want = _hf_logits(pm, ids, names)
    got = _logits(model, mgr, ids, [ids_of.get(n) for n in names])
    np.testing.assert_allclose(got, want, **TOL)
    # Each adapter really changes its rows (the oracle can fail).
    base = _hf_logits(pm, ids, ["__base__"] * B_)
    for row in range(3):
        assert np.abs(want[row] - base[row]).max() > 1e-2
    # Another mix, adapters repeated and reordered, same slots.
    names = ["C", "C", "__base__", "A"]
    np.testing.assert_allclose(
        _logits(model, mgr, ids, [ids_of.get(n) for n in names]),
        _hf_logits(pm, ids, names),
        **TOL,
    )


def test_mixed_batch_greedy_decode_matches_peft_generate(hf):
    from lora_jax.serving.generate import generate

    _, base_dir, dirs, pm = hf
    model, mgr = _serve(base_dir)
    ids_of = {a.name: a.id for a in mgr.load_adapters(dirs, activate=True, progress=False)}
    names = ["A", "__base__", "C", "B", "A"]
    prompts = _ids(seed=4, shape=(len(names), 6))
    steps = 8
    with torch.no_grad():
        out = pm.generate(
            input_ids=torch.tensor(prompts, dtype=torch.long),
            attention_mask=torch.ones(prompts.shape, dtype=torch.long),
            adapter_names=names,
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
    want = out[:, prompts.shape[1] :].numpy().tolist()
    slots = mgr.token_mapping([ids_of.get(n) for n in names])
    got = generate(model, prompts.tolist(), slots.tolist(), max_new_tokens=steps)
    assert got.tokens == want
    # The adapters steer generation: not every adapted row equals the base continuation.
    base = generate(model, prompts.tolist(), [-1] * len(names), max_new_tokens=steps)
    assert sum(g != b for g, b in zip(got.tokens, base.tokens)) >= 2


def test_churn_lru_and_failed_loads_never_disturb_other_slots(hf, tmp_path):
    _, base_dir, dirs, pm = hf
    model, mgr = _serve(base_dir, max_loras=2, max_cpu_loras=3)
    a = {x.name: x for x in mgr.load_adapters(dirs, progress=False)}
    ids = _ids(seed=1, shape=(3, S))
    want = {n: _hf_logits(pm, ids, [n, "__base__", n]) for n in ("A", "B", "C")}
    mgr.set_active_adapters([a["A"], a["B"]])
    assert mgr.lora_index_to_id == [a["A"].id, a["B"].id]

    def check(name):
        got = _logits(model, mgr, ids, [a[name].id, None, a[name].id])
        np.testing.assert_allclose(got, want[name], **TOL)

    check("A")
    check("B")
    mgr.activate_adapter(a["A"].id)  # touch A: B is now least recently used
    mgr.activate_adapter(a["C"].id)
    assert mgr.lora_index_to_id == [a["A"].id, a["C"].id]  # B evicted, A kept its slot
    check("A")
    check("C")
    # A corrupt and a mismatched adapter fail without touching any slot.
    before = _lora_state(model)
    bad = tmp_path / "truncated"
    shutil.copytree(dirs["A"], bad)
    f = bad / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    with pytest.raises(ValueError, match="truncated|corrupt"):
        mgr.load_adapters({"bad": bad}, first_id=90, activate=True, progress=False)
    # An adapter trained for a model of another width: shape mismatch.
    small = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**{**TINY, "hidden_size": 32, "head_dim": 8}), dtype=torch.float32
    )
    small_dir = str(tmp_path / "small")
    small.save_pretrained(small_dir, safe_serialization=True)
    mismatched = _make_adapter(small_dir, "M", ADAPTERS["A"], str(tmp_path / "M"), seed=9)
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        mgr.load_adapters({"M": mismatched}, first_id=91, activate=True, progress=False)
    assert mgr.lora_index_to_id == [a["A"].id, a["C"].id]
    jax.tree.map(np.testing.assert_array_equal, before, _lora_state(model))
    check("A")
    check("C")


def test_merge_matches_lora_path_and_unmerge_restores(hf):
    _, base_dir, dirs, pm = hf
    model, mgr = _serve(base_dir, max_loras=2)
    a = {x.name: x for x in mgr.load_adapters(dirs, progress=False)}
    mgr.set_active_adapters([a["C"]])
    ids = _ids(seed=2, shape=(2, S))
    lora = _logits(model, mgr, ids, [a["C"].id] * 2)
    np.testing.assert_allclose(lora, _hf_logits(pm, ids, ["C", "C"]), **TOL)
    params = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    merge_adapter(model, mgr.slot_of(a["C"].id))
    merged = np.asarray(_forward_no_mapping(model, jnp.asarray(ids)))  # base matmuls only
    np.testing.assert_allclose(merged, lora, **TOL)
    unmerge_adapter(model)
    jax.tree.map(
        np.testing.assert_array_equal, params, jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    )
    np.testing.assert_allclose(
        _logits(model, mgr, ids, [None, None]), _hf_logits(pm, ids, ["__base__"] * 2), **TOL
    )


def test_activated_lora_matches_peft_s_alora(hf, tmp_path):
    """An activated LoRA (PEFT's `alora_invocation_tokens`) beside a plain adapter and the
    base: PEFT's mixed-batch forward (which finds each row's last invocation) and greedy
    generate, against the manager's slots and starts as per-token slots and in `generate`.
    Row 0 holds the sequence twice (the last counts), row 1 at position 0, row 2 not at all
    (the base model throughout), row 3 with the plain adapter (no start)."""
    from lora_jax.serving.alora import token_slots
    from lora_jax.serving.generate import generate

    _, base_dir, dirs, _ = hf
    invoke = [5, 9]
    spec = dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        alora_invocation_tokens=invoke,
    )
    d = _make_adapter(base_dir, "D", spec, str(tmp_path / "D"), seed=7)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, d, adapter_name="D")
    pm.load_adapter(dirs["A"], adapter_name="A")
    pm.eval()
    model, mgr = _serve(base_dir)
    paths = {"D": d, "A": dirs["A"]}
    ids_of = {a.name: a.id for a in mgr.load_adapters(paths, activate=True, progress=False)}
    ids = _ids(seed=9, shape=(5, S))
    ids[ids == 9] = 10  # only the planted occurrences
    ids[0, 1:3] = ids[0, 4:6] = invoke
    ids[1, 0:2] = ids[3, 2:4] = invoke
    names = ["D", "D", "D", "A", "__base__"]
    slots, starts = mgr.adapter_starts([ids_of.get(n) for n in names], ids)
    assert starts.tolist() == [4, 0, 0, 0, 0] and slots[2] == -1 and slots[0] == slots[1] >= 0
    want = _hf_logits(pm, ids, names)
    got = _forward(model, jnp.asarray(ids), jnp.asarray(token_slots(slots, starts, S)))
    np.testing.assert_allclose(np.asarray(got), want, **TOL)
    # PEFT's aLoRA is the base model before the start and not after it (the oracle can fail)
    base_logits = _hf_logits(pm, ids, ["__base__"] * 5)
    np.testing.assert_allclose(want[0, :4], base_logits[0, :4], **TOL)
    np.testing.assert_allclose(want[2], base_logits[2], **TOL)
    assert np.abs(want[0, 4:] - base_logits[0, 4:]).max() > 1e-2
    steps = 6
    with torch.no_grad():
        out = pm.generate(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.ones(ids.shape, dtype=torch.long),
            adapter_names=names,
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
    want_tokens = out[:, S:].numpy().tolist()
    result = generate(model, ids.tolist(), slots, adapter_starts=starts, max_new_tokens=steps)
    assert result.tokens == want_tokens
    # the slot saved back is an aLoRA for PEFT too
    from lora_jax.serving.export import save_peft_adapter

    saved = save_peft_adapter(model, int(slots[0]), tmp_path / "D_saved")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    back = peft.PeftModel.from_pretrained(base, saved, adapter_name="D").eval()
    np.testing.assert_allclose(_hf_logits(back, ids[:3], ["D"] * 3), want[:3], **TOL)


def test_bdlora_adapter_matches_peft(hf, tmp_path):
    """BD-LoRA (PEFT's `use_bdlora`: block-diagonal B on the column projections, A on the
    row ones, 2 blocks) made with PEFT and loaded here: PEFT's forward in a mixed batch."""
    from peft.tuners.lora.config import BdLoraConfig

    _, base_dir, dirs, _ = hf
    bd = BdLoraConfig(
        target_modules_bd_a=["o_proj", "down_proj"],
        target_modules_bd_b=["q_proj", "k_proj", "v_proj", "up_proj", "gate_proj"],
        nblocks=2,
    )
    spec = dict(
        r=8,
        lora_alpha=16,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        use_bdlora=bd,
    )
    d = _make_adapter(base_dir, "BD", spec, str(tmp_path / "BD"), seed=11)
    from lora_jax.serving.peft import read_safetensors

    saved = read_safetensors(f"{d}/adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn"
    assert saved[f"{key}.q_proj.lora_B.weight"].shape == (64, 4)  # [out, r / 2]: the blocks
    assert saved[f"{key}.o_proj.lora_A.weight"].shape == (8, 32)  # [r, in / 2]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, d, adapter_name="BD")
    pm.load_adapter(dirs["A"], adapter_name="A")
    pm.eval()
    model, mgr = _serve(base_dir)
    paths = {"BD": d, "A": dirs["A"]}
    ids_of = {a.name: a.id for a in mgr.load_adapters(paths, activate=True, progress=False)}
    ids = _ids(seed=12)
    names = ["BD", "A", "__base__", "BD"]
    want = _hf_logits(pm, ids, names)
    np.testing.assert_allclose(
        _logits(model, mgr, ids, [ids_of.get(n) for n in names]), want, **TOL
    )
    base_logits = _hf_logits(pm, ids, ["__base__"] * 4)
    assert np.abs(want[0] - base_logits[0]).max() > 1e-2  # the adapter acts


def test_tensors_the_config_does_not_target_are_ignored_as_peft_does(hf, tmp_path):
    """Adapter A's file (q, k, v, o) under a config that excludes o_proj: PEFT makes no
    o_proj LoRA and ignores those tensors; so does lora_jax (with a warning)."""
    import json

    _, base_dir, dirs, _ = hf
    d = tmp_path / "no_o"
    shutil.copytree(dirs["A"], d)
    config = json.loads((d / "adapter_config.json").read_text())
    config["exclude_modules"] = ["o_proj"]
    (d / "adapter_config.json").write_text(json.dumps(config))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, str(d)).eval()
    ids = _ids(seed=3, shape=(2, S))
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    model, mgr = _serve(base_dir)
    with pytest.warns(UserWarning, match="ignored"):
        (adapter,) = mgr.load_adapters({"no_o": d}, activate=True, progress=False)
    assert not any(k.endswith("o_proj") for k in adapter.modules)
    np.testing.assert_allclose(_logits(model, mgr, ids, [adapter.id] * 2), want, **TOL)


@pytest.mark.parametrize(
    "layers",
    [{"layers_to_transform": [1]}, {"layers_to_transform": 0, "layers_pattern": "layers"}],
)
def test_layers_to_transform_serves_the_layers_peft_serves(hf, tmp_path, layers):
    """Adapter A's file (every layer's q, k, v, o) under a config with PEFT's layer filter:
    PEFT gives only those layers a LoRA and ignores the other tensors; so does lora_jax."""
    import json

    _, base_dir, dirs, _ = hf
    d = tmp_path / "some_layers"
    shutil.copytree(dirs["A"], d)
    config = json.loads((d / "adapter_config.json").read_text())
    config.update(layers)
    (d / "adapter_config.json").write_text(json.dumps(config))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns of the tensors it leaves out
        pm = peft.PeftModel.from_pretrained(base, str(d)).eval()
    ids = _ids(seed=4, shape=(2, S))
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    model, mgr = _serve(base_dir)
    with pytest.warns(UserWarning, match="ignored"):
        (adapter,) = mgr.load_adapters({"some": d}, activate=True, progress=False)
    keep = layers["layers_to_transform"]
    keep = keep if isinstance(keep, list) else [keep]
    assert {int(k.split(".")[2]) for k in adapter.modules} == set(keep)
    np.testing.assert_allclose(_logits(model, mgr, ids, [adapter.id] * 2), want, **TOL)


def _edited_copy(src, dst, **changes):
    import json

    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def _peft_single(base_dir, d, ids):
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns of the tensors it leaves out
        pm = peft.PeftModel.from_pretrained(base, str(d)).eval()
    with torch.no_grad():
        return pm(input_ids=torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def test_null_target_modules_serves_as_peft(hf, tmp_path):
    """Adapter A's file (q, k, v, o) under `target_modules: null`: PEFT targets its default
    for the model type (q_proj, v_proj) and ignores k / o; so does lora_jax, with a warning
    (it served every tensor: logits off by ~1)."""
    _, base_dir, dirs, _ = hf
    d = _edited_copy(dirs["A"], tmp_path / "null", target_modules=None)
    ids = _ids(seed=6, shape=(2, S))
    want = _peft_single(base_dir, d, ids)
    model, mgr = _serve(base_dir)
    with pytest.warns(UserWarning, match="null target_modules.*ignored"):
        (adapter,) = mgr.load_adapters({"null": d}, activate=True, progress=False)
    assert not any(k.endswith("o_proj") for k in adapter.modules)
    np.testing.assert_allclose(_logits(model, mgr, ids, [adapter.id] * 2), want, **TOL)


def test_null_target_modules_defaults_are_peft_s():
    """lora_jax's reading of a null `target_modules` is PEFT's, on a tiny HF model of every
    type lora_jax serves, with and without `target_parameters`: the modules PEFT gives a
    LoRA (MoE types: none, as PEFT's transformers 5 conversion empties the list), or a
    refusal where PEFT refuses."""
    from lora_jax.models.config import SUPPORTED_MODEL_TYPES
    from lora_jax.models.moe_decoder import MOE_MODEL_TYPES
    from lora_jax.serving.peft_config import PEFTConfig

    tiny = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
    )  # fmt: skip
    for model_type in (*SUPPORTED_MODEL_TYPES, *MOE_MODEL_TYPES):
        moe = model_type in MOE_MODEL_TYPES
        for extra in ({}, {"target_parameters": ["experts.down_proj"]} if moe else None):
            if extra is None:
                continue
            torch.manual_seed(0)
            config = transformers.AutoConfig.for_model(model_type, **tiny)
            model = transformers.AutoModelForCausalLM.from_config(config)
            names = [n for n, _ in model.named_modules() if n]
            ours = PEFTConfig.from_dict({"r": 2, "lora_alpha": 4, **extra})
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, **extra))
            except ValueError:
                with pytest.raises(ValueError, match="target_modules is null"):
                    ours.for_model_type(model_type)
                continue
            want = {
                n.removeprefix("base_model.model.")
                for n, m in pm.named_modules()
                if isinstance(m, peft.tuners.lora.LoraLayer) and not n.endswith("experts")
            }
            resolved = ours.for_model_type(model_type)
            got = {n.removeprefix("base_model.model.") for n in names if resolved.targets(n)}
            assert got == want, model_type


@pytest.mark.parametrize("shorthand", ["all-linear", "ALL-LINEAR"])
def test_all_linear_literal_serves_as_peft(hf, tmp_path, shorthand):
    """A file with q / down_proj, embed_tokens and lm_head LoRA under a literal
    `target_modules: "all-linear"` (PEFT matches it in any case): PEFT targets every linear
    but the output layer, so it ignores the embedding's and lm_head's tensors; lora_jax
    too (it served them, logits off by ~6; "ALL-LINEAR" was refused as a regex)."""
    _, base_dir, _, _ = hf
    spec = dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "down_proj", "embed_tokens", "lm_head"]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = _make_adapter(base_dir, "E", spec, str(tmp_path / "src"), seed=7)
    d = _edited_copy(src, tmp_path / "all_linear", target_modules=shorthand)
    ids = _ids(seed=7, shape=(2, S))
    want = _peft_single(base_dir, d, ids)
    model, mgr = _serve(base_dir)
    with pytest.warns(UserWarning, match="ignored"):
        (adapter,) = mgr.load_adapters({"all": d}, activate=True, progress=False)
    assert "lm_head" not in adapter.modules and "model.embed_tokens" not in adapter.modules
    np.testing.assert_allclose(_logits(model, mgr, ids, [adapter.id] * 2), want, **TOL)


def test_configs_peft_refuses_are_refused():
    """PEFT's `LoraConfig` refuses a layer filter with a string `target_modules` (a regex,
    or "all-linear") and `layers_pattern` without `layers_to_transform`: lora_jax refuses
    the same configs, naming the file and the fields, and accepts the others."""
    from lora_jax.serving.peft_config import PEFTConfig

    configs = [
        dict(target_modules=r".*\.(q|k)_proj", layers_to_transform=[0]),
        dict(target_modules="all-linear", layers_to_transform=[0]),
        dict(target_modules="ALL-LINEAR", layers_to_transform=0),
        dict(target_modules=r".*\.q_proj", layers_pattern="layers"),
        dict(target_modules=r".*\.q_proj", layers_pattern=["layers"], layers_to_transform=[1]),
        dict(target_modules=["q_proj"], layers_pattern="layers"),
        dict(target_modules=["q_proj"], layers_pattern=["h"]),
        # accepted by both
        dict(target_modules=["q_proj"], layers_pattern="layers", layers_to_transform=[0]),
        dict(target_modules=["q_proj"], layers_to_transform=[0]),
        dict(target_modules=r".*\.q_proj"),
        dict(target_modules="all-linear"),
        dict(target_modules=["q_proj"], layers_pattern=[]),
    ]
    for extra in configs:
        d = {"r": 4, "lora_alpha": 8, **extra}
        try:
            peft.LoraConfig(**d)
            refused = False
        except ValueError:
            refused = True
        if not refused:
            PEFTConfig.from_dict(d)
            continue
        with pytest.raises(ValueError, match=r"adapter_config.json: layers_(to_transform|pattern)"):
            PEFTConfig.from_dict(d)


def test_target_rule_is_peft_check_target_module_exists():
    """`PEFTConfig.targets` against PEFT's own rule over names and configs with layer
    filters, exact names, regexes and exclusions."""
    from peft.tuners.tuners_utils import check_target_module_exists

    from lora_jax.serving.peft_config import PEFTConfig

    names = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.12.mlp.experts.3.down_proj",
        "model.layers.3.mlp.experts.12.down_proj",
        "transformer.h.1.attn.c_attn",
        "lm_head",
        "q_proj",
    ]
    configs = [
        dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[1, 12]),
        dict(target_modules=["q_proj"], layers_to_transform=0, layers_pattern="layers"),
        dict(
            target_modules=["c_attn", "down_proj"], layers_to_transform=[1, 3], layers_pattern=["h"]
        ),
        dict(target_modules=["model.layers.0.self_attn.q_proj", "q_proj"], layers_to_transform=[1]),
        dict(target_modules=r".*\.(q_proj|down_proj)"),
        dict(target_modules=["q_proj", "down_proj"], exclude_modules=["down_proj"]),
    ]
    for extra in configs:
        hf_cfg = peft.LoraConfig(r=4, lora_alpha=8, **extra)
        ours = PEFTConfig.from_dict({"r": 4, "lora_alpha": 8, **extra})
        for name in names:
            want = bool(check_target_module_exists(hf_cfg, name)) and not isinstance(
                check_target_module_exists(hf_cfg, name), peft.tuners.tuners_utils._ExcludedModule
            )
            assert ours.targets(name) == want, (extra, name)


@pytest.mark.parametrize(
    "targets, patterns",
    [
        (["embed_tokens", "q_proj"], {}),
        (["embed_tokens", "lm_head"], {}),
        (["embed_tokens", "q_proj"], dict(rank_pattern={"embed_tokens": 6})),
        (
            ["embed_tokens", "q_proj"],
            dict(rank_pattern={"embed_tokens": 6}, alpha_pattern={"lm_head": 12}),
        ),
    ],
)
def test_ensure_weight_tying_serves_the_tied_lm_head_lora(tmp_path, targets, patterns):
    """A tied model's adapter saved with `ensure_weight_tying=True`: PEFT ties a LoRA onto
    lm_head and saves it, though the saved `target_modules` name only the embedding;
    lora_jax serves it too (it was dropped as untargeted: logits off by ~30). The tied
    LoRA shares the embedding's factors, so it has the embedding's rank (a rank_pattern
    for embed_tokens), but PEFT scales it by lm_head's own r and alpha (it was refused:
    "has rank 6 but ... gives r=4")."""
    cfg = transformers.LlamaConfig(**{**TINY, "tie_word_embeddings": True})
    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    base_dir = str(tmp_path / "base")
    base.save_pretrained(base_dir, safe_serialization=True)
    spec = dict(r=4, lora_alpha=8, target_modules=targets, ensure_weight_tying=True, **patterns)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = _make_adapter(base_dir, "tied", spec, str(tmp_path / "tied"), seed=3)
        again = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        pm = peft.PeftModel.from_pretrained(again, d).eval()
    ids = _ids(seed=5, shape=(2, S))
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    model, mgr = _serve(base_dir)
    (adapter,) = mgr.load_adapters({"tied": d}, activate=True, progress=False)
    assert "lm_head" in adapter.modules
    np.testing.assert_allclose(_logits(model, mgr, ids, [adapter.id] * 2), want, **TOL)


@pytest.mark.parametrize(
    "targets", [["q_proj", "v_proj", "down_proj"], ["embed_tokens", "lm_head", "o_proj"]]
)
def test_a_slot_trained_here_and_exported_serves_in_peft(hf, tmp_path, targets):
    """An adapter trained in a slot (PEFT init, AdamW, other slots fixed) and written with
    `save_peft_adapter` gives, loaded by HF peft, the logits lora_jax serves from the slot
    (linear layers; the token embedding's and the lm_head's LoRA too)."""
    import optax

    from lora_jax.serving.export import save_peft_adapter
    from lora_jax.serving.training import init_lora_slot, train_only_slots

    _, base_dir, dirs, _ = hf
    model, mgr = _serve(base_dir, max_loras=3)
    (served_a,) = mgr.load_adapters({"A": dirs["A"]}, activate=True, progress=False)  # slot 0
    trained = 2
    init_lora_slot(model, trained, 8, seed=0, target_modules=targets)
    ids = _ids(1)
    slots = jnp.full(ids.size, trained, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), ids.shape)

    def loss_fn(m):
        with lj.lora_mapping(m, slots):
            logits = m(jnp.asarray(ids), pos)[0]
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], -1))

    opt = nnx.Optimizer(
        model, optax.chain(optax.adam(3e-2), train_only_slots([trained])), wrt=nnx.LoRAParam
    )

    @nnx.jit
    def step(model, opt):
        loss, g = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, g)
        return loss

    losses = [float(step(model, opt)) for _ in range(3)]
    assert losses[-1] < losses[0]
    out = save_peft_adapter(model, trained, tmp_path / "trained", base_model_name_or_path=base_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, out, adapter_name="T").eval()
    want = _hf_logits(pm, ids, ["T"] * B_)
    got = np.asarray(_forward(model, jnp.asarray(ids), slots))
    np.testing.assert_allclose(got, want, **TOL)
    served = _logits(model, mgr, ids, [served_a.id] * B_)  # A still as peft serves it
    np.testing.assert_allclose(served, _hf_logits(hf[3], ids, ["A"] * B_), **TOL)
