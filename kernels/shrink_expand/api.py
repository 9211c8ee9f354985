"""Public, jitted shrink/expand: argument checks, tile choice, then the backend.

Example::

    from lora_jax.kernels import lora_shrink, lora_expand
    h = lora_shrink(x, (lora_a,), **meta, scale=0.5)                  # f32 [1, T, R]
    y = lora_expand(y, h, (lora_b,), offsets=(0,), **meta)            # [T, N]

where ``meta`` holds ``token_lora_indices``, ``sorted_token_ids``,
``slot_token_counts``, ``slot_token_starts``, ``active_slots`` and
``num_active`` as built by ``lora_jax.mapping``, and optionally ``work_lists``
(`build_work_lists`: the per-step schedules, so that ops sharing a mapping do not
each rebuild theirs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from lora_jax.kernels.shrink_expand import (
    mosaic_gpu_expand,
    mosaic_gpu_shrink,
    pallas_triton,
    pallas_triton_bgmv,
    pallas_triton_shrink,
)
from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes, use_per_token
from lora_jax.kernels.shrink_expand.work_list import (
    PROMPT_TILES,
    SEGMENT_LONG_RANK,
    SEGMENT_MAX_PIECES,
    SEGMENT_MAX_TOKENS,
    SEGMENT_MIN_TOKENS,
    SEGMENTS_KEY,
    TILES_REST_BLOCK_MS,
    build_segments,
    get_work_list,
    segment_block_m,
)

_FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)

MOSAIC_INTERPRET = None
"""Pallas's GPU interpreter params (``plgpu.InterpretGPUParams()``, jax >= 0.11) under which
interpret-mode calls with ``mosaic=True`` run the Mosaic GPU kernels on the CPU, with tiles
the interpreter takes: the expand's h tile in shared memory, the shrink's jobs one per
program with no hidden split (the interpreter has no TMA reduce-add). None (default): such
calls raise. For tests: jax 0.11-0.12's interpreter also refuses the predicated TMA stores
that the pipelines issue (tests/kernels/test_mosaic_interpret.py lets it take them)."""


def _mosaic_interpret(interpret: bool):
    """The interpreter params for the Mosaic kernels of an ``interpret`` call, or None."""
    return MOSAIC_INTERPRET if interpret else None


def _check_float(name: str, arr) -> None:
    if arr.dtype not in _FLOATS:
        raise ValueError(f"{name} has dtype {arr.dtype}; expected bfloat16, float16 or float32.")


def _check_meta(
    num_tokens: int,
    max_loras: int,
    token_lora_indices,
    sorted_token_ids,
    slot_token_counts,
    slot_token_starts,
    slot_ranks,
    num_slices: int,
    rank: int,
):
    for name, arr, shape in (
        ("token_lora_indices", token_lora_indices, (num_tokens,)),
        ("sorted_token_ids", sorted_token_ids, (num_tokens,)),
        ("slot_token_counts", slot_token_counts, (max_loras,)),
        ("slot_token_starts", slot_token_starts, (max_loras,)),
    ):
        if tuple(arr.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(arr.shape)}; expected {shape}.")
    if slot_ranks is not None and tuple(slot_ranks.shape) != (num_slices, max_loras):
        raise ValueError(
            f"slot_ranks has shape {tuple(slot_ranks.shape)}; expected "
            f"(num_slices, max_loras) = {(num_slices, max_loras)} with values <= {rank}."
        )


def _check_a_slices(op: str, lora_a: tuple, hidden: int) -> None:
    """Every A slice: float, [max_loras, R, H], one shape for all slices."""
    for s, a in enumerate(lora_a):
        _check_float(f"lora_a[{s}]", a)
        if a.ndim != 3 or a.shape != lora_a[0].shape or a.shape[2] != hidden:
            raise ValueError(
                f"{op}: lora_a[{s}] has shape {a.shape}; every slice must be "
                f"[max_loras, R, H={hidden}] with one shape {lora_a[0].shape}."
            )


def _check_b_slices(
    op: str, lora_b: tuple, offsets: tuple, max_loras: int, rank: int, width: int
) -> None:
    """Every B slice: float, [max_loras, n_s, R], its columns inside y's width."""
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        _check_float(f"lora_b[{s}]", b)
        if b.ndim != 3 or b.shape[0] != max_loras or b.shape[2] != rank:
            raise ValueError(
                f"{op}: lora_b[{s}] has shape {b.shape}; expected "
                f"[max_loras={max_loras}, n_s, R={rank}]."
            )
        if off < 0 or off + b.shape[1] > width:
            raise ValueError(
                f"{op}: slice {s} covers columns [{off}, {off + b.shape[1]}) "
                f"outside y's {width} columns."
            )


def _segment_tiles(mosaic, x, lora_a, interpret: bool, prompt_tiles: str | None):
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


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "block_sizes",
        "mosaic",
        "prompt_tiles",
        "tokens_per_slot",
        "interpret",
    ),
)
def lora_shrink(
    x: jax.Array,
    lora_a: Sequence[jax.Array],
    *,
    token_lora_indices: jax.Array,
    sorted_token_ids: jax.Array,
    slot_token_counts: jax.Array,
    slot_token_starts: jax.Array,
    active_slots: jax.Array,
    num_active: jax.Array,
    scale: float = 1.0,
    slot_ranks: jax.Array | None = None,
    work_lists: Mapping | None = None,
    block_sizes: BlockSizes | None = None,
    mosaic: bool | None = None,
    prompt_tiles: str | None = None,
    tokens_per_slot: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``out[s, t] = scale * x[t] @ lora_a[s][idx[t]].T``, f32 [S, T, R], one launch
    (two on Hopper at prefill lengths, see ``mosaic``).

    x: [T, H]; lora_a: tuple of S arrays [max_loras, R, H]. Rows whose token
    has idx -1 are exactly 0, and so are rank columns past ``slot_ranks``.

    ``mosaic``: None (default) runs, on a Hopper GPU from ``SEGMENT_MIN_TOKENS`` tokens
    (up to ``SEGMENT_MAX_TOKENS`` below rank ``SEGMENT_LONG_RANK``) with bf16/fp16 x and A
    and a rank that is a multiple of 32 up to 128, the tiles of x made of a few runs of
    one adapter (prompts) through the Mosaic GPU TMA + WGMMA kernel (mosaic_gpu_shrink.py)
    and the other tokens through the Triton kernel. True forces that split from
    ``SEGMENT_MIN_TOKENS`` tokens (an error where the shapes do not allow it), False the
    Triton kernel alone. The Mosaic kernel computes every rank column (then zeroes those
    past ``slot_ranks``): in its regime x, not the adapter, is most of the bytes.

    ``prompt_tiles``: what the host knows of the step (`work_list.prompt_tiles`, which
    `lora_jax.mapping.make_lora_mapping` finds from numpy indices): "none" of the mapped
    tokens lie in prompt tiles (the default then runs the Triton kernel alone), "some",
    or "all" (the split runs the Mosaic kernel alone on a zeroed output: no Triton
    launch). None: not known, both kernels run. A wrong "all" leaves the tokens outside
    prompt tiles at 0.

    ``tokens_per_slot``: what the host knows of the step's mapped tokens per active slot
    (`lora_jax.mapping.LoRAMapping.tokens_per_slot`). Without ``block_sizes``, a step
    where that is 1 (or 2 at rank 16 or up to 16 tokens: `use_per_token`) runs the
    per-token kernel (pallas_triton_bgmv.py). It picks kernels only: any value gives the
    same result.

    Example::

        h = lora_shrink(x, (a_q, a_k, a_v), **meta)  # [3, T, R]
    """
    del active_slots, num_active  # the work list covers the same information
    if prompt_tiles not in (None, *PROMPT_TILES):
        raise ValueError(
            f"lora_shrink: prompt_tiles={prompt_tiles!r}; expected None or one of {PROMPT_TILES}."
        )
    lora_a = tuple(lora_a)
    if x.ndim != 2:
        raise ValueError(f"lora_shrink: x has shape {x.shape}; expected [T, H].")
    if not lora_a:
        raise ValueError("lora_shrink: lora_a is empty; expected a tuple of [L, R, H] arrays.")
    num_tokens, hidden = x.shape
    _check_float("x", x)
    _check_a_slices("lora_shrink", lora_a, hidden)
    max_loras, rank, _ = lora_a[0].shape
    _check_meta(
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
    if block_sizes is None:
        block_sizes = BlockSizes.get_default(
            "shrink",
            num_tokens=num_tokens,
            hidden=hidden,
            rank=rank,
            per_token=use_per_token(tokens_per_slot, rank, num_tokens) and not mosaic,
        )
    ranks = None if slot_ranks is None else slot_ranks.astype(jnp.int32)
    if block_sizes.per_token:
        if mosaic:
            raise ValueError(
                "lora_shrink: mosaic=True runs the segment shrink, but block_sizes has "
                "per_token=True; pass one or the other."
            )
        return pallas_triton_bgmv.shrink(
            x, lora_a, token_lora_indices, ranks, scale=float(scale), bs=block_sizes,
            interpret=interpret,
        )  # fmt: skip
    tiles = _segment_tiles(mosaic, x, lora_a, interpret, prompt_tiles)
    if tiles is None:
        tab = get_work_list(
            work_lists,
            slot_token_counts,
            slot_token_starts,
            sorted_token_ids,
            block_m=block_sizes.block_m,
        )
        return pallas_triton_shrink.shrink(
            x, lora_a, tab, ranks, scale=float(scale), bs=block_sizes, interpret=interpret
        )
    seg = _get_segments(
        work_lists,
        token_lora_indices,
        slot_token_counts,
        slot_token_starts,
        sorted_token_ids,
        block_m=block_sizes.block_m,
    )
    if prompt_tiles == "all":  # no token is left to the Triton kernel: no launch
        out = jnp.zeros((len(lora_a), num_tokens, rank), jnp.float32)
    else:  # the Triton kernel writes (or zeroes) every row, then the Mosaic kernel its pieces
        out = pallas_triton_shrink.shrink(
            x,
            lora_a,
            seg.rest[block_sizes.block_m],
            ranks,
            scale=float(scale),
            bs=block_sizes,
            interpret=interpret,
        )
    return mosaic_gpu_shrink.shrink(
        x,
        lora_a,
        seg.items,
        out,
        ranks,
        scale=float(scale),
        tiles=tiles,
        interpret=_mosaic_interpret(interpret),
    )


def _get_segments(
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


@functools.partial(
    jax.jit,
    static_argnames=(
        "offsets",
        "block_sizes",
        "mosaic",
        "prompt_tiles",
        "tokens_per_slot",
        "interpret",
    ),
)
def lora_expand(
    y: jax.Array,
    h: jax.Array,
    lora_b: Sequence[jax.Array],
    *,
    offsets: Sequence[int],
    token_lora_indices: jax.Array,
    sorted_token_ids: jax.Array,
    slot_token_counts: jax.Array,
    slot_token_starts: jax.Array,
    active_slots: jax.Array,
    num_active: jax.Array,
    slot_ranks: jax.Array | None = None,
    work_lists: Mapping[int, jax.Array] | None = None,
    block_sizes: BlockSizes | None = None,
    mosaic: bool | None = None,
    prompt_tiles: str | None = None,
    tokens_per_slot: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``y[t, off_s:off_s+n_s] += h[s, t] @ lora_b[s][idx[t]].T``, all slices in one launch
    (two on Hopper for prompts, see ``mosaic``).

    y: [T, N] (its dtype is the output's); h: [S, T, R] float; lora_b: tuple of
    S arrays [max_loras, n_s, R]; offsets: static column offset of each slice.
    Sums are formed in f32 and cast once; rows with idx -1 are returned
    bit-identical. Donate ``y`` under an outer jit to update it in place.
    ``tokens_per_slot`` picks the kernel as in `lora_shrink`.

    ``mosaic``: None (default) runs, on a Hopper GPU, the aligned tiles of y wholly of
    one slot (`work_list.tile_items`: a prompt's inside) through the Mosaic GPU TMA +
    WGMMA kernel (mosaic_gpu_expand.py) and the other tokens through the Triton kernel,
    from ``SEGMENT_MIN_TOKENS`` tokens where the host says every mapped token lies in such
    tiles (``prompt_tiles="all"``: `work_list.whole_tiles`, found by
    `lora_jax.mapping.make_lora_mapping`; then the Mosaic kernel runs alone), or from rank
    ``EXPAND_SPLIT_MIN_RANK`` unless it says "none"; with bf16/fp16 y and B, ranks a
    multiple of 16 up to 128, and slices in whole column blocks. True forces that split
    from ``SEGMENT_MIN_TOKENS`` tokens (an error where the shapes do not allow it),
    False the Triton kernel alone. A wrong "all" leaves the tokens outside whole tiles
    without their update. The Mosaic kernel reads B's padded rank columns (h's are
    masked to 0 past ``slot_ranks``): they must be finite, as the adapter slots keep them.

    Example::

        y = lora_expand(y, h, (b_q, b_k, b_v), offsets=(0, 4096, 5120), **meta)
    """
    del active_slots, num_active
    lora_b = tuple(lora_b)
    offsets = tuple(int(o) for o in offsets)
    if y.ndim != 2:
        raise ValueError(f"lora_expand: y has shape {y.shape}; expected [T, N].")
    num_tokens, width = y.shape
    if len(offsets) != len(lora_b) or not lora_b:
        raise ValueError(
            f"lora_expand: {len(lora_b)} lora_b slices but {len(offsets)} offsets; "
            "expected one offset per slice and at least one slice."
        )
    _check_float("y", y)
    _check_float("h", h)
    rank = lora_b[0].shape[-1]
    max_loras = lora_b[0].shape[0]
    if h.shape != (len(lora_b), num_tokens, rank):
        raise ValueError(
            f"lora_expand: h has shape {h.shape}; expected [S, T, R] = "
            f"{(len(lora_b), num_tokens, rank)}."
        )
    _check_b_slices("lora_expand", lora_b, offsets, max_loras, rank, width)
    _check_meta(
        num_tokens,
        max_loras,
        token_lora_indices,
        sorted_token_ids,
        slot_token_counts,
        slot_token_starts,
        slot_ranks,
        len(lora_b),
        rank,
    )
    if block_sizes is None:
        block_sizes = BlockSizes.get_default(
            "expand",
            num_tokens=num_tokens,
            hidden=width,
            rank=rank,
            per_token=use_per_token(tokens_per_slot, rank, num_tokens),
        )
    ranks = None if slot_ranks is None else slot_ranks.astype(jnp.int32)
    if block_sizes.per_token:
        return pallas_triton_bgmv.expand(
            y, h, lora_b, token_lora_indices, ranks, offsets=offsets, bs=block_sizes,
            interpret=interpret,
        )  # fmt: skip
    # Fitting the tiles to shared memory may halve block_m: the work list must use the
    # token blocks the kernel walks.
    block_sizes = pallas_triton.expand_tiles(block_sizes, lora_b, y)
    tiles = _expand_tiles(mosaic, y, lora_b, offsets, interpret, prompt_tiles)
    if tiles is not None:
        return _tiles_expand(
            y, h, lora_b, tiles, ranks, offsets, block_sizes, prompt_tiles, interpret,
            token_lora_indices, slot_token_counts, slot_token_starts, sorted_token_ids,
            work_lists,
        )  # fmt: skip
    tab = get_work_list(
        work_lists,
        slot_token_counts,
        slot_token_starts,
        sorted_token_ids,
        block_m=block_sizes.block_m,
    )
    return pallas_triton.expand(
        y,
        h,
        lora_b,
        tab,
        ranks,
        offsets=offsets,
        bs=block_sizes,
        interpret=interpret,
    )


EXPAND_SPLIT_MIN_RANK = 32
"""From this rank the expand's default takes the Mosaic + Triton split where the host does
not say "all" (nor "none") of the step's tokens lie in whole tiles."""


def _expand_tiles(mosaic, y, lora_b, offsets, interpret: bool, prompt_tiles: str | None):
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


def _tiles_expand(
    y, h, lora_b, tiles, ranks, offsets, block_sizes, prompt_tiles, interpret,
    token_lora_indices, counts, starts, sorted_ids, work_lists,
):  # fmt: skip
    """The Triton expand on the tokens outside whole tiles (unless the host says there are
    none), then the Mosaic GPU expand on the tiles, both in place."""
    block_m = block_sizes.block_m if block_sizes.block_m in TILES_REST_BLOCK_MS else 32
    block_sizes = dataclasses.replace(block_sizes, block_m=block_m)
    seg = _get_segments(
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
        interpret=_mosaic_interpret(interpret),
    )
