"""`save_peft_adapter(..., expert_layout="per_expert")`: MoE experts written as PEFT writes
them on transformers 4 (one LoRA per expert and projection: Mixtral
`block_sparse_moe.experts.{j}.w1/w3/w2`, Qwen3-MoE `mlp.experts.{j}.gate_proj/up_proj/
down_proj`).

Oracles: the slot's own stacks (`read_lora`) for the written tensors, the slot's own
forward for the logits of the adapter loaded back (into the same model, or into one with
the experts wrapped the other way), the first file for a second export of the adapter
loaded back. HF peft on transformers 4 was checked by hand (transformers 5, which CI has,
no longer has per-expert modules)."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax as lj
from lora_jax.models import PACKED_MODULES_MAPPING, DecoderConfig
from lora_jax.models.moe_decoder import MoEConfig, MoEDecoderForCausalLM
from lora_jax.serving.export import save_peft_adapter
from lora_jax.serving.peft import load_peft_adapter, read_safetensors
from lora_jax.serving.training import init_lora_slot, is_linear, trainable_layers
from lora_jax.serving.wrap import lora_layers, wrap_model

E, N, H = 4, 32, 64  # experts, per-expert width, hidden (DecoderConfig.tiny)
MAX_RANK = 8
# family → (attention family, the MoE block in the file, (gate, up, down) member names)
FAMILIES = {
    "mixtral": ("mistral", "block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("qwen3", "mlp", ("gate_proj", "up_proj", "down_proj")),
}
SEPARATE = {**PACKED_MODULES_MAPPING, "experts": ["w1", "w3"]}
PREFIX = "base_model.model."


def _model(family, separate=False, rules=None):
    attention, _, _ = FAMILIES[family]
    # Qwen3-MoE: layer 1 dense, so the checkpoint also has non-expert gate_proj / up_proj
    dense = (1,) if family == "qwen3_moe" else ()
    moe = MoEConfig(
        model_type=family, num_experts=E, top_k=2, moe_intermediate_size=N, mlp_only_layers=dense
    )
    model = MoEDecoderForCausalLM(
        DecoderConfig.tiny(model_type=attention), moe, rules=rules, rngs=nnx.Rngs(0)
    )
    wrap_model(
        model,
        lj.LoRAConfig(max_loras=3, max_lora_rank=MAX_RANK),
        packed_modules_mapping=SEPARATE if separate else None,
    )
    return model


def _moe_layers(model):
    return {n: x for n, x in lora_layers(model).items() if hasattr(x, "fused_w13")}


def _trained(model, rank=4, layer0_rank=2, seed=2):
    """Slot 1: experts, router and q_proj at `rank` (layer 0's experts at `layer0_rank`),
    every B random (a "trained" slot)."""
    init_lora_slot(model, 1, rank, seed=1, target_modules=["experts", "gate", "q_proj"])
    rng = np.random.default_rng(seed)
    for name, layer in trainable_layers(model).items():
        if hasattr(layer, "fused_w13"):
            a_list, b_list = layer.read_lora(1)  # [E, r, in], [E, out, r]
            cut = layer0_rank if name.startswith("model.layers.0.") else rank
            layer.set_lora(
                1,
                [a[:, :cut] for a in a_list],
                [rng.normal(size=b[..., :cut].shape) * 0.2 for b in b_list],
            )
            continue
        if not is_linear(layer):  # the untargeted embedding / lm_head
            continue
        for s, v in enumerate(layer.lora_b):
            r = int(np.asarray(layer.slot_ranks[...])[s, 1])
            val = np.asarray(v[...]).copy()  # [L, out, R]
            val[1, :, :r] = rng.normal(size=(val.shape[1], r)) * 0.1
            v.set_value(jax.device_put(jnp.asarray(val), v[...].sharding))
    return model


def _batch():
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 8)), jnp.int32)
    return ids, jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), ids.shape)


@nnx.jit
def _logits(model, ids, pos, slots):
    with lj.lora_mapping(model, slots):
        return model(ids, pos)[0]


def _slot_logits(model, slot):
    ids, pos = _batch()
    return np.asarray(_logits(model, ids, pos, jnp.full(ids.size, slot, jnp.int32)))


def _serve(model, path, slot=0, **kw):
    """The adapter at ``path`` loaded into ``slot`` of ``model`` (cleared first)."""
    adapter = load_peft_adapter(
        path, model, lj.LoRAConfig(max_loras=3, max_lora_rank=MAX_RANK), **kw
    )
    for layer in trainable_layers(model).values():
        layer.reset_lora(slot)
    for name, m in adapter.modules.items():
        trainable_layers(model)[name].set_lora(slot, *m.set_lora_args())
    return adapter


def _gate_up_down(layer, slot):
    """The slot's (gate, up, down) expert LoRAs, each (A [E, r, in], B [E, out, r])."""
    a_list, b_list = layer.read_lora(slot)
    by = dict(zip(layer.projections, zip(a_list, b_list)))
    if "w13" in by:
        a13, b13 = by["w13"]
        gate, up = layer.base_layer.split_w13(b13, axis=1)
        return (a13, gate), (a13, up), by["w2"]
    return by["w1"], by["w3"], by["w2"]


CASES = [("mixtral", False), ("mixtral", True), ("qwen3_moe", False), ("qwen3_moe", True)]


@pytest.mark.parametrize("family,separate", CASES, ids=str)
def test_per_expert_files_are_transformers4_s_modules(tmp_path, family, separate):
    """Per expert and projection one `lora_A [r, in]` / `lora_B [out, r]` pair, named as
    transformers 4 names the model's modules, equal to the slot's stacks (a fused w13:
    the shared A with each half of B); `target_modules` names them (and no dense MLP of
    the same leaf), no `target_parameters`; rank 2 experts in `rank_pattern`."""
    _, block, members = FAMILIES[family]
    model = _trained(_model(family, separate))
    out = save_peft_adapter(model, 1, tmp_path / "a", expert_layout="per_expert")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    tensors = read_safetensors(os.path.join(out, "adapter_model.safetensors"))
    assert cfg["target_parameters"] is None and not any(".experts.gate_up" in k for k in tensors)
    assert cfg["r"] == cfg["lora_alpha"] == 4
    written = {k.rsplit(".lora_", 1)[0][len(PREFIX) :] for k in tensors}
    for name, layer in _moe_layers(model).items():
        layer_i = name.split(".")[2]
        stacks = _gate_up_down(layer, 1)
        for j in range(E):
            for member, (a, b), (n_in, n_out) in zip(members, stacks, ((H, N), (H, N), (N, H))):
                key = f"{PREFIX}model.layers.{layer_i}.{block}.experts.{j}.{member}"
                r = 2 if layer_i == "0" else 4
                assert tensors[key + ".lora_A.weight"].shape == (r, n_in)
                assert tensors[key + ".lora_B.weight"].shape == (n_out, r)
                np.testing.assert_array_equal(tensors[key + ".lora_A.weight"], a[j])
                np.testing.assert_array_equal(tensors[key + ".lora_B.weight"], b[j])
        assert f"model.layers.{layer_i}.{block}.gate" in written  # the router's block too
    for member in members:  # every rank-2 expert, one key a projection
        key = rf"model\.layers\.0\.{block}\.experts\.\d+\.{member}"
        assert cfg["rank_pattern"][key] == cfg["alpha_pattern"][key] == 2
    targets = cfg["target_modules"]
    if family == "mixtral":
        assert sorted(targets) == ["gate", "q_proj", "w1", "w2", "w3"]
    else:  # gate_proj would also name layer 1's dense MLP: a regex of exactly these
        candidates = written | {"model.layers.1.mlp.gate_proj", "model.layers.1.mlp.down_proj"}
        assert {n for n in candidates if re.fullmatch(targets, n)} == written


@pytest.mark.parametrize("family,separate", CASES, ids=str)
def test_per_expert_export_loads_back_to_the_slot_s_logits(tmp_path, family, separate):
    """Loaded back, in slot 0 of the same model and of one with the experts wrapped the
    other way (w1 / w3 apart vs one w13), the file gives the slot's logits."""
    model = _trained(_model(family, separate))
    want = _slot_logits(model, 1)
    assert np.abs(want - _slot_logits(model, -1)).max() > 1e-2  # the slot is not the base
    save_peft_adapter(model, 1, tmp_path / "a", expert_layout="per_expert")
    adapter = _serve(model, tmp_path / "a")
    r = adapter.modules["model.layers.0.mlp.experts"].rank  # rank 2 experts
    assert r == (2 if separate else 4)  # gate and up fuse again at r1 + r3
    np.testing.assert_allclose(_slot_logits(model, 0), want, rtol=1e-5, atol=1e-5)
    other = _model(family, not separate)  # same base weights (same seed)
    _serve(other, tmp_path / "a")
    np.testing.assert_allclose(_slot_logits(other, 0), want, rtol=1e-5, atol=1e-5)


def test_per_expert_export_on_a_mesh(tmp_path):
    """Experts sharded over the tensor axis are written as on one device."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    rules = lj.ShardingRules(jax.make_mesh((1, 2), ("dp", "tp")))
    model = _trained(_model("mixtral", rules=rules))
    want = _slot_logits(model, 1)
    save_peft_adapter(model, 1, tmp_path / "m", expert_layout="per_expert")
    single = _trained(_model("mixtral"))
    save_peft_adapter(single, 1, tmp_path / "s", expert_layout="per_expert")
    sharded = read_safetensors(tmp_path / "m" / "adapter_model.safetensors")
    plain = read_safetensors(tmp_path / "s" / "adapter_model.safetensors")
    assert sharded.keys() == plain.keys()
    for k in plain:
        np.testing.assert_allclose(sharded[k], plain[k], rtol=1e-6, atol=1e-7)
    _serve(model, tmp_path / "m")
    np.testing.assert_allclose(_slot_logits(model, 0), want, rtol=1e-5, atol=1e-5)


def test_a_fused_w13_slot_at_max_rank_needs_w1_w3_apart_to_load_back(tmp_path):
    """A fused w13 LoRA at max_lora_rank r is written as gate and up LoRAs of rank r each:
    read back into `FusedMoE3DWithLoRA` they fuse at 2r, past max_lora_rank (refused,
    naming it); experts wrapped w1 / w3 apart take them and give the slot's logits."""
    model = _trained(_model("mixtral"), rank=MAX_RANK, layer0_rank=MAX_RANK)
    want = _slot_logits(model, 1)
    save_peft_adapter(model, 1, tmp_path / "a", expert_layout="per_expert")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["r"] == MAX_RANK and cfg["rank_pattern"] == {}
    with pytest.raises(ValueError, match=r"rank 16 on FusedMoE3DWithLoRA.*max_lora_rank=8"):
        _serve(model, tmp_path / "a")
    other = _model("mixtral", separate=True)
    _serve(other, tmp_path / "a")
    np.testing.assert_allclose(_slot_logits(other, 0), want, rtol=1e-5, atol=1e-5)


def test_an_adapter_read_into_a_fused_w13_slot_is_written_back_unchanged(tmp_path):
    """Per-expert gate / up LoRAs fuse in `FusedMoE3DWithLoRA` at rank r1 + r3 (A stacked,
    B block-diagonal); written per expert again, each half keeps only its own rank
    columns, and a member the adapter lacked (no up_proj) stays out: the same file."""
    model = _model("qwen3_moe", separate=True)
    _trained(model)
    for layer in _moe_layers(model).values():  # no up_proj LoRA in the adapter
        (a1, a2, _), (b1, b2, _) = layer.read_lora(1)
        layer.set_lora(1, [a1, a2, None], [b1, b2, None])
    save_peft_adapter(model, 1, tmp_path / "a", expert_layout="per_expert")
    first = read_safetensors(tmp_path / "a" / "adapter_model.safetensors")
    assert not any("up_proj" in k for k in first)
    fused = _model("qwen3_moe")
    _serve(fused, tmp_path / "a", slot=1)
    save_peft_adapter(fused, 1, tmp_path / "b", expert_layout="per_expert")
    second = read_safetensors(tmp_path / "b" / "adapter_model.safetensors")
    assert second.keys() == first.keys()
    for k in first:
        np.testing.assert_allclose(second[k], first[k], rtol=1e-6)
    for name in ("a", "b"):
        cfg = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert cfg["rank_pattern"] == {
            r"model\.layers\.0\.mlp\.experts\.\d+\.gate_proj": 2,
            r"model\.layers\.0\.mlp\.experts\.\d+\.down_proj": 2,
        }


def test_a_fresh_fused_w13_slot_writes_peft_s_init_for_gate_and_up(tmp_path):
    """A just-initialised slot (B zero) writes gate and up with the shared A and zero B,
    PEFT's init, to train on; it serves the base."""
    model = _model("mixtral")
    init_lora_slot(model, 1, 4, seed=1, target_modules=["experts"])
    save_peft_adapter(model, 1, tmp_path / "a", expert_layout="per_expert")
    tensors = read_safetensors(tmp_path / "a" / "adapter_model.safetensors")
    key = f"{PREFIX}model.layers.0.block_sparse_moe.experts.1."
    np.testing.assert_array_equal(
        tensors[key + "w1.lora_A.weight"], tensors[key + "w3.lora_A.weight"]
    )
    assert tensors[key + "w1.lora_A.weight"].shape == (4, H)
    assert not any(v.any() for k, v in tensors.items() if ".lora_B." in k)
    _serve(model, tmp_path / "a")
    # exact on a CPU; a GPU's XLA fuses the base matmuls otherwise beside the LoRA ops
    exact = dict(rtol=0, atol=0 if jax.default_backend() == "cpu" else 1e-6)
    np.testing.assert_allclose(_slot_logits(model, 0), _slot_logits(model, -1), **exact)


def test_per_expert_names_go_through_name_map(tmp_path):
    """``name_map`` is given the model's names (`<experts>.{j}.<member>`); the loader's
    inverse map reads the file back to the slot's logits."""
    model = _trained(_model("mixtral", separate=True))
    want = _slot_logits(model, 1)
    save_peft_adapter(
        model, 1, tmp_path / "a", expert_layout="per_expert", name_map=lambda n: "net." + n
    )
    tensors = read_safetensors(tmp_path / "a" / "adapter_model.safetensors")
    assert f"{PREFIX}net.model.layers.1.mlp.experts.3.w2.lora_A.weight" in tensors
    _serve(model, tmp_path / "a", name_map=lambda n: n.removeprefix("net."))
    np.testing.assert_allclose(_slot_logits(model, 0), want, rtol=1e-5, atol=1e-5)


def test_expert_layout_is_checked_and_the_default_is_fused(tmp_path):
    """A bad layout is refused naming the option and the allowed values, writing
    nothing; the default writes what "fused" writes (`target_parameters`)."""
    model = _trained(_model("mixtral"))
    for bad in ("per-expert", None, ["fused"]):
        with pytest.raises(
            ValueError, match=r"expert_layout must be one of \['fused', 'per_expert'\]"
        ):
            save_peft_adapter(model, 1, tmp_path / "bad", expert_layout=bad)
    assert not (tmp_path / "bad").exists()
    save_peft_adapter(model, 1, tmp_path / "default")
    save_peft_adapter(model, 1, tmp_path / "fused", expert_layout="fused")
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "default" / f).read_bytes() == (tmp_path / "fused" / f).read_bytes()
    cfg = json.loads((tmp_path / "default" / "adapter_config.json").read_text())
    assert "model.layers.0.mlp.experts.gate_up_proj" in cfg["target_parameters"]
