"""The Mosaic GPU expand: its tile list (CPU, against a numpy oracle), its CUDA lowering
(on CPU), and the kernel against the jnp oracle (on a Hopper GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shrink_expand_test_base import abstract_gpu_context, make_metadata

from lora_jax.kernels import lora_expand, lora_expand_reference
from lora_jax.kernels.shrink_expand import mosaic_gpu_expand as me
from lora_jax.kernels.shrink_expand import work_list
from lora_jax.mapping import make_lora_mapping


def _mapping(layout: str, num_tokens: int, max_loras: int, rng) -> np.ndarray:
    if layout == "one":
        return np.full(num_tokens, 3, np.int32)
    if layout == "runs":  # prompts of random lengths, some unmapped, some tiles mixed
        out, slot = [], 0
        while sum(map(len, out)) < num_tokens:
            slot = int(rng.integers(-1, max_loras))
            out.append(np.full(int(rng.integers(1, 400)), slot, np.int32))
        return np.concatenate(out)[:num_tokens]
    return rng.integers(-1, max_loras, num_tokens).astype(np.int32)  # shuffled: no tiles


def _items_oracle(idx: np.ndarray, block_m: int):
    tiles = []
    for t in range(len(idx) // block_m):
        rows = idx[t * block_m : (t + 1) * block_m]
        if rows[0] >= 0 and (rows == rows[0]).all():
            tiles.append((t, rows[0]))
    return tiles


@pytest.mark.slow  # 9 cases; the host/device agreement test below runs everywhere
@pytest.mark.parametrize("layout", ["one", "runs", "shuffled"])
@pytest.mark.parametrize("num_tokens,block_m", [(1000, 64), (4096, 128), (64, 64)])
def test_tile_items_match_oracle(layout, num_tokens, block_m):
    idx = _mapping(layout, num_tokens, 8, np.random.default_rng(num_tokens + block_m))
    items, mine = me.tile_items(jnp.asarray(idx), block_m=block_m)
    items, mine = np.asarray(items), np.asarray(mine)
    want = _items_oracle(idx, block_m)
    count = items[2, 0]
    assert (items[2] == count).all() and count == len(want)
    assert [(int(a), int(b)) for a, b in items[:2, :count].T] == want
    rows = np.zeros(num_tokens, bool)
    for t, _ in want:
        rows[t * block_m : (t + 1) * block_m] = True
    np.testing.assert_array_equal(mine, rows)


def test_unsupported_shapes_are_named():
    tiles = me.ExpandTiles(block_m=64, block_n=128)
    why = me.supported(jnp.bfloat16, jnp.bfloat16, (4096, 5096), (4096, 1000), (0, 4096), 64, tiles)
    assert "slice 1" in why and "block_n=128" in why
    assert "dtype" in me.supported(jnp.float32, jnp.float32, (4096, 4096), (4096,), (0,), 64, tiles)
    assert "rank=8" in me.supported(
        jnp.bfloat16, jnp.bfloat16, (4096, 4096), (4096,), (0,), 8, tiles
    )
    big = me.ExpandTiles(block_m=128, block_n=256)
    assert "shared memory" in me.supported(
        jnp.bfloat16, jnp.bfloat16, (4096, 4096), (4096,), (0,), 128, big
    )
    # y's rows must be whole 16-byte units for TMA (a few columns no slice touches)
    odd = me.supported(jnp.bfloat16, jnp.bfloat16, (4096, 4099), (4096,), (0,), 64, tiles)
    assert "16 bytes" in odd
    with pytest.raises(ValueError, match="block_n=96"):
        me.ExpandTiles(block_n=96)


@pytest.mark.parametrize("rank,block_m,block_n,stages", [(64, 64, 128, 6), (128, 64, 128, 4)])
def test_stages_fit_shared_memory(rank, block_m, block_n, stages):
    tiles = me.ExpandTiles(block_m=block_m, block_n=block_n, stages=stages)
    got = me.fit_stages(tiles, rank)
    assert me.smem_bytes(tiles, rank, got) <= me.SMEM_BUDGET
    assert got == stages or me.smem_bytes(tiles, rank, got + 1) > me.SMEM_BUDGET


def test_h_buffer_is_free_for_the_stages():
    """With h read into registers ("regs") its f32 buffer's scope closes before the
    pipeline's, so the stages may reuse its bytes: at rank 128 in 64 x 128 tiles that is
    one stage more than with the buffer held (three of 64 KiB against two + 32 KiB)."""
    per_stage = (2 * 64 * 128 + 128 * 128) * 2
    h_tile = 64 * 128 * 4
    for h_in, want in (("regs", 3 * per_stage), ("regs_held", 2 * per_stage + h_tile)):
        tiles = me.ExpandTiles(block_m=64, block_n=128, stages=4, h_in=h_in)
        got = me.fit_stages(tiles, 128)
        assert me.smem_bytes(tiles, 128, got) == want <= me.SMEM_BUDGET
    assert me.smem_bytes(me.ExpandTiles(h_in="regs"), 128, 0) == h_tile  # the larger scope
    with pytest.raises(ValueError, match="h_in='tmem'"):
        me.ExpandTiles(h_in="tmem")


@pytest.mark.parametrize("rank", [16, 32, 64, 96, 128])
@pytest.mark.parametrize("item_rows", [64, 128])
def test_default_tiles_fit_and_divide_the_listed_tiles(rank, item_rows):
    tiles = me.default_tiles(rank, item_rows)
    assert item_rows % tiles.block_m == 0 and tiles.block_n == 128
    assert me.smem_bytes(tiles, rank, tiles.stages) <= me.SMEM_BUDGET and tiles.stages >= 2
    assert (
        me.supported(jnp.bfloat16, jnp.bfloat16, (4096, 4096), (4096,), (0,), rank, tiles) is None
    )


def _inputs(num_tokens, widths, rank, dtype, layout, ranked, seed=0):
    rng = np.random.default_rng(seed)
    max_loras = 8
    idx = _mapping(layout, num_tokens, max_loras, rng)
    k = jax.random.key(seed)
    y = jax.random.normal(k, (num_tokens, sum(widths)), dtype)
    h = jax.random.normal(jax.random.fold_in(k, 1), (len(widths), num_tokens, rank), jnp.float32)
    lora_b = tuple(
        (jax.random.normal(jax.random.fold_in(k, 2 + s), (max_loras, n, rank)) * 0.1).astype(dtype)
        for s, n in enumerate(widths)
    )
    ranks = (
        jnp.asarray(rng.integers(1, rank + 1, (len(widths), max_loras)), jnp.int32)
        if ranked
        else None
    )
    offsets = tuple(int(o) for o in np.cumsum((0,) + widths[:-1]))
    return idx, y, h, lora_b, ranks, offsets


@pytest.mark.parametrize(
    "num_tokens,widths,rank,ranked,h_in",
    [
        (2048, (4096,), 128, False, "regs"),
        (2048, (4096,), 128, True, "regs"),
        (2048, (4096,), 128, True, "regs_held"),
        (1000, (512, 256, 256), 64, True, "smem"),
    ],
)
def test_mosaic_expand_lowers_for_cuda(num_tokens, widths, rank, ranked, h_in):
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    idx, y, h, lora_b, ranks, offsets = _inputs(
        num_tokens, widths, rank, jnp.bfloat16, "runs", ranked
    )
    tiles = me.ExpandTiles(block_m=64, block_n=128, h_in=h_in)

    def f(y, h, lora_b, idx):
        items, _ = me.tile_items(idx, block_m=64)
        return me.expand(y, h, lora_b, items, ranks, offsets=offsets, tiles=tiles)

    idx = jnp.asarray(idx)
    with abstract_gpu_context():
        lowered = jax.jit(f).trace(y, h, lora_b, idx)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_tokens,widths,rank,dtype,layout,ranked,tiles,item_rows",
    [
        (4096, (4096,), 64, jnp.bfloat16, "one", False, me.ExpandTiles(), 64),
        (2048, (4096,), 128, jnp.bfloat16, "one", False, me.default_tiles(128, 128), 128),
        # rank 128: 3 stages in h's reused buffer, and the buffer held (2 stages)
        (2048, (4096,), 128, jnp.bfloat16, "runs", True, me.default_tiles(128, 64), 64),
        (1024, (4096,), 128, jnp.bfloat16, "runs", True, me.ExpandTiles(h_in="regs_held"), 64),
        (3000, (1024, 256, 256), 64, jnp.bfloat16, "runs", True, me.ExpandTiles(), 64),
        (2048, (2048, 2048), 32, jnp.float16, "runs", True, me.ExpandTiles(h_in="smem"), 64),
        (1024, (4096,), 16, jnp.bfloat16, "one", False, me.ExpandTiles(block_n=64, stages=6), 64),
        (16384, (4096,), 64, jnp.bfloat16, "runs", False, me.ExpandTiles(block_m=128), 128),
        (5000, (2048,), 96, jnp.bfloat16, "runs", True, me.ExpandTiles(), 128),  # 2 a tile
    ],
    ids=str,
)
def test_mosaic_expand_matches_reference(
    num_tokens, widths, rank, dtype, layout, ranked, tiles, item_rows
):
    if not me.available():
        pytest.skip("needs a Hopper GPU (Mosaic GPU WGMMA)")
    idx, y, h, lora_b, ranks, offsets = _inputs(num_tokens, widths, rank, dtype, layout, ranked)
    items, mine = me.tile_items(jnp.asarray(idx), block_m=item_rows)
    got = jax.jit(
        lambda y, h, b, items: me.expand(
            y, h, b, items, ranks, offsets=offsets, tiles=tiles, item_rows=item_rows
        )
    )(y, h, lora_b, items)
    want = lora_expand_reference(
        y, h, lora_b, offsets=offsets, token_lora_indices=jnp.asarray(idx), slot_ranks=ranks
    )
    mine = np.asarray(mine)
    got, want, y = (np.asarray(v.astype(jnp.float32)) for v in (got, want, y))
    np.testing.assert_allclose(got[mine], want[mine], rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(got[~mine], y[~mine])  # other rows: untouched


def test_host_whole_tiles_agree_with_the_device_list():
    """`work_list.whole_tiles` (numpy, on the host) says "all" / "some" / "none" exactly as
    `tile_items`' ``mine`` covers all, some or none of the mapped tokens."""
    rng = np.random.default_rng(3)
    seen = set()
    for trial in range(24):
        num_tokens = (130, 1024, 4200, 8192)[trial % 4]
        block_m = work_list.segment_block_m(num_tokens)
        idx = _mapping(("one", "runs", "shuffled")[trial % 3], num_tokens, 4, rng)
        if trial % 5 == 4:  # prompts padded to whole tiles: "all"
            idx = np.repeat(rng.integers(0, 4, -(-num_tokens // block_m)), block_m)[:num_tokens]
            idx[num_tokens // block_m * block_m :] = -1
        if trial % 7 == 6:
            idx[:] = -1
        mine = np.asarray(me.tile_items(jnp.asarray(idx), block_m=block_m)[1])
        mapped = idx >= 0
        want = "none" if not mine.any() else "all" if mine.sum() == mapped.sum() else "some"
        assert work_list.whole_tiles(idx) == want, (trial, idx)
        seen.add(want)
    assert seen == set(work_list.PROMPT_TILES)


def test_mapping_says_whole_tiles_to_the_expand():
    idx = np.repeat(np.arange(4, dtype=np.int32), 512)  # 2048 tokens, 64-row tiles
    m = make_lora_mapping(idx, 8, host_hints=True)
    assert m.whole_tiles == "all" and m.expand_kwargs()["prompt_tiles"] == "all"
    assert m.expand_kwargs()["mosaic"] is None
    idx[100:103] = 5
    assert make_lora_mapping(idx, 8, host_hints=True).whole_tiles == "some"
    decode = make_lora_mapping(idx, 8, is_prefill=False, host_hints=True)
    assert decode.whole_tiles == "none" and decode.expand_kwargs()["mosaic"] is False
    assert make_lora_mapping(jnp.asarray(idx), 8).whole_tiles is None  # device indices
    said = make_lora_mapping(jnp.asarray(idx), 8, whole_tiles="all")  # the caller knows
    assert said.expand_kwargs()["prompt_tiles"] == "all"
    # a tile wholly of one slot is a prompt tile: "none" of these says "none" of those
    assert (
        make_lora_mapping(jnp.asarray(idx), 8, prompt_tiles="none", whole_tiles="all").whole_tiles
        == "none"
    )
    with pytest.raises(ValueError, match="whole_tiles must be"):
        make_lora_mapping(idx, 8, whole_tiles="every")


def _lower_expand(num_tokens, rank, width, y_width=None, **kw):
    """The CUDA lowering of `lora_expand` over one slot's tokens (y [T, y_width], the
    slice's ``width`` columns from 0)."""
    y_width = y_width or width
    meta = make_metadata(np.zeros(num_tokens, np.int32), 2)
    y = jax.ShapeDtypeStruct((num_tokens, y_width), jnp.bfloat16)
    h = jax.ShapeDtypeStruct((1, num_tokens, rank), jnp.float32)
    b = jax.ShapeDtypeStruct((2, width, rank), jnp.bfloat16)
    with abstract_gpu_context():
        lowered = jax.jit(lambda y, h, b: lora_expand(y, h, (b,), offsets=(0,), **meta, **kw))
        return lowered.trace(y, h, b).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "num_tokens,rank,hint,mosaic,triton",
    [
        (2048, 64, "all", True, False),  # the host says every token is in whole tiles
        (2048, 64, "some", True, True),  # from rank 32: both kernels
        (2048, 32, None, True, True),
        (8192, 16, None, False, True),  # rank 16: the Triton launch costs what Mosaic saves
        (2048, 16, "all", True, False),
        (8192, 128, "none", False, True),
        (8192, 128, "all", True, False),
        (512, 64, "all", False, True),  # under SEGMENT_MIN_TOKENS
        (2048, 8, "all", False, True),  # rank 8: not a multiple of 16
        (2046, 64, "all", False, True),  # tokens not whole 8-row TMA tiles (failed to lower)
    ],
)
def test_default_picks_the_mosaic_expand_where_measured(
    monkeypatch, num_tokens, rank, hint, mosaic, triton
):
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    monkeypatch.setattr(me, "available", lambda: True)
    text = _lower_expand(num_tokens, rank, 1024, prompt_tiles=hint)
    assert ("mosaic_gpu" in text) == mosaic
    assert ("triton" in text) == triton
    if mosaic:  # y's rows not whole 16-byte units (3 columns past the slice): Triton alone
        odd = _lower_expand(num_tokens, rank, 1024, y_width=1027, prompt_tiles=hint)
        assert "mosaic_gpu" not in odd and "triton" in odd


def test_forced_mosaic_expand_names_what_it_cannot_run():
    meta = make_metadata(np.zeros(2048, np.int32), 2)
    y = jnp.zeros((2048, 512), jnp.float32)
    h = jnp.zeros((1, 2048, 64), jnp.float32)
    b = jnp.zeros((2, 512, 64), jnp.float32)
    with pytest.raises(ValueError, match="mosaic=True.*bfloat16 or float16"):
        lora_expand(y, h, (b,), offsets=(0,), **meta, mosaic=True)
    yb, bb = y.astype(jnp.bfloat16), jnp.zeros((2, 500, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="slice 0.*block_n"):
        lora_expand(yb, h, (bb,), offsets=(0,), **meta, mosaic=True)
    with pytest.raises(ValueError, match="interpret mode"):
        lora_expand(
            yb, h, (b.astype(jnp.bfloat16),), offsets=(0,), **meta, mosaic=True, interpret=True
        )
    with pytest.raises(ValueError, match="prompt_tiles='every'"):
        lora_expand(yb, h, (b.astype(jnp.bfloat16),), offsets=(0,), **meta, prompt_tiles="every")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_tokens,widths,rank,layout,ranked,hint",
    [
        (4096, (4096,), 64, "one", False, True),  # "all": the Mosaic kernel alone
        (3000, (1024, 256, 256), 64, "runs", True, False),  # both kernels, 3 slices
        (8192, (2048,), 128, "runs", True, False),  # 128-row tiles, 64 columns
        (5000, (1024, 1024), 16, "shuffled", False, False),  # no whole tile: Triton's
    ],
    ids=str,
)
def test_library_expand_with_mosaic_matches_reference(
    num_tokens, widths, rank, layout, ranked, hint
):
    if not me.available():
        pytest.skip("needs a Hopper GPU (Mosaic GPU WGMMA)")
    idx, y, h, lora_b, ranks, offsets = _inputs(
        num_tokens, widths, rank, jnp.bfloat16, layout, ranked
    )
    meta = make_metadata(idx, 8)
    tiles = work_list.whole_tiles(idx) if hint else None
    assert not hint or tiles == "all"
    got = lora_expand(
        y, h, lora_b, offsets=offsets, **meta, slot_ranks=ranks, mosaic=True, prompt_tiles=tiles
    )
    want = lora_expand_reference(
        y, h, lora_b, offsets=offsets, token_lora_indices=jnp.asarray(idx), slot_ranks=ranks
    )
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    unmapped = idx < 0
    np.testing.assert_array_equal(got[unmapped], np.asarray(y.astype(jnp.float32))[unmapped])
