"""Public, jitted shrink/expand: argument checks, tile choice, then the backend. The shrink
`lora_shrink` is here, the expand `lora_expand` in api_expand.py (importable from here too).

Example::

    from lora_jax.kernels import lora_shrink, lora_expand
    h = lora_shrink(x, (lora_a,), **meta, scale=0.5)                  # f32 [1, T, R]
    y = lora_expand(y, h, (lora_b,), offsets=(0,), **meta)            # [T, N]

where ``meta`` holds ``token_lora_indices``, ``sorted_token_ids``,
``slot_token_counts``, ``slot_token_starts``, ``active_slots`` and
``num_active`` as built by ``lora_jax.mapping``, and optionally ``work_lists``
(`build_work_lists`: the per-step schedules, so that ops sharing a mapping do not
each rebuild theirs). The metadata must be one step's, as `lora_jax.mapping` builds it:
``token_lora_indices`` in ``[-1, max_loras)`` (-1 = no adapter; the mapping makes any
other value -1), the rest derived from those indices. The kernels do not check values
on the device: an index past the slots reads out of bounds in the per-token and
rectangle kernels, and metadata of another step computes other tokens' rows. The jnp
references treat an index past the slots as -1.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from lora_jax.kernels.shrink_expand import (
    checks,
    mosaic_gpu_shrink,
    pallas_triton_bgmv,
    pallas_triton_rect,
    pallas_triton_shrink,
    routing,
    tuning_long_shrink,
)
from lora_jax.kernels.shrink_expand import pallas_triton as pallas_triton  # re-exported
from lora_jax.kernels.shrink_expand.api_expand import lora_expand as lora_expand
from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes, next_pow2
from lora_jax.kernels.shrink_expand.tuning_per_token import use_per_token
from lora_jax.kernels.shrink_expand.work_list import (
    PROMPT_TILES,
    get_work_list,
    segment_block_m,
)


def _check_rect(bs: BlockSizes, num_tokens: int, whole_tiles, mosaic) -> None:
    """Tiles given with ``rect=True`` need the host's word that every mapped token lies in
    whole tiles of one slot, tiles their ``block_m`` divides."""
    tile = segment_block_m(num_tokens)
    pair = bs.block_m == 2 * tile and bs.split_k > 1
    if whole_tiles != "all" or (tile % bs.block_m and not pair) or mosaic:
        raise ValueError(
            f"lora_shrink: block_sizes has rect=True (x read in rectangles of block_m="
            f"{bs.block_m} tokens), which needs whole_tiles='all' (got {whole_tiles!r}), "
            f"a block_m dividing the host's {tile}-token tiles (or twice them with "
            f"split_k > 1) and mosaic not True (got {mosaic!r})."
        )


@checks.static_args
@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "block_sizes",
        "mosaic",
        "prompt_tiles",
        "whole_tiles",
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
    whole_tiles: str | None = None,
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

    ``whole_tiles``: what the host knows of the step's tiles wholly of one slot
    (`work_list.whole_tiles`, `LoRAMapping.whole_tiles`). Without ``block_sizes`` and
    unless ``mosaic`` is True, "all" runs rank 16 from 1024 tokens and ranks 32 / 64 from
    1024 to 16384 / 8192 over rectangles of x with no work list (`pallas_triton_rect.rect_shrink`,
    `tuning_long_shrink.rect_shrink_tiles`), ahead of the Mosaic kernel. Tiles given with
    ``rect=True`` need "all". A wrong "all" computes a tile with its first token's adapter.

    ``tokens_per_slot``: what the host knows of the step's mapped tokens per active slot
    (`lora_jax.mapping.LoRAMapping.tokens_per_slot`). Without ``block_sizes``, a step
    where that is 1 (or 2 at rank 16 or up to 16 tokens: `use_per_token`) runs the
    per-token kernel (pallas_triton_bgmv.py). It picks kernels only: any value gives the
    same result.

    Example::

        h = lora_shrink(x, (a_q, a_k, a_v), **meta)  # [3, T, R]
    """
    del active_slots, num_active  # the work list covers the same information
    for name, hint in (("prompt_tiles", prompt_tiles), ("whole_tiles", whole_tiles)):
        if hint not in (None, *PROMPT_TILES):
            raise ValueError(
                f"lora_shrink: {name}={hint!r}; expected None or one of {PROMPT_TILES}."
            )
    lora_a = tuple(lora_a)
    if x.ndim != 2:
        raise ValueError(f"lora_shrink: x has shape {x.shape}; expected [T, H].")
    if not lora_a:
        raise ValueError("lora_shrink: lora_a is empty; expected a tuple of [L, R, H] arrays.")
    num_tokens, hidden = x.shape
    checks.check_float("x", x)
    checks.check_a_slices("lora_shrink", lora_a, hidden)
    max_loras, rank, _ = lora_a[0].shape
    checks.check_meta(
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
    if num_tokens == 0:  # an empty batch: nothing to launch
        return jnp.zeros((len(lora_a), 0, rank), jnp.float32)
    defaulted = block_sizes is None
    if defaulted:
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
    rect = block_sizes if block_sizes.rect else None
    if rect is not None:
        _check_rect(rect, num_tokens, whole_tiles, mosaic)
    elif defaulted and not mosaic and whole_tiles == "all":  # ahead of the Mosaic kernel
        rank_p = max(16, next_pow2(rank))
        rect = tuning_long_shrink.rect_shrink_tiles(num_tokens, hidden, rank_p)
    if rect is not None:
        return pallas_triton_rect.rect_shrink(
            x, lora_a, token_lora_indices, ranks, scale=float(scale), bs=rect,
            interpret=interpret, tile=segment_block_m(num_tokens),
        )  # fmt: skip
    tiles = routing.segment_tiles(mosaic, x, lora_a, interpret, prompt_tiles)
    if tiles is not None and defaulted:
        block_sizes = tuning_long_shrink.segment_rest_shrink(block_sizes, num_tokens, hidden, rank)
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
    seg = routing.get_segments(
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
        interpret=routing.mosaic_interpret(interpret),
    )
