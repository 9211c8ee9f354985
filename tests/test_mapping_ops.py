"""`make_lora_mapping` metadata and the XLA ops against numpy loops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lora_jax as lj
from lora_jax import ops


@pytest.mark.parametrize(
    "idx",
    [[-1, -1, -1], [2, 2, 2, 2], [3, 1, -1, 1, 0, 7, 3], [0, 1, 2, 3], [5]],
)
def test_mapping_metadata(idx):
    L = 4
    m = jax.jit(lj.make_lora_mapping, static_argnums=1)(jnp.asarray(idx, jnp.int32), L)
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


def test_shrink_rows_without_adapter_are_zero():
    m = lj.make_lora_mapping(jnp.array([-1, 0], jnp.int32), 1)
    h = ops.lora_shrink(jnp.ones((2, 4)), [jnp.ones((1, 2, 4))], m, 0.5, backend="xla")
    assert h.dtype == jnp.float32 and h.shape == (1, 2, 2)
    np.testing.assert_array_equal(h[0, 0], 0.0)
    np.testing.assert_allclose(h[0, 1], 2.0)


def test_backend_selection():
    assert ops.resolve_backend("xla") == "xla"
    with pytest.raises(ValueError, match="backend"):
        ops.resolve_backend("cuda")
    with pytest.raises(ValueError, match="backend"):
        ops.set_default_backend("triton")
    if jax.default_backend() != "gpu":
        assert ops.resolve_backend() == "xla"
