"""Tile sizes for the shrink/expand kernels: the `BlockSizes` dataclass. The H200 table
that picks them by op and static shape is tuning.py (`BlockSizes.get_default`).

Triton dots need every dimension >= 16 and power-of-two tiles, so every tile field
here is a power of two >= 16.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Static tiling of one shrink or expand launch.

    Example::

        bs = BlockSizes.get_default("shrink", num_tokens=64, hidden=4096, rank=16)
        out = lora_shrink(x, lora_a, ..., block_sizes=bs)
    """

    block_m: int = 16
    """Tokens per program (rows of one adapter's run in ``sorted_token_ids``)."""
    block_k: int = 256
    """Shrink: hidden columns per step of the reduction loop."""
    block_r: int = 16
    """Shrink: rank columns per program (the rank is split over programs)."""
    block_n: int = 64
    """Expand: output columns per program."""
    num_warps: int = 4
    """Warps per Triton program."""
    num_stages: int = 3
    """Software-pipelining depth of the shrink reduction loop."""
    split_k: int = 1
    """Shrink: programs that share the hidden reduction of one (block, rank block).

    Each writes an f32 partial [T, R]; the partials are summed in XLA (deterministic),
    unless ``atomic_programs`` is set (then this is the most the split may be). Decode
    uses it to fill the GPU: a handful of token blocks x 32 k steps each leaves most SMs
    idle.
    """
    atomic_programs: int = 0
    """Shrink: when > 0, the split's programs add their f32 partial sums into a zeroed
    output with atomics, so no second kernel sums partials.

    The hidden split is then picked at run time from the step's count of live token
    blocks (the work list's row 3) so that about ``atomic_programs`` (block, k range)
    items exist (``split_k`` caps it): 8 live blocks get 8 times the split of 64. The f32
    summation order, not what is read, varies from run to run (as in vLLM's split-K).
    """
    live_split: bool = True
    """Shrink with ``atomic_programs``: the split is picked when the kernel runs, from the
    step's live block count (the work list's row 3), which every program reads before its
    own entry. False: the split is ``split_k``, fixed, and a program reads only its own
    block's entry (blocks past the mapped ones have no rows, or the slot -1, and add
    nothing), so x's loads wait on one round trip to memory instead of two. Session 35
    (benchmarks/RESULTS.md): at 4096 tokens, rank 16, the shrink over rectangles of x runs
    10.5 us alone where the library's kernel takes ~11.2 with the same tiles."""
    persistent: bool = True
    """Shrink with ``atomic_programs``: about that many programs walk the (block, k range)
    items in turn; if False, the grid is (block, slice, ``split_k`` x rank block) and
    programs past the live blocks or the picked split return at once."""
    split_inner: bool = False
    """Shrink on the static grid (not ``persistent``): grid axis 0 walks (block, k split,
    rank block), so a block's k-split programs are neighbours in launch order and the
    programs of the work list's static tail (blocks with no rows: the list's upper bound
    leaves up to max_loras + 1 of them) launch after every live one, instead of between
    one k split's blocks and the next's. H200, session 37 (benchmarks/RESULTS.md), rank
    16, 4096 tokens, split 4 fixed: 12.5-12.8 -> 11.8-12.2 us over 1 and 8 adapters, the
    tail's cost between the waves; no default takes it: the persistent default ran 11.6 /
    11.9 beside it, and ranks 64 / 128 (split 2) tied."""
    rank_inner: bool = False
    """Shrink with more than one rank block (``block_r`` < the padded rank): a token
    block's rank-block programs are neighbours in launch order (grid axis 0 walks (block,
    rank block) pairs), so they run at the same time and all but the first read the
    block's x from L2. False: the rank block is the last grid axis, so every block's
    first rank block launches before any second one, and where x outgrows L2 (16384
    tokens at H = 4096: 134 MB against 60 MB) the second reads x from HBM again."""
    cols_inner: bool = False
    """Expand on the static grid (no ``live_programs``, no ``block_groups``): grid axis 0
    walks the column groups (of ``tiles_n`` tiles), so a token block's column groups are
    neighbours in launch order and run at the same time: all but the first read the
    block's h from L2, and y's gathered rows are read and written across their whole
    width at once rather than a column group of every block at a time. False: the token
    block is axis 0, and every block's first column group launches before any second."""
    tiles_n: int = 1
    """Expand: ``block_n`` column tiles one program walks, in a loop.

    The program loads its tokens' h [block_m, R] (f32) once for all of them; with one
    tile per program, every column tile re-reads h, which at prefill ranks (64-128) is
    as many bytes as the tile's y and B.
    """
    prefetch: int = 0
    """Expand with ``tiles_n`` > 1 (and no ``live_programs``): column tiles of y loaded
    ahead (0: none). Step j of a program's column-tile loop loads tile j + prefetch's y
    before tile j's B, dot and store, and carries the loaded tiles (the first ones are
    issued before h's load). Triton software-pipelines only the loads that feed a dot
    (B's), and the prefill expand waits on its gathered y rows (session 16's probe: 30.8
    -> 21.3 us at T = 4096, R = 128, n = 8 without y's loads). True counts as 1."""
    prefetch_rows: int = 0
    """Expand with ``prefetch``: when > 0, only token blocks of at least this many rows
    load ahead; emptier blocks (many adapters with a few tokens each, where B's bytes
    dominate) walk their column tiles without it. The choice is made per block when
    the kernel runs, so one compiled kernel serves both kinds of step. H200, session 33
    (benchmarks/RESULTS.md): no default uses it; at 1024 tokens the full blocks lost what
    the ahead-load alone wins over 8 adapters (rank 128: 12.7-13.0 us with it everywhere,
    14.7 with it from 32 rows, 14.6 without)."""
    live_programs: int = 0
    """Expand: when > 0, the column tiles one program walks are picked when the kernel
    runs, from the step's live token blocks (the work list's row 3): the most, up to
    ``tiles_n`` (a power of two), that keep about this many programs working. The grid
    then has a program per column tile, and those a group does not start return at once.

    At 64 tokens, 64 adapters give 64 live blocks and 4 tiles a program pays (h loaded
    once); 8 adapters give 8 blocks, and 4 tiles a program would leave 64 programs on 132
    SMs (session 16: vLLM's one-tile programs beat ours there).
    """
    block_groups: int = 0
    """Expand: when > 0, the grid is (column tile of a slice, group) with this many groups,
    and program g walks the step's live token blocks g, g + groups, ... in a loop (the
    work list's row 3 counts them), loading its B tile per block. No program is launched
    for the blocks of the list's static tail (at 64 tokens over 64 slots the list has 68
    entries, and 8 adapters fill 8 of them). ``tiles_n`` and ``live_programs`` are not used.
    """
    per_token: bool = False
    """Shrink / expand: a program per token (pallas_triton_bgmv.py, Punica's BGMV) and
    ``split_k`` k ranges x ``block_r`` rank rows (shrink) or ``tiles_n`` column tiles of
    ``block_n`` (expand), each reading its own token's adapter rows and summing their
    products with x (h) on the CUDA cores; no work list and no token blocks. ``block_m``
    is not used. For decode steps where most tokens have an adapter of their own.
    """
    rect: bool = False
    """Shrink: x read in rectangles of ``block_m`` consecutive tokens, with no work list,
    each block's slot read from its first token (`pallas_triton_rect.rect_shrink`);
    ``split_k`` k ranges (they must divide the hidden size's ``block_k`` steps) added
    atomically. Right only where the host found every mapped token in whole tiles of one
    slot (`lora_shrink(whole_tiles="all")`, which it then needs) and ``block_m`` divides
    those tiles, or is twice them with ``split_k`` > 1 (pairs of tiles: one rectangle
    where both are one slot's; H200, session 42: 8-12 % slower than 64-row blocks at rank
    64, no default uses them). ``rank_inner`` launches a block's rank blocks side by
    side. Defaults: ranks 16, 32 and 64 (`tuning_long_shrink.rect_shrink_tiles`)."""
    x_first: bool = False
    """Shrink over rectangles (``rect``): the k loop runs whatever the block's slot, so
    the first k step's x tile is requested while the slot's load (the program's first
    read, which A's tiles wait on) is still in flight, instead of after it. A block with
    no live slot (unmapped tokens, or a rank block past its slot's true rank) reads that
    one x tile and no A, runs its dots on zeros and stores zeros. Default of the rectangle
    tiles (`tuning_long_shrink.rect_shrink_tiles`; H200, session 43: 2-8 % faster at ranks
    16 / 32, 2-4 % at rank 64 with 1024 tokens, a tie from 4096)."""
    split_n: int = 1
    """Fused shrink-expand: column groups per (work block, slice), at most.

    Each group recomputes the block's shrink and walks its share of the slice's
    ``block_n`` tiles: more groups, more parallelism and more (L2) re-reads of x and A.
    """

    def __post_init__(self):
        for field in dataclasses.fields(self):  # a float tile or count failed later, unnamed
            v = getattr(self, field.name)
            if field.type == "bool":
                if not isinstance(v, bool | np.bool_):
                    raise ValueError(f"BlockSizes.{field.name}={v!r}: must be True or False.")
                object.__setattr__(self, field.name, bool(v))
            elif field.type == "int":
                if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer):
                    raise ValueError(f"BlockSizes.{field.name}={v!r}: must be an int.")
                object.__setattr__(self, field.name, int(v))
        for f in ("block_m", "block_k", "block_r", "block_n"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"BlockSizes.{f}={v}: Triton tiles must be powers of two >= 16.")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"BlockSizes.num_warps={self.num_warps}: use 1, 2, 4, 8 or 16.")
        if self.split_k < 1:
            raise ValueError(f"BlockSizes.split_k={self.split_k}: must be >= 1.")
        if self.atomic_programs < 0:
            raise ValueError(
                f"BlockSizes.atomic_programs={self.atomic_programs}: must be >= 0 (0: off)."
            )
        if self.tiles_n < 1:
            raise ValueError(f"BlockSizes.tiles_n={self.tiles_n}: must be >= 1.")
        if self.live_programs < 0:
            raise ValueError(
                f"BlockSizes.live_programs={self.live_programs}: must be >= 0 (0: off)."
            )
        if self.live_programs and self.tiles_n & (self.tiles_n - 1):
            raise ValueError(
                f"BlockSizes.tiles_n={self.tiles_n}: with live_programs it must be a power of two."
            )
        if self.cols_inner and (self.live_programs or self.block_groups):
            raise ValueError(
                "BlockSizes.cols_inner=True: only for the expand's static grid; "
                "live_programs and block_groups must be 0."
            )
        if self.block_groups < 0:
            raise ValueError(f"BlockSizes.block_groups={self.block_groups}: must be >= 0 (0: off).")
        if self.split_n < 1:
            raise ValueError(f"BlockSizes.split_n={self.split_n}: must be >= 1.")
        if not 0 <= int(self.prefetch) <= 4:
            raise ValueError(
                f"BlockSizes.prefetch={self.prefetch}: column tiles loaded ahead, 0 (off) to 4."
            )
        if self.prefetch_rows < 0:
            raise ValueError(
                f"BlockSizes.prefetch_rows={self.prefetch_rows}: must be >= 0 (0: every block)."
            )
        if self.rect and self.per_token:
            raise ValueError(
                "BlockSizes: rect=True (x in rectangles of block_m tokens) and per_token=True "
                "(a program per token) exclude each other; pass one."
            )
        if self.x_first and not self.rect:
            raise ValueError(
                "BlockSizes.x_first=True: only for the shrink over rectangles (rect=True)."
            )
        if self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages={self.num_stages}: must be >= 1.")

    @classmethod
    def get_default(
        cls,
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
        """Tuned defaults for H200 (see benchmarks/RESULTS.md), by op and static shape:
        `tuning.default_block_sizes`, whose rules carry their measurements.

        ``op`` is "shrink", "expand" or "fused" (`lora_shrink_expand`; there
        ``out_features`` is the widest slice and ``num_slices`` the slice count).
        For the expand, ``hidden`` is y's width (all slices).
        ``per_token``: the per-token (BGMV) tiles of a shrink or expand, for steps whose
        tokens mostly have an adapter of their own (`tuning_per_token.per_token_default`).
        ``tokens_per_slot``: the host's hint of the expand's token-block fill
        (`tuning.AHEAD_TOKENS_PER_SLOT`).
        """
        from lora_jax.kernels.shrink_expand.tuning import default_block_sizes

        return default_block_sizes(
            op,
            num_tokens=num_tokens,
            hidden=hidden,
            rank=rank,
            out_features=out_features,
            num_slices=num_slices,
            per_token=per_token,
            tokens_per_slot=tokens_per_slot,
        )
