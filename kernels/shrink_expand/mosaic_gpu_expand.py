"""Mosaic GPU (Hopper: TMA + WGMMA) expand for tiles of y that are one adapter's rows.

``y[t, off_s : off_s + n_s] += h[s, t] @ B_s[slot].T`` for the tiles that `tile_items`
lists: aligned ``block_m``-row tiles of y whose every token maps to one slot (the inside
of a prompt). Such a tile is one rectangle of y, so the tensor memory accelerator (TMA)
streams its column blocks in and out of shared memory, where the Triton expand gathers
and scatters row by row. The expand moves y twice (read, write), so its speed is the
speed of that stream.

The kernel is persistent: one program per SM takes an equal run of the step's
(tile, column block) units, laid end to end tile after tile (each tile's slices in turn).
For each (tile, slice) its run touches, it loads the tile's h rows once (f32 through
TMA, masked past the slot's true rank, cast to the weights' dtype in registers: the
WGMMA's left operand; h's buffer is then free for the pipeline's stages) and pipelines
the column blocks: y's block and B's rows in, one
WGMMA of ``block_m x R x block_n``, y + the product out. Tokens outside the listed tiles
(decode, shuffled batches, a prompt's partial edge tiles, unmapped tokens) are left to the
Triton expand.

Example::

    items, mine = tile_items(idx, block_m=64)
    y = expand(y, h, (b,), items, None, offsets=(0,), tiles=ExpandTiles())
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lora_jax.kernels.shrink_expand.mosaic_gpu_jobs import (
    available,
    num_sms,
    run_in_place,
    stream_k_range,
)
from lora_jax.kernels.shrink_expand.work_list import tile_items

__all__ = ["ExpandTiles", "available", "default_tiles", "expand", "supported", "tile_items"]


H_IN = ("regs", "regs_held", "smem")
"""`ExpandTiles.h_in`'s values."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpandTiles:
    """Static tiling of the Mosaic GPU expand.

    Shared memory per pipeline stage: y's block in and out (2 x ``block_m x block_n``)
    and B's ``block_n x R``, all in y's dtype.
    """

    block_m: int = 64
    """Rows of y per tile: 64 or 128 (WGMMA row groups of 64)."""
    block_n: int = 128
    """Columns of y per pipeline step: 64, 128 or 256."""
    stages: int = 4
    """Column blocks in flight."""
    programs: int = 0
    """Programs of the persistent grid; 0: one per SM (`num_sms`)."""
    h_in: str = "regs"
    """Where the WGMMA reads h's tile from: "regs" (registers; h's f32 tile comes in
    through a buffer of its own scope, which the pipeline's stages then reuse), "regs_held"
    (registers, that buffer held through the pipeline: the session-21 kernel, a probe) or
    "smem" (a shared-memory copy in the weights' dtype, held through the pipeline)."""
    variant: str = "full"
    """"full"; "copy" (probe only: y's blocks through the same pipeline, no WGMMA, so the
    difference is what the product costs)."""

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"ExpandTiles.block_m={self.block_m}: use 64 or 128.")
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"ExpandTiles.block_n={self.block_n}: use 64, 128 or 256.")
        if self.stages < 2:
            raise ValueError(f"ExpandTiles.stages={self.stages}: must be >= 2.")
        if self.programs < 0:
            raise ValueError(f"ExpandTiles.programs={self.programs}: must be >= 0 (0: auto).")
        if self.h_in not in H_IN:
            raise ValueError(f"ExpandTiles.h_in={self.h_in!r}: use one of {H_IN}.")
        if self.variant not in ("full", "copy"):
            raise ValueError(f"ExpandTiles.variant={self.variant!r}: use 'full' or 'copy'.")


SMEM_BUDGET = 200 * 1024
"""Shared memory the tiles may fill (as `mosaic_gpu_shrink.SMEM_BUDGET`)."""


def smem_bytes(tiles: ExpandTiles, rank: int, stages: int) -> int:
    """Shared memory of the pipeline's ``stages`` (y in and out, B; 2-byte dtypes) and
    h's tile (f32, and its 2-byte copy where ``h_in`` is "smem"). With ``h_in="regs"``
    h's f32 buffer is gone before the pipeline's stages are taken: the larger of the two."""
    per_stage = (2 * tiles.block_m * tiles.block_n + tiles.block_n * rank) * 2
    h_tile = tiles.block_m * rank * (4 + (2 if tiles.h_in == "smem" else 0))
    if tiles.h_in == "regs":
        return max(stages * per_stage, h_tile)
    return stages * per_stage + h_tile


def fit_stages(tiles: ExpandTiles, rank: int) -> int:
    """The deepest pipeline up to ``tiles.stages`` that fits ``SMEM_BUDGET`` (at least 2)."""
    stages = tiles.stages
    while stages > 2 and smem_bytes(tiles, rank, stages) > SMEM_BUDGET:
        stages -= 1
    return stages


def default_tiles(rank: int, item_rows: int) -> ExpandTiles:
    """The default tiles for listed tiles of ``item_rows`` rows (the step's prompt tiles,
    `work_list.segment_block_m`): as many rows, 128 columns, as many stages up to 4 as
    fit shared memory; where two stages do not fit, 64 rows.
    Session 21 (H200, one adapter, rank 64; with the tile list built in the call): 128 x
    128 tiles (2 stages) 23.8 / 82.3 us at 4096 / 16384 tokens, 64 x 128 (3) 24.6 /
    90.5, 64 x 64 (6) 26.5 / 95.4. Session 37: with h's buffer reused by the stages
    (``h_in="regs"``), rank 128 takes 3 stages of 64 x 128 (the library, one adapter, T =
    4096: 23.3 -> 21.1 us) and from 16384 tokens 128 x 128 tiles, whose 2 stages no
    longer fit beside h's buffer (T = 16384: 91.1 -> 76.8 us); rank 64 in 64-row tiles 4
    stages (T = 4096: 19.3 -> 18.7 us)."""
    tiles = ExpandTiles(block_m=item_rows, block_n=128)
    if smem_bytes(tiles, rank, 2) > SMEM_BUDGET:
        tiles = dataclasses.replace(tiles, block_m=64)
    return dataclasses.replace(tiles, stages=fit_stages(tiles, rank))


def supported(y_dtype, b_dtype, y_shape, widths, offsets, rank: int, tiles: ExpandTiles):
    """None if this kernel can run the shapes (y [T, N]), else why not (a sentence)."""
    num_tokens, width = y_shape
    if y_dtype != b_dtype or y_dtype not in (jnp.bfloat16, jnp.float16):
        return f"y and lora_b must share dtype bfloat16 or float16, got {y_dtype} / {b_dtype}"
    if width % 8:  # TMA: every stride but the last a multiple of 16 bytes
        return f"y's rows of {width} columns are not a multiple of 16 bytes"
    if num_tokens < tiles.block_m:
        return f"{num_tokens} tokens < block_m={tiles.block_m}"
    if num_tokens % 8:  # TMA boxes over the token dim come in 8-row tiles
        return f"{num_tokens} tokens are not a multiple of 8 (TMA's 8-row tiling)"
    for s, (n_s, off) in enumerate(zip(widths, offsets)):
        # A TMA box has a static shape and y's slices sit side by side: a block that
        # crossed a slice's edge would write the next slice's columns.
        if n_s % tiles.block_n or off % tiles.block_n:
            return (
                f"slice {s} (columns [{off}, {off + n_s})) is not in whole "
                f"block_n={tiles.block_n} blocks"
            )
    if rank % 16 or not 16 <= rank <= 128:
        return f"rank={rank} is not a multiple of 16 in [16, 128]"
    if smem_bytes(tiles, rank, 2) > SMEM_BUDGET:
        return (
            f"two stages of {tiles.block_m} x {tiles.block_n} tiles at rank {rank} need "
            f"{smem_bytes(tiles, rank, 2)} bytes of shared memory (> {SMEM_BUDGET})"
        )
    return None


def _kernel_body(
    items_ref,  # [3, NT] int32 (tile_items): tile, slot, count
    *refs,
    num_slices: int,
    has_ranks: bool,
    rank: int,
    blocks: tuple[int, ...],
    col_blocks: tuple[int, ...],
    programs: int,
    sub: int,
    tiles: ExpandTiles,
):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ranks_ref, refs = (refs[0], refs[1:]) if has_ranks else (None, refs)
    h_ref, b_refs, y_ref = refs[0], refs[1 : 1 + num_slices], refs[-1]
    bm, bn = tiles.block_m, tiles.block_n
    dtype = y_ref.dtype

    def item(it):  # each listed tile is ``sub`` tiles of block_m rows
        return items_ref[0, it // sub] * sub + it % sub, items_ref[1, it // sub]

    def slice_run(tile_slot, s, s_lo, s_hi):
        _slice_run(s, *tile_slot, s_lo, s_hi)

    def _slice_run(s, tile, slot, s_lo, s_hi):
        def load_h(h_smem, barrier):  # h's tile in the weights' dtype, in registers
            plgpu.copy_gmem_to_smem(h_ref.at[s, pl.ds(tile * bm, bm)], h_smem, barrier)
            plgpu.barrier_wait(barrier)
            hv = h_smem[...].astype(jnp.float32)
            if has_ranks:  # rank columns past the slot's true rank add nothing
                col = jax.lax.broadcasted_iota(jnp.int32, (bm, rank), 1)
                hv = jnp.where(col < ranks_ref[s, slot], hv, jnp.float32(0))
            return hv.astype(dtype)

        def pipeline(hb):  # hb: h's tile in registers or in shared memory
            def step(_, y_smem, b_smem, o_smem):
                if tiles.variant == "copy":
                    o_smem[...] = y_smem[...]
                    return

                def mma(acc_ref):
                    plgpu.wgmma(acc_ref, hb, b_smem.transpose((1, 0)))
                    return acc_ref[...]

                acc = pl.run_scoped(mma, plgpu.ACC((bm, bn), jnp.float32))
                o_smem[...] = (acc + y_smem[...].astype(jnp.float32)).astype(dtype)

            col0 = col_blocks[s] + s_lo
            y_spec = plgpu.BlockSpec((bm, bn), lambda j: (tile, col0 + j))
            plgpu.emit_pipeline(
                step,
                grid=(s_hi - s_lo,),
                in_specs=[y_spec, plgpu.BlockSpec((bn, rank), lambda j: (s_lo + j, 0))],
                out_specs=[y_spec],
                max_concurrent_steps=tiles.stages,
            )(y_ref, b_refs[s].at[slot], y_ref)

        h_scratch = (plgpu.SMEM((bm, rank), h_ref.dtype), plgpu.Barrier(num_arrivals=1))
        if tiles.h_in == "regs":  # h's buffer is free again before the stages are taken
            hb = pl.run_scoped(load_h, *h_scratch)
            plgpu.commit_smem()  # every thread has read it before a TMA copy reuses it
            pipeline(hb)
        elif tiles.h_in == "regs_held":
            pl.run_scoped(lambda h_smem, barrier: pipeline(load_h(h_smem, barrier)), *h_scratch)
        else:

            def held(h_smem, barrier, hb_smem):
                hb_smem[...] = load_h(h_smem, barrier)
                plgpu.commit_smem()
                pipeline(hb_smem)

            pl.run_scoped(held, *h_scratch, plgpu.SMEM((bm, rank), dtype))

    walk_slice_runs(
        items_ref[2, 0] * sub, blocks=blocks, programs=programs, item=item, run=slice_run
    )


def walk_slice_runs(num_items, *, blocks: tuple[int, ...], programs: int, item, run):
    """This program's share of a persistent grid over the step's (item, column block)
    units: ``num_items`` items (tiles, or work-list blocks), each ``sum(blocks)`` column
    blocks long (slice after slice), laid end to end; each program takes an equal run of
    them (`stream_k_range`). For each item its run touches, ``ctx = item(i)`` once, then
    ``run(ctx, s, lo, hi)`` for each slice ``s`` whose column blocks [lo, hi) it covers."""
    units = sum(blocks)
    first_unit = [sum(blocks[:s]) for s in range(len(blocks))]
    start, end, first_item, count = stream_k_range(
        jax.lax.axis_index("prog"),
        num_items,
        num_slices=1,
        job_steps=units,
        unit_steps=1,
        programs=programs,
    )

    def body(i, carry):
        it = first_item + i
        ctx = item(it)
        lo = jnp.maximum(start, it * units) - it * units
        hi = jnp.minimum(end, it * units + units) - it * units
        for s in range(len(blocks)):
            s_lo = jnp.maximum(lo, first_unit[s]) - first_unit[s]
            s_hi = jnp.minimum(hi, first_unit[s] + blocks[s]) - first_unit[s]

            @pl.when(s_hi > s_lo)
            def _(s=s, s_lo=s_lo, s_hi=s_hi):
                run(ctx, s, s_lo, s_hi)

        return carry

    jax.lax.fori_loop(0, count, body, jnp.int32(0))


def expand(
    y: jax.Array,
    h: jax.Array,
    lora_b: tuple[jax.Array, ...],
    items: jax.Array,
    slot_ranks: jax.Array | None,
    *,
    offsets: tuple[int, ...],
    tiles: ExpandTiles,
    item_rows: int | None = None,
    interpret=None,
) -> jax.Array:
    """y with the listed tiles' (`tile_items`) products added, in place; every other row
    of y is left as it was. h: [S, T, R] float; lora_b: S arrays [L, n_s, R].
    ``item_rows``: the rows of the listed tiles (their ``block_m``; default
    ``tiles.block_m``), a multiple of ``tiles.block_m``. ``interpret``: as
    `mosaic_gpu_jobs.run_in_place` (the interpreter's WGMMA reads its left operand from
    shared memory only: ``tiles.h_in="smem"``)."""

    num_slices = len(lora_b)
    rank = lora_b[0].shape[2]
    widths = tuple(b.shape[1] for b in lora_b)
    why = supported(y.dtype, lora_b[0].dtype, y.shape, widths, offsets, rank, tiles)
    if why is not None:
        raise ValueError(f"mosaic_gpu expand: {why}.")
    tiles = dataclasses.replace(tiles, stages=fit_stages(tiles, rank))
    blocks = tuple(n // tiles.block_n for n in widths)
    item_rows = item_rows or tiles.block_m
    if item_rows % tiles.block_m:
        raise ValueError(
            f"mosaic_gpu expand: item_rows={item_rows} is not a multiple of "
            f"block_m={tiles.block_m}."
        )
    sub = item_rows // tiles.block_m
    programs = min(tiles.programs or num_sms(), items.shape[1] * sub * sum(blocks))
    has_ranks = slot_ranks is not None
    body = functools.partial(
        _kernel_body,
        num_slices=num_slices,
        has_ranks=has_ranks,
        rank=rank,
        blocks=blocks,
        col_blocks=tuple(off // tiles.block_n for off in offsets),
        programs=programs,
        sub=sub,
        tiles=tiles,
    )
    inputs = [items] + ([slot_ranks] if has_ranks else []) + [h, *lora_b]
    # rows it does not store keep their value
    return run_in_place(body, inputs, y, programs, interpret)
