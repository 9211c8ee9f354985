"""Fused shrink->expand (`lora_shrink_expand`): interpret mode and CUDA lowering on CPU, GPU runs.

Compared with the composition of the jnp oracles over shapes x dtypes x slice
layouts x mappings; the ops-level test checks `add_lora_linear(backend="pallas_fused")`
against the XLA backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shrink_expand_test_base import (
    TOLERANCES,
    Case,
    ShrinkExpandTestBase,
    make_metadata,
)

from lora_jax.kernels import BlockSizes, lora_shrink_expand, lora_shrink_expand_reference
from lora_jax.kernels.shrink_expand.block_sizes import next_pow2
from lora_jax.kernels.shrink_expand.pallas_triton import SMEM_BUDGET
from lora_jax.kernels.shrink_expand.pallas_triton_fused import fit_fused_tiles, fused_smem_bytes
from lora_jax.kernels.shrink_expand.pallas_triton_fused_split import SplitTiles

# Several column tiles per program (split_n 2 over 3 tiles: the second group's
# second tile lies past the slice) and a short k step (several k iterations).
_GROUPS = BlockSizes(block_m=16, block_k=32, block_n=16, split_n=2)
_ONE_TILE_EACH = BlockSizes(block_m=16, block_k=64, block_n=16, split_n=8, num_stages=3)

FUSED_CASES = [
    Case(8, 64, 16, (32,), jnp.bfloat16, "none"),
    Case(4, 48, 16, (32,), jnp.float16, "distinct"),
    Case(16, 40, 16, (24, 8, 40), jnp.float32, "unsorted"),  # ragged hidden, 3 widths
    Case(12, 64, 8, (16,), jnp.bfloat16, "unsorted"),  # rank 8: padded to 16 inside
    Case(9, 130, 32, (40,), jnp.bfloat16, "unsorted"),  # ragged hidden, 2 k steps
    Case(16, 64, 32, (32, 48, 16), jnp.bfloat16, "unsorted", ranked=True),
    Case(20, 96, 16, (48, 16, 33), jnp.float16, "unsorted", block_sizes=_GROUPS),
    Case(24, 72, 24, (40,), jnp.float32, "sorted", ranked=True, block_sizes=_ONE_TILE_EACH),
    Case(1, 64, 16, (16,), jnp.float32, "one"),
]
# Paths another case takes too: the oldest jax only (slow; the newest-jax CI run skips them).
FUSED_PARAMS = [
    pytest.param(c, marks=pytest.mark.slow) if i in (1, 3, 4, 8) else c
    for i, c in enumerate(FUSED_CASES)
]


class FusedTestBase:
    """Subclass and set `interpret`; reuses the shared base's inputs."""

    interpret: bool = True
    split: bool | SplitTiles = False
    _inputs = ShrinkExpandTestBase._inputs

    def check(self, case: Case, scale: float = 0.5):
        idx, meta, x, lora_a, lora_b, y, offsets, slot_ranks, _ = self._inputs(case)
        # unit-scale deltas: B ~ N(0, 1 / R) so that h @ B.T ~ h
        lora_b = tuple((b / np.sqrt(case.rank)).astype(b.dtype) for b in lora_b)
        kw = dict(meta, offsets=offsets, scale=scale, slot_ranks=slot_ranks)
        out = lora_shrink_expand(
            x,
            y,
            lora_a,
            lora_b,
            **kw,
            block_sizes=case.block_sizes,
            split=self.split,
            interpret=self.interpret,
        )
        ref = lora_shrink_expand_reference(x, y, lora_a, lora_b, **kw)
        assert out.shape == y.shape and out.dtype == y.dtype
        rtol, atol = TOLERANCES[("expand", case.dtype)]
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=rtol, atol=atol
        )
        # the test can fail: mapped rows of touched columns do change
        y_np, out_np = np.asarray(y), np.asarray(out)
        if np.any(idx >= 0):
            assert not np.array_equal(out_np[idx >= 0], y_np[idx >= 0])
        # unmapped rows and untouched columns are bit-identical to the input
        assert np.array_equal(out_np[idx < 0], y_np[idx < 0])
        assert np.array_equal(out_np[:, sum(case.widths) :], y_np[:, sum(case.widths) :])

    @pytest.mark.parametrize("case", FUSED_PARAMS, ids=str)
    def test_fused(self, case: Case):
        self.check(case)


class TestFusedInterpret(FusedTestBase):
    interpret = True

    def test_under_jit_with_donated_y(self):
        case = FUSED_CASES[2]
        idx, meta, x, lora_a, lora_b, y, offsets, _, _ = self._inputs(case, seed=2)
        ref = lora_shrink_expand_reference(x, y, lora_a, lora_b, offsets=offsets, **meta)

        @jax.jit
        def step(x, y):
            return lora_shrink_expand(x, y, lora_a, lora_b, offsets=offsets, **meta, interpret=True)

        out = jax.jit(step, donate_argnums=1)(x, jnp.array(y))
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
class TestFusedGpu(FusedTestBase):
    interpret = False

    @pytest.mark.parametrize(
        "case",
        [
            Case(64, 4096, 16, (4096,), jnp.bfloat16, "unsorted", max_loras=64),
            Case(256, 4096, 64, (4096, 1024, 1024), jnp.bfloat16, "unsorted", max_loras=16),
            Case(16, 2049, 8, (1000, 14336), jnp.bfloat16, "one", max_loras=8),
            Case(64, 4096, 128, (4096,), jnp.float16, "unsorted", max_loras=8, ranked=True),
            Case(64, 1000, 16, (300,), jnp.float32, "unsorted", max_loras=8),
        ],
        ids=str,
    )
    def test_large(self, case):
        self.check(case)


# The split kernel: small tiles so that a case has several chunks, column tiles and items
# per program (5 programs), a hidden size off the chunk (masked), and 3 slices.
_SPLIT = SplitTiles(block_m=16, block_k=16, chunk_k=32, block_n=16, programs=5)


class TestSplitInterpret(FusedTestBase):
    """Interpret mode runs the two halves as two launches (no program may wait there)."""

    split = _SPLIT

    @pytest.mark.parametrize("case", FUSED_PARAMS, ids=str)
    def test_fused(self, case: Case):
        self.check(case)


@pytest.mark.gpu
class TestSplitGpu(FusedTestBase):
    """The one launch with the grid-wide barrier, at the model's decode shapes."""

    interpret = False
    split = True

    @pytest.mark.parametrize(
        "case",
        [
            Case(64, 4096, 16, (4096, 1024, 1024), jnp.bfloat16, "unsorted", max_loras=64),
            Case(64, 14336, 16, (4096,), jnp.bfloat16, "distinct", max_loras=64),
            Case(256, 4096, 64, (14336, 14336), jnp.bfloat16, "unsorted", max_loras=16),
            Case(16, 2049, 8, (1000, 300), jnp.float16, "one", max_loras=8, ranked=True),
            Case(64, 1000, 16, (300,), jnp.float32, "unsorted", max_loras=8),
        ],
        ids=str,
    )
    def test_large(self, case):
        self.check(case)

    def test_repeated_calls_in_one_jit(self):
        """Eight launches back to back, each the previous one's y: every barrier's flags
        start at zero and no launch reads another's partials."""
        case = Case(64, 4096, 16, (4096,), jnp.bfloat16, "unsorted", max_loras=64)
        idx, meta, x, lora_a, lora_b, y, offsets, _, _ = self._inputs(case, seed=3)
        lora_b = tuple((b / np.sqrt(case.rank)).astype(b.dtype) for b in lora_b)
        kw = dict(meta, offsets=offsets, scale=0.25)

        def chain(y, split):
            for i in range(8):
                y = lora_shrink_expand(x * (i + 1), y, lora_a, lora_b, **kw, split=split)
            return y

        got = jax.jit(functools.partial(chain, split=True))(y)
        want = jax.jit(functools.partial(chain, split=False))(y)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0.05, atol=0.05
        )
        assert not np.array_equal(np.asarray(got), np.asarray(y))


def test_tiles_fit_shared_memory():
    for rank in (8, 16, 32, 64, 128, 256):
        for num_tokens in (1, 64, 256, 4096):
            bs = BlockSizes.get_default(
                "fused", num_tokens=num_tokens, hidden=4096, rank=rank, out_features=4096
            )
            for itemsize in (2, 4):
                fit = fit_fused_tiles(bs, rank, itemsize)
                rank_p = max(16, next_pow2(rank))
                if rank_p <= 128:
                    assert fused_smem_bytes(fit, rank_p, itemsize) <= SMEM_BUDGET, (rank, fit)
                assert fit.block_k >= 16 and fit.block_n >= 16
    # decode at rank 16 keeps the wide k step; split_n spreads ~1 program per SM
    bs = BlockSizes.get_default("fused", num_tokens=64, hidden=4096, rank=16, out_features=4096)
    assert bs.block_k == 256 and bs.split_n == 16
    assert fit_fused_tiles(bs, 16, 2) == bs
    with pytest.raises(ValueError, match="split_n"):
        BlockSizes(split_n=0)


def test_bad_shapes_are_named():
    meta = make_metadata(np.zeros(4, np.int32), 2)
    x = jnp.zeros((4, 32), jnp.float32)
    a = jnp.zeros((2, 16, 32), jnp.float32)
    b = jnp.zeros((2, 16, 16), jnp.float32)
    y = jnp.zeros((4, 16), jnp.float32)
    with pytest.raises(ValueError, match="outside y"):
        lora_shrink_expand(x, y, (a,), (b,), offsets=(8,), **meta, interpret=True)
    with pytest.raises(ValueError, match=r"lora_b\[0\]"):
        lora_shrink_expand(x, y, (a,), (b[:, :, :8],), offsets=(0,), **meta, interpret=True)
    with pytest.raises(ValueError, match="offsets"):
        lora_shrink_expand(x, y, (a,), (b,), offsets=(0, 0), **meta, interpret=True)


@pytest.mark.parametrize("split", [False, True], ids=["per_group", "grid_split"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_cuda(dtype, split):
    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    from shrink_expand_test_base import abstract_gpu_context

    num_tokens, hidden, rank, max_loras = 64, 2049, 8, 4
    meta = make_metadata(np.arange(num_tokens) % max_loras, max_loras)
    sds = jax.ShapeDtypeStruct
    x = sds((num_tokens, hidden), dtype)
    lora_a = (sds((max_loras, rank, hidden), dtype),) * 3
    lora_b = tuple(sds((max_loras, n, rank), dtype) for n in (1000, 300, 300))
    y = sds((num_tokens, 1600), dtype)
    ranks = jnp.full((3, max_loras), 4, jnp.int32)

    def step(x, lora_a, lora_b, y, meta):
        return lora_shrink_expand(
            x,
            y,
            lora_a,
            lora_b,
            offsets=(0, 1000, 1300),
            **meta,
            slot_ranks=ranks,
            scale=0.5,
            split=split,
        )

    with abstract_gpu_context():
        text = (
            jax.jit(step)
            .trace(x, lora_a, lora_b, y, meta)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert text.count("triton") >= 1
    assert ("lora_shrink_expand_split_both" if split else "lora_shrink_expand") in text


@pytest.mark.parametrize("backend", ["pallas", "pallas_fused"])
def test_add_lora_linear_pallas_matches_xla(monkeypatch, backend):
    """`add_lora_linear` through the kernels (shrink + expand, or the fused launch) in
    interpret mode gives the XLA backend's output."""
    from lora_jax import ops
    from lora_jax.mapping import make_lora_mapping

    monkeypatch.setattr(ops, "PALLAS_INTERPRET", True)
    rng = np.random.default_rng(3)
    num_tokens, hidden, rank, max_loras = 10, 48, 16, 4
    widths = (24, 16, 40)
    num_slices = len(widths)
    idx = rng.integers(-1, max_loras, num_tokens).astype(np.int32)
    mapping = make_lora_mapping(jnp.asarray(idx), max_loras)
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.float32)
    a = [
        jnp.asarray(rng.standard_normal((max_loras, rank, hidden)) / 7, jnp.float32) for _ in widths
    ]
    b = [jnp.asarray(rng.standard_normal((max_loras, n, rank)) / 4, jnp.float32) for n in widths]
    y = jnp.asarray(rng.standard_normal((num_tokens, sum(widths))), jnp.float32)
    ranks = jnp.asarray(rng.integers(1, rank + 1, (num_slices, max_loras)), jnp.int32)
    # the XLA path reads slot_ranks only through the zeroed padding (as the manager stores it)
    pad = jnp.arange(rank)[None, :, None] >= ranks[:, :, None, None]  # [S, L, R, 1]
    a = [jnp.where(pad[s], 0.0, a_s) for s, a_s in enumerate(a)]
    for slot_ranks in (None, ranks):
        got = ops.add_lora_linear(y, x, a, b, mapping, 0.5, slot_ranks=slot_ranks, backend=backend)
        want = ops.add_lora_linear(y, x, a, b, mapping, 0.5, slot_ranks=slot_ranks, backend="xla")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        assert np.array_equal(np.asarray(got)[idx < 0], np.asarray(y)[idx < 0])
    assert "pallas_fused" in ops.BACKENDS
    monkeypatch.setattr(ops, "_default_backend", ops._default_backend)  # restored after
    ops.set_default_backend(backend)
    assert ops.resolve_backend(None, num_tokens) == backend


@pytest.mark.parametrize(
    "backend,kernel", [("pallas", "lora_expand"), ("pallas_fused", "lora_shrink_expand")]
)
@pytest.mark.parametrize("kind", ["qkv", "row"])
def test_layers_with_pallas_backends_match_xla(monkeypatch, kind, backend, kernel):
    """The column (3-slice qkv) and row layers route through add_lora_linear, so the
    "pallas" and "pallas_fused" default backends give the XLA backend's output (mesh
    tp=2), through the kernels (interpret mode)."""
    if jax.device_count() < 2:
        pytest.skip(f"needs a mesh of 2 devices, {jax.device_count()} visible")
    from flax import nnx

    import lora_jax as lj
    from lora_jax import ops

    monkeypatch.setattr(ops, "PALLAS_INTERPRET", True)
    monkeypatch.setattr(ops, "_default_backend", ops._default_backend)  # restored after
    mesh = jax.make_mesh((1, 2), ("dp", "tp"), devices=jax.devices()[:2])
    rules = lj.ShardingRules(mesh)
    kw = dict(rules=rules, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0))
    if kind == "qkv":
        base = lj.QKVParallelLinear(32, 8, 4, 2, **kw)
        layer_cls = lj.QKVParallelLinearWithLoRA
    else:
        base = lj.RowParallelLinear(32, 24, **kw)
        layer_cls = lj.RowParallelLinearWithLoRA
    cfg = lj.LoRAConfig(max_loras=4, max_lora_rank=16, lora_dtype=jnp.float32)
    layer = layer_cls(base, cfg, lj.LoRAContext(None))
    rng = np.random.default_rng(5)
    for slot, rank in {0: 16, 1: 8, 3: 4}.items():
        a = [rng.normal(0, 0.3, (rank, 32)).astype(np.float32) for _ in range(layer.n_slices)]
        b = [rng.normal(0, 0.3, (n, rank)).astype(np.float32) for n in layer.logical_slice_sizes]
        layer.set_lora(slot, a, b)
    x = jnp.asarray(rng.normal(size=(12, 32)), jnp.float32)
    idx = jnp.asarray([1, -1, 0, 3, 1, 1, -1, 2, 0, 3, 3, 0], jnp.int32)

    def run(backend):
        ops.set_default_backend(backend)

        @nnx.jit
        def f(layer, x, idx):
            lj.set_lora_mapping(layer, idx)
            return layer(x)

        return np.asarray(f(layer, x, idx))

    kernels, calls = ops._kernels(), []
    op = getattr(kernels, kernel)
    monkeypatch.setattr(kernels, kernel, lambda *a, **k: calls.append(1) or op(*a, **k))
    want, got = run("xla"), run(backend)
    assert calls, f"the layer did not reach {kernel}"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["shuffled", "prompts"])
def test_layer_default_backend_on_gpu_matches_xla(monkeypatch, layout):
    """On the GPU, a 3-slice qkv layer at 2048 tokens takes the default backend (the
    kernels: Triton, and on Hopper the prompt-tile kernel) with a mapping built from
    host indices, and gives the XLA backend's output."""
    from flax import nnx

    import lora_jax as lj
    from lora_jax import ops

    monkeypatch.setattr(ops, "_default_backend", None)
    kw = dict(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    layer = lj.MergedQKVParallelLinearWithLoRA(
        lj.QKVParallelLinear(1024, 64, 16, 8, **kw),
        lj.LoRAConfig(max_loras=4, max_lora_rank=64, lora_dtype=jnp.bfloat16),
        lj.LoRAContext(None),
    )
    rng = np.random.default_rng(9)
    for slot, rank in {0: 64, 1: 32, 3: 16}.items():
        a = [rng.normal(0, 0.05, (rank, 1024)).astype(np.float32) for _ in range(layer.n_slices)]
        b = [rng.normal(0, 0.05, (n, rank)).astype(np.float32) for n in layer.logical_slice_sizes]
        layer.set_lora(slot, a, b)
    tokens = 2048
    idx = np.repeat(np.array([0, 1, -1, 3], np.int32), tokens // 4)
    if layout == "shuffled":
        idx = rng.permutation(idx)
    x = jnp.asarray(rng.normal(size=(tokens, 1024)), jnp.bfloat16)
    mapping = lj.make_lora_mapping(idx, 4)  # host indices: prompt tiles found
    assert mapping.prompt_tiles == ("none" if layout == "shuffled" else "all")
    assert ops.resolve_backend(None, tokens) == "pallas"

    @nnx.jit
    def run(layer, x, mapping):
        lj.set_lora_mapping(layer, mapping)
        return layer(x)

    got = np.asarray(run(layer, x, mapping), np.float32)
    ops.set_default_backend("xla")
    want = np.asarray(run(layer, x, mapping), np.float32)
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)


def test_fused_split_setting_is_parsed():
    """``LORA_JAX_FUSED_SPLIT``: off, on with the default tiles, or tiles spelled out; a bad
    value names the variable and what it takes."""
    from lora_jax import ops

    assert ops._fused_split("0") is False and ops._fused_split("") is False
    assert ops._fused_split("1") is True
    tiles = ops._fused_split("1024:512:66:8")
    assert (tiles.chunk_k, tiles.block_n, tiles.programs, tiles.num_warps) == (1024, 512, 66, 8)
    with pytest.raises(ValueError, match="LORA_JAX_FUSED_SPLIT='fast'"):
        ops._fused_split("fast")
    with pytest.raises(ValueError, match="chunk_k"):
        ops._fused_split("100:512:66:8")  # not a multiple of block_k
