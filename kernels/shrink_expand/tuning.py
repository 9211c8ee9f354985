"""The H200 tuning table: default shrink / expand tiles by op and static shape
(`BlockSizes.get_default` calls `default_block_sizes`), with the measurements behind each
rule (benchmarks/RESULTS.md, by session); the long-prompt shrink's in tuning_long_shrink.py,
the per-token kernels' in tuning_per_token.py.

The token count ``T`` is static, so the choice between the decode regime (few tokens per
adapter: small token blocks, the rank split over many programs for parallelism) and the
prefill regime (long runs per adapter: large token blocks, x read once) is made at trace
time. Figures are H200 trace-timed microseconds unless said otherwise.
"""

from __future__ import annotations

from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes, next_pow2
from lora_jax.kernels.shrink_expand.tuning_per_token import per_token_default

DECODE_MAX_TOKENS = 256
"""Static token counts up to this use the decode tiles (small token blocks, split-K)."""
TARGET_PROGRAMS = 264
"""Shrink aims for this many live programs: 2 per SM of an H200 (132 SMs)."""
LONG_PREFILL_TOKENS = 2048
LONG_PREFILL_TARGET_PROGRAMS = 528
"""From LONG_PREFILL_TOKENS tokens the prefill shrink aims for 4 programs per SM (the
session-5 trace-timed sweep: T = 4096 split 4 ways beat 2 by 12-20 % at R <= 64)."""
ATOMIC_PROGRAMS = 528
"""Atomic split-K shrinks aim for this many (block, k range) items: 4 per SM of an H200
(the session-6 sweep: 528 beat 264 by up to 18 % at T = 64, n = 64)."""
SHORT_PREFILL_MAX_TOKENS = 4096
"""Up to this many tokens the rank-16 prefill expand uses 16-token blocks (measured up to
4096 on an H200; 16384 keeps the 32-token blocks)."""
PREFILL_MAX_SPLIT_K = 8
"""Most hidden splits above the decode regime (the H200 sweep went up to 8)."""
EXPAND_LIVE_PROGRAMS = 264
"""Decode expands (ranks >= 64, 64-256 tokens) walk as many column tiles a program as keep
about this many programs working: 2 per SM of an H200."""
WIDE_DECODE_EXPAND_COLUMNS = 16384
"""From this many output columns (128 column tiles of 128) a rank-16/32 decode expand of
up to ``WIDE_DECODE_EXPAND_MAX_TOKENS`` tokens walks the live token blocks in
``DECODE_EXPAND_GROUPS`` groups a column tile (``block_groups``). H200, session 25
(benchmarks/RESULTS.md; Llama-3-8B gate_up, 28672 columns, after XLA's matmul): 64 tokens
over 8 adapters 12.3 -> 6.9 us over the matmul, over 64 adapters equal (the block kernel;
with the host's hint the per-token kernel runs there); narrower outputs (4096-6144
columns, 32-48 tiles) lost with it at 64 adapters."""
WIDE_DECODE_EXPAND_MAX_TOKENS = 64
"""256 tokens over 8 adapters gained too (14.0 -> 10.1 us), but 256 over 64 was not
measured with it, and the 32-layer model's step there ran 3 % slower than in session 24
with it (one run each): kept to the measured regime."""
DECODE_EXPAND_GROUPS = 4
PREFETCH_MIN_TOKENS = 2048
"""Prefill expands of more tokens than this load each column tile's y a tile ahead
(``prefetch``) at rank 128, and at ranks 16 and 64 up to SHORT_PREFILL_MAX_TOKENS (session
26, H200: 7-12 % faster over 8 adapters at 4096 tokens, up to 12 % at rank 128 and 16384;
at 1024 tokens over 64 adapters it lost 16-27 %, at rank 64 from 8192 tokens 2-7 %)."""
AHEAD_TOKENS_PER_SLOT = 64
"""The host's tokens-per-slot hint (`lora_jax.mapping.TOKENS_PER_SLOT`) of a step whose
active adapters average at least 64 mapped tokens each, for an expand whose tokens all go
to the Triton kernel (no aligned tile of y is wholly one adapter's): its token blocks are
mostly full, and up to ``AHEAD_SHORT_MAX_TOKENS`` tokens it loads each column tile's y a
tile ahead at ranks 64 and 128. Session 33 (H200, T = 1024, H = 4096, shuffled tokens, µs,
three runs): over 8 adapters (128 tokens each) rank 128 14.6-14.9 -> 12.7-13.0, rank 64
12.4-12.6 -> 11.0-11.1; over 64 (16 each, quarter-full blocks) it lost 16-27 % (27.9 ->
32.3-32.6, 15.9 -> 20.5), which is why the device alone cannot pick it. Into 8192
columns the rank-64 tiles lost with it (session 34, T = 1024, n = 8: 14.3 -> >= 16.2 µs),
so only narrower outputs take it."""
AHEAD_SHORT_MAX_TOKENS = 1024
"""Most tokens of the hinted ahead-load (measured at 512 and 1024). At 2048 tokens over 8
adapters it lost (session 36, H = 4096, µs: rank 128 16.4 -> 20.1, rank 64 13.4 -> 18.3 on
the 32 x 128 tiles); past PREFETCH_MIN_TOKENS the rank-128 expand loads ahead in any case."""
FEW_TOKENS_PER_SLOT = 16
"""The host's hint (`lora_jax.mapping.TOKENS_PER_SLOT`) of a step whose active adapters
average 3-16 mapped tokens each."""
FEW_PER_SLOT_RANK128_TILES = dict(block_m=16, block_n=64, num_stages=2, tiles_n=2)
"""Rank-128 expands of 257 to AHEAD_SHORT_MAX_TOKENS tokens with the hint
FEW_TOKENS_PER_SLOT into fewer than 8192 columns: 16-token blocks, 2 column tiles of 64 a
program, where 64-token blocks would run mostly empty. Session 38 (H200, H = 4096,
shuffled tokens, µs; RESULTS.md runs 2-3): T = 1024 over 64 adapters (16 tokens each)
28.1 -> 24.1 (twice; 70 -> 81 % of the roofline). With more tokens a slot they lost: at
1024 tokens over 32 adapters (32 each) 16.9 -> 18.3, over 8 (128 each) 12.7 -> 16.9; at
2048 over 64 (32 each) 31.8 -> 33.1."""
COLS_INNER_MAX_TOKENS = 2048
"""Expands of up to this many tokens on the static grid launch a token block's column
groups side by side (`BlockSizes.cols_inner`) at ranks 16 (every hint), 64 (with the
ahead-load of the hint 64) and 128 (with the ahead-load: the hint 64 up to 1024 tokens,
every hint above). Session 38 (H200, H = 4096, shuffled tokens, µs; two runs at 1024
tokens): rank 16, T = 1024, n = 8 / 64 7.6-7.8 / 8.5-8.6 -> 7.3 / 7.9-8.0, T = 2048 equal;
rank 128 hinted, T = 1024, n = 8 12.7-13.0 -> 11.8-12.2; rank 128 at 2048 tokens, with the
ahead-load session 36 found losing without it, n = 8 / 64 16.6 / 31.8 -> 15.7 / 31.1;
rank 64 hinted, T = 1024, n = 8 10.8 -> 10.5. From 4096 tokens it tied or lost (rank 64,
16384 tokens: 94.9 -> 96.3-101.4)."""
DECODE_COLS_INNER_MIN_TOKENS = 129
DECODE_COLS_INNER_COLUMNS = 8192
"""Rank-64 decode expands of ``DECODE_COLS_INNER_MIN_TOKENS`` to DECODE_MAX_TOKENS tokens into at
least this many output columns (from WIDE_DECODE_EXPAND_COLUMNS: from
`WIDE_DECODE_COLS_INNER_MIN_TOKENS` tokens) run on the static grid with a token block's 4 column
tiles of 128 launched side by side (`BlockSizes.cols_inner`), not over the live blocks
(``live_programs``). Session 39 (H200, 8192 columns, shuffled tokens, µs, runs 1 and 5): 256 tokens
over 8 / 64 adapters 10.4-10.5 / 24.4 -> 9.5-9.6 / 23.4-23.5. At 128 tokens it lost over 8 (7.9 ->
8.6) and won 3 % over 64; at 64 tokens it lost (7.3 / 19.3 -> 7.8 / 21.4); into 4096 columns it lost
over 8 adapters (6.1 -> 7.6; over 64 13.8 -> 13.0, but the mapping of a decode step cannot tell the
two apart); rank 128 lost at 4096 columns (session 38: 8.7 / 21.8 -> 10.4 / 26.1) and was not
measured at 8192. Session 40 (run 1): at rank 16 / 128 into 8192 columns it lost or tied (128 tokens
over 8: 5.8 -> 8.3, 10.2 -> 11.9 µs)."""
WIDE_DECODE_COLS_INNER_MIN_TOKENS = 64
"""From WIDE_DECODE_EXPAND_COLUMNS output columns (a 70B-class gate or up projection,
28672 columns, or their merged 57344) the rank-64 decode expand takes those tiles from
this many tokens. Session 40 (H200, shuffled tokens, µs, runs 1 and 3; old default ->
these tiles): 16384 columns, over 8 / 64 adapters, T = 64 11.9 / 36.1 -> 9.8 / 37.9, T =
128 13.0 / 41.5 -> 10.7 / 39.7, T = 256 17.4 / 43.9 -> 12.9 / 41.5; 28672 columns T = 64
19.7 / 61.7 -> 13.4 / 61.9, T = 128 21.1-21.2 / 66.8-67.2 -> 14.4 / 63.9-64.4, T = 256
27.2-27.4 / 71.5 -> 23.0-23.1 / 67.3; 57344 columns, T = 128 over 8 36.3 -> 26.3. 8 column
tiles a program instead of 4 won at 256 tokens into 28672 columns (21.0 / 66.9) but lost
into 16384 (16.0 / 45.5) and at 64-128 tokens over 8 adapters. 10240 columns (session 39's
rule from 129 tokens) at 128 tokens: 9.5 / 26.8 -> 9.1 / 25.4, not taken (one run)."""

WIDE_PREFILL_MAX_SPLIT_K = 16
"""Most hidden splits of the prefill shrink below LONG_PREFILL_TOKENS tokens: 16 only where
the hidden size keeps 8 k steps of 64 per split (H >= 8192)."""


def decode_cols_inner(rank_p: int, num_tokens: int, hidden: int) -> bool:
    """Whether a decode expand of ``num_tokens`` tokens into ``hidden`` columns at padded
    rank ``rank_p`` takes the static grid with a block's column groups side by side
    (`DECODE_COLS_INNER_COLUMNS`, `WIDE_DECODE_COLS_INNER_MIN_TOKENS`)."""
    if rank_p != 64 or num_tokens > DECODE_MAX_TOKENS:
        return False
    if hidden >= WIDE_DECODE_EXPAND_COLUMNS:
        return num_tokens >= WIDE_DECODE_COLS_INNER_MIN_TOKENS
    return hidden >= DECODE_COLS_INNER_COLUMNS and num_tokens >= DECODE_COLS_INNER_MIN_TOKENS


def default_block_sizes(
    op: str,
    *,
    num_tokens: int,
    hidden: int,
    rank: int,
    out_features: int = 0,
    num_slices: int = 1,
    per_token: bool = False,
    tokens_per_slot: int | None = None,
) -> BlockSizes:
    """Tuned defaults for H200 (see benchmarks/RESULTS.md), by op and static shape.

    ``op`` is "shrink", "expand" or "fused" (`lora_shrink_expand`; there
    ``out_features`` is the widest slice and ``num_slices`` the slice count).
    For the expand, ``hidden`` is y's width (all slices).
    ``per_token``: the per-token (BGMV) tiles of a shrink or expand, for steps whose
    tokens mostly have an adapter of their own (`per_token_default`).
    ``tokens_per_slot``: the expand's token blocks' fill where the host knows it
    (`AHEAD_TOKENS_PER_SLOT`; only for an expand whose tokens all go to these tiles).
    """
    rank_p = max(16, next_pow2(rank))
    if per_token and op in ("shrink", "expand"):
        return per_token_default(op, hidden, rank_p)
    if op == "shrink":
        if num_tokens <= DECODE_MAX_TOKENS:
            # Decode: a few token blocks, A dominates the bytes. Split the hidden
            # reduction over programs, the split picked when the kernel runs from
            # the step's live blocks (atomic adds, no partial-sum kernel): up to one
            # 128-column step per item. H200 trace-timed sweep (RESULTS.md, session
            # 6): T = 64, n = 8 at R = 64 7.8 -> 5.5 us; persistent programs from 16
            # tokens, the (block, split) grid below (T = 1: 2.6-3.5 -> 2.5-3.2 us).
            # Rank 16 from 16 tokens: 2 warps and twice the items (session 8: T = 64,
            # n = 64 7.8 -> 6.8 us, the other cells equal).
            narrow = rank_p <= 16 and num_tokens >= 16
            return BlockSizes(
                block_m=16,
                block_r=min(rank_p, 64),
                block_k=128,
                num_warps=2 if narrow else 4,
                num_stages=2,
                split_k=max(1, hidden // 128),
                atomic_programs=2 * ATOMIC_PROGRAMS if narrow else ATOMIC_PROGRAMS,
                persistent=num_tokens >= 16,
            )
        # Prefill: x dominates; wide rank blocks read each x tile from HBM once
        # (a second rank block finds it in L2). Up to a few thousand tokens the
        # token blocks alone leave SMs idle (T = 1024: ~40 programs on 132 SMs), so
        # split the hidden reduction until about TARGET_PROGRAMS carry work
        # (H200 sweep, benchmarks/RESULTS.md: T = 1024 36-52 -> 24-39 us).
        if num_tokens >= LONG_PREFILL_TOKENS:
            from lora_jax.kernels.shrink_expand.tuning_long_shrink import long_prefill_shrink

            long = long_prefill_shrink(num_tokens, hidden, rank_p)
            if long is not None:
                return long
        block_r = min(rank_p, 64)
        if num_tokens >= 8192 and rank_p >= 128:
            # Long prompts, wide ranks: 64-row blocks halve the re-reads of A.
            return BlockSizes(block_m=64, block_r=block_r, block_k=64, num_warps=4, num_stages=2)
        live = -(-num_tokens // 32) * (rank_p // block_r)
        target = (
            LONG_PREFILL_TARGET_PROGRAMS if num_tokens >= LONG_PREFILL_TOKENS else TARGET_PROGRAMS
        )
        want = max(1, target // live)
        # >= 8 k steps per split; up to 16 splits at H >= 8192 (session 14: T = 1024,
        # H = 8192, R = 64, n = 8 15.8 -> 14.5 us, n = 64 equal)
        max_split = min(WIDE_PREFILL_MAX_SPLIT_K, max(1, hidden // 512))
        split_k = min(1 << (want.bit_length() - 1), max_split)
        # The split's partials are added atomically, the split picked at run time up
        # to max_split (sessions 6 and 9: T = 1024 3 % faster; T = 2048, R = 64
        # 16.8 / 22.3 -> 13.3 / 19.4 us at n = 1 / 64, no partial-sum kernel; T = 1024,
        # R = 128 14.6 -> 13.1 us with the cap at 8; T = 4096 equal).
        return BlockSizes(
            block_m=32,
            block_r=block_r,
            block_k=64,
            num_warps=4,
            num_stages=3,
            split_k=max_split if split_k > 1 else 1,
            atomic_programs=ATOMIC_PROGRAMS if split_k > 1 else 0,
        )
    if op == "expand":
        # H200 trace-timed sweeps (benchmarks/RESULTS.md, session 5). Several column
        # tiles per program (tiles_n) load the tokens' f32 h once instead of per
        # tile: at R >= 64 that was as many bytes as the tile's y and B.
        if num_tokens <= DECODE_MAX_TOKENS:
            if decode_cols_inner(rank_p, num_tokens, hidden):
                return BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=4, cols_inner=True)
            if rank_p >= 64 and num_tokens >= 64:
                # Up to 4 column tiles a program (T = 64/256, n = 64: 14 -> 12 us), as
                # many as keep EXPAND_LIVE_PROGRAMS busy with the step's live blocks.
                return BlockSizes(
                    block_m=16,
                    block_n=128,
                    num_stages=2,
                    tiles_n=4,
                    live_programs=EXPAND_LIVE_PROGRAMS,
                )
            wide = hidden >= WIDE_DECODE_EXPAND_COLUMNS
            if rank_p <= 32 and wide and num_tokens <= WIDE_DECODE_EXPAND_MAX_TOKENS:
                return BlockSizes(
                    block_m=16, block_n=128, num_stages=2, block_groups=DECODE_EXPAND_GROUPS
                )
            return BlockSizes(block_m=16, block_n=128, num_warps=4, num_stages=1)
        long = num_tokens > PREFETCH_MIN_TOKENS
        # full blocks (the host's hint) of a short prompt batch: y loaded a tile ahead
        full = (
            tokens_per_slot == AHEAD_TOKENS_PER_SLOT
            and num_tokens <= AHEAD_SHORT_MAX_TOKENS
            and hidden < 8192
        )
        short = num_tokens <= COLS_INNER_MAX_TOKENS  # `cols_inner` pays here
        if (
            rank_p == 128
            and tokens_per_slot == FEW_TOKENS_PER_SLOT
            and num_tokens <= AHEAD_SHORT_MAX_TOKENS
            and hidden < 8192
        ):
            return BlockSizes(**FEW_PER_SLOT_RANK128_TILES)
        if rank_p >= 128:  # the tiles fit shared memory at 64 x 64; T = 16384: 233 -> 129 us
            # Up to 2048 tokens, 4 column tiles per program rather than 8 (twice the
            # programs; session 10, n = 1 / 64: T = 1024 19.0 / 32.6 -> 14.5 / 28.1 us,
            # T = 2048 23.9 / 34.9 -> 16.2 / 31.7 us). Past that, y loaded a tile
            # ahead, and from 16384 tokens 16 tiles a program (session 26, n = 8 / 64:
            # T = 4096 30.6 / 39.8 -> 27.7 / 38.9 us, T = 8192 60.6 / 67.5 -> 56.0 /
            # 63.0, T = 16384 118.5 / 127.0 -> 106.8 / 112.0; n = 1 runs the Mosaic
            # kernel, unchanged).
            # Session 38: 1025-2048 tokens load ahead too, with `cols_inner` (every hint).
            mid = num_tokens > AHEAD_SHORT_MAX_TOKENS and short and hidden < 8192
            ahead = (long or full or mid) and rank_p == 128  # measured at 128 (256: smaller)
            tiles_n = 4 if not long else 16 if ahead and num_tokens >= 16384 else 8
            return BlockSizes(
                block_m=64,
                block_n=64,
                num_stages=2,
                tiles_n=tiles_n,
                prefetch=int(ahead),
                cols_inner=ahead and short,
            )
        if rank_p == 64 and long and num_tokens <= SHORT_PREFILL_MAX_TOKENS and hidden < 8192:
            # 64 x 64 tiles, 8 a program, y loaded a tile ahead (session 26, T = 4096,
            # H = 4096, n = 8 / 64: 26.1 / 30.5 -> 23.6 / 30.3 us). Not at 8192 and
            # 16384 tokens (2 % and 7 % slower) nor into 8192 columns (2.6 % slower);
            # on the 32 x 128 tiles below the ahead-load lost 12-15 %.
            return BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=8, prefetch=1)
        if rank_p <= 16 and num_tokens <= SHORT_PREFILL_MAX_TOKENS:
            # Rank 16 up to 4096 tokens: 16-token blocks, 2 column tiles per program
            # (session 14, n = 1 / 8 / 64: T = 1024 8.9 / 10.0 / 11.3 -> 7.7 / 7.8 /
            # 9.2 us, T = 2048 14.8 / 14.8 / 15.6 -> 12.0 / 12.2 / 12.8, T = 4096
            # 1-3 % faster), tiles of 64 columns up to 2048 tokens (n = 8 / 64: T =
            # 1024 7.7 / 8.9 -> 7.6 / 8.6 us, T = 2048 12.2 / 12.7 -> 11.7 / 12.1). At
            # n = 64 each adapter has ~T / 64 tokens, and 32-token blocks ran half
            # empty at 1024 tokens; h is 64 bytes a row at rank 16, so fewer column
            # tiles per program cost little.
            # Past 2048 tokens 4 tiles a program, y loaded a tile ahead (session 26,
            # T = 4096, n = 8 / 64: 21.7 / 23.9 -> 20.0 / 21.8 us).
            if long:
                return BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=4, prefetch=1)
            return BlockSizes(block_m=16, block_n=64, num_stages=2, tiles_n=2, cols_inner=True)
        ahead = full and rank_p == 64  # measured at 64 (the 32 x 128 tiles at 16 / 32: no)
        return BlockSizes(
            block_m=32, block_n=128, num_stages=2, tiles_n=4, prefetch=int(ahead), cols_inner=ahead
        )
    if op == "fused":
        return fused_default(num_tokens, hidden, rank_p, out_features, num_slices)
    raise ValueError(f"BlockSizes.get_default: op={op!r}; expected 'shrink', 'expand' or 'fused'.")


FUSED_TARGET_PROGRAMS = 132
"""Fused decode aims for about one live program per SM of an H200 (not yet measured)."""


def fused_default(
    num_tokens: int, hidden: int, rank_p: int, out_features: int, num_slices: int
) -> BlockSizes:
    """Fused shrink-expand tiles (untuned guesses; the ops benchmark ``--fused`` sweeps split_n).

    Every program streams x [16, H] and one slot's A [R, H] before its expand
    tiles, so the k loop is wide (few iterations, 2 stages) with block_k shrinking
    as the rank grows to keep shared memory under budget. ``split_n`` spreads a
    slice's column tiles over groups until about FUSED_TARGET_PROGRAMS programs
    carry work, assuming max(T / 16, min(T, 8)) live token blocks as shrink does.
    """
    del hidden
    block_k = 256 if rank_p <= 32 else 128 if rank_p <= 64 else 64
    block_n = 128
    if num_tokens > DECODE_MAX_TOKENS:
        # Not the fused kernel's regime (the shrink is recomputed per column group).
        return BlockSizes(block_m=32, block_k=64, block_n=block_n, num_stages=2, split_n=4)
    live = max(-(-num_tokens // 16), min(num_tokens, 8)) * max(1, num_slices)
    tiles = max(1, -(-max(out_features, 1) // block_n))
    want = max(1, FUSED_TARGET_PROGRAMS // live)
    split_n = min(1 << (want.bit_length() - 1), next_pow2(tiles))  # power of two <= want
    return BlockSizes(
        block_m=16, block_k=block_k, block_n=block_n, num_warps=4, num_stages=2, split_n=split_n
    )
