"""PEFT adapters on MoE models (Mixtral, Qwen3-MoE) against HF peft on transformers 5:
expert tensors need LoRA-wrapped experts, `target_parameters` on the router (`gate.weight`,
what `all-linear` saves), and per-expert adapters (`experts.{j}.w1/w2/w3`, what PEFT on
transformers 4 saved) stacked into the fused-experts LoRA layers."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import jax.numpy as jnp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from lora_jax.config import LoRAConfig  # noqa: E402
from lora_jax.layers.base import set_lora_mapping  # noqa: E402
from lora_jax.models import PACKED_MODULES_MAPPING  # noqa: E402
from lora_jax.models.moe_decoder import load_hf_moe_model  # noqa: E402
from lora_jax.serving.peft import load_peft_adapter  # noqa: E402
from lora_jax.serving.wrap import lora_layers, wrap_model  # noqa: E402

pytestmark = pytest.mark.oracle

S, V, E = 6, 96, 4
TOL = dict(rtol=2e-4, atol=2e-4)
# per family: expert block, the checkpoint's (gate, up, down) names, the per-expert width
FAMILIES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), "intermediate_size"),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "moe_intermediate_size"),
}


def _hf_model(family):
    if family == "mixtral":
        cfg = transformers.MixtralConfig(
            vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
            num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        )  # fmt: skip
        return transformers.MixtralForCausalLM(cfg)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=E, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(cfg)


@pytest.fixture(scope="module", params=list(FAMILIES))
def base(request, tmp_path_factory):
    """(family, checkpoint dir, HF model)."""
    torch.manual_seed(0)
    model = _hf_model(request.param).eval()
    with torch.no_grad():  # routers start at zero in some HF inits: make routing matter
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") or "experts" in name:
                p.normal_(0, 0.2)
    d = tmp_path_factory.mktemp(request.param) / "ckpt"
    model.save_pretrained(d)
    return request.param, str(d), model


def _ids():
    return np.random.default_rng(1).integers(0, V, (2, S))


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def _peft_adapter(base_dir, out, spec, seed=1):
    """A PEFT adapter made by peft itself, both factors random (PEFT inits B to zero)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **spec)
    pm = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(out)
    return pm.eval()


def _serve(base_dir, adapter_dir, cfg, **wrap_kw):
    model = load_hf_moe_model(base_dir)
    wrap_model(model, cfg, **wrap_kw)
    adapter = load_peft_adapter(adapter_dir, model, cfg)
    for name, m in adapter.modules.items():
        lora_layers(model)[name].set_lora(0, *m.set_lora_args())
    ids = _ids()
    set_lora_mapping(model, jnp.zeros(ids.size, jnp.int32))
    pos = jnp.broadcast_to(jnp.arange(S), ids.shape)
    return adapter, np.asarray(model(jnp.asarray(ids, jnp.int32), pos)[0])


def _per_expert_adapter(family, base_dir, out, r, alpha, drop=(), **config):
    """A transformers-4 style per-expert adapter for the sparse layers (layer 0; Mixtral's
    layer 1 too), less the (layer, expert, member) in `drop`; returns its tensors."""
    block, names, _ = FAMILIES[family]
    hf = json.load(open(f"{base_dir}/config.json"))
    H, n = hf["hidden_size"], hf[FAMILIES[family][2]]
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in (0, 1) if family == "mixtral" else (0,):
        for j in range(E):
            for nm, (n_in, n_out) in zip(names, ((H, n), (H, n), (n, H))):
                if (layer, j, nm) in drop:
                    continue
                k = f"base_model.model.model.layers.{layer}.{block}.experts.{j}.{nm}"
                tensors[f"{k}.lora_A.weight"] = torch.randn(r, n_in, generator=g) * 0.2
                tensors[f"{k}.lora_B.weight"] = torch.randn(n_out, r, generator=g) * 0.2
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = dict(peft_type="LORA", r=r, lora_alpha=alpha, target_modules=list(names), **config)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return tensors


def _merged_oracle(family, base_dir, tensors, scale):
    """The HF model with every expert's `scale * B @ A` added to its fused weights."""
    block, (gate, up, down), _ = FAMILIES[family]
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in range(len(model.model.layers)):
            experts = getattr(model.model.layers[layer].mlp, "experts", None)
            if experts is None:  # a Qwen3-MoE mlp_only layer
                continue
            n = experts.down_proj.shape[-1]
            for j in range(E):
                k = f"base_model.model.model.layers.{layer}.{block}.experts.{j}"
                for nm, rows in ((gate, slice(0, n)), (up, slice(n, 2 * n)), (down, None)):
                    if f"{k}.{nm}.lora_A.weight" not in tensors:
                        continue
                    a, b = tensors[f"{k}.{nm}.lora_A.weight"], tensors[f"{k}.{nm}.lora_B.weight"]
                    w = experts.down_proj[j] if rows is None else experts.gate_up_proj[j, rows]
                    w += scale * b @ a  # [out, in]
    return model.eval()


def test_expert_tensors_need_lora_wrapped_experts(base, tmp_path):
    """An adapter with expert LoRAs on a model whose experts are not LoRA-wrapped is refused
    naming the experts and how to wrap them, as a targeted dense module is (the expert
    tensors were dropped with a "not targeted" warning)."""
    family, d, _ = base
    spec = dict(
        r=4, lora_alpha=8, target_modules=["q_proj"],
        target_parameters=["gate_up_proj", "down_proj"],
    )  # fmt: skip
    _peft_adapter(d, tmp_path / "fused", spec)
    _per_expert_adapter(family, d, tmp_path / "per_expert", 4, 8)
    cfg = LoRAConfig(max_loras=1, max_lora_rank=8)
    model = load_hf_moe_model(d)
    wrap_model(model, cfg, target_modules=["q_proj", "o_proj"])
    for adapter in ("fused", "per_expert"):
        with pytest.raises(
            ValueError, match=r"layers\.0\.mlp\.experts'.*not LoRA-wrapped.*experts"
        ):
            load_peft_adapter(tmp_path / adapter, model, cfg)


ROUTER_SPECS = {
    # all-linear on transformers 5 saves the router as target_parameters "gate.weight"
    "all-linear": dict(r=2, lora_alpha=4, target_modules="all-linear"),
    # PEFT resolves the router's patterns on "<module>.weight": "gate" matches no module
    "patterns": dict(
        r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["gate.weight"],
        rank_pattern={"gate": 2}, alpha_pattern={"mlp.gate.weight": 24},
    ),
}  # fmt: skip


@pytest.mark.parametrize("spec", list(ROUTER_SPECS))
def test_router_target_parameter_matches_peft(base, tmp_path, spec):
    family, d, hf = base
    if spec == "patterns" and family != "mixtral":
        pytest.skip("one family covers the pattern names")
    pm = _peft_adapter(d, tmp_path / "a", ROUTER_SPECS[spec])
    saved = json.load(open(tmp_path / "a" / "adapter_config.json"))
    assert "gate.weight" in saved["target_parameters"]
    ref = _hf_logits(pm, _ids())
    assert np.abs(ref - _hf_logits(hf, _ids())).max() > 1e-2  # the adapter changes logits
    adapter, ours = _serve(d, tmp_path / "a", LoRAConfig(max_loras=1, max_lora_rank=8))
    assert adapter.modules["model.layers.0.mlp.gate"].rank == ROUTER_SPECS[spec]["r"]
    np.testing.assert_allclose(ours, ref, **TOL)


SEPARATE_W1_W3 = dict(packed_modules_mapping={**PACKED_MODULES_MAPPING, "experts": ["w1", "w3"]})


@pytest.mark.parametrize("wrap", ["fused_w13", "w1_w3"])
def test_per_expert_adapter_matches_peft(base, tmp_path, wrap):
    """Per-expert LoRAs served by `FusedMoE3DWithLoRA` (w13 LoRA of rank 2r: A stacked on
    rank, B block-diagonal) or `FusedMoEWithLoRA` (w1 / w2 / w3 apart) equal peft, which
    converts such an adapter to the fused experts on transformers 5."""
    family, d, _ = base
    if wrap == "w1_w3" and family != "mixtral":
        pytest.skip("one family covers FusedMoEWithLoRA")
    tensors = _per_expert_adapter(family, d, tmp_path / "a", 4, 8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ref = _hf_logits(peft.PeftModel.from_pretrained(hf, tmp_path / "a").eval(), _ids())
    merged = _hf_logits(_merged_oracle(family, d, tensors, 8 / 4), _ids())
    np.testing.assert_allclose(ref, merged, **TOL)  # peft really serves the expert LoRAs
    kw = SEPARATE_W1_W3 if wrap == "w1_w3" else {}
    adapter, ours = _serve(d, tmp_path / "a", LoRAConfig(max_loras=1, max_lora_rank=8), **kw)
    assert adapter.modules["model.layers.0.mlp.experts"].rank == (4 if kw else 8)
    np.testing.assert_allclose(ours, ref, **TOL)


def test_per_expert_rslora_scales_each_expert_by_its_own_rank(base, tmp_path):
    """rsLoRA per-expert adapters are scaled alpha / sqrt(r) with each expert's own rank,
    as they were trained (transformers 4) and as vLLM serves them: the oracle merges each
    `scale * B @ A` into the HF weights. (PEFT 0.21 on transformers 5, converting them
    to fused experts, serves other logits: 0.2 off this oracle, and off alpha / sqrt(2r)
    too; it is not the oracle for rsLoRA here.)"""
    family, d, _ = base
    if family != "mixtral":
        pytest.skip("one family covers the scaling")
    tensors = _per_expert_adapter(family, d, tmp_path / "a", 4, 8, use_rslora=True)
    ref = _hf_logits(_merged_oracle(family, d, tensors, 8 / np.sqrt(4)), _ids())
    plain = _hf_logits(_merged_oracle(family, d, tensors, 8 / 4), _ids())
    assert np.abs(ref - plain).max() > 1e-2  # rsLoRA's scale is visible
    _, ours = _serve(d, tmp_path / "a", LoRAConfig(max_loras=1, max_lora_rank=8))
    np.testing.assert_allclose(ours, ref, **TOL)


def test_per_expert_missing_experts_are_zeros_and_rank_is_checked(base, tmp_path):
    """Experts or members missing from the file get no LoRA (PEFT cannot convert such a
    file: the oracle merges each present `scale * B @ A` into the HF weights); the fused
    w13 LoRA's rank r1 + r3 must fit max_lora_rank, separate w1 / w3 need only r."""
    family, d, _ = base
    if family != "mixtral":
        pytest.skip("one family covers the packing")
    drop = {(0, 1, "w3"), (0, 2, "w1"), (0, 2, "w3"), (0, 2, "w2"), (1, 3, "w2")}
    tensors = _per_expert_adapter(family, d, tmp_path / "a", 4, 8, drop=drop)
    ref = _hf_logits(_merged_oracle(family, d, tensors, 8 / 4), _ids())
    _, ours = _serve(d, tmp_path / "a", LoRAConfig(max_loras=1, max_lora_rank=8))
    np.testing.assert_allclose(ours, ref, **TOL)
    _per_expert_adapter(family, d, tmp_path / "r8", 8, 8)
    cfg = LoRAConfig(max_loras=1, max_lora_rank=8)
    model = load_hf_moe_model(d)
    wrap_model(model, cfg)
    with pytest.raises(ValueError, match=r"rank 16 on FusedMoE3DWithLoRA.*max_lora_rank=8"):
        load_peft_adapter(tmp_path / "r8", model, cfg)
    model = load_hf_moe_model(d)
    wrap_model(model, cfg, **SEPARATE_W1_W3)
    assert load_peft_adapter(tmp_path / "r8", model, cfg).rank == 8


@pytest.mark.parametrize("wrap", ["fused_w13", "w1_w3"])
def test_a_trained_and_exported_moe_slot_serves_in_peft(base, tmp_path, wrap):
    """Experts (PEFT's init), the router and q_proj trained in a slot and written with
    `save_peft_adapter` (`target_parameters` on the fused expert weights; w1 / w3 apart
    as one w13 LoRA of rank r1 + r3) give, loaded by HF peft, lora_jax's logits; loaded
    back by lora_jax into a fresh slot, the same logits again."""
    import jax
    import optax
    from flax import nnx

    import lora_jax as lj
    from lora_jax.serving.export import save_peft_adapter
    from lora_jax.serving.training import init_lora_slot, train_only_slots

    family, d, _ = base
    if wrap == "w1_w3" and family != "mixtral":
        pytest.skip("one family covers FusedMoEWithLoRA")
    cfg = LoRAConfig(max_loras=2, max_lora_rank=8)
    model = load_hf_moe_model(d)
    wrap_model(model, cfg, **(SEPARATE_W1_W3 if wrap == "w1_w3" else {}))
    init_lora_slot(model, 1, 4, seed=0, target_modules=["experts", "gate", "q_proj"])
    ids = jnp.asarray(_ids(), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(S), ids.shape)

    def logits(m, slot):
        with lj.lora_mapping(m, jnp.full(ids.size, slot, jnp.int32)):
            return m(ids, pos)[0]

    def loss_fn(m):
        logp = jax.nn.log_softmax(logits(m, 1)[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

    opt = nnx.Optimizer(
        model, optax.chain(optax.adam(3e-2), train_only_slots([1])), wrt=nnx.LoRAParam
    )

    @nnx.jit
    def step(model, opt):
        loss, g = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, g)
        return loss

    losses = [float(step(model, opt)) for _ in range(3)]
    assert losses[-1] < losses[0]
    got = np.asarray(logits(model, 1))
    assert np.abs(got - np.asarray(logits(model, -1))).max() > 1e-2  # the slot moved
    out = save_peft_adapter(model, 1, tmp_path / "t")
    saved = json.load(open(tmp_path / "t" / "adapter_config.json"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in saved["target_parameters"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ref = _hf_logits(peft.PeftModel.from_pretrained(hf, out).eval(), _ids())
    np.testing.assert_allclose(got, ref, **TOL)
    adapter = load_peft_adapter(out, model, cfg)
    for name, m in adapter.modules.items():
        lora_layers(model)[name].set_lora(0, *m.set_lora_args())
    np.testing.assert_allclose(np.asarray(logits(model, 0)), got, **TOL)


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_per_expert_fused_w13_follows_the_gate_up_layout(layout):
    """The block-diagonal w13 B is laid out as the base's w13 (GPT-OSS interleaves gate and
    up): `FusedMoE3DWithLoRA` gives what `FusedMoEWithLoRA` (separate w1 / w3, checked
    against peft above) gives, with an expert's w3 missing."""
    from flax import nnx

    from lora_jax.moe import FusedMoE
    from lora_jax.serving.peft import PEFTConfig, adapter_from_tensors

    H, n, r = 16, 8, 2
    rng = np.random.default_rng(0)
    tensors = {}
    for j in range(E):
        for nm, shape in (("w1", (H, n)), ("w3", (H, n)), ("w2", (n, H))):
            if (j, nm) != (1, "w3"):
                k = f"base_model.model.mlp.experts.{j}.{nm}"
                tensors[f"{k}.lora_A.weight"] = rng.normal(size=(r, shape[0])).astype(np.float32)
                tensors[f"{k}.lora_B.weight"] = rng.normal(size=(shape[1], r)).astype(np.float32)
    cfg = LoRAConfig(max_loras=1, max_lora_rank=8)
    x = jnp.asarray(rng.normal(size=(5, H)), jnp.float32)  # [T, H]
    router = jnp.asarray(rng.normal(size=(5, E)), jnp.float32)  # [T, E]
    outs = []
    for mapping in (None, {"experts": ["w1", "w3"]}):
        model = nnx.Module()
        model.mlp = nnx.Module()
        model.mlp.experts = FusedMoE(E, 2, H, n, gate_up_layout=layout, rngs=nnx.Rngs(0))
        wrap_model(model, cfg, packed_modules_mapping=mapping)
        peft_cfg = PEFTConfig(r=r, lora_alpha=4, target_modules=("w1", "w2", "w3"))
        adapter = adapter_from_tensors(tensors, peft_cfg, model, cfg)
        layer = lora_layers(model)["mlp.experts"]
        layer.set_lora(0, *adapter.modules["mlp.experts"].set_lora_args())
        set_lora_mapping(model, jnp.zeros(5, jnp.int32))
        outs.append(np.asarray(layer(x, router)))
    assert np.abs(outs[1] - np.asarray(layer.base_layer(x, router))).max() > 1e-2
    np.testing.assert_allclose(outs[0], outs[1], **TOL)
