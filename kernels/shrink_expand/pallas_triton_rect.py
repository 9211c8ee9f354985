"""Pallas Triton shrink over rectangles of x: ``out[s, t] = scale * x[t] @ A_s[idx[t]].T``
in f32 where the host found every mapped token in aligned tiles wholly of one slot
(`work_list.whole_tiles` "all": a batch of prompts).

No work list and no sort: a program takes ``block_m`` consecutive tokens, reads its
block's slot from the first of them and x's rows as one rectangle (a tile the software
pipeline streams, where the work-list kernel of pallas_triton_shrink.py gathers rows). The
hidden reduction splits into ``split_k`` k ranges added atomically into a zeroed output, or,
with no split, each tile is stored whole. ``BlockSizes.x_first`` asks for a program's first
x tile before its slot's read comes back (session 43). The tiles it runs by default are
`tuning_long_shrink.rect_shrink_tiles`'.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# The split-K add through the module, so a probe that swaps `_add_to` reaches this kernel
# too (benchmarks/shrink_probe.py).
from lora_jax.kernels.shrink_expand import pallas_triton_shrink as shrink_lib
from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes
from lora_jax.kernels.shrink_expand.pallas_triton import _dot_precision, _true_rank


def _rect_kernel(
    idx_ref,  # [T] int32: token_lora_indices
    *refs,
    num_slices: int,
    has_ranks: bool,
    hidden: int,
    rank: int,
    scale: float,
    compute_dtype,
    bs: BlockSizes,
    pair: int,
    interpret: bool,
):
    """One (block of ``block_m`` consecutive tokens, slice, k range x rank block) item: x's
    rows read as a rectangle, the block's slot read from its first token (every block is
    one slot's or has no mapped token: `rect_shrink`), the partial added atomically; with
    ``split_k`` 1 the tile is stored whole (zeros where the block or rank block has no
    work), so the output needs no zeroing first. ``pair`` > 0: the block is two host tiles
    of ``pair`` rows; where both are one slot's, their rows make one rectangle (A's tile
    loaded once for both), else each tile is its own (added atomically: ``split_k`` > 1)."""
    ranks_ref, x_ref, a_refs, (_, o_ref) = shrink_lib._shrink_refs(refs, has_ranks, num_slices)
    bm, bk, br = bs.block_m, bs.block_k, bs.block_r
    n_rb = max(16, 1 << (rank - 1).bit_length()) // br
    blk, sid, ks, rb = shrink_lib._grid_ids(n_rb, rank_inner=bs.rank_inner)
    chunk = hidden // bk // bs.split_k  # k steps per item (rect_shrink: they divide)
    precision = _dot_precision(compute_dtype)
    row0 = pl.multiple_of(blk * bm, bm)
    slot = idx_ref[row0]
    r = rb * br + jnp.arange(br, dtype=jnp.int32)  # [br]
    plain = bs.split_k == 1
    x_first = bs.x_first
    num_tokens = o_ref.shape[1]

    def rectangle(s, start, rows: int, slot, when):
        """Rows [start, start + rows) of slot ``slot`` (-1: none) where ``when``."""
        r_lim = _true_rank(ranks_ref, s, slot, rank)
        live = (slot >= 0) & (rb * br < r_lim)
        a_mask = jnp.broadcast_to((r < r_lim)[:, None], (br, bk))
        ids = start + jnp.arange(rows, dtype=jnp.int32)
        idx = (s, ids[:, None], r[None, :])
        out_mask = (ids < num_tokens)[:, None] & (r < rank)[None, :]
        # x_first: the loop does not wait on the slot (A's tiles do): the first k step's x
        # tile is requested at once, the others only where the block is live; rows past
        # the tokens exist only in a tail block, whose x is masked
        x_rows = (ids < num_tokens)[:, None] if x_first and num_tokens % rows else None
        if plain and not x_first:  # rows past the tokens only in a tail block, which has no slot

            @pl.when(when & jnp.logical_not(live))
            def _():
                plgpu.store(o_ref.at[idx], jnp.zeros((rows, br), jnp.float32), mask=out_mask)

        @pl.when(when if x_first else when & live)
        def _():
            safe = jnp.maximum(slot, 0)
            mask_a = a_mask & live if x_first else a_mask

            def body(kk, acc):
                k0 = pl.multiple_of((ks * chunk + kk) * bk, bk)
                if not x_first:
                    xt = x_ref[pl.ds(start, rows), pl.ds(k0, bk)]  # [rows, bk]
                else:  # a constant mask in the pipeline's first step: no wait on the slot
                    x_mask = jnp.broadcast_to(live | (kk == 0), (rows, bk))
                    if x_rows is not None:
                        x_mask = x_mask & x_rows
                    xt = plgpu.load(
                        x_ref.at[pl.ds(start, rows), pl.ds(k0, bk)], mask=x_mask, other=0
                    )
                k = k0 + jnp.arange(bk, dtype=jnp.int32)
                at = plgpu.load(a_refs[s].at[safe, r[:, None], k[None, :]], mask=mask_a, other=0)
                return acc + plgpu.dot(
                    xt.astype(compute_dtype),
                    at.astype(compute_dtype),
                    trans_b=True,
                    precision=precision,
                )

            acc = jax.lax.fori_loop(0, chunk, body, jnp.zeros((rows, br), jnp.float32))
            val = acc * jnp.float32(scale)
            # a live block is whole (every row is a token); x_first runs a tail block too
            mask = out_mask if x_first else jnp.broadcast_to((r < rank)[None, :], (rows, br))
            if x_first:  # a dead block's x may hold inf: its zeros stay zeros
                val = jnp.where(live, val, 0.0)
            if plain:
                plgpu.store(o_ref.at[idx], val, mask=mask)
            elif x_first:

                @pl.when(live)
                def _():
                    shrink_lib._add_to(o_ref, idx, val, mask, interpret)

            else:
                shrink_lib._add_to(o_ref, idx, val, mask, interpret)

    for s in range(num_slices):
        if not pair:
            rectangle(s, row0, bm, slot, sid == s)
            continue
        second = row0 + pair  # a tail past the tokens has no slot
        slot2 = jnp.where(second < num_tokens, idx_ref[jnp.minimum(second, num_tokens - 1)], -1)
        same = slot == slot2
        rectangle(s, row0, bm, slot, (sid == s) & same)
        rectangle(s, row0, pair, slot, (sid == s) & jnp.logical_not(same))
        rectangle(s, second, pair, slot2, (sid == s) & jnp.logical_not(same))


def rect_shrink(
    x,
    lora_a,
    token_lora_indices,
    slot_ranks,
    *,
    scale: float,
    bs: BlockSizes,
    interpret: bool,
    tile: int | None = None,
):
    """f32 [S, T, R] where every block of ``bs.block_m`` consecutive tokens is wholly one
    slot's or has no mapped token (the host's `work_list.whole_tiles` "all", whose tiles
    ``block_m`` divides): no work list, x read in rectangles, each block's slot from its
    first token. A block that breaks the rule is computed with its first token's slot.
    ``bs.split_k`` k ranges (it must divide the hidden size's ``block_k`` steps), added
    atomically into a zeroed output; ``bs.rank_inner``: a block's rank blocks side by
    side in launch order (the second reads x from L2). ``tile``: the host's whole tiles'
    rows, where ``bs.block_m`` is twice them (blocks of two tiles, `_rect_kernel`'s
    ``pair``; it needs ``split_k`` > 1)."""
    num_tokens, hidden = x.shape
    num_slices = len(lora_a)
    rank = lora_a[0].shape[1]
    rank_p = max(16, 1 << (rank - 1).bit_length())
    compute_dtype = shrink_lib.shrink_dtype(x.dtype, lora_a[0].dtype)
    bs = dataclasses.replace(bs, block_r=min(bs.block_r, rank_p))
    if hidden % (bs.block_k * bs.split_k):
        raise ValueError(
            f"rect_shrink: hidden={hidden} is not a multiple of block_k x split_k = "
            f"{bs.block_k} x {bs.split_k}."
        )
    pair = tile if tile is not None and bs.block_m == 2 * tile else 0
    if pair and bs.x_first:
        raise ValueError(
            f"rect_shrink: block_m={bs.block_m} is two {tile}-row tiles; x_first=True is for "
            f"blocks of one tile only."
        )
    if pair and bs.split_k == 1:
        raise ValueError(
            f"rect_shrink: block_m={bs.block_m} is two {tile}-row tiles, which add their "
            f"partial sums atomically; it needs split_k > 1 (got 1)."
        )
    has_ranks = slot_ranks is not None
    kernel = functools.partial(
        _rect_kernel,
        pair=pair,
        num_slices=num_slices,
        has_ranks=has_ranks,
        hidden=hidden,
        rank=rank,
        scale=scale,
        compute_dtype=compute_dtype,
        bs=bs,
        interpret=interpret,
    )
    inputs = [token_lora_indices.astype(jnp.int32)]
    inputs += ([slot_ranks] if has_ranks else []) + [x, *lora_a]
    shape = (num_slices, num_tokens, rank)
    aliases = {}
    if bs.split_k > 1:  # the k ranges add into zeros
        aliases = {len(inputs): 0}
        inputs.append(jnp.zeros(shape, jnp.float32))
    else:  # every tile is stored whole: the kernel's signature has a placeholder input
        kernel = functools.partial(_without_zeros, kernel)
    blocks = -(-num_tokens // bs.block_m)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32),
        grid=shrink_lib._grid(blocks, num_slices, bs.split_k, rank_p // bs.block_r, bs.rank_inner),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="lora_shrink_rect",
    )(*inputs)


def _without_zeros(kernel, *refs):
    """``kernel`` (which reads its refs as (..., zeros, out)) on refs with no zeros input."""
    return kernel(*refs[:-1], None, refs[-1])
