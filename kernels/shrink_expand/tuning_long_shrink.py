"""The H200 long-prompt shrink tiles (from `tuning.LONG_PREFILL_TOKENS` tokens), with the
measurements behind each rule (benchmarks/RESULTS.md, by session): rank 16's 128-column k
steps; ranks 64 and 128 on 64 x 64 tiles of 8 warps, rank 64's deep k steps from 4096
tokens, rank 128's rank blocks side by side, its whole rank on 64-token blocks at 2049-4096
tokens and in 128 x 128 tiles from 16384 tokens; and the Triton tiles beside the Mosaic GPU
segment shrink (`segment_rest_shrink`). `tuning.default_block_sizes` asks
`long_prefill_shrink`. Tiles over 48 KiB of shared memory are used only where the GPU lets
a kernel opt in to them.
"""

from __future__ import annotations

import dataclasses

from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes, next_pow2
from lora_jax.kernels.shrink_expand.tuning import ATOMIC_PROGRAMS, PREFILL_MAX_SPLIT_K
from lora_jax.kernels.shrink_expand.work_list import SEGMENT_REST_BLOCK_MS

DEEP_K_R64_MIN_TOKENS = 4096
"""From this many tokens the rank-64 long-prompt shrink takes 128-column k steps and splits
the hidden reduction only up to ``DEEP_K_R64_PROGRAMS`` items (`deep_k_rank64_shrink`;
measured from 4096 tokens, session 30)."""
DEEP_K_R64_PROGRAMS = 128
"""(64-token block, k range) items the rank-64 deep-k shrink aims for: about one an SM of
an H200 (132 SMs): 2 k ranges at 4096 tokens, none from 8192."""


RECT_MIN_TOKENS = 1024
"""From this many tokens a rank-16, -32 or -64 step whose host found every mapped token in
whole tiles of one slot (`work_list.whole_tiles` "all": prompts) runs `rect_shrink_tiles`."""
RECT_ITEMS = 256
"""(64-token block, k range) items the rank-16 rectangle shrink aims for (two an SM of an
H200)."""
RECT_WIDE_RANKS = {32: 16384, 64: 8192}
"""Padded ranks past 16 that take the rectangles, each up to the tokens it was measured
at (on ``RECT_WIDE_ITEMS`` items, 4 stages). Session 42: from 1024 tokens 5-11 % faster
than the Mosaic or work-list kernels; rank 64 lost 2-3 % at 16384 tokens, and rank 128
lost to the Mosaic shrink (15.3 vs 14.8 us at 4096). Session 43 (with ``x_first``): rank
32 at 8192 / 16384 tokens over 1 / 8 / 64 adapters 23.5 / 23.9 / 25.9 and 42.0 / 42.1 /
43.8 us on the work-list kernel -> 19.0 / 19.0 / 21.9 and 33.6 / 34.2 / 37.2."""
RECT_WIDE_ITEMS = 128
"""(64-token block, k range) items the rank-32 / -64 rectangle shrink aims for (one an SM
of an H200 at 4 stages: 128 KiB of shared memory a program at rank 64)."""


def rect_shrink_tiles(num_tokens: int, hidden: int, rank_p: int) -> BlockSizes | None:
    """The tiles of `pallas_triton_rect.rect_shrink` (x read in rectangles of 64 tokens,
    no work list) for a rank-16, -32 or -64 step whose tokens lie in whole tiles of one
    slot, or None where the other kernels run. The hidden reduction is split to fill
    about ``RECT_ITEMS`` (rank 16) or ``RECT_WIDE_ITEMS`` (ranks 32 / 64) items; a split of
    1 stores each tile whole.

    H200 (benchmarks/RESULTS.md): rank 16, session 36's probes at T = 4096, one adapter:
    over 64 x 128 rectangles split 4 ways 10.4 us, gathering the rows through a work list
    as the library's kernel does 11.0, the library 11.6; session 42, T = 16384 stored
    whole (no zeroed output, no atomics) 33.0 us against the work-list kernel's 35.2.
    Rank 64, session 42, prompts as runs over 1 / 8 adapters against the Mosaic segment
    shrink: T = 4096 (split 2) 12.9 / 13.6 -> 11.9 / 12.7-12.9 us, T = 1024, H = 8192 over
    8 (split 8) 9.8 -> 8.9; 3 stages, 8 warps, 256-column steps, 32-token blocks and
    splits to 256 items were slower, tiles stored whole (64 programs) 15 % slower. The
    same rule at rank 32, T = 1024 / 2048 / 4096 over 1 / 8 adapters: 5.3 / 5.6, 7.6 / 8.0,
    12.2 / 12.6 -> 4.7 / 5.1, 6.9 / 7.3, 11.2 / 11.7 us; rank 64 at 8192 tokens (128 blocks,
    stored whole) against the work-list kernel over 1 / 8 / 64 adapters 21.2 / 22.0 / 28.1
    -> 20.1 / 20.8 / 27.1, at 16384 tokens 37.4 / 38.2 / 44.4 -> 38.5 / 39.1 / 45.1 (lost).
    Session 43: x's first tile requested before the block's slot is read back (``x_first``;
    a block of unmapped tokens then reads one x tile an item, 1/4-1/32 of its x), prompts
    as runs, us: rank 16 T = 1024 / 2048 / 4096 / 16384 over 1 / 8 / 8 / 8 adapters 4.7 /
    6.7 / 10.8 / 33.8 -> 4.5 / 6.4 / 10.5 / 33.5, rank 32 T = 4096 11.1 -> 10.7, rank 64 T =
    1024 over 1 / 8 5.4 / 6.1 -> 5.2 / 5.9, at H = 8192 7.4 / 8.9 -> 7.3 / 8.8; from 4096
    tokens rank 64 ties (11.9 / 12.7 / 19.0 over 1 / 8 / 64 either way; 8192 tokens 19.9-20.0).
    With the slot a constant (a probe) rank 64 at 4096 tokens over one adapter took 11.7: the
    wait on that read is ~0.3 us of its 11.9-12.0."""
    if num_tokens < RECT_MIN_TOKENS or hidden % 512:
        return None
    steps = hidden // 128
    blocks = -(-num_tokens // 64)
    if rank_p <= 16:
        items, stages = RECT_ITEMS, 3
    elif num_tokens <= RECT_WIDE_RANKS.get(rank_p, 0):
        from lora_jax.kernels.shrink_expand.pallas_triton import opt_in_smem_budget

        items, stages = RECT_WIDE_ITEMS, 4
        if opt_in_smem_budget() < stages * (64 + rank_p) * 128 * 2:
            return None
    else:
        return None
    split = 1
    while split * 2 * blocks <= items and steps % (split * 2) == 0 and split < 8:
        split *= 2
    return BlockSizes(
        block_m=64,
        block_r=rank_p,
        block_k=128,
        num_stages=stages,
        num_warps=4,
        split_k=split,
        rect=True,
        x_first=True,
    )


def long_prefill_shrink(num_tokens: int, hidden: int, rank_p: int) -> BlockSizes | None:
    """Long-prompt shrink tiles from the session-8 and -9 H200 sweeps
    (benchmarks/RESULTS.md), or None for the general prefill rule. Those of ranks 64 and
    128 need 48 KiB of shared memory, used only where the GPU lets the kernel opt in."""
    from lora_jax.kernels.shrink_expand.pallas_triton import opt_in_smem_budget

    max_split = max(1, min(PREFILL_MAX_SPLIT_K, hidden // 512))  # >= 8 k steps per split
    if rank_p <= 16:
        # x-bound: 128-column k steps, 3 stages (36 KiB), the split added atomically.
        # T = 4096 / 16384: 14.1 / 40.0 -> 12.5 / 36.7 us (n = 1), 15.6 / 41.3 -> 14.6 / 38.6
        # (n = 64).
        return BlockSizes(
            block_m=32,
            block_r=16,
            block_k=128,
            num_stages=3,
            split_k=max_split,
            atomic_programs=ATOMIC_PROGRAMS,
        )
    if rank_p in (64, 128) and opt_in_smem_budget() >= 3 * 128 * 64 * 2:
        # 64 x 64 output tiles, 8 warps, 3 stages (48 KiB), the split added atomically,
        # on the static (block, split) grid. Session 9 (n = 1 / 64): R = 128, T = 2048
        # 18.6 / 30.1 -> 16.0 / 27.7 us and T = 4096 21.6 / 36.0 -> 21.3 / 34.3 (vs
        # session 8's 128 x 128 tiles); R = 64 and T = 16384 within 2 % of the tiles
        # they replace (session 8: T = 16384, R = 64 47.8 -> 43.7 us at n = 1).
        # The split's cap: what a step with every token mapped picks at run time (the
        # kernel's pick is ATOMIC_PROGRAMS // live blocks). A larger cap only adds
        # programs that return at once on the static grid: session 11, T = 16384,
        # R = 128, split cap 8: 5136 programs, 14 / 16 of them idle, ~4 us.
        blocks = -(-num_tokens // 64) * (rank_p // 64)
        if rank_p == 64 and num_tokens >= DEEP_K_R64_MIN_TOKENS:
            return deep_k_rank64_shrink(blocks)
        if rank_p == 128:
            return rank128_long_shrink(blocks, max_split)
        split = min(max_split, 1 << max(0, (ATOMIC_PROGRAMS // blocks).bit_length() - 1))
        return square64_tiles(block_k=64, num_stages=3, split=split)
    return None


def rank128_long_shrink(blocks: int, max_split: int, *, whole: bool = True) -> BlockSizes:
    """Rank 128's long-prompt tiles: two 64-row rank blocks a token block, launched side by
    side (``rank_inner``) so that the second reads the block's x from L2. While the
    (token block, rank block) programs fit one wave (``blocks`` <= 2 x
    ``DEEP_K_R64_PROGRAMS``, two an SM at 3 stages: up to 8192 tokens), rank 64's deep-k
    tiles, but from 2049 to 4096 tokens the whole rank on 64-token blocks
    (`whole_rank128_rows_shrink`); from ``WHOLE_RANK_MIN_BLOCKS`` (16384 tokens) the whole
    rank in one 128 x 128 tile (`whole_rank128_shrink`); between, the 64-column k steps,
    3 stages (48 KiB: 4 programs an SM), split as far as ATOMIC_PROGRAMS items.

    H200, session 31 (benchmarks/RESULTS.md), shuffled tokens, n = 8 / 64, against the
    session-9 tiles launched rank block last: T = 16384 56.6 / 68.5 -> 50.2 / 58.0 us
    (the same tiles, side by side); T = 4096 19.1 / 31.5 -> 18.1 / 28.2 (deep k steps,
    unsplit, 4 stages); T = 2048 14.2 / 26.2 -> 12.0 / 27.0 (split 2); T = 8192, n = 8
    32.5 -> 27.8 (unsplit, 3 stages). The deep-k tiles at 16384 tokens: 54.1 / 67.2.
    ``whole=False``: never the 128 x 128 tiles (`segment_rest_shrink`)."""
    from lora_jax.kernels.shrink_expand.pallas_triton import opt_in_smem_budget

    whole = whole and blocks >= WHOLE_RANK_MIN_BLOCKS
    if whole and opt_in_smem_budget() >= WHOLE_RANK_SMEM:
        return whole_rank128_shrink()
    mid = WHOLE_ROWS_BLOCKS[0] < blocks <= WHOLE_ROWS_BLOCKS[1]
    if mid and opt_in_smem_budget() >= WHOLE_ROWS_SMEM:
        return whole_rank128_rows_shrink()
    if blocks <= 2 * DEEP_K_R64_PROGRAMS:
        return dataclasses.replace(deep_k_rank64_shrink(blocks), rank_inner=True)
    split = min(max_split, 1 << max(0, (ATOMIC_PROGRAMS // blocks).bit_length() - 1))
    return dataclasses.replace(
        square64_tiles(block_k=64, num_stages=3, split=split), rank_inner=True
    )


WHOLE_RANK_MIN_BLOCKS = 512
"""(64-token block, 64-row rank block) programs of rank 128's split-free 64 x 64 tiles
from which the shrink takes the whole rank in 128 x 128 tiles instead (16384 tokens:
128 such tiles, one an SM of an H200)."""
WHOLE_RANK_SMEM = 5 * 2 * 128 * 64 * 2
"""Shared memory of `whole_rank128_shrink`'s 5 stages of x's and A's 128 x 64 tiles."""


def whole_rank128_shrink() -> BlockSizes:
    """The rank-128 shrink from 16384 tokens: 128 x 128 output tiles of 8 warps, 5 stages of
    64-column k steps (160 KiB), unsplit. A program reads its 128 tokens' x once and its
    adapter's A once, where the side-by-side 64 x 64 tiles read x twice (the second from
    L2) and A once per 64 tokens: at 16384 tokens over 8 adapters those L2 reads were
    about 512 MB a call, twice the HBM bytes.

    H200, session 32 (benchmarks/RESULTS.md), shuffled tokens, H = 4096, against the
    side-by-side tiles: T = 16384, n = 8 / 64: 51.1 / 58.6 -> 43.5 / 55.7 us with 4
    stages (81 / 88 % of the roofline), 5 stages 2-4 % faster at n = 8 in three runs
    (42.1 / 41.9 vs 43.3 / 43.7; T = 32768 81.1 vs 84.5 against 102.5), equal at n = 64.
    At 8192 tokens (64 such tiles; split 2 to fill the GPU) n = 64 lost (37.2 -> 40.2),
    at 4096 (split 2 or 4) too (28.0 -> 30.5 / 34.5)."""
    return BlockSizes(block_m=128, block_r=128, block_k=64, num_warps=8, num_stages=5)


WHOLE_ROWS_BLOCKS = (64, 128)
"""(64-token block, 64-row rank block) programs of rank 128's side-by-side tiles above
which, and up to which, the shrink takes `whole_rank128_rows_shrink` (2049-4096 tokens)."""
WHOLE_ROWS_SMEM = 4 * (64 + 128) * 128 * 2
"""Shared memory of `whole_rank128_rows_shrink`'s 4 stages of 128-column k steps."""
WHOLE_ROWS_PROGRAMS = 176
"""(block, k range) items `whole_rank128_rows_shrink` aims for: its split of 2 holds while
a step has at most 88 live 64-token blocks (about one item an SM of an H200)."""


def whole_rank128_rows_shrink() -> BlockSizes:
    """The rank-128 shrink from 2049 to 4096 tokens: the whole rank on 64-token blocks
    (64 x 128 tiles of 8 warps: x read once a block, where the side-by-side 64 x 64 tiles
    read it twice), 4 stages of 128-column k steps (192 KiB), the hidden reduction split 2
    ways on the static grid while the live blocks make at most ``WHOLE_ROWS_PROGRAMS``
    items, unsplit past that.

    H200, session 32 (benchmarks/RESULTS.md), shuffled tokens, T = 4096, H = 4096, n = 8 /
    64 against session 31's side-by-side deep-k tiles: 18.0 / 28.0 -> 16.3 / 29.2 us (56
    -> 63 % / 85 -> 82 % of the roofline; 8 adapters make ~68 live blocks and split, 64
    make ~100 and run unsplit, which measured the same 29.2). Taken for the few-adapter
    batches that prompts make, as session 31 took its 2048-token tiles (12.0 vs 14.2 us
    over 8 adapters, 27.0 vs 26.2 over 64)."""
    return BlockSizes(
        block_m=64,
        block_r=128,
        block_k=128,
        num_warps=8,
        num_stages=4,
        split_k=2,
        atomic_programs=WHOLE_ROWS_PROGRAMS,
        persistent=False,
    )


def segment_rest_shrink(bs: BlockSizes, num_tokens: int, hidden: int, rank: int) -> BlockSizes:
    """The default Triton tiles ``bs`` for the tokens that the Mosaic GPU segment shrink
    leaves to Triton (api.py): the step's ready-made segment schedule lists those tokens
    in blocks of `SEGMENT_REST_BLOCK_MS` rows only, so the whole-rank 128-token tiles
    give way to the side-by-side 64 x 64 ones (session 32: with them, 16384 tokens of one
    adapter rebuilt the schedule in the call, 43.2 -> 80.5 us)."""
    if bs.block_m in SEGMENT_REST_BLOCK_MS:
        return bs
    rank_p = max(16, next_pow2(rank))
    max_split = max(1, min(PREFILL_MAX_SPLIT_K, hidden // 512))
    rest = rank128_long_shrink(-(-num_tokens // 64) * (rank_p // 64), max_split, whole=False)
    assert rest.block_m in SEGMENT_REST_BLOCK_MS, rest
    return rest


def square64_tiles(*, block_k: int, num_stages: int, split: int) -> BlockSizes:
    """64 x 64 output tiles of 8 warps, the long-prompt shrink's: a ``split`` > 1 adds its
    partial sums atomically on the static (block, split) grid, the split picked at run
    time up to it; a split of 1 stores plainly (no zeroed output either)."""
    atomic = dict(atomic_programs=ATOMIC_PROGRAMS, persistent=False) if split > 1 else {}
    return BlockSizes(
        block_m=64,
        block_r=64,
        block_k=block_k,
        num_warps=8,
        num_stages=num_stages,
        split_k=split,
        **atomic,
    )


def deep_k_rank64_shrink(blocks: int) -> BlockSizes:
    """The rank-64 long-prompt tiles from ``DEEP_K_R64_MIN_TOKENS`` tokens: 64 x 64 output
    tiles of 8 warps over 128-column k steps, the hidden split only as far as
    ``DEEP_K_R64_PROGRAMS`` (block, k range) items (``blocks`` 64-token blocks), 4 stages
    while that leaves one program an SM, 3 where two share one (128 KiB a program no
    longer fits twice).

    H200, session 30 (benchmarks/RESULTS.md), shuffled tokens, n = 8 / 64, against the
    64-column k steps split up to ATOMIC_PROGRAMS items: T = 4096 (split 2) 15.3 / 22.1
    -> 13.7 / 19.7 us; T = 8192 (unsplit) 24.2 / 31.3 -> 21.9 / 28.2; T = 16384 41.0 /
    48.3 -> 38.2 / 44.3; H = 8192 as much. The long k steps carry the gain: the old k
    steps unsplit lost everywhere, and 3 stages at 8192 tokens / 4 at 16384 lost."""
    split = max(1, DEEP_K_R64_PROGRAMS // blocks)
    split = 1 << (split.bit_length() - 1)  # a power of two
    stages = 4 if blocks * split < 2 * DEEP_K_R64_PROGRAMS else 3
    return square64_tiles(block_k=128, num_stages=stages, split=split)
