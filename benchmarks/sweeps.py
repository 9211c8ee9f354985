"""The tile candidates `ops.py` sweeps (`--sweep`, `--sweep-set prefill`, `--model K
--decode-sweep`, `--fused`) and the past defaults its before/after rows name.

Each list is append-only: `benchmarks/RESULTS.md` names candidates by their index
(``PREFILL_SWEEP["shrink"][59]``), so an entry is never moved or removed. Data only, no
jax work at import.
"""

from __future__ import annotations

import dataclasses

from lora_jax.kernels import BlockSizes

# The decode shrink tiles before split-K (commit 694f20a), for before/after rows.
OLD_DECODE_SHRINK = BlockSizes(block_m=16, block_r=16, block_k=128, num_warps=4, num_stages=4)

# The session-6 decode shrink default at H = 4096 (persistent from 16 tokens), for variants.
ATOMIC_DECODE = BlockSizes(
    block_m=16, block_r=64, block_k=128, num_stages=2, split_k=32, atomic_programs=528
)

# Per-token (BGMV) tiles: a program per token x k range (shrink) or column tile (expand).
BGMV_SHRINK = BlockSizes(per_token=True, block_r=16, block_k=512, split_k=8, num_stages=1)
BGMV_EXPAND = BlockSizes(per_token=True, block_n=128, num_stages=1)

SWEEP = {
    "shrink": [
        OLD_DECODE_SHRINK,
        BlockSizes(block_m=16, block_r=64, block_k=64, num_stages=2, split_k=8),
        BlockSizes(block_m=16, block_r=64, block_k=64, num_stages=2, split_k=16),
        BlockSizes(block_m=16, block_r=64, block_k=64, num_stages=2, split_k=32),
        BlockSizes(block_m=16, block_r=64, block_k=128, num_stages=2, split_k=16),
        BlockSizes(block_m=16, block_r=32, block_k=64, num_stages=3, split_k=16),
        BlockSizes(block_m=16, block_r=128, block_k=32, num_stages=3, split_k=32),
        BlockSizes(block_m=16, block_r=16, block_k=256, num_stages=2),
        BlockSizes(block_m=16, block_r=32, block_k=128, num_stages=3),
        BlockSizes(block_m=16, block_r=16, block_k=64, num_stages=6),
        BlockSizes(block_m=32, block_r=64, block_k=64, num_stages=3, num_warps=8),
        BlockSizes(block_m=64, block_r=64, block_k=64, num_stages=2),
        BlockSizes(block_m=32, block_r=128, block_k=32, num_stages=4),
        BlockSizes(block_m=64, block_r=128, block_k=32, num_stages=3, num_warps=8),
        BlockSizes(block_m=16, block_r=64, block_k=128, num_stages=2),
        # 15-19: atomic split-K (one launch, the split picked from the live blocks)
        dataclasses.replace(ATOMIC_DECODE, atomic_programs=264),
        ATOMIC_DECODE,
        dataclasses.replace(ATOMIC_DECODE, block_k=64, num_stages=3, split_k=64),
        dataclasses.replace(ATOMIC_DECODE, block_k=256, split_k=16, atomic_programs=264),
        dataclasses.replace(ATOMIC_DECODE, atomic_programs=132),
        # 20-22: atomic split-K on the static (block, slice, split) grid
        dataclasses.replace(ATOMIC_DECODE, persistent=False),
        dataclasses.replace(ATOMIC_DECODE, atomic_programs=264, persistent=False),
        dataclasses.replace(ATOMIC_DECODE, block_k=64, num_stages=3, split_k=64, persistent=False),
        # 23-26 (session 8): fewer warps per program, longer k steps, narrower rank blocks
        dataclasses.replace(ATOMIC_DECODE, num_warps=2),
        dataclasses.replace(ATOMIC_DECODE, block_k=256, split_k=16),
        dataclasses.replace(ATOMIC_DECODE, num_warps=2, atomic_programs=1056),
        dataclasses.replace(ATOMIC_DECODE, block_r=32),
        # 27-28: deeper pipelines, over 48 KiB of shared memory (LORA_JAX_TRITON_SMEM_BUDGET)
        dataclasses.replace(ATOMIC_DECODE, block_k=256, num_stages=3, split_k=16),
        dataclasses.replace(ATOMIC_DECODE, num_stages=4),
        # 29-32 (session 17: ncu put the rank-16, n = 64 decode shrink at 8 two-warp
        # programs a SM, 23 % occupancy, waiting on loads): more warps or items a SM
        dataclasses.replace(ATOMIC_DECODE, num_warps=4, atomic_programs=1056),
        dataclasses.replace(ATOMIC_DECODE, num_warps=2, atomic_programs=2112),
        dataclasses.replace(ATOMIC_DECODE, num_warps=1, atomic_programs=2112),
        dataclasses.replace(
            ATOMIC_DECODE, block_k=64, split_k=64, num_warps=2, atomic_programs=2112
        ),
        # 33-39 (session 18): per-token programs (pallas_triton_bgmv.py), each loading its
        # token's whole [block_r, block_k] tile of A at once: split_k k ranges x rank blocks
        BGMV_SHRINK,
        dataclasses.replace(BGMV_SHRINK, block_r=64, block_k=256, split_k=16),
        dataclasses.replace(BGMV_SHRINK, block_r=64, block_k=128, split_k=32),
        dataclasses.replace(BGMV_SHRINK, block_r=32, block_k=256, split_k=16),
        dataclasses.replace(BGMV_SHRINK, block_r=64, block_k=256, split_k=16, num_warps=8),
        dataclasses.replace(BGMV_SHRINK, block_k=1024, split_k=4),
        dataclasses.replace(BGMV_SHRINK, block_r=64, block_k=512, split_k=8, num_warps=8),
    ],
    "expand": [
        BlockSizes(block_m=16, block_n=64, num_stages=1),
        BlockSizes(block_m=16, block_n=64, num_stages=1, num_warps=2),
        BlockSizes(block_m=16, block_n=256, num_stages=1),
        BlockSizes(block_m=16, block_n=32, num_stages=1, num_warps=2),
        BlockSizes(block_m=16, block_n=256, num_stages=1, num_warps=8),
        BlockSizes(block_m=32, block_n=128, num_stages=1),
        BlockSizes(block_m=64, block_n=256, num_stages=1, num_warps=8),
        BlockSizes(block_m=128, block_n=128, num_stages=1, num_warps=8),
        BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=2),
        BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=4),
        BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=8),
        BlockSizes(block_m=16, block_n=128, num_stages=1),  # decode default before session 5
        # 12-16 (session 18): per-token programs (pallas_triton_bgmv.py), a [block_n, R]
        # tile of B a program (16: two tiles, h loaded once)
        BGMV_EXPAND,
        dataclasses.replace(BGMV_EXPAND, block_n=256, num_warps=8),
        dataclasses.replace(BGMV_EXPAND, block_n=64),
        dataclasses.replace(BGMV_EXPAND, block_n=512, num_warps=8),
        dataclasses.replace(BGMV_EXPAND, tiles_n=2, num_stages=2),
        # 17-22 (session 32): the decode expand at 256 tokens over 64 adapters (R = 64: 64 %
        # of the roofline, B's 32 MB streamed once): deeper B pipelines and longer walks
        # than the default ([9] with live_programs 264), more programs, wider tiles
        BlockSizes(block_m=16, block_n=128, num_stages=3, tiles_n=4, live_programs=264),
        BlockSizes(block_m=16, block_n=128, num_stages=3, tiles_n=8, live_programs=132),
        BlockSizes(block_m=16, block_n=128, num_stages=4, tiles_n=8, live_programs=132),
        BlockSizes(block_m=16, block_n=256, num_stages=2, tiles_n=2, live_programs=264),
        BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=4, live_programs=528),
        BlockSizes(block_m=16, block_n=64, num_stages=3, tiles_n=8, live_programs=264),
    ],
}


# A 64-token, 128-rank prefill shrink tile, 3 stages of 64-column k steps (72 KiB of
# shared memory), 8 warps, atomic split-K: the base of the session-8 prefill candidates.
PREFILL_BIG = BlockSizes(
    block_m=64,
    block_r=128,
    block_k=64,
    num_warps=8,
    num_stages=3,
    split_k=8,
    atomic_programs=528,
)

# The session-8 long-prompt rank-16 shrink default: 128-column k steps, 3 stages (36 KiB).
PREFILL_R16 = BlockSizes(
    block_m=32, block_r=16, block_k=128, num_stages=3, split_k=8, atomic_programs=528
)


def rect_tiles(fields: str, rows, **fixed) -> list[BlockSizes]:
    """Candidates of the rectangle shrink (`BlockSizes.rect`): one a row of ``rows``, the
    row's values for the space-separated ``fields``, the rest from ``fixed``."""
    names = fields.split()
    return [BlockSizes(rect=True, **fixed, **dict(zip(names, row, strict=True))) for row in rows]


# Prefill / mid-size tile candidates for `--sweep --sweep-set prefill` (T > 256): the
# prefill shrink had no split-K, so at T = 1024 it ran ~40 programs on 132 SMs.
PREFILL_SWEEP = {
    "shrink": [
        BlockSizes(block_m=32, block_r=64, block_k=64, num_stages=3, split_k=2),
        BlockSizes(block_m=32, block_r=64, block_k=64, num_stages=3, split_k=4),
        BlockSizes(block_m=32, block_r=64, block_k=64, num_stages=3, split_k=8),
        BlockSizes(block_m=64, block_r=64, block_k=64, num_stages=2),
        BlockSizes(block_m=64, block_r=64, block_k=64, num_stages=2, split_k=4),
        BlockSizes(block_m=64, block_r=16, block_k=128, num_stages=2, split_k=2),
        BlockSizes(block_m=128, block_r=16, block_k=64, num_stages=2, num_warps=8),
        BlockSizes(block_m=128, block_r=16, block_k=64, num_stages=2, num_warps=8, split_k=4),
        BlockSizes(block_m=32, block_r=32, block_k=128, num_stages=2, split_k=4),
        BlockSizes(block_m=16, block_r=64, block_k=128, num_stages=2, split_k=16),
        BlockSizes(block_m=64, block_r=128, block_k=32, num_stages=3, num_warps=8, split_k=2),
        BlockSizes(block_m=32, block_r=128, block_k=32, num_stages=4, split_k=4),
        BlockSizes(block_m=64, block_r=128, block_k=32, num_stages=3),
        BlockSizes(block_m=128, block_r=128, block_k=32, num_stages=2, num_warps=8),
        # 14-16: atomic split-K (no partial-sum kernel; split from the live blocks)
        BlockSizes(
            block_m=32, block_r=64, block_k=64, num_stages=3, split_k=8, atomic_programs=528
        ),
        BlockSizes(
            block_m=32, block_r=64, block_k=64, num_stages=3, split_k=8, atomic_programs=1056
        ),
        BlockSizes(
            block_m=64, block_r=64, block_k=64, num_stages=2, split_k=8, atomic_programs=528
        ),
        # 17-24 (session 8): 64-128-token blocks and wide rank blocks (fewer L2 re-reads of
        # x and A per output), most over 48 KiB of shared memory: run them with
        # LORA_JAX_TRITON_SMEM_BUDGET raised, or they are shrunk to fit 45 KiB.
        dataclasses.replace(PREFILL_BIG, num_warps=4),
        PREFILL_BIG,
        dataclasses.replace(PREFILL_BIG, block_m=128),
        dataclasses.replace(PREFILL_BIG, block_m=128, num_stages=4, atomic_programs=264),
        dataclasses.replace(PREFILL_BIG, block_r=64, block_k=128, num_warps=4),
        dataclasses.replace(PREFILL_BIG, block_m=128, block_r=64),
        dataclasses.replace(PREFILL_BIG, block_m=32, block_r=64, block_k=128, num_warps=4),
        dataclasses.replace(PREFILL_BIG, block_m=128, split_k=4, atomic_programs=0),
        # 25-27: the R = 128 default ([24]) with other splits
        dataclasses.replace(PREFILL_BIG, block_m=128, split_k=8),
        dataclasses.replace(PREFILL_BIG, block_m=128, split_k=8, atomic_programs=0),
        dataclasses.replace(PREFILL_BIG, block_m=128, split_k=2, atomic_programs=0),
        # 28-33 (session 9), rank 16: the default on the static (block, split) grid (no
        # dependent load of the live count before a block's), longer k steps, deeper pipelines
        dataclasses.replace(PREFILL_R16, persistent=False),
        dataclasses.replace(PREFILL_R16, block_k=256, persistent=False),
        dataclasses.replace(PREFILL_R16, block_k=256, num_stages=4, persistent=False),
        dataclasses.replace(PREFILL_R16, block_m=64, block_k=256, num_warps=8, persistent=False),
        dataclasses.replace(PREFILL_R16, num_stages=5, persistent=False),
        dataclasses.replace(
            PREFILL_R16,
            block_m=16,
            block_k=256,
            num_stages=4,
            atomic_programs=1056,
            persistent=False,
        ),  # fmt: skip
        # 34-37 (session 9), ranks 64 and 128 on the static grid
        dataclasses.replace(PREFILL_BIG, block_r=64, persistent=False),
        dataclasses.replace(PREFILL_BIG, block_r=64, block_k=128, persistent=False),
        dataclasses.replace(PREFILL_BIG, block_m=128, persistent=False),
        dataclasses.replace(PREFILL_BIG, num_stages=4, persistent=False),
        # 38 (session 9): 64-token, 64-rank blocks with twice the atomic items
        dataclasses.replace(PREFILL_BIG, block_r=64, atomic_programs=1056),
        # 39-41 (session 14): a hidden split of up to 16 at H = 8192 (the default's cap
        # is 8): the T = 1024 default's tiles, with twice the items, and the T = 4096 one's
        BlockSizes(
            block_m=32, block_r=64, block_k=64, num_stages=3, split_k=16, atomic_programs=528
        ),
        BlockSizes(
            block_m=32, block_r=64, block_k=64, num_stages=3, split_k=16, atomic_programs=1056
        ),
        dataclasses.replace(PREFILL_BIG, block_r=64, split_k=16, persistent=False),
        # 42-47 (session 29): no software pipeline (num_stages 1: x's tiles through plain
        # vector loads into registers, as XLA's fusions read), rank 16 then ranks 64 / 128
        dataclasses.replace(PREFILL_R16, num_stages=1),
        dataclasses.replace(PREFILL_R16, num_stages=1, block_k=256),
        dataclasses.replace(PREFILL_R16, num_stages=1, block_k=256, atomic_programs=1056),
        dataclasses.replace(PREFILL_R16, num_stages=1, block_m=64, num_warps=8),
        dataclasses.replace(PREFILL_BIG, block_r=64, num_stages=1, persistent=False),
        dataclasses.replace(PREFILL_BIG, block_r=64, block_k=128, num_stages=1, persistent=False),
        # 48-53 (session 30): no hidden split, so no atomics and no zeroed output (an XLA
        # memset of [T, R] f32 before the kernel): every x row read by one program, deep
        # pipelines of long k steps to keep x's bytes in flight. Rank 16, then rank 64.
        BlockSizes(block_m=32, block_r=16, block_k=256, num_stages=4),
        BlockSizes(block_m=16, block_r=16, block_k=256, num_stages=4),
        BlockSizes(block_m=16, block_r=16, block_k=512, num_stages=3),
        BlockSizes(block_m=32, block_r=16, block_k=128, num_stages=6),
        BlockSizes(block_m=32, block_r=64, block_k=128, num_stages=4),
        BlockSizes(block_m=64, block_r=64, block_k=128, num_stages=3, num_warps=8),
        # 54-55 (session 30, after run 1: [53] beat the split-2 default at 16384 tokens,
        # rank 64): the default's 64-column k steps with no split; [53] 4 stages deep
        BlockSizes(block_m=64, block_r=64, block_k=64, num_stages=3, num_warps=8),
        BlockSizes(block_m=64, block_r=64, block_k=128, num_stages=4, num_warps=8),
        # 56-58 (session 30): the rank-16 default on 2 warps (smaller programs, more of
        # them resident a SM), with twice the atomic items, and on 16-token blocks
        dataclasses.replace(PREFILL_R16, num_warps=2),
        dataclasses.replace(PREFILL_R16, num_warps=2, atomic_programs=1056),
        dataclasses.replace(PREFILL_R16, block_m=16, num_warps=2, atomic_programs=1056),
        # 59-62 (session 30, after run 3): the 128-column k steps that won from 8192 tokens
        # at rank 64, at 4096 tokens with a split of 2 or 4 (4 or 3 stages)
        dataclasses.replace(
            PREFILL_BIG, block_r=64, block_k=128, num_stages=4, split_k=2, persistent=False
        ),
        dataclasses.replace(
            PREFILL_BIG, block_r=64, block_k=128, num_stages=3, split_k=4, persistent=False
        ),
        dataclasses.replace(
            PREFILL_BIG, block_r=64, block_k=128, num_stages=4, split_k=4, persistent=False
        ),
        dataclasses.replace(
            PREFILL_BIG, block_r=64, block_k=128, num_stages=3, split_k=2, persistent=False
        ),
        # 63-66 (session 31): rank 128's two 64-row rank blocks launched side by side
        # (rank_inner), so the second reads x from L2: [53], [55], [62], [59] so launched
        BlockSizes(block_m=64, block_r=64, block_k=128, num_stages=3, num_warps=8, rank_inner=True),
        BlockSizes(block_m=64, block_r=64, block_k=128, num_stages=4, num_warps=8, rank_inner=True),
        dataclasses.replace(
            PREFILL_BIG,
            block_r=64,
            block_k=128,
            num_stages=3,
            split_k=2,
            persistent=False,
            rank_inner=True,
        ),
        dataclasses.replace(
            PREFILL_BIG,
            block_r=64,
            block_k=128,
            num_stages=4,
            split_k=2,
            persistent=False,
            rank_inner=True,
        ),
        # 67-68 (session 31): the session-9 tiles launched side by side: split up to 8
        # atomically ([34]'s), and unsplit ([54]'s; rank 128's default from 8192 tokens)
        dataclasses.replace(PREFILL_BIG, block_r=64, persistent=False, rank_inner=True),
        BlockSizes(block_m=64, block_r=64, block_k=64, num_stages=3, num_warps=8, rank_inner=True),
        # 69-71 (session 31): 1024 tokens at H = 8192 (the general rule's 32 x 64 tiles in
        # 64-column k steps, 52 % of the roofline at n = 8): 128-column k steps split up to
        # 8 or 16 ways on 64- and 32-token blocks
        dataclasses.replace(
            PREFILL_BIG, block_r=64, block_k=128, num_stages=4, split_k=8, persistent=False
        ),
        dataclasses.replace(
            PREFILL_BIG, block_r=64, block_k=128, num_stages=3, split_k=16, persistent=False
        ),
        BlockSizes(
            block_m=32,
            block_r=64,
            block_k=128,
            num_stages=3,
            split_k=8,
            atomic_programs=528,
            persistent=False,
        ),
        # 72-75 (session 31, not yet run): 128-token blocks (half the L2 re-reads of A per
        # token, which over 8 adapters at 4096 tokens and rank 128 are as many bytes as x's
        # two reads), rank blocks side by side: 128 x 64 in 128-column k steps unsplit, 3
        # stages (144 KiB) or split 2; in 64-column k steps 4 stages (96 KiB); 128 x 128
        # split 2 (one rank block, x read once)
        BlockSizes(
            block_m=128, block_r=64, block_k=128, num_stages=3, num_warps=8, rank_inner=True
        ),
        dataclasses.replace(
            PREFILL_BIG,
            block_m=128,
            block_r=64,
            block_k=128,
            split_k=2,
            persistent=False,
            rank_inner=True,
        ),
        BlockSizes(block_m=128, block_r=64, block_k=64, num_stages=4, num_warps=8, rank_inner=True),
        dataclasses.replace(PREFILL_BIG, block_m=128, split_k=2, persistent=False),
        # 76-78 (session 32): 128 x 128 output tiles (x read once a 128-token block, A once
        # a block: a quarter of the 64 x 64 tiles' L2 reads of A), 4 stages of 64-column k
        # steps (128 KiB) unsplit or split up to 2 / 4 on the static grid
        dataclasses.replace(PREFILL_BIG, block_m=128, num_stages=4, split_k=1, atomic_programs=0),
        dataclasses.replace(PREFILL_BIG, block_m=128, num_stages=4, split_k=2, persistent=False),
        dataclasses.replace(PREFILL_BIG, block_m=128, num_stages=4, split_k=4, persistent=False),
        # 79-80 (session 32, after run 1: [76] won at 16384 tokens): 128-column k steps 3
        # stages deep (192 KiB), 64-column k steps 5 deep (160 KiB), unsplit
        dataclasses.replace(PREFILL_BIG, block_m=128, block_k=128, split_k=1, atomic_programs=0),
        dataclasses.replace(PREFILL_BIG, block_m=128, num_stages=5, split_k=1, atomic_programs=0),
        # 81-83 (session 32): rank 128 at 4096 tokens (56 % over 8 adapters): the whole rank
        # on 64-token blocks (x read once, A once a block: 96 MB of L2 reads against the
        # side-by-side tiles' 128 MB), split 2 or 4 on the static grid, deep pipelines
        dataclasses.replace(PREFILL_BIG, block_k=128, num_stages=4, split_k=2, persistent=False),
        dataclasses.replace(PREFILL_BIG, num_stages=5, split_k=2, persistent=False),
        dataclasses.replace(PREFILL_BIG, num_stages=5, split_k=4, persistent=False),
        # 84-85 (session 32, after run 6: [81] won over 8 adapters, lost over 64): [81]
        # split only while the live blocks are <= 88 (about one item an SM), and unsplit
        dataclasses.replace(
            PREFILL_BIG, block_k=128, num_stages=4, split_k=2, atomic_programs=176, persistent=False
        ),
        dataclasses.replace(PREFILL_BIG, block_k=128, num_stages=4, split_k=1, atomic_programs=0),
        # 86-89 (session 35, not yet run): the rank-16 shrink at 4096 tokens with fewer
        # atomic adds. Its split-4 dot over rectangles runs 10.5 us alone; the 262 K adds
        # of its partials at the programs' common end (and the memset) take it to 11.6.
        # Split 2 on 8 warps (x streams at 10.4 us so), the same in 256-column k steps,
        # split 4 on 8 warps, split 2 on 4 warps; all on the static grid.
        dataclasses.replace(PREFILL_R16, num_warps=8, atomic_programs=264, persistent=False),
        dataclasses.replace(
            PREFILL_R16, block_k=256, num_warps=8, atomic_programs=264, persistent=False
        ),
        dataclasses.replace(PREFILL_R16, num_warps=8, persistent=False),
        dataclasses.replace(PREFILL_R16, atomic_programs=264, persistent=False),
        # 90-92 (session 35, not yet run): the same without the read of the live block
        # count (BlockSizes.live_split=False: the split fixed, x's loads one round trip
        # after the program starts instead of two): split 4 over persistent workers and
        # on the static grid, split 2 on 8 warps
        dataclasses.replace(PREFILL_R16, split_k=4, live_split=False),
        dataclasses.replace(PREFILL_R16, split_k=4, live_split=False, persistent=False),
        dataclasses.replace(
            PREFILL_R16, split_k=2, num_warps=8, atomic_programs=264, live_split=False
        ),
        # 93-94 (session 35, not yet run): the 4096-token defaults of ranks 64 ([59]) and
        # 128 ([84], whose live split is 2 up to 88 live blocks, else 1) at a fixed split of 2
        dataclasses.replace(
            PREFILL_BIG,
            block_r=64,
            block_k=128,
            num_stages=4,
            split_k=2,
            persistent=False,
            live_split=False,
        ),
        dataclasses.replace(
            PREFILL_BIG,
            block_k=128,
            num_stages=4,
            split_k=2,
            atomic_programs=176,
            persistent=False,
            live_split=False,
        ),
        # 95-97 (session 36, after run 1: live_split=False gained 0.1-0.2 us; the fixed
        # split's items now run a static trip count): the rectangle probe's best tiles
        # (64-token blocks, 4 warps, 3 stages, split 4: 10.35 us with its adds at T = 4096)
        # on the static grid and over persistent workers, and [91] on 8 warps
        dataclasses.replace(PREFILL_R16, block_m=64, split_k=4, live_split=False, persistent=False),
        dataclasses.replace(PREFILL_R16, block_m=64, split_k=4, live_split=False),
        dataclasses.replace(
            PREFILL_R16, split_k=4, num_warps=8, live_split=False, persistent=False
        ),
        # 98-104 (session 37): the static grid with a block's k-split programs side by side
        # and the work list's empty tail (65 entries at 64 slots) launched last
        # (BlockSizes.split_inner): [91], [95], rank 16's live split on the static grid,
        # then the 4096-token defaults of ranks 64 ([59]) and 128 ([84]) and their fixed
        # splits ([93], [94])
        dataclasses.replace(
            PREFILL_R16, split_k=4, live_split=False, persistent=False, split_inner=True
        ),
        dataclasses.replace(
            PREFILL_R16,
            block_m=64,
            split_k=4,
            live_split=False,
            persistent=False,
            split_inner=True,
        ),
        dataclasses.replace(PREFILL_R16, split_k=4, persistent=False, split_inner=True),
        dataclasses.replace(
            PREFILL_BIG,
            block_r=64,
            block_k=128,
            num_stages=4,
            split_k=2,
            persistent=False,
            split_inner=True,
        ),
        dataclasses.replace(
            PREFILL_BIG,
            block_r=64,
            block_k=128,
            num_stages=4,
            split_k=2,
            persistent=False,
            live_split=False,
            split_inner=True,
        ),
        dataclasses.replace(
            PREFILL_BIG,
            block_k=128,
            num_stages=4,
            split_k=2,
            atomic_programs=176,
            persistent=False,
            split_inner=True,
        ),
        dataclasses.replace(
            PREFILL_BIG,
            block_k=128,
            num_stages=4,
            split_k=2,
            atomic_programs=176,
            persistent=False,
            live_split=False,
            split_inner=True,
        ),
        # 105-119 (session 42): the shrink over rectangles of x (`rect`: no work list, each
        # 64-token block's slot from its first token; prompts only, the host's whole
        # tiles) at ranks 64 / 128, where the Mosaic segment shrink runs 4096-token prompts
        # at 57-67 % (x's TMA stream) and the rank-16 rectangles reached 75 %. Rank 64 at
        # 4096 tokens (64 blocks): split 4 / 2 / 8, 4 or 8 warps, 64-column k steps,
        # 32-token blocks
        *rect_tiles(
            "block_m block_k num_stages num_warps split_k",
            [(64, 128, 3, 4, 4), (64, 128, 3, 8, 4), (64, 64, 4, 4, 4), (64, 128, 4, 4, 2)],
            block_r=64,
        ),
        *rect_tiles(
            "block_m block_k num_stages num_warps split_k",
            [(64, 128, 3, 4, 8), (32, 128, 3, 4, 4)],
            block_r=64,
        ),
        # rank 128: the whole rank a block (8 or 4 warps, 64- or 128-column steps, split
        # 4 / 2), or two 64-row rank blocks side by side (`rank_inner`)
        *rect_tiles(
            "block_r block_k num_stages num_warps split_k rank_inner",
            [
                (128, 128, 3, 8, 4, False),
                (128, 64, 4, 8, 4, False),
                (64, 128, 3, 4, 4, True),
                (128, 128, 3, 4, 4, False),
                (128, 128, 3, 8, 2, False),
            ],
            block_m=64,
        ),
        # rank 64 at 1024 tokens, H = 8192 (16 blocks of 64 k steps): split 16 / 8, 32-token
        # blocks split 8, 64-column steps split 16
        *rect_tiles(
            "block_m block_k num_stages split_k",
            [(64, 128, 3, 16), (64, 128, 3, 8), (32, 128, 3, 8), (64, 64, 4, 16)],
            block_r=64,
        ),
        # 120-132 (session 42, after run 1: at 4096 tokens, rank 64, [108] (split 2, 4
        # stages) ran 11.9 / 12.7 us over 1 / 8 adapters against the Mosaic shrink's 12.9 /
        # 13.5; the 1024-token H = 8192 cell 9.4 against 10.1): around [108], and the
        # tiles stored whole with no k split (no zeroed output, no atomics)
        *rect_tiles(
            "block_m block_k num_stages num_warps split_k",
            [
                (64, 128, 4, 8, 2),
                (64, 128, 5, 4, 2),
                (64, 256, 3, 4, 2),
                (64, 64, 6, 4, 2),
                (32, 128, 4, 4, 1),
                (64, 128, 4, 4, 1),
                (32, 128, 4, 4, 2),
                (64, 128, 4, 4, 4),
                (64, 128, 4, 4, 8),
                (64, 128, 4, 4, 16),
                (32, 128, 4, 4, 8),
                (64, 256, 3, 4, 8),
                (64, 128, 5, 4, 8),
            ],
            block_r=64,
        ),
        # 133-142 (session 42, after run 3): blocks of two 64-row host tiles (`rect_shrink`'s
        # pairs: one 128-row rectangle where both tiles are one slot's, so A's tile is
        # loaded once for 128 tokens, not 64): rank 64 at 4096 tokens (32 pairs), 1024
        # tokens at H = 8192 (8 pairs), rank 128 at 4096
        *rect_tiles(
            "block_r block_k num_stages num_warps split_k",
            [
                (64, 128, 4, 8, 4),
                (64, 128, 3, 8, 4),
                (64, 128, 4, 4, 4),
                (64, 64, 6, 8, 4),
                (64, 128, 3, 8, 2),
                (64, 128, 4, 8, 16),
                (64, 128, 3, 8, 16),
                (64, 128, 4, 8, 8),
                (128, 64, 4, 8, 4),
                (128, 64, 3, 8, 4),
            ],
            block_m=128,
        ),
        # 143-148 (session 42, after run 4: the pairs lost 8-12 %): rank 64 split into
        # 32- or 16-row rank blocks side by side (`rank_inner`: x from HBM once, then L2),
        # so that a split of 1 (tiles stored whole: no zeroed output, no atomics) still
        # makes 128-256 programs at 4096 tokens; the 1024-token H = 8192 cell with k splits
        *rect_tiles(
            "block_r split_k",
            [(32, 1), (16, 1), (32, 2), (32, 4), (32, 8), (16, 2)],
            block_m=64,
            block_k=128,
            num_stages=4,
            rank_inner=True,
        ),
        # 149-152 (session 43): rank 64 over rectangles on many small programs, x loaded
        # with little or no software pipeline (Triton's plain loads read x at XLA's rate
        # over 512-1024 programs: session 35), against the 128 one-an-SM items of 4 stages
        *rect_tiles(
            "block_k num_stages num_warps split_k",
            [(128, 1, 4, 8), (64, 1, 4, 16), (128, 2, 4, 4), (128, 2, 8, 8)],
            block_m=64,
            block_r=64,
        ),
    ],
    "expand": [  # column tiles per program (h loaded once), then token-block sizes
        BlockSizes(block_m=64, block_n=128, num_stages=1, tiles_n=2),
        BlockSizes(block_m=64, block_n=128, num_stages=1, tiles_n=4),
        BlockSizes(block_m=64, block_n=128, num_stages=2, tiles_n=4),
        BlockSizes(block_m=64, block_n=128, num_stages=2, tiles_n=8),
        BlockSizes(block_m=32, block_n=128, num_stages=2, tiles_n=4),
        BlockSizes(block_m=128, block_n=64, num_stages=2, num_warps=8, tiles_n=4),
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=8),
        # 7-12 (session 8): wider tiles over 48 KiB of shared memory (run them with
        # LORA_JAX_TRITON_SMEM_BUDGET set, or they are fitted to 45 KiB)
        BlockSizes(block_m=64, block_n=128, num_stages=2, tiles_n=4),
        BlockSizes(block_m=64, block_n=128, num_stages=3, num_warps=8, tiles_n=4),
        BlockSizes(block_m=128, block_n=128, num_stages=2, num_warps=8, tiles_n=4),
        BlockSizes(block_m=128, block_n=64, num_stages=3, num_warps=8, tiles_n=8),
        BlockSizes(block_m=64, block_n=256, num_stages=2, num_warps=8, tiles_n=2),
        BlockSizes(block_m=32, block_n=256, num_stages=3, num_warps=8, tiles_n=2),
        # 13-16 (session 9, not yet run): fewer column tiles per program at 1024-2048
        # tokens, where the R = 128 default's 8 tiles leave ~128 programs on 132 SMs
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=2),
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=4),
        BlockSizes(block_m=32, block_n=64, num_stages=2, tiles_n=4),
        BlockSizes(block_m=32, block_n=128, num_stages=2, tiles_n=2),
        # 17-19 (session 14): 16-token blocks at low rank (n = 64 at 1024 tokens gives each
        # adapter ~16 tokens, and 32-token blocks run half empty; SWEEP["expand"][8] was
        # 11.2 -> 9.0 us there in session 14's first run)
        BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=2),
        BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=1),
        BlockSizes(block_m=16, block_n=64, num_stages=2, tiles_n=4),
        # 20-23 (session 14): around [17] (the rank-16 default since): 2 warps, one
        # 256-column tile, 2 x 64 columns, 3 stages
        BlockSizes(block_m=16, block_n=128, num_stages=2, num_warps=2, tiles_n=2),
        BlockSizes(block_m=16, block_n=256, num_stages=2, tiles_n=1),
        BlockSizes(block_m=16, block_n=64, num_stages=2, tiles_n=2),
        BlockSizes(block_m=16, block_n=128, num_stages=3, tiles_n=2),
        # 24-26 (session 14): around [22] (the default up to 2048 tokens since)
        BlockSizes(block_m=16, block_n=64, num_stages=3, tiles_n=2),
        BlockSizes(block_m=16, block_n=64, num_stages=2, tiles_n=1),
        BlockSizes(block_m=16, block_n=32, num_stages=2, tiles_n=4),
        # 27-30 (session 16): ncu read the rank-64 default (32 x 128, 4 warps) at 120
        # registers a thread, 23 % occupancy and stalled on loads: the same tiles on 8
        # warps, narrower column tiles, 3 stages
        BlockSizes(block_m=32, block_n=128, num_stages=2, num_warps=8, tiles_n=4),
        BlockSizes(block_m=64, block_n=64, num_stages=2, num_warps=8, tiles_n=8),
        BlockSizes(block_m=32, block_n=64, num_stages=2, tiles_n=8),
        BlockSizes(block_m=32, block_n=128, num_stages=3, num_warps=8, tiles_n=4),
        # 31-34 (session 20): one column tile per program, as the one-adapter rectangle
        # probe (`--impls rect`, 64 x 128 tiles, 512 programs at 1024 tokens) that ran
        # 1.5 x faster than the default at 1024 tokens, rank 64
        BlockSizes(block_m=64, block_n=128, num_stages=1, tiles_n=1),
        BlockSizes(block_m=64, block_n=128, num_stages=1, tiles_n=1, persistent=False),
        BlockSizes(block_m=32, block_n=128, num_stages=1, tiles_n=1, persistent=False),
        BlockSizes(block_m=64, block_n=64, num_stages=1, tiles_n=1, persistent=False),
        # 35-39 (session 26): the next column tile's y loaded ahead (`prefetch`), with
        # longer walks than the defaults (the ahead-load hides more of each walk)
        BlockSizes(block_m=32, block_n=128, num_stages=2, tiles_n=8, prefetch=1),
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=16, prefetch=1),
        BlockSizes(block_m=64, block_n=128, num_stages=2, tiles_n=4, prefetch=1),
        BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=4, prefetch=1),
        BlockSizes(block_m=32, block_n=64, num_stages=2, tiles_n=8, prefetch=1),
        # 40-42 (session 26, after run 1: prefetch gained at rank 128, lost at 64 on the
        # 32 x 128 tiles): 64 x 64 tiles at rank 64, 8 warps (half the registers a thread)
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=8, prefetch=1),
        BlockSizes(block_m=32, block_n=128, num_stages=2, num_warps=8, tiles_n=4, prefetch=1),
        BlockSizes(block_m=64, block_n=64, num_stages=2, num_warps=8, tiles_n=8, prefetch=1),
        # 43-47 (session 26): 128-token blocks (half the L2 re-reads of B) with the
        # ahead-load; at rank 128 over 48 KiB (run with LORA_JAX_TRITON_SMEM_BUDGET set)
        BlockSizes(block_m=128, block_n=64, num_stages=2, num_warps=8, tiles_n=8, prefetch=1),
        BlockSizes(block_m=128, block_n=64, num_stages=2, tiles_n=8, prefetch=1),
        BlockSizes(block_m=128, block_n=64, num_stages=2, num_warps=8, tiles_n=16, prefetch=1),
        BlockSizes(block_m=64, block_n=128, num_stages=2, num_warps=8, tiles_n=4, prefetch=1),
        BlockSizes(block_m=128, block_n=32, num_stages=2, tiles_n=16, prefetch=1),
        # 48-50 (session 26): two column tiles of y loaded ahead, on the new defaults' tiles
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=8, prefetch=2),
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=16, prefetch=2),
        BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=4, prefetch=2),
        # 51-58 (session 33): the ahead-load at 1024-2048 tokens only in blocks at least
        # half full (`prefetch_rows`): over 8 adapters it gained (session 26: T = 1024, R =
        # 128 14.8 -> 13.0 us), over 64 (quarter-full 64-row blocks, B's bytes) it lost.
        # Run 1 had the emptier blocks in a second loop (its own B buffers): lost; run 2
        # on one loop whose y loads are masked one way or the other
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=4, prefetch=1),
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=4, prefetch=1, prefetch_rows=32),
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=4, prefetch=2, prefetch_rows=32),
        BlockSizes(
            block_m=64,
            block_n=64,
            num_stages=2,
            num_warps=8,
            tiles_n=4,
            prefetch=3,
            prefetch_rows=32,
        ),  # fmt: skip
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=8, prefetch=1, prefetch_rows=32),
        BlockSizes(block_m=32, block_n=128, num_stages=2, tiles_n=4, prefetch=1),
        BlockSizes(block_m=32, block_n=128, num_stages=2, tiles_n=4, prefetch=1, prefetch_rows=16),
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=4, prefetch=1, prefetch_rows=48),
        # 59 (session 33, run 2): 32-token blocks ahead from 24 rows
        BlockSizes(block_m=32, block_n=128, num_stages=2, tiles_n=4, prefetch=1, prefetch_rows=24),
        # 60-61 (session 33, run 3): [51] (ahead-load, 4 tiles) on twice the programs, or
        # on one stage of B (less shared memory a program, more programs an SM)
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=2, prefetch=1),
        BlockSizes(block_m=64, block_n=64, num_stages=1, tiles_n=4, prefetch=1),
        # 62-67 (session 38): a token block's column groups side by side in launch order
        # (`cols_inner`: h from L2 for all but the first, y's gathered rows whole at once)
        # on the defaults' tiles: rank 64 from 8192 tokens and into 8192 columns; rank 64
        # at 4096 tokens and rank 128 up to 8192; rank 128 from 16384; rank 128 with the
        # host's hint at 1024; rank 16 up to 2048; and 32 x 128 tiles in twice the groups
        BlockSizes(block_m=32, block_n=128, num_stages=2, tiles_n=4, cols_inner=True),
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=8, prefetch=1, cols_inner=True),
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=16, prefetch=1, cols_inner=True),
        BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=4, prefetch=1, cols_inner=True),
        BlockSizes(block_m=16, block_n=64, num_stages=2, tiles_n=2, cols_inner=True),
        BlockSizes(block_m=32, block_n=128, num_stages=2, tiles_n=2, cols_inner=True),
        # 68-72 (session 38, after run 1: cols_inner gained at 1024 tokens, tied or lost
        # from 4096): the decode expand's 16-token blocks on the static grid, 4 / 2 / 1
        # column tiles a program; rank 64's hinted tiles; rank 128 in 16-token blocks
        BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=4, cols_inner=True),
        BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=2, cols_inner=True),
        BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=1, cols_inner=True),
        BlockSizes(block_m=32, block_n=128, num_stages=2, tiles_n=4, prefetch=1, cols_inner=True),
        BlockSizes(block_m=16, block_n=64, num_stages=2, tiles_n=4, cols_inner=True),
        # 73-75 (session 38, for the next device call): the decode expand of 256 tokens
        # over 64 adapters (4 a slot: the hint 16), where [68] ran 13.7 -> 12.9 us (the
        # cell needs 12.6): more column tiles a program, a deeper pipeline, wider tiles
        BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=8, cols_inner=True),
        BlockSizes(block_m=16, block_n=128, num_stages=3, tiles_n=4, cols_inner=True),
        BlockSizes(block_m=16, block_n=256, num_stages=2, tiles_n=2, cols_inner=True),
    ],
}


def session25_prefill_expand(tokens: int, rank: int) -> BlockSizes:
    """The prefill expand's default tiles before session 26's ahead-loads (`ours_s25`),
    for the A/B of the new defaults inside one run."""
    rank_p = max(16, 1 << (rank - 1).bit_length())
    if rank_p >= 128:
        return BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=4 if tokens <= 2048 else 8)
    if rank_p <= 16 and tokens <= 4096:
        return BlockSizes(
            block_m=16, block_n=64 if tokens <= 2048 else 128, num_stages=2, tiles_n=2
        )
    return BlockSizes(block_m=32, block_n=128, num_stages=2, tiles_n=4)


# Decode tile candidates for `--model K --decode-sweep` (fatter programs than the defaults).
DECODE_SWEEP = {
    "shrink": [
        BlockSizes(block_m=16, block_r=64, block_k=256, num_stages=2, split_k=1),
        BlockSizes(block_m=16, block_r=64, block_k=256, num_stages=2, split_k=2),
        BlockSizes(block_m=16, block_r=64, block_k=256, num_stages=2, split_k=4),
        BlockSizes(block_m=16, block_r=64, block_k=256, num_stages=2, split_k=8),
        BlockSizes(block_m=16, block_r=64, block_k=128, num_stages=3, split_k=8),
    ],
    "expand": [
        BlockSizes(block_m=16, block_n=256, num_stages=1),
        BlockSizes(block_m=16, block_n=512, num_stages=1),
        BlockSizes(block_m=16, block_n=512, num_stages=1, num_warps=8),
        BlockSizes(block_m=16, block_n=1024, num_stages=1, num_warps=8),
    ],
}


def fused_variant(impl: str, tokens: int, hidden: int, rank: int) -> BlockSizes | None:
    """Tiles of fused impl "fused" (defaults), "fused/2" or "fused*2" (split_n halved/doubled)."""
    if impl == "fused":
        return None
    bs = BlockSizes.get_default(
        "fused", num_tokens=tokens, hidden=hidden, rank=rank, out_features=hidden
    )
    split_n = max(1, bs.split_n // 2) if impl == "fused/2" else bs.split_n * 2
    return dataclasses.replace(bs, split_n=split_n)
