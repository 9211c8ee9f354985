"""Mixtral / Qwen3-MoE decoders: the dense decoder's attention with a `FusedMoE` MLP.

Module paths follow transformers 5's runtime names (which PEFT's `target_parameters`
use), for both families:

    model.model.layers[i].self_attn.*          as in `lora_jax.models.decoder`
    model.model.layers[i].mlp.gate             GateLinear hidden → num_experts (router)
    model.model.layers[i].mlp.experts          FusedMoE (w13 = [gate | up], w2 = down)
    model.model.layers[i].mlp.gate_up_proj ... a dense MLP on Qwen3-MoE `mlp_only_layers`

Checkpoints are read with either expert naming: per expert (what `save_pretrained`
writes; Mixtral `block_sparse_moe.experts.{j}.w1/w2/w3`, router `block_sparse_moe.gate`;
Qwen3-MoE `mlp.experts.{j}.gate_proj/up_proj/down_proj`, router `mlp.gate`) or fused
(`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.gate_linear import GateLinear
from lora_jax.models.config import DecoderConfig
from lora_jax.models.decoder import (
    MLP,
    Attention,
    DecoderForCausalLM,
    DecoderModel,
    RMSNorm,
)
from lora_jax.models.loading import (
    SafetensorsCheckpoint,
    hf_linear,
    load_dense_mlp,
    load_hf_weights,
    read_config_json,
)
from lora_jax.moe import FusedMoE
from lora_jax.sharding import ShardingRules
from lora_jax.vocab import ParallelLMHead, VocabParallelEmbedding

MOE_MODEL_TYPES = {"mixtral": "mistral", "qwen3_moe": "qwen3"}  # → attention family


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The MoE part of a Mixtral / Qwen3-MoE config.

    Example:
        >>> MoEConfig(model_type="mixtral", num_experts=8, top_k=2, moe_intermediate_size=64).top_k
        2
    """

    model_type: str
    """"mixtral" or "qwen3_moe" (checkpoint names)."""
    num_experts: int
    """Routed experts E (`num_local_experts` / `num_experts`)."""
    top_k: int
    """Experts per token (`num_experts_per_tok`)."""
    moe_intermediate_size: int
    """Per-expert MLP width (Mixtral: `intermediate_size`)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights (always on for Mixtral)."""
    decoder_sparse_step: int = 1
    """Qwen3-MoE: layer i is sparse when `(i + 1) % step == 0`."""
    mlp_only_layers: tuple[int, ...] = ()
    """Qwen3-MoE: layers with a dense MLP instead."""

    def __post_init__(self):
        if self.model_type not in MOE_MODEL_TYPES:
            raise ValueError(
                f"MoEConfig.model_type={self.model_type!r} is not supported; allowed: "
                f"{tuple(MOE_MODEL_TYPES)}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoEConfig: top_k={self.top_k} outside [1, {self.num_experts}]")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

    def is_sparse(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> tuple[DecoderConfig, MoEConfig]:
        """`(attention/decoder config, MoE config)` from an HF `config.json` dict."""
        mt = hf.get("model_type")
        if mt not in MOE_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type={mt!r} is not an MoE model this module reads; "
                f"allowed: {tuple(MOE_MODEL_TYPES)}"
            )
        if hf.get("shared_expert_intermediate_size"):
            raise ValueError(f"config.json ({mt}): shared experts are not supported")
        experts = (
            ("num_local_experts",) if mt == "mixtral" else ("num_experts", "num_local_experts")
        )
        need = [("num_experts_per_tok",), experts]
        need.append(("intermediate_size",) if mt == "mixtral" else ("moe_intermediate_size",))
        missing = [" or ".join(k) for k in need if all(hf.get(x) is None for x in k)]
        if missing:
            raise ValueError(f"config.json ({mt}) lacks required MoE fields {missing}")
        # Fields the file leaves out take the MoE type's transformers defaults, then the
        # file's values: MixtralConfig has no window (Mistral's default is 4096), rope_theta
        # 1e6 and rms_norm_eps 1e-5; Qwen3MoeConfig has 4 kv heads and no head_dim field
        # (D // H, where dense Qwen3's is 128). None: derived as for an explicit null.
        defaults, overrides = {}, {}
        if mt == "mixtral":
            defaults = {
                "sliding_window": None,
                "rope_theta": 1e6,
                "rms_norm_eps": 1e-5,
                "num_key_value_heads": 8,
                "head_dim": None,
            }
            # transformers' Mixtral windows every layer with sliding_window and ignores
            # layer_types (AutoConfig reads only a *mistral* file with them as Ministral)
            overrides = {"layer_types": None}
        else:
            defaults = {"num_key_value_heads": 4, "head_dim": None}
            # transformers 5's Qwen3-MoE puts the window (when use_sliding_window) on every
            # layer: it has no max_window_layers / layer_types, unlike dense Qwen3
            overrides = {"layer_types": None, "max_window_layers": 0}
        base = DecoderConfig.from_hf(
            {**defaults, **hf, **overrides, "model_type": MOE_MODEL_TYPES[mt]}
        )
        if mt == "mixtral":
            moe = cls(
                model_type=mt,
                num_experts=int(hf["num_local_experts"]),
                top_k=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["intermediate_size"]),
            )
        else:
            moe = cls(
                model_type=mt,
                # transformers 5 writes num_local_experts; Qwen's own configs num_experts
                num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
                top_k=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            )
        return base, moe


class SparseMoeBlock(nnx.Module):
    """Router (`gate`) + routed experts: `experts(x, gate(x))`."""

    def __init__(self, config: DecoderConfig, moe: MoEConfig, *, rules, dtype, param_dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rules=rules, rngs=rngs)
        self.gate = GateLinear(config.hidden_size, moe.num_experts, **kw)
        self.experts = FusedMoE(
            moe.num_experts,
            moe.top_k,
            config.hidden_size,
            moe.moe_intermediate_size,
            renormalize=moe.norm_topk_prob,
            activation=config.hidden_act,
            **kw,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.experts(x, self.gate(x))


class MoEDecoderLayer(nnx.Module):
    """Pre-norm block with attention and a sparse (or, per config, dense) MLP."""

    def __init__(self, config, moe, layer_idx, *, rules, dtype, param_dtype, rngs):
        c = config
        norm_kw = dict(dtype=dtype, param_dtype=param_dtype, rules=rules)
        kw = dict(rules=rules, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **norm_kw)
        self.self_attn = Attention(c, layer_idx, **kw)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **norm_kw)
        self.mlp = SparseMoeBlock(c, moe, **kw) if moe.is_sparse(layer_idx) else MLP(c, **kw)

    def __call__(self, x, positions, cache_kv=None, attention_mask=None):
        a, cache_kv = self.self_attn(self.input_layernorm(x), positions, cache_kv, attention_mask)
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h)), cache_kv


class MoEDecoderModel(DecoderModel):
    """`DecoderModel` with MoE layers (same call: `(ids, positions, cache) → hidden`)."""

    def __init__(self, config, moe, *, rules, dtype, param_dtype, rngs):
        c = config
        self.config, self.moe_config, self.rules, self.dtype = c, moe, rules, dtype
        kw = dict(rules=rules, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, **kw)
        self.layers = nnx.List(
            [MoEDecoderLayer(c, moe, i, **kw) for i in range(c.num_hidden_layers)]
        )
        self.norm = RMSNorm(
            c.hidden_size, c.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, rules=rules
        )


class MoEDecoderForCausalLM(DecoderForCausalLM):
    """Mixtral / Qwen3-MoE causal LM (`DecoderForCausalLM`'s call and logits).

    Example:
        >>> cfg, moe = MoEConfig.from_hf(hf_config_dict)  # doctest: +SKIP
        >>> model = MoEDecoderForCausalLM(cfg, moe, rngs=nnx.Rngs(0))  # doctest: +SKIP
        >>> logits, _ = model(ids_bs, positions_bs)  # doctest: +SKIP
    """

    def __init__(
        self,
        config: DecoderConfig,
        moe: MoEConfig,
        *,
        rules: ShardingRules | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        rules = rules if rules is not None else ShardingRules()
        self.config, self.moe_config, self.rules, self.dtype = config, moe, rules, dtype
        kw = dict(rules=rules, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.model = MoEDecoderModel(config, moe, **kw)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else ParallelLMHead(config.vocab_size, config.hidden_size, **kw)
        )


# -- loading --------------------------------------------------------------------------------
def read_hf_moe_config(path_or_dir: str) -> tuple[str, DecoderConfig, MoEConfig]:
    """`(directory, DecoderConfig, MoEConfig)` from a checkpoint directory."""
    directory, config = read_config_json(path_or_dir)
    return (directory, *MoEConfig.from_hf(config))


def load_hf_moe_model(
    path_or_dir: str,
    *,
    rules: ShardingRules | None = None,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
) -> MoEDecoderForCausalLM:
    """Builds an `MoEDecoderForCausalLM` with the weights of an HF safetensors checkpoint.

    Example:
        >>> model = load_hf_moe_model("/ckpt/Qwen3-30B-A3B", rules=rules)  # doctest: +SKIP
    """
    directory, config, moe = read_hf_moe_config(path_or_dir)
    rules = rules if rules is not None else ShardingRules()
    ckpt = SafetensorsCheckpoint(directory)
    model = nnx.eval_shape(
        lambda: MoEDecoderForCausalLM(
            config, moe, rules=rules, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)
        )
    )
    load_hf_moe_weights(model, ckpt)
    return model


def _experts(ckpt: SafetensorsCheckpoint, prefix: str, moe: MoEConfig, H: int):
    """(w1, w3, w2) as Flax `[E, in, out]` from per-expert or fused checkpoint tensors."""
    E, n = moe.num_experts, moe.moe_intermediate_size
    fused = f"{prefix}experts.gate_up_proj"
    if fused in ckpt:
        gu = ckpt.get(fused, (E, 2 * n, H))  # torch [E, out, in], [gate; up]
        down = ckpt.get(f"{prefix}experts.down_proj", (E, H, n))
        return (
            gu[:, :n].transpose(0, 2, 1),
            gu[:, n:].transpose(0, 2, 1),
            down.transpose(0, 2, 1),
        )
    names = (
        ("w1", "w3", "w2") if moe.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    )
    shapes = ((n, H), (n, H), (H, n))
    return tuple(
        np.stack([ckpt.get(f"{prefix}experts.{j}.{nm}.weight", shp).T for j in range(E)])
        for nm, shp in zip(names, shapes)
    )


def load_hf_moe_weights(model: MoEDecoderForCausalLM, ckpt: SafetensorsCheckpoint) -> None:
    """Writes every weight of `model` from `ckpt` (HF names); checks for leftovers.

    The dense loader does the embedding, attention, norms and lm_head; sparse layers'
    router and experts come from Mixtral's `block_sparse_moe.` or Qwen3-MoE's `mlp.`.
    """
    moe = model.moe_config

    def load_mlp(mlp, m: str, c, ckpt: SafetensorsCheckpoint) -> None:
        if not isinstance(mlp, SparseMoeBlock):
            return load_dense_mlp(mlp, m, c, ckpt)
        p = m[: -len("mlp.")]
        if f"{p}block_sparse_moe.gate.weight" in ckpt:
            m = p + "block_sparse_moe."
        mlp.gate.load_kernel([hf_linear(ckpt, m + "gate.weight", moe.num_experts, c.hidden_size)])
        w1, w3, w2 = _experts(ckpt, m, moe, c.hidden_size)
        mlp.experts.load_weights(w1=w1, w3=w3, w2=w2)

    load_hf_weights(model, ckpt, load_mlp)
