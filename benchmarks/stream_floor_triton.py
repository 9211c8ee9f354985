"""The Pallas Triton side of `stream_floor.py` (each Pallas GPU backend in its own file).

Triton loads x with plain (cp.async) loads from every thread rather than TMA boxes.
``triton_x_only`` streams x's tiles and sums each row (so every byte is used);
``triton_full`` is the one-adapter shrink: x @ A.T over the same tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

VARIANTS = ("triton_full", "triton_x_only")


def tile_kernel(
    x, a, *, variant: str, block_m: int, block_k: int, warps: int, stages: int, split: int
):
    """One program per (tile, hidden split), ``block_m`` x ``block_k`` tiles of x per k step;
    its f32 partial goes to out[split, T, R] (x_only: the row sums broadcast over R)."""
    from jax.experimental.pallas import triton as plt

    tokens = x.shape[0]
    rank, hidden = a.shape
    steps = hidden // block_k // split
    width = 1 if variant == "triton_x_only" else rank

    def body(x_ref, a_ref, o_ref):
        tile, part = pl.program_id(0), pl.program_id(1)
        rows = pl.ds(pl.multiple_of(tile * block_m, block_m), block_m)

        def step(k, acc):
            cols = pl.ds(pl.multiple_of((part * steps + k) * block_k, block_k), block_k)
            xt = x_ref[rows, cols]
            if variant == "triton_x_only":
                return acc + jnp.sum(xt.astype(jnp.float32), axis=1, keepdims=True)
            return acc + plt.dot(xt, a_ref[:, cols], trans_b=True)

        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_m, width), jnp.float32))
        o_ref[part, rows, :] = jnp.broadcast_to(acc, (block_m, rank))

    out = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((split, tokens, rank), jnp.float32),
        grid=(tokens // block_m, split),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
    )(x, a)
    return out.sum(0)
