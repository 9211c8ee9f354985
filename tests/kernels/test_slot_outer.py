"""`lora_slot_outer`, the LoRA stacks' gradient (per slot, the sum over its tokens of
``a[t]^T b[t]``), against its jnp oracle and a float64 loop: interpret mode on the CPU over
shapes x dtypes x mappings x token blocks, the CUDA lowering, its errors, and on a GPU the
compiled kernel at a training step's size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lora_jax.kernels import lora_slot_outer, lora_slot_outer_reference
from tests.kernels.shrink_expand_test_base import (
    abstract_gpu_context,
    make_mapping,
    make_metadata,
)

# (T, P, Q, L): ragged P / Q (masked columns), T past and below one token block, P = rank
# with Q = hidden (dA) and P = width with Q = rank (dB)
SHAPES = [(37, 24, 50, 4), (300, 64, 130, 3), (16, 16, 16, 2), (5, 48, 16, 8), (520, 200, 32, 5)]
MAPPINGS = ["none", "one", "distinct", "sorted", "unsorted"]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-4, jnp.float16: 1e-4}


def _inputs(shape, kind, dtype, seed=0):
    num_tokens, p, q, max_loras = shape
    rng = np.random.default_rng(seed)
    idx = make_mapping(kind, num_tokens, max_loras, rng)
    a = jnp.asarray(rng.normal(size=(num_tokens, p)), dtype)
    b = jnp.asarray(rng.normal(size=(num_tokens, q)), dtype)
    return a, b, idx, make_metadata(idx, max_loras)


def _loop(a, b, idx, max_loras):
    """The float64 oracle: one token at a time into its slot."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    out = np.zeros((max_loras, a.shape[1], b.shape[1]))
    for t, slot in enumerate(np.asarray(idx)):
        if slot >= 0:
            out[slot] += np.outer(a[t], b[t])
    return out


# every shape x mapping, the dtypes taken in turn (each meets every shape and mapping)
CASES = [
    (shape, kind, (jnp.float32, jnp.bfloat16, jnp.float16)[(i + j) % 3])
    for i, shape in enumerate(SHAPES)
    for j, kind in enumerate(MAPPINGS)
    if kind != "distinct" or shape[0] <= shape[3]  # 'distinct' needs T <= max_loras
]


@pytest.mark.parametrize("shape, kind, dtype", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_slot_outer_equals_the_oracles(shape, kind, dtype):
    a, b, idx, meta = _inputs(shape, kind, dtype)
    want = lora_slot_outer_reference(a, b, num_slots=shape[3], **meta)
    scale = max(1.0, float(jnp.max(jnp.abs(want))))
    for block_m in (16, 256):
        got = lora_slot_outer(a, b, **meta, block_m=block_m, interpret=True)
        assert got.shape == (shape[3], shape[1], shape[2]) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype] * scale)
    np.testing.assert_allclose(want, _loop(a, b, idx, shape[3]), rtol=1e-5, atol=1e-4 * scale)
    unused = np.setdiff1d(np.arange(shape[3]), idx)
    np.testing.assert_array_equal(np.asarray(got)[unused], 0.0)  # no token: exactly zero


def test_slot_outer_takes_the_mapping_s_work_list():
    """With the step's schedule for ``block_m`` in ``work_lists`` the kernel walks it (the
    same sums as one it builds)."""
    from lora_jax.mapping import make_lora_mapping

    a, b, idx, _ = _inputs((200, 32, 40, 4), "unsorted", jnp.float32)
    meta = make_lora_mapping(jnp.asarray(idx), 4).kernel_kwargs()
    assert 64 in meta["work_lists"]
    got = lora_slot_outer(a, b, **meta, block_m=64, interpret=True)
    np.testing.assert_allclose(got, _loop(a, b, idx, 4), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a, b, m: (a[0], b, m), "a \\[T, P\\] has shape"),
        (lambda a, b, m: (a, b[:-1], m), "a has 40 tokens and b 39"),
        (lambda a, b, m: (a.astype(jnp.int32), b, m), "a \\[T, P\\] has dtype int32"),
        (
            lambda a, b, m: (a, b, {**m, "sorted_token_ids": m["sorted_token_ids"][:3]}),
            "sorted_token_ids has shape",
        ),
    ],  # fmt: skip
)
def test_slot_outer_names_bad_input(change, match):
    a, b, _, meta = _inputs((40, 16, 16, 4), "unsorted", jnp.float32)
    a, b, meta = change(a, b, meta)
    with pytest.raises(ValueError, match=match):
        lora_slot_outer(a, b, **meta, interpret=True)


def test_slot_outer_refuses_a_token_block_that_is_not_a_power_of_two():
    a, b, _, meta = _inputs((40, 16, 16, 4), "unsorted", jnp.float32)
    with pytest.raises(ValueError, match="block_m=48; expected a power of two"):
        lora_slot_outer(a, b, **meta, block_m=48, interpret=True)


def test_slot_outer_lowers_for_cuda():
    a = jax.ShapeDtypeStruct((4096, 64), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    meta = make_metadata(np.repeat(np.arange(4), 1024), 8)
    with abstract_gpu_context():
        traced = jax.jit(lambda a, b: lora_slot_outer(a, b, **meta)).trace(a, b)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "lora_slot_outer" in text


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["one", "sorted", "unsorted"])
@pytest.mark.parametrize("shape", [(4096, 64, 4096, 8), (4096, 1024, 128, 8), (1000, 48, 520, 3)])
def test_slot_outer_on_the_gpu(shape, kind):
    a, b, idx, meta = _inputs(shape, kind, jnp.bfloat16)
    got = jax.jit(lambda a, b: lora_slot_outer(a, b, **meta))(a, b)
    want = lora_slot_outer_reference(a, b, num_slots=shape[3], **meta)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)


def test_tokens_a_program_grow_with_the_rank():
    """`outer_block_m`: 8 x the smaller output dim (the rank), within 256-1024 tokens, so
    the f32 tiles a program adds stay ~1/4 of the bytes it reads or less."""
    from lora_jax.kernels.shrink_expand.api_grad import outer_block_m

    assert [outer_block_m(r, 4096) for r in (8, 16, 32, 64, 128, 256)] == [
        256, 256, 256, 512, 1024, 1024,
    ]  # fmt: skip
    assert outer_block_m(14336, 64) == outer_block_m(64, 14336) == 512
    for r in (16, 64, 128):
        assert 2 * r / outer_block_m(r, 4096) <= 0.25
