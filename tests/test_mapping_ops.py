"""`make_lora_mapping` metadata and the XLA ops against numpy loops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lora_jax as lj
from lora_jax import ops


@pytest.mark.parametrize("build", ["jit", "eager"])
@pytest.mark.parametrize(
    "idx",
    [[-1, -1, -1], [2, 2, 2, 2], [3, 1, -1, 1, 0, 7, 3], [0, 1, 2, 3], [5]],
)
def test_mapping_metadata(idx, build):
    """Inside a jit, and eagerly from host indices (one jitted call for the arrays, the
    prompt tiles found with numpy): the same arrays, and both match numpy."""
    L = 4
    m = jax.jit(lj.make_lora_mapping, static_argnums=1)(jnp.asarray(idx, jnp.int32), L)
    if build == "eager":
        jitted, m = m, lj.make_lora_mapping(np.asarray(idx, np.int32), L)
        for got, want in zip(jax.tree.leaves(m), jax.tree.leaves(jitted), strict=True):
            np.testing.assert_array_equal(got, want)
    clean = np.array([i if 0 <= i < L else -1 for i in idx])
    np.testing.assert_array_equal(m.token_lora_indices, clean)
    key = np.where(clean < 0, L, clean)
    np.testing.assert_array_equal(m.sorted_token_ids, np.argsort(key, kind="stable"))
    counts = np.array([(clean == s).sum() for s in range(L)])
    np.testing.assert_array_equal(m.slot_token_counts, counts)
    np.testing.assert_array_equal(m.slot_token_starts, np.cumsum(counts) - counts)
    active = [s for s in range(L) if counts[s]]
    np.testing.assert_array_equal(m.active_slots, active + [-1] * (L - len(active)))
    assert int(m.num_active) == len(active)


def test_64_bit_ids_out_of_range_never_wrap_into_a_slot():
    """With x64 on, ids past int32 (2**32 + 1 would wrap to slot 1) are -1 on every
    path: host numpy, a device array eagerly, and inside a jit."""
    idx = np.array([2**32 + 1, -1, 0, 2**31 + 1, 2**33 + 3], np.int64)
    with jax.enable_x64(True):
        paths = {
            "host": lj.make_lora_mapping(idx, 4).token_lora_indices,
            "device": lj.make_lora_mapping(jnp.asarray(idx), 4).token_lora_indices,
            "jit": jax.jit(lambda i: lj.make_lora_mapping(i, 4).token_lora_indices)(
                jnp.asarray(idx)
            ),
        }
    for path, got in paths.items():
        np.testing.assert_array_equal(np.asarray(got), [-1, -1, 0, -1, -1], err_msg=path)


def _oracle(x, a_slices, b_slices, idx, scale, y, offsets):
    y = np.array(y, np.float64)
    for t, i in enumerate(idx):
        if i < 0:
            continue
        for a, b, off in zip(a_slices, b_slices, offsets):
            h = scale * (np.asarray(x[t], np.float64) @ np.asarray(a[i], np.float64).T)
            y[t, off : off + b.shape[1]] += h @ np.asarray(b[i], np.float64).T
    return y


@pytest.mark.parametrize("L", [3, 16], ids=["one_hot_path", "gather_path"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_add_lora_linear_xla_matches_loop(dtype, L):
    rng = np.random.default_rng(0)
    T, H, R = 9, 24, 8
    sizes = [16, 8, 8]
    offsets = [4, 20, 28]  # not contiguous from 0: vLLM's offset_start
    a = [jnp.asarray(rng.normal(size=(L, R, H)), dtype) for _ in sizes]
    b = [jnp.asarray(rng.normal(size=(L, n, R)), dtype) for n in sizes]
    x = jnp.asarray(rng.normal(size=(T, H)), dtype)
    y0 = jnp.asarray(rng.normal(size=(T, 40)), dtype)
    idx = np.array([2, -1, 0, 0, 1, -1, 2, 1, 0], np.int32)
    m = lj.make_lora_mapping(jnp.asarray(idx), L)
    y = ops.add_lora_linear(y0, x, a, b, m, 0.5, offsets=offsets, backend="xla")
    ref = _oracle(
        np.asarray(x, np.float32),
        [np.asarray(v, np.float32) for v in a],
        [np.asarray(v, np.float32) for v in b],
        idx,
        0.5,
        np.asarray(y0, np.float32),
        offsets,
    )
    tol = 1e-4 if dtype == jnp.float32 else 5e-2
    np.testing.assert_allclose(
        np.asarray(y, np.float32), ref, rtol=tol, atol=tol * np.abs(ref).max()
    )
    # -1 rows bit-identical.
    np.testing.assert_array_equal(np.asarray(y)[idx < 0], np.asarray(y0)[idx < 0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_xla_expand_rounds_the_same_on_both_paths(monkeypatch, dtype):
    """The XLA expand's gather (few tokens a slot) and one-hot (many) paths both round h
    to B's dtype, as the kernels do: a token's result does not depend on the batch size
    beyond f32 summation order."""
    rng = np.random.default_rng(2)
    T, R, L = 12, 16, 4
    b = [jnp.asarray(rng.normal(size=(L, 24, R)), dtype)]
    h = jnp.asarray(rng.normal(size=(1, T, R)), jnp.float32)
    y0 = jnp.asarray(rng.normal(size=(T, 24)), jnp.float32)
    m = lj.make_lora_mapping(jnp.asarray(rng.integers(-1, L, T).astype(np.int32)), L)
    outs = []
    for rule in (float("inf"), 0.0):  # gather, then one-hot
        monkeypatch.setattr(ops, "ONE_HOT_TOKENS_PER_SLOT", rule)
        outs.append(np.asarray(ops.lora_expand(y0, h, b, m, backend="xla")))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-5)


def test_shrink_rows_without_adapter_are_zero():
    m = lj.make_lora_mapping(jnp.array([-1, 0], jnp.int32), 1)
    h = ops.lora_shrink(jnp.ones((2, 4)), [jnp.ones((1, 2, 4))], m, 0.5, backend="xla")
    assert h.dtype == jnp.float32 and h.shape == (1, 2, 2)
    np.testing.assert_array_equal(h[0, 0], 0.0)
    np.testing.assert_allclose(h[0, 1], 2.0)


def test_gpu_default_backend_by_tokens_and_host_hint(monkeypatch):
    """On a GPU the ops default to the kernels from PALLAS_MIN_TOKENS tokens, or from
    PALLAS_MIN_TOKENS_HINTED where the mapping carries the host's tokens-per-slot hint."""
    monkeypatch.setattr(ops, "_default_backend", None)
    monkeypatch.setattr(ops.jax, "default_backend", lambda: "gpu")
    lo, hi = ops.PALLAS_MIN_TOKENS_HINTED, ops.PALLAS_MIN_TOKENS
    assert lo < hi
    assert ops.resolve_backend(None, lo, hinted=True) == "pallas"
    assert ops.resolve_backend(None, lo - 1, hinted=True) == "xla"
    assert ops.resolve_backend(None, lo, hinted=False) == "xla"
    assert ops.resolve_backend(None, hi) == "pallas"
    assert ops.resolve_backend("xla", hi, hinted=True) == "xla"
    hinted = lj.make_lora_mapping(np.zeros(lo, np.int32), 4)  # numpy indices: hint found
    assert hinted.tokens_per_slot is not None and ops._hinted(hinted, 16)
    assert not ops._hinted(lj.make_lora_mapping(jnp.zeros(lo, jnp.int32), 4), 16)


def test_gpu_default_keeps_xla_for_a_token_an_adapter_from_rank_64(monkeypatch):
    """With the hint that every mapped token has an adapter of its own, the GPU default
    below PALLAS_MIN_TOKENS stays XLA from PER_TOKEN_XLA_MIN_RANK (the per-token kernels
    below it, and every other hint's kernels at any rank)."""
    monkeypatch.setattr(ops, "_default_backend", None)
    monkeypatch.setattr(ops.jax, "default_backend", lambda: "gpu")
    picked = []
    monkeypatch.setattr(
        ops, "_kernels", lambda: type("K", (), {"lora_shrink": lambda *a, **k: picked.append(1)})
    )
    rank_hi = ops.PER_TOKEN_XLA_MIN_RANK
    t = ops.PALLAS_MIN_TOKENS_HINTED
    own = lj.make_lora_mapping(np.arange(t, dtype=np.int32), t)  # a slot per token
    shared = lj.make_lora_mapping(np.arange(t, dtype=np.int32) % 2, t)  # 8 tokens a slot
    assert own.tokens_per_slot == 1 and shared.tokens_per_slot not in (None, 1)
    assert ops._hinted(own, rank_hi // 2) and not ops._hinted(own, rank_hi)
    assert ops._hinted(shared, rank_hi) and ops._hinted(shared, 2 * rank_hi)
    x = jnp.ones((t, 8))
    for mapping, rank, kernels in ((own, rank_hi, False), (own, 16, True), (shared, rank_hi, True)):
        picked.clear()
        out = ops.lora_shrink(x, [jnp.ones((t, rank, 8))], mapping)
        assert bool(picked) == kernels, (mapping.tokens_per_slot, rank)
        if not kernels:  # XLA's gather einsum ran: every row is 8.0
            np.testing.assert_allclose(out, np.full((1, t, rank), 8.0))
    # at PALLAS_MIN_TOKENS the kernels run, hint or not
    big = ops.PALLAS_MIN_TOKENS
    own_big = lj.make_lora_mapping(np.arange(big, dtype=np.int32), big)
    picked.clear()
    ops.lora_shrink(jnp.ones((big, 8)), [jnp.ones((big, rank_hi, 8))], own_big)
    assert picked


def test_backend_selection():
    assert ops.resolve_backend("xla") == "xla"
    with pytest.raises(ValueError, match="backend"):
        ops.resolve_backend("cuda")
    with pytest.raises(ValueError, match="backend"):
        ops.set_default_backend("triton")
    if jax.default_backend() != "gpu":
        assert ops.resolve_backend() == "xla"


def test_is_prefill_is_static_and_checked():
    """`is_prefill` rides in the mapping as static metadata (no array leaf; a new value is
    a new trace) and only True, False or None is accepted."""
    idx = jnp.array([1, -1, 0, 1], jnp.int32)
    traces = []

    @jax.jit
    def f(m):
        traces.append(m.is_prefill)
        return m.num_active

    for flag in (None, False, False, True):
        m = lj.make_lora_mapping(idx, 2, is_prefill=flag)
        assert m.is_prefill is flag and int(f(m)) == 2
    assert traces == [None, False, True]
    leaves = jax.tree.leaves(lj.make_lora_mapping(idx, 2, is_prefill=False))
    assert all(isinstance(v, jax.Array) for v in leaves)
    with pytest.raises(ValueError, match="is_prefill must be True, False or None"):
        lj.make_lora_mapping(idx, 2, is_prefill=1)


@pytest.mark.parametrize("is_prefill,want", [(None, True), (True, True), (False, False)])
def test_decode_mapping_skips_the_prompt_tile_kernel(monkeypatch, is_prefill, want):
    """On a Hopper GPU (faked; lowered for CUDA on this CPU) a 2048-token prompt step runs
    the shrink's prompt-tile (Mosaic GPU) kernel beside the Triton one; a decode step
    (``is_prefill=False``) runs the Triton kernel alone and builds no prompt schedule."""
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    from lora_jax.kernels.shrink_expand import mosaic_gpu_shrink
    from lora_jax.kernels.shrink_expand.work_list import SEGMENTS_KEY
    from tests.kernels.shrink_expand_test_base import abstract_gpu_context

    monkeypatch.setattr(mosaic_gpu_shrink, "available", lambda: True)
    monkeypatch.setattr(ops, "PALLAS_INTERPRET", False)
    tokens, hidden, rank = 2048, 1024, 64
    idx = jnp.asarray(np.repeat(np.arange(4), tokens // 4), jnp.int32)  # four prompts
    m = lj.make_lora_mapping(idx, 4, is_prefill=is_prefill)
    assert (SEGMENTS_KEY in m.work_lists) == want
    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((4, rank, hidden), jnp.bfloat16)
    with abstract_gpu_context():
        lowered = jax.jit(lambda x, a: ops.lora_shrink(x, [a], m, backend="pallas")).trace(x, a)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    assert ("mosaic_gpu" in text) == want


def _prompt_step(layout: str, tokens: int = 2048, slots: int = 4) -> np.ndarray:
    """Host slot indices: "prompts" (one run per slot), "shuffled" (the same tokens in
    random order), "mixed" (prompts, then a shuffled tail of 512 tokens)."""
    prompts = np.repeat(np.arange(slots), tokens // slots).astype(np.int32)
    shuffled = np.random.default_rng(0).permutation(prompts)
    if layout == "prompts":
        return prompts
    if layout == "shuffled":
        return shuffled
    return np.concatenate([prompts[: tokens - 512], shuffled[:512]])


def test_prompt_tiles_found_on_the_host_only():
    """From numpy indices the mapping says whether its mapped tokens lie in prompt tiles
    ("none" / "some" / "all", static, no array leaf); from device or traced indices it
    does not know (None); a decode step has none."""
    want = {"prompts": "all", "shuffled": "none", "mixed": "some"}
    for layout, tiles in want.items():
        idx = _prompt_step(layout)
        m = lj.make_lora_mapping(idx, 4, host_hints=True)
        assert m.prompt_tiles == tiles, layout
        assert m.shrink_kwargs()["prompt_tiles"] == tiles
        assert all(isinstance(v, jax.Array) for v in jax.tree.leaves(m))
        assert lj.make_lora_mapping(jnp.asarray(idx), 4).prompt_tiles is None
        assert (
            lj.make_lora_mapping(idx, 4, is_prefill=False, host_hints=True).prompt_tiles == "none"
        )
    traced = jax.jit(lambda i: lj.make_lora_mapping(i, 4), static_argnums=())(
        jnp.asarray(_prompt_step("prompts"))
    )
    assert traced.prompt_tiles is None
    # ids past max_loras are -1 before the host looks: slot 7 of 4 is no prompt
    assert (
        lj.make_lora_mapping(np.full(2048, 7, np.int32), 4, host_hints=True).prompt_tiles == "none"
    )


@pytest.mark.parametrize(
    "layout,kernels",
    [("prompts", {"mosaic_gpu"}), ("shuffled", {"triton"}), ("mixed", {"mosaic_gpu", "triton"})],
)
def test_host_prompt_tiles_launch_only_kernels_with_work(monkeypatch, layout, kernels):
    """On a Hopper GPU (faked, with an H200's shared memory; lowered for CUDA on this CPU)
    a mapping built from numpy indices launches only the shrink kernels that have tokens:
    rank-128 prompts whose tiles are one adapter's run the Mosaic GPU kernel alone (no
    Triton launch; ranks 16-64 take the Triton rectangles there), a shuffled batch the
    Triton kernel alone, a mix both."""
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    from lora_jax.kernels.shrink_expand import mosaic_gpu_shrink, pallas_triton
    from lora_jax.kernels.shrink_expand.work_list import SEGMENTS_KEY
    from tests.kernels.shrink_expand_test_base import abstract_gpu_context

    monkeypatch.setattr(mosaic_gpu_shrink, "available", lambda: True)
    monkeypatch.setattr(ops, "PALLAS_INTERPRET", False)
    monkeypatch.setenv("LORA_JAX_TRITON_SMEM_BUDGET", str(200 * 1024))
    tokens, hidden, rank = 2048, 1024, 128
    m = lj.make_lora_mapping(_prompt_step(layout, tokens), 4, host_hints=True)
    assert (SEGMENTS_KEY in m.work_lists) == ("mosaic_gpu" in kernels)
    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((4, rank, hidden), jnp.bfloat16)
    pallas_triton.opt_in_smem_budget.cache_clear()
    try:
        with abstract_gpu_context():
            shrink = jax.jit(lambda x, a: ops.lora_shrink(x, [a], m, backend="pallas"))
            text = shrink.trace(x, a).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        monkeypatch.delenv("LORA_JAX_TRITON_SMEM_BUDGET")
        pallas_triton.opt_in_smem_budget.cache_clear()
    assert {k for k in ("mosaic_gpu", "triton") if k in text} == kernels


def test_prompt_tiles_checked():
    from lora_jax.kernels import lora_shrink

    m = lj.make_lora_mapping(np.zeros(8, np.int32), 2)
    x, a = jnp.zeros((8, 32)), jnp.zeros((2, 16, 32))
    with pytest.raises(ValueError, match="prompt_tiles='most'; expected None or one of"):
        lora_shrink(x, (a,), **m.kernel_kwargs(), prompt_tiles="most", interpret=True)


def test_told_prompt_tiles_and_the_rows_rule():
    """A caller may say the prompt tiles (checked; a decode step still says "none"); the
    rule `generate` relies on holds: rows of one slot each, a power of two of at least
    PROMPT_ROWS_MIN_TOKENS long, put every mapped token in a prompt tile (the host's
    finding on random slots, unmapped rows included)."""
    from lora_jax.kernels.shrink_expand import work_list
    from lora_jax.mapping import PROMPT_ROWS_MIN_TOKENS, PROMPT_TILE_TOKENS

    assert PROMPT_TILE_TOKENS == work_list.SEGMENT_BLOCK_M
    assert PROMPT_ROWS_MIN_TOKENS == work_list.SEGMENT_BLOCK_M // work_list.SEGMENT_MAX_PIECES
    idx = jnp.asarray(_prompt_step("prompts"))
    assert lj.make_lora_mapping(idx, 4, prompt_tiles="all").prompt_tiles == "all"
    told = lj.make_lora_mapping(_prompt_step("shuffled"), 4, prompt_tiles="some", host_hints=True)
    assert told.prompt_tiles == "some"  # what the caller said, not re-derived
    assert lj.make_lora_mapping(idx, 4, is_prefill=False, prompt_tiles="all").prompt_tiles == (
        "none"
    )
    with pytest.raises(ValueError, match="prompt_tiles must be None, 'none', 'some' or 'all'"):
        lj.make_lora_mapping(idx, 4, prompt_tiles="most")
    rng = np.random.default_rng(1)
    for tokens in (2048, 8192):  # 64- and 128-row tiles
        for rows in (PROMPT_ROWS_MIN_TOKENS, 64, 128, 512):
            for _ in range(4):
                slots = rng.integers(-1, 6, tokens // rows).astype(np.int32)
                slots[0] = 2  # at least one mapped token
                assert work_list.prompt_tiles(np.repeat(slots, rows)) == "all"
    rows = np.repeat(np.arange(2048 // PROMPT_ROWS_MIN_TOKENS) % 7 - 1, PROMPT_ROWS_MIN_TOKENS)
    assert (
        lj.make_lora_mapping(rows.astype(np.int32), 6, host_hints=True).prompt_tiles == "all"
    )  # the same
    short = np.repeat(np.arange(256) % 6, PROMPT_ROWS_MIN_TOKENS // 4).astype(np.int32)
    assert lj.make_lora_mapping(short, 6, host_hints=True).prompt_tiles != "all"  # 8 runs a tile


def test_tokens_per_slot_found_on_the_host_only():
    """From numpy indices the mapping buckets its mapped tokens per active slot (static,
    no array leaf): 1 a slot each, 2 at most two on average, 16 at most 16 (from
    FEW_MIN_TOKENS tokens: a decode step reports 0), 64 at least 64 on average, 0 between
    or none mapped; from
    device indices it does not know (None); a caller may say it, checked."""
    cases = {
        (3, 1, -1, 2): 1,
        (0, 0, 1, -1): 2,  # 1.5 a slot
        (0, 0, 0, 1): 2,  # 2.0 a slot
        (0, 0, 0, 0, 1): 0,  # 2.5 a slot, 5 tokens (decode-sized: not 16)
        (0, 1, 2, 3) * 5 + (-1,) * 240: 16,  # 5 a slot, 260 tokens
        (0, 1, 2, 3) * 16 + (-1,) * 200: 16,  # 16.0 a slot
        (0, 1, 2, 3) * 16 + (0,) + (-1,) * 200: 0,  # 16.25 a slot
        (0, 1, 2, 3) * 5 + (-1,) * 236: 0,  # 5 a slot, 256 tokens
        (-1, -1): 0,
        (7, 7, 1): 1,  # 7 is past max_loras = 4: unmapped, not a shared slot
        (0,) * 63 + (1,) * 64: 0,  # 63.5 a slot
        (0,) * 60 + (1,) * 68 + (-1,) * 9: 64,  # 64.0 a slot: a short prompt batch
    }
    for idx, want in cases.items():
        m = lj.make_lora_mapping(np.asarray(idx, np.int32), 4, host_hints=True)
        assert m.tokens_per_slot == want, idx
        assert m.shrink_kwargs()["tokens_per_slot"] == want
        assert m.expand_kwargs()["tokens_per_slot"] == want
        assert all(isinstance(v, jax.Array) for v in jax.tree.leaves(m))
        assert lj.make_lora_mapping(jnp.asarray(idx, jnp.int32), 4).tokens_per_slot is None
    assert lj.make_lora_mapping(jnp.zeros(4, jnp.int32), 4, tokens_per_slot=1).tokens_per_slot == 1
    with pytest.raises(
        ValueError, match=r"tokens_per_slot must be None or one of \(0, 1, 2, 16, 64\)"
    ):
        lj.make_lora_mapping(np.zeros(4, np.int32), 4, tokens_per_slot=3)


def test_tokens_per_slot_buckets_are_the_kernels():
    """The mapping's buckets are the values the kernels' tuning reads (kernels/ depend on
    nothing in lora_jax, so each side spells them), and its few-tokens bucket starts where
    the kernels' decode tiles stop."""
    from lora_jax import mapping
    from lora_jax.kernels.shrink_expand import tuning

    assert tuning.AHEAD_TOKENS_PER_SLOT in mapping.TOKENS_PER_SLOT
    assert tuning.FEW_TOKENS_PER_SLOT == mapping.FEW_TOKENS_PER_SLOT
    assert mapping.FEW_MIN_TOKENS == tuning.DECODE_MAX_TOKENS + 1


@pytest.mark.parametrize(
    "per_slot,rank,tokens,bgmv",
    [
        (1, 64, 64, True),
        (2, 16, 64, True),
        (2, 64, 16, True),
        (2, 64, 64, False),
        (0, 16, 64, False),
        (None, 16, 64, False),
    ],
)
def test_tokens_per_slot_picks_the_per_token_kernels(monkeypatch, per_slot, rank, tokens, bgmv):
    """Lowered for CUDA on this CPU: a step with a slot per token (or two a slot at rank
    16 or at up to 16 tokens) runs the per-token (BGMV) shrink and expand; others the
    segment kernels."""
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    from tests.kernels.shrink_expand_test_base import abstract_gpu_context

    monkeypatch.setattr(ops, "PALLAS_INTERPRET", False)
    hidden = 1024
    idx = np.random.default_rng(0).permutation(64)[:tokens].astype(np.int32)
    if per_slot is None:  # device indices: not known
        idx = jnp.asarray(idx)
    m = lj.make_lora_mapping(idx, 64, tokens_per_slot=per_slot)
    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((64, rank, hidden), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((64, 512, rank), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((tokens, 512), jnp.bfloat16)

    def step(x, a, b, y):
        return ops.add_lora_linear(y, x, [a], [b], m, backend="pallas")

    with abstract_gpu_context():
        text = jax.jit(step).trace(x, a, b, y).lower(lowering_platforms=("cuda",)).as_text()
    assert ("lora_shrink_bgmv" in text) == bgmv
    assert ("lora_expand_bgmv" in text) == bgmv
    assert ("lora_shrink_atomic" in text) == (not bgmv)


def test_tokens_per_slot_changes_no_result(monkeypatch):
    """The hint picks kernels only: interpret mode, per-token vs segment vs XLA."""
    monkeypatch.setattr(ops, "PALLAS_INTERPRET", True)
    rng = np.random.default_rng(1)
    idx = np.array([5, -1, 2, 7, 0, 3], np.int32)
    x = jnp.asarray(rng.normal(size=(6, 96)), jnp.float32)
    a = jnp.asarray(rng.normal(size=(8, 16, 96)) / 10, jnp.float32)
    b = jnp.asarray(rng.normal(size=(8, 40, 16)) / 4, jnp.float32)
    y = jnp.asarray(rng.normal(size=(6, 40)), jnp.float32)
    want = ops.add_lora_linear(y, x, [a], [b], lj.make_lora_mapping(idx, 8), backend="xla")
    for per_slot in (1, None):
        m = lj.make_lora_mapping(jnp.asarray(idx), 8, tokens_per_slot=per_slot)
        got = ops.add_lora_linear(y, x, [a], [b], m, backend="pallas")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        assert np.array_equal(np.asarray(got)[1], np.asarray(y)[1])


def test_host_mappings_compile_once_where_the_ops_run_xla(monkeypatch):
    """Where the ops run XLA (a CPU, no backend forced), numpy indices give no host hints:
    XLA reads none, and each new value (static) recompiled a jit the mapping is passed to.
    Asked for (or where the kernels run) they are found as before."""
    monkeypatch.setattr(lj.ops, "_default_backend", None)
    if lj.ops.resolve_backend() != "xla":  # a GPU: the kernels run and read the hints
        monkeypatch.setattr(lj.ops, "_default_backend", "xla")
    traces = []

    @jax.jit
    def step(x, a, m):
        traces.append(1)
        return lj.ops.lora_shrink(x, (a,), m, 1.0)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
    a = jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32)
    mixes = [np.full(64, 0), np.arange(64) % 4, np.repeat(np.arange(4), 16), np.arange(64) % 2]
    for idx in mixes:
        m = lj.make_lora_mapping(idx.astype(np.int32), 4)
        assert (m.tokens_per_slot, m.prompt_tiles, m.whole_tiles) == (None, None, None)
        step(x, a, m)
    assert len(traces) == 1
    told = lj.make_lora_mapping(mixes[0].astype(np.int32), 4, host_hints=True)
    assert told.tokens_per_slot == 64 and told.prompt_tiles is not None


@pytest.mark.parametrize("backend", ["xla", "pallas", "pallas_fused"])
def test_every_backend_checks_the_same_inputs_and_takes_a_traced_scale(monkeypatch, backend):
    """XLA broadcast or truncated what the kernels refuse (slot_ranks of the wrong shape
    masked the wrong rank columns; an x of 1 token was broadcast over the mapping's 4;
    offsets 2.7 became 2); a jax or traced `scale` crashed the kernels (a static argument)."""
    monkeypatch.setattr(lj.ops, "PALLAS_INTERPRET", True)
    rng = np.random.default_rng(0)
    T, H, R, L = 4, 32, 8, 3
    idx = np.array([0, 2, 1, -1], np.int32)
    m = lj.make_lora_mapping(jnp.asarray(idx), L)
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
    a = jnp.asarray(rng.normal(size=(L, R, H)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(L, 16, R)), jnp.float32)
    y = jnp.zeros((T, 16), jnp.float32)
    ops = lj.ops
    with pytest.raises(ValueError, match=r"slot_ranks must be integers of shape \(num_slices"):
        ops.lora_shrink(x, [a], m, slot_ranks=jnp.array([2, 5, 8]), backend=backend)
    with pytest.raises(ValueError, match="slot_ranks must be integers"):
        ops.lora_expand(
            y, jnp.zeros((1, T, R)), [b], m, slot_ranks=jnp.ones((1, L)), backend=backend
        )
    with pytest.raises(ValueError, match="x has 1 tokens, the mapping 4"):
        ops.lora_shrink(x[:1], [a], m, backend=backend)
    with pytest.raises(ValueError, match="y has 4 tokens, h 1"):
        ops.lora_expand(y, jnp.zeros((1, 1, R)), [b], m, backend=backend)
    with pytest.raises(ValueError, match="x .* must be a 2-D float array"):
        ops.lora_shrink(x.astype(jnp.int32), [a], m, backend=backend)
    with pytest.raises(ValueError, match="offsets must be ints"):
        ops.lora_expand(y, jnp.zeros((1, T, R)), [b], m, offsets=[0.0], backend=backend)
    wide = jnp.zeros((T, 24), jnp.float32)
    for bad in (2.7, True, jnp.float32(2.0)):  # the fused op took 2.7 as column 2, True as 1
        with pytest.raises(ValueError, match="offsets must be ints"):
            ops.add_lora_linear(wide, x, [a], [b], m, 0.5, offsets=[bad], backend=backend)
    with pytest.raises(ValueError, match="exceeds y width"):
        ops.add_lora_linear(wide, x, [a], [b], m, 0.5, offsets=[9], backend=backend)
    hj = jnp.ones((1, T, R))
    np.testing.assert_array_equal(  # concrete jax ints are offsets as any int
        ops.lora_expand(y, hj, [b], m, offsets=[jnp.int32(0)], backend=backend),
        ops.lora_expand(y, hj, [b], m, offsets=[0], backend=backend),
    )
    a_np, x_np = np.asarray(a, np.float64), np.asarray(x, np.float64)
    want = np.stack(
        [0.5 * x_np[t] @ a_np[i].T if i >= 0 else np.zeros(R) for t, i in enumerate(idx)]
    )
    run = jax.jit(lambda x, s: ops.lora_shrink(x, [a], m, s, backend=backend))
    np.testing.assert_allclose(np.asarray(run(x, 0.5))[0], want, rtol=1e-5, atol=1e-5)
    got = ops.lora_shrink(x, [a], m, jnp.float32(0.5), backend=backend)
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-5, atol=1e-5)
    lin = jax.jit(lambda y, x, s: ops.add_lora_linear(y, x, [a], [b], m, s, backend=backend))
    delta = np.einsum("tr,tnr->tn", want, np.asarray(b, np.float64)[np.maximum(idx, 0)])
    np.testing.assert_allclose(
        np.asarray(lin(y, x, 0.5)), delta * (idx >= 0)[:, None], rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("bad", [True, 0, -1, 2.5, "2"])
def test_max_loras_must_be_an_int_of_at_least_one(bad):
    """True made a 1-slot mapping, 0 / -1 mapped every token to no adapter, 2.5 passed
    and '2' raised numpy's UFuncTypeError."""
    idx = np.array([0, 1, -1], np.int32)
    with pytest.raises(ValueError, match=f"max_loras must be an int >= 1.*got {bad!r}"):
        lj.make_lora_mapping(idx, bad)
    m = lj.make_lora_mapping(idx, np.int64(2))  # numpy ints are ints
    np.testing.assert_array_equal(m.token_lora_indices, np.where(idx < 2, idx, -1))


@pytest.mark.parametrize("backend", ["xla", "pallas_fused"])
def test_scale_and_mapping_types_are_checked(monkeypatch, backend):
    """A str / None scale gave raw TypeErrors, True was taken as 1.0 and a [2] array
    broadcast; an index array for the mapping an AttributeError ('tokens_per_slot')."""
    monkeypatch.setattr(lj.ops, "PALLAS_INTERPRET", True)
    T, H, R, L, N = 3, 16, 8, 2, 12
    x, y = jnp.ones((T, H)), jnp.zeros((T, N))
    a, b = jnp.ones((L, R, H)), jnp.ones((L, N, R))
    idx = jnp.array([0, 1, -1], jnp.int32)
    m = lj.make_lora_mapping(idx, L)
    for bad in ("2", None, True, jnp.ones(2)):
        with pytest.raises(ValueError, match="lora_shrink: scale must be a real number"):
            ops.lora_shrink(x, [a], m, bad, backend=backend)
        with pytest.raises(ValueError, match="add_lora_linear: scale must be a real number"):
            ops.add_lora_linear(y, x, [a], [b], m, bad, backend=backend)
    for raw in (idx, np.asarray(idx)):
        with pytest.raises(ValueError, match=r"mapping must be a LoRAMapping \(make_lora_mapping"):
            ops.lora_shrink(x, [a], raw, backend=backend)
        with pytest.raises(ValueError, match=r"mapping must be a LoRAMapping \(make_lora_mapping"):
            ops.lora_expand(y, jnp.ones((1, T, R)), [b], raw, backend=backend)
        with pytest.raises(ValueError, match=r"mapping must be a LoRAMapping \(make_lora_mapping"):
            ops.add_lora_linear(y, x, [a], [b], raw, backend=backend)
    want = np.where((np.asarray(idx) >= 0)[:, None], 0.5 * H * R, 0.0) * np.ones((T, N))
    for good in (0.5, np.float32(0.5), jnp.float32(0.5)):  # numbers and 0-d arrays still
        got = ops.add_lora_linear(y, x, [a], [b], m, good, backend=backend)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_set_columns_refuses_an_offset_outside_y():
    """dynamic_update_slice clamped offset 10 of 4 columns in a 12-wide y to 8: the
    columns landed elsewhere, with no error."""
    y, cols = jnp.zeros((2, 12)), jnp.ones((2, 4))
    for bad in (10, -1, np.int32(9)):
        with pytest.raises(ValueError, match=f"set_columns: offset {bad} with 4 columns"):
            ops.set_columns(y, bad, cols)
    want = np.zeros((2, 12))
    want[:, 8:] = 1.0
    np.testing.assert_array_equal(ops.set_columns(y, 8, cols), want)
    traced = jax.jit(lambda o: ops.set_columns(y, o, cols))  # a traced offset is not known
    np.testing.assert_array_equal(traced(8), want)


@pytest.mark.parametrize("y_dtype", [jnp.bfloat16, jnp.float32])
def test_a_tokens_numbers_do_not_depend_on_the_hint_or_the_backend(monkeypatch, y_dtype):
    """The per-token expand (tokens_per_slot 1) kept h in f32 where the segment expand
    rounds it to B's bf16 (1 ulp apart on 132 of 512 outputs), and XLA rounded h to bf16
    where the kernels keep f32 for an f32 y: one rule now, the kernels' (h in B's bf16 /
    fp16 unless y is f32): bf16 outputs bit for bit, f32 ones to the last bits (interpret
    mode on a CPU; on a GPU the compiled kernels: there XLA drops an interpreted kernel's
    f32 -> bf16 -> f32 round trip, as its excess-precision rule allows)."""
    monkeypatch.setattr(lj.ops, "PALLAS_INTERPRET", jax.default_backend() != "gpu")
    rng = np.random.default_rng(0)
    T, H, R, L, N = 8, 64, 16, 8, 64
    idx = jnp.asarray(rng.permutation(L)[:T].astype(np.int32))
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16)
    a = jnp.asarray(rng.normal(size=(L, R, H)) / 8, jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=(L, N, R)) / 4, jnp.bfloat16)
    y = jnp.asarray(rng.normal(size=(T, N)), y_dtype)
    h = lj.ops.lora_shrink(x, [a], lj.make_lora_mapping(idx, L), 0.5, backend="xla")
    outs = {}
    for tps in (None, 1, 0):
        m = lj.make_lora_mapping(idx, L, tokens_per_slot=tps)
        outs[tps] = np.asarray(lj.ops.lora_expand(y, h, [b], m, backend="pallas"), np.float32)
    m = lj.make_lora_mapping(idx, L)
    outs["xla"] = np.asarray(lj.ops.lora_expand(y, h, [b], m, backend="xla"), np.float32)
    gathered = lj.make_lora_mapping(jnp.concatenate([idx, idx]), L)  # T > L: one-hot path
    two = lj.ops.lora_expand(jnp.concatenate([y, y]), jnp.concatenate([h, h], 1), [b], gathered)
    outs["one-hot"] = np.asarray(two[:T], np.float32)
    for k, v in outs.items():
        if y_dtype == jnp.bfloat16:  # sums formed in another order vanish in bf16
            np.testing.assert_array_equal(v, outs[None], err_msg=str(k))
        else:  # f32 sums in another order: last bits (h rounded to bf16 was 2.7e-2 off)
            np.testing.assert_allclose(v, outs[None], rtol=1e-6, atol=1e-6, err_msg=str(k))


def test_sequence_indices_are_cleaned_like_token_indices():
    """The logits LoRA's per-sequence slots went through a bare int32 cast: a 64-bit id
    wrapped into slot 1, floats were truncated, a 2-D array was taken."""
    idx = jnp.zeros(4, jnp.int32)
    for seq in (np.array([2**32 + 1, 1, -7, 5], np.int64), jnp.array([2**31 - 1, 1, -7, 5])):
        m = lj.make_lora_mapping(idx, 4, seq_lora_indices=seq)
        assert m.seq_lora_indices.tolist() == [-1, 1, -1, -1]
        assert m.with_sequences(seq).seq_lora_indices.tolist() == [-1, 1, -1, -1]
    with pytest.raises(ValueError, match="seq_lora_indices must be integers, got float"):
        lj.make_lora_mapping(idx, 4, seq_lora_indices=np.array([0.0, 1.9]))
    with pytest.raises(ValueError, match="seq_lora_indices must be 1-D"):
        lj.make_lora_mapping(idx, 4).with_sequences(np.zeros((2, 2), np.int32))
