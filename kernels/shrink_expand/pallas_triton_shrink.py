"""Pallas Triton shrink: ``out[s, t] = scale * x[t] @ A_s[idx[t]].T`` in f32, all slices
in one launch (exactness rules as in pallas_triton.py).

Grid: (work block, slice, k split x rank block). A shrink that splits the
hidden reduction over ``split_k`` programs either writes f32 partials
[KS, S, T, R] that XLA sums afterwards (deterministic, a second kernel), or,
with ``BlockSizes.atomic_programs`` (the decode default), adds them
atomically into a zeroed output and picks the split when it runs, from the
step's live block count (one launch; the f32 summation order varies from run
to run). The shrink over rectangles of x, for batches of prompts, is in
pallas_triton_rect.py; it shares this file's grid, refs and atomic add.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lora_jax.kernels.shrink_expand import relaxed_atomic
from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes
from lora_jax.kernels.shrink_expand.pallas_triton import (
    _block_rows,
    _dot_precision,
    _true_rank,
    opt_in_smem_budget,
)


def shrink_smem_bytes(bs: BlockSizes, itemsize: int) -> int:
    """The shrink's pipelined x and A tiles in shared memory."""
    return bs.num_stages * (bs.block_m + bs.block_r) * bs.block_k * itemsize


def fit_shrink_tiles(
    bs: BlockSizes, rank: int, itemsize: int, budget: int | None = None
) -> BlockSizes:
    """Fewer pipeline stages, then a shorter k step, until the buffers fit ``budget``
    (default: `opt_in_smem_budget`, what this GPU lets a kernel opt in to)."""
    budget = opt_in_smem_budget() if budget is None else budget
    bs = dataclasses.replace(bs, block_r=min(bs.block_r, max(16, 1 << (rank - 1).bit_length())))
    stages, bk = bs.num_stages, bs.block_k
    while stages * (bs.block_m + bs.block_r) * bk * itemsize > budget:
        if stages > 2:
            stages -= 1
        elif bk > 32:
            bk //= 2
        elif stages > 1:
            stages -= 1
        else:
            break
    return dataclasses.replace(bs, num_stages=stages, block_k=bk)


def shrink_dtype(x_dtype, a_dtype):
    """The dtype the shrink's dots take: bf16 / fp16 where x and A promote to it, else f32
    (accumulation is f32 either way)."""
    dtype = jnp.promote_types(x_dtype, a_dtype)
    return dtype if dtype in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)


def _shrink_tile(x_ref, a_ref, rows, slot, r, r_mask, k, hidden: int | None, dtype, precision):
    """``x[rows, k] @ A[slot, r, k].T`` in f32 for one k step: x gathered by token row,
    columns past ``hidden`` (None: no step reaches past it, no mask) and rank rows
    outside ``r_mask`` masked (no traffic)."""
    x_at = x_ref.at[rows[:, None], k[None, :]]
    if hidden is None:
        xt = plgpu.load(x_at)  # [bm, bk]
        a_mask = r_mask[:, None]
    else:
        k_mask = k < hidden
        xt = plgpu.load(
            x_at, mask=jnp.broadcast_to(k_mask[None, :], (rows.shape[0], k.shape[0])), other=0
        )
        a_mask = r_mask[:, None] & k_mask[None, :]
    at = plgpu.load(
        a_ref.at[slot, r[:, None], k[None, :]],
        mask=jnp.broadcast_to(a_mask, (r.shape[0], k.shape[0])),
        other=0,
    )  # [br, bk]
    return plgpu.dot(xt.astype(dtype), at.astype(dtype), trans_b=True, precision=precision)


def _shrink_refs(refs, has_ranks: bool, num_slices: int):
    """(slot_ranks [S, L] or None, x [T, H], S x A [L, R, H], the refs after them)."""
    ranks_ref, refs = (refs[0], refs[1:]) if has_ranks else (None, refs)
    return ranks_ref, refs[0], refs[1 : 1 + num_slices], refs[1 + num_slices :]


def _grid_ids(n_rb: int, rank_inner: bool, split_inner: int = 0):
    """(block or worker, slice, k split, rank block) of this program. The grid is (block,
    slice, k split x rank block), or with ``rank_inner`` (block x rank block, slice, k
    split): a block's rank blocks launch side by side (`BlockSizes.rank_inner`), or with
    ``split_inner`` (the static grid's split, > 0) (block x k split x rank block, slice,
    1): a block's programs launch side by side and the list's empty tail last
    (`BlockSizes.split_inner`). The persistent grid has no k-split axis (its axis 2 has
    size 1 with ``rank_inner``)."""
    p0, sid, p2 = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if split_inner:
        per_block = split_inner * n_rb
        return p0 // per_block, sid, (p0 % per_block) // n_rb, p0 % n_rb
    if rank_inner:
        return p0 // n_rb, sid, p2, p0 % n_rb
    return p0, sid, p2 // n_rb, p2 % n_rb


def _grid(rows: int, num_slices: int, split: int, n_rb: int, rank_inner: bool, split_inner=False):
    """The launch grid that `_grid_ids` reads: ``rows`` blocks (or workers)."""
    if split_inner:
        return (rows * split * n_rb, num_slices, 1)
    if rank_inner:
        return (rows * n_rb, num_slices, split)
    return (rows, num_slices, split * n_rb)


def _shrink_kernel(
    tab_ref,  # [4 + block_m, NB] int32 (work_list.py)
    *refs,
    num_slices: int,
    has_ranks: bool,
    hidden: int,
    rank: int,
    scale: float,
    compute_dtype,
    bs: BlockSizes,
):
    ranks_ref, x_ref, a_refs, (o_ref,) = _shrink_refs(refs, has_ranks, num_slices)  # [KS, S, T, R]
    bm, bk, br = bs.block_m, bs.block_k, bs.block_r
    n_rb = max(16, 1 << (rank - 1).bit_length()) // br
    pid, sid, ks, rb = _grid_ids(n_rb, bs.rank_inner, bs.split_k if bs.split_inner else 0)
    # Program ks reduces hidden columns [ks * chunk, (ks + 1) * chunk).
    chunk = -(-hidden // (bs.split_k * bk)) * bk
    num_k = chunk // bk
    precision = _dot_precision(compute_dtype)

    for s in range(num_slices):

        @pl.when((sid == s) & (tab_ref[2, pid] > 0))
        def _(s=s):
            slot, _, rows = _block_rows(tab_ref, pid, bm)
            r = rb * br + jnp.arange(br, dtype=jnp.int32)  # [br]
            r_lim = _true_rank(ranks_ref, s, slot, rank)
            live = (slot >= 0) & (rb * br < r_lim) & (ks * chunk < hidden)
            r_mask = r < r_lim
            safe_slot = jnp.maximum(slot, 0)

            def body(kk, acc):
                k = ks * chunk + kk * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk]
                return acc + _shrink_tile(
                    x_ref,
                    a_refs[s],
                    rows,
                    safe_slot,
                    r,
                    r_mask,
                    k,
                    None if hidden % chunk == 0 else hidden,  # no split runs past it
                    compute_dtype,
                    precision,
                )

            r_store = jnp.broadcast_to((r < rank)[None, :], (bm, br))
            o_at = o_ref.at[ks, s, rows[:, None], r[None, :]]

            # Two branches rather than a loop with a dynamic trip count: Triton's
            # scf.for rejects the mixed bound types that lowering produces for it.
            @pl.when(live)
            def _():
                acc = jax.lax.fori_loop(0, num_k, body, jnp.zeros((bm, br), jnp.float32))
                plgpu.store(o_at, acc * jnp.float32(scale), mask=r_store)

            @pl.when(jnp.logical_not(live))
            def _():
                plgpu.store(o_at, jnp.zeros((bm, br), jnp.float32), mask=r_store)


def _add_to(o_ref, idx, val, mask, interpret: bool):
    """``o_ref[idx] += val`` where ``mask``: a relaxed atomic add on the GPU (no program
    reads the output, so no add needs ordering; session 15: Pallas's acquire-release add
    cost 0.7-3.4 us of 12-27 us shrinks). Interpret mode runs the programs one after
    another, so there a read-modify-write is the same thing."""
    if interpret:
        at = o_ref.at[idx]
        plgpu.store(at, plgpu.load(at, mask=mask, other=0) + val, mask=mask)
    else:
        relaxed_atomic.atomic_add(o_ref, idx, val, mask=mask)


def _shrink_atomic_kernel(
    tab_ref,  # [4 + block_m, NB] int32 (work_list.py; row 3: live block count)
    *refs,
    num_slices: int,
    has_ranks: bool,
    hidden: int,
    rank: int,
    scale: float,
    compute_dtype,
    bs: BlockSizes,
    workers: int,
    persistent: bool,
    interpret: bool,
):
    """Split-K with atomic adds; the split is picked here from the step's n_live blocks
    so that about ``workers`` (block, k range) items exist per (slice, rank block), or
    without ``bs.live_split`` it is ``bs.split_k`` over every block of the list.

    persistent: worker w (grid axis 0) takes items w, w + workers, ... in turn.
    Otherwise the grid is (block, slice, k split x rank block), as `_shrink_kernel`'s,
    and programs past n_live blocks or the picked split return at once.
    """
    # The zeroed input that the output [S, T, R] aliases comes before it.
    ranks_ref, x_ref, a_refs, (_, o_ref) = _shrink_refs(refs, has_ranks, num_slices)
    bm, bk, br = bs.block_m, bs.block_k, bs.block_r
    n_rb = max(16, 1 << (rank - 1).bit_length()) // br
    # persistent grid: (worker, slice, rank block); static: (block, slice, k split x rank
    # block); with rank_inner the rank block moves into axis 0 of either, with split_inner
    # (static grid only) the k split and the rank block
    split_inner = bs.split_k if bs.split_inner and not persistent else 0
    pid, sid, ks, rb = _grid_ids(n_rb, bs.rank_inner, split_inner)
    steps = -(-hidden // bk)
    k_lim = None if hidden % bk == 0 else hidden  # no k step runs past hidden: no mask
    precision = _dot_precision(compute_dtype)
    if bs.live_split:
        n_live = tab_ref[3, 0]
        split = jnp.clip(jax.lax.div(jnp.int32(workers), jnp.maximum(n_live, 1)), 1, bs.split_k)
        chunk = jax.lax.div(steps + split - 1, split)  # k steps per item
        n_items = n_live * split
    else:  # no read of the live count: every block of the list, split_k ways
        split = bs.split_k
        chunk = -(-steps // split)
        n_items = tab_ref.shape[1] * split
    r = rb * br + jnp.arange(br, dtype=jnp.int32)  # [br]

    def do_item(s: int, blk, ks):
        slot, nrows, rows = _block_rows(tab_ref, blk, bm)
        r_lim = _true_rank(ranks_ref, s, slot, rank)
        first = ks * chunk
        if isinstance(chunk, int) and steps % chunk == 0:  # every item runs chunk steps
            n_steps = chunk
        else:
            n_steps = jnp.clip(steps - first, 0, chunk)
        live = rb * br < r_lim  # a rank block wholly past the slot's rank: 0
        if not bs.live_split:  # the list's tail (no rows) and unmapped tokens (slot -1)
            live = live & (nrows > 0) & (slot >= 0)
            slot = jnp.maximum(slot, 0)

        def body(kk, acc):
            k = (first + kk) * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk]
            return acc + _shrink_tile(
                x_ref, a_refs[s], rows, slot, r, r < r_lim, k, k_lim, compute_dtype, precision
            )

        @pl.when(live)
        def _():
            acc = jax.lax.fori_loop(0, n_steps, body, jnp.zeros((bm, br), jnp.float32))
            mask = jnp.broadcast_to((r < rank)[None, :], (bm, br))
            if not interpret:  # rows past the count repeat the last token: add it once
                mask = mask & (jnp.arange(bm, dtype=jnp.int32) < nrows)[:, None]
            idx = (s, rows[:, None], r[None, :])
            _add_to(o_ref, idx, acc * jnp.float32(scale), mask, interpret)

    if persistent:
        n_mine = jax.lax.div(jnp.maximum(n_items - pid, 0) + workers - 1, workers)
        for s in range(num_slices):

            @pl.when(sid == s)
            def _(s=s):
                def item(j, carry):
                    i = pid + j * workers
                    do_item(s, jax.lax.div(i, split), jax.lax.rem(i, split))
                    return carry

                jax.lax.fori_loop(0, n_mine, item, 0)

    else:
        for s in range(num_slices):
            run = (sid == s) & (ks < split)
            if bs.live_split:
                run = run & (pid < n_live)

            @pl.when(run)
            def _(s=s):
                do_item(s, pid, ks)


def shrink(x, lora_a, tab, slot_ranks, *, scale: float, bs: BlockSizes, interpret: bool):
    """f32 [S, T, R]. ``tab`` is the work list of work_list.build_work_list."""
    num_tokens, hidden = x.shape
    num_slices = len(lora_a)
    rank = lora_a[0].shape[1]
    rank_p = max(16, 1 << (rank - 1).bit_length())
    br = min(bs.block_r, rank_p)
    compute_dtype = shrink_dtype(x.dtype, lora_a[0].dtype)
    # More splits than k steps would leave programs with nothing to reduce.
    split_k = max(1, min(bs.split_k, -(-hidden // bs.block_k)))
    bs = dataclasses.replace(bs, block_r=br, split_k=split_k)
    bs = fit_shrink_tiles(bs, rank, jnp.dtype(compute_dtype).itemsize)
    has_ranks = slot_ranks is not None
    params = dict(
        num_slices=num_slices,
        has_ranks=has_ranks,
        hidden=hidden,
        rank=rank,
        scale=scale,
        compute_dtype=compute_dtype,
        bs=bs,
    )
    inputs = [tab] + ([slot_ranks] if has_ranks else []) + [x, *lora_a]
    if bs.atomic_programs:
        n_rb = rank_p // br
        workers = max(1, -(-bs.atomic_programs // (num_slices * n_rb)))
        kernel = functools.partial(
            _shrink_atomic_kernel,
            **params,
            workers=workers,
            persistent=bs.persistent,
            interpret=interpret,
        )
        zeros = jnp.zeros((num_slices, num_tokens, rank), jnp.float32)
        if bs.persistent:
            grid = _grid(workers, num_slices, 1, n_rb, bs.rank_inner)
        else:
            grid = _grid(tab.shape[1], num_slices, bs.split_k, n_rb, bs.rank_inner, bs.split_inner)
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(zeros.shape, jnp.float32),
            grid=grid,
            input_output_aliases={len(inputs): 0},
            compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
            interpret=interpret,
            name="lora_shrink_atomic",
        )(*inputs, zeros)
    split_k = bs.split_k
    kernel = functools.partial(_shrink_kernel, **params)
    grid = _grid(tab.shape[1], num_slices, split_k, rank_p // br, bs.rank_inner, bs.split_inner)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split_k, num_slices, num_tokens, rank), jnp.float32),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="lora_shrink",
    )(*inputs)
    # Every (row, k split) is written (zeros where dead), so a plain sum is exact.
    return out[0] if split_k == 1 else jnp.sum(out, axis=0)
