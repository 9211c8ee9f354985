"""The embedded default of `lora-jax-serve`: a tiny random Llama checkpoint and three
PEFT adapters (different ranks, alphas and targets; one rsLoRA, one with a rank pattern),
written as files, so that a run with no arguments goes through the paths a real one uses."""

from __future__ import annotations

import json
import os

import numpy as np

# The embedded default model (Llama layout, byte vocabulary).
DEFAULT_MODEL = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_ADAPTERS = {
    "sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "chat": dict(
        r=4, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]
    ),
    "poet": dict(r=16, lora_alpha=32, target_modules=ALL_MODULES, rank_pattern={"down_proj": 4}),
}


def _hf_module_shapes(c: dict) -> dict[str, tuple[int, int]]:
    D, hd = c["hidden_size"], c["head_dim"]
    q, kv, ff = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["intermediate_size"]
    return {
        "q_proj": (D, q),
        "k_proj": (D, kv),
        "v_proj": (D, kv),
        "o_proj": (q, D),
        "gate_proj": (D, ff),
        "up_proj": (D, ff),
        "down_proj": (ff, D),
    }


def _parent(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def write_default_model(directory: str, seed: int = 0) -> str:
    """Writes a tiny random Llama checkpoint (`config.json` + `model.safetensors`)."""
    from lora_jax.serving.peft import write_safetensors

    c = DEFAULT_MODEL
    rng = np.random.default_rng(seed)
    normal = lambda *shape, std=1.0: (rng.normal(size=shape) * std).astype(np.float32)  # noqa: E731
    D, V = c["hidden_size"], c["vocab_size"]
    w = {"model.embed_tokens.weight": normal(V, D), "model.norm.weight": 1 + normal(D, std=0.1)}
    w["lm_head.weight"] = normal(V, D, std=D**-0.5)
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        w[f"{pre}.input_layernorm.weight"] = 1 + normal(D, std=0.1)
        w[f"{pre}.post_attention_layernorm.weight"] = 1 + normal(D, std=0.1)
        for m, (n_in, n_out) in _hf_module_shapes(c).items():
            w[f"{pre}.{_parent(m)}.{m}.weight"] = normal(n_out, n_in, std=n_in**-0.5)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    write_safetensors(os.path.join(directory, "model.safetensors"), w)
    return directory


def write_default_adapter(directory: str, spec: dict, seed: int) -> str:
    """Writes a random PEFT LoRA adapter for the default model (A and B non-zero)."""
    from lora_jax.serving.peft import PEFTConfig, write_safetensors

    c = DEFAULT_MODEL
    rng = np.random.default_rng(seed)
    peft_cfg = PEFTConfig.from_dict(spec)
    tensors = {}
    for i in range(c["num_hidden_layers"]):
        for m in spec["target_modules"]:
            name = f"model.layers.{i}.{_parent(m)}.{m}"
            n_in, n_out = _hf_module_shapes(c)[m]
            r = peft_cfg.rank_for(name)
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = (rng.normal(size=(r, n_in)) / n_in**0.5).astype(
                np.float32
            )
            tensors[f"{key}.lora_B.weight"] = (rng.normal(size=(n_out, r)) * 2 / r).astype(
                np.float32
            )
    os.makedirs(directory, exist_ok=True)
    config = {"peft_type": "LORA", "bias": "none", "lora_dropout": 0.0, **spec}
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    write_safetensors(os.path.join(directory, "adapter_model.safetensors"), tensors)
    return directory


def write_default(directory: str, seed: int = 0) -> tuple[str, dict[str, str]]:
    """The embedded default: `(model dir, {adapter name: adapter dir})`."""
    model_dir = write_default_model(os.path.join(directory, "model"), seed)
    adapters = {
        name: write_default_adapter(os.path.join(directory, name), spec, seed + 1 + i)
        for i, (name, spec) in enumerate(DEFAULT_ADAPTERS.items())
    }
    return model_dir, adapters
