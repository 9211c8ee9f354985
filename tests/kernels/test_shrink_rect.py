"""The shrink over rectangles of x (`pallas_triton_rect.rect_shrink`), which
`lora_shrink` runs at ranks 16-64 where the host found every mapped token in whole tiles
of one slot (``whole_tiles="all"``), and any rank with tiles a caller gives
(`BlockSizes.rect`): interpret mode and CUDA lowering on CPU, real runs on GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shrink_expand_test_base import abstract_gpu_context, make_metadata

import lora_jax as lj
from lora_jax import ops
from lora_jax.kernels import BlockSizes, lora_shrink, lora_shrink_reference
from lora_jax.kernels.shrink_expand.tuning_long_shrink import (
    RECT_MIN_TOKENS,
    RECT_WIDE_RANKS,
    rect_shrink_tiles,
)
from lora_jax.kernels.shrink_expand.work_list import segment_block_m, whole_tiles


@pytest.fixture
def h200_smem(monkeypatch):
    """`opt_in_smem_budget` as on an H200 (200 KiB), on a machine with no GPU."""
    from lora_jax.kernels.shrink_expand import pallas_triton

    monkeypatch.setenv("LORA_JAX_TRITON_SMEM_BUDGET", str(200 * 1024))
    pallas_triton.opt_in_smem_budget.cache_clear()
    yield
    monkeypatch.undo()
    pallas_triton.opt_in_smem_budget.cache_clear()


def prompts(num_tokens: int, slots, *, unmapped_tiles=(), seed: int = 0) -> np.ndarray:
    """Prompts of whole tiles (`segment_block_m`), each one of ``slots``, in random order and
    lengths; the tiles in ``unmapped_tiles`` and the rows past the last whole tile -1."""
    rng = np.random.default_rng(seed)
    tile = segment_block_m(num_tokens)
    tiles = num_tokens // tile
    cuts = np.sort(rng.choice(np.arange(1, tiles), size=len(slots) - 1, replace=False))
    per_tile = np.repeat(rng.permutation(np.asarray(slots)), np.diff([0, *cuts, tiles]))
    per_tile[list(unmapped_tiles)] = -1
    idx = np.full(num_tokens, -1, np.int32)
    idx[: tiles * tile] = np.repeat(per_tile, tile)
    return idx


def _shrink(x, lora_a, idx, max_loras, *, hint="all", ranks=None, interpret=True, bs=None):
    return lora_shrink(
        x,
        lora_a,
        **make_metadata(idx, max_loras),
        slot_ranks=ranks,
        scale=0.5,
        whole_tiles=hint,
        block_sizes=bs,
        interpret=interpret,
    )


def _check(num_tokens, hidden, rank, widths, dtype, idx, max_loras, ranked, interpret, bs=None):
    k = jax.random.key(num_tokens + rank)
    x = jax.random.normal(jax.random.fold_in(k, 0), (num_tokens, hidden), dtype)
    lora_a = tuple(
        jax.random.normal(jax.random.fold_in(k, 1 + s), (max_loras, rank, hidden), dtype)
        * hidden**-0.5
        for s in range(widths)
    )
    ranks = None
    if ranked:  # true ranks under the padded one, per slice and slot
        ranks = jnp.asarray(np.random.default_rng(1).integers(1, rank + 1, (widths, max_loras)))
    assert whole_tiles(idx) == "all"
    got = _shrink(x, lora_a, idx, max_loras, ranks=ranks, interpret=interpret, bs=bs)
    want = lora_shrink_reference(
        x, lora_a, token_lora_indices=jnp.asarray(idx), slot_ranks=ranks, scale=0.5
    )
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.asarray(got)[:, idx < 0], 0.0)  # unmapped rows: exactly 0


@pytest.mark.parametrize(
    "num_tokens, hidden, rank, widths, dtype, ranked, unmapped",
    [
        (1024, 512, 16, 1, jnp.bfloat16, False, (0,)),
        # rank 8 padded to 16, true ranks, three slices, a tail of 36 unmapped rows
        (1060, 1024, 8, 3, jnp.float16, True, (3, 4)),
        (2048, 512, 12, 2, jnp.float32, True, ()),
    ],
    ids=str,
)
def test_rect_shrink_matches_reference(num_tokens, hidden, rank, widths, dtype, ranked, unmapped):
    """Prompts in whole tiles (some tiles and the tail unmapped), every dtype, true ranks,
    several slices: as the oracle, and the unmapped rows exactly 0."""
    idx = prompts(num_tokens, [2, 5, 0, 7], unmapped_tiles=unmapped)
    _check(num_tokens, hidden, rank, widths, dtype, idx, 8, ranked, interpret=True)


RECT_WIDE = [  # ranks 64 / 128 over rectangles, given by the caller (`BlockSizes.rect`)
    BlockSizes(block_m=64, block_r=64, block_k=128, split_k=2, rect=True),
    BlockSizes(block_m=32, block_r=128, block_k=64, num_warps=8, split_k=4, rect=True),
    BlockSizes(block_m=64, block_r=64, block_k=128, split_k=1, rank_inner=True, rect=True),
    BlockSizes(block_m=32, block_r=16, block_k=128, split_k=1, rect=True),
    # two 64-row host tiles a block (one rectangle where both are one slot's)
    BlockSizes(block_m=128, block_r=64, block_k=128, split_k=2, rect=True),
    # x's first tiles requested before the slot is read back (`BlockSizes.x_first`)
    BlockSizes(block_m=64, block_r=64, block_k=128, split_k=2, rect=True, x_first=True),
    BlockSizes(block_m=32, block_r=16, block_k=128, split_k=1, rect=True, x_first=True),
]


@pytest.mark.parametrize(
    "num_tokens, rank, widths, dtype, ranked, bs",
    [
        (1024, 64, 1, jnp.bfloat16, False, RECT_WIDE[0]),
        (1024, 128, 2, jnp.float16, True, RECT_WIDE[1]),
        (1024, 100, 3, jnp.float32, True, RECT_WIDE[2]),  # 100 padded to 128: 2 rank blocks
        (1060, 16, 2, jnp.bfloat16, True, RECT_WIDE[3]),  # stored whole, an unmapped tail
        (1060, 64, 2, jnp.bfloat16, True, RECT_WIDE[4]),  # tile pairs, some of two slots
        (1024, 100, 2, jnp.bfloat16, True, RECT_WIDE[5]),  # x_first, dead rank blocks
        (1060, 16, 3, jnp.float32, True, RECT_WIDE[6]),  # x_first stored whole, a tail
    ],
    ids=str,
)
def test_rect_shrink_given_tiles_match_reference(num_tokens, rank, widths, dtype, ranked, bs):
    """Rectangle tiles given by the caller at ranks 16-128: whole-rank and split rank
    blocks (side by side), k splits added atomically or one range stored whole, true
    ranks under the padded one, unmapped tiles and tails: as the oracle."""
    idx = prompts(num_tokens, [6, 1, 3], unmapped_tiles=(2,))
    if bs.block_m == 128:  # pairs of one slot and pairs of two
        idx = prompts(num_tokens, [6, 1, 3, 4, 0], unmapped_tiles=(2, 9))
        pairs = idx[: num_tokens // 128 * 128].reshape(-1, 2, 64)[:, :, 0]
        assert (pairs[:, 0] == pairs[:, 1]).any() and (pairs[:, 0] != pairs[:, 1]).any()
    _check(num_tokens, 512, rank, widths, dtype, idx, 8, ranked, interpret=True, bs=bs)


@pytest.mark.parametrize("bs", [RECT_WIDE[5], RECT_WIDE[6]], ids=str)
def test_rect_shrink_x_first_keeps_unmapped_rows_zero(bs):
    """With ``x_first`` the loop runs over blocks of unmapped tokens too: where their x
    holds inf or NaN, their rows still come out exactly 0 and the others as the oracle."""
    num_tokens, hidden, rank = 1060, 512, 64
    idx = prompts(num_tokens, [6, 1, 3], unmapped_tiles=(2, 5))
    k = jax.random.key(3)
    x = jax.random.normal(k, (num_tokens, hidden), jnp.bfloat16)
    bad = np.flatnonzero(idx < 0)
    x = x.at[bad[::2]].set(jnp.inf).at[bad[1::2]].set(jnp.nan)
    a = (jax.random.normal(jax.random.fold_in(k, 1), (8, rank, hidden), jnp.bfloat16) * 0.05,)
    got = np.asarray(_shrink(x, a, idx, 8, bs=bs))
    want = lora_shrink_reference(x, a, token_lora_indices=jnp.asarray(idx), scale=0.5)
    np.testing.assert_array_equal(got[:, idx < 0], 0.0)
    mapped = idx >= 0
    np.testing.assert_allclose(got[:, mapped], np.asarray(want)[:, mapped], atol=2e-2, rtol=2e-2)


def test_rect_tiles_need_the_hosts_whole_tiles():
    """``rect=True`` without the host's "all", with rectangles wider than its tiles, or
    with the Mosaic kernel asked for, is refused before anything runs."""
    idx = prompts(1024, [0, 1])
    x = jnp.zeros((1024, 256), jnp.bfloat16)
    a = (jnp.zeros((2, 64, 256), jnp.bfloat16),)
    meta = make_metadata(idx, 2)
    bs = RECT_WIDE[0]
    for hint in (None, "some", "none"):
        with pytest.raises(ValueError, match="rect=True.*whole_tiles='all'"):
            lora_shrink(x, a, **meta, whole_tiles=hint, block_sizes=bs, interpret=True)
    wide = BlockSizes(block_m=128, block_r=64, block_k=128, rect=True)  # tiles of 64 rows
    with pytest.raises(ValueError, match="block_m=128"):
        lora_shrink(x, a, **meta, whole_tiles="all", block_sizes=wide, interpret=True)
    with pytest.raises(ValueError, match="mosaic"):
        lora_shrink(x, a, **meta, whole_tiles="all", block_sizes=bs, mosaic=True, interpret=True)
    with pytest.raises(ValueError, match="rect=True.*per_token=True"):
        BlockSizes(rect=True, per_token=True)
    with pytest.raises(ValueError, match="x_first=True.*rect=True"):
        BlockSizes(x_first=True)
    pairs = BlockSizes(block_m=128, block_r=64, block_k=128, split_k=2, rect=True, x_first=True)
    with pytest.raises(ValueError, match="x_first=True is for blocks of one tile"):
        lora_shrink(x, a, **meta, whole_tiles="all", block_sizes=pairs, interpret=True)


def _kernel_names(num_tokens, hidden, rank, hint, block_sizes=None):
    """The Pallas kernels `lora_shrink` lowers to for CUDA (on the CPU)."""
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    idx = prompts(num_tokens, [1, 3])
    meta = make_metadata(idx, 4)
    sds = jax.ShapeDtypeStruct
    x = sds((num_tokens, hidden), jnp.bfloat16)
    lora_a = (sds((4, rank, hidden), jnp.bfloat16),) * 2

    def step(x, lora_a, meta):
        return lora_shrink(
            x, lora_a, **meta, whole_tiles=hint, mosaic=False, block_sizes=block_sizes
        )

    with abstract_gpu_context():
        text = jax.jit(step).trace(x, lora_a, meta).lower(lowering_platforms=("cuda",)).as_text()
    return {n for n in ("lora_shrink_rect", "lora_shrink_atomic", "lora_shrink") if n in text}


def test_rect_shrink_lowers_for_cuda_where_the_host_says_all(h200_smem):
    """Rank 16 with every token in whole tiles lowers to the rectangle kernel alone; any
    other hint, rank 64, or tiles given by the caller keep the work-list kernels."""
    t = RECT_MIN_TOKENS
    assert _kernel_names(t, 4096, 16, "all") == {"lora_shrink", "lora_shrink_rect"}
    assert "lora_shrink_rect" not in _kernel_names(t, 4096, 16, "some")
    assert "lora_shrink_rect" not in _kernel_names(t, 4096, 16, None)
    assert _kernel_names(t, 4096, 64, "all") == {"lora_shrink", "lora_shrink_rect"}
    assert "lora_shrink_rect" not in _kernel_names(t, 4096, 128, "all")
    assert "lora_shrink_rect" not in _kernel_names(2 * RECT_WIDE_RANKS[64], 4096, 64, "all")
    assert "lora_shrink_rect" not in _kernel_names(t // 2, 4096, 16, "all")
    given = BlockSizes(block_m=32, block_r=16, block_k=128, split_k=4, atomic_programs=528)
    assert "lora_shrink_rect" not in _kernel_names(t, 4096, 16, "all", given)
    assert _kernel_names(t, 4096, 64, "all", RECT_WIDE[0]) == {"lora_shrink", "lora_shrink_rect"}
    assert _kernel_names(t, 4096, 128, "all", RECT_WIDE[2]) == {"lora_shrink", "lora_shrink_rect"}


def test_rect_shrink_tiles(h200_smem, monkeypatch):
    """64-token rectangles, 128-column k steps; the hidden split fills ~256 items (4 at
    4096 tokens, none from 16384), at most 8 ways; rank 16 only, from 1024 tokens."""
    t4k = rect_shrink_tiles(4096, 4096, 16)
    assert (t4k.block_m, t4k.block_k, t4k.split_k, t4k.num_stages) == (64, 128, 4, 3)
    assert rect_shrink_tiles(1024, 4096, 16).split_k == 8
    assert rect_shrink_tiles(16384, 8192, 16).split_k == 1
    assert rect_shrink_tiles(4096, 4096, 32).block_r == 32
    assert rect_shrink_tiles(8192, 4096, 64).split_k == 1  # 128 blocks: stored whole
    assert rect_shrink_tiles(4096, 4096, 128) is None
    # rank 64: 4 stages, the split fills ~128 items (8 ways at 1024 tokens, 2 at 4096)
    r64 = rect_shrink_tiles(4096, 4096, 64)
    assert (r64.block_r, r64.num_stages, r64.split_k, r64.rect) == (64, 4, 2, True)
    assert r64.x_first and t4k.x_first  # x's first tile before the slot (session 43)
    assert rect_shrink_tiles(1024, 8192, 64).split_k == 8
    assert rect_shrink_tiles(RECT_WIDE_RANKS[64] + 64, 4096, 64) is None
    assert rect_shrink_tiles(RECT_WIDE_RANKS[32] + 64, 4096, 32) is None  # measured to 16384
    assert rect_shrink_tiles(16384, 4096, 32).split_k == 1  # 256 blocks: stored whole
    from lora_jax.kernels.shrink_expand import pallas_triton

    monkeypatch.setenv("LORA_JAX_TRITON_SMEM_BUDGET", str(96 * 1024))  # 4 stages do not fit
    pallas_triton.opt_in_smem_budget.cache_clear()
    assert rect_shrink_tiles(4096, 4096, 64) is None
    assert rect_shrink_tiles(4096, 4096, 16) is not None
    assert rect_shrink_tiles(RECT_MIN_TOKENS - 1, 4096, 16) is None
    assert rect_shrink_tiles(4096, 1000, 16) is None  # not in whole 512-column k ranges
    # the rectangles lie inside the host's whole tiles
    assert all(segment_block_m(t) % t4k.block_m == 0 for t in (1024, 4096, 16384))


def test_ops_pass_the_mappings_whole_tiles(monkeypatch):
    """A mapping made from host indices carries whole_tiles, and `lj.ops.lora_shrink` on
    the kernels hands it on: the rectangle kernel's result is the XLA backend's."""
    monkeypatch.setattr(ops, "PALLAS_INTERPRET", True)
    idx = prompts(1024, [0, 3, 6])
    m = lj.make_lora_mapping(idx, 8, host_hints=True)
    assert m.whole_tiles == "all" and m.shrink_kwargs()["whole_tiles"] == "all"
    x = jax.random.normal(jax.random.key(0), (1024, 512), jnp.float32)
    a = jax.random.normal(jax.random.key(1), (8, 16, 512), jnp.float32)
    got = ops.lora_shrink(x, [a], m, 0.5, backend="pallas")
    want = ops.lora_shrink(x, [a], m, 0.5, backend="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_tokens, hidden, rank, widths, dtype, ranked, slots",
    [
        (4096, 4096, 16, 1, jnp.bfloat16, False, [7]),
        (4096, 4096, 16, 1, jnp.bfloat16, False, [3, 9, 12, 20, 33, 41, 50, 63]),
        (16384, 4096, 16, 1, jnp.bfloat16, False, [3, 9, 12, 20, 33, 41, 50, 63]),
        (3000, 2048, 8, 3, jnp.float16, True, [1, 2, 5]),
        (1024, 4096, 16, 2, jnp.float32, True, [0, 4]),
        (4096, 4096, 64, 1, jnp.bfloat16, False, [7]),
        (1024, 8192, 64, 2, jnp.bfloat16, True, [3, 9, 12, 20, 33, 41, 50, 63]),
        (2048, 4096, 32, 3, jnp.bfloat16, True, [5, 6, 7]),
        (8192, 4096, 64, 1, jnp.bfloat16, False, [3, 9, 12, 20, 33, 41, 50, 63]),
        (16384, 4096, 32, 2, jnp.bfloat16, True, [3, 9, 12, 20, 33, 41, 50, 63]),
    ],
    ids=str,
)
def test_rect_shrink_on_gpu(num_tokens, hidden, rank, widths, dtype, ranked, slots):
    idx = prompts(num_tokens, slots, unmapped_tiles=(1,) if len(slots) > 1 else ())
    _check(num_tokens, hidden, rank, widths, dtype, idx, 64, ranked, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_tokens, hidden, rank, widths, dtype, ranked, slots, bs",
    [
        (4096, 4096, 64, 1, jnp.bfloat16, False, [3, 9, 12, 20, 33, 41, 50, 63], RECT_WIDE[0]),
        (4096, 4096, 128, 1, jnp.bfloat16, False, [7], RECT_WIDE[1]),
        (2048, 4096, 128, 3, jnp.float16, True, [1, 2, 5], RECT_WIDE[2]),
        (3000, 4096, 16, 2, jnp.bfloat16, True, [4, 8], RECT_WIDE[3]),
        (4096, 4096, 64, 1, jnp.bfloat16, False, [3, 9, 12, 20, 33, 41, 50, 63], RECT_WIDE[4]),
        (4096, 4096, 64, 1, jnp.bfloat16, False, [7], RECT_WIDE[5]),
        (2048, 4096, 100, 2, jnp.bfloat16, True, [3, 9, 12], RECT_WIDE[5]),
        (3000, 4096, 16, 2, jnp.float16, True, [4, 8], RECT_WIDE[6]),
    ],
    ids=str,
)
def test_rect_shrink_given_tiles_on_gpu(num_tokens, hidden, rank, widths, dtype, ranked, slots, bs):
    idx = prompts(num_tokens, slots, unmapped_tiles=(1,) if len(slots) > 1 else ())
    _check(num_tokens, hidden, rank, widths, dtype, idx, 64, ranked, interpret=False, bs=bs)
