"""Pallas Triton shrink/expand: interpret mode on CPU, CUDA lowering on CPU, real runs on GPU."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shrink_expand_test_base import (
    CPU_CASES,
    Case,
    ShrinkExpandTestBase,
    abstract_gpu_context,
    make_mapping,
    make_metadata,
)

from lora_jax.kernels import (
    BlockSizes,
    lora_expand,
    lora_expand_reference,
    lora_shrink,
    lora_shrink_reference,
)
from lora_jax.kernels.shrink_expand.tuning_long_shrink import (
    long_prefill_shrink,
    whole_rank128_rows_shrink,
    whole_rank128_shrink,
)
from lora_jax.kernels.shrink_expand.work_list import (
    WORK_LIST_BLOCK_MS,
    build_work_list,
    build_work_lists,
    num_work_blocks,
)

_DECODE_ATOMIC = BlockSizes(
    block_m=16, block_r=64, block_k=128, num_stages=2, split_k=32, atomic_programs=264
)
_DECODE_GRID = dataclasses.replace(_DECODE_ATOMIC, persistent=False)
# the per-token (BGMV) kernels: a program per token, k range and rank block
_BGMV = BlockSizes(per_token=True, block_r=16, block_k=128, split_k=8, block_n=64)
_BGMV_WIDE = BlockSizes(
    per_token=True, block_r=64, block_k=256, split_k=16, block_n=256, num_warps=8
)
_BGMV_ONE = BlockSizes(per_token=True, block_r=64, block_k=256, block_n=128, tiles_n=2)
_GROUPS = BlockSizes(block_m=16, block_n=128, num_stages=2, block_groups=2)
_PF128 = BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=8, prefetch=2)
_PF64 = BlockSizes(block_m=32, block_n=128, num_stages=2, tiles_n=4, prefetch=1)
_PF_ROWS = BlockSizes(block_m=64, block_n=64, num_stages=2, tiles_n=4, prefetch=1, prefetch_rows=32)
# Session 38's short-expand defaults, by the host's hint (tuning.py): the hinted ahead-load
# with a block's column groups side by side at ranks 64 / 128, and rank 128's 16-token
# blocks for 3-16 tokens a slot
_HINT64_R64 = BlockSizes.get_default(
    "expand", num_tokens=1024, hidden=4096, rank=64, tokens_per_slot=64
)
_HINT64_R128 = BlockSizes.get_default(
    "expand", num_tokens=1024, hidden=4096, rank=128, tokens_per_slot=64
)
_HINT16_R128 = BlockSizes.get_default(
    "expand", num_tokens=1024, hidden=4096, rank=128, tokens_per_slot=16
)
# Session 39: the decode expand on the static grid, a token block's column groups side by
# side (`PREFILL_SWEEP["expand"][68]`), for decode steps into 8192 columns
_DECODE_CI = BlockSizes(block_m=16, block_n=128, num_stages=2, tiles_n=4, cols_inner=True)
_RI128 = BlockSizes(block_m=64, block_r=64, block_k=128, num_warps=8, num_stages=3, rank_inner=True)
_RI128_SPLIT = dataclasses.replace(
    _RI128, split_k=2, atomic_programs=528, persistent=False, num_stages=4
)
# the prefill rank-16 tiles at a fixed split of 4, no read of the live count (session 35)
_FIXED_R16 = BlockSizes(
    block_m=32, block_r=16, block_k=128, split_k=4, atomic_programs=528, live_split=False
)
_BIG_SMEM = 200 * 1024  # what an H100/H200 lets the shrink opt in to (pallas_triton.py)


@contextlib.contextmanager
def shrink_smem(budget: int):
    """Runs with `opt_in_smem_budget()` == ``budget`` (the shrink's tiles, and with the
    variable set the expand's, are fitted to it), as on a GPU that allows that much."""
    from lora_jax.kernels.shrink_expand import pallas_triton

    old = os.environ.get("LORA_JAX_TRITON_SMEM_BUDGET")
    os.environ["LORA_JAX_TRITON_SMEM_BUDGET"] = str(budget)
    pallas_triton.opt_in_smem_budget.cache_clear()
    try:
        yield
    finally:
        if old is None:
            del os.environ["LORA_JAX_TRITON_SMEM_BUDGET"]
        else:
            os.environ["LORA_JAX_TRITON_SMEM_BUDGET"] = old
        pallas_triton.opt_in_smem_budget.cache_clear()


class TestPallasTritonInterpret(ShrinkExpandTestBase):
    interpret = True


@pytest.mark.gpu
class TestPallasTritonGpu(ShrinkExpandTestBase):
    interpret = False

    @pytest.mark.parametrize(
        "case",
        [
            Case(256, 4096, 64, (4096,), jnp.bfloat16, "unsorted", max_loras=64),
            Case(1024, 2049, 8, (1024, 256, 256), jnp.bfloat16, "sorted", max_loras=8),
            Case(64, 4096, 256, (512, 128), jnp.float16, "unsorted", max_loras=16, ranked=True),
            Case(300, 1000, 16, (200,), jnp.float32, "unsorted", max_loras=8),
            Case(4096, 4096, 128, (4096,), jnp.bfloat16, "sorted", max_loras=8),
            # prefill at rank 256: the fitted expand tiles halve block_m (work list too)
            Case(600, 512, 256, (520,), jnp.float16, "one", max_loras=2),
            # atomic split-K at decode: repeated rows must be added once
            Case(64, 4096, 64, (4096,), jnp.bfloat16, "unsorted", 64, block_sizes=_DECODE_ATOMIC),
            Case(5, 2049, 16, (1024, 256, 256), jnp.float16, "one", 8, True, _DECODE_ATOMIC),
            Case(256, 4096, 128, (512,), jnp.bfloat16, "distinct", 256, block_sizes=_DECODE_ATOMIC),
            Case(64, 4096, 64, (4096,), jnp.bfloat16, "unsorted", 64, block_sizes=_DECODE_GRID),
            Case(16, 2049, 128, (512, 64), jnp.float16, "unsorted", 8, True, _DECODE_GRID),
            # the default decode expand at ranks >= 64 picks its column tiles per program
            # from the live blocks: 1 with 8 adapters at 64 tokens, 4 with 64 at 256
            Case(64, 4096, 64, (4096, 1024), jnp.bfloat16, "unsorted", 8),
            Case(256, 4096, 128, (4096,), jnp.bfloat16, "distinct", 256),
            # long prompts (tuning.long_prefill_shrink): rank 16's 128-column k
            # steps; ranks 64 and 128 (T = 4096 above) 64 x 64 tiles of 8 warps on the
            # static grid (48 KiB, over the portable budget); rank 64 from 4096 tokens in
            # 128-column k steps, split 2 ways 4 deep (4096), unsplit 4 deep (8192) or 3
            # (16384; ragged H, true ranks)
            Case(4096, 4096, 16, (4096,), jnp.bfloat16, "unsorted", max_loras=64),
            Case(4096, 4096, 64, (4096,), jnp.bfloat16, "unsorted", max_loras=8),
            Case(8192, 4096, 64, (1024,), jnp.bfloat16, "one", max_loras=2),
            Case(16384, 2049, 64, (512,), jnp.float16, "unsorted", 8, True),
            # rank 128's two rank blocks launched side by side (rank_inner): unsplit deep-k
            # tiles, and the static atomic grid split 2 ways (ragged H, true ranks)
            Case(4096, 4096, 128, (4096,), jnp.bfloat16, "unsorted", 8, block_sizes=_RI128),
            Case(2048, 2049, 128, (512,), jnp.float16, "unsorted", 8, True, _RI128_SPLIT),
            # rank 128's long-prompt defaults (session 31): deep k steps split 2 (2048
            # tokens), unsplit 3 stages deep (8192; ragged H, true ranks)
            Case(2048, 4096, 128, (4096,), jnp.bfloat16, "unsorted", max_loras=64),
            Case(8192, 2049, 128, (512,), jnp.float16, "unsorted", 8, True),
            # the whole rank on 64-token blocks at 2049-4096 tokens, split 2 while the live
            # blocks allow (8 adapters) or not (64), and from 16384 tokens in one 128 x 128
            # tile (session 32)
            Case(4096, 4096, 128, (4096,), jnp.bfloat16, "unsorted", max_loras=8),
            Case(3000, 2049, 128, (512,), jnp.float16, "unsorted", 64, True),
            Case(16384, 4096, 128, (4096,), jnp.bfloat16, "unsorted", max_loras=8),
            Case(16384, 2049, 128, (512,), jnp.float16, "unsorted", 64, True),
            # per-token (BGMV) programs: atomic k ranges; wide tiles with true ranks; one
            # k range over a ragged hidden size
            Case(64, 4096, 16, (4096,), jnp.bfloat16, "distinct", 64, block_sizes=_BGMV),
            Case(256, 4096, 128, (4096, 1024), jnp.bfloat16, "unsorted", 64, True, _BGMV_WIDE),
            Case(16, 2049, 64, (512,), jnp.float16, "unsorted", 8, True, _BGMV_ONE),
            Case(37, 1000, 8, (200, 100), jnp.float32, "unsorted", 8, block_sizes=_BGMV),
            # expand programs per column tile walking the live blocks (block_groups)
            Case(64, 4096, 16, (14336, 14336), jnp.bfloat16, "unsorted", 8, block_sizes=_GROUPS),
            Case(256, 2049, 64, (4096, 1024, 1024), jnp.float16, "distinct", 64, True, _GROUPS),
            # prefill expands loading the next column tile's y ahead (prefetch)
            Case(4096, 4096, 128, (4096,), jnp.bfloat16, "unsorted", 8, block_sizes=_PF128),
            Case(1024, 2049, 64, (4096, 1024, 1024), jnp.float16, "sorted", 8, True, _PF64),
            # ... only in blocks of at least half their rows (8 adapters: most are full;
            # 64: most are a quarter full and load in step)
            Case(1024, 4096, 128, (4096,), jnp.bfloat16, "unsorted", 8, block_sizes=_PF_ROWS),
            Case(1024, 2049, 128, (4096, 1024), jnp.float16, "unsorted", 64, True, _PF_ROWS),
            # the atomic shrink at a fixed split (live_split=False): unmapped tokens' and the
            # list tail's blocks skip themselves
            Case(4096, 4096, 16, (4096,), jnp.bfloat16, "unsorted", 64, block_sizes=_FIXED_R16),
            Case(3000, 2049, 16, (512, 256), jnp.float16, "sorted", 8, True, _FIXED_R16),
            # session 38's short expands: rank 16 and rank 128 at 2048 tokens by default
            # (a block's column groups side by side), and the hinted tiles at 1024
            Case(1024, 4096, 16, (4096, 1024), jnp.bfloat16, "unsorted", 64),
            Case(2048, 2049, 128, (512, 256), jnp.float16, "unsorted", 8, True),
            Case(1024, 4096, 64, (4096,), jnp.bfloat16, "unsorted", 8, block_sizes=_HINT64_R64),
            Case(1024, 2049, 128, (4096,), jnp.float16, "unsorted", 8, True, _HINT64_R128),
            Case(1024, 4096, 128, (4096, 1024), jnp.bfloat16, "unsorted", 64, True, _HINT16_R128),
            Case(256, 4096, 64, (8192,), jnp.bfloat16, "unsorted", 64, block_sizes=_DECODE_CI),
            Case(200, 2049, 64, (8192, 1024, 1024), jnp.float16, "unsorted", 8, True, _DECODE_CI),
            Case(128, 4096, 128, (8192,), jnp.bfloat16, "unsorted", 64, block_sizes=_DECODE_CI),
            # session 40: the default from 64 tokens into >= 16384 columns (`_DECODE_CI`),
            # one slice, and a merged gate_up of two 14336-column slices with true ranks
            Case(64, 4096, 64, (16384,), jnp.bfloat16, "unsorted", 8),
            Case(100, 2049, 64, (14336, 14336), jnp.float16, "unsorted", 64, True),
        ],
        ids=str,
    )
    def test_large(self, case):
        self.test_shrink(case)
        self.test_expand(case)


@pytest.mark.parametrize(
    "tiles",
    [
        dataclasses.replace(_DECODE_ATOMIC, atomic_programs=0),
        _DECODE_ATOMIC,
        _DECODE_GRID,
        None,
        BlockSizes(block_m=128, block_r=128, block_k=64, num_warps=8, num_stages=3, split_k=4),
        BlockSizes(
            block_m=64,
            block_r=64,
            block_k=64,
            num_warps=8,
            num_stages=3,
            split_k=8,
            atomic_programs=528,
            persistent=False,
        ),  # fmt: skip
        dataclasses.replace(_DECODE_ATOMIC, block_n=32, tiles_n=4, live_programs=8),
        _BGMV,
        dataclasses.replace(_BGMV, split_k=1, block_k=64, block_n=32, tiles_n=4),
        dataclasses.replace(_DECODE_ATOMIC, split_k=4, live_split=False),
        dataclasses.replace(_DECODE_GRID, split_k=4, live_split=False),
    ],
    ids=[
        "split",
        "atomic",
        "grid",
        "default",
        "long128",
        "long64",
        "live",
        "bgmv",
        "bgmv1",
        "fixed_split",
        "fixed_split_grid",
    ],  # fmt: skip
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_cuda(dtype, tiles):
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    num_tokens, hidden, rank, max_loras = 64, 2049, 8, 4
    meta = make_metadata(np.arange(num_tokens) % max_loras, max_loras)
    sds = jax.ShapeDtypeStruct
    x = sds((num_tokens, hidden), dtype)
    lora_a = (sds((max_loras, rank, hidden), dtype),) * 3
    lora_b = (sds((max_loras, 100, rank), dtype), sds((max_loras, 50, rank), dtype)) * 1
    y = sds((num_tokens, 160), dtype)
    ranks = jnp.full((3, max_loras), 4, jnp.int32)

    def step(x, lora_a, lora_b, y, meta):
        h = lora_shrink(x, lora_a, **meta, slot_ranks=ranks, block_sizes=tiles)
        bgmv = tiles if tiles is not None and tiles.per_token else None
        return lora_expand(
            y, h[:2], lora_b, offsets=(0, 110), **meta, slot_ranks=ranks[:2], block_sizes=bgmv
        )

    with abstract_gpu_context():
        text = (
            jax.jit(step)
            .trace(x, lora_a, lora_b, y, meta)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert text.count("triton") >= 2
    # the decode default (64 tokens) adds its split's partials atomically
    assert ("lora_shrink_atomic" in text) == (tiles is None or tiles.atomic_programs > 0)
    per_token = tiles is not None and tiles.per_token
    assert ("lora_shrink_bgmv" in text) == per_token
    assert ("lora_expand_bgmv" in text) == per_token


@pytest.mark.parametrize("cols_inner", [False, True], ids=["blocks_first", "cols_inner"])
@pytest.mark.parametrize("prefetch_rows", [0, 16])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_prefetching_expand_lowers_for_cuda(dtype, prefetch_rows, cols_inner):
    """The expand that carries the next column tile's y through its loop lowers to Triton
    (with ``prefetch_rows``: and loads the tile in its step in emptier blocks; with
    ``cols_inner``: on the grid whose first axis is the column group)."""
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    num_tokens, rank, max_loras = 300, 64, 4
    meta = make_metadata(np.arange(num_tokens) % max_loras, max_loras)
    sds = jax.ShapeDtypeStruct
    h = sds((2, num_tokens, rank), jnp.float32)
    lora_b = (sds((max_loras, 300, rank), dtype), sds((max_loras, 50, rank), dtype))
    y = sds((num_tokens, 360), dtype)
    tiles = BlockSizes(
        block_m=32,
        block_n=64,
        num_stages=2,
        tiles_n=4,
        prefetch=2,
        prefetch_rows=prefetch_rows,
        cols_inner=cols_inner,
    )

    def step(y, h, lora_b, meta):
        return lora_expand(y, h, lora_b, offsets=(0, 310), **meta, block_sizes=tiles)

    with abstract_gpu_context():
        text = jax.jit(step).trace(y, h, lora_b, meta).lower(lowering_platforms=("cuda",))
    assert "lora_expand" in text.as_text()


@pytest.mark.parametrize(
    "tiles",
    [
        _RI128,
        _RI128_SPLIT,
        dataclasses.replace(_DECODE_ATOMIC, rank_inner=True),
        dataclasses.replace(_DECODE_GRID, rank_inner=True),
        whole_rank128_shrink(),
        whole_rank128_rows_shrink(),
    ],
    ids=["unsplit", "grid_split", "persistent", "grid", "whole128", "whole_rows"],
)
def test_rank_inner_shrink_lowers_for_cuda(tiles):
    """Each shrink grid with a block's rank blocks side by side (`BlockSizes.rank_inner`)
    lowers to Triton at rank 128 (two rank blocks of 64), ragged hidden size, true ranks;
    so do session 32's whole-rank tiles (one rank block: 128 x 128 unsplit, 64 x 128 on
    the static atomic grid)."""
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    num_tokens, hidden, rank, max_loras = 300, 2049, 128, 4
    meta = make_metadata(np.arange(num_tokens) % max_loras, max_loras)
    sds = jax.ShapeDtypeStruct
    x = sds((num_tokens, hidden), jnp.bfloat16)
    lora_a = (sds((max_loras, rank, hidden), jnp.bfloat16),) * 2
    ranks = jnp.full((2, max_loras), 100, jnp.int32)

    def step(x, lora_a, meta):
        return lora_shrink(x, lora_a, **meta, slot_ranks=ranks, block_sizes=tiles)

    with shrink_smem(_BIG_SMEM), abstract_gpu_context():
        text = jax.jit(step).trace(x, lora_a, meta).lower(lowering_platforms=("cuda",)).as_text()
    assert ("lora_shrink_atomic" in text) == (tiles.atomic_programs > 0)
    assert "lora_shrink" in text


@pytest.mark.parametrize("relaxed", [True, False], ids=["relaxed", "acq_rel"])
def test_split_k_adds_lower_relaxed(monkeypatch, relaxed):
    """The atomic split's adds lower to relaxed atomics (Pallas's own add is
    acquire-release), and LORA_JAX_RELAXED_ATOMICS=0 brings back Pallas's add."""
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    from jax._src.pallas.triton import lowering as tl

    from lora_jax.kernels.shrink_expand import relaxed_atomic

    assert relaxed_atomic.available()
    if not relaxed:
        monkeypatch.setenv("LORA_JAX_RELAXED_ATOMICS", "0")
    seen = []
    original = tl._atomic_rmw

    def spy(op, ptr, val, mask=None, **kw):
        seen.append(str(kw.get("semantic", "default")))
        return original(op, ptr, val, mask=mask, **kw)

    monkeypatch.setattr(tl, "_atomic_rmw", spy)
    jax.clear_caches()
    num_tokens, hidden, rank, max_loras = 64, 512, 16, 4
    meta = make_metadata(np.arange(num_tokens) % max_loras, max_loras)
    sds = jax.ShapeDtypeStruct
    x, lora_a = (
        sds((num_tokens, hidden), jnp.bfloat16),
        sds((max_loras, rank, hidden), jnp.bfloat16),
    )

    def step(x, lora_a, meta):
        return lora_shrink(x, (lora_a,), **meta, block_sizes=_DECODE_ATOMIC)

    with abstract_gpu_context():
        jax.jit(step).trace(x, lora_a, meta).lower(lowering_platforms=("cuda",))
    jax.clear_caches()
    assert seen, "no atomic add was lowered"
    if relaxed:
        assert all("relaxed" in s.lower() for s in seen), seen
    else:
        assert seen == ["default"] * len(seen), seen


def test_work_list_covers_every_token_once():
    rng = np.random.default_rng(0)
    for num_tokens, max_loras, block_m in [(1, 4, 16), (37, 5, 16), (300, 8, 32), (16, 64, 16)]:
        idx = make_mapping("unsorted", num_tokens, max_loras, rng)
        meta = make_metadata(idx, max_loras)
        tab = np.asarray(
            build_work_list(
                meta["slot_token_counts"],
                meta["slot_token_starts"],
                meta["sorted_token_ids"],
                block_m=block_m,
            )
        )
        assert tab.shape == (4 + block_m, num_work_blocks(num_tokens, max_loras, block_m))
        # Row 3: the count of mapped blocks, which come first in the list.
        counts = np.asarray(meta["slot_token_counts"])
        n_live = int(np.sum(-(-counts // block_m)))
        assert np.all(tab[3] == n_live)
        assert np.all(tab[0, :n_live] >= 0) and np.all(tab[2, :n_live] > 0)
        assert not np.any((tab[0, n_live:] >= 0) & (tab[2, n_live:] > 0))
        sorted_ids = np.asarray(meta["sorted_token_ids"])
        seen = np.zeros(num_tokens, int)
        for slot, first, rows, _, *tokens in tab.T:
            assert 0 <= rows <= block_m
            for p in range(first, first + rows):
                tok = sorted_ids[p]
                seen[tok] += 1
                assert idx[tok] == slot
            if rows:  # rows 4...: the block's tokens, the last one repeated past its count
                want = [sorted_ids[first + min(m, rows - 1)] for m in range(block_m)]
                assert tokens == want
            else:
                assert all(0 <= t < num_tokens for t in tokens)
        assert np.all(seen == 1)


def test_matches_lora_mapping_metadata():
    mapping = pytest.importorskip("lora_jax.mapping")
    idx = np.array([3, -1, 0, 3, 1, -1, 0, 0], np.int32)
    got = mapping.make_lora_mapping(jnp.asarray(idx), 4)
    want = make_metadata(idx, 4)
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(value), name)


def test_ready_made_work_lists():
    """Ops given the per-step work lists (as LoRAMapping carries them) give the same result
    as ops building their own; a list of the wrong shape is named, not used."""
    mapping = pytest.importorskip("lora_jax.mapping")
    rng = np.random.default_rng(5)
    num_tokens, max_loras, hidden, rank = 37, 5, 64, 16
    idx = make_mapping("unsorted", num_tokens, max_loras, rng)
    meta = make_metadata(idx, max_loras)
    lists = mapping.make_lora_mapping(jnp.asarray(idx), max_loras).work_lists
    assert sorted(lists) == list(WORK_LIST_BLOCK_MS)
    for bm, tab in lists.items():  # the mapping's lists are the kernels' own
        want = build_work_list(
            meta["slot_token_counts"],
            meta["slot_token_starts"],
            meta["sorted_token_ids"],
            block_m=bm,
        )
        np.testing.assert_array_equal(np.asarray(tab), np.asarray(want))
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((max_loras, rank, hidden)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((max_loras, 24, rank)), jnp.float32)
    h = lora_shrink(x, (a,), **meta, interpret=True)
    h_ready = lora_shrink(x, (a,), **meta, work_lists=lists, interpret=True)
    np.testing.assert_array_equal(np.asarray(h_ready), np.asarray(h))
    y = jnp.zeros((num_tokens, 24), jnp.float32)
    y1 = lora_expand(y, h, (b,), offsets=(0,), **meta, interpret=True)
    y2 = lora_expand(y, h, (b,), offsets=(0,), **meta, work_lists=lists, interpret=True)
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y1))
    stale = build_work_lists(
        meta["slot_token_counts"][:4], meta["slot_token_starts"][:4], meta["sorted_token_ids"]
    )  # built for 4 slots, not 5
    with pytest.raises(ValueError, match=r"work_lists\[16\].*build_work_lists"):
        lora_shrink(x, (a,), **meta, work_lists=stale, interpret=True)


def test_block_sizes_validated():
    with pytest.raises(ValueError, match="block_m"):
        BlockSizes(block_m=24)
    with pytest.raises(ValueError, match="block_k"):
        BlockSizes(block_k=8)
    assert BlockSizes.get_default("shrink", num_tokens=16384, hidden=4096, rank=8).block_r == 16


@pytest.mark.parametrize("budget", [45 * 1024, _BIG_SMEM], ids=["45k", "200k"])
@pytest.mark.parametrize("num_tokens", [300, 1024, 4096, 16384])
@pytest.mark.parametrize("rank", [16, 64, 128])
def test_prefill_shrink_default_fills_the_gpu(num_tokens, rank, budget):
    """Above the decode regime the hidden split brings the live programs to about
    TARGET_PROGRAMS (never past it by more than 2x), and never splits a long prompt.
    An atomic split is picked at run time from the live blocks (here all full: one
    adapter), capped by split_k."""
    from lora_jax.kernels.shrink_expand import tuning as B
    from lora_jax.kernels.shrink_expand import tuning_long_shrink as L

    with shrink_smem(budget):
        bs = BlockSizes.get_default("shrink", num_tokens=num_tokens, hidden=4096, rank=rank)
        small = BlockSizes.get_default("shrink", num_tokens=num_tokens, hidden=256, rank=rank)
    rank_blocks = max(16, rank) // bs.block_r
    blocks = -(-num_tokens // bs.block_m)
    split = bs.split_k
    if bs.atomic_programs:  # as _shrink_atomic_kernel picks it
        split = min(max(1, bs.atomic_programs // rank_blocks // blocks), bs.split_k)
    programs = blocks * rank_blocks * split
    target = B.TARGET_PROGRAMS
    if num_tokens >= B.LONG_PREFILL_TOKENS:
        target = B.LONG_PREFILL_TARGET_PROGRAMS
    assert split == 1 or programs <= 2 * target  # no needless splits
    # split until the GPU is busy (a 128 x 128 tile of 8 warps fills an SM about alone;
    # rank 64's 64 x 64 tiles of 8 warps with deep 128-column k steps from 128 items, one
    # an SM: session 30)
    deep_k = bs.block_k == 128 and bs.num_warps == 8 and programs >= L.DEEP_K_R64_PROGRAMS
    assert split == 8 or programs >= target // 2 or bs.block_m * bs.block_r >= 128 * 128 or deep_k
    assert num_tokens < 8192 or split <= 2
    assert split <= 4096 // (bs.block_k * 8)  # every split keeps >= 8 k steps
    assert small.split_k == 1 or small.atomic_programs


def test_split_partials_are_added_atomically_where_measured_faster():
    """Decode (persistent programs from 16 tokens, the static grid below) and every split
    prefill add their split's partials atomically (session 9: at 2048 tokens the
    partial-sum kernel cost 3 us); a shrink with no split needs neither."""
    from lora_jax.kernels.shrink_expand import tuning as B
    from lora_jax.kernels.shrink_expand import tuning_long_shrink as L

    def get(t, h=4096):
        return BlockSizes.get_default("shrink", num_tokens=t, hidden=h, rank=64)

    for t in (1, 8, 16, 64, 256):
        bs = get(t)
        assert bs.atomic_programs == B.ATOMIC_PROGRAMS and bs.persistent == (t >= 16)
        assert bs.split_k == 4096 // bs.block_k  # the cap: one k step per item
    for t in (300, 1024, B.LONG_PREFILL_TOKENS, 4096):
        assert get(t).atomic_programs == B.ATOMIC_PROGRAMS and get(t).split_k > 1
    with shrink_smem(45 * 1024):  # 16384 tokens fill the GPU unsplit; a short H is not split
        assert get(16384).atomic_programs == 0 and get(16384).split_k == 1
        assert get(1024, h=256).atomic_programs == 0 and get(1024, h=256).split_k == 1
    with shrink_smem(_BIG_SMEM):  # 64-token blocks over 48 KiB add atomically
        long = get(B.LONG_PREFILL_TOKENS)
        assert long.atomic_programs == B.ATOMIC_PROGRAMS and long.block_m == 64
        # the cap is the split a fully mapped step picks: no programs idle on the grid
        assert get(2048).split_k == 8 and get(2048).atomic_programs == B.ATOMIC_PROGRAMS
        # session 30: rank 64 from 4096 tokens takes 128-column k steps, split to about
        # 128 items (2 at 4096 tokens, none from 8192), 4 stages deep while one program
        # runs an SM, 3 where two do
        for t, split, stages in ((4096, 2, 4), (8192, 1, 4), (16384, 1, 3), (65536, 1, 3)):
            bs = get(t)
            assert (bs.split_k, bs.block_k, bs.num_stages) == (split, 128, stages), (t, bs)
            assert (bs.block_m, bs.block_r, bs.num_warps) == (64, 64, 8)
            assert bool(bs.atomic_programs) == (split > 1) and not bs.persistent or split == 1
        assert get(L.DEEP_K_R64_MIN_TOKENS - 1).block_k == 64
        wide = BlockSizes.get_default("shrink", num_tokens=16384, hidden=4096, rank=128)
        assert wide.split_k == 1 and wide.atomic_programs == 0  # plain stores, no zeroing


def test_session31_rank128_long_prompts_launch_rank_blocks_side_by_side():
    """Rank 128 from LONG_PREFILL_TOKENS tokens: its two 64-row rank blocks launch side by
    side; rank 64's deep k steps while the (token block, rank block) programs make about
    one wave (split 2 at 2048 tokens, unsplit at 4097-8192; 2049-4096: session 32), then
    64-column k steps split to about ATOMIC_PROGRAMS items. Decode and the other ranks
    keep the rank block last."""
    from lora_jax.kernels.shrink_expand import tuning as B

    def get(t, rank=128):
        return BlockSizes.get_default("shrink", num_tokens=t, hidden=4096, rank=rank)

    with shrink_smem(_BIG_SMEM):
        for t, split, bk, stages in ((2048, 2, 128, 4), (4097, 1, 128, 4), (8192, 1, 128, 3)):
            bs = get(t)
            assert bs.rank_inner and (bs.block_m, bs.block_r, bs.num_warps) == (64, 64, 8)
            assert (bs.split_k, bs.block_k, bs.num_stages) == (split, bk, stages), (t, bs)
            assert bool(bs.atomic_programs) == (split > 1)
        assert get(12288).rank_inner and get(12288).block_k == 64 and get(12288).block_m == 64
        assert not any(get(t).rank_inner for t in (1, 64, 256, B.LONG_PREFILL_TOKENS - 1))
        assert not any(get(4096, rank).rank_inner for rank in (16, 64))


def test_session32_rank128_from_16384_tokens_takes_the_whole_rank_a_tile():
    """Rank 128 from 16384 tokens (`WHOLE_RANK_MIN_BLOCKS`): one 128 x 128 tile a
    128-token block (x and A read once a block), 5 stages of 64-column k steps, unsplit;
    where the GPU does not allow its 160 KiB of shared memory, the side-by-side 64 x 64
    tiles as before. Rank 64 keeps its tiles."""
    from lora_jax.kernels.shrink_expand import tuning_long_shrink as B
    from lora_jax.kernels.shrink_expand.pallas_triton_shrink import shrink_smem_bytes

    def get(t, rank=128, hidden=4096):
        return BlockSizes.get_default("shrink", num_tokens=t, hidden=hidden, rank=rank)

    with shrink_smem(_BIG_SMEM):
        for t in (16384 - 63, 16384, 65536):
            for hidden in (4096, 8192):
                bs = get(t, hidden=hidden)
                assert bs == B.whole_rank128_shrink(), (t, hidden, bs)
        bs = B.whole_rank128_shrink()
        assert (bs.block_m, bs.block_r, bs.block_k, bs.num_warps) == (128, 128, 64, 8)
        assert (bs.split_k, bs.atomic_programs, bs.num_stages) == (1, 0, 5)
        assert shrink_smem_bytes(bs, 2) == B.WHOLE_RANK_SMEM <= _BIG_SMEM
        assert get(16384 - 64).block_m == 64  # 255 blocks of 64: the side-by-side tiles
        assert get(16384, rank=64).block_m == 64
    with shrink_smem(B.WHOLE_RANK_SMEM - 1):
        small = get(16384)
        assert small.rank_inner and (small.block_m, small.block_r) == (64, 64)


def test_session32_rank128_at_2049_to_4096_tokens_takes_the_whole_rank_on_64_rows():
    """Rank 128 at 2049-4096 tokens (`WHOLE_ROWS_BLOCKS`): the whole rank on 64-token blocks
    (64 x 128 tiles: x read once a block), 4 stages of 128-column k steps, split 2 on the
    static grid while the live blocks make at most `WHOLE_ROWS_PROGRAMS` items (the kernel
    picks it: 8 adapters' ~68 blocks split, 64 adapters' ~100 do not); where the GPU does not
    allow its 192 KiB, the side-by-side 64 x 64 tiles as before."""
    from lora_jax.kernels.shrink_expand import tuning_long_shrink as B
    from lora_jax.kernels.shrink_expand.pallas_triton_shrink import shrink_smem_bytes

    def get(t, rank=128, hidden=4096):
        return BlockSizes.get_default("shrink", num_tokens=t, hidden=hidden, rank=rank)

    with shrink_smem(_BIG_SMEM):
        for t in (2049, 3000, 4096):
            for hidden in (4096, 8192):
                assert get(t, hidden=hidden) == B.whole_rank128_rows_shrink(), (t, hidden)
        bs = B.whole_rank128_rows_shrink()
        assert (bs.block_m, bs.block_r, bs.block_k, bs.num_warps) == (64, 128, 128, 8)
        assert (bs.split_k, bs.num_stages, bs.persistent) == (2, 4, False)
        assert bs.atomic_programs == B.WHOLE_ROWS_PROGRAMS
        # the split the kernel picks from the live blocks (`_shrink_atomic_kernel`)
        assert min(B.WHOLE_ROWS_PROGRAMS // 68, bs.split_k) == 2
        assert max(1, B.WHOLE_ROWS_PROGRAMS // 100) == 1
        assert shrink_smem_bytes(bs, 2) == B.WHOLE_ROWS_SMEM <= _BIG_SMEM
        assert get(2048).block_r == 64 and get(4097).block_r == 64
        assert get(4096, rank=64).block_r == 64
    with shrink_smem(B.WHOLE_ROWS_SMEM - 1):
        small = get(4096)
        assert small.rank_inner and (small.block_m, small.block_r) == (64, 64)


def test_session14_defaults_rank16_expand_and_wide_split():
    """Rank <= 16 prefill expands up to SHORT_PREFILL_MAX_TOKENS use 16-token blocks with 2
    column tiles (64 columns up to 2048 tokens); longer prompts and higher ranks keep
    their tiles. Below LONG_PREFILL_TOKENS a hidden of 8192 may split 16 ways, each split
    still >= 8 k steps; 4096 stays at 8."""
    from lora_jax.kernels.shrink_expand import tuning as B

    def expand(t, r=16):
        return BlockSizes.get_default("expand", num_tokens=t, hidden=4096, rank=r)

    for t in (300, 1024, 2048):
        bs = expand(t)
        assert (bs.block_m, bs.block_n, bs.tiles_n) == (16, 64, 2), (t, bs)
    for t in (2049, B.SHORT_PREFILL_MAX_TOKENS):  # session 26: 4 tiles, y loaded ahead
        bs = expand(t)
        assert (bs.block_m, bs.block_n, bs.tiles_n, bs.prefetch) == (16, 128, 4, True), (t, bs)
    assert expand(B.SHORT_PREFILL_MAX_TOKENS + 1).block_m == 32
    assert expand(1024, r=64).block_m == 32 and expand(1024, r=8).block_m == 16
    for h, cap in ((4096, 8), (8192, 16), (16384, 16), (1024, 2)):
        bs = BlockSizes.get_default("shrink", num_tokens=1024, hidden=h, rank=64)
        assert bs.split_k == cap and h // bs.split_k >= 8 * bs.block_k, (h, bs)


def test_session26_prefill_expands_load_y_ahead():
    """Prefill expands of more than PREFETCH_MIN_TOKENS tokens load each column tile's y a
    tile ahead at rank 128 (16 tiles a program from 16384 tokens), and at ranks 16 and 64
    up to SHORT_PREFILL_MAX_TOKENS (rank 64: 64 x 64 tiles, under 8192 columns); shorter
    ones, longer rank-16/64 ones, rank 32 and rank 256 keep their tiles."""
    from lora_jax.kernels.shrink_expand import tuning as B

    def expand(t, r, width=4096):
        return BlockSizes.get_default("expand", num_tokens=t, hidden=width, rank=r)

    long, short_max = B.PREFETCH_MIN_TOKENS + 1, B.SHORT_PREFILL_MAX_TOKENS
    for t, r, want in (
        (long, 16, (16, 128, 4)),
        (short_max, 64, (64, 64, 8)),
        (long, 128, (64, 64, 8)),
        (8192, 128, (64, 64, 8)),
        (16384, 128, (64, 64, 16)),
    ):
        bs = expand(t, r)
        assert (bs.block_m, bs.block_n, bs.tiles_n, bs.prefetch) == (*want, True), (t, r, bs)
    for t, r, want in ((16384, 16, (32, 128, 4)), (8192, 64, (32, 128, 4))):
        bs = expand(t, r)
        assert (bs.block_m, bs.block_n, bs.tiles_n, bs.prefetch) == (*want, False), (t, r, bs)
    # (rank 128 at PREFETCH_MIN_TOKENS loads ahead since session 38, with cols_inner)
    for t, r in ((B.PREFETCH_MIN_TOKENS, 64), (1024, 128), (1024, 16), (long, 32)):
        assert not expand(t, r).prefetch, (t, r)
    assert not expand(short_max, 64, width=8192).prefetch
    assert not expand(16384, 256).prefetch and expand(16384, 256).tiles_n == 8
    assert not expand(256, 128).prefetch  # decode


def test_session36_hinted_short_expand_loads_y_ahead(monkeypatch):
    """With the host's hint of at least AHEAD_TOKENS_PER_SLOT tokens per active adapter, a
    prefill expand of up to AHEAD_SHORT_MAX_TOKENS tokens into fewer than 8192 columns
    loads y a tile ahead at ranks 64 and 128 (the session-33 candidates: the default tiles
    plus the ahead-load); other hints, more tokens, wider outputs and other ranks keep
    their tiles. lora_expand passes the hint only where every token goes to the Triton
    kernel (the host says no tile of y is wholly one adapter's)."""
    from lora_jax.kernels.shrink_expand import api
    from lora_jax.kernels.shrink_expand import tuning as B

    def expand(t, r, per=B.AHEAD_TOKENS_PER_SLOT, width=4096):
        return BlockSizes.get_default(
            "expand", num_tokens=t, hidden=width, rank=r, tokens_per_slot=per
        )

    for t, r, want in ((1024, 128, (64, 64, 4)), (512, 128, (64, 64, 4)), (1024, 64, (32, 128, 4))):
        bs = expand(t, r)
        assert (bs.block_m, bs.block_n, bs.tiles_n, bs.prefetch) == (*want, 1), (t, r, bs)
        # session 38: with a block's column groups side by side
        want_bs = dataclasses.replace(expand(t, r, per=None), prefetch=1, cols_inner=True)
        assert bs == want_bs, (t, r)
    for per in (None, 0, 1, 2, 16):
        assert not expand(1024, 128, per=per).prefetch, per
    assert not expand(B.AHEAD_SHORT_MAX_TOKENS + 1, 64).prefetch
    assert not expand(1024, 64, width=8192).prefetch
    assert not expand(1024, 16).prefetch and not expand(1024, 32).prefetch
    assert not expand(256, 128).prefetch  # decode

    seen = []
    real = api.pallas_triton.expand

    def spy(*args, bs, **kw):
        seen.append(bs.prefetch)
        return real(*args, bs=bs, **kw)

    monkeypatch.setattr(api.pallas_triton, "expand", spy)
    rng = np.random.default_rng(0)
    t, n_cols, rank = 320, 256, 64  # a prefill: 32 x 128 tiles, 4 a program
    idx = rng.integers(0, 2, t).astype(np.int32)
    meta = make_metadata(idx, 4)
    y = jnp.asarray(rng.normal(size=(t, n_cols)), jnp.float32)
    h = jnp.asarray(rng.normal(size=(1, t, rank)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(4, n_cols, rank)) / 8, jnp.float32)
    want = lora_expand_reference(y, h, (b,), offsets=(0,), **meta)
    for tiles, per, ahead in (("none", 64, 1), ("none", 0, 0), (None, 64, 0), ("some", 64, 0)):
        got = lora_expand(
            y, h, (b,), offsets=(0,), **meta, prompt_tiles=tiles, tokens_per_slot=per,
            mosaic=False, interpret=True,
        )  # fmt: skip
        assert seen[-1] == ahead, (tiles, per)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_session38_short_expands_launch_a_blocks_column_groups_together():
    """Up to COLS_INNER_MAX_TOKENS tokens, rank-16 expands, rank-64 ones with the hinted
    ahead-load and rank-128 ones with the ahead-load (hinted up to 1024 tokens, any hint
    above) launch a token block's column groups side by side; rank 128 with the hint
    FEW_TOKENS_PER_SLOT (3-16 tokens a slot) up to 1024 tokens takes 16-token blocks.
    Longer expands, decode steps, wider outputs and the unhinted short rank-64/128 tiles
    keep their order."""
    from lora_jax.kernels.shrink_expand import tuning as B

    def expand(t, r, per=None, width=4096):
        return BlockSizes.get_default(
            "expand", num_tokens=t, hidden=width, rank=r, tokens_per_slot=per
        )

    def tiles(bs):
        return (bs.block_m, bs.block_n, bs.tiles_n, int(bs.prefetch), bs.cols_inner)

    for t, r, per, want in (
        (300, 16, None, (16, 64, 2, 0, True)),
        (1024, 16, 0, (16, 64, 2, 0, True)),
        (B.COLS_INNER_MAX_TOKENS, 16, None, (16, 64, 2, 0, True)),
        (1024, 64, B.AHEAD_TOKENS_PER_SLOT, (32, 128, 4, 1, True)),
        (1024, 128, B.AHEAD_TOKENS_PER_SLOT, (64, 64, 4, 1, True)),
        (B.AHEAD_SHORT_MAX_TOKENS + 1, 128, None, (64, 64, 4, 1, True)),
        (B.COLS_INNER_MAX_TOKENS, 128, 0, (64, 64, 4, 1, True)),
        (1024, 128, B.FEW_TOKENS_PER_SLOT, (16, 64, 2, 0, False)),
        (512, 128, B.FEW_TOKENS_PER_SLOT, (16, 64, 2, 0, False)),
        # kept: unhinted short tiles, 17-63 tokens a slot, longer expands, rank 256
        (1024, 128, 0, (64, 64, 4, 0, False)),
        (1024, 64, B.FEW_TOKENS_PER_SLOT, (32, 128, 4, 0, False)),
        (1024, 64, None, (32, 128, 4, 0, False)),
        (1024, 128, None, (64, 64, 4, 0, False)),
        (B.COLS_INNER_MAX_TOKENS, 64, 0, (32, 128, 4, 0, False)),
        (B.COLS_INNER_MAX_TOKENS + 1, 16, None, (16, 128, 4, 1, False)),
        (B.COLS_INNER_MAX_TOKENS + 1, 128, None, (64, 64, 8, 1, False)),
        (1024, 256, B.FEW_TOKENS_PER_SLOT, (64, 64, 4, 0, False)),
    ):
        assert tiles(expand(t, r, per)) == want, (t, r, per)
    # into 8192 columns: neither the hinted nor the mid-size rank-128 ahead-load
    assert tiles(expand(1024, 128, B.FEW_TOKENS_PER_SLOT, width=8192)) == (64, 64, 4, 0, False)
    assert tiles(expand(B.COLS_INNER_MAX_TOKENS, 128, width=8192)) == (64, 64, 4, 0, False)
    for t, r in ((256, 16), (256, 64), (256, 128)):  # decode
        assert not expand(t, r, per=B.FEW_TOKENS_PER_SLOT).cols_inner, (t, r)


def test_session39_wide_rank64_decode_expand_launches_a_blocks_column_groups_together():
    """Rank-64 decode expands of 129-256 tokens into at least 8192 columns run the static grid with
    a token block's column groups side by side (the tiles of `_DECODE_CI`, which the GPU cases of
    `test_large` run); fewer tokens, narrower or wider outputs, other ranks, prefills and the
    per-token tiles do not."""
    from lora_jax.kernels.shrink_expand import tuning as B

    def expand(t, width, r, **kw):
        return BlockSizes.get_default("expand", num_tokens=t, hidden=width, rank=r, **kw)

    for t, width in ((256, 8192), (B.DECODE_COLS_INNER_MIN_TOKENS, 8192), (200, 10240)):
        assert expand(t, width, 64) == _DECODE_CI, (t, width)
        assert expand(t, width, 48) == _DECODE_CI  # padded to 64
        assert expand(t, width, 64, tokens_per_slot=0) == _DECODE_CI
    live = expand(256, 4096, 64)
    assert live.live_programs == B.EXPAND_LIVE_PROGRAMS and not live.cols_inner
    for t, width, r in (
        (B.DECODE_COLS_INNER_MIN_TOKENS - 1, 8192, 64),  # 128 tokens: lost over 8 adapters
        (64, 8192, 64),
        (256, 8191, 64),  # narrower: lost over 8 adapters at 4096 columns
        (256, 8192, 128),  # rank 128: lost at 4096 columns, not measured at 8192
        (256, 8192, 16),
        (B.DECODE_MAX_TOKENS + 1, 8192, 64),  # a prefill
    ):
        assert not expand(t, width, r).cols_inner or t > B.DECODE_MAX_TOKENS, (t, width, r)
        assert expand(t, width, r) != _DECODE_CI, (t, width, r)
    assert expand(256, 8192, 64, per_token=True).per_token


def test_session40_wider_rank64_decode_expand_takes_column_groups_from_64_tokens():
    """From WIDE_DECODE_EXPAND_COLUMNS columns (a 70B-class gate / up / gate_up) the
    rank-64 decode expand takes `_DECODE_CI` from WIDE_DECODE_COLS_INNER_MIN_TOKENS tokens
    (the GPU cases of `test_large` run it); fewer tokens, other ranks and prefills do not."""
    from lora_jax.kernels.shrink_expand import tuning as B

    def expand(t, width, r, **kw):
        return BlockSizes.get_default("expand", num_tokens=t, hidden=width, rank=r, **kw)

    wide = B.WIDE_DECODE_EXPAND_COLUMNS
    for t in (B.WIDE_DECODE_COLS_INNER_MIN_TOKENS, 128, B.DECODE_MAX_TOKENS):
        for width in (wide, 28672, 57344):
            assert expand(t, width, 64) == _DECODE_CI, (t, width)
            assert expand(t, width, 40, tokens_per_slot=64) == _DECODE_CI, (t, width)
    # below the wide outputs, 64-128 tokens keep the live-block tiles (lost at 8192)
    assert expand(B.WIDE_DECODE_COLS_INNER_MIN_TOKENS, wide - 1, 64) != _DECODE_CI
    for t, r in (
        (B.WIDE_DECODE_COLS_INNER_MIN_TOKENS - 1, 64),
        (128, 16),  # rank 16 walks the live blocks in groups up to 64 tokens, else default
        (128, 128),
        (B.DECODE_MAX_TOKENS + 1, 64),  # a prefill
    ):
        assert expand(t, 28672, r) != _DECODE_CI, (t, r)
    assert expand(128, 28672, 64, per_token=True).per_token


def test_session25_wide_decode_expand_walks_live_blocks():
    """Rank-16/32 decode expands of up to 64 tokens into y of at least
    WIDE_DECODE_EXPAND_COLUMNS columns (a Llama gate_up) walk the live blocks in groups;
    narrower ones, higher ranks, more tokens and the per-token tiles do not."""
    from lora_jax.kernels.shrink_expand import tuning as B

    def expand(t, width, r, per_token=False):
        return BlockSizes.get_default(
            "expand", num_tokens=t, hidden=width, rank=r, per_token=per_token
        )

    for t, r in ((1, 16), (64, 16), (64, 32)):
        assert expand(t, 28672, r).block_groups == B.DECODE_EXPAND_GROUPS, (t, r)
    for t, width, r in ((64, 6144, 16), (64, 28672, 64), (256, 28672, 16), (1024, 28672, 16)):
        assert expand(t, width, r).block_groups == 0, (t, width, r)
    assert expand(64, 28672, 16, per_token=True).block_groups == 0


def test_session16_decode_expand_picks_its_tiles_when_it_runs():
    """Decode expands at ranks >= 64 from 64 tokens walk up to 4 column tiles a program,
    as many as the live blocks allow (`live_programs`); rank 16 and 16 tokens keep one
    tile a program, prefill a static count; and the pick is the largest power of two that
    leaves `live_programs` programs."""
    from lora_jax.kernels.shrink_expand import tuning as B
    from lora_jax.kernels.shrink_expand.pallas_triton import _tiles_per_program

    def expand(t, r):
        return BlockSizes.get_default("expand", num_tokens=t, hidden=4096, rank=r)

    for t, r in ((64, 64), (256, 128), (64, 256)):
        bs = expand(t, r)
        assert (bs.tiles_n, bs.live_programs) == (4, B.EXPAND_LIVE_PROGRAMS), (t, r, bs)
    for t, r in ((16, 64), (64, 16), (1024, 64)):
        assert expand(t, r).live_programs == 0, (t, r)
    bs = BlockSizes(tiles_n=4, live_programs=264)
    # 64 tokens, 4096 columns of 128: 32 tiles a block; 8 live blocks -> 1, 64 -> 4
    got = [int(_tiles_per_program(jnp.int32(n * 32), bs)) for n in (0, 8, 16, 17, 33, 64)]
    assert got == [1, 1, 1, 2, 4, 4], got
    with pytest.raises(ValueError, match="power"):
        BlockSizes(tiles_n=3, live_programs=8)


@pytest.mark.parametrize(
    "cc, want",
    [
        ("9.0", 200 * 1024),
        ("8.0", 150 * 1024),
        ("8.6", 90 * 1024),
        ("7.5", 45 * 1024),
        (None, 45 * 1024),
    ],
)
def test_opt_in_smem_budget_by_compute_capability(monkeypatch, cc, want):
    """The shrink's shared-memory budget follows the first GPU's compute capability (none:
    the portable 45 KiB), and LORA_JAX_TRITON_SMEM_BUDGET overrides it."""
    from lora_jax.kernels.shrink_expand import pallas_triton

    class FakeGpu:
        compute_capability = cc

    def devices(backend=None):
        if cc is None:
            raise RuntimeError("Unknown backend: 'gpu' requested, but no platforms are found")
        assert backend == "gpu"
        return [FakeGpu()]

    monkeypatch.delenv("LORA_JAX_TRITON_SMEM_BUDGET", raising=False)
    monkeypatch.setattr(pallas_triton.jax, "devices", devices)
    pallas_triton.opt_in_smem_budget.cache_clear()
    try:
        assert pallas_triton.opt_in_smem_budget() == want
        pallas_triton.opt_in_smem_budget.cache_clear()
        monkeypatch.setenv("LORA_JAX_TRITON_SMEM_BUDGET", "65536")
        assert pallas_triton.opt_in_smem_budget() == 65536
    finally:
        pallas_triton.opt_in_smem_budget.cache_clear()


@pytest.mark.parametrize(
    "rank,t_long",
    [(16, 2048), (64, 4096), (64, 16384), (128, 2048), (128, 4096), (128, 8192), (128, 16384)],
    ids=str,
)
def test_long_prefill_shrink_tiles(rank, t_long):
    """The long-prompt tiles (sessions 8-9; rank 64's deep k steps, split 2 at 4096 tokens
    and unsplit from 8192, session 30; rank 128's rank blocks side by side, on deep k
    steps up to 4096 tokens, session 31): chosen only where the GPU allows their shared
    memory, and right (interpret mode, ragged hidden size, ranks needing padding)."""
    from lora_jax.kernels.shrink_expand.pallas_triton_shrink import shrink_smem_bytes

    with shrink_smem(45 * 1024):
        small = long_prefill_shrink(t_long, 4096, max(16, rank))
    with shrink_smem(_BIG_SMEM):
        tiles = long_prefill_shrink(t_long, 4096, max(16, rank))
        assert BlockSizes.get_default("shrink", num_tokens=t_long, hidden=4096, rank=rank) == tiles
        assert shrink_smem_bytes(tiles, 2) <= _BIG_SMEM
        assert (small is None) == (shrink_smem_bytes(tiles, 2) > 45 * 1024)
        rng = np.random.default_rng(rank)
        num_tokens, hidden, max_loras = 300, 520, 4
        idx = make_mapping("unsorted", num_tokens, max_loras, rng)
        idx[:200] = 1  # a long run of one adapter: full blocks
        meta = make_metadata(idx, max_loras)
        r = rank - 3  # padded inside the kernel
        x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.bfloat16)
        a = jnp.asarray(rng.standard_normal((max_loras, r, hidden)) / 16, jnp.bfloat16)
        got = lora_shrink(x, (a,), **meta, scale=0.5, block_sizes=tiles, interpret=True)
    want = lora_shrink_reference(x, (a,), **meta, scale=0.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_prefill_default_split_matches_reference():
    """The default tiles at T = 300 (prefill regime: the shrink split over the hidden dim,
    the expand walking column tiles) vs the oracle."""
    case = Case(300, 1024, 16, (16,), jnp.bfloat16, "unsorted", max_loras=8)
    assert BlockSizes.get_default("shrink", num_tokens=300, hidden=1024, rank=16).split_k > 1
    rng = np.random.default_rng(3)
    idx = make_mapping(case.mapping, case.num_tokens, case.max_loras, rng)
    meta = make_metadata(idx, case.max_loras)
    x = jnp.asarray(rng.standard_normal((case.num_tokens, case.hidden)), case.dtype)
    a = jnp.asarray(rng.standard_normal((case.max_loras, case.rank, case.hidden)) / 32, case.dtype)
    out = lora_shrink(x, (a,), **meta, scale=0.5, interpret=True)
    ref = lora_shrink_reference(x, (a,), **meta, scale=0.5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-2, atol=2e-2)
    # The default prefill expand walks several column tiles per program: 600 columns
    # are 10 tiles of 64, so 5 groups of 2, the last partly past the slice.
    bs = BlockSizes.get_default("expand", num_tokens=300, hidden=600, rank=16)
    assert bs.tiles_n > 1 and bs.tiles_n * bs.block_n < 600
    b = jnp.asarray(rng.standard_normal((case.max_loras, 600, case.rank)), case.dtype)
    y = jnp.asarray(rng.standard_normal((case.num_tokens, 600)), case.dtype)
    got = lora_expand(y, out, (b,), offsets=(0,), **meta, interpret=True)
    want = lora_expand_reference(y, out, (b,), offsets=(0,), **meta)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=5e-2
    )


def test_expand_work_list_uses_the_fitted_token_block():
    """Rank 256 with the prefill tiles: fitting them to shared memory halves block_m
    (64 -> 32), and the work list must be cut at 32 rows too, or half the rows of every
    full block are never updated."""
    bs = BlockSizes.get_default("expand", num_tokens=300, hidden=64, rank=256)
    rng = np.random.default_rng(4)
    idx = np.full(300, 1, np.int32)  # one adapter: every block is full
    idx[::7] = 0
    meta = make_metadata(idx, 2)
    h = jnp.asarray(rng.standard_normal((1, 300, 256)) / 16, jnp.float32)
    b = jnp.asarray(rng.standard_normal((2, 64, 256)), jnp.float16)
    y = jnp.asarray(rng.standard_normal((300, 64)), jnp.float16)
    from lora_jax.kernels.shrink_expand import pallas_triton

    with shrink_smem(45 * 1024):  # a GPU with less shared memory than an H200
        assert pallas_triton.expand_tiles(bs, (b,), y).block_m < bs.block_m  # the case at hand
        got = lora_expand(y, h, (b,), offsets=(0,), **meta, interpret=True)
    want = lora_expand_reference(y, h, (b,), offsets=(0,), **meta)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=5e-2
    )


def test_bad_shapes_are_named():
    case = CPU_CASES[1]
    meta = make_metadata(np.zeros(case.num_tokens, np.int32), case.max_loras)
    x = jnp.zeros((case.num_tokens, case.hidden), jnp.float32)
    a = jnp.zeros((case.max_loras, case.rank, case.hidden + 1), jnp.float32)
    with pytest.raises(ValueError, match=r"lora_a\[0\]"):
        lora_shrink(x, (a,), **meta, interpret=True)
    y = jnp.zeros((case.num_tokens, 8), jnp.float32)
    h = jnp.zeros((1, case.num_tokens, case.rank), jnp.float32)
    b = jnp.zeros((case.max_loras, 16, case.rank), jnp.float32)
    with pytest.raises(ValueError, match="outside y"):
        lora_expand(y, h, (b,), offsets=(0,), **meta, interpret=True)
