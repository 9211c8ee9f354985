"""Mosaic GPU (Hopper: TMA + WGMMA) shrink for tiles of x made of a few runs of one adapter.

``out[s, t] = scale * x[t] @ A_s[slot].T`` in f32 for the pieces that
`work_list.segment_items` lists: a prompt's tokens are adjacent in x, so an aligned tile
of ``block_m`` rows holds one run of one adapter, or a few where prompts meet. Such a
tile is one rectangle of x, so the tensor memory accelerator (TMA) streams it (and the
piece's adapter rows) into shared memory for the warpgroup MMA, where the Triton kernels
gather row by row.

Tokens outside the pieces (decode, shuffled batches, unmapped tokens) are left to the
Triton shrink: `work_list.build_segments` splits a step between the two, and
`lora_jax.kernels.lora_shrink` runs the Triton kernel on its share first (it writes or
zeroes every row), then this one writes its pieces in place.

The kernel is persistent: one program per SM walks a share of the step's work. A job is
one (piece, slice): the whole tile through WGMMA into a ``block_m`` x R f32 accumulator
over the hidden size, then only the piece's rows stored, by a ladder of power-of-two TMA
row copies (a TMA box has a static shape). The jobs' k steps are laid end to end and each
program takes an equal run of them (stream-K): a job that one program covers whole is
stored plainly, a part of a job is added by TMA reduce-add (the Triton kernel zeroed its
rows). When the jobs fit the programs, a run is one job's ``1 / split`` share
(`pick_split`), so a step of one adapter's prompts splits evenly; when prompt boundaries
add pieces past one per program, the runs lengthen instead of spilling a second wave.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

TARGET_ITEMS = 132
"""Job shares (piece x slice x hidden split) to aim for at one piece per tile: one per SM
of an H200 (132 SMs; a program's 192 KiB of shared memory at rank 128 leaves room for
one). Session 10: tiles x split = 128
ran T = 1024 / 2048 / 4096 at splits 16 / 8 / 4; T = 4096, rank 128, split 2 or 8 instead
of 4: 19.3 or 21.7 us instead of 16.2."""


@functools.cache
def num_sms() -> int:
    """Programs of the persistent grid: the first GPU's SM count (``TARGET_ITEMS`` where
    jax does not say, or off a GPU, as when lowering for CUDA on a CPU)."""
    try:
        return int(jax.devices("gpu")[0].core_count)
    except Exception:  # noqa: BLE001 - no GPU backend, or no core_count on this device
        return TARGET_ITEMS


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTiles:
    """Static tiling of the Mosaic GPU shrink.

    Example::

        items, _ = work_list.segment_items(idx, block_m=128, max_pieces=4)
        out = shrink(x, (a,), items, out, None, scale=1.0, tiles=MosaicTiles(block_m=128))
    """

    block_m: int = 128
    """Rows of x per tile: 64, 128 or 256 (WGMMA row groups of 64; a power of two, so the
    store ladder's copies cover every row count)."""
    block_k: int = 64
    """Hidden columns per pipeline step (64 bf16 = one 128-byte swizzle row)."""
    stages: int = 4
    """TMA copies in flight (shared memory: stages x (block_m + R) x block_k x 2 bytes)."""
    split_k: int = 0
    """Hidden splits per piece; 0 picks one from the tile count (`pick_split`)."""
    programs: int = 0
    """Programs of the persistent grid; 0: one per SM (`num_sms`)."""
    warp_specialized: bool = False
    """A warpgroup of its own issues the TMA copies while another runs the WGMMAs and the
    stores (jax's warp-specialized pipeline, `_kernel_body_ws`), instead of one warpgroup
    doing both. Its buffers and the f32 output tile are live together (`smem_bytes`).
    Session 56 (H100, benchmarks/RESULTS.md): 3-8 % slower than one warpgroup at 1024 and
    4096 tokens, ranks 64 and 128, 64- and 128-row tiles; so off by default."""
    compute_wgs: int = 1
    """WGMMA warpgroups of the warp-specialized form: 2 give each half of a 128- or 256-row
    tile to one of them (each keeps half the accumulator in its registers). Session 56
    (H100): within 3.5 % of one, both slower than the one-warpgroup kernel."""

    def __post_init__(self):
        if self.block_m not in (64, 128, 256):
            raise ValueError(f"MosaicTiles.block_m={self.block_m}: use 64, 128 or 256.")
        if self.block_k not in (32, 64, 128):
            raise ValueError(f"MosaicTiles.block_k={self.block_k}: use 32, 64 or 128.")
        if self.stages < 2:
            raise ValueError(f"MosaicTiles.stages={self.stages}: must be >= 2.")
        if self.split_k < 0:
            raise ValueError(f"MosaicTiles.split_k={self.split_k}: must be >= 0 (0: auto).")
        if self.programs < 0:
            raise ValueError(f"MosaicTiles.programs={self.programs}: must be >= 0 (0: auto).")
        if self.compute_wgs not in (1, 2) or (
            self.compute_wgs == 2 and (not self.warp_specialized or self.block_m < 128)
        ):
            raise ValueError(
                f"MosaicTiles.compute_wgs={self.compute_wgs}: use 1, or 2 with "
                f"warp_specialized=True and block_m >= 128 (got {self.warp_specialized}, "
                f"{self.block_m})."
            )


SMEM_BUDGET = 200 * 1024
"""Shared memory the default tiles may fill: the pipeline's buffers, or the f32 output
tile, whichever is larger (one scope after the other; an H200 block may opt in to 227 KiB,
the rest is left to barriers and scratch)."""
MAX_STAGES = 6


def smem_bytes(tiles: MosaicTiles, rank: int) -> int:
    """Shared memory the kernel's scopes fill at once: the pipeline's buffers or the f32
    output tile, one scope after the other; both together when warp-specialized."""
    buffers = tiles.stages * (tiles.block_m + rank) * tiles.block_k * 2
    out = tiles.block_m * rank * 4
    return buffers + out if tiles.warp_specialized else max(buffers, out)


def default_tiles(rank: int, block_m: int = 128, *, warp_specialized: bool = False) -> MosaicTiles:
    """The default tiles at this rank: the deepest pipeline, 4 to ``MAX_STAGES`` copies in
    flight, whose buffers fit ``SMEM_BUDGET``, and so does the f32 output tile: the two
    live in scopes one after the other (the pipeline's for the k steps, the tile's for the
    store), so the larger of the two counts. 6 stages at every rank up to 128, 64- or
    128-row tiles. Session 12 (H200, the kernel alone, rank 64): 6 stages instead of 4 ran
    2-5 % faster (T = 4096: 13.4 -> 13.1 us; T = 16384 prompts over 8 adapters: 45.8 ->
    43.3 us); 256-row tiles ran slower (14.9 us at T = 4096). Sessions 38-39 (rank 128,
    128-row tiles, which had 4 stages while the two scopes were counted together): T =
    8192 one adapter 25.9 -> 25.0 us, prompts over 8 adapters 29.5 -> 28.9; T = 16384 one
    adapter 43.5 -> 42.3 (session 38) and 44.5 -> 43.5, prompts over 8 52.8 -> 51.0."""
    tiles = MosaicTiles(block_m=block_m, warp_specialized=warp_specialized)
    deepest = dataclasses.replace(tiles, stages=MAX_STAGES)
    while deepest.stages > tiles.stages and smem_bytes(deepest, rank) > SMEM_BUDGET:
        deepest = dataclasses.replace(deepest, stages=deepest.stages - 1)
    return deepest


def supported(x_dtype, a_dtype, num_tokens: int, hidden: int, rank: int, tiles: MosaicTiles):
    """None if this kernel can run the shapes, else why not (a sentence)."""
    if x_dtype != a_dtype or x_dtype not in (jnp.bfloat16, jnp.float16):
        return f"x and lora_a must share dtype bfloat16 or float16, got {x_dtype} / {a_dtype}"
    if num_tokens < tiles.block_m:
        return f"{num_tokens} tokens < block_m={tiles.block_m}"
    if num_tokens % 8:  # TMA boxes over the token dim come in 8-row tiles
        return f"{num_tokens} tokens are not a multiple of 8 (TMA's 8-row tiling)"
    if hidden % tiles.block_k:
        return f"hidden={hidden} is not a multiple of block_k={tiles.block_k}"
    if rank % 32 or not 32 <= rank <= 128:
        # A TMA copy starts at a 128-byte aligned shared-memory row: a piece may start at
        # any row of the f32 tile, so its rows must be 128 bytes (ranks 16: misaligned).
        # Past 128, the f32 accumulator outgrows one warpgroup's registers.
        return f"rank={rank} is not a multiple of 32 in [32, 128]"
    return None


def pick_split(num_tiles: int, num_slices: int, hidden: int, tiles: MosaicTiles) -> int:
    """A power-of-two hidden split giving at most TARGET_ITEMS job shares at one piece per
    tile, >= 4 k steps each (the persistent grid's shortest run, `stream_k_range`)."""
    if tiles.split_k:
        return tiles.split_k
    steps = hidden // tiles.block_k
    split = 1
    # About one piece per tile (prompts), not the list's capacity (pieces per tile bound).
    while num_tiles * num_slices * split * 2 <= TARGET_ITEMS and steps % (split * 2) == 0:
        if steps // (split * 2) < 4:
            break
        split *= 2
    return split


def _store_rows(
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


def _store_piece(
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
            _store_rows(o_smem, o_at, src, dst, count, rows, add=add)


@dataclasses.dataclass(frozen=True)
class _Plan:
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


def _jobs(items_ref, refs, plan: _Plan):
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


def _job(items_ref, i, run, plan: _Plan):
    """The ``i``-th job of a run: (slice, tile, slot, first row, rows, k0, steps, whole)."""
    start, end, first_job, _ = run
    job, k0, steps, whole = stream_k_segment(i, start, end, first_job, job_steps=plan.job_steps)
    piece, sid = job // plan.num_slices, job % plan.num_slices
    tile, slot = items_ref[0, piece], items_ref[1, piece]
    first, count = items_ref[2, piece], items_ref[3, piece]
    return sid, tile, slot, first, count, k0, steps, whole


def _in_specs(tile, k0, rank: int, tiles: MosaicTiles):
    """The pipeline's TMA blocks: x's tile rows and A's rank rows over k steps from ``k0``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bm, bk = tiles.block_m, tiles.block_k
    return [
        plgpu.BlockSpec((bm, bk), lambda k: (tile, k0 + k), delay_release=1),
        plgpu.BlockSpec((rank, bk), lambda k: (0, k0 + k), delay_release=1),
    ]


def _kernel_body(
    items_ref,  # [5, NI] int32 (work_list.segment_items): tile, slot, first, rows, live
    *refs,
    plan: _Plan,
):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ranks_ref, x_ref, a_refs, o_ref, run = _jobs(items_ref, refs, plan)
    rank, scale, tiles, bm = plan.rank, plan.scale, plan.tiles, plan.tiles.block_m

    def segment(i, carry):
        sid, tile, slot, first, count, k0, steps, whole = _job(items_ref, i, run, plan)
        for s in range(plan.num_slices):

            @pl.when(sid == s)
            def _(s=s):

                def mma(acc_ref):
                    plgpu.emit_pipeline(
                        lambda _, x_smem, a_smem: plgpu.wgmma(
                            acc_ref, x_smem, a_smem.transpose((1, 0))
                        ),
                        grid=(steps,),
                        in_specs=_in_specs(tile, k0, rank, tiles),
                        max_concurrent_steps=tiles.stages,
                    )(x_ref, a_refs[s].at[slot])
                    return acc_ref[...]

                acc = pl.run_scoped(mma, plgpu.ACC((bm, rank), jnp.float32))

                def store(o_smem):
                    _store_piece(
                        acc, o_smem, o_ref.at[s], tile=tile, first=first, count=count,
                        whole=whole, ranks_ref=ranks_ref, s=s, slot=slot, scale=scale, bm=bm,
                    )  # fmt: skip

                pl.run_scoped(store, plgpu.SMEM((bm, rank), jnp.float32))

        return carry

    jax.lax.fori_loop(0, run[3], segment, jnp.int32(0))


MEMORY_REGISTERS = 40
"""Registers a thread of the warp-specialized kernel's copy warpgroup keeps (jax's advice
for Hopper); the WGMMA warpgroup gets the rest."""


def _kernel_body_ws(
    items_ref,
    *refs,
    plan: _Plan,
):
    """`_kernel_body` on warpgroups of axis "wg": the last issues every TMA copy of the
    run's jobs, the others (``tiles.compute_wgs``, each a share of the tile's rows) run the
    WGMMAs and store their rows of each job's piece. All walk the same jobs; the
    pipeline's buffers are allocated once for the whole run."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ranks_ref, x_ref, a_refs, o_ref, run = _jobs(items_ref, refs, plan)
    rank, scale, tiles, bm = plan.rank, plan.scale, plan.tiles, plan.tiles.block_m
    wgs = tiles.compute_wgs
    hb = bm // wgs  # rows a WGMMA warpgroup takes
    wg = jax.lax.axis_index("wg")

    def pipeline(body, tile, k0, steps, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=_in_specs(tile, k0, rank, tiles),
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
            sid, tile, slot, first, count, k0, steps, whole = _job(items_ref, i, run, plan)
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
                            _store_piece(
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


def shrink(
    x: jax.Array,
    lora_a: tuple[jax.Array, ...],
    items: jax.Array,
    out: jax.Array,
    slot_ranks: jax.Array | None,
    *,
    scale: float,
    tiles: MosaicTiles,
    interpret=None,
) -> jax.Array:
    """Writes the pieces of ``items`` (`work_list.segment_items`) into ``out`` [S, T, R] f32, in
    place (``out`` must be zero in their rows: parts of a job are added), and returns it.
    Every other row of ``out`` is left as it was. ``interpret``: as `run_in_place`."""

    num_tokens, hidden = x.shape
    num_slices = len(lora_a)
    rank = lora_a[0].shape[1]
    why = supported(x.dtype, lora_a[0].dtype, num_tokens, hidden, rank, tiles)
    if why is not None:
        raise ValueError(f"mosaic_gpu shrink: {why}.")
    num_pieces = items.shape[1]
    split = pick_split(-(-num_tokens // tiles.block_m), num_slices, hidden, tiles)
    job_steps = hidden // tiles.block_k
    programs = min(tiles.programs or num_sms(), num_pieces * num_slices * split)
    has_ranks = slot_ranks is not None
    plan = _Plan(
        num_slices=num_slices,
        has_ranks=has_ranks,
        rank=rank,
        scale=scale,
        job_steps=job_steps,
        unit_steps=job_steps // split,
        programs=programs,
        tiles=tiles,
    )
    body = functools.partial(_kernel_body_ws if tiles.warp_specialized else _kernel_body, plan=plan)
    inputs = [items] + ([slot_ranks] if has_ranks else []) + [x, *lora_a]
    threads = tiles.compute_wgs + 1 if tiles.warp_specialized else 1
    return run_in_place(body, inputs, out, programs, interpret, threads=threads)


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
