"""Probe kernel: the one-adapter prefill shrink with 2 CTAs of a cluster sharing A's tile.

``out[t] = scale * x[t] @ A[slot].T`` (f32 [T, R]) for a step whose tokens all use one
adapter (issue #3's worst cells: 4096 tokens, rank 128, one adapter, 58 % of the roofline).
The library's Mosaic shrink reads the whole of A's hidden range from L2 for every 128-row
tile of x; here the two CTAs of a cluster take neighbouring row tiles of one hidden range,
and A's tile is loaded once and multicast into both SMs' shared memory (TMA multicast,
``BlockSpec(collective_axes=("cluster",))`` in jax's warp-specialized pipeline: one
warpgroup issues the copies, ``wgs`` warpgroups multiply).

A job is (pair of row tiles, hidden split); cluster ``c`` runs jobs ``c, c + C, ...`` of
the ``T / (2 * block_m) * split`` jobs; both CTAs of a cluster walk the same jobs in
lockstep (the multicast needs it). A split's partial is added into a zeroed output by TMA
reduce-add. ``cluster=1`` runs the same kernel without the multicast: the probe's control.

Not part of the library: a probe for `benchmarks/cluster_probe.py` (GPU, Hopper), run
beside ``lora_jax.ops.lora_shrink`` before anything of it moves into the segment shrink.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def cluster_shrink(
    x: jax.Array,
    a: jax.Array,
    slot: jax.Array,
    *,
    scale: float = 1.0,
    block_m: int = 128,
    block_k: int = 64,
    stages: int = 4,
    split: int = 4,
    cluster: int = 2,
    wgs: int = 1,
    programs: int = 132,
) -> jax.Array:
    """x [T, H], a [L, R, H] (bf16 / fp16), slot int32 [1] -> f32 [T, R] of that slot.

    T must be a multiple of ``cluster * block_m``, H of ``block_k * split``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_tokens, hidden = x.shape
    rank = a.shape[1]
    pair = cluster * block_m
    if num_tokens % pair or hidden % (block_k * split) or block_m % wgs:
        raise ValueError(
            f"cluster_shrink: T={num_tokens} must be a multiple of cluster*block_m={pair}, "
            f"H={hidden} of block_k*split={block_k * split}, block_m of wgs={wgs}."
        )
    steps = hidden // block_k // split
    jobs = num_tokens // pair * split
    clusters = min(programs // cluster, jobs)
    hb = block_m // wgs

    def body(slot_ref, x_ref, a_ref, o_ref):
        ci = jax.lax.axis_index("cluster") if cluster > 1 else 0
        c = jax.lax.axis_index("prog")
        mine = (jobs - c + clusters - 1) // clusters
        wg = jax.lax.axis_index("wg")
        a_slot = a_ref.at[slot_ref[0]]

        def pipeline_for(fn, tile, k0, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                fn,
                grid=(steps,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((block_m, block_k), lambda k: (tile, k0 + k), delay_release=1),
                    plgpu.BlockSpec(
                        (rank, block_k),
                        lambda k: (0, k0 + k),
                        delay_release=1,
                        collective_axes=("cluster",) if cluster > 1 else (),
                    ),
                ],
                wg_axis="wg",
                num_compute_wgs=wgs,
                max_concurrent_steps=stages,
                compute_context=compute_context,
            )

        def ignore(*_, **__):
            return None

        zero = jnp.int32(0)
        allocs = pipeline_for(ignore, zero, zero, ignore).get_allocations(x_ref, a_slot)

        def scope(pipeline_allocs, o_all):
            def job(i, carry):
                j = c + i * clusters
                tile = (j // split) * cluster + ci
                k0 = (j % split) * steps

                def mma(_, x_smem, a_smem, acc_ref):
                    plgpu.wgmma(acc_ref, x_smem.at[pl.ds(wg * hb, hb)], a_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(1)
                    return acc_ref

                def compute_context(eval_pipeline):
                    def acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        o_smem = o_all.at[wg]
                        o_smem[...] = acc_ref[...] * jnp.float32(scale)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            o_smem,
                            o_ref.at[pl.ds(tile * block_m + wg * hb, hb)],
                            reduction_op="add" if split > 1 else None,
                        )
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                    pl.run_scoped(acc_scope, plgpu.ACC((hb, rank), jnp.float32))

                pipeline_for(mma, tile, k0, compute_context)(
                    x_ref, a_slot, allocations=pipeline_allocs
                )
                return carry

            jax.lax.fori_loop(0, mine, job, jnp.int32(0))

        pl.run_scoped(
            scope,
            pipeline_allocs=allocs,
            o_all=plgpu.SMEM((wgs, hb, rank), jnp.float32),
            collective_axes="wg",
        )

    mesh_kw = dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}
    ref = jax.new_ref(jnp.zeros((num_tokens, rank), jnp.float32))
    pl.kernel(
        body,
        out_type=(),
        mesh=plgpu.Mesh(
            grid=(clusters,),
            grid_names=("prog",),
            num_threads=wgs + 1,
            thread_name="wg",
            **mesh_kw,
        ),  # fmt: skip
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(slot, x, a, ref)
    return jax.freeze(ref)


def lower_for_cuda(tokens=4096, hidden=4096, rank=128, **kw) -> str:
    """The kernel's CUDA lowering as text (runs on a CPU: checks that it lowers)."""
    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((8, rank, hidden), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((1,), jnp.int32)
    f = jax.jit(functools.partial(cluster_shrink, **kw))
    return f.trace(x, a, s).lower(lowering_platforms=("cuda",)).as_text()
