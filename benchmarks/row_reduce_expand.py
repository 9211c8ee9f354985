"""A probe (session 22): a Mosaic GPU expand that adds into y with TMA reduce-adds, in
any token order.

``y[t, off_s : off_s + n_s] += h[s, t] @ B_s[slot].T`` for every mapped token, walking the
same (slot, token block) work list as the Triton expand (`work_list.build_work_list`):
blocks of ``block_m`` tokens of one slot, in any order over y's rows (a shuffled batch).

Hopper's tensor memory accelerator (TMA) cannot gather rows (gather4 is Blackwell's), but
it can add a tile of shared memory into global memory (``cp.reduce.async.bulk.tensor
... .add``), and a box may be one row. So the kernel never reads y: each (block, column
block) is one WGMMA of ``block_m x R x block_n`` into registers, cast to y's dtype,
written to shared memory and added into y's rows by the TMA, one row box per token (one
box for the whole block when its tokens are consecutive rows, as inside a prompt); the L2
does the read-modify-write. h's rows are gathered the same way.

It is right (the ops harness checks it against the oracle) and slow. Session 22 (one H200,
benchmarks/RESULTS.md): a row box costs ~100 cycles of an SM whatever its width, so
4096 x 4096 at rank 64 over 8 shuffled adapters took 52.7 µs (128-column rows) and 101.9
µs (64-column rows), where the Triton expand takes 26.0; with one box per block (one
adapter) 20.9 µs, where the library's Mosaic expand, which loads y and stores it back,
takes 19.3. So it stays a probe: `benchmarks/ops.py --impls rexp[:block_m:block_n:stages
[:store]]`.

Rounding: y + bf16(h @ B.T) rounded once more, where the library's expands round y + the
f32 product once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lora_jax.kernels.shrink_expand.mosaic_gpu_expand import walk_slice_runs
from lora_jax.kernels.shrink_expand.mosaic_gpu_shrink import num_sms, run_in_place

__all__ = ["RowTiles", "expand", "supported"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowTiles:
    """Static tiling of the row-reduce expand."""

    block_m: int = 64
    """Tokens per block: the work list's ``block_m`` (64; WGMMA row groups of 64)."""
    block_n: int = 128
    """Columns of y per pipeline step: 64, 128 or 256."""
    stages: int = 4
    """B's column blocks in flight."""
    programs: int = 0
    """Programs of the persistent grid; 0: one per SM."""
    store: str = "auto"
    """"auto": one box for a block of consecutive rows, a box per row otherwise; "rows":
    a box per row always. Session 34's probes of plain row boxes: "rows_plain" stores
    each row plainly (y := the product: wrong by design, timed only); "rows_ld" loads
    y's rows (one box each, in the step, not ahead), adds, and stores them plainly."""
    hoist: bool = False
    """Read the block's token ids once per (block, slice) run, before its column steps,
    instead of in every step before each row box (session 34: does the issuing loop or
    the TMA unit set the ~100 cycles a box of session 22?)."""

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"RowTiles.block_m={self.block_m}: use 64 or 128.")
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"RowTiles.block_n={self.block_n}: use 64, 128 or 256.")
        if self.stages < 2:
            raise ValueError(f"RowTiles.stages={self.stages}: must be >= 2.")
        if self.store not in ("auto", "rows", "rows_plain", "rows_ld"):
            raise ValueError(
                f"RowTiles.store={self.store!r}: use 'auto', 'rows', 'rows_plain' or 'rows_ld'."
            )


def supported(y_dtype, b_dtype, y_shape, widths, offsets, rank: int, tiles: RowTiles):
    """None if this kernel can run the shapes (y [T, N]), else why not (a sentence)."""
    _, width = y_shape
    if y_dtype != b_dtype or y_dtype not in (jnp.bfloat16, jnp.float16):
        return f"y and lora_b must share dtype bfloat16 or float16, got {y_dtype} / {b_dtype}"
    if width % 8:
        return f"y's rows of {width} columns are not a multiple of 16 bytes"
    for s, (n_s, off) in enumerate(zip(widths, offsets)):
        if n_s % tiles.block_n or off % tiles.block_n:
            return (
                f"slice {s} (columns [{off}, {off + n_s})) is not in whole "
                f"block_n={tiles.block_n} blocks"
            )
    if rank % 16 or not 16 <= rank <= 128:
        return f"rank={rank} is not a multiple of 16 in [16, 128]"
    return None


def _kernel_body(
    wl_ref,  # [4 + block_m, NB] int32 (build_work_list): slot, first, rows, live, tokens
    *refs,
    num_slices: int,
    has_ranks: bool,
    rank: int,
    blocks: tuple[int, ...],
    col_blocks: tuple[int, ...],
    programs: int,
    tiles: RowTiles,
):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ranks_ref, refs = (refs[0], refs[1:]) if has_ranks else (None, refs)
    h_ref, b_refs, y_ref = refs[0], refs[1 : 1 + num_slices], refs[-1]
    bm, bn = tiles.block_m, tiles.block_n
    dtype = y_ref.dtype

    def _slice_run(s, blk, s_lo, s_hi):
        slot = wl_ref[0, blk]
        count = wl_ref[2, blk]
        tok0 = wl_ref[4, blk]
        if tiles.hoist:  # read once, held in registers through the column steps
            toks = [wl_ref[4 + r, blk] for r in range(bm)]
            token = toks.__getitem__
        else:  # read before each row box

            def token(r):
                return wl_ref[4 + r, blk]

        # Tokens of a slot's run sort in order, so a full block whose last token is
        # tok0 + bm - 1 is the bm consecutive rows from tok0.
        if tiles.store == "auto":
            whole = (count == bm) & (wl_ref[3 + bm, blk] - tok0 == bm - 1)
        else:
            whole = jnp.bool_(False)

        def with_bufs(h_tile, bar_rows, bar_tile, o_tile, y_rows, bar_y):
            @pl.when(whole)
            def _():
                plgpu.copy_gmem_to_smem(h_ref.at[s, pl.ds(tok0, bm)], h_tile, bar_tile)
                plgpu.barrier_wait(bar_tile)

            @pl.when(~whole)
            def _():
                for r in range(bm):
                    plgpu.copy_gmem_to_smem(
                        h_ref.at[s, pl.ds(token(r), 1)], h_tile.at[pl.ds(r, 1)], bar_rows
                    )
                plgpu.barrier_wait(bar_rows)

            hv = h_tile[...].astype(jnp.float32)
            if has_ranks:  # rank columns past the slot's true rank add nothing
                col = jax.lax.broadcasted_iota(jnp.int32, (bm, rank), 1)
                hv = jnp.where(col < ranks_ref[s, slot], hv, jnp.float32(0))
            hb = hv.astype(dtype)

            def step(idx, b_smem):
                j = idx[0]

                def mma(acc_ref):
                    plgpu.wgmma(acc_ref, hb, b_smem.transpose((1, 0)))
                    return acc_ref[...]

                acc = pl.run_scoped(mma, plgpu.ACC((bm, bn), jnp.float32)).astype(dtype)
                col = (col_blocks[s] + s_lo + j) * bn
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # step j - 2's buffer read

                @pl.when(whole)
                def _():
                    o = o_tile.at[j % 2]
                    o[...] = acc
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        o, y_ref.at[pl.ds(tok0, bm), pl.ds(col, bn)], reduction_op="add"
                    )

                @pl.when(~whole)
                def _():
                    o = o_tile.at[j % 2]
                    if tiles.store == "rows_ld":
                        for r in range(bm):
                            plgpu.copy_gmem_to_smem(
                                y_ref.at[pl.ds(token(r), 1), pl.ds(col, bn)],
                                y_rows.at[pl.ds(r, 1)],
                                bar_y,
                                predicate=r < count,
                            )
                        plgpu.barrier_wait(bar_y)
                        o[...] = (acc.astype(jnp.float32) + y_rows[...].astype(jnp.float32)).astype(
                            dtype
                        )
                    else:
                        o[...] = acc
                    plgpu.commit_smem()
                    for r in range(bm):
                        plgpu.copy_smem_to_gmem(
                            o.at[pl.ds(r, 1)],
                            y_ref.at[pl.ds(token(r), 1), pl.ds(col, bn)],
                            predicate=r < count,
                            commit_group=r == bm - 1,
                            reduction_op="add" if tiles.store in ("auto", "rows") else None,
                        )

            plgpu.emit_pipeline(
                step,
                grid=(s_hi - s_lo,),
                in_specs=[plgpu.BlockSpec((bn, rank), lambda j: (s_lo + j, 0))],
                max_concurrent_steps=tiles.stages,
            )(b_refs[s].at[slot])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(
            with_bufs,
            plgpu.SMEM((bm, rank), h_ref.dtype),
            plgpu.Barrier(num_arrivals=bm),
            plgpu.Barrier(num_arrivals=1),
            plgpu.SMEM((2, bm, bn), dtype),
            plgpu.SMEM((bm, bn) if tiles.store == "rows_ld" else (8, 8), dtype),
            plgpu.Barrier(num_arrivals=bm),
        )

    walk_slice_runs(
        wl_ref[3, 0],
        blocks=blocks,
        programs=programs,
        item=lambda blk: blk,
        run=lambda blk, s, s_lo, s_hi: _slice_run(s, blk, s_lo, s_hi),
    )


def expand(
    y: jax.Array,
    h: jax.Array,
    lora_b: tuple[jax.Array, ...],
    work_list: jax.Array,
    slot_ranks: jax.Array | None,
    *,
    offsets: tuple[int, ...],
    tiles: RowTiles,
) -> jax.Array:
    """y with every mapped token's product added, in place. h: [S, T, R] float; lora_b: S
    arrays [L, n_s, R]; ``work_list``: `build_work_list` of ``tiles.block_m`` rows."""
    num_slices = len(lora_b)
    rank = lora_b[0].shape[2]
    widths = tuple(b.shape[1] for b in lora_b)
    why = supported(y.dtype, lora_b[0].dtype, y.shape, widths, offsets, rank, tiles)
    if why is not None:
        raise ValueError(f"mosaic_gpu row expand: {why}.")
    if work_list.shape[0] != 4 + tiles.block_m:
        raise ValueError(
            f"mosaic_gpu row expand: the work list has {work_list.shape[0] - 4} token rows; "
            f"block_m={tiles.block_m}."
        )
    blocks = tuple(n // tiles.block_n for n in widths)
    programs = min(tiles.programs or num_sms(), work_list.shape[1] * sum(blocks))
    has_ranks = slot_ranks is not None
    body = functools.partial(
        _kernel_body,
        num_slices=num_slices,
        has_ranks=has_ranks,
        rank=rank,
        blocks=blocks,
        col_blocks=tuple(off // tiles.block_n for off in offsets),
        programs=programs,
        tiles=tiles,
    )
    inputs = [work_list] + ([slot_ranks] if has_ranks else []) + [h, *lora_b]
    return run_in_place(body, inputs, y, programs)
