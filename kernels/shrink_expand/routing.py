"""Which tokens of a step the Mosaic GPU kernels take (aligned tiles of one adapter: a
prompt's inside) and which the Triton kernels take, for the public ops in api.py.

On a Hopper GPU at prefill lengths the shrink runs the Triton kernel on the rows outside
prompt pieces, then the Mosaic GPU segment shrink on the pieces (mosaic_gpu_shrink.py);
the expand runs the Triton kernel outside whole tiles, then the Mosaic GPU expand on
them (mosaic_gpu_expand.py). Elsewhere (decode, shuffled batches, interpret mode, other
GPUs) the Triton kernels take every token.
"""

from __future__ import annotations

import dataclasses

from lora_jax.kernels.shrink_expand import (
    mosaic_gpu_expand,
    mosaic_gpu_shrink,
    pallas_triton,
)
from lora_jax.kernels.shrink_expand.work_list import (
    PROMPT_TILES,
    SEGMENT_LONG_RANK,
    SEGMENT_MAX_PIECES,
    SEGMENT_MAX_TOKENS,
    SEGMENT_MIN_TOKENS,
    SEGMENTS_KEY,
    TILES_REST_BLOCK_MS,
    build_segments,
    segment_block_m,
)

MOSAIC_INTERPRET = None
"""Pallas's GPU interpreter params (``plgpu.InterpretGPUParams()``, jax >= 0.11) under which
interpret-mode calls with ``mosaic=True`` run the Mosaic GPU kernels on the CPU, with tiles
the interpreter takes: the expand's h tile in shared memory, the shrink's jobs one per
program with no hidden split (the interpreter has no TMA reduce-add). None (default): such
calls raise. For tests: jax 0.11-0.12's interpreter also refuses the predicated TMA stores
that the pipelines issue (tests/kernels/testmosaic_interpret.py lets it take them)."""


def mosaic_interpret(interpret: bool):
    """The interpreter params for the Mosaic kernels of an ``interpret`` call, or None."""
    return MOSAIC_INTERPRET if interpret else None


def segment_tiles(mosaic, x, lora_a, interpret: bool, prompt_tiles: str | None):
    """The Mosaic GPU segment shrink's tiles for this call, or None (Triton only)."""
    if mosaic is False or (mosaic is None and (interpret or prompt_tiles == "none")):
        return None
    num_tokens, hidden = x.shape
    tiles = mosaic_gpu_shrink.default_tiles(lora_a[0].shape[1], segment_block_m(num_tokens))
    why = mosaic_gpu_shrink.supported(
        x.dtype, lora_a[0].dtype, num_tokens, hidden, lora_a[0].shape[1], tiles
    )
    if why is None and num_tokens < SEGMENT_MIN_TOKENS:
        why = f"{num_tokens} tokens < {SEGMENT_MIN_TOKENS}"
    if why is None and interpret:
        if MOSAIC_INTERPRET is None:
            why = "interpret mode (Mosaic GPU kernels need a Hopper GPU)"
        else:  # every (piece, slice) job whole, in a program of its own
            pieces = -(-num_tokens // tiles.block_m) * SEGMENT_MAX_PIECES
            tiles = dataclasses.replace(tiles, split_k=1, programs=pieces * len(lora_a))
    if mosaic is None:
        short = num_tokens <= SEGMENT_MAX_TOKENS or lora_a[0].shape[1] >= SEGMENT_LONG_RANK
        auto = why is None and short
        return tiles if auto and mosaic_gpu_shrink.available() else None
    if why is not None:
        raise ValueError(f"lora_shrink: mosaic=True, but {why}.")
    return tiles


def get_segments(
    work_lists, token_lora_indices, counts, starts, sorted_ids, *, block_m: int, tiles=False
):
    """The step's ready-made segment schedule (`build_segments`) if it has this
    ``block_m``'s rest list (of the shrink's pieces, or with ``tiles`` of the expand's
    whole tiles), else a new one."""
    seg = None if work_lists is None else work_lists.get(SEGMENTS_KEY)
    rest = None if seg is None else seg.tiles_rest if tiles else seg.rest
    if rest is None or block_m not in rest:
        return build_segments(
            token_lora_indices,
            counts,
            starts,
            sorted_ids,
            block_ms=() if tiles else (block_m,),
            tiles_block_ms=(block_m,) if tiles else (),
        )
    num_tokens = sorted_ids.shape[0]
    cap = -(-num_tokens // segment_block_m(num_tokens)) * SEGMENT_MAX_PIECES
    if tuple(seg.items.shape) != (5, cap):
        raise ValueError(
            f"work_lists[{SEGMENTS_KEY}].items has shape {tuple(seg.items.shape)}; "
            f"expected (5, {cap}) for {num_tokens} tokens (build it with build_work_lists)."
        )
    return seg


EXPAND_SPLIT_MIN_RANK = 32
"""From this rank the expand's default takes the Mosaic + Triton split where the host does
not say "all" (nor "none") of the step's tokens lie in whole tiles."""


def expand_tiles(mosaic, y, lora_b, offsets, interpret: bool, prompt_tiles: str | None):
    """The Mosaic GPU expand's tiles for this call, or None (Triton only)."""
    if prompt_tiles not in (None, *PROMPT_TILES):
        raise ValueError(
            f"lora_expand: prompt_tiles={prompt_tiles!r}; expected None or one of {PROMPT_TILES}."
        )
    if mosaic is False or (mosaic is None and (interpret or prompt_tiles == "none")):
        return None
    num_tokens = y.shape[0]
    rank = lora_b[0].shape[2]
    tiles = mosaic_gpu_expand.default_tiles(rank, segment_block_m(num_tokens))
    widths = tuple(b.shape[1] for b in lora_b)
    why = mosaic_gpu_expand.supported(
        y.dtype, lora_b[0].dtype, y.shape, widths, offsets, rank, tiles
    )
    if why is None and num_tokens < SEGMENT_MIN_TOKENS:
        why = f"{num_tokens} tokens < {SEGMENT_MIN_TOKENS}"
    if why is None and interpret:
        if MOSAIC_INTERPRET is None:
            why = "interpret mode (Mosaic GPU kernels need a Hopper GPU)"
        else:  # the interpreter's WGMMA reads its left operand from shared memory only
            tiles = dataclasses.replace(tiles, h_in="smem")
    if mosaic is None:
        # Session 21 (H200, prompts over 8 adapters, µs): the Mosaic kernel alone ("all")
        # beat the Triton one in every cell from 1024 tokens (rank 64: 7.6 / 19.8 / 77.2
        # vs 12.2 / 25.8 / 93.8 at 1024 / 4096 / 16384 tokens). With the Triton launch for
        # the other tokens too (the host silent) it still won from rank 32 (rank 64: 9.3
        # / 22.2 / 81.2) but not at rank 16 (9.9 / 21.8 / 78.5 vs 7.5 / 21.6 / 78.7).
        wanted = prompt_tiles == "all" or rank >= EXPAND_SPLIT_MIN_RANK
        auto = why is None and wanted
        return tiles if auto and mosaic_gpu_expand.available() else None
    if why is not None:
        raise ValueError(f"lora_expand: mosaic=True, but {why}.")
    return tiles


def tiles_expand(
    y, h, lora_b, tiles, ranks, offsets, block_sizes, prompt_tiles, interpret,
    token_lora_indices, counts, starts, sorted_ids, work_lists,
):  # fmt: skip
    """The Triton expand on the tokens outside whole tiles (unless the host says there are
    none), then the Mosaic GPU expand on the tiles, both in place."""
    block_m = block_sizes.block_m if block_sizes.block_m in TILES_REST_BLOCK_MS else 32
    block_sizes = dataclasses.replace(block_sizes, block_m=block_m)
    seg = get_segments(
        work_lists, token_lora_indices, counts, starts, sorted_ids, block_m=block_m, tiles=True
    )
    if prompt_tiles != "all":
        y = pallas_triton.expand(
            y, h, lora_b, seg.tiles_rest[block_m], ranks, offsets=offsets, bs=block_sizes,
            interpret=interpret,
        )  # fmt: skip
    return mosaic_gpu_expand.expand(
        y,
        h,
        lora_b,
        seg.tiles,
        ranks,
        offsets=offsets,
        tiles=tiles,
        item_rows=segment_block_m(y.shape[0]),
        interpret=mosaic_interpret(interpret),
    )
