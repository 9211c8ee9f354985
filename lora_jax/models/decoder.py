"""Llama / Qwen2 / Qwen3 / Mistral decoder in NNX, built on lora_jax's parallel linears.

Module paths mirror HF names so PEFT `target_modules` resolve against them:

    model.model.embed_tokens                       VocabParallelEmbedding
    model.model.layers[i].input_layernorm          RMSNorm
    model.model.layers[i].self_attn.qkv_proj       QKVParallelLinear (q|k|v packed)
    model.model.layers[i].self_attn.q_norm/k_norm  RMSNorm over head_dim (Qwen3)
    model.model.layers[i].self_attn.o_proj         RowParallelLinear
    model.model.layers[i].post_attention_layernorm RMSNorm
    model.model.layers[i].mlp.gate_up_proj         MergedColumnParallelLinear (gate|up)
    model.model.layers[i].mlp.down_proj            RowParallelLinear
    model.model.norm                               RMSNorm
    model.lm_head                                  ParallelLMHead (None when tied)

The residual stream is kept flat, `[T = B*S, D]` in row-major token order — the order of
the LoRA token mapping. Per-head work (split of the packed qkv, q/k norm, RoPE, cache
write, attention) and the gated MLP activation run per shard in `shard_map`, so packed
outputs are only ever sliced locally and the model runs on Explicit and Auto meshes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.linear import MergedColumnParallelLinear, RowParallelLinear
from lora_jax.models.attention import Attention, RMSNorm, run_per_shard
from lora_jax.models.config import DecoderConfig
from lora_jax.models.kv_cache import KVCache
from lora_jax.sharding import ShardingRules
from lora_jax.vocab import ParallelLMHead, VocabParallelEmbedding


class MLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))` with gate|up packed in one column layer."""

    def __init__(
        self, config: DecoderConfig, *, rules: ShardingRules, dtype, param_dtype, rngs: nnx.Rngs
    ):
        c = config
        self.rules, self.intermediate_size = rules, c.intermediate_size
        kw = dict(dtype=dtype, param_dtype=param_dtype, rules=rules, rngs=rngs, use_bias=c.mlp_bias)
        self.gate_up_proj = MergedColumnParallelLinear(
            c.hidden_size, [c.intermediate_size] * 2, **kw
        )
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        rules = self.rules
        n_l = self.intermediate_size // rules.size("tensor")
        y = self.gate_up_proj(x)  # [T, 2*I], shard i holds [gate_i | up_i]

        def act(y):
            return jax.nn.silu(y[:, :n_l]) * y[:, n_l:]

        t = "batch" if y.shape[0] % rules.size("batch") == 0 else None
        h = run_per_shard(rules, act, dict(y=y), dict(y=(t, "tensor")), (t, "tensor"))
        return self.down_proj(h)


class DecoderLayer(nnx.Module):
    """Pre-norm block: `h = x + attn(norm(x)); out = h + mlp(norm(h))`."""

    def __init__(
        self,
        config: DecoderConfig,
        layer_idx: int,
        *,
        rules: ShardingRules,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
    ):
        c = config
        norm_kw = dict(dtype=dtype, param_dtype=param_dtype, rules=rules)
        kw = dict(rules=rules, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **norm_kw)
        self.self_attn = Attention(c, layer_idx, **kw)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **norm_kw)
        self.mlp = MLP(c, **kw)

    def __call__(self, x, positions, cache_kv=None, attention_mask=None):
        a, cache_kv = self.self_attn(self.input_layernorm(x), positions, cache_kv, attention_mask)
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h)), cache_kv


class DecoderModel(nnx.Module):
    """Embedding, decoder layers, final norm: `(ids, positions, cache) → (hidden, cache)`."""

    def __init__(
        self, config: DecoderConfig, *, rules: ShardingRules, dtype, param_dtype, rngs: nnx.Rngs
    ):
        c = config
        self.config, self.rules, self.dtype = c, rules, dtype
        self.embed_tokens = VocabParallelEmbedding(
            c.vocab_size,
            c.hidden_size,
            dtype=dtype,
            param_dtype=param_dtype,
            rules=rules,
            rngs=rngs,
        )
        kw = dict(rules=rules, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(c, i, **kw) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(
            c.hidden_size, c.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, rules=rules
        )

    def __call__(
        self,
        input_ids,
        positions,
        cache: KVCache | None = None,
        *,
        attention_mask=None,
        flat: bool = False,
    ):
        """`input_ids, positions i32[B, S]` → `(hidden [B, S, D] (or [B*S, D] if flat),
        new cache | None)`. `attention_mask [B, S]`: 0 marks pad tokens (never attended,
        never written to the cache).

        With a cache, every real (unmasked) token's position must be `< cache.max_len`: a
        ValueError when S exceeds it, or when concrete positions reach it. Traced positions
        (inside `jax.jit`) cannot be checked, so jitted callers must size the cache for
        the last position they write (`generate` makes it prompt + new tokens long); a
        position past the end would drop its key and value silently (wrong logits).
        """
        if input_ids.shape != positions.shape or input_ids.ndim != 2:
            raise ValueError(
                f"input_ids {input_ids.shape} and positions {positions.shape} must both be [B, S]"
            )
        if cache is not None and len(cache.k) != len(self.layers):
            raise ValueError(f"cache has {len(cache.k)} layers, model has {len(self.layers)}")
        if cache is not None:
            _check_cache_room(positions, attention_mask, cache.max_len)
        B, S = input_ids.shape
        rules = self.rules
        tok = "batch" if B % rules.size("batch") == 0 else None
        h = self.embed_tokens(input_ids.reshape(B * S))  # [T, D]
        h = rules.constrain(h, tok, None)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            h, kv = layer(h, positions, kv, attention_mask)
            if kv is not None:
                ks.append(kv[0])
                vs.append(kv[1])
        h = self.norm(h)
        new_cache = None if cache is None else KVCache(k=tuple(ks), v=tuple(vs))
        return (h if flat else h.reshape(B, S, -1)), new_cache


def _check_cache_room(positions, attention_mask, max_len: int) -> None:
    """A ValueError unless every real token's position fits a cache of `max_len` slots:
    the cache write drops out-of-range slots (meant for pad tokens), so an overflowing
    position would lose its key and value without an error."""
    S = positions.shape[1]
    if S > max_len:
        raise ValueError(
            f"sequence length S={S} exceeds cache.max_len={max_len}; the cache holds "
            f"positions 0..{max_len - 1} (make a longer KVCache)"
        )
    arrays = [a for a in (positions, attention_mask) if a is not None]
    if any(isinstance(a, jax.core.Tracer) for a in arrays):
        return  # traced: the caller sizes the cache (see DecoderModel.__call__)
    if not all(getattr(a, "is_fully_addressable", True) for a in arrays):
        return  # multi-process arrays: no host holds them all
    pos = np.asarray(positions)
    if attention_mask is not None:
        pos = pos[np.asarray(attention_mask).astype(bool)]  # pad tokens are never written
    if pos.size and int(pos.max()) >= max_len:
        raise ValueError(
            f"position {int(pos.max())} does not fit cache.max_len={max_len}; positions "
            f"must be < max_len (make a longer KVCache)"
        )


class DecoderForCausalLM(nnx.Module):
    """Causal LM: `DecoderModel` + lm_head (or the tied embedding).

    Example:
        >>> model = DecoderForCausalLM(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
        >>> ids = jnp.zeros((2, 5), jnp.int32)
        >>> pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
        >>> logits, _ = model(ids, pos)
        >>> logits.shape
        (2, 5, 256)
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        rules: ShardingRules | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        rules = rules if rules is not None else ShardingRules()
        self.config, self.rules, self.dtype = config, rules, dtype
        self.model = DecoderModel(
            config, rules=rules, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                dtype=dtype,
                param_dtype=param_dtype,
                rules=rules,
                rngs=rngs,
            )

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """`hidden [..., D]` → `f32[..., V]`, replicated over the mesh."""
        if self.lm_head is None:
            emb = self.model.embed_tokens
            logits = emb.attend(hidden, gather=True)[..., : self.config.vocab_size]
        else:
            logits = self.lm_head(hidden)
        return logits.astype(jnp.float32)

    def __call__(self, input_ids, positions, cache: KVCache | None = None, *, attention_mask=None):
        """`(input_ids, positions i32[B, S], cache)` → `(logits f32[B, S, V], new cache)`."""
        hidden, cache = self.model(
            input_ids, positions, cache, attention_mask=attention_mask, flat=True
        )
        B, S = input_ids.shape
        return self.compute_logits(hidden).reshape(B, S, -1), cache
