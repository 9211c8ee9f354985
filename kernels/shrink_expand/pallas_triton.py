"""Pallas Triton backend: the expand (SGMV style, one launch for all slices); the shared
pieces are in pallas_triton_common.py, the shrink in pallas_triton_shrink.py.

Grid: (work block, slice, column block). A work block is up to ``block_m``
tokens of one adapter slot, taken from ``sorted_token_ids`` (see
work_list.py), so an adapter's weights are read once per token block, not
once per token. Tokens are gathered by row index.

Two details keep the result exact and the interpret mode (CPU) faithful:

* Rows past a block's count repeat the block's last real token. They load
  and compute the same values and store them to the same row, so no row
  mask is needed on stores (interpret mode writes masked lanes back with the
  old value, which would race with the real lane writing the same row).
* Rank columns past a slot's true rank (``slot_ranks``) are masked off on
  load: masked lanes issue no memory traffic, so a rank-8 adapter in a
  rank-64 buffer reads rank-8 bytes; rank blocks wholly past it skip the loop.

The Pallas Triton lowering is deprecated upstream since JAX 0.11; the
``pallas_triton*`` files are self-contained so that they can be dropped when
Mosaic GPU takes over.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes
from lora_jax.kernels.shrink_expand.pallas_triton_common import (  # noqa: F401  (re-exported)
    _OPT_IN_SMEM,
    _OPT_IN_SMEM_MAJOR,
    SMEM_BUDGET,
    _block_rows,
    _dot_precision,
    _expand_dtype,
    _true_rank,
    expand_refs,
    expand_tiles,
    fit_expand_tiles,
    opt_in_smem_budget,
)


def load_y_tile(y_ref, rows, c, n_s: int, off: int, live=True):
    """y's [block_m, block_n] tile at ``rows`` x ``off + c``; columns past the slice
    (``c >= n_s``), or every column where ``live`` is False, are masked (no bytes move)."""
    mask = jnp.broadcast_to(((c < n_s) & live)[None, :], (rows.shape[0], c.shape[0]))
    return plgpu.load(y_ref.at[rows[:, None], off + c[None, :]], mask=mask, other=0)


def expand_tile(
    y_ref, b_ref, h, rows, slot, r, r_mask, c, n_s: int, off: int, dtype, precision, row_ok,
    yt=None,
):  # fmt: skip
    """``y[rows, off + c] += h @ B[slot, c, r].T`` for one [block_m, block_n] tile.

    Columns past the slice (``c >= n_s``) are masked, so a tile wholly past it moves no
    bytes; ``row_ok`` (or None) masks the stores of rows. y's tile is the most bytes, so
    its load is issued first, in flight while B loads and the dot runs; ``yt``: that
    tile, loaded earlier by the caller (`load_y_tile`).
    """
    c_mask = c < n_s
    col_mask = jnp.broadcast_to(c_mask[None, :], (h.shape[0], c.shape[0]))
    y_at = y_ref.at[rows[:, None], off + c[None, :]]
    if yt is None:
        yt = plgpu.load(y_at, mask=col_mask, other=0)
    bt = plgpu.load(
        b_ref.at[slot, c[:, None], r[None, :]], mask=c_mask[:, None] & r_mask[None, :], other=0
    )  # [bn, rank_p]
    delta = plgpu.dot(h, bt.astype(dtype), trans_b=True, precision=precision)  # f32
    if row_ok is not None:
        col_mask = col_mask & row_ok[:, None]
    plgpu.store(y_at, (yt.astype(jnp.float32) + delta).astype(y_ref.dtype), mask=col_mask)


def _block_h(h_ref, ranks_ref, s: int, slot, rows, r, rank: int, compute_dtype):
    """A token block's h [block_m, rank_p] of slice ``s`` in the dot's dtype, 0 past the
    slot's true rank, and that rank mask [rank_p]."""
    r_mask = r < _true_rank(ranks_ref, s, slot, rank)
    ht = plgpu.load(
        h_ref.at[s, rows[:, None], r[None, :]],
        mask=jnp.broadcast_to(r_mask[None, :], (rows.shape[0], r.shape[0])),
        other=0,
    )
    return ht.astype(compute_dtype), r_mask


def _expand_kernel(
    tab_ref,  # [4 + block_m, NB] int32 (work_list.py)
    *refs,
    num_slices: int,
    has_ranks: bool,
    offsets: tuple[int, ...],
    widths: tuple[int, ...],
    rank: int,
    compute_dtype,
    bs: BlockSizes,
    mask_rows: bool,
):
    ranks_ref, h_ref, b_refs, y_ref = expand_refs(refs, has_ranks, num_slices)
    pid, sid, grp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if bs.cols_inner:  # grid (column group, slice, block): see `BlockSizes.cols_inner`
        pid, grp = grp, pid
    bm, bn, tiles = bs.block_m, bs.block_n, bs.tiles_n
    rank_p = max(16, 1 << (rank - 1).bit_length())
    precision = _dot_precision(compute_dtype)
    max_tiles = -(-max(widths) // bn)
    if bs.live_programs:
        # One grid entry per column tile; `per` tiles a program, picked from the live blocks.
        per = _tiles_per_program(tab_ref[3, 0] * num_slices * max_tiles, bs)
        first, starts = grp, jax.lax.rem(grp, per) == 0
    else:
        first, starts = grp * tiles, True

    for s in range(num_slices):
        n_s, off = widths[s], offsets[s]
        blocks_s = -(-n_s // bn)

        @pl.when(
            (sid == s)
            & starts
            & (first < blocks_s)
            & (tab_ref[2, pid] > 0)
            & (tab_ref[0, pid] >= 0)
        )
        def _(s=s, n_s=n_s, off=off, blocks_s=blocks_s):
            slot, nrows, rows = _block_rows(tab_ref, pid, bm)
            r = jnp.arange(rank_p, dtype=jnp.int32)
            ahead = bs.prefetch if not bs.live_programs and tiles > 1 else 0

            def cols(j):
                return (first + j) * bn + jnp.arange(bn, dtype=jnp.int32)  # [bn]

            # Full blocks load ahead; emptier ones (B's bytes dominate) load in step.
            full = nrows >= bs.prefetch_rows if bs.prefetch_rows else True
            # With the ahead-load, the first tiles' y loads are issued before h's.
            y_first = tuple(
                load_y_tile(y_ref, rows, cols(i), n_s, off, (i < tiles) & full)
                for i in range(ahead)
            )
            # The tokens' h, loaded once for all of this program's column tiles.
            ht, r_mask = _block_h(h_ref, ranks_ref, s, slot, rows, r, rank, compute_dtype)
            row_ok = jnp.arange(bm, dtype=jnp.int32) < nrows

            def tile(j, carry):
                expand_tile(
                    y_ref, b_refs[s], ht, rows, slot, r, r_mask, cols(j), n_s, off,
                    compute_dtype, precision, row_ok if mask_rows else None,
                )  # fmt: skip
                return carry

            def tile_ahead(j, ys):
                # Tile j + ahead's y is loaded before tile j's B, dot and store, and the
                # loaded tiles are carried: Triton pipelines only the loads that feed a
                # dot, and the gathered y rows' loads are what the prefill expand waits on.
                # A block that is not full loads each tile in its step instead (the loads
                # of the other way are masked off: no bytes). One loop either way: two
                # loops would each get their own pipeline buffers of B.
                ahead_ok = (j + ahead < tiles) & full
                y_next = load_y_tile(y_ref, rows, cols(j + ahead), n_s, off, ahead_ok)
                yt = ys[0]
                if bs.prefetch_rows:
                    y_now = load_y_tile(y_ref, rows, cols(j), n_s, off, ~full)
                    yt = jnp.where(full, yt, y_now)
                expand_tile(
                    y_ref, b_refs[s], ht, rows, slot, r, r_mask, cols(j), n_s, off,
                    compute_dtype, precision, row_ok if mask_rows else None, yt=yt,
                )  # fmt: skip
                return (*ys[1:], y_next)

            if bs.live_programs:  # no tile past the slice: it would move no bytes anyway
                jax.lax.fori_loop(0, jnp.minimum(per, blocks_s - first), tile, 0)
            elif tiles == 1:
                tile(0, 0)
            elif ahead:
                jax.lax.fori_loop(0, tiles, tile_ahead, y_first)
            else:
                jax.lax.fori_loop(0, tiles, tile, 0)


def _expand_blocks_kernel(
    tab_ref,  # [4 + block_m, NB] int32 (work_list.py)
    *refs,
    num_slices: int,
    has_ranks: bool,
    offsets: tuple[int, ...],
    widths: tuple[int, ...],
    rank: int,
    compute_dtype,
    bs: BlockSizes,
    mask_rows: bool,
):
    """``block_groups`` > 0: a program per (column tile of a slice, group g) walks the live
    token blocks g, g + groups, ... (the work list's row 3 counts them), so no program is
    launched for a block of the list's static tail."""
    ranks_ref, h_ref, b_refs, y_ref = expand_refs(refs, has_ranks, num_slices)
    tile, grp = pl.program_id(0), pl.program_id(1)
    bm, bn, groups = bs.block_m, bs.block_n, bs.block_groups
    rank_p = max(16, 1 << (rank - 1).bit_length())
    precision = _dot_precision(compute_dtype)
    walks = jnp.maximum(tab_ref[3, 0] - grp + groups - 1, 0) // groups
    r = jnp.arange(rank_p, dtype=jnp.int32)
    first = 0
    for s in range(num_slices):
        n_s, off = widths[s], offsets[s]
        blocks_s = -(-n_s // bn)

        @pl.when((tile >= first) & (tile < first + blocks_s))
        def _(s=s, n_s=n_s, off=off, first=first):
            c = (tile - first) * bn + jnp.arange(bn, dtype=jnp.int32)  # [bn]

            def block(i, carry):
                slot, nrows, rows = _block_rows(tab_ref, grp + i * groups, bm)
                ht, r_mask = _block_h(h_ref, ranks_ref, s, slot, rows, r, rank, compute_dtype)
                row_ok = jnp.arange(bm, dtype=jnp.int32) < nrows
                expand_tile(
                    y_ref, b_refs[s], ht, rows, slot, r, r_mask, c, n_s, off, compute_dtype,
                    precision, row_ok if mask_rows else None,
                )  # fmt: skip
                return carry

            jax.lax.fori_loop(0, walks, block, 0)

        first += blocks_s


def _tiles_per_program(live_tiles, bs: BlockSizes):
    """Column tiles a program walks: the largest power of two up to ``bs.tiles_n`` that
    leaves at least ``bs.live_programs`` programs for ``live_tiles`` (live blocks x
    slices x column tiles), or 1."""
    per = jnp.int32(1)
    p = 2
    while p <= bs.tiles_n:
        per = jnp.where(live_tiles >= p * bs.live_programs, jnp.int32(p), per)
        p *= 2
    return per


def expand(
    y,
    h,
    lora_b,
    tab,
    slot_ranks,
    *,
    offsets: tuple[int, ...],
    bs: BlockSizes,
    interpret: bool,
):
    """New y [T, N] with the adapters' contributions added. ``tab``: see work_list.py,
    built with ``expand_tiles(bs, lora_b, y).block_m`` (the fitted token block)."""
    num_slices = len(lora_b)
    rank = lora_b[0].shape[2]
    widths = tuple(b.shape[1] for b in lora_b)
    compute_dtype = _expand_dtype(lora_b, y)
    bs = expand_tiles(bs, lora_b, y)
    bn = bs.block_n  # the grid below must use the fitted width
    has_ranks = slot_ranks is not None
    common = dict(
        num_slices=num_slices,
        has_ranks=has_ranks,
        offsets=tuple(offsets),
        widths=widths,
        rank=rank,
        compute_dtype=compute_dtype,
        # Interpret mode writes masked lanes back with their old value, which would race
        # with the real row; on the GPU, masking the repeated rows saves their stores.
        mask_rows=not interpret,
    )
    if bs.block_groups:  # a program per (slice column tile, group of live blocks)
        kernel = functools.partial(_expand_blocks_kernel, bs=bs, **common)
        grid = (sum(-(-n // bn) for n in widths), bs.block_groups)
    else:
        max_tiles = -(-max(widths) // bn)
        tiles = max(1, min(bs.tiles_n, max_tiles))
        if bs.live_programs:  # a power of two, for the run-time pick
            tiles = 1 << (tiles.bit_length() - 1)
        kernel = functools.partial(
            _expand_kernel, bs=dataclasses.replace(bs, tiles_n=tiles), **common
        )
        # With live_programs, a program per column tile; the groups are picked at run time.
        grid = (
            tab.shape[1],
            num_slices,
            max_tiles if bs.live_programs else -(-max_tiles // tiles),
        )
        if bs.cols_inner:
            grid = grid[::-1]
    inputs = [tab] + ([slot_ranks] if has_ranks else []) + [h, *lora_b, y]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=grid,
        input_output_aliases={len(inputs) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="lora_expand",
    )(*inputs)
