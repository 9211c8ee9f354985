"""`MergedReplicatedLinearWithLoRA` (vLLM's, for DeepSeek's replicated `fused_qkv_a_proj` =
`q_a_proj` | `kv_a_proj_with_mqa`) through the serving stack: `wrap_model` with a packed
mapping, a PEFT adapter of the two checkpoint modules against a numpy oracle, merging, and
saving the slot back as the two modules. The layer itself runs the layer grid
(tests/layer_cases.py: every mesh, dtypes, the kernels, the compiled HLO)."""

import json

import jax.numpy as jnp
import numpy as np
from flax import nnx

import lora_jax as lj
from lora_jax.serving.export import save_peft_adapter
from lora_jax.serving.manager import LRUCacheLoRAModelManager
from lora_jax.serving.merge import merge_adapter, unmerge_adapter
from lora_jax.serving.peft import PEFTConfig, adapter_from_tensors, load_peft_adapter
from lora_jax.serving.wrap import wrap_model

D, Q_A, KV_A = 32, 16, 24
PACKED = {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}
CFG = lj.LoRAConfig(max_loras=2, max_lora_rank=8)


class _Attn(nnx.Module):
    def __init__(self, rngs):
        self.fused_qkv_a_proj = lj.MergedReplicatedLinear(D, [Q_A, KV_A], rngs=rngs)


class _Model(nnx.Module):
    def __init__(self):
        self.attn = _Attn(nnx.Rngs(0))

    def __call__(self, x):
        return self.attn.fused_qkv_a_proj(x)


def _tensors(seed):
    rng = np.random.default_rng(seed)
    out = {}
    for name, n_out, r in (("q_a_proj", Q_A, 8), ("kv_a_proj_with_mqa", KV_A, 4)):
        key = f"base_model.model.attn.{name}"
        out[f"{key}.lora_A.weight"] = rng.normal(size=(r, D)).astype(np.float32)
        out[f"{key}.lora_B.weight"] = rng.normal(size=(n_out, r)).astype(np.float32)
    return out


@nnx.jit
def _forward(model, x, slots):
    with lj.lora_mapping(model, slots):
        return model(x)


def test_a_peft_adapter_of_the_two_modules_serves_merges_and_saves(tmp_path):
    model = _Model()
    wrap_model(model, CFG, packed_modules_mapping=PACKED)
    layer = model.attn.fused_qkv_a_proj
    assert type(layer) is lj.MergedReplicatedLinearWithLoRA
    tensors = _tensors(0)
    cfg = PEFTConfig(
        r=8,
        lora_alpha=16,
        target_modules=("q_a_proj", "kv_a_proj_with_mqa"),
        rank_pattern=(("kv_a_proj_with_mqa", 4),),
    )
    mgr = LRUCacheLoRAModelManager(model, CFG)
    mgr.add_adapter(adapter_from_tensors(tensors, cfg, model, CFG, adapter_id=1))
    mgr.activate_adapter(1)
    x = np.random.default_rng(1).normal(size=(6, D)).astype(np.float32)
    slots = mgr.token_mapping([1, None, 1, 1, None, 1])
    got = np.asarray(_forward(model, jnp.asarray(x), jnp.asarray(slots)))
    # the oracle: the base kernel, and per member x @ A.T @ B.T * alpha / r on its columns
    kernel = np.asarray(layer.base_layer.kernel[...], np.float64)
    want = x @ kernel
    for name, lo, hi, r in (("q_a_proj", 0, Q_A, 8), ("kv_a_proj_with_mqa", Q_A, Q_A + KV_A, 4)):
        a = tensors[f"base_model.model.attn.{name}.lora_A.weight"].astype(np.float64)
        b = tensors[f"base_model.model.attn.{name}.lora_B.weight"].astype(np.float64)
        delta = x @ a.T @ b.T * (16 / r)
        want[:, lo:hi] += np.where(slots[:, None] >= 0, delta, 0.0)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    assert np.abs(got - x @ kernel).max() > 1e-2  # the adapter acts
    # merged into the kernel: the base path alone gives the adapter's rows
    merge_adapter(model, mgr.slot_of(1))
    none = jnp.full((6,), -1, jnp.int32)
    merged = np.asarray(_forward(model, jnp.asarray(x), none))
    rows = slots >= 0
    np.testing.assert_allclose(merged[rows], want[rows], rtol=2e-4, atol=2e-4 * np.abs(want).max())
    unmerge_adapter(model)
    # saved back as PEFT's two modules, each its own rank; loaded again, the same factors
    path = save_peft_adapter(model, mgr.slot_of(1), tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["kv_a_proj_with_mqa", "q_a_proj"]
    back = load_peft_adapter(path, model, CFG, adapter_id=2)
    held = mgr.list_adapters()[1].modules["attn.fused_qkv_a_proj"]
    for x_, y_ in zip(held.lora_a + held.lora_b, back.modules["attn.fused_qkv_a_proj"].lora_a +
                      back.modules["attn.fused_qkv_a_proj"].lora_b):  # fmt: skip
        np.testing.assert_allclose(y_, x_, rtol=1e-6, atol=1e-6)
