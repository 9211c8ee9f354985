"""The ops' own backward pass: through the kernels themselves, or dense for one slot.

A shrink ``h_s = scale * mask_s * (x @ A_s[idx]^T)`` and an expand ``y += h_s @ B_s[idx]^T``
(mask_s: the token has a slot and the rank column is below the slot's true rank) have as
gradient two ops of the same kind and one new one:

* the shrink's ``dx = sum_s (scale * mask_s * dh_s) @ A_s[idx]`` is an expand against the
  transposed A stacks (slices side by side in rank, at most ``DX_CHUNK_RANK`` a call);
* the expand's ``dh_s = mask_s * (dy_s @ B_s[idx])`` is a shrink against the transposed B;
* each stack's gradient, per slot the sum over its tokens of ``dh^T x`` (dA) or
  ``dy_s^T h_s`` (dB), is `lora_jax.kernels.lora_slot_outer`: each token counts once,
  for its own slot.

Where every mapped token uses one slot (`LoRAMapping.single_slot`: a training batch) the
four are dense matmuls against that slot's weights instead, on every backend (XLA's
forward included): what PEFT's LoRA does for its one adapter.

XLA's autodiff of the XLA backend (`ops_pallas._with_xla_vjp`) multiplies against every
slot once tokens outnumber slots: on an H100, 4 Llama-3-8B layers of 4096 training tokens
over 8 slots spent 19.5 ms of a 54.7 ms rank-64 step there (session 52); in session 53's run
the step took 51.3 ms that way, 38.8 ms through this module, 37.0 with ``single_slot``
(benchmarks/RESULTS.md, "training").
The rounding follows the XLA backend's (operands in the stacks' bf16 / fp16, f32
accumulation), so the two backward passes agree to the dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lora_jax.ops_pallas import _kernels
from lora_jax.ops_xla import _shrink_xla, _within_rank

BLOCK_DIAGONAL_SLICES = True
"""Where the tokens use one slot (`LoRAMapping.single_slot`), take a merged layer's
(qkv, gate_up) dh and dB as one pair of matmuls over the whole of dy against the slot's B's
laid block-diagonally, instead of a pair a slice over dy's column slices. It reads dy once
with no slice of it copied out, at S x the FLOPs (the off-diagonal blocks are zeros).
On by default since session 55 (H100, `benchmarks/train_step.py`'s ``*_bd`` variants, the
4-layer Llama-3-8B-shaped grad step, 8 x 512 tokens): rank 64 pallas 36.8 -> 35.2 ms,
xla 39.4 -> 38.6; rank 128 a tie (36.7 -> 36.4, 40.3 -> 40.5). False: a pair of matmuls
a slice. Read when the backward is traced."""

DX_CHUNK_RANK = 128
"""The most rank columns (slices side by side) of one expand call of the shrink's dx: the
Mosaic GPU expand takes ranks up to 128."""


def _interpret() -> bool:
    from lora_jax import ops

    return ops.PALLAS_INTERPRET


def _half_or_f32(*dtypes):
    """The dtype the products take: the operands' bf16 / fp16 when they share it, else f32."""
    first = jnp.dtype(dtypes[0])
    half = first in (jnp.bfloat16, jnp.float16)
    return first if half and all(jnp.dtype(d) == first for d in dtypes) else jnp.float32


def _masked(g, mapping, slot_ranks, s: int, rank: int):
    """``g [T, R]`` (f32) zeroed where the forward's slice ``s`` was: unmapped tokens and
    rank columns past the token's slot's rank."""
    idx = mapping.token_lora_indices
    keep = (idx >= 0)[:, None] & _within_rank(slot_ranks, s, idx, rank)
    return jnp.where(keep, g.astype(jnp.float32), 0.0)


def _one_slot(mapping):
    """The slot every mapped token uses (`LoRAMapping.single_slot`; 0 where no token is
    mapped: every row is masked then)."""
    return jnp.maximum(mapping.active_slots[0], 0)


def _slot_of(stack, slot):
    """``stack[slot]`` (a dynamic slice: the slot is a device value)."""
    return jax.lax.dynamic_index_in_dim(stack, slot, 0, keepdims=False)


def _into_slot(grad, stack, slot):
    """A cotangent of ``stack``: zeros but ``grad`` at ``slot``, in the stack's dtype."""
    zeros = jnp.zeros(stack.shape, stack.dtype)
    return jax.lax.dynamic_update_index_in_dim(zeros, grad.astype(stack.dtype), slot, 0)


def _dot(a, b, cdt, dims):
    precision = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
    return jax.lax.dot_general(
        a.astype(cdt), b.astype(cdt), (dims, ((), ())), precision=precision,
        preferred_element_type=jnp.float32,
    )  # fmt: skip


def _dense_shrink_backward(x, lora_a, mapping, gm, cdt):
    """`shrink_backward` where the tokens use one slot: two matmuls against its A's, the
    slices side by side (``gm``: the masked, scaled cotangent ``[S, T, R]``)."""
    slot = _one_slot(mapping)
    flat = jnp.moveaxis(gm, 0, 1).reshape(x.shape[0], -1)  # [T, S * R]
    a_one = jnp.concatenate([_slot_of(a, slot) for a in lora_a])  # [S * R, H]
    dx = _dot(flat, a_one, cdt, ((1,), (0,))).astype(x.dtype)  # [T, H]
    da = _dot(flat, x, cdt, ((0,), (0,)))  # [S * R, H]
    rank = lora_a[0].shape[1]
    d_a = tuple(_into_slot(da[s * rank : (s + 1) * rank], a, slot) for s, a in enumerate(lora_a))
    return dx, d_a


def shrink_backward(x, lora_a, mapping, slot_ranks, g, *, scale: float):
    """``(dx, dA)`` of the shrink at its output's cotangent ``g [S, T, R]`` (``scale``: the
    kernels' static scale)."""
    num_tokens = x.shape[0]
    rank = lora_a[0].shape[1]
    gm = jnp.stack(
        [_masked(g[s], mapping, slot_ranks, s, rank) for s in range(len(lora_a))]
    ) * jnp.float32(scale)  # [S, T, R]
    cdt = _half_or_f32(x.dtype, *(a.dtype for a in lora_a))
    if mapping.single_slot:
        return _dense_shrink_backward(x, lora_a, mapping, gm, cdt)
    kernels, interpret = _kernels(), _interpret()
    flat = jnp.moveaxis(gm, 0, 1).reshape(num_tokens, -1)  # [T, S * R]: slices side by side
    da = kernels.lora_slot_outer(
        flat.astype(cdt), x, **mapping.kernel_kwargs(), interpret=interpret
    )  # [L, S * R, H]
    d_a = tuple(da[:, s * rank : (s + 1) * rank].astype(a.dtype) for s, a in enumerate(lora_a))
    dx = jnp.zeros_like(x)
    per = max(1, DX_CHUNK_RANK // rank)
    for first in range(0, len(lora_a), per):
        part = range(first, min(len(lora_a), first + per))
        a_t = jnp.concatenate([jnp.swapaxes(lora_a[s], 1, 2) for s in part], axis=2)
        h = gm[first : first + len(part)]
        h = jnp.moveaxis(h, 0, 1).reshape(num_tokens, -1)[None]  # [1, T, k * R]
        dx = kernels.lora_expand(
            dx, h, (a_t.astype(cdt),), offsets=(0,), **mapping.expand_kwargs(),
            interpret=interpret,
        )  # fmt: skip
    return dx, d_a


def _dense_expand_backward(h, lora_b, mapping, slot_ranks, gy, offsets, cdt):
    """`expand_backward` where the tokens use one slot and the layer has several slices
    (`BLOCK_DIAGONAL_SLICES`): two matmuls over the whole of ``gy``, against that slot's
    B's laid block-diagonally (slice s's rows at its columns of y, its rank columns at
    s * R), so that no slice of ``gy`` is copied out first."""
    num_slices, rank = len(lora_b), h.shape[-1]
    slot = _one_slot(mapping)
    blocks = jnp.zeros((gy.shape[1], num_slices * rank), cdt)
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        blocks = jax.lax.dynamic_update_slice(
            blocks, _slot_of(b, slot).astype(cdt), (off, s * rank)
        )
    g = gy.astype(cdt)
    dh = _dot(g, blocks, cdt, ((1,), (0,)))  # [T, S * R]
    hm = jnp.concatenate(
        [_masked(h[s], mapping, slot_ranks, s, rank) for s in range(num_slices)], axis=1
    ).astype(cdt)  # [T, S * R]
    full = _dot(g, hm, cdt, ((0,), (0,)))  # [N, S * R]: slice s's dB is its diagonal block
    dhs, dbs = [], []
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        dhs.append(_masked(dh[:, s * rank : (s + 1) * rank], mapping, slot_ranks, s, rank))
        db = full[off : off + b.shape[1], s * rank : (s + 1) * rank]
        dbs.append(_into_slot(db, b, slot))
    return jnp.stack(dhs), tuple(dbs)


def expand_backward(y_dtype, h, lora_b, mapping, slot_ranks, gy, *, offsets):
    """``(dy, dh, dB)`` of the expand at its output's cotangent ``gy [T, N]``: through the
    kernels, or where the tokens use one slot two matmuls a slice against its B (all
    slices at once with `BLOCK_DIAGONAL_SLICES`)."""
    rank = h.shape[-1]
    cdts = {_half_or_f32(b.dtype, y_dtype) for b in lora_b}
    if BLOCK_DIAGONAL_SLICES and mapping.single_slot and len(lora_b) > 1 and len(cdts) == 1:
        dh, d_b = _dense_expand_backward(h, lora_b, mapping, slot_ranks, gy, offsets, *cdts)
        return gy, dh.astype(h.dtype), d_b
    dhs, dbs = [], []
    slot = _one_slot(mapping) if mapping.single_slot else None
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        # the expand's products take B's bf16 / fp16 unless y is f32 (ops_xla._expand_xla)
        cdt = _half_or_f32(b.dtype, y_dtype)
        g_s = gy[:, off : off + b.shape[1]].astype(cdt)  # [T, n_s]
        hm = _masked(h[s], mapping, slot_ranks, s, rank).astype(cdt)
        if slot is not None:
            dh = _dot(g_s, _slot_of(b, slot), cdt, ((1,), (0,)))  # [T, R]
            dhs.append(_masked(dh, mapping, slot_ranks, s, rank))
            dbs.append(_into_slot(_dot(g_s, hm, cdt, ((0,), (0,))), b, slot))  # [n_s, R]
            continue
        kernels, interpret = _kernels(), _interpret()
        ranks = None if slot_ranks is None else slot_ranks[s : s + 1]
        dh = kernels.lora_shrink(
            g_s, (jnp.swapaxes(b, 1, 2).astype(cdt),), scale=1.0, slot_ranks=ranks,
            **mapping.shrink_kwargs(), interpret=interpret,
        )  # fmt: skip
        dhs.append(dh[0])
        db = kernels.lora_slot_outer(g_s, hm, **mapping.kernel_kwargs(), interpret=interpret)
        dbs.append(db.astype(b.dtype))
    return gy, jnp.stack(dhs).astype(h.dtype), tuple(dbs)


def add_backward(y, x, lora_a, lora_b, mapping, slot_ranks, g, *, scale: float, offsets):
    """``(dy, dx, dA, dB)`` of the fused shrink -> expand: h is recomputed by the shrink
    kernel (the fused kernel keeps it on chip; the XLA backend where the tokens use one
    slot), then the expand's and the shrink's backward passes."""
    if mapping.single_slot:
        h = _shrink_xla(x, lora_a, mapping, slot_ranks, scale=scale)
    else:
        h = _kernels().lora_shrink(
            x, lora_a, scale=scale, slot_ranks=slot_ranks, **mapping.shrink_kwargs(),
            interpret=_interpret(),
        )  # fmt: skip
    dy, dh, d_b = expand_backward(y.dtype, h, lora_b, mapping, slot_ranks, g, offsets=offsets)
    dx, d_a = shrink_backward(x, lora_a, mapping, slot_ranks, dh, scale=scale)
    return dy, dx, d_a, d_b
