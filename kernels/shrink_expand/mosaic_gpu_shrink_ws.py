"""The Mosaic GPU segment shrink, warp-specialized (`MosaicTiles.warp_specialized`).

The same persistent stream-K job walk as `mosaic_gpu_shrink` (`mosaic_gpu_jobs`), on jax's
warp-specialized pipeline: one warpgroup issues every TMA copy of a program's run of jobs,
one or two others (`MosaicTiles.compute_wgs`) run the WGMMAs and store the pieces. Off by
default: it ran 1.7-8 % slower than the one-warpgroup kernel on an H100 (session 56) and
1-5 % slower on an H200 (session 57).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lora_jax.kernels.shrink_expand.mosaic_gpu_jobs import (
    Plan,
    in_specs,
    job_at,
    run_jobs,
    store_piece,
)

MEMORY_REGISTERS = 40
"""Registers a thread of the warp-specialized kernel's copy warpgroup keeps (jax's advice
for Hopper); the WGMMA warpgroup gets the rest."""


def kernel_body(
    items_ref,
    *refs,
    plan: Plan,
):
    """`mosaic_gpu_shrink`'s kernel body on warpgroups of axis "wg": the last issues
    every TMA copy of the run's jobs, the others (``tiles.compute_wgs``, each a share of
    the tile's rows) run the WGMMAs and store their rows of each job's piece. All walk the
    same jobs; the pipeline's buffers are allocated once for the whole run."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ranks_ref, x_ref, a_refs, o_ref, run = run_jobs(items_ref, refs, plan)
    rank, scale, tiles, bm = plan.rank, plan.scale, plan.tiles, plan.tiles.block_m
    wgs = tiles.compute_wgs
    hb = bm // wgs  # rows a WGMMA warpgroup takes
    wg = jax.lax.axis_index("wg")

    def pipeline(body, tile, k0, steps, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=in_specs(tile, k0, rank, tiles),
            wg_axis="wg",
            num_compute_wgs=wgs,
            max_concurrent_steps=tiles.stages,
            compute_context=compute_context,
        )

    def unused(*_, **__):
        return None

    zero = jnp.int32(0)  # a traced grid, as every job's: the same buffers
    allocs = pipeline(unused, zero, zero, zero + plan.job_steps, unused).get_allocations(
        x_ref, a_refs[0].at[0]
    )

    def scope(pipeline_allocs, o_smem):
        def segment(i, carry):
            sid, tile, slot, first, count, k0, steps, whole = job_at(items_ref, i, run, plan)
            for s in range(plan.num_slices):

                @pl.when(sid == s)
                def _(s=s):
                    def mma(_, x_smem, a_smem, acc_ref):
                        rows = x_smem if wgs == 1 else x_smem.at[pl.ds(wg * hb, hb)]
                        plgpu.wgmma(acc_ref, rows, a_smem.transpose((1, 0)))
                        plgpu.wgmma_wait(1)
                        return acc_ref

                    def compute_context(eval_pipeline):
                        def acc_scope(acc_ref):
                            eval_pipeline(acc_ref)
                            store_piece(
                                acc_ref[...], o_smem.at[wg] if wgs > 1 else o_smem,
                                o_ref.at[s], tile=tile, first=first, count=count,
                                whole=whole, ranks_ref=ranks_ref, s=s, slot=slot,
                                scale=scale, bm=bm, row0=wg * hb if wgs > 1 else None,
                            )  # fmt: skip

                        pl.run_scoped(acc_scope, plgpu.ACC((hb, rank), jnp.float32))

                    pipeline(mma, tile, k0, steps, compute_context)(
                        x_ref, a_refs[s].at[slot], allocations=pipeline_allocs
                    )

            return carry

        jax.lax.fori_loop(0, run[3], segment, jnp.int32(0))

    pl.run_scoped(
        scope,
        pipeline_allocs=allocs,
        o_smem=plgpu.SMEM((bm, rank) if wgs == 1 else (wgs, hb, rank), jnp.float32),
        collective_axes="wg",
    )
