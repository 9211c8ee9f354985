"""The public, jitted expand `lora_expand` (importable from api.py too): argument checks,
tile choice, then the backend (the per-token kernel, the Mosaic GPU split of routing.py,
or pallas_triton.py's expand). Its metadata arguments are those of api.py's `lora_shrink`.

Example::

    from lora_jax.kernels import lora_expand
    y = lora_expand(y, h, (lora_b,), offsets=(0,), **meta)            # [T, N]
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from lora_jax.kernels.shrink_expand import (
    checks,
    pallas_triton,
    pallas_triton_bgmv,
    routing,
)
from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes
from lora_jax.kernels.shrink_expand.tuning_per_token import use_per_token
from lora_jax.kernels.shrink_expand.work_list import get_work_list


@checks.static_args
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
    checks.check_float("y", y)
    checks.check_float("h", h)
    rank = lora_b[0].shape[-1]
    max_loras = lora_b[0].shape[0]
    if h.shape != (len(lora_b), num_tokens, rank):
        raise ValueError(
            f"lora_expand: h has shape {h.shape}; expected [S, T, R] = "
            f"{(len(lora_b), num_tokens, rank)}."
        )
    checks.check_b_slices("lora_expand", lora_b, offsets, max_loras, rank, width)
    checks.check_meta(
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
    if num_tokens == 0:  # an empty batch: nothing to add
        return y
    if block_sizes is None:
        block_sizes = BlockSizes.get_default(
            "expand",
            num_tokens=num_tokens,
            hidden=width,
            rank=rank,
            per_token=use_per_token(tokens_per_slot, rank, num_tokens),
            # the blocks' fill, where every token goes to the Triton kernel
            tokens_per_slot=tokens_per_slot if prompt_tiles == "none" else None,
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
    tiles = routing.expand_tiles(mosaic, y, lora_b, offsets, interpret, prompt_tiles)
    if tiles is not None:
        return routing.tiles_expand(
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
