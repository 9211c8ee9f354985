"""The Mosaic GPU kernels run on the CPU under Pallas's GPU interpreter (jax >= 0.11), against
the jnp oracles: numbers on CI, where tests/kernels/test_*_mosaic_gpu.py only lower them.

The interpreter simulates shared memory, TMA copies, barriers and WGMMA. Two limits shape
these cases:

* it refuses predicated TMA stores, and `emit_pipeline` predicates its output copies; the
  `interpreter` fixture evaluates the predicate on the host and skips a store whose
  predicate is false, as the hardware does;
* it has no TMA reduce-add, and its WGMMA reads the left operand from shared memory only.
  So the shrink runs with one program per job (no program adds into another's rows), and
  the expand with h's tile copied to shared memory (``h_in="smem"``: the rest of the
  kernel is the default's).

The library's split (`lora_shrink` / `lora_expand` with ``mosaic=True``: the Triton kernel
on the other tokens, then the Mosaic kernel) runs the same way in interpret mode once
`routing.MOSAIC_INTERPRET` holds the interpreter's params.

The GPU runs of the same kernels (compiled, default tiles) are in test_expand_mosaic_gpu.py
and test_shrink_mosaic_gpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shrink_expand_test_base import make_metadata

from lora_jax.kernels import lora_expand, lora_shrink
from lora_jax.kernels.shrink_expand import mosaic_gpu_expand as me
from lora_jax.kernels.shrink_expand import mosaic_gpu_shrink as ms
from lora_jax.kernels.shrink_expand import routing
from lora_jax.kernels.shrink_expand.reference import (
    lora_expand_reference,
    lora_shrink_reference,
)
from lora_jax.kernels.shrink_expand.work_list import (
    SEGMENT_MIN_TOKENS,
    prompt_tiles,
    segment_items,
    tile_items,
    whole_tiles,
)


@pytest.fixture
def interpreter(monkeypatch):
    """``plgpu.InterpretGPUParams()`` with predicated stores honoured (see the module doc)."""
    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    params = getattr(plgpu, "InterpretGPUParams", None)
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError:
        gpu_callbacks = None
    if params is None or not hasattr(gpu_callbacks, "copy_smem_to_gmem"):
        pytest.skip(f"jax {jax.__version__} has no Mosaic GPU interpreter")
    store = gpu_callbacks.copy_smem_to_gmem

    def predicated_store(*, predicate=None, token=None, **kw):
        if predicate is not None and not bool(np.asarray(predicate)):
            return token  # the hardware issues no copy
        return store(predicate=None, token=token, **kw)

    monkeypatch.setattr(gpu_callbacks, "copy_smem_to_gmem", predicated_store)
    yield params()
    reset = getattr(plgpu, "reset_gpu_interpret_mode_state", None)
    if reset is not None:
        reset()


def _layout(name: str, num_tokens: int, rng) -> np.ndarray:
    if name == "one":
        return np.full(num_tokens, 2, np.int32)
    if name == "prompts":  # runs of 3 slots, unmapped tokens between, partial tiles
        idx = np.concatenate([np.full(100, 5), np.full(28, -1), np.full(190, 1)])
        return np.resize(np.concatenate([idx, np.full(num_tokens, 3)]), num_tokens).astype(np.int32)
    return rng.integers(-1, 6, num_tokens).astype(np.int32)  # shuffled: no whole tiles


@pytest.mark.parametrize(
    "num_tokens,widths,rank,layout,ranked,block_n,item_rows,programs",
    [
        (256, (256,), 16, "one", False, 128, 64, 3),  # runs that straddle tiles
        (384, (128, 256, 128), 32, "prompts", True, 128, 64, 5),  # QKV-like, true ranks
        (512, (256, 256), 64, "prompts", False, 64, 128, 4),  # 64-row tiles in 128-row items
        (256, (128,), 16, "shuffled", False, 128, 64, 2),  # nothing listed: y as it was
    ],
    ids=str,
)
def test_mosaic_expand_matches_reference_interpreted(
    interpreter, num_tokens, widths, rank, layout, ranked, block_n, item_rows, programs
):
    rng = np.random.default_rng(num_tokens + rank)
    max_loras = 8
    idx = _layout(layout, num_tokens, rng)
    k = jax.random.key(rank)
    y = jax.random.normal(k, (num_tokens, sum(widths)), jnp.bfloat16)
    h = jax.random.normal(jax.random.fold_in(k, 1), (len(widths), num_tokens, rank), jnp.float32)
    lora_b = tuple(
        (jax.random.normal(jax.random.fold_in(k, 2 + s), (max_loras, n, rank)) * 0.2).astype(
            jnp.bfloat16
        )
        for s, n in enumerate(widths)
    )
    offsets = tuple(int(o) for o in np.cumsum((0,) + widths[:-1]))
    ranks = (
        jnp.asarray(rng.integers(1, rank + 1, (len(widths), max_loras)), jnp.int32)
        if ranked
        else None
    )
    tiles = me.ExpandTiles(block_m=64, block_n=block_n, stages=2, programs=programs, h_in="smem")
    items, mine = tile_items(jnp.asarray(idx), block_m=item_rows)
    got = me.expand(
        y,
        h,
        lora_b,
        items,
        ranks,
        offsets=offsets,
        tiles=tiles,
        item_rows=item_rows,
        interpret=interpreter,
    )
    # The kernel's share only: tokens outside the listed tiles keep y's value.
    share = jnp.where(mine, jnp.asarray(idx), -1)
    want = lora_expand_reference(
        y, h, lora_b, offsets=offsets, token_lora_indices=share, slot_ranks=ranks
    )
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
    )
    if layout == "shuffled":
        assert not bool(jnp.any(mine)) and bool(jnp.all(got == y))
    else:
        assert bool(jnp.any(mine)) and not bool(jnp.all(got == y))


@pytest.mark.parametrize(
    "num_tokens,hidden,rank,slices,layout,ranked",
    [
        (256, 256, 32, 1, "one", False),
        (320, 128, 64, 2, "prompts", True),  # pieces where prompts meet, a partial last tile
    ],
    ids=str,
)
@pytest.mark.parametrize(
    "ws,compute_wgs", [(False, 1), (True, 1), (True, 2)], ids=["one_wg", "ws", "ws_two_mma_wgs"]
)
def test_segment_shrink_matches_reference_interpreted(
    interpreter, num_tokens, hidden, rank, slices, layout, ranked, ws, compute_wgs
):
    rng = np.random.default_rng(num_tokens + rank)
    max_loras = 8
    idx = _layout(layout, num_tokens, rng)
    k = jax.random.key(rank)
    x = jax.random.normal(k, (num_tokens, hidden), jnp.bfloat16)
    lora_a = tuple(
        (jax.random.normal(jax.random.fold_in(k, 1 + s), (max_loras, rank, hidden)) * 0.1).astype(
            jnp.bfloat16
        )
        for s in range(slices)
    )
    ranks = (
        jnp.asarray(rng.integers(1, rank + 1, (slices, max_loras)), jnp.int32) if ranked else None
    )
    # two WGMMA warpgroups: each a 64-row half of 128-row tiles (pieces cross the halves)
    block_m = 64 * compute_wgs
    items, mine = segment_items(jnp.asarray(idx), block_m=block_m, max_pieces=4)
    # One program per (piece, slice) job and no hidden split: every job is stored whole.
    tiles = ms.MosaicTiles(
        block_m=block_m,
        block_k=64,
        stages=2,
        split_k=1,
        programs=items.shape[1] * slices,
        warp_specialized=ws,
        compute_wgs=compute_wgs,
    )
    out = jnp.zeros((slices, num_tokens, rank), jnp.float32)
    got = ms.shrink(x, lora_a, items, out, ranks, scale=0.5, tiles=tiles, interpret=interpreter)
    share = jnp.where(mine, jnp.asarray(idx), -1)
    want = lora_shrink_reference(x, lora_a, token_lora_indices=share, slot_ranks=ranks, scale=0.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    assert bool(jnp.any(got != 0))


@pytest.mark.parametrize("hint", [False, True], ids=["host_silent", "host_hint"])
def test_library_split_matches_reference_interpreted(interpreter, monkeypatch, hint):
    """`lora_shrink` / `lora_expand` with ``mosaic=True`` in interpret mode: the Triton
    kernel (interpret mode) on the tokens outside the Mosaic kernels' pieces and tiles,
    the Mosaic kernels (the GPU interpreter) on theirs — the library's split on Hopper,
    end to end, against the oracles; with the host's hints where it knows them."""
    monkeypatch.setattr(routing, "MOSAIC_INTERPRET", interpreter)
    jax.clear_caches()  # the module setting is read at trace time
    num_tokens, hidden, rank, widths = SEGMENT_MIN_TOKENS, 128, 32, (128, 128)
    rng = np.random.default_rng(7)
    idx = np.concatenate(
        [np.full(300, 4), np.full(40, -1), np.full(200, 1), rng.integers(-1, 8, 100)]
    )
    idx = np.resize(np.concatenate([idx, np.full(num_tokens, 6)]), num_tokens).astype(np.int32)
    meta = make_metadata(idx, 8)
    k = jax.random.key(3)
    x = jax.random.normal(k, (num_tokens, hidden), jnp.bfloat16)
    lora_a = tuple(
        (jax.random.normal(jax.random.fold_in(k, 1 + s), (8, rank, hidden)) * 0.1).astype(
            jnp.bfloat16
        )
        for s in range(len(widths))
    )
    lora_b = tuple(
        (jax.random.normal(jax.random.fold_in(k, 5 + s), (8, n, rank)) * 0.2).astype(jnp.bfloat16)
        for s, n in enumerate(widths)
    )
    ranks = jnp.asarray(rng.integers(1, rank + 1, (len(widths), 8)), jnp.int32)
    shrink_hint = prompt_tiles(idx) if hint else None
    expand_hint = whole_tiles(idx) if hint else None
    assert not hint or (shrink_hint, expand_hint) == ("some", "some")
    h = lora_shrink(
        x, lora_a, **meta, slot_ranks=ranks, scale=0.5, mosaic=True, prompt_tiles=shrink_hint,
        interpret=True,
    )  # fmt: skip
    want_h = lora_shrink_reference(
        x, lora_a, token_lora_indices=meta["token_lora_indices"], slot_ranks=ranks, scale=0.5
    )
    np.testing.assert_allclose(np.asarray(h), np.asarray(want_h), rtol=1e-4, atol=1e-4)
    y = jax.random.normal(jax.random.fold_in(k, 9), (num_tokens, sum(widths)), jnp.bfloat16)
    got = lora_expand(
        y, want_h, lora_b, offsets=(0, 128), **meta, slot_ranks=ranks, mosaic=True,
        prompt_tiles=expand_hint, interpret=True,
    )  # fmt: skip
    want = lora_expand_reference(
        y, want_h, lora_b, offsets=(0, 128), token_lora_indices=meta["token_lora_indices"],
        slot_ranks=ranks,
    )  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
    )
    jax.clear_caches()


def test_interpret_mode_without_the_interpreter_names_why():
    """Interpret mode with ``mosaic=True`` and no interpreter set: an error that says so."""
    idx = np.full(SEGMENT_MIN_TOKENS, 2, np.int32)
    x = jnp.zeros((SEGMENT_MIN_TOKENS, 128), jnp.bfloat16)
    a = jnp.zeros((4, 32, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="mosaic=True, but interpret mode"):
        lora_shrink(x, (a,), **make_metadata(idx, 4), mosaic=True, interpret=True)
