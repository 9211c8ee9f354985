"""Fused decode LoRA: shrink and expand of every slice of a layer in ONE Pallas Triton launch.

``y[t, off_s:off_s+n_s] += scale * (x[t] @ A_s[idx[t]].T) @ B_s[idx[t]].T``

The 3-launch path (split-K shrink, an XLA sum of its f32 partials, expand) costs
~15-20 µs per LoRA application at decode on an H200, almost all of it fixed
per-launch cost (benchmarks/RESULTS.md, "ops"). This kernel does the whole
application in one launch, for decode (T <= 256):

Grid: (work block, slice s, column group). A work block is a run of up to
``block_m`` tokens of one adapter slot (work_list.py, shared with the other
kernels). Each program

1. gathers its tokens' x rows (positions from the work list) and streams its
   slot's ``A_s`` in ``block_k`` chunks (a pipelined loop), accumulating
   ``h [block_m, R]`` in f32 registers;
2. scales h and rounds it to B's dtype (as the expand kernel does);
3. walks its column group in ``block_n`` tiles: loads ``B_s[slot]``'s tile
   ``[block_n, R]`` and adds ``h @ B_tile.T`` into the y tile (read, add in
   f32, round once, store; y is aliased to the output).

The shrink is recomputed by every column group of a (work block, slice):
``split_n`` groups re-read x and A (the second and later reads come from L2,
since the groups of one block run together). That is cheap at decode, where A
is a few hundred KiB per slot, and it is what buys one launch with no h round
trip through HBM; it is wasteful for prefill (long runs per slot, many column
tiles), so use the two-kernel path (`lora_shrink` + `lora_expand`) there.
``split_n`` trades that recomputation against parallelism (tuning.py).

Measured (H200, benchmarks/RESULTS.md "ops", session 3): 26-116 µs per call against
14-24 µs for the shrink + expand pair at T <= 256 — each program's k loop over the
whole hidden dim and its serial walk over column tiles make the launch latency-bound.
It stays an opt-in backend ("pallas_fused"); a version worth defaulting to needs the
k split inside (a grid-wide reduction), e.g. on Mosaic GPU.

Exactness as in pallas_triton.py: rows past a block's count repeat its last
real token (identical values to the same row, no row mask on stores), tokens
with idx -1 form work blocks whose programs return at once (their y rows come
back bit-identical through the alias), and rank columns past ``slot_ranks``
are masked on load (no traffic). Ranks are padded to a power of two >= 16
inside the kernel; the weights need no padding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lora_jax.kernels.shrink_expand import checks
from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes, next_pow2
from lora_jax.kernels.shrink_expand.mosaic_gpu_jobs import num_sms
from lora_jax.kernels.shrink_expand.pallas_triton import (
    SMEM_BUDGET,
    _block_rows,
    _dot_precision,
    _true_rank,
    expand_tile,
)
from lora_jax.kernels.shrink_expand.pallas_triton_fused_split import (
    SplitTiles,
    shrink_expand_split,
)
from lora_jax.kernels.shrink_expand.pallas_triton_shrink import _shrink_tile
from lora_jax.kernels.shrink_expand.pallas_triton_shrink import shrink_dtype as dot_dtype
from lora_jax.kernels.shrink_expand.work_list import get_work_list


def fused_smem_bytes(bs: BlockSizes, rank_p: int, itemsize: int) -> int:
    """Shared memory of one program, counted without reuse: pipelined shrink operands
    (``num_stages`` x [x tile + A tile]) plus the expand dot's operands (h + B tile)."""
    loop = bs.num_stages * (bs.block_m + rank_p) * bs.block_k * itemsize
    epilogue = (bs.block_m + bs.block_n) * rank_p * itemsize
    return loop + epilogue


def fit_fused_tiles(bs: BlockSizes, rank: int, itemsize: int) -> BlockSizes:
    """Fewer stages, shorter k steps, narrower column tiles until under SMEM_BUDGET."""
    rank_p = max(16, next_pow2(rank))
    while fused_smem_bytes(bs, rank_p, itemsize) > SMEM_BUDGET:
        if bs.num_stages > 2:
            bs = dataclasses.replace(bs, num_stages=bs.num_stages - 1)
        elif bs.block_k > 64:
            bs = dataclasses.replace(bs, block_k=bs.block_k // 2)
        elif bs.block_n > 32:
            bs = dataclasses.replace(bs, block_n=bs.block_n // 2)
        elif bs.num_stages > 1:
            bs = dataclasses.replace(bs, num_stages=bs.num_stages - 1)
        elif bs.block_k > 16:
            bs = dataclasses.replace(bs, block_k=bs.block_k // 2)
        elif bs.block_n > 16:
            bs = dataclasses.replace(bs, block_n=bs.block_n // 2)
        else:
            break
    return bs


def _fused_kernel(
    tab_ref,  # [4 + block_m, NB] int32 (work_list.py)
    *refs,
    num_slices: int,
    has_ranks: bool,
    offsets: tuple[int, ...],
    widths: tuple[int, ...],
    hidden: int,
    rank: int,
    scale: float,
    tiles_per_program: int,
    shrink_dtype,
    expand_dtype,
    bs: BlockSizes,
):
    if has_ranks:
        ranks_ref, x_ref, *rest = refs  # [S, L], [T, H]
    else:
        ranks_ref, (x_ref, *rest) = None, refs
    a_refs = rest[:num_slices]  # S x [L, R, H]
    b_refs = rest[num_slices : 2 * num_slices]  # S x [L, n_s, R]
    y_ref = rest[2 * num_slices + 1]  # output aliased to the y input: [T, N]
    pid, sid, grp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm, bk, bn = bs.block_m, bs.block_k, bs.block_n
    rank_p = max(16, next_pow2(rank))
    num_k = -(-hidden // bk)
    shrink_precision = _dot_precision(shrink_dtype)
    expand_precision = _dot_precision(expand_dtype)

    for s in range(num_slices):
        n_s, off = widths[s], offsets[s]
        tiles_s = -(-n_s // bn)
        first_tile = grp * tiles_per_program

        @pl.when(
            (sid == s) & (first_tile < tiles_s) & (tab_ref[2, pid] > 0) & (tab_ref[0, pid] >= 0)
        )
        def _(s=s, n_s=n_s, off=off, first_tile=first_tile):
            slot, _, rows = _block_rows(tab_ref, pid, bm)
            r = jnp.arange(rank_p, dtype=jnp.int32)  # [rank_p]
            r_mask = r < _true_rank(ranks_ref, s, slot, rank)

            def shrink_step(kk, acc):
                k = kk * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk]
                return acc + _shrink_tile(
                    x_ref, a_refs[s], rows, slot, r, r_mask, k, hidden, shrink_dtype,
                    shrink_precision,
                )  # fmt: skip

            h = jax.lax.fori_loop(0, num_k, shrink_step, jnp.zeros((bm, rank_p), jnp.float32))
            h = (h * jnp.float32(scale)).astype(expand_dtype)  # [bm, rank_p]

            def tile(j, carry):
                c = (first_tile + j) * bn + jnp.arange(bn, dtype=jnp.int32)  # [bn]
                expand_tile(
                    y_ref, b_refs[s], h, rows, slot, r, r_mask, c, n_s, off, expand_dtype,
                    expand_precision, None,
                )  # fmt: skip
                return carry

            if tiles_per_program == 1:
                tile(0, 0)
            else:
                jax.lax.fori_loop(0, tiles_per_program, tile, 0)


def _compute_dtypes(x, lora_a, lora_b, y):
    expand_dtype = lora_b[0].dtype
    if expand_dtype not in (jnp.bfloat16, jnp.float16) or y.dtype == jnp.float32:
        expand_dtype = jnp.float32
    return dot_dtype(x.dtype, lora_a[0].dtype), jnp.dtype(expand_dtype)


def shrink_expand(
    x,
    y,
    lora_a,
    lora_b,
    tab,
    slot_ranks,
    *,
    offsets: tuple[int, ...],
    scale: float,
    bs: BlockSizes,
    interpret: bool,
):
    """New y [T, N] with every slice's adapter contribution added. ``tab``: work_list.py."""
    hidden = x.shape[1]
    num_slices = len(lora_a)
    rank = lora_a[0].shape[1]
    widths = tuple(b.shape[1] for b in lora_b)
    shrink_dtype, expand_dtype = _compute_dtypes(x, lora_a, lora_b, y)
    itemsize = max(shrink_dtype.itemsize, expand_dtype.itemsize)
    bn = min(bs.block_n, max(16, next_pow2(max(widths))))
    bk = min(bs.block_k, max(16, next_pow2(hidden)))
    bs = fit_fused_tiles(dataclasses.replace(bs, block_n=bn, block_k=bk), rank, itemsize)
    max_tiles = -(-max(widths) // bs.block_n)  # the grid must use the fitted width
    tiles_per_program = -(-max_tiles // max(1, min(bs.split_n, max_tiles)))
    groups = -(-max_tiles // tiles_per_program)
    has_ranks = slot_ranks is not None
    kernel = functools.partial(
        _fused_kernel,
        num_slices=num_slices,
        has_ranks=has_ranks,
        offsets=tuple(offsets),
        widths=widths,
        hidden=hidden,
        rank=rank,
        scale=scale,
        tiles_per_program=tiles_per_program,
        shrink_dtype=shrink_dtype,
        expand_dtype=expand_dtype,
        bs=bs,
    )
    grid = (tab.shape[1], num_slices, groups)
    inputs = [tab] + ([slot_ranks] if has_ranks else []) + [x, *lora_a, *lora_b, y]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=grid,
        input_output_aliases={len(inputs) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="lora_shrink_expand",
    )(*inputs)


@checks.static_args
@functools.partial(
    jax.jit, static_argnames=("offsets", "scale", "block_sizes", "split", "interpret")
)
def lora_shrink_expand(
    x: jax.Array,
    y: jax.Array,
    lora_a: Sequence[jax.Array],
    lora_b: Sequence[jax.Array],
    *,
    offsets: Sequence[int],
    token_lora_indices: jax.Array,
    sorted_token_ids: jax.Array,
    slot_token_counts: jax.Array,
    slot_token_starts: jax.Array,
    active_slots: jax.Array,
    num_active: jax.Array,
    scale: float = 1.0,
    slot_ranks: jax.Array | None = None,
    work_lists: Mapping[int, jax.Array] | None = None,
    block_sizes: BlockSizes | None = None,
    split: bool | SplitTiles = False,
    interpret: bool = False,
) -> jax.Array:
    """``y[t, off_s:off_s+n_s] += scale * (x[t] @ A_s[idx[t]].T) @ B_s[idx[t]].T``, one launch.

    x: [T, H]; y: [T, N] (its dtype is the output's); lora_a: S arrays
    [max_loras, R, H]; lora_b: S arrays [max_loras, n_s, R]; offsets: static
    column offset of each slice. h is accumulated in f32, scaled, rounded to
    B's dtype for the second dot (f32 when y or B is f32), and each y element
    is rounded once. Rows with idx -1 come back bit-identical. Made for decode
    (T <= 256): the shrink is recomputed per column group (module docstring);
    for prefill use `lora_shrink` + `lora_expand`. Donate ``y`` under an outer
    jit to update it in place.

    ``split`` (True, or its `SplitTiles`): the kernel of pallas_triton_fused_split.py
    instead, which splits the shrink's hidden dim over a persistent grid and joins the
    two halves by a grid-wide barrier (``block_sizes`` then unused).

    Example::

        y = lora_shrink_expand(
            x, y, (a_q, a_k, a_v), (b_q, b_k, b_v), offsets=(0, 4096, 5120), scale=0.5, **meta
        )
    """
    del active_slots, num_active  # the work list covers the same information
    lora_a, lora_b = tuple(lora_a), tuple(lora_b)
    offsets = tuple(int(o) for o in offsets)
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"lora_shrink_expand: x has shape {x.shape} and y {y.shape}; expected "
            "x [T, H] and y [T, N] with the same T."
        )
    if not lora_a or len(lora_a) != len(lora_b) or len(offsets) != len(lora_a):
        raise ValueError(
            f"lora_shrink_expand: {len(lora_a)} lora_a slices, {len(lora_b)} lora_b slices "
            f"and {len(offsets)} offsets; expected the same number (>= 1) of each."
        )
    num_tokens, hidden = x.shape
    width = y.shape[1]
    for name, arr in (("x", x), ("y", y)):
        checks.check_float(name, arr)
    checks.check_a_slices("lora_shrink_expand", lora_a, hidden)
    max_loras, rank = lora_a[0].shape[0], lora_a[0].shape[1]
    checks.check_b_slices("lora_shrink_expand", lora_b, offsets, max_loras, rank, width)
    checks.check_meta(
        num_tokens,
        max_loras,
        token_lora_indices,
        sorted_token_ids,
        slot_token_counts,
        slot_token_starts,
        slot_ranks,
        len(lora_a),
        rank,
    )
    if num_tokens == 0:  # an empty batch: nothing to add
        return y
    if split:
        tiles = split if isinstance(split, SplitTiles) else SplitTiles(programs=num_sms())
        block_m = tiles.block_m
    else:
        if block_sizes is None:
            block_sizes = BlockSizes.get_default(
                "fused",
                num_tokens=num_tokens,
                hidden=hidden,
                rank=rank,
                out_features=max(b.shape[1] for b in lora_b),
                num_slices=len(lora_b),
            )
        block_m = block_sizes.block_m
    tab = get_work_list(
        work_lists, slot_token_counts, slot_token_starts, sorted_token_ids, block_m=block_m
    )
    ranks = None if slot_ranks is None else slot_ranks.astype(jnp.int32)
    common = dict(offsets=offsets, scale=float(scale), interpret=interpret)
    if split:
        shrink_dtype, expand_dtype = _compute_dtypes(x, lora_a, lora_b, y)
        return shrink_expand_split(
            x, y, lora_a, lora_b, tab, ranks, shrink_dtype=shrink_dtype,
            expand_dtype=expand_dtype, tiles=tiles, **common,
        )  # fmt: skip
    return shrink_expand(x, y, lora_a, lora_b, tab, ranks, bs=block_sizes, **common)
