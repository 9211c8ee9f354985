"""MoE decoders (Mixtral, Qwen3-MoE) against HF transformers on tiny random checkpoints."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from lora_jax.models.moe_decoder import MoEConfig, load_hf_moe_model  # noqa: E402
from lora_jax.sharding import ShardingRules  # noqa: E402

pytestmark = pytest.mark.oracle

B, S, V = 2, 6, 96


def _mixtral(tmp_path, **overrides):
    cfg = transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5, **overrides,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


def _qwen3_moe(tmp_path):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(cfg)


def _save(make, tmp_path):
    torch.manual_seed(0)
    model = make(tmp_path).eval()
    with torch.no_grad():  # routers start at zero in some HF inits: make routing matter
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") or "experts" in name:
                p.normal_(0, 0.2)
    d = tmp_path / "ckpt"
    model.save_pretrained(d)
    return model, str(d)


def _ids():
    return np.random.default_rng(0).integers(0, V, (B, S))


def _ours(directory, rules=None):
    model = load_hf_moe_model(directory, rules=rules)
    ids = jnp.asarray(_ids(), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(S), (B, S))
    # One jitted call: op by op on an 8-device mesh it took a minute on 2 CPU cores.
    logits, _ = nnx.jit(lambda m, i, p: m(i, p))(model, ids, pos)
    return np.asarray(logits)


@pytest.mark.parametrize("make", [_mixtral, _qwen3_moe], ids=["mixtral", "qwen3_moe"])
def test_logits_match_transformers(make, tmp_path):
    hf, d = _save(make, tmp_path)
    with torch.no_grad():
        ref = hf(torch.as_tensor(_ids())).logits.float().numpy()
    np.testing.assert_allclose(_ours(d), ref, rtol=2e-4, atol=2e-4)


def test_mixtral_windows_every_layer_whatever_layer_types(tmp_path):
    """transformers' Mixtral applies sliding_window to every layer and ignores a
    config.json `layer_types` (lora_jax gave its "full_attention" layers no window)."""
    _, d = _save(lambda p: _mixtral(p, sliding_window=3), tmp_path)  # window < S
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["layer_types"] = ["full_attention", "sliding_attention"]
    with open(path, "w") as f:
        json.dump(cfg, f)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.as_tensor(_ids())).logits.float().numpy()
    np.testing.assert_allclose(_ours(d), ref, rtol=2e-4, atol=2e-4)


def test_logits_sharded_tp_ep(tmp_path):
    hf, d = _save(_qwen3_moe, tmp_path)
    with torch.no_grad():
        ref = hf(torch.as_tensor(_ids())).logits.float().numpy()
    mesh = jax.make_mesh((2, 2, 2), ("dp", "tp", "ep"))
    np.testing.assert_allclose(_ours(d, ShardingRules(mesh)), ref, rtol=2e-4, atol=2e-4)


def test_config_reading():
    base, moe = MoEConfig.from_hf(
        dict(
            model_type="qwen3_moe",
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            moe_intermediate_size=4,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            mlp_only_layers=[],
        )  # fmt: skip
    )
    assert base.qk_norm and [moe.is_sparse(i) for i in range(2)] == [False, True]
    with pytest.raises(ValueError, match="not an MoE model"):
        MoEConfig.from_hf(dict(model_type="llama"))


# -- PEFT adapters on the experts (target_parameters) -----------------------------------------
PEFT_SPECS = {
    1: dict(
        r=4, lora_alpha=8, target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    ),
    # a bare parameter name, as transformers 5 saves a target_modules list on MoE experts
    2: dict(r=8, lora_alpha=4, use_rslora=True, target_parameters=["down_proj"]),
}  # fmt: skip


def _peft_adapters(base_dir, tmp_path, specs=PEFT_SPECS):
    peft = pytest.importorskip("peft")
    dirs, models = {}, {}
    for aid, spec in specs.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        cfg = peft.LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **spec)
        pm = peft.get_peft_model(model, cfg)
        g = torch.Generator().manual_seed(aid)
        with torch.no_grad():  # PEFT inits B to zero: make both factors random
            for name, p in pm.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        dirs[aid] = tmp_path / f"adapter{aid}"
        pm.save_pretrained(dirs[aid])
        models[aid] = pm.eval()
    return dirs, models


@pytest.mark.parametrize(
    "make,mesh",
    [(_mixtral, None), (_qwen3_moe, None), (_mixtral, (1, 2, 2))],
    ids=["mixtral", "qwen3_moe", "mixtral-tp2-ep2"],
)
def test_peft_expert_adapters_mixed_batch(make, mesh, tmp_path):
    """Two PEFT adapters with `target_parameters` on the fused experts (one also on
    q_proj), served in one batch with a no-adapter row, equal peft's per-adapter forward;
    on one device and with the experts split over tp x ep."""
    from lora_jax.config import LoRAConfig
    from lora_jax.layers.base import set_lora_mapping
    from lora_jax.serving.manager import LRUCacheLoRAModelManager
    from lora_jax.serving.wrap import wrap_model

    hf, d = _save(make, tmp_path)
    dirs, peft_models = _peft_adapters(d, tmp_path)
    ids = np.random.default_rng(1).integers(0, V, (3, S))
    rows = ["1", "2", None]  # adapter per sequence (None: base)
    with torch.no_grad():
        ref = []
        for r, seq in zip(rows, ids):
            m = hf if r is None else peft_models[int(r)]
            ref.append(m(torch.as_tensor(seq[None])).logits[0].float().numpy())
        base = hf(torch.as_tensor(ids)).logits.float().numpy()
    for row in (0, 1):  # each adapter really changes its sequence (the oracle can fail)
        assert np.abs(ref[row] - base[row]).max() > 1e-3
    cfg = LoRAConfig(max_loras=2, max_lora_rank=8)
    rules = None
    if mesh is not None:
        if jax.device_count() < int(np.prod(mesh)):
            pytest.skip(f"needs {int(np.prod(mesh))} devices, {jax.device_count()} visible")
        devices = jax.devices()[: int(np.prod(mesh))]
        rules = ShardingRules(jax.make_mesh(mesh, ("dp", "tp", "ep"), devices=devices))
    model = load_hf_moe_model(d, rules=rules)
    wrap_model(model, cfg, target_modules=["q_proj", "experts"])
    # The adapter manager path: PEFT loader → prepare_lora → one batched slot write.
    mgr = LRUCacheLoRAModelManager(model, cfg)
    loaded = mgr.load_adapters({str(k): v for k, v in dirs.items()}, activate=True, progress=False)
    id_of = {a.name: a.id for a in loaded}
    assert all(any(n.endswith("mlp.experts") for n in a.modules) for a in loaded)
    slots = mgr.token_mapping([id_of.get(r) for r in rows], tokens_per_request=S)
    set_lora_mapping(model, jnp.asarray(slots))
    pos = jnp.broadcast_to(jnp.arange(S), (3, S))
    logits, _ = model(jnp.asarray(ids, jnp.int32), pos)
    np.testing.assert_allclose(np.asarray(logits), np.stack(ref), rtol=2e-4, atol=2e-4)


def test_peft_expert_patterns_give_each_weight_its_rank_and_scale(tmp_path):
    """`rank_pattern` / `alpha_pattern` keyed on the experts' parameters (PEFT matches
    `<module>.gate_up_proj` / `<module>.down_proj`): each weight gets its own rank and
    scaling, as in peft's forward."""
    from lora_jax.config import LoRAConfig
    from lora_jax.layers.base import set_lora_mapping
    from lora_jax.serving.manager import LRUCacheLoRAModelManager
    from lora_jax.serving.wrap import wrap_model

    spec = dict(
        r=4, lora_alpha=8, target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        rank_pattern={"down_proj": 2}, alpha_pattern={"gate_up_proj": 32, "q_proj": 2},
    )  # fmt: skip
    hf, d = _save(_mixtral, tmp_path)
    dirs, peft_models = _peft_adapters(d, tmp_path, {1: spec})
    ids = _ids()
    with torch.no_grad():
        ref = peft_models[1](torch.as_tensor(ids)).logits.float().numpy()
    cfg = LoRAConfig(max_loras=1, max_lora_rank=8)
    model = load_hf_moe_model(d)
    wrap_model(model, cfg, target_modules=["q_proj", "experts"])
    mgr = LRUCacheLoRAModelManager(model, cfg)
    (adapter,) = mgr.load_adapters({"patterns": dirs[1]}, activate=True, progress=False)
    experts = adapter.modules["model.layers.0.mlp.experts"]
    assert [a.shape[1] for a in experts.lora_a] == [4, 2]  # [E, r, in]: w13 4, w2 2
    slots = mgr.token_mapping([adapter.id] * len(ids), tokens_per_request=S)
    set_lora_mapping(model, jnp.asarray(slots))
    pos = jnp.broadcast_to(jnp.arange(S), ids.shape)
    logits, _ = model(jnp.asarray(ids, jnp.int32), pos)
    np.testing.assert_allclose(np.asarray(logits), ref, rtol=2e-4, atol=2e-4)
