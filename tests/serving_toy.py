"""A tiny HF-named NNX model of lora_jax linears, and PEFT-style adapter tensors for it.

Shared by the serving tests (wrap, manager, PEFT); builds in well under a second.
Module names mirror a Llama layer: `model.layers.{i}.self_attn.{qkv_proj,o_proj}`,
`model.layers.{i}.mlp.{gate_up_proj,down_proj}`, plus a replicated `model.proj`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from lora_jax.sharding import ShardingRules

D, HEADS, KV, HD, FF = 32, 4, 2, 8, 48
Q_OUT, KV_OUT = HEADS * HD, KV * HD
# HF module leaf → (in, out)
SHAPES = {
    "q_proj": (D, Q_OUT),
    "k_proj": (D, KV_OUT),
    "v_proj": (D, KV_OUT),
    "o_proj": (Q_OUT, D),
    "gate_proj": (D, FF),
    "up_proj": (D, FF),
    "down_proj": (FF, D),
}
PARENT = {m: "self_attn" for m in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
    m: "mlp" for m in ("gate_proj", "up_proj", "down_proj")
}


def _base(layer):
    return getattr(layer, "base_layer", layer)


class Attn(nnx.Module):
    def __init__(self, rules, rngs):
        kw = dict(rules=rules, rngs=rngs)
        self.qkv_proj = QKVParallelLinear(D, HD, HEADS, KV, **kw)
        self.o_proj = RowParallelLinear(Q_OUT, D, **kw)


class Mlp(nnx.Module):
    def __init__(self, rules, rngs):
        kw = dict(rules=rules, rngs=rngs)
        self.gate_up_proj = MergedColumnParallelLinear(D, [FF, FF], **kw)
        self.down_proj = RowParallelLinear(FF, D, **kw)


class Layer(nnx.Module):
    def __init__(self, rules, rngs):
        self.self_attn = Attn(rules, rngs)
        self.mlp = Mlp(rules, rngs)

    def __call__(self, x):
        a = self.self_attn
        q, k, v = _base(a.qkv_proj).split_output(a.qkv_proj(x))
        h = x + a.o_proj(q * 0.5 + jnp.concatenate([k, v], axis=-1))
        m = self.mlp
        g, u = _base(m.gate_up_proj).split_output(m.gate_up_proj(h))
        return h + m.down_proj(jax.nn.silu(g) * u)


class Inner(nnx.Module):
    def __init__(self, n_layers, rules, rngs):
        self.layers = nnx.List([Layer(rules, rngs) for _ in range(n_layers)])
        self.proj = ReplicatedLinear(D, D, rules=rules, rngs=rngs)


class ToyLM(nnx.Module):
    """`x f32[T, D] -> f32[T, D]`; only the module names matter for the tests."""

    def __init__(self, n_layers: int = 2, *, rules: ShardingRules | None = None, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.model = Inner(n_layers, rules or ShardingRules(), rngs)

    def __call__(self, x):
        for layer in self.model.layers:
            x = layer(x)
        return self.model.proj(x)


def peft_tensors(
    modules, rank: int, *, n_layers: int = 2, seed: int = 0, ranks=None
) -> dict[str, np.ndarray]:
    """PEFT-keyed random `lora_A [r, in]` / `lora_B [out, r]` for HF leaf names `modules`."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n_layers):
        for m in modules:
            r = (ranks or {}).get(m, rank)
            n_in, n_out = SHAPES[m]
            key = f"base_model.model.model.layers.{i}.{PARENT[m]}.{m}"
            out[f"{key}.lora_A.weight"] = rng.normal(size=(r, n_in)).astype(np.float32) / 4
            out[f"{key}.lora_B.weight"] = rng.normal(size=(n_out, r)).astype(np.float32) / 4
    return out


def tiny_mixtral(**rules_kw):
    """A one-layer Mixtral-shaped `MoEDecoderForCausalLM` (4 experts of width 16, hidden
    32, vocab 64) with random weights."""
    from lora_jax.models.moe_decoder import MoEConfig, MoEDecoderForCausalLM

    base, moe = MoEConfig.from_hf(
        dict(
            model_type="mixtral", vocab_size=64, hidden_size=32, intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            num_local_experts=4, num_experts_per_tok=2,
        )
    )  # fmt: skip
    return MoEDecoderForCausalLM(base, moe, rngs=nnx.Rngs(0), **rules_kw)
