"""The public ops at their edges: overlapping slices, slot ranks of the wrong dtype, an
empty batch, host indices of any integer dtype, and the XLA path's true-rank masks —
each against a float64 numpy loop or the stated contract."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from shrink_expand_test_base import make_metadata

import lora_jax as lj
from lora_jax import ops
from lora_jax.kernels import (
    lora_expand,
    lora_expand_reference,
    lora_shrink,
    lora_shrink_expand,
    lora_shrink_reference,
)


def _numpy_expand(y, h, lora_b, offsets, idx):
    """`y[t, off:off+n] += h[s, t] @ B_s[idx[t]].T`, slice after slice, in float64."""
    out = np.asarray(y, np.float64).copy()
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        b = np.asarray(b, np.float64)
        for t, i in enumerate(idx):
            if i >= 0:
                out[t, off : off + b.shape[1]] += np.asarray(h[s, t], np.float64) @ b[i].T
    return out


def test_overlapping_slices_are_refused_and_the_oracle_adds_them():
    """Slices whose columns overlap would race in the kernels (no atomics): every op
    refuses them, naming both slices; the oracle itself adds one slice after another."""
    rng = np.random.default_rng(0)
    T, R, L = 8, 16, 2
    idx = rng.integers(-1, L, T).astype(np.int32)
    meta = make_metadata(idx, L)
    b = tuple(jnp.asarray(rng.normal(size=(L, 32, R)), jnp.float32) for _ in range(2))
    a = tuple(jnp.asarray(rng.normal(size=(L, R, 24)), jnp.float32) for _ in range(2))
    h = jnp.asarray(rng.normal(size=(2, T, R)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(T, 48)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(T, 24)), jnp.float32)
    with pytest.raises(ValueError, match=r"slices 0 and 1 overlap at columns \[16, 32\)"):
        lora_expand(y, h, b, offsets=(0, 16), **meta, interpret=True)
    with pytest.raises(ValueError, match="slices 0 and 1 overlap"):
        lora_shrink_expand(x, y, a, b, offsets=(0, 16), **meta, interpret=True)
    mapping = lj.make_lora_mapping(jnp.asarray(idx), L)
    for backend in ("xla", "pallas"):
        with pytest.raises(ValueError, match="slices 1 and 0 overlap"):
            ops.lora_expand(y, h, b, mapping, offsets=(16, 0), backend=backend)
    got = lora_expand_reference(y, h, b, offsets=(0, 16), token_lora_indices=jnp.asarray(idx))
    want = _numpy_expand(y, h, b, (0, 16), idx)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def test_a_slice_without_columns_is_refused():
    idx = np.array([0, 1, -1], np.int32)
    meta = make_metadata(idx, 2)
    y, h = jnp.ones((3, 48), jnp.float32), jnp.ones((2, 3, 16), jnp.float32)
    b = (jnp.ones((2, 32, 16), jnp.float32), jnp.ones((2, 0, 16), jnp.float32))
    with pytest.raises(ValueError, match=r"lora_b\[1\] has no columns"):
        lora_expand(y, h, b, offsets=(0, 32), **meta, interpret=True)


def test_slot_ranks_must_be_integers():
    idx = np.array([0, 1, -1], np.int32)
    meta = make_metadata(idx, 2)
    x = jnp.ones((3, 16), jnp.float32)
    a = jnp.ones((2, 16, 16), jnp.float32)
    with pytest.raises(ValueError, match="slot_ranks has dtype float32; expected integers"):
        lora_shrink(x, (a,), **meta, slot_ranks=jnp.array([[2.5, 16.0]]), interpret=True)


def test_an_empty_batch_launches_nothing():
    """Zero tokens: the shrink gives `[S, 0, R]` zeros, the expands give y back, through
    the kernels and through `ops` on either backend."""
    meta = make_metadata(np.zeros(0, np.int32), 4)
    x = jnp.zeros((0, 32), jnp.bfloat16)
    y = jnp.zeros((0, 40), jnp.bfloat16)
    a = (jnp.ones((4, 16, 32), jnp.bfloat16),) * 2
    b = (jnp.ones((4, 24, 16), jnp.bfloat16), jnp.ones((4, 16, 16), jnp.bfloat16))
    h = lora_shrink(x, a, **meta, interpret=True)
    assert h.shape == (2, 0, 16) and h.dtype == jnp.float32
    assert lora_expand(y, h, b, offsets=(0, 24), **meta, interpret=True).shape == (0, 40)
    assert lora_shrink_expand(x, y, a, b, offsets=(0, 24), **meta, interpret=True).shape == (
        0,
        40,
    )
    mapping = lj.make_lora_mapping(np.zeros(0, np.int32), 4)
    for backend in ("xla", "pallas"):
        out = ops.add_lora_linear(y, x, a, b, mapping, 1.0, backend=backend)
        assert out.shape == (0, 40)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.int64, np.uint64])
def test_host_indices_of_any_integer_dtype(dtype):
    """Host indices in unsigned or 64-bit dtypes: the same mapping as int32 indices, and
    a value past int32 is "no adapter", never a slot it would wrap into."""
    idx = np.array([3, 0, 7, 1, 3], dtype)
    if np.iinfo(dtype).max >= 2**32 + 1:
        idx[2] = 2**32 + 1  # wraps to 1 as int32
    m = lj.make_lora_mapping(idx, 4)
    want = np.where(idx.astype(np.float64) < 4, idx.astype(np.int64), -1)
    assert m.token_lora_indices.tolist() == want.tolist()
    ref = lj.make_lora_mapping(want.astype(np.int32), 4)
    assert m.slot_token_counts.tolist() == ref.slot_token_counts.tolist()


def test_xla_path_keeps_each_slots_true_rank():
    """Rank rows past a slot's true rank that are not zero (`slot_ranks` says to skip
    them): the XLA backend masks them as the kernels and the oracle do, on both of its
    paths (gather and one-hot)."""
    rng = np.random.default_rng(1)
    R, L = 16, 3
    ranks = jnp.asarray([[4, 8, 16]], jnp.int32)
    a = (jnp.asarray(rng.normal(size=(L, R, 24)), jnp.float32),)
    b = (jnp.asarray(rng.normal(size=(L, 20, R)), jnp.float32),)
    for T in (2, 12):  # tokens below / above the slots: gather / one-hot
        idx = rng.integers(-1, L, T).astype(np.int32)
        x = jnp.asarray(rng.normal(size=(T, 24)), jnp.float32)
        y = jnp.asarray(rng.normal(size=(T, 20)), jnp.float32)
        h = jnp.asarray(rng.normal(size=(1, T, R)), jnp.float32)
        m = lj.make_lora_mapping(jnp.asarray(idx), L)
        kw = dict(token_lora_indices=jnp.asarray(idx), slot_ranks=ranks)
        got = ops.lora_shrink(x, a, m, 0.5, slot_ranks=ranks, backend="xla")
        want = lora_shrink_reference(x, a, scale=0.5, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        got = ops.lora_expand(y, h, b, m, slot_ranks=ranks, backend="xla")
        want = lora_expand_reference(y, h, b, offsets=(0,), **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_static_arguments_in_any_form_and_traced_scales_named():
    """jax.jit hashed `offsets` (a list or array: a raw hash error) and `scale` (a traced
    or jnp scalar) before the body ran; non-integer offsets were truncated."""
    import jax

    rng = np.random.default_rng(0)
    T, R, L = 8, 16, 2
    idx = rng.integers(-1, L, T).astype(np.int32)
    meta = make_metadata(idx, L)
    a = (jnp.asarray(rng.normal(size=(L, R, 24)), jnp.float32),) * 2
    b = tuple(jnp.asarray(rng.normal(size=(L, 16, R)), jnp.float32) for _ in range(2))
    x = jnp.asarray(rng.normal(size=(T, 24)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(T, 40)), jnp.float32)
    h = lora_shrink(x, a, **meta, scale=0.5, interpret=True)
    want = _numpy_expand(y, h, b, (0, 24), idx)
    for offsets in ([0, 24], np.array([0, 24]), (np.int64(0), jnp.int32(24))):
        got = lora_expand(y, h, b, offsets=offsets, **meta, interpret=True)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
        fused = lora_shrink_expand(x, y, a, b, offsets=offsets, scale=0.5, **meta, interpret=True)
        np.testing.assert_allclose(np.asarray(fused), want, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="offsets must be a sequence of ints"):
        lora_expand(y, h, b, offsets=(0, 24.5), **meta, interpret=True)
    np.testing.assert_array_equal(
        np.asarray(lora_shrink(x, a, **meta, scale=np.float32(0.5), interpret=True)),
        np.asarray(h),
    )
    with pytest.raises(ValueError, match="scale is a static"):
        jax.jit(lambda s: lora_shrink(x, a, **meta, scale=s, interpret=True))(0.5)


def test_block_sizes_fields_must_have_their_types():
    from lora_jax.kernels import BlockSizes

    for kw in ({"block_m": 16.0}, {"split_k": 2.5}, {"num_warps": True}, {"per_token": 1}):
        with pytest.raises(ValueError, match=f"BlockSizes.{next(iter(kw))}="):
            BlockSizes(**kw)
    assert BlockSizes(block_m=np.int64(32)).block_m == 32


def test_the_references_treat_indices_past_the_slots_as_unmapped():
    """lora_jax.mapping makes such indices -1; the references clamped them to the last
    slot (a third answer beside the kernels')."""
    rng = np.random.default_rng(0)
    L, R = 3, 16
    idx = np.array([0, 1, 2, 3, 7, -1], np.int32)
    a = (jnp.asarray(rng.normal(size=(L, R, 24)), jnp.float32),)
    b = (jnp.asarray(rng.normal(size=(L, 16, R)), jnp.float32),)
    x = jnp.asarray(rng.normal(size=(6, 24)), jnp.float32)
    h = lora_shrink_reference(x, a, token_lora_indices=jnp.asarray(idx))
    assert not np.asarray(h)[0, 3:].any() and np.asarray(h)[0, 2].any()
    y = jnp.zeros((6, 16))
    out = lora_expand_reference(y, h + 1.0, b, offsets=(0,), token_lora_indices=jnp.asarray(idx))
    assert not np.asarray(out)[3:].any() and np.asarray(out)[:3].any()


def test_the_references_gather_a_chunk_of_tokens_at_a_time(monkeypatch):
    """With room for 7 tokens' gathered weights, 50 tokens (a partial last chunk, unmapped
    and ranked tokens among them) still give the float64 loop's answer (session 51: at
    16384 tokens, rank 128 the references formed 32 GiB of per-token weights at once and
    ran an 80 GB GPU out of memory)."""
    import jax

    from lora_jax.kernels.shrink_expand import reference

    rng = np.random.default_rng(1)
    T, H, R, L = 50, 24, 16, 4
    monkeypatch.setattr(reference, "_CHUNK_BYTES", 7 * 4 * R * H)
    idx = rng.integers(-1, L, size=T).astype(np.int32)
    ranks = jnp.asarray([[16, 8, 16, 4]], jnp.int32)
    a = jnp.asarray(rng.normal(size=(L, R, H)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(L, H, R)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
    h = lora_shrink_reference(x, (a,), token_lora_indices=jnp.asarray(idx), slot_ranks=ranks)
    chunked = jax.make_jaxpr(
        lambda x: lora_shrink_reference(x, (a,), token_lora_indices=jnp.asarray(idx))
    )(x)
    assert "scan" in str(chunked)  # lax.map over the chunks, not one gather of 50 tokens
    want_h = np.zeros((1, T, R))
    for t, i in enumerate(idx):
        if i >= 0:
            r = int(ranks[0, i])
            want_h[0, t, :r] = np.asarray(x, np.float64)[t] @ np.asarray(a, np.float64)[i, :r].T
    np.testing.assert_allclose(np.asarray(h), want_h, rtol=1e-5, atol=1e-4)
    y = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
    out = lora_expand_reference(y, h, (b,), offsets=(0,), token_lora_indices=jnp.asarray(idx))
    want = _numpy_expand(y, np.asarray(h), (b,), (0,), idx)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-4)
