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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lora_jax.kernels.shrink_expand import mosaic_gpu_shrink_ws
from lora_jax.kernels.shrink_expand.mosaic_gpu_jobs import (
    Plan,
    available,
    in_specs,
    job_at,
    num_sms,
    run_in_place,
    run_jobs,
    store_piece,
    stream_k_range,
    stream_k_segment,
)

__all__ = [
    "MAX_STAGES",
    "SMEM_BUDGET",
    "MosaicTiles",
    "available",
    "default_tiles",
    "num_sms",
    "pick_split",
    "run_in_place",
    "shrink",
    "smem_bytes",
    "stream_k_range",
    "stream_k_segment",
    "supported",
]

TARGET_ITEMS = 132
"""Job shares (piece x slice x hidden split) to aim for at one piece per tile: one per SM
of an H200 (132 SMs; a program's 192 KiB of shared memory at rank 128 leaves room for
one). Session 10: tiles x split = 128
ran T = 1024 / 2048 / 4096 at splits 16 / 8 / 4; T = 4096, rank 128, split 2 or 8 instead
of 4: 19.3 or 21.7 us instead of 16.2."""


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
    stores (jax's warp-specialized pipeline, `mosaic_gpu_shrink_ws`), instead of one warpgroup
    doing both. Its buffers and the f32 output tile are live together (`smem_bytes`).
    Session 56 (H100, benchmarks/RESULTS.md): 3-8 % slower than one warpgroup at 1024 and
    4096 tokens, ranks 64 and 128, 64- and 128-row tiles; session 57 (H200, 4096 tokens):
    1-5 % slower at 128-row tiles. So off by default."""
    compute_wgs: int = 1
    """WGMMA warpgroups of the warp-specialized form: 2 give each half of a 128- or 256-row
    tile to one of them (each keeps half the accumulator in its registers). Sessions 56-57
    (H100, H200): within 3.5 % of one, both slower than the one-warpgroup kernel."""

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


def _kernel_body(
    items_ref,  # [5, NI] int32 (work_list.segment_items): tile, slot, first, rows, live
    *refs,
    plan: Plan,
):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ranks_ref, x_ref, a_refs, o_ref, run = run_jobs(items_ref, refs, plan)
    rank, scale, tiles, bm = plan.rank, plan.scale, plan.tiles, plan.tiles.block_m

    def segment(i, carry):
        sid, tile, slot, first, count, k0, steps, whole = job_at(items_ref, i, run, plan)
        for s in range(plan.num_slices):

            @pl.when(sid == s)
            def _(s=s):

                def mma(acc_ref):
                    plgpu.emit_pipeline(
                        lambda _, x_smem, a_smem: plgpu.wgmma(
                            acc_ref, x_smem, a_smem.transpose((1, 0))
                        ),
                        grid=(steps,),
                        in_specs=in_specs(tile, k0, rank, tiles),
                        max_concurrent_steps=tiles.stages,
                    )(x_ref, a_refs[s].at[slot])
                    return acc_ref[...]

                acc = pl.run_scoped(mma, plgpu.ACC((bm, rank), jnp.float32))

                def store(o_smem):
                    store_piece(
                        acc, o_smem, o_ref.at[s], tile=tile, first=first, count=count,
                        whole=whole, ranks_ref=ranks_ref, s=s, slot=slot, scale=scale, bm=bm,
                    )  # fmt: skip

                pl.run_scoped(store, plgpu.SMEM((bm, rank), jnp.float32))

        return carry

    jax.lax.fori_loop(0, run[3], segment, jnp.int32(0))


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
    plan = Plan(
        num_slices=num_slices,
        has_ranks=has_ranks,
        rank=rank,
        scale=scale,
        job_steps=job_steps,
        unit_steps=job_steps // split,
        programs=programs,
        tiles=tiles,
    )
    kernel = mosaic_gpu_shrink_ws.kernel_body if tiles.warp_specialized else _kernel_body
    body = functools.partial(kernel, plan=plan)
    inputs = [items] + ([slot_ranks] if has_ranks else []) + [x, *lora_a]
    threads = tiles.compute_wgs + 1 if tiles.warp_specialized else 1
    return run_in_place(body, inputs, out, programs, interpret, threads=threads)
