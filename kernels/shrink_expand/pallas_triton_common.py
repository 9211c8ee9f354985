"""What the Pallas Triton kernels share (pallas_triton.py's expand, pallas_triton_shrink.py,
pallas_triton_rect.py, pallas_triton_bgmv.py, pallas_triton_fused.py): the shared-memory
budgets and the expand's tiles fitted to them, the dots' dtype and precision, and the
helpers that read a work block's rows, a slot's true rank and an expand kernel's refs.

Like every ``pallas_triton*`` file, self-contained so that it can be dropped when Mosaic
GPU takes over (see pallas_triton.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp

from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes

# The portable shared-memory budget of one program: under the 48 KiB that a kernel may use
# without opting in. The expand and the fused kernel keep to it; the shrink's tiles may use
# what `opt_in_smem_budget` allows.
SMEM_BUDGET = 45 * 1024

# Per-block shared memory a kernel may opt in to, by CUDA compute capability, less a
# margin for what Triton adds (barriers, layout conversions): H100/H200/B200 227 KiB,
# A100 163 KiB, other Ampere/Ada 99 KiB.
_OPT_IN_SMEM = {(9, 0): 200 * 1024, (10, 0): 200 * 1024, (8, 0): 150 * 1024}
_OPT_IN_SMEM_MAJOR = {8: 90 * 1024}


@functools.cache
def opt_in_smem_budget() -> int:
    """Shared memory the shrink's tiles may use: ``LORA_JAX_TRITON_SMEM_BUDGET``
    (bytes) if set, else by the first GPU's compute capability, else (no GPU) `SMEM_BUDGET`.

    Kernels over 48 KiB launch through jax 0.11.2's Triton custom call on an H200
    (benchmarks/RESULTS.md, session 8: 72-128 KiB shrink tiles ran and checked).
    """
    env = os.environ.get("LORA_JAX_TRITON_SMEM_BUDGET")
    if env:
        return int(env)
    try:
        cc = str(jax.devices("gpu")[0].compute_capability)
        major, minor = (int(v) for v in cc.split(".")[:2])
    except Exception:  # noqa: BLE001 - no GPU (interpret mode, CUDA lowering on CPU)
        return SMEM_BUDGET
    return _OPT_IN_SMEM.get((major, minor), _OPT_IN_SMEM_MAJOR.get(major, SMEM_BUDGET))


def fit_expand_tiles(
    bs: BlockSizes, rank: int, itemsize: int, budget: int | None = None
) -> BlockSizes:
    """Narrower column (then token) tiles until both dot operands fit ``budget``.

    The default is `SMEM_BUDGET`: wider expand tiles over 48 KiB were slower or equal in
    the session-8 H200 sweep (benchmarks/RESULTS.md). Setting LORA_JAX_TRITON_SMEM_BUDGET
    makes it `opt_in_smem_budget()`, for such sweeps.
    """
    if budget is None:
        env = os.environ.get("LORA_JAX_TRITON_SMEM_BUDGET")
        budget = opt_in_smem_budget() if env else SMEM_BUDGET
    rank_p = max(16, 1 << (rank - 1).bit_length())
    bm, bn = bs.block_m, bs.block_n
    while (bm + bn) * rank_p * itemsize > budget and (bn > 16 or bm > 16):
        if bn > 16 and bn >= bm:
            bn //= 2
        else:
            bm //= 2
    return dataclasses.replace(bs, block_m=bm, block_n=bn)


def _dot_precision(dtype):
    # f32 operands: full-precision (IEEE) dots, not TF32, so f32 matches the oracle.
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _block_rows(tab_ref, pid, block_m: int):
    """Slot, row count and the token positions [block_m] of work block ``pid`` (the last
    one repeated), all from the work list's column ``pid``: independent loads."""
    slot = tab_ref[0, pid]
    nrows = tab_ref[2, pid]
    rows = tab_ref[4 + jnp.arange(block_m, dtype=jnp.int32), pid]
    return slot, nrows, rows


def _true_rank(ranks_ref, s: int, slot, rank: int):
    if ranks_ref is None:
        return jnp.int32(rank)
    return jnp.minimum(ranks_ref[s, jnp.maximum(slot, 0)], rank)


def expand_refs(refs, has_ranks: bool, num_slices: int):
    """An expand kernel's refs after its schedule: (slot_ranks [S, L] or None, h [S, T, R],
    S x B [L, n_s, R], the output y [T, N] aliased to the y input)."""
    ranks_ref, refs = (refs[0], refs[1:]) if has_ranks else (None, refs)
    h_ref, rest = refs[0], refs[1:]
    return ranks_ref, h_ref, rest[:num_slices], rest[num_slices + 1]


def _expand_dtype(lora_b, y):
    dtype = lora_b[0].dtype
    if dtype not in (jnp.bfloat16, jnp.float16) or y.dtype == jnp.float32:
        return jnp.float32
    return dtype


def expand_tiles(bs: BlockSizes, lora_b, y) -> BlockSizes:
    """The tiles `expand` runs: column tiles no wider than the widest slice, then fitted
    to shared memory (which may halve ``block_m``: build the work list with the result)."""
    widths = tuple(b.shape[1] for b in lora_b)
    bn = min(bs.block_n, max(16, 1 << (max(widths) - 1).bit_length()))
    itemsize = jnp.dtype(_expand_dtype(lora_b, y)).itemsize
    return fit_expand_tiles(dataclasses.replace(bs, block_n=bn), lora_b[0].shape[2], itemsize)
