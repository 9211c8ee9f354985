"""Rotary position embeddings (HF "rotate_half" layout) with linear and Llama 3 scaling.

The head dim is split in two halves `[x1 | x2]` rotated by the same frequency; this is
the layout HF checkpoints of Llama / Qwen / Mistral use (their q/k weights are permuted
for it), so no weight permutation is needed at load time.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from lora_jax.models.config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies `f32[hd // 2]`, scaled as `scaling` says.

    Example:
        >>> rope_inv_freq(4, 10000.0).tolist()
        [1.0, 0.009999999776482582]
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = (1.0 / np.power(np.float32(theta), exponent)).astype(np.float32)  # [hd/2]
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return (inv / np.float32(scaling.factor)).astype(np.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend
    # in between (Llama 3.1's published formula).
    old_ctx = float(scaling.original_max_position_embeddings)
    low_wl = old_ctx / scaling.low_freq_factor
    high_wl = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / scaling.factor, inv)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """`cos, sin f32[..., hd]` for int positions `[...]` (frequencies repeated twice)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [..., hd]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates `x [B, S, heads, hd]` with `cos, sin [B, S, hd]`; computed in f32.

    Example:
        >>> cos, sin = rope_cos_sin(jnp.zeros((1, 2), jnp.int32), rope_inv_freq(4, 1e4))
        >>> apply_rope(jnp.ones((1, 2, 3, 4)), cos, sin).shape
        (1, 2, 3, 4)
    """
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
