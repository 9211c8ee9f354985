"""Per-layer building blocks of the decoder: RMSNorm and GQA self-attention.

The packed qkv output is split *per shard* (shard i holds `[q_i | k_i | v_i]`), then
q/k norm, RoPE, the KV-cache write and attention run in one `shard_map` over
("batch", "tensor"): heads never leave their shard, so attention adds no collective and
works on Explicit and Auto meshes alike. Query head h uses physical kv head h // G with
G = H / kv_phys, which is the right GQA grouping also when kv heads are replicated
(tp > num_kv_heads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lora_jax.linear import QKVParallelLinear, RowParallelLinear
from lora_jax.models.config import DecoderConfig
from lora_jax.models.kv_cache import cache_batch_axis, physical_kv_heads
from lora_jax.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from lora_jax.sharding import ShardingRules, shard_map


def _rms(x: jax.Array, weight: jax.Array, eps: float, dtype) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * y.astype(dtype)


class RMSNorm(nnx.Module):
    """`weight * x / rms(x)`, normalized in f32 (HF's LlamaRMSNorm), weight replicated.

    Example:
        >>> RMSNorm(8, rngs=nnx.Rngs(0))(jnp.ones((2, 8))).shape
        (2, 8)
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        rules: ShardingRules | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        self.rules = rules if rules is not None else ShardingRules()
        self.dim, self.eps, self.dtype, self.param_dtype = dim, eps, dtype, param_dtype
        self.weight = nnx.Param(self.rules.place(jnp.ones((dim,), param_dtype), None))  # [dim]

    def __call__(self, x: jax.Array) -> jax.Array:
        return _rms(x, self.weight[...], self.eps, self.dtype or x.dtype)


def run_per_shard(rules: ShardingRules, fn, args: dict, specs: dict, out_specs):
    """`fn(**local_args)` per shard (directly when there is no mesh); None args skipped."""
    if rules.mesh is None:
        return fn(**args)
    names = [k for k, v in args.items() if v is not None]
    local = lambda *vals: fn(**{**dict.fromkeys(args), **dict(zip(names, vals))})  # noqa: E731
    in_specs = tuple(specs[k] for k in names)
    return shard_map(rules, local, in_specs, out_specs)(*(args[k] for k in names))


class Attention(nnx.Module):
    """GQA self-attention with packed qkv, optional q/k norm, RoPE and a KV cache."""

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
        self.config, self.layer_idx, self.rules, self.dtype = c, layer_idx, rules, dtype
        self.window = c.layer_window(layer_idx)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rules=rules, rngs=rngs)
        self.qkv_proj = QKVParallelLinear(
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
            use_bias=c.qkv_bias,
            **kw,
        )
        self.o_proj = RowParallelLinear(
            c.num_attention_heads * c.head_dim, c.hidden_size, use_bias=c.o_bias, **kw
        )
        norm_kw = dict(dtype=dtype, param_dtype=param_dtype, rules=rules)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **norm_kw) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **norm_kw) if c.qk_norm else None

    def __call__(self, x, positions, cache_kv=None, attention_mask=None):
        """`x [T, D]`, `positions i32[B, S]`, `cache_kv` = (k, v) `[B, kv_phys, L, hd]` or
        None, `attention_mask [B, S]` (keys to ignore = 0) → `([T, D], new (k, v) | None)`."""
        c, rules = self.config, self.rules
        B, S = positions.shape
        tp = rules.size("tensor")
        hd = c.head_dim
        h_l = c.num_attention_heads // tp
        kv_l = physical_kv_heads(c, rules) // tp
        inv_freq = rope_inv_freq(hd, c.rope_theta, c.rope_scaling)
        dtype = self.dtype or x.dtype
        qkv = self.qkv_proj(x)  # [T, (H + 2*kv_phys) * hd], packed per shard
        b = cache_batch_axis(rules, B)
        ck, cv = cache_kv if cache_kv is not None else (None, None)
        window, eps = self.window, c.rms_norm_eps

        def core(qkv, pos, qn, kn, ck, cv, mask):
            bl = pos.shape[0]
            q = qkv[:, : h_l * hd].reshape(bl, S, h_l, hd)
            k = qkv[:, h_l * hd : (h_l + kv_l) * hd].reshape(bl, S, kv_l, hd)
            v = qkv[:, (h_l + kv_l) * hd :].reshape(bl, S, kv_l, hd)
            if qn is not None:
                q, k = _rms(q, qn, eps, q.dtype), _rms(k, kn, eps, k.dtype)
            cos, sin = rope_cos_sin(pos, inv_freq)  # [bl, S, hd]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if ck is not None:
                L = ck.shape[2]
                where = pos if mask is None else jnp.where(mask.astype(bool), pos, L)
                rows = jnp.arange(bl)[:, None]
                # [bl, S] row/position pairs around the head slice: the indexed block is
                # [bl, S, kv, hd], k's own layout. "drop" discards the pad tokens sent to
                # slot L; DecoderModel refuses real positions >= L where it can see them.
                ck = ck.at[rows, :, where].set(k.astype(ck.dtype), mode="drop")
                cv = cv.at[rows, :, where].set(v.astype(cv.dtype), mode="drop")
                keys, vals, key_pos, key_ok = ck, cv, jnp.arange(L)[None, :], None
            else:
                keys, vals = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [bl, kv, S, hd]
                key_pos, key_ok = pos, mask
            out = _attend(q, keys.astype(dtype), vals.astype(dtype), pos, key_pos, key_ok, window)
            return out.reshape(bl * S, h_l * hd), ck, cv

        args = dict(
            qkv=qkv,
            pos=positions,
            qn=None if self.q_norm is None else self.q_norm.weight[...],
            kn=None if self.k_norm is None else self.k_norm.weight[...],
            ck=ck,
            cv=cv,
            mask=attention_mask,
        )
        cache_spec = (b, "tensor", None, None)
        specs = dict(
            qkv=(b, "tensor"),
            pos=(b, None),
            qn=(None,),
            kn=(None,),
            ck=cache_spec,
            cv=cache_spec,
            mask=(b, None),
        )
        out_specs = (
            (b, "tensor"),
            cache_spec if ck is not None else None,
            cache_spec if ck is not None else None,
        )
        out, ck, cv = run_per_shard(rules, core, args, specs, out_specs)
        return self.o_proj(out), (None if ck is None else (ck, cv))


def _attend(q, k, v, q_pos, key_pos, key_ok, window):
    """q `[B, S, H, hd]`, k/v `[B, kv, L, hd]` (H = kv * G; q head h uses kv head h // G)."""
    B, S, H, hd = q.shape
    kv = k.shape[1]
    qg = q.reshape(B, S, kv, H // kv, hd)
    scores = jnp.einsum("bskgd,bkld->bkgsl", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (hd**-0.5)
    diff = q_pos[:, :, None] - key_pos[:, None, :]  # [B, S, L] (key_pos may be [1, L])
    ok = diff >= 0
    if window is not None:
        ok &= diff < window
    if key_ok is not None:
        ok &= key_ok.astype(bool)[:, None, :]
    scores = jnp.where(ok[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    if jax.default_backend() == "cpu":
        # XLA's CPU runtime has no bf16 x bf16 -> f32 dot for this output layout (batch
        # > 1: "Unsupported element type for DotThunk"); the dot in its own layout and a
        # transpose is the same math
        out = jnp.einsum("bkgsl,bkld->bkgsd", probs, v, preferred_element_type=jnp.float32)
        out = out.transpose(0, 3, 1, 2, 4)
    else:
        out = jnp.einsum("bkgsl,bkld->bskgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(B, S, H, hd).astype(q.dtype)
