"""The segment shrink: its schedule (CPU, against numpy oracles), its CUDA lowering (on
CPU), and the Mosaic GPU kernel against the jnp oracle (on a Hopper GPU)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shrink_expand_test_base import abstract_gpu_context, make_metadata

from lora_jax.kernels import lora_shrink, lora_shrink_reference
from lora_jax.kernels.shrink_expand import mosaic_gpu_shrink, work_list
from lora_jax.mapping import make_lora_mapping


def _runs(rng, num_tokens: int, max_loras: int, longest: int) -> np.ndarray:
    """Prompt-like runs of one slot (or -1) of 1 ... longest tokens."""
    out: list[int] = []
    while len(out) < num_tokens:
        out += [int(rng.integers(-1, max_loras))] * int(rng.integers(1, longest + 1))
    return np.asarray(out[:num_tokens], np.int32)


def _pieces_oracle(idx: np.ndarray, block_m: int, max_pieces: int):
    """(tile, slot, first, count) of each mapped run piece inside a tile cut into at most
    max_pieces runs; and the tokens they cover."""
    mine = np.zeros(len(idx), bool)
    pieces = []
    for lo in range(0, len(idx), block_m):
        tile = idx[lo : lo + block_m]
        cuts = [0] + [i for i in range(1, len(tile)) if tile[i] != tile[i - 1]] + [len(tile)]
        if len(cuts) - 1 > max_pieces:
            continue
        for a, b in zip(cuts[:-1], cuts[1:]):
            if tile[a] >= 0:
                mine[lo + a : lo + b] = True
                pieces.append((lo // block_m, int(tile[a]), lo + a, b - a))
    return pieces, mine


@pytest.mark.parametrize("block_m,max_pieces", [(128, 4), (64, 2), (128, 1)])
def test_segment_items_match_oracle(block_m, max_pieces):
    rng = np.random.default_rng(block_m + max_pieces)
    items_of = jax.jit(
        lambda idx: work_list.segment_items(idx, block_m=block_m, max_pieces=max_pieces)
    )
    for trial in range(16):
        num_tokens = (1, 77, 300, 640)[trial % 4]  # a few shapes: a few compiles
        idx = _runs(rng, num_tokens, 5, 200)
        if trial % 8 == 3:
            idx = rng.permutation(idx)  # shuffled: few or no pieces
        items, mine = items_of(jnp.asarray(idx))
        want, want_mine = _pieces_oracle(idx, block_m, max_pieces)
        items = np.asarray(items)
        got = [tuple(int(v) for v in col[:4]) for col in items.T if col[3] > 0]
        assert got == want, trial
        assert (items[3, len(want) :] == 0).all()  # the live pieces first
        assert (items[4] == len(want)).all()  # their count in every column
        np.testing.assert_array_equal(np.asarray(mine), want_mine)
        assert items.shape == (5, -(-num_tokens // block_m) * max_pieces)


def test_host_prompt_tiles_agree_with_the_device_schedule():
    """`work_list.prompt_tiles` (numpy, on the host) says "all" / "some" / "none" exactly
    as the device schedule's ``mine`` covers all, some or none of the mapped tokens."""
    rng = np.random.default_rng(7)
    mine_of = jax.jit(
        lambda idx, block_m: work_list.segment_items(idx, block_m=block_m, max_pieces=4)[1],
        static_argnums=1,
    )
    seen = set()
    for trial in range(18):
        num_tokens = (130, 1024, 4200)[trial % 3]  # 64-row tiles, then 128 past 4096
        block_m = work_list.segment_block_m(num_tokens)
        idx = _runs(rng, num_tokens, 5, (4, 60, 400)[trial // 3 % 3])
        if trial % 5 == 2:
            idx = rng.permutation(idx)
        if trial % 7 == 5:
            idx[:] = -1
        mine = np.asarray(mine_of(jnp.asarray(idx), block_m))
        mapped = idx >= 0
        want = "none" if not mine.any() else "all" if mine.sum() == mapped.sum() else "some"
        assert work_list.prompt_tiles(idx) == want, (trial, idx)
        seen.add(want)
    assert seen == set(work_list.PROMPT_TILES)


def test_rest_order_is_the_mapping_without_the_pieces():
    rng = np.random.default_rng(0)
    max_loras = 6

    @jax.jit
    def rest(idx):
        m = make_lora_mapping(idx, max_loras)
        _, mine = work_list.segment_items(m.token_lora_indices, block_m=128, max_pieces=4)
        got = work_list.rest_order(
            m.token_lora_indices, m.slot_token_counts, m.sorted_token_ids, mine
        )
        return got, mine

    for trial in range(12):
        num_tokens = (5, 333, 600)[trial % 3]
        idx = _runs(rng, num_tokens, max_loras, 150)
        if trial % 4 == 1:
            idx = rng.permutation(idx)
        (counts, starts, order), mine = rest(jnp.asarray(idx))
        want = make_metadata(np.where(np.asarray(mine), -1, idx), max_loras)
        np.testing.assert_array_equal(counts, want["slot_token_counts"])
        np.testing.assert_array_equal(starts, want["slot_token_starts"])
        kept = int(np.sum(np.asarray(counts)))
        np.testing.assert_array_equal(order[:kept], want["sorted_token_ids"][:kept])
        assert sorted(np.asarray(order).tolist()) == list(range(num_tokens))  # a permutation


def test_mapping_carries_the_segment_schedule_from_min_tokens(monkeypatch):
    key = work_list.SEGMENTS_KEY
    off = make_lora_mapping(jnp.zeros(work_list.SEGMENT_MIN_TOKENS, jnp.int32), 4)
    assert key not in off.work_lists  # no Hopper GPU here: nothing to build it for
    monkeypatch.setattr(mosaic_gpu_shrink, "available", lambda: True)
    short = make_lora_mapping(jnp.zeros(work_list.SEGMENT_MIN_TOKENS - 8, jnp.int32), 4)
    assert key not in short.work_lists
    long = jax.jit(make_lora_mapping, static_argnums=1)(
        jnp.zeros(work_list.SEGMENT_MIN_TOKENS, jnp.int32), 4
    )
    seg = long.work_lists[key]
    assert int(jnp.sum(seg.items[3])) == work_list.SEGMENT_MIN_TOKENS  # one run: all
    assert set(seg.rest) == set(work_list.SEGMENT_REST_BLOCK_MS)
    # the mapping, segments and all, is a pytree that passes through jit
    live = jax.jit(lambda m: m.work_lists[key].rest[64][3, 0])(long)
    assert int(live) == 0  # every token is in a piece: no mapped Triton blocks


@pytest.mark.parametrize(
    "num_pieces,num_slices,job_steps,split,programs",
    [
        (128, 1, 64, 1, 132),  # one adapter, 16384 tokens: one whole job per program
        (136, 1, 64, 1, 132),  # prompt boundaries: past one job per program (stream-K)
        (32, 1, 64, 4, 132),  # 4096 tokens, split 4: quarter jobs, as before
        (39, 1, 64, 4, 132),  # ... and prompt boundaries past the programs
        (8, 3, 16, 16, 132),  # 3 slices, splits as short as a step
        (40, 3, 64, 1, 5),  # few programs, many jobs each
        (0, 2, 64, 2, 132),  # no pieces: nothing to do
        (1, 1, 8, 1, 132),
    ],
)
def test_stream_k_runs_cover_every_step_once(num_pieces, num_slices, job_steps, split, programs):
    """The persistent grid's schedule (vs a count of every (job, k step)): each step is
    one program's, ``whole`` exactly where one run covers a job, runs of equal length,
    and while the work fits the programs each run is one job's 1 / split share."""
    unit = job_steps // split
    covered = np.zeros((num_pieces * num_slices, job_steps), np.int32)
    whole = np.zeros(num_pieces * num_slices, np.int32)
    lengths = []
    rng_of = jax.jit(
        jax.vmap(
            lambda p: mosaic_gpu_shrink.stream_k_range(
                p,
                jnp.int32(num_pieces),
                num_slices=num_slices,
                job_steps=job_steps,
                unit_steps=unit,
                programs=programs,
            )
        )
    )
    starts, ends, firsts, counts = map(np.asarray, rng_of(jnp.arange(programs, dtype=jnp.int32)))
    for start, end, first, count in zip(starts, ends, firsts, counts):
        lengths.append(int(end - start))
        for i in range(int(count)):
            job, k0, steps, is_whole = (
                int(v)
                for v in mosaic_gpu_shrink.stream_k_segment(
                    i, start, end, first, job_steps=job_steps
                )
            )
            assert steps > 0 and 0 <= k0 and k0 + steps <= job_steps
            covered[job, k0 : k0 + steps] += 1
            whole[job] += is_whole
            if num_pieces * num_slices * job_steps <= programs * unit:
                assert steps == unit and k0 % unit == 0  # the split's share, aligned
    assert (covered == 1).all()
    for job in range(num_pieces * num_slices):  # whole iff no other run touches the job
        runs = sum(
            1 for s, e in zip(starts, ends) if s < (job + 1) * job_steps and e > job * job_steps
        )
        assert whole[job] == (runs == 1)
    busy = [n for n in lengths if n]
    assert len(set(busy[:-1])) <= 1 and all(n <= busy[0] for n in busy)  # equal, but the last


def test_forced_mosaic_names_what_it_cannot_run():
    meta = make_metadata(np.zeros(2048, np.int32), 2)
    x = jnp.zeros((2048, 512), jnp.float32)
    a = jnp.zeros((2, 64, 512), jnp.float32)
    with pytest.raises(ValueError, match="mosaic=True.*bfloat16 or float16"):
        lora_shrink(x, (a,), **meta, mosaic=True)
    xb, ab = x.astype(jnp.bfloat16), jnp.zeros((2, 16, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="rank=16 is not a multiple of 32"):
        lora_shrink(xb, (ab,), **meta, mosaic=True)
    with pytest.raises(ValueError, match="interpret mode"):
        lora_shrink(xb, (a.astype(jnp.bfloat16),), **meta, mosaic=True, interpret=True)
    with pytest.raises(ValueError, match="block_m"):
        mosaic_gpu_shrink.MosaicTiles(block_m=96)


def test_default_is_triton_only_off_hopper():
    # CPU: no Hopper GPU, so the default never picks the Mosaic kernel
    assert not mosaic_gpu_shrink.available()
    meta = make_metadata(np.zeros(2048, np.int32), 2)
    x = jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((2, 64, 512), jnp.bfloat16)
    text = jax.jit(lambda x, a: lora_shrink(x, (a,), **meta, interpret=True)).lower(x, a)
    assert "mosaic" not in text.as_text()


@pytest.mark.parametrize(
    "num_tokens,hidden,rank,slices,ranked",
    [(2048, 4096, 128, 1, False), (4104, 4096, 64, 3, True), (1024, 512, 32, 2, False)],
)
def test_segment_shrink_lowers_for_cuda(num_tokens, hidden, rank, slices, ranked):
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    max_loras = 8
    idx = np.repeat(np.arange(max_loras), -(-num_tokens // max_loras))[:num_tokens]
    meta = make_metadata(idx, max_loras)
    sds = jax.ShapeDtypeStruct
    x = sds((num_tokens, hidden), jnp.bfloat16)
    lora_a = (sds((max_loras, rank, hidden), jnp.bfloat16),) * slices
    ranks = jnp.full((slices, max_loras), rank // 2, jnp.int32) if ranked else None

    def f(x, lora_a):
        return lora_shrink(x, lora_a, **meta, slot_ranks=ranks, mosaic=True)

    with abstract_gpu_context():
        text = jax.jit(f).trace(x, lora_a).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text  # the segment kernel
    assert "triton" in text  # the Triton kernel for the other tokens


@pytest.mark.parametrize(
    "rank,slices,ranked,compute_wgs", [(64, 1, False, 1), (128, 3, True, 1), (128, 1, True, 2)]
)
def test_warp_specialized_segment_shrink_lowers_for_cuda(rank, slices, ranked, compute_wgs):
    """The warp-specialized form (a copy warpgroup, one or two WGMMA ones) lowers, with its
    default tiles; on the GPU `test_few_programs_walk_many_jobs` checks its numbers."""
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    num_tokens, hidden, max_loras = 4096, 4096, 8
    idx = np.repeat(np.arange(max_loras), num_tokens // max_loras)
    items, _ = work_list.segment_items(jnp.asarray(idx), block_m=128, max_pieces=4)
    tiles = mosaic_gpu_shrink.default_tiles(rank, warp_specialized=True)
    tiles = dataclasses.replace(tiles, compute_wgs=compute_wgs)
    assert mosaic_gpu_shrink.smem_bytes(tiles, rank) <= mosaic_gpu_shrink.SMEM_BUDGET
    sds = jax.ShapeDtypeStruct
    x = sds((num_tokens, hidden), jnp.bfloat16)
    lora_a = (sds((max_loras, rank, hidden), jnp.bfloat16),) * slices
    ranks = jnp.full((slices, max_loras), rank // 2, jnp.int32) if ranked else None

    def f(x, lora_a):
        out = jnp.zeros((slices, num_tokens, rank), jnp.float32)
        return mosaic_gpu_shrink.shrink(x, lora_a, items, out, ranks, scale=0.5, tiles=tiles)

    with abstract_gpu_context():
        text = jax.jit(f).trace(x, lora_a).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize(
    "kw",
    [
        dict(compute_wgs=3),
        dict(compute_wgs=2),
        dict(compute_wgs=2, warp_specialized=True, block_m=64),
    ],
)
def test_mosaic_tiles_name_what_two_mma_warpgroups_need(kw):
    with pytest.raises(ValueError, match="compute_wgs"):
        mosaic_gpu_shrink.MosaicTiles(**kw)


def _check(num_tokens, hidden, rank, slices, dtype, layout, ranked, seed=0, host=False):
    """The split shrink (forced) against the oracle; ``host``: told what the host finds
    (`work_list.prompt_tiles`), so "all" runs the Mosaic kernel alone."""
    rng = np.random.default_rng(seed)
    max_loras = 16
    if layout == "one":
        idx = np.full(num_tokens, 3, np.int32)
    elif layout == "padded":  # one adapter's prompts with unmapped gaps: every tile a prompt's
        idx = np.full(num_tokens, 3, np.int32)
        idx[1000:1100] = idx[-300:] = -1
    elif layout == "runs":
        idx = _runs(rng, num_tokens, max_loras, 700)
    else:  # shuffled: no pieces, the Triton kernel takes every token
        idx = rng.integers(-1, max_loras, num_tokens).astype(np.int32)
    meta = make_metadata(idx, max_loras)
    k = jax.random.key(seed)
    x = jax.random.normal(k, (num_tokens, hidden), dtype)
    lora_a = tuple(
        (jax.random.normal(jax.random.fold_in(k, s + 1), (max_loras, rank, hidden)) * 0.05).astype(
            dtype
        )
        for s in range(slices)
    )
    ranks = (
        jnp.asarray(rng.integers(1, rank + 1, (slices, max_loras)), jnp.int32) if ranked else None
    )
    tiles = work_list.prompt_tiles(idx) if host else None
    assert not host or layout != "padded" or tiles == "all"
    got = lora_shrink(
        x, lora_a, **meta, slot_ranks=ranks, scale=0.5, mosaic=True, prompt_tiles=tiles
    )
    want = lora_shrink_reference(
        x, lora_a, token_lora_indices=meta["token_lora_indices"], slot_ranks=ranks, scale=0.5
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_tokens,hidden,rank,slices,dtype,layout,ranked",
    [
        (2048, 4096, 128, 1, jnp.bfloat16, "one", False),
        (4096, 4096, 64, 2, jnp.bfloat16, "padded", True),  # "all": the Mosaic kernel alone
        (4096, 4096, 64, 1, jnp.bfloat16, "runs", False),
        (4104, 4096, 64, 3, jnp.bfloat16, "runs", True),  # a partial last tile, 3 slices
        (2048, 2048, 96, 2, jnp.float16, "runs", True),
        (1024, 4096, 32, 1, jnp.bfloat16, "shuffled", False),
        (16384, 4096, 128, 1, jnp.bfloat16, "runs", False),  # split hidden: TMA reduce-add
    ],
    ids=str,
)
@pytest.mark.parametrize("host", [False, True], ids=["unknown", "host"])
def test_segment_shrink_matches_reference(
    num_tokens, hidden, rank, slices, dtype, layout, ranked, host
):
    if not mosaic_gpu_shrink.available():
        pytest.skip("needs a Hopper GPU (Mosaic GPU WGMMA)")
    _check(num_tokens, hidden, rank, slices, dtype, layout, ranked, host=host)


@pytest.mark.parametrize(
    "num_tokens,rank,want",
    [
        (2048, 64, True),
        (4096, 128, True),
        (16384, 128, True),
        (512, 64, False),
        (8192, 64, False),
        (2048, 16, False),
        (2046, 64, False),  # tokens not whole 8-row TMA tiles (failed to lower): Triton
        (4100, 128, False),
    ],
)
def test_default_picks_the_segment_shrink_where_measured(monkeypatch, num_tokens, rank, want):
    """On a Hopper GPU (faked here) the default takes the Mosaic kernel at 1024-4096 tokens
    with a rank that is a multiple of 32 (at rank 128 from 1024 tokens on), the Triton
    kernel alone elsewhere."""
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    monkeypatch.setattr(mosaic_gpu_shrink, "available", lambda: True)
    meta = make_metadata(np.zeros(num_tokens, np.int32), 2)
    x = jax.ShapeDtypeStruct((num_tokens, 1024), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((2, rank, 1024), jnp.bfloat16)
    with abstract_gpu_context():
        lowered = jax.jit(lambda x, a: lora_shrink(x, (a,), **meta)).trace(x, a)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert ("mosaic_gpu" in text) == want


def test_rest_tokens_keep_the_ready_made_schedule(monkeypatch):
    """Beside the Mosaic kernel (a faked Hopper GPU), the default Triton tiles for the
    other tokens have block rows that the step's ready-made schedule lists
    (`SEGMENT_REST_BLOCK_MS`), so the call builds no schedule of its own; at 16384 tokens,
    rank 128 the Triton-only default is a 128-row tile (session 32: one adapter's 16384
    tokens rebuilt the schedule in the call, 43.2 -> 80.5 us)."""
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    from lora_jax.kernels import BlockSizes
    from lora_jax.kernels.shrink_expand import pallas_triton, pallas_triton_shrink, routing

    num_tokens, hidden, rank = 16384, 512, 128
    monkeypatch.setattr(mosaic_gpu_shrink, "available", lambda: True)
    monkeypatch.setenv("LORA_JAX_TRITON_SMEM_BUDGET", str(200 * 1024))
    pallas_triton.opt_in_smem_budget.cache_clear()
    seen, built = [], []
    triton_shrink, build = pallas_triton_shrink.shrink, routing.build_segments

    def spy_shrink(*args, bs, **kw):
        seen.append(bs)
        return triton_shrink(*args, bs=bs, **kw)

    def spy_build(*args, **kw):
        built.append(kw)
        return build(*args, **kw)

    monkeypatch.setattr(pallas_triton_shrink, "shrink", spy_shrink)
    monkeypatch.setattr(routing, "build_segments", spy_build)
    try:
        whole = BlockSizes.get_default("shrink", num_tokens=num_tokens, hidden=hidden, rank=rank)
        assert whole.block_m not in work_list.SEGMENT_REST_BLOCK_MS  # the Triton-only tiles
        idx = np.repeat(np.arange(4), num_tokens // 8)[: num_tokens // 2]
        idx = np.concatenate([idx, np.arange(num_tokens // 2) % 3])  # prompts, then mixed
        mapping = make_lora_mapping(jnp.asarray(idx, jnp.int32), 4)
        assert work_list.SEGMENTS_KEY in mapping.work_lists
        sds = jax.ShapeDtypeStruct
        x = sds((num_tokens, hidden), jnp.bfloat16)
        a = sds((4, rank, hidden), jnp.bfloat16)

        def f(x, a):
            return lora_shrink(x, (a,), **mapping.shrink_kwargs())

        with abstract_gpu_context():
            text = jax.jit(f).trace(x, a).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        pallas_triton.opt_in_smem_budget.cache_clear()
    assert "mosaic_gpu" in text and "triton" in text
    assert len(seen) == 1 and seen[0].block_m in work_list.SEGMENT_REST_BLOCK_MS, seen
    assert seen[0].block_r == 64 and seen[0].rank_inner  # the side-by-side rank blocks
    assert not built  # the mapping's own schedule served the call


@pytest.mark.parametrize("rank", [32, 64, 96, 128])
@pytest.mark.parametrize("block_m", [64, 128])
def test_default_tiles_fill_shared_memory_but_not_past_it(rank, block_m):
    """The default pipeline depth: its shared memory (the TMA buffers of x and A, or the f32
    output tile in the scope after theirs) within the budget, and one more stage would not
    be (or it is the most)."""
    tiles = mosaic_gpu_shrink.default_tiles(rank, block_m)

    def smem(stages):
        return max(stages * (block_m + rank) * tiles.block_k * 2, block_m * rank * 4)

    assert tiles.block_m == block_m and 4 <= tiles.stages <= mosaic_gpu_shrink.MAX_STAGES
    assert smem(tiles.stages) <= mosaic_gpu_shrink.SMEM_BUDGET or tiles.stages == 4
    more = tiles.stages + 1
    assert more > mosaic_gpu_shrink.MAX_STAGES or smem(more) > mosaic_gpu_shrink.SMEM_BUDGET
    if (block_m, rank) == (128, 64):
        assert tiles.stages == 6  # the session-12 measurement
    if (block_m, rank) == (128, 128):
        assert tiles.stages == 6  # 192 KiB of buffers, then a 64 KiB tile (sessions 38-39)
    if block_m == 64:
        assert tiles.stages == 6  # 176 KiB at rank 128 (session 13's default up to 4096 tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("programs,split", [(5, 0), (3, 2), (64, 1)], ids=str)
@pytest.mark.parametrize("ws", [0, 1, 2], ids=["one_wg", "ws", "ws_two_mma_wgs"])
def test_few_programs_walk_many_jobs(programs, split, ws):
    """A persistent grid much smaller than the work: each program's run of k steps crosses
    several jobs (pieces x slices), whole ones stored, parts added."""
    if not mosaic_gpu_shrink.available():
        pytest.skip("needs a Hopper GPU (Mosaic GPU WGMMA)")
    rng = np.random.default_rng(programs)
    max_loras, num_tokens, hidden, rank = 8, 1152, 1024, 64
    idx = _runs(rng, num_tokens, max_loras, 300)
    k = jax.random.key(programs)
    x = jax.random.normal(k, (num_tokens, hidden), jnp.bfloat16)
    lora_a = tuple(
        (jax.random.normal(jax.random.fold_in(k, s), (max_loras, rank, hidden)) * 0.05).astype(
            jnp.bfloat16
        )
        for s in (1, 2)
    )
    items, mine = work_list.segment_items(jnp.asarray(idx), block_m=128, max_pieces=4)
    tiles = mosaic_gpu_shrink.MosaicTiles(
        programs=programs, split_k=split, warp_specialized=ws > 0, compute_wgs=max(ws, 1)
    )
    zeros = jnp.zeros((2, num_tokens, rank), jnp.float32)
    got = mosaic_gpu_shrink.shrink(x, lora_a, items, zeros, None, scale=0.5, tiles=tiles)
    ref = lora_shrink_reference(x, lora_a, token_lora_indices=jnp.asarray(idx), scale=0.5)
    want = jnp.where(mine[None, :, None], ref, 0.0)  # rows outside the pieces untouched
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
