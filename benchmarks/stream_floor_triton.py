"""The Pallas Triton side of `stream_floor.py` (each Pallas GPU backend in its own file).

Triton loads x with plain (cp.async) loads from every thread rather than TMA boxes.
``triton_x_only`` streams x's tiles and sums each row (so every byte is used);
``triton_full`` is the one-adapter shrink: x @ A.T over the same tiles;
``triton_x_acc`` streams x's tiles into an elementwise f32 sum in registers (no cross-lane
work until each program's end, no dot: the loads alone, the way XLA's fusions read).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

VARIANTS = ("triton_full", "triton_x_only", "triton_x_acc")
ATOMIC_VARIANTS = (
    "triton_full_atomic",
    "triton_full_dep",
    "triton_full_rows",
    "triton_full_rows_cold",
)
"""The dot over the same tiles, each split's partial added atomically (relaxed) into a
zeroed [T, R] output as the library's shrink adds its own; ``triton_full_dep`` also reads
its block's first row from a table in memory before its first load of x, as the library's
programs read their work list (a dependent round trip before x streams);
``triton_full_rows`` reads all its block's rows from a column of a [4 + block_m, blocks]
table, as the library's work list holds them, and gathers x's tiles by those rows;
``triton_full_rows_cold`` reads the same table from a constant of its own call (built on
the host, so no kernel writes it just before: it comes from HBM, as the library's work
lists, built once per step, do), where ``triton_full_rows`` builds it in the call (an XLA
fusion writes it into L2 just before the kernel reads it)."""

_COLD_TABLES = [0]  # tables made so far: each call's constant differs (no merging)


def tile_kernel(
    x, a, *, variant: str, block_m: int, block_k: int, warps: int, stages: int, split: int
):
    """One program per (tile, hidden split), ``block_m`` x ``block_k`` tiles of x per k step;
    its f32 partial goes to out[split, T, R] (x_only: the row sums broadcast over R)."""
    from jax.experimental.pallas import triton as plt

    tokens = x.shape[0]
    rank, hidden = a.shape
    steps = hidden // block_k // split
    width = rank if variant == "triton_full" else 1
    acc_shape = (block_m, block_k) if variant == "triton_x_acc" else (block_m, width)

    def body(x_ref, a_ref, o_ref):
        tile, part = pl.program_id(0), pl.program_id(1)
        rows = pl.ds(pl.multiple_of(tile * block_m, block_m), block_m)

        def step(k, acc):
            cols = pl.ds(pl.multiple_of((part * steps + k) * block_k, block_k), block_k)
            xt = x_ref[rows, cols]
            if variant == "triton_x_only":
                return acc + jnp.sum(xt.astype(jnp.float32), axis=1, keepdims=True)
            if variant == "triton_x_acc":
                return acc + xt.astype(jnp.float32)
            return acc + plt.dot(xt, a_ref[:, cols], trans_b=True)

        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(acc_shape, jnp.float32))
        if variant == "triton_x_acc":
            acc = jnp.sum(acc, axis=1, keepdims=True)
        o_ref[part, rows, :] = jnp.broadcast_to(acc, (block_m, rank))

    out = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((split, tokens, rank), jnp.float32),
        grid=(tokens // block_m, split),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
    )(x, a)
    return out.sum(0)


def tile_kernel_atomic(
    x, a, *, variant: str, block_m: int, block_k: int, warps: int, stages: int, split: int
):
    """`ATOMIC_VARIANTS`: one program per (tile, hidden split), its partial added into the
    zeroed f32 [T, R] output (no partial-sum kernel after it)."""
    from jax.experimental.pallas import triton as plt

    from lora_jax.kernels.shrink_expand.pallas_triton_shrink import _add_to

    tokens = x.shape[0]
    rank, hidden = a.shape
    steps = hidden // block_k // split
    starts = jnp.arange(tokens // block_m, dtype=jnp.int32) * block_m
    if variant == "triton_full_rows":  # the work list's layout: row 4 + i holds row i
        starts = jnp.concatenate(
            [jnp.zeros((4, starts.shape[0]), jnp.int32), starts + jnp.arange(block_m)[:, None]]
        )
    if variant == "triton_full_rows_cold":  # the same table, a host constant of this call
        import numpy as np

        table = np.zeros((4 + block_m, tokens // block_m), np.int32)
        table[4:] = np.arange(tokens // block_m)[None, :] * block_m + np.arange(block_m)[:, None]
        table[0] = _COLD_TABLES[0]  # row 0 is not read: it only makes the constant distinct
        _COLD_TABLES[0] += 1
        starts = jnp.asarray(table)
        variant = "triton_full_rows"

    def body(t_ref, x_ref, a_ref, _, o_ref):
        tile, part = pl.program_id(0), pl.program_id(1)
        if variant == "triton_full_rows":
            ids = t_ref[4 + jnp.arange(block_m, dtype=jnp.int32), tile]
            rows = ids[:, None]
        else:
            first = t_ref[tile] if variant == "triton_full_dep" else tile * block_m
            rows = pl.ds(pl.multiple_of(first, block_m), block_m)
            ids = first + jnp.arange(block_m, dtype=jnp.int32)

        def step(k, acc):
            cols = pl.ds(pl.multiple_of((part * steps + k) * block_k, block_k), block_k)
            if variant == "triton_full_rows":
                kk = (part * steps + k) * block_k + jnp.arange(block_k, dtype=jnp.int32)
                xt = plt.load(x_ref.at[rows, kk[None, :]])
            else:
                xt = x_ref[rows, cols]
            return acc + plt.dot(xt, a_ref[:, cols], trans_b=True)

        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_m, rank), jnp.float32))
        mask = jnp.broadcast_to((ids < tokens)[:, None], (block_m, rank))
        idx = (ids[:, None], jnp.arange(rank, dtype=jnp.int32)[None, :])
        _add_to(o_ref, idx, acc, mask, interpret=False)

    zeros = jnp.zeros((tokens, rank), jnp.float32)
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct(zeros.shape, jnp.float32),
        grid=(tokens // block_m, split),
        input_output_aliases={3: 0},
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
    )(starts, x, a, zeros)


# The one-adapter ops over rectangles of consecutive tokens, for `ops.py --impls rect`
# (n = 1 cells only, like its `dense` floor): what the Triton kernels would run if a
# prompt tile's rows were read as one rectangle instead of gathered through the token list.
SHRINK_RECT_TILES = {64: (64, 128, 4, 3, 4), 128: (128, 64, 8, 4, 4)}
"""rank -> block_m, block_k, warps, stages, split (session 20 run 7's best at T = 4096;
ranks up to 64 take the rank-64 tiles)."""
EXPAND_RECT_TILES = (64, 128, 4)
"""block_m, block_n, warps."""


def parse_tiles(spec: str, default):
    """``"rect:64:128:4:3:4"`` -> (64, 128, 4, 3, 4); ``"rect"`` -> ``default``."""
    parts = spec.split(":")[1:]
    return tuple(map(int, parts)) if parts else default


def shrink_rect(x, a, *, tiles=None, interpret: bool = False):
    """``x @ a.T`` in f32 [T, R] over ``block_m`` x ``block_k`` rectangles of x, the hidden
    split's partials added atomically (relaxed) into a zeroed output."""
    from jax.experimental.pallas import triton as plt

    from lora_jax.kernels.shrink_expand.pallas_triton_shrink import _add_to

    tokens = x.shape[0]
    rank, hidden = a.shape
    bm, bk, warps, stages, split = tiles or SHRINK_RECT_TILES[max(64, rank)]
    steps = hidden // bk // split
    if tokens % bm or hidden % (bk * split):
        raise ValueError(
            f"shrink_rect: T={tokens}, H={hidden} must divide into {bm} x {bk * split}"
        )

    def body(x_ref, a_ref, zero_ref, o_ref):
        del zero_ref  # aliased to o_ref
        tile, part = pl.program_id(0), pl.program_id(1)
        rows = pl.ds(pl.multiple_of(tile * bm, bm), bm)

        def step(k, acc):
            cols = pl.ds(pl.multiple_of((part * steps + k) * bk, bk), bk)
            return acc + plt.dot(x_ref[rows, cols], a_ref[:, cols], trans_b=True)

        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bm, rank), jnp.float32))
        _add_to(o_ref, (rows, pl.ds(0, rank)), acc, jnp.ones((bm, rank), bool), interpret)

    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((tokens, rank), jnp.float32),
        grid=(tokens // bm, split),
        input_output_aliases={2: 0},
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
    )(x, a, jnp.zeros((tokens, rank), jnp.float32))


def expand_rect(y, h, b, *, tiles=None, interpret: bool = False):
    """``y + h @ b.T`` (h: [T, R] f32, cast to b's dtype; sums in f32, cast once) over
    ``block_m`` x ``block_n`` rectangles of y, in place."""
    from jax.experimental.pallas import triton as plt

    tokens, width = y.shape
    bm, bn, warps = tiles or EXPAND_RECT_TILES
    if tokens % bm or width % bn:
        raise ValueError(f"expand_rect: y {y.shape} must divide into {bm} x {bn} tiles")

    def body(y_ref, h_ref, b_ref, o_ref):
        rows = pl.ds(pl.multiple_of(pl.program_id(0) * bm, bm), bm)
        cols = pl.ds(pl.multiple_of(pl.program_id(1) * bn, bn), bn)
        ht = h_ref[rows, :].astype(b_ref.dtype)
        delta = plt.dot(ht, b_ref[cols, :], trans_b=True)
        o_ref[rows, cols] = (y_ref[rows, cols].astype(jnp.float32) + delta).astype(o_ref.dtype)

    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(tokens // bm, width // bn),
        input_output_aliases={0: 0},
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
    )(y, h, b)
