"""The (slot, token block) schedule that both kernels walk.

vLLM grids over (slot, token block) and lets most programs exit at once
(it knows the active count on the host). Under jit we only have device
arrays, so instead we list the blocks that carry work: group g covers the
run of slot g in ``sorted_token_ids`` (g = max_loras is the run of unmapped
tokens, idx -1, which sort last), cut into ``block_m`` rows. The list has a
static length, an upper bound on the number of non-empty blocks; the tail
entries have zero rows and their programs return at once. The blocks of
mapped tokens come first, and row 3 holds their count (in every column), so
that a kernel can size its work to the step's live blocks at run time.

Rows 4 ... 4 + block_m - 1 hold each block's token positions (the last real one
repeated past its count), gathered from ``sorted_token_ids`` here rather than by
the kernel: a program then reads its slot and its rows in one round trip to
memory instead of two dependent ones (the sorted ids at an offset read first).

The segment schedule (`segment_items`, `build_segments`) serves the Mosaic GPU shrink,
which reads aligned tiles of x: the pieces of runs of one adapter inside each tile, and
for the Triton shrink a work list of the tokens outside them.

The list depends only on the step's mapping and ``block_m``, so it is a per-step
cost like the sort: `build_work_lists` makes one per ``WORK_LIST_BLOCK_MS`` entry
(the token blocks the default tiles use) and `lora_jax.mapping` keeps them, so
that a step's LoRA ops take them ready-made rather than each building its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

WORK_LIST_BLOCK_MS = (16, 32, 64, 128)
"""The token-block sizes the default tiles use (tuning.py): decode 16, prefill 32-128."""
SEGMENT_BLOCK_M = 128
"""Rows of x per tile of the segment (Mosaic GPU) shrink past ``SEGMENT_MAX_TOKENS``
tokens: aligned tiles of this many (`segment_block_m`)."""
SEGMENT_SHORT_BLOCK_M = 64
"""Rows per segment tile up to ``SEGMENT_MAX_TOKENS`` tokens. Session 13 (H200, the kernel
alone, prompts over 8 adapters / one adapter): 64-row tiles instead of 128 at 1024 tokens
7.5 / 7.0 -> 6.5 / 6.2 us (rank 64), 9.8 / 9.1 -> 7.9 / 7.4 (rank 128); at 4096 tokens
14.5 / 13.2 -> 13.8 / 13.1, 18.5 / 16.0 -> 16.1 / 15.0; at 16384 tokens slower (rank
128: 52.9 / 44.6 -> 53.6 / 50.7)."""
SEGMENT_MAX_PIECES = 4
"""Most runs (pieces) a tile may hold for the segment shrink to take it."""
SEGMENT_MIN_TOKENS = 1024
"""Static token counts from which `build_work_lists` adds the segment schedule."""
SEGMENT_MAX_TOKENS = 4096
"""Static token counts up to which `lora_shrink` uses the segment shrink by default below
``SEGMENT_LONG_RANK``.

Session 10 (H200): from 1024 to 4096 tokens it ran 10-40 % faster than the Triton kernel
alone on prompts. Session 11, with the persistent stream-K grid, at 16384 tokens and rank
64 it tied or lost (prompts over 8 adapters: 48.3 vs 44.0 us with the Triton zeroing
pass) while at rank 128 it won (57.7 vs 63.8; one adapter 49.1 vs 62.2)."""
SEGMENT_LONG_RANK = 128
"""From this rank the default takes the segment shrink at every length from
``SEGMENT_MIN_TOKENS`` (see ``SEGMENT_MAX_TOKENS``)."""
SEGMENT_REST_BLOCK_MS = (32, 64)
"""Token blocks of the prefill Triton shrink, which takes the tokens outside pieces."""
TILES_REST_BLOCK_MS = (16, 32, 64)
"""Token blocks of the prefill Triton expand, which takes the tokens outside whole tiles
(`tile_items`; tuning.py: 16 at rank 16, 32 up to rank 64, 64 at rank 128)."""
SEGMENTS_KEY = 0
"""The key of the segment schedule in `build_work_lists`'s dict (no block_m is 0; an int,
so that the dict's keys sort as a pytree)."""


def segment_block_m(num_tokens: int) -> int:
    """Rows per segment-shrink tile for a step of this many (static) tokens."""
    return SEGMENT_SHORT_BLOCK_M if num_tokens <= SEGMENT_MAX_TOKENS else SEGMENT_BLOCK_M


def num_work_blocks(num_tokens: int, max_loras: int, block_m: int) -> int:
    """Static upper bound on sum_g ceil(count_g / block_m) over the L + 1 groups."""
    groups = max_loras + 1
    return -(-num_tokens // block_m) + min(groups, num_tokens)


def build_work_list(
    slot_token_counts: jax.Array,  # [L] int32
    slot_token_starts: jax.Array,  # [L] int32
    sorted_token_ids: jax.Array,  # [T] int32
    *,
    block_m: int,
) -> jax.Array:
    """Returns int32 [4 + block_m, NB]: per block (slot or -1 for unmapped, first row,
    row count), in row 3 the number of blocks of mapped tokens (the list's first
    entries), then the block's ``block_m`` token positions (last one repeated)."""
    num_tokens = sorted_token_ids.shape[0]
    num_slots = slot_token_counts.shape[0]
    counts = slot_token_counts.astype(jnp.int32)
    mapped = jnp.sum(counts)
    counts_g = jnp.concatenate([counts, (num_tokens - mapped)[None]])  # [G]
    starts_g = jnp.concatenate([slot_token_starts.astype(jnp.int32), mapped[None]])  # [G]
    slots_g = jnp.concatenate(
        [jnp.arange(num_slots, dtype=jnp.int32), jnp.full((1,), -1, jnp.int32)]
    )
    nblk = (counts_g + block_m - 1) // block_m  # [G]
    cum = jnp.cumsum(nblk)  # [G] inclusive
    nb = num_work_blocks(num_tokens, num_slots, block_m)
    i = jnp.arange(nb, dtype=jnp.int32)
    g = jnp.sum((i[:, None] >= cum[None, :]).astype(jnp.int32), axis=1)  # [NB]
    in_range = g < num_slots + 1
    gc = jnp.minimum(g, num_slots)
    j = i - (cum[gc] - nblk[gc])  # block index inside the group
    rows = jnp.clip(counts_g[gc] - j * block_m, 0, block_m)
    rows = jnp.where(in_range, rows, 0)
    first = starts_g[gc] + j * block_m
    live = jnp.broadcast_to(cum[num_slots - 1], (nb,))  # blocks of slots 0..L-1
    m = jnp.arange(block_m, dtype=jnp.int32)
    pos = first[None, :] + jnp.minimum(m[:, None], jnp.maximum(rows - 1, 0)[None, :])
    tokens = sorted_token_ids.astype(jnp.int32)[jnp.clip(pos, 0, num_tokens - 1)]  # [bm, NB]
    head = jnp.stack([slots_g[gc], first, rows, live]).astype(jnp.int32)
    return jnp.concatenate([head, tokens])


def build_work_lists(
    slot_token_counts: jax.Array,
    slot_token_starts: jax.Array,
    sorted_token_ids: jax.Array,
    token_lora_indices: jax.Array | None = None,
) -> dict:
    """One work list per ``WORK_LIST_BLOCK_MS`` entry, keyed by ``block_m``, and, given
    ``token_lora_indices`` and at least ``SEGMENT_MIN_TOKENS`` tokens, the segment
    shrink's schedule under ``SEGMENTS_KEY`` (`build_segments`).

    Example::

        lists = build_work_lists(counts, starts, sorted_ids, idx)
        h = lora_shrink(x, (a,), **meta, work_lists=lists)
    """
    lists: dict[int, jax.Array | Segments] = {
        bm: build_work_list(slot_token_counts, slot_token_starts, sorted_token_ids, block_m=bm)
        for bm in WORK_LIST_BLOCK_MS
    }
    if token_lora_indices is not None and sorted_token_ids.shape[0] >= SEGMENT_MIN_TOKENS:
        lists[SEGMENTS_KEY] = build_segments(
            token_lora_indices, slot_token_counts, slot_token_starts, sorted_token_ids
        )
    return lists


def get_work_list(
    work_lists: Mapping | None,
    slot_token_counts: jax.Array,
    slot_token_starts: jax.Array,
    sorted_token_ids: jax.Array,
    *,
    block_m: int,
) -> jax.Array:
    """The ready-made list for ``block_m`` from ``work_lists``, else a new one."""
    tab = None if work_lists is None else work_lists.get(block_m)
    if tab is None:
        return build_work_list(
            slot_token_counts, slot_token_starts, sorted_token_ids, block_m=block_m
        )
    num_tokens = sorted_token_ids.shape[0]
    expected = (4 + block_m, num_work_blocks(num_tokens, slot_token_counts.shape[0], block_m))
    if tuple(tab.shape) != expected or tab.dtype != jnp.int32:
        raise ValueError(
            f"work_lists[{block_m}] is {tab.dtype}{list(tab.shape)}; expected int32"
            f"{list(expected)}, the shape for {num_tokens} tokens and "
            f"{slot_token_counts.shape[0]} slots (build it with build_work_lists from this "
            "step's metadata: only its shape is checked)."
        )
    return tab


def segment_items(
    token_lora_indices: jax.Array, *, block_m: int, max_pieces: int
) -> tuple[jax.Array, jax.Array]:
    """This kernel's share of a step: in each aligned ``block_m``-row tile of x cut into at
    most ``max_pieces`` runs of one slot (or of unmapped tokens), the runs of a slot.

    A tile of prompts holds one run, or a few where prompts meet; a tile of a shuffled
    batch holds many, and goes to the Triton shrink whole. Every piece costs a full tile
    of MMA and one read of its adapter, so ``max_pieces`` bounds that waste.

    Returns ``(items, mine)``: items int32 [5, NI] holds per piece (tile, slot, first
    token, row count), the count 0 in unused entries, which come last, and in row 4 the
    number of pieces (in every column); mine bool [T] marks the tokens the pieces cover
    (the Triton shrink takes the others). NI = tiles x ``max_pieces`` bounds the piece
    count, so the list has a static length.
    """
    num_tokens = token_lora_indices.shape[0]
    num_tiles = -(-num_tokens // block_m)
    idx = token_lora_indices.astype(jnp.int32)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    prev = jnp.concatenate([jnp.full((1,), -2, jnp.int32), idx[:-1]])
    starts = (idx != prev) | (t % block_m == 0)
    piece = jnp.cumsum(starts.astype(jnp.int32)) - 1  # [T]
    length = jax.ops.segment_sum(jnp.ones_like(t), piece, num_segments=num_tokens)
    tile_pieces = jax.ops.segment_sum(starts.astype(jnp.int32), t // block_m, num_tiles)
    mine = (idx >= 0) & (tile_pieces[t // block_m] <= max_pieces)
    cap = num_tiles * max_pieces
    (first,) = jnp.nonzero(starts & mine, size=cap, fill_value=0)
    first = first.astype(jnp.int32)
    num_pieces = jnp.sum((starts & mine).astype(jnp.int32))
    live = jnp.arange(cap) < num_pieces
    count = jnp.where(live, length[piece[first]], 0)
    total = jnp.broadcast_to(num_pieces, (cap,))
    items = jnp.stack([first // block_m, jnp.maximum(idx[first], 0), first, count, total])
    return items.astype(jnp.int32), mine


def tile_items(token_lora_indices: jax.Array, *, block_m: int) -> tuple[jax.Array, jax.Array]:
    """The Mosaic GPU expand's share of a step: the aligned ``block_m``-row tiles whose
    tokens all map to one slot (a prompt's inside; a trailing partial tile never does).

    Returns ``(items, mine)``: items int32 [3, NT] holds per tile (tile, slot), the listed
    tiles first, and in row 2 their count (in every column); mine bool [T] marks their
    tokens (the Triton expand takes the others). NT = T // block_m.
    """
    num_tokens = token_lora_indices.shape[0]
    num_tiles = num_tokens // block_m
    idx = token_lora_indices.astype(jnp.int32)
    rows = idx[: num_tiles * block_m].reshape(num_tiles, block_m)
    one = (rows[:, 0] >= 0) & jnp.all(rows == rows[:, :1], axis=1)
    (tile,) = jnp.nonzero(one, size=num_tiles, fill_value=0)
    tile = tile.astype(jnp.int32)
    count = jnp.sum(one.astype(jnp.int32))
    slot = jnp.maximum(rows[tile, 0], 0)
    items = jnp.stack([tile, slot, jnp.broadcast_to(count, (num_tiles,))])
    mine = jnp.zeros((num_tokens,), bool).at[: num_tiles * block_m].set(jnp.repeat(one, block_m))
    return items.astype(jnp.int32), mine


def whole_tiles(token_lora_indices, *, block_m: int | None = None) -> str:
    """On the host (numpy, no device work): how many of a step's mapped tokens lie in
    `tile_items`' tiles (the Mosaic GPU expand's share) — "none", "some" or "all".
    Indices outside ``[0, max_loras)`` must already be -1.

    Example::

        whole_tiles(np.repeat([0, 1], 1024))  # "all"
    """
    idx = np.asarray(token_lora_indices).astype(np.int64).reshape(-1)
    num_tokens = idx.shape[0]
    mapped = idx >= 0
    if num_tokens == 0 or not mapped.any():
        return "none"
    block_m = segment_block_m(num_tokens) if block_m is None else block_m
    num_tiles = num_tokens // block_m
    rows = idx[: num_tiles * block_m].reshape(num_tiles, block_m)
    one = (rows[:, 0] >= 0) & (rows == rows[:, :1]).all(axis=1)
    n_mine, n_mapped = int(one.sum()) * block_m, int(mapped.sum())
    return "none" if n_mine == 0 else "all" if n_mine == n_mapped else "some"


PROMPT_TILES = ("none", "some", "all")
"""What `prompt_tiles` may say of a step, and what `lora_shrink(prompt_tiles=)` accepts."""


def prompt_tiles(
    token_lora_indices,
    *,
    block_m: int | None = None,
    max_pieces: int = SEGMENT_MAX_PIECES,
) -> str:
    """On the host (numpy, no device work): how many of a step's mapped tokens
    `segment_items` gives the segment shrink — "none", "some" or "all".

    A server builds each step's slot indices on the host, so it can say this for free
    (vLLM keeps such host summaries of a batch too), and the shrink then launches only
    the kernels with work: "none" (a decode step, a shuffled batch) the Triton kernel
    alone, "all" (prompts whose tiles are one adapter's) the Mosaic GPU kernel alone.
    Indices outside ``[0, max_loras)`` must already be -1, as `make_lora_mapping` makes
    them.

    Example::

        prompt_tiles(np.repeat([0, 1], 1024))  # "all"
    """
    idx = np.asarray(token_lora_indices).astype(np.int64).reshape(-1)
    num_tokens = idx.shape[0]
    if num_tokens == 0:
        return "none"
    block_m = segment_block_m(num_tokens) if block_m is None else block_m
    t = np.arange(num_tokens)
    starts = np.ones(num_tokens, bool)
    starts[1:] = idx[1:] != idx[:-1]
    starts |= t % block_m == 0
    tile_pieces = np.bincount(t // block_m, weights=starts)
    mapped = idx >= 0
    mine = mapped & (tile_pieces[t // block_m] <= max_pieces)
    n_mine, n_mapped = int(mine.sum()), int(mapped.sum())
    return "none" if n_mine == 0 else "all" if n_mine == n_mapped else "some"


def rest_order(
    token_lora_indices: jax.Array,
    slot_token_counts: jax.Array,
    sorted_token_ids: jax.Array,
    mine: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sort metadata of the tokens that ``mine`` does not mark, as if the marked ones
    had no adapter: (counts, starts, sorted ids), the kept tokens in their order, then
    the rest. O(T) (a stable partition of the sorted order), no second sort."""
    num_tokens = sorted_token_ids.shape[0]
    num_slots = slot_token_counts.shape[0]
    sorted_ids = sorted_token_ids.astype(jnp.int32)
    counts = slot_token_counts.astype(jnp.int32)
    p = jnp.arange(num_tokens, dtype=jnp.int32)
    keep = ((p < jnp.sum(counts)) & ~mine[sorted_ids]).astype(jnp.int32)
    n_keep = jnp.sum(keep)
    dest = jnp.where(keep > 0, jnp.cumsum(keep) - 1, n_keep + jnp.cumsum(1 - keep) - 1)
    new_sorted = jnp.zeros_like(sorted_ids).at[dest].set(sorted_ids)
    idx = token_lora_indices.astype(jnp.int32)
    slot = jnp.where(mine & (idx >= 0), idx, num_slots)
    taken = jax.ops.segment_sum(jnp.ones_like(idx), slot, num_segments=num_slots + 1)
    new_counts = counts - taken[:num_slots]
    new_starts = jnp.cumsum(new_counts) - new_counts
    return new_counts, new_starts.astype(jnp.int32), new_sorted


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """The segment shrink's schedule for one step (`build_segments`)."""

    items: jax.Array
    """int32 [5, NI]: per piece (tile, slot, first token, rows), then the piece count;
    `segment_items`."""
    rest: dict[int, jax.Array]
    """block_m -> the Triton work list of the tokens outside the pieces."""
    tiles: jax.Array | None = None
    """int32 [3, T // block_m]: the tiles wholly of one slot, for the Mosaic GPU expand;
    `tile_items`."""
    tiles_rest: dict[int, jax.Array] | None = None
    """block_m -> the Triton expand's work list of the tokens outside ``tiles``."""


def build_segments(
    token_lora_indices: jax.Array,
    slot_token_counts: jax.Array,
    slot_token_starts: jax.Array,
    sorted_token_ids: jax.Array,
    *,
    block_ms: tuple[int, ...] = SEGMENT_REST_BLOCK_MS,
    tiles_block_ms: tuple[int, ...] = TILES_REST_BLOCK_MS,
) -> Segments:
    """The prompt tiles' schedule for one step: the segment shrink's pieces and, per
    ``block_ms`` entry, the Triton work list of the other tokens (`segment_items`,
    `rest_order`); the Mosaic expand's whole tiles and, per ``tiles_block_ms`` entry,
    the Triton expand's list of the other tokens (`tile_items`; none if empty)."""
    block_m = segment_block_m(token_lora_indices.shape[0])
    items, mine = segment_items(token_lora_indices, block_m=block_m, max_pieces=SEGMENT_MAX_PIECES)
    del slot_token_starts  # the kept tokens' starts are new
    counts, starts, order = rest_order(
        token_lora_indices, slot_token_counts, sorted_token_ids, mine
    )
    rest = {bm: build_work_list(counts, starts, order, block_m=bm) for bm in block_ms}
    if not tiles_block_ms:
        return Segments(items=items, rest=rest)
    tiles, whole = tile_items(token_lora_indices, block_m=block_m)
    counts, starts, order = rest_order(
        token_lora_indices, slot_token_counts, sorted_token_ids, whole
    )
    tiles_rest = {bm: build_work_list(counts, starts, order, block_m=bm) for bm in tiles_block_ms}
    return Segments(items=items, rest=rest, tiles=tiles, tiles_rest=tiles_rest)
