"""The persistent job walk the Mosaic GPU (Hopper) kernels share.

`mosaic_gpu_shrink` and `mosaic_gpu_expand` run one program per SM (`num_sms`,
`run_in_place`). A job is one (piece, slice) of `work_list.segment_items`; the jobs' k
steps are laid end to end and each program takes an equal run of them (stream-K,
`stream_k_range`). The shrink's two kernel bodies (one warpgroup: `mosaic_gpu_shrink`;
warp-specialized: `mosaic_gpu_shrink_ws`) share the launch's static plan (`Plan`), the walk
(`run_jobs`, `job_at`), the TMA blocks (`in_specs`) and the store of a job's piece
(`store_piece`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

if TYPE_CHECKING:
    from lora_jax.kernels.shrink_expand.mosaic_gpu_shrink import MosaicTiles

FALLBACK_SMS = 132
"""Programs where jax does not say how many SMs the GPU has: an H200's 132."""


@functools.cache
def num_sms() -> int:
    """Programs of the persistent grid: the first GPU's SM count (``FALLBACK_SMS`` where
    jax does not say, or off a GPU, as when lowering for CUDA on a CPU)."""
    try:
        return int(jax.devices("gpu")[0].core_count)
    except Exception:  # noqa: BLE001 - no GPU backend, or no core_count on this device
        return FALLBACK_SMS


@functools.cache
def available() -> bool:
    """Whether the default path may use this kernel: Mosaic GPU imports, the first GPU is
    a Hopper (WGMMA; compute capability 9.x), and ``LORA_JAX_MOSAIC_GPU`` is not "0"."""
    if os.environ.get("LORA_JAX_MOSAIC_GPU", "1") == "0":
        return False
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401

        cc = str(jax.devices("gpu")[0].compute_capability)
    except Exception:  # noqa: BLE001 - no GPU backend, or no Mosaic GPU in this jaxlib
        return False
    return cc.split(".")[0] == "9"


def store_rows(
    o_smem, out_at, src: jax.Array, dst: jax.Array, count: jax.Array, block_m: int, add: bool
):
    """Copies tile rows [src, src + count) to ``out_at`` rows [dst, dst + count): one TMA
    copy per set bit of ``count``, largest first (a TMA box has a static row count)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    done = jnp.int32(0)
    size = block_m
    while size >= 1:

        @pl.when((count & size) != 0)
        def _(size=size, done=done):
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(src + done, size)],
                out_at.at[pl.ds(dst + done, size)],
                reduction_op="add" if add else None,
            )

        done = done + (count & size)
        size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def stream_k_range(
    prog, num_pieces, *, num_slices: int, job_steps: int, unit_steps: int, programs: int
):
    """Program ``prog``'s run of the step's k steps: (start, end, first job, job count).

    A job is one (piece, slice) = ``piece * num_slices + slice``, ``job_steps`` k steps
    long; the jobs' steps are laid end to end and each program takes an equal run of
    them, never shorter than ``unit_steps`` (a job's ``1 / split`` share), so while the
    work fits the programs every run is exactly one such share.
    """
    work = num_pieces * (num_slices * job_steps)
    per = jnp.maximum(jnp.int32(unit_steps), (work + programs - 1) // programs)
    start = jnp.minimum(prog * per, work)
    end = jnp.minimum(start + per, work)
    first_job = start // job_steps
    num_jobs = jnp.where(end > start, (end - 1) // job_steps - first_job + 1, 0)
    return start, end, first_job, num_jobs


def stream_k_segment(i, start, end, first_job, *, job_steps: int):
    """The ``i``-th job a run [start, end) touches: (job, first k step, k steps, whole).
    ``whole``: the run covers the job, so no other program adds to its rows."""
    job = first_job + i
    lo = jnp.maximum(start, job * job_steps)
    steps = jnp.minimum(end, job * job_steps + job_steps) - lo
    return job, lo - job * job_steps, steps, steps == job_steps


def store_piece(
    acc, o_smem, o_at, *, tile, first, count, whole, ranks_ref, s, slot, scale, bm, row0=None
):
    """The piece's rows of a job's f32 tile ``acc`` (times ``scale``, rank columns past the
    slot's true rank zeroed) through ``o_smem`` into ``o_at``: stored where the job is
    ``whole``, added where other programs add the rest of its hidden range. ``row0``: acc
    holds only the tile's rows [row0, row0 + len(acc)) (one warpgroup's share), and only
    the piece's rows among them are written."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    src, dst = first - tile * bm, first
    rows = acc.shape[0]
    if row0 is not None:  # the piece's rows within [row0, row0 + rows) of the tile
        lo = jnp.maximum(src, row0)
        count = jnp.maximum(jnp.minimum(src + count, row0 + rows) - lo, 0)
        src, dst = lo - row0, tile * bm + lo

    acc = acc * jnp.float32(scale)
    if ranks_ref is not None:  # rank columns past the slot's true rank are exactly 0
        col = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 1)
        acc = jnp.where(col < ranks_ref[s, slot], acc, jnp.float32(0))
    o_smem[...] = acc
    plgpu.commit_smem()
    for add in (False, True):

        @pl.when(whole != add)
        def _(add=add):
            store_rows(o_smem, o_at, src, dst, count, rows, add=add)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A launch's static shape: slices, whether slot ranks come, the rank, the scale, the
    k steps of a job and of its ``1 / split`` share, the programs, the tiles."""

    num_slices: int
    has_ranks: bool
    rank: int
    scale: float
    job_steps: int
    unit_steps: int
    programs: int
    tiles: MosaicTiles


def run_jobs(items_ref, refs, plan: Plan):
    """The refs by role (slot ranks or None, x, the A slices, out), and this program's run
    of jobs (`stream_k_range`)."""
    ranks_ref, refs = (refs[0], refs[1:]) if plan.has_ranks else (None, refs)
    x_ref, a_refs, o_ref = refs[0], refs[1 : 1 + plan.num_slices], refs[-1]
    run = stream_k_range(
        jax.lax.axis_index("prog"),
        items_ref[4, 0],
        num_slices=plan.num_slices,
        job_steps=plan.job_steps,
        unit_steps=plan.unit_steps,
        programs=plan.programs,
    )
    return ranks_ref, x_ref, a_refs, o_ref, run


def job_at(items_ref, i, run, plan: Plan):
    """The ``i``-th job of a run: (slice, tile, slot, first row, rows, k0, steps, whole)."""
    start, end, first_job, _ = run
    job, k0, steps, whole = stream_k_segment(i, start, end, first_job, job_steps=plan.job_steps)
    piece, sid = job // plan.num_slices, job % plan.num_slices
    tile, slot = items_ref[0, piece], items_ref[1, piece]
    first, count = items_ref[2, piece], items_ref[3, piece]
    return sid, tile, slot, first, count, k0, steps, whole


def in_specs(tile, k0, rank: int, tiles: MosaicTiles):
    """The pipeline's TMA blocks: x's tile rows and A's rank rows over k steps from ``k0``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bm, bk = tiles.block_m, tiles.block_k
    return [
        plgpu.BlockSpec((bm, bk), lambda k: (tile, k0 + k), delay_release=1),
        plgpu.BlockSpec((rank, bk), lambda k: (0, k0 + k), delay_release=1),
    ]


def run_in_place(
    body, inputs: list, target: jax.Array, programs: int, interpret=None, *, threads: int = 1
) -> jax.Array:
    """Runs ``body(*input_refs, target_ref)`` on a persistent grid of ``programs`` (axis
    "prog", warpgroup semantics) and returns ``target`` as the kernel left it.

    ``target`` goes in as a Ref, aliased in and out of the kernel (plgpu.kernel has no
    input_output_aliases): what the kernel does not store keeps its value. ``interpret``:
    Pallas's GPU interpreter params (``plgpu.InterpretGPUParams()``, jax >= 0.11: the
    kernel runs on the CPU; for tests), None to compile for the GPU. ``threads`` > 1:
    warpgroups a program, on axis "wg"."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ref = jax.new_ref(target)
    wgs = dict(num_threads=threads, thread_name="wg") if threads > 1 else {}
    pl.kernel(
        body,
        out_type=(),
        mesh=plgpu.Mesh(grid=(programs,), grid_names=("prog",), **wgs),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({} if interpret is None else {"interpret": interpret}),
    )(*inputs, ref)
    return jax.freeze(ref)
