"""Pallas Triton backend: the LoRA stacks' gradient, per slot the sum over its tokens of
outer products, ``out[l] = sum_{t : idx[t] = l} a[t]^T b[t]`` (f32 ``[L, P, Q]``).

With ``a`` the shrink's output cotangent ``dh [T, R]`` and ``b`` its input ``x [T, H]``
this is dA; with ``a`` the expand's output cotangent ``dy [T, n]`` and ``b`` its input
``h [T, R]`` it is dB. XLA has no grouped weight-gradient matmul for GPU (its
`ragged_dot` lowers to a dense one against every group there), so a backward through
XLA multiplies against every slot; this kernel reads each token once, for its own slot.

Grid: (work block, P block, Q block). A work block is up to ``block_m`` tokens of one slot
(work_list.py, the schedule the forward kernels walk); a program sums its tokens'
products ``block_t`` rows at a time into an f32 tile and adds the tile into the zeroed
output atomically (blocks of one slot meet in the same tile). Rows past a block's count
repeat its last token and are masked off on load, so they add nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lora_jax.kernels.shrink_expand.block_sizes import next_pow2
from lora_jax.kernels.shrink_expand.pallas_triton_common import _dot_precision
from lora_jax.kernels.shrink_expand.pallas_triton_shrink import _add_to

BLOCK_T = 64
"""Token rows per dot (the reduction step)."""
BLOCK_PQ = 128
"""The most rows / columns of an output tile."""


def outer_tiles(p: int, q: int, num_tokens: int) -> tuple[int, int, int]:
    """(block_t, block_p, block_q): powers of two of at least 16, as Triton's dots need."""
    block_t = min(BLOCK_T, max(16, next_pow2(num_tokens)))
    return block_t, min(BLOCK_PQ, max(16, next_pow2(p))), min(BLOCK_PQ, max(16, next_pow2(q)))


def _outer_kernel(
    tab_ref,  # [4 + block_m, NB] int32 (work_list.py)
    a_ref,  # [T, P]
    b_ref,  # [T, Q]
    _zeros_ref,  # [L, P, Q] f32, aliased to the output
    o_ref,
    *,
    block_m: int,
    tiles: tuple[int, int, int],
    compute_dtype,
    interpret: bool,
):
    bt, bp, bq = tiles
    blk, pi, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot, nrows = tab_ref[0, blk], tab_ref[2, blk]
    p_dim, q_dim = a_ref.shape[1], b_ref.shape[1]
    p = pi * bp + jnp.arange(bp, dtype=jnp.int32)
    q = qi * bq + jnp.arange(bq, dtype=jnp.int32)
    p_ok, q_ok = p < p_dim, q < q_dim
    precision = _dot_precision(compute_dtype)

    @pl.when((slot >= 0) & (nrows > 0))
    def _():
        def step(i, acc):
            j = i * bt + jnp.arange(bt, dtype=jnp.int32)  # rows of the block
            row_ok = j < nrows
            rows = tab_ref[4 + jnp.minimum(j, block_m - 1), blk]
            at = plgpu.load(
                a_ref.at[rows[:, None], p[None, :]], mask=row_ok[:, None] & p_ok[None, :], other=0
            )
            bt_ = plgpu.load(
                b_ref.at[rows[:, None], q[None, :]], mask=row_ok[:, None] & q_ok[None, :], other=0
            )
            return acc + plgpu.dot(
                at.astype(compute_dtype), bt_.astype(compute_dtype), trans_a=True,
                precision=precision,
            )  # fmt: skip

        steps = (nrows + bt - 1) // bt
        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bp, bq), jnp.float32))
        mask = p_ok[:, None] & q_ok[None, :]
        _add_to(o_ref, (slot, p[:, None], q[None, :]), acc, mask, interpret)


def slot_outer(a, b, tab, *, num_slots: int, block_m: int, interpret: bool):
    """f32 ``[num_slots, P, Q]``: per slot, the sum of ``a[t]^T b[t]`` over its tokens.
    ``tab``: `work_list.build_work_list` with ``block_m``."""
    num_tokens, p_dim = a.shape
    q_dim = b.shape[1]
    tiles = outer_tiles(p_dim, q_dim, num_tokens)
    half = (jnp.bfloat16, jnp.float16)
    compute_dtype = a.dtype if a.dtype == b.dtype and a.dtype in half else jnp.float32
    kernel = functools.partial(
        _outer_kernel,
        block_m=block_m,
        tiles=tiles,
        compute_dtype=compute_dtype,
        interpret=interpret,
    )
    grid = (tab.shape[1], -(-p_dim // tiles[1]), -(-q_dim // tiles[2]))
    zeros = jnp.zeros((num_slots, p_dim, q_dim), jnp.float32)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(zeros.shape, jnp.float32),
        grid=grid,
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="lora_slot_outer",
    )(tab, a, b, zeros)
