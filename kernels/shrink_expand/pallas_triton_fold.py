"""Pallas Triton base matmul with the LoRA expand folded in, for decode steps.

``y = x @ W (+ bias) + Σ_s h[s, t] @ B_s[idx[t]].T`` over each slice's columns, in one
launch: a program computes one [block_m, block_n] tile of y, first over the hidden size
(x and W tiles, the base GEMM), then over the step's active adapter slots (B tiles, h
masked to the tokens of that slot) into the same f32 accumulator, and stores the tile
once. The expand then costs its B bytes only: no launch of its own, no second read and
write of y.

In a decode step the base matmul streams W once and x is a few rows, so the kernel is
bound by W's bytes; the active slots add one ``block_n x R`` B tile each per program.
h comes from the shrink (`lora_shrink`, f32, scale applied).

The Pallas Triton lowering is deprecated upstream since JAX 0.11; this file is
self-contained like the other ``pallas_triton*`` files.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True, kw_only=True)
class FoldTiles:
    """Static tiling of `base_expand`.

    Example::

        y = base_expand(x, w, h, (b,), idx, active, num_active, offsets=(0,),
                        tiles=FoldTiles(block_n=64))
    """

    block_m: int = 16
    """Rows of x per program (a power of two >= 16; decode steps take all in one)."""
    block_n: int = 64
    """Columns of y per program (a power of two >= 16 dividing every slice's offset)."""
    block_k: int = 128
    """Hidden columns per step of the base matmul's loop."""
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for f in ("block_m", "block_n", "block_k"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"FoldTiles.{f}={v}: Triton tiles must be powers of two >= 16.")


def _fold_kernel(
    idx_ref,  # [T] int32: token_lora_indices
    act_ref,  # [L] int32: active slots, then -1
    nact_ref,  # [1] int32: how many are active
    x_ref,  # [T, H]
    w_ref,  # [H, N]
    *refs,
    num_slices: int,
    offsets: tuple[int, ...],
    widths: tuple[int, ...],
    rank: int,
    has_bias: bool,
    compute_dtype,
    tiles: FoldTiles,
):
    bias_ref, refs = (refs[0], refs[1:]) if has_bias else (None, refs)
    h_ref, b_refs, y_ref = refs[0], refs[1 : 1 + num_slices], refs[-1]
    tokens, hidden = x_ref.shape
    width = w_ref.shape[1]
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    j, i = pl.program_id(0), pl.program_id(1)
    rows = i * bm + jnp.arange(bm, dtype=jnp.int32)
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    row_ok, col_ok = rows < tokens, cols < width
    steps = -(-hidden // bk)
    k_masked = steps * bk != hidden

    def k_step(k, acc):
        kk = k * bk + jnp.arange(bk, dtype=jnp.int32)
        x_mask = jnp.broadcast_to(row_ok[:, None], (bm, bk))
        w_mask = jnp.broadcast_to(col_ok[None, :], (bk, bn))
        if k_masked:
            x_mask = x_mask & (kk < hidden)[None, :]
            w_mask = w_mask & (kk < hidden)[:, None]
        xt = plgpu.load(x_ref.at[rows[:, None], kk[None, :]], mask=x_mask, other=0)
        wt = plgpu.load(w_ref.at[kk[:, None], cols[None, :]], mask=w_mask, other=0)
        return acc + plgpu.dot(xt.astype(compute_dtype), wt.astype(compute_dtype))

    acc = jax.lax.fori_loop(0, steps, k_step, jnp.zeros((bm, bn), jnp.float32))

    rank_p = max(16, 1 << (rank - 1).bit_length())
    r = jnp.arange(rank_p, dtype=jnp.int32)
    idx_t = plgpu.load(idx_ref.at[rows], mask=row_ok, other=-1)
    num_active = nact_ref[0]
    for s in range(num_slices):
        off, n_s = offsets[s], widths[s]
        inside = (j * bn >= off) & (j * bn < off + n_s)
        c = cols - off
        h_mask = (row_ok & inside)[:, None] & (r < rank)[None, :]
        ht = plgpu.load(h_ref.at[s, rows[:, None], r[None, :]], mask=h_mask, other=0)
        b_mask = (c < n_s)[:, None] & (r < rank)[None, :]

        def slot_step(a, acc, s=s, ht=ht, c=c, b_mask=b_mask):
            slot = act_ref[a]
            hm = jnp.where(idx_t[:, None] == slot, ht, 0.0).astype(compute_dtype)
            bt = plgpu.load(b_refs[s].at[slot, c[:, None], r[None, :]], mask=b_mask, other=0)
            return acc + plgpu.dot(hm, bt.astype(compute_dtype), trans_b=True)

        acc = jax.lax.fori_loop(0, jnp.where(inside, num_active, 0), slot_step, acc)

    if has_bias:
        acc = acc + plgpu.load(bias_ref.at[cols], mask=col_ok, other=0).astype(jnp.float32)[None]
    y_mask = row_ok[:, None] & col_ok[None, :]
    plgpu.store(y_ref.at[rows[:, None], cols[None, :]], acc.astype(y_ref.dtype), mask=y_mask)


@functools.partial(
    jax.jit, static_argnames=("offsets", "tiles", "interpret")
)
def base_expand(
    x: jax.Array,
    w: jax.Array,
    h: jax.Array,
    lora_b,
    token_lora_indices: jax.Array,
    active_slots: jax.Array,
    num_active: jax.Array,
    *,
    offsets: tuple[int, ...],
    bias: jax.Array | None = None,
    tiles: FoldTiles = FoldTiles(),
    interpret: bool = False,
) -> jax.Array:
    """``x @ w (+ bias)`` with each slice's LoRA expand added, [T, N] in x's dtype.

    x: [T, H]; w: [H, N] (Flax's kernel layout); h: [S, T, R] f32 (the shrink's output);
    lora_b: S arrays [max_loras, n_s, R]; slice s covers columns ``offsets[s] :
    offsets[s] + n_s`` (each offset a multiple of ``tiles.block_n``). Tokens whose index
    is -1 get the base product only.
    """
    lora_b = tuple(lora_b)
    tokens, hidden = x.shape
    if w.ndim != 2 or w.shape[0] != hidden:
        raise ValueError(f"base_expand: w has shape {w.shape}; expected [H={hidden}, N].")
    width = w.shape[1]
    widths = tuple(b.shape[1] for b in lora_b)
    if len(offsets) != len(lora_b):
        raise ValueError(f"base_expand: {len(offsets)} offsets for {len(lora_b)} B slices.")
    for s, (off, n_s) in enumerate(zip(offsets, widths)):
        if off % tiles.block_n or off < 0 or off + n_s > width:
            raise ValueError(
                f"base_expand: slice {s} covers columns [{off}, {off + n_s}) of {width}; its "
                f"offset must be a multiple of block_n={tiles.block_n} inside y."
            )
    rank = lora_b[0].shape[2]
    compute_dtype = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    has_bias = bias is not None
    kernel = functools.partial(
        _fold_kernel,
        num_slices=len(lora_b),
        offsets=tuple(offsets),
        widths=widths,
        rank=rank,
        has_bias=has_bias,
        compute_dtype=compute_dtype,
        tiles=tiles,
    )
    inputs = [
        token_lora_indices.astype(jnp.int32),
        active_slots.astype(jnp.int32),
        jnp.reshape(num_active, (1,)).astype(jnp.int32),
        x,
        w,
    ]
    inputs += ([bias] if has_bias else []) + [h, *lora_b]
    grid = (-(-width // tiles.block_n), -(-tokens // tiles.block_m))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tokens, width), x.dtype),
        grid=grid,
        compiler_params=plgpu.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=interpret,
        name="lora_base_expand",
    )(*inputs)


def reference(x, w, h, lora_b, token_lora_indices, *, offsets, bias=None):
    """The jnp oracle of `base_expand`: f32 products, rounded to x's dtype once."""
    y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    idx = token_lora_indices
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        bt = b[jnp.maximum(idx, 0)].astype(jnp.float32)  # [T, n_s, R]
        d = jnp.einsum("tr,tnr->tn", h[s], bt, precision="highest")
        d = jnp.where((idx >= 0)[:, None], d, 0.0)
        y = y.at[:, off : off + b.shape[1]].add(d)
    return y.astype(x.dtype)
