"""Shared checks for every shrink/expand backend (Tokamax style).

A backend's test file subclasses `ShrinkExpandTestBase` and sets
``interpret`` (and, for GPU classes, larger shapes). Everything is compared
with the jnp oracles in `lora_jax.kernels` over shapes x dtypes x slice
layouts x mappings, with the tolerances in `TOLERANCES`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lora_jax.kernels import (
    BlockSizes,
    lora_expand,
    lora_expand_reference,
    lora_shrink,
    lora_shrink_reference,
)

# (op, dtype) -> (rtol, atol) on outputs of unit scale. Shrink sums exact
# products in f32, so only the summation order differs. Expand feeds h to the
# tensor cores in the weights' dtype (as vLLM does) and rounds y once.
TOLERANCES = {
    ("shrink", jnp.float32): (1e-5, 1e-5),
    ("shrink", jnp.bfloat16): (1e-4, 1e-4),
    ("shrink", jnp.float16): (1e-4, 1e-4),
    ("expand", jnp.float32): (1e-5, 1e-5),
    ("expand", jnp.bfloat16): (2e-2, 2e-2),
    ("expand", jnp.float16): (4e-3, 4e-3),
}


def make_metadata(token_lora_indices, max_loras: int) -> dict[str, jax.Array]:
    """The kernels' metadata, built in numpy the obvious way (the oracle of LoRAMapping)."""
    idx = np.asarray(token_lora_indices, np.int32)
    key = np.where(idx < 0, max_loras, idx)
    sorted_ids = np.argsort(key, kind="stable").astype(np.int32)
    counts = np.bincount(key, minlength=max_loras + 1)[:max_loras].astype(np.int32)
    starts = (np.cumsum(counts) - counts).astype(np.int32)
    active = np.full(max_loras, -1, np.int32)
    used = np.nonzero(counts)[0]
    active[: len(used)] = used
    return dict(
        token_lora_indices=jnp.asarray(idx),
        sorted_token_ids=jnp.asarray(sorted_ids),
        slot_token_counts=jnp.asarray(counts),
        slot_token_starts=jnp.asarray(starts),
        active_slots=jnp.asarray(active),
        num_active=jnp.asarray(len(used), jnp.int32),
    )


def make_mapping(kind: str, num_tokens: int, max_loras: int, rng) -> np.ndarray:
    """Token -> slot index, int32 [T], for the named mapping pattern."""
    if kind == "none":
        return np.full(num_tokens, -1, np.int32)
    if kind == "one":
        return np.full(num_tokens, max_loras - 1, np.int32)
    if kind == "distinct":  # every token its own slot (T <= L), some slots unused
        return rng.permutation(max_loras)[:num_tokens].astype(np.int32)
    if kind == "sorted":  # prefill-like runs
        return np.sort(rng.integers(0, max_loras, num_tokens)).astype(np.int32)
    if kind == "unsorted":  # decode-like scatter, with unmapped tokens
        return rng.integers(-1, max_loras, num_tokens).astype(np.int32)
    raise ValueError(kind)


@dataclasses.dataclass(frozen=True)
class Case:
    num_tokens: int
    hidden: int
    rank: int
    widths: tuple[int, ...]  # n_s of each slice; len = S
    dtype: object
    mapping: str
    max_loras: int = 4
    ranked: bool = False  # pass slot_ranks below R
    block_sizes: BlockSizes | None = None
    lead: int = 0  # columns of y before the first slice (its offset), untouched

    def __str__(self):
        name = jnp.dtype(self.dtype).name
        return (
            f"T{self.num_tokens}-H{self.hidden}-R{self.rank}-S{len(self.widths)}-{name}-"
            f"{self.mapping}{'-ranked' if self.ranked else ''}"
            f"{'-atomic' if self.block_sizes and self.block_sizes.atomic_programs else ''}"
            f"{'-grid' if self.block_sizes and not self.block_sizes.persistent else ''}"
            f"{'-bgmv' if self.block_sizes and self.block_sizes.per_token else ''}"
            f"{'-groups' if self.block_sizes and self.block_sizes.block_groups else ''}"
            f"{'-prefetch' if self.block_sizes and self.block_sizes.prefetch else ''}"
            f"{'-rows' if self.block_sizes and self.block_sizes.prefetch_rows else ''}"
            f"{'-rank_inner' if self.block_sizes and self.block_sizes.rank_inner else ''}"
            f"{'-fixed_split' if self.block_sizes and not self.block_sizes.live_split else ''}"
            f"{'-split_inner' if self.block_sizes and self.block_sizes.split_inner else ''}"
            f"{'-cols_inner' if self.block_sizes and self.block_sizes.cols_inner else ''}"
            f"{'-one_slot' if self.max_loras == 1 else ''}"
            f"{f'-lead{self.lead}' if self.lead else ''}"
        )


_PREFILL = BlockSizes(block_m=16, block_k=32, block_r=16, block_n=32)
_SPLIT3 = BlockSizes(block_m=16, block_k=32, block_r=16, split_k=3)
_SPLIT4 = BlockSizes(block_m=16, block_k=32, block_r=16, split_k=4)
_TILES2 = BlockSizes(block_m=16, block_n=16, tiles_n=2, num_stages=2)
_TILES2_PF = dataclasses.replace(_TILES2, prefetch=1)
_TILES4_PF = dataclasses.replace(_TILES2, tiles_n=4, prefetch=2)  # two tiles ahead
# only blocks of at least 12 rows load ahead (~17 tokens a slot: a full block and a tail)
_TILES4_PF_ROWS = dataclasses.replace(_TILES4_PF, prefetch_rows=12)
# Column tiles per program picked at run time from the live blocks: up to 4 (a few live
# blocks x 3 tiles >= 4 x 2 programs), or 1 (no block count reaches 4 x 1000).
_LIVE_MANY = BlockSizes(block_m=16, block_n=16, tiles_n=4, num_stages=2, live_programs=2)
_LIVE_FEW = BlockSizes(block_m=16, block_n=16, tiles_n=4, num_stages=2, live_programs=1000)
_LIVE_MID = dataclasses.replace(_LIVE_MANY, live_programs=20)
# Expand programs per column tile walking the live blocks: 3 groups (some walk none), 1
_GROUPS3 = BlockSizes(block_m=16, block_n=16, num_stages=2, block_groups=3)
_GROUPS1 = dataclasses.replace(_GROUPS3, block_groups=1)
# Atomic split-K: few workers (each walks several items) and many (a split of up to 5)
_ATOMIC8 = BlockSizes(block_m=16, block_k=32, block_r=16, split_k=4, atomic_programs=8)
_ATOMIC64 = BlockSizes(block_m=16, block_k=32, block_r=16, split_k=8, atomic_programs=64)
_ATOMIC_GRID = BlockSizes(
    block_m=16, block_k=32, block_r=16, split_k=4, atomic_programs=16, persistent=False
)
# A block's rank-block programs side by side in launch order (rank 32 in 16-row rank
# blocks): the partial-sum split, the static atomic grid, persistent atomic workers
_SPLIT3_RI = dataclasses.replace(_SPLIT3, rank_inner=True)
_ATOMIC_GRID_RI = dataclasses.replace(_ATOMIC_GRID, rank_inner=True)
_ATOMIC8_RI = dataclasses.replace(_ATOMIC8, rank_inner=True)
# The split fixed at split_k (3 ways over 5 k steps: uneven), no read of the live count:
# the list's tail and unmapped tokens' blocks skip themselves (live_split=False)
_STATIC_SPLIT = BlockSizes(
    block_m=16, block_k=32, block_r=16, split_k=3, atomic_programs=8, live_split=False
)
_STATIC_SPLIT_GRID = dataclasses.replace(_STATIC_SPLIT, persistent=False)
# ... split evenly (4 k steps 2 ways): every item runs a static trip count
_STATIC_SPLIT_EVEN = dataclasses.replace(_STATIC_SPLIT, split_k=2)
# The static grids with a block's (k split, rank block) programs side by side and the
# list's empty tail last (split_inner): fixed and live atomic splits (rank 32 in 16-row
# blocks), and the partial-sum split
_SPLIT_INNER_FIXED = dataclasses.replace(_STATIC_SPLIT_GRID, split_inner=True)
_SPLIT_INNER_LIVE = dataclasses.replace(_ATOMIC_GRID, split_inner=True)
_SPLIT_INNER_SUM = dataclasses.replace(_SPLIT3, split_inner=True)
# The expand's column groups side by side in launch order (cols_inner): 2 tiles a program,
# and 2 tiles ahead of 4
_TILES2_CI = dataclasses.replace(_TILES2, cols_inner=True)
_TILES4_PF_CI = dataclasses.replace(_TILES4_PF, cols_inner=True)
# Per-token (BGMV) programs: 5 k steps of 32 split 3 ways (uneven, the last past H),
# rank 32 in two 16-row blocks, 2 column tiles a program; and one k range of 64 columns.
_BGMV3 = BlockSizes(per_token=True, block_k=32, block_r=16, split_k=3, block_n=16, tiles_n=2)
_BGMV1 = BlockSizes(per_token=True, block_k=64, block_r=32, block_n=32)

# Small grids: interpret mode runs every program through XLA on the CPU.
CPU_CASES = [
    Case(8, 64, 16, (32,), jnp.bfloat16, "none"),
    Case(8, 64, 16, (32, 16), jnp.float32, "one"),
    Case(4, 48, 16, (32, 16, 16), jnp.float16, "distinct"),
    Case(24, 64, 16, (48,), jnp.bfloat16, "sorted", block_sizes=_PREFILL),
    Case(16, 40, 16, (24, 8, 8), jnp.float32, "unsorted"),
    Case(12, 64, 8, (16,), jnp.bfloat16, "unsorted"),  # rank 8: padded to 16 inside
    Case(9, 130, 32, (40, 20), jnp.float32, "unsorted"),  # ragged hidden, two k steps
    Case(16, 64, 32, (32, 32), jnp.bfloat16, "unsorted", ranked=True),
    Case(1, 64, 16, (16,), jnp.float32, "one"),
    Case(40, 32, 24, (20,), jnp.float32, "sorted", max_loras=2, block_sizes=_PREFILL),
    # split-K: 5 k steps over 3 programs; and 4 splits of 2 steps, the last past H
    Case(9, 130, 32, (16,), jnp.float32, "unsorted", block_sizes=_SPLIT3),
    Case(20, 130, 16, (16, 16), jnp.bfloat16, "unsorted", ranked=True, block_sizes=_SPLIT4),
    # atomic split-K: the split is picked from the live blocks when the kernel runs.
    # Rank 32 in 16-row blocks: 2 rank blocks share the workers; 5 k steps split 1-4
    # ways (uneven chunks); 40 tokens over 8 slots: more items than workers.
    Case(9, 130, 32, (16,), jnp.float32, "unsorted", block_sizes=_ATOMIC8),
    Case(20, 130, 16, (16, 16), jnp.bfloat16, "unsorted", ranked=True, block_sizes=_ATOMIC64),
    Case(40, 64, 16, (24, 8), jnp.bfloat16, "sorted", max_loras=8, block_sizes=_ATOMIC8),
    Case(3, 130, 32, (16, 16, 8), jnp.float16, "distinct", block_sizes=_ATOMIC64),
    Case(8, 64, 16, (32,), jnp.float32, "none", block_sizes=_ATOMIC64),
    # the same on the static (block, slice, split x rank block) grid
    Case(9, 130, 32, (16, 16), jnp.float32, "unsorted", ranked=True, block_sizes=_ATOMIC_GRID),
    Case(40, 64, 16, (24, 8), jnp.bfloat16, "sorted", max_loras=8, block_sizes=_ATOMIC_GRID),
    # expand: 2 column tiles per program. Slice 0 has 3 tiles (2 groups, the second
    # group's second tile past the slice, over the next one), slices 1-2 have 2 (1 group,
    # the grid's second group idle); the last slice's tail lies past y: all masked.
    Case(24, 64, 16, (48, 20, 20), jnp.bfloat16, "unsorted", block_sizes=_TILES2),
    Case(18, 64, 32, (40, 30), jnp.float32, "sorted", ranked=True, block_sizes=_TILES2),
    # expand, tiles per program picked when it runs: 4 (slice 0's 3 tiles in one group,
    # the rest of the grid idle); 2 (~8 live blocks x 2 slices x 3 tiles, between 2 x 20
    # and 4 x 20); 1
    Case(24, 64, 16, (48, 20, 20), jnp.bfloat16, "unsorted", block_sizes=_LIVE_MANY),
    Case(
        40, 64, 32, (40, 30), jnp.float32, "sorted", max_loras=8, ranked=True, block_sizes=_LIVE_MID
    ),
    Case(24, 64, 16, (48, 20), jnp.float16, "distinct", max_loras=32, block_sizes=_LIVE_FEW),
    Case(8, 64, 16, (48,), jnp.bfloat16, "none", block_sizes=_LIVE_MANY),
    # expand programs per (slice, column tile) that walk the live blocks in groups: the
    # slices' tails past their width, ranks, unmapped tokens, one block per slot
    Case(24, 64, 16, (48, 20, 20), jnp.bfloat16, "unsorted", block_sizes=_GROUPS3),
    Case(
        40, 64, 32, (40, 30), jnp.float32, "sorted", max_loras=8, ranked=True, block_sizes=_GROUPS1
    ),
    Case(24, 64, 16, (48, 20), jnp.float16, "distinct", max_loras=32, block_sizes=_GROUPS3),
    Case(8, 64, 16, (48,), jnp.bfloat16, "none", block_sizes=_GROUPS3),
    # per-token programs (no work list): atomic k ranges, masked ranks, -1 tokens
    Case(9, 130, 32, (40, 20), jnp.float32, "unsorted", ranked=True, block_sizes=_BGMV3),
    Case(12, 64, 8, (16, 16, 8), jnp.bfloat16, "unsorted", block_sizes=_BGMV3),
    Case(6, 64, 16, (48,), jnp.float16, "distinct", max_loras=8, block_sizes=_BGMV1),
    Case(8, 64, 16, (32,), jnp.float32, "none", block_sizes=_BGMV1),
    # rank 256: expand tiles shrink to fit shared memory (block_n 128 -> 64), grid follows
    Case(4, 32, 256, (200,), jnp.float16, "unsorted", max_loras=2),
    # expand loading the next column tile's y ahead: 2 and 4 tiles a program, slices whose
    # last group runs past them (the tile ahead masked), true ranks, unmapped tokens
    Case(24, 64, 16, (48, 20, 20), jnp.bfloat16, "unsorted", block_sizes=_TILES2_PF),
    Case(18, 64, 32, (40, 70), jnp.float32, "sorted", ranked=True, block_sizes=_TILES4_PF),
    Case(50, 64, 32, (40, 70), jnp.bfloat16, "sorted", 3, True, _TILES4_PF_ROWS),
    # shrink with a block's rank blocks launched side by side (rank_inner)
    Case(9, 130, 32, (16, 16), jnp.float32, "unsorted", ranked=True, block_sizes=_SPLIT3_RI),
    Case(40, 64, 32, (24, 8), jnp.bfloat16, "sorted", 8, block_sizes=_ATOMIC_GRID_RI),
    Case(20, 130, 32, (16,), jnp.float16, "unsorted", ranked=True, block_sizes=_ATOMIC8_RI),
    # atomic split-K at a fixed split (live_split=False): persistent workers and the static
    # grid, unmapped tokens and ranks, every token unmapped
    Case(40, 130, 32, (24, 8), jnp.bfloat16, "unsorted", 8, True, _STATIC_SPLIT),
    Case(24, 130, 16, (16, 16), jnp.float32, "unsorted", block_sizes=_STATIC_SPLIT_GRID),
    Case(8, 64, 16, (32,), jnp.float32, "none", block_sizes=_STATIC_SPLIT_GRID),
    Case(40, 128, 32, (16, 24), jnp.bfloat16, "sorted", 8, True, _STATIC_SPLIT_EVEN),
    # split_inner: unmapped tokens, ranks, 2 rank blocks, an uneven split
    Case(40, 130, 32, (24, 8), jnp.bfloat16, "unsorted", 8, True, _SPLIT_INNER_FIXED),
    Case(9, 130, 32, (16, 16), jnp.float32, "unsorted", ranked=True, block_sizes=_SPLIT_INNER_LIVE),
    Case(20, 130, 32, (16,), jnp.float16, "sorted", 4, True, _SPLIT_INNER_SUM),
    # expand with a block's column groups side by side (cols_inner): slices past their
    # tiles' width, true ranks, unmapped tokens, the ahead-load
    Case(24, 64, 16, (48, 20, 20), jnp.bfloat16, "unsorted", block_sizes=_TILES2_CI),
    Case(50, 64, 32, (40, 70), jnp.float32, "sorted", 3, True, _TILES4_PF_CI),
    # vLLM's rank list beyond the above: 1 and 4 (padded to 16), 320 (to 512); one slot
    # with unmapped tokens (a -1 row's key, max_loras, must not alias slot 0); slices that
    # start past y's first columns
    Case(6, 64, 1, (16,), jnp.float32, "unsorted"),
    Case(10, 64, 4, (24, 8), jnp.bfloat16, "unsorted", ranked=True),
    Case(5, 48, 320, (40,), jnp.float32, "unsorted", max_loras=2),
    Case(8, 64, 16, (32,), jnp.float32, "unsorted", max_loras=1),
    Case(12, 64, 16, (24, 8), jnp.bfloat16, "unsorted", max_loras=1, block_sizes=_ATOMIC8),
    Case(16, 64, 16, (24, 16), jnp.float32, "unsorted", lead=5),
    Case(24, 64, 16, (48, 20), jnp.bfloat16, "sorted", lead=16, block_sizes=_TILES2_PF),
]

# Cases whose kernel path another case already takes (tiles, mapping kind, dtype): they
# run on the oldest jax only (marked slow; the newest-jax CI run skips slow tests).
_REPEATS = {1, 8, 9, 11, 13, 14, 16, 18, 20, 22, 23, 24, 27, 30, 32}
CPU_PARAMS = [
    pytest.param(c, marks=pytest.mark.slow) if i in _REPEATS else c for i, c in enumerate(CPU_CASES)
]


class ShrinkExpandTestBase:
    """Subclass and set `interpret`; `cases` may be overridden with larger shapes."""

    interpret: bool = True

    def _inputs(self, case: Case, seed: int = 0):
        rng = np.random.default_rng(seed)
        num_slices = len(case.widths)
        idx = make_mapping(case.mapping, case.num_tokens, case.max_loras, rng)
        meta = make_metadata(idx, case.max_loras)
        x = jnp.asarray(rng.standard_normal((case.num_tokens, case.hidden)), case.dtype)
        lora_a = tuple(
            jnp.asarray(
                rng.standard_normal((case.max_loras, case.rank, case.hidden))
                / np.sqrt(case.hidden),
                case.dtype,
            )
            for _ in range(num_slices)
        )
        lora_b = tuple(
            jnp.asarray(rng.standard_normal((case.max_loras, n, case.rank)), case.dtype)
            for n in case.widths
        )
        width = case.lead + sum(case.widths) + 3  # a few columns no slice touches
        y = jnp.asarray(rng.standard_normal((case.num_tokens, width)), case.dtype)
        offsets = tuple(case.lead + int(o) for o in np.cumsum((0,) + case.widths[:-1]))
        slot_ranks = None
        if case.ranked:
            slot_ranks = jnp.asarray(
                rng.integers(1, case.rank + 1, (num_slices, case.max_loras)), jnp.int32
            )
            # zero the padded rows as the adapter manager does
            keep = jnp.arange(case.rank)[None, :, None] < slot_ranks[:, :, None, None]
            lora_a = tuple(jnp.where(keep[s], a, 0).astype(a.dtype) for s, a in enumerate(lora_a))
        h = jnp.asarray(
            rng.standard_normal((num_slices, case.num_tokens, case.rank)) / np.sqrt(case.rank),
            jnp.float32,
        )
        return idx, meta, x, lora_a, lora_b, y, offsets, slot_ranks, h

    @pytest.mark.parametrize("case", CPU_PARAMS, ids=str)
    def test_shrink(self, case: Case):
        if case.block_sizes is not None and (
            case.block_sizes.live_programs or case.block_sizes.block_groups
        ):
            pytest.skip("expand tiling: the shrink runs as the cases above")
        idx, meta, x, lora_a, _, _, _, slot_ranks, _ = self._inputs(case)
        kw = dict(meta, scale=0.5, slot_ranks=slot_ranks)
        out = lora_shrink(x, lora_a, **kw, block_sizes=case.block_sizes, interpret=self.interpret)
        ref = lora_shrink_reference(x, lora_a, **kw)
        assert out.shape == (len(case.widths), case.num_tokens, case.rank)
        assert out.dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(out)))
        rtol, atol = TOLERANCES[("shrink", case.dtype)]
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=rtol, atol=atol)
        # unmapped rows are exactly 0, and so is everything past a slot's true rank
        assert np.all(np.asarray(out)[:, idx < 0] == 0)
        if slot_ranks is not None:
            safe = np.where(idx < 0, 0, idx)
            past = np.arange(case.rank)[None, None, :] >= np.asarray(slot_ranks)[:, safe][..., None]
            assert np.all(np.asarray(out)[past] == 0)

    @pytest.mark.parametrize("case", CPU_PARAMS, ids=str)
    def test_expand(self, case: Case):
        idx, meta, _, _, lora_b, y, offsets, slot_ranks, h = self._inputs(case)
        kw = dict(meta, offsets=offsets, slot_ranks=slot_ranks)
        out = lora_expand(
            y, h, lora_b, **kw, block_sizes=case.block_sizes, interpret=self.interpret
        )
        ref = lora_expand_reference(y, h, lora_b, **kw)
        assert out.shape == y.shape and out.dtype == y.dtype
        rtol, atol = TOLERANCES[("expand", case.dtype)]
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=rtol, atol=atol
        )
        # unmapped rows and untouched columns are bit-identical to the input
        y_np, out_np = np.asarray(y), np.asarray(out)
        assert np.array_equal(out_np[idx < 0], y_np[idx < 0])
        end = case.lead + sum(case.widths)
        assert np.array_equal(out_np[:, end:], y_np[:, end:])
        assert np.array_equal(out_np[:, : case.lead], y_np[:, : case.lead])

    def test_shrink_then_expand_in_one_jit(self):
        case = CPU_CASES[4]
        _, meta, x, lora_a, lora_b, y, offsets, _, _ = self._inputs(case, seed=1)

        @jax.jit
        def step(x, y):
            h = lora_shrink(x, lora_a, **meta, scale=2.0, interpret=self.interpret)
            return lora_expand(y, h, lora_b, offsets=offsets, **meta, interpret=self.interpret)

        def ref(x, y):
            h = lora_shrink_reference(x, lora_a, **meta, scale=2.0)
            return lora_expand_reference(y, h, lora_b, offsets=offsets, **meta)

        np.testing.assert_allclose(step(x, y), ref(x, y), rtol=1e-5, atol=1e-5)


def abstract_gpu_context():
    """jax >= 0.12 needs an abstract GPU device to lower Pallas Triton without a GPU."""
    import contextlib

    try:
        from jax._src.mesh import AbstractDevice
    except ImportError:
        return contextlib.nullcontext()
    try:
        mesh = jax.sharding.AbstractMesh(
            (1,),
            ("x",),
            abstract_device=AbstractDevice(
                device_kind="NVIDIA H200", num_cores=132, platform="gpu"
            ),
        )
    except TypeError:  # older jax: no abstract_device, and none needed
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh)
