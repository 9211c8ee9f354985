"""Pallas Triton per-token shrink and expand (Punica's BGMV): one program per token and
k range (shrink) or column tile (expand), each reading its own token's adapter.

The segment kernels (pallas_triton.py, pallas_triton_shrink.py) gather a block of up to
``block_m`` tokens of one adapter and feed the tensor cores; in a decode step where most
tokens have an adapter of their own, each such block holds one token, and its program
waits on a work-list load, then on its x and A tiles, item after item. Here a program
reads ``token_lora_indices[t]`` and then its whole tile of the adapter at once, and forms
the products on the CUDA cores in f32 (a [block_r, block_k] tile times one x row, summed
along k): no work list, no sort, no dot shape constraint on the token count. Tokens that
share an adapter read its rows again, from L2.

Numerics: products of the inputs in f32, summed in f32 (the shrink as the segment kernels;
the expand first rounds h as the segment expand does for the tensor cores, to the weights'
bf16 / fp16 unless y is f32: `pallas_triton._expand_dtype`, so a token's numbers do not
depend on which kernel the step's hint picks). Selected with ``BlockSizes(per_token=True)``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes, next_pow2
from lora_jax.kernels.shrink_expand.pallas_triton import _expand_dtype, _true_rank, expand_refs
from lora_jax.kernels.shrink_expand.pallas_triton_shrink import _add_to, _shrink_refs


def _row_dot(tile, row):
    """``tile [n, k] @ row [k]`` in f32 on the CUDA cores: [n]."""
    return jnp.sum(tile.astype(jnp.float32) * row.astype(jnp.float32)[None, :], axis=1)


def _shrink_kernel(
    idx_ref,  # [T] int32: token_lora_indices
    *refs,
    num_slices: int,
    has_ranks: bool,
    hidden: int,
    rank: int,
    scale: float,
    bs: BlockSizes,
    interpret: bool,
):
    ranks_ref, x_ref, a_refs, rest = _shrink_refs(refs, has_ranks, num_slices)
    o_ref = rest[-1]  # [S, T, R] f32 (split > 1: aliased to a zeroed input)
    t, sid, p2 = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    br, bk, split = bs.block_r, bs.block_k, bs.split_k
    n_rb = max(16, next_pow2(rank)) // br
    ks, rb = p2 // n_rb, p2 % n_rb
    steps = -(-hidden // bk)
    chunk = -(-steps // split)  # k steps per program (static)
    masked = chunk * split * bk != hidden  # some step reaches past hidden
    slot = idx_ref[t]
    r = rb * br + jnp.arange(br, dtype=jnp.int32)  # [br]
    out_mask = r < rank

    for s in range(num_slices):

        @pl.when(sid == s)
        def _(s=s):
            r_lim = _true_rank(ranks_ref, s, slot, rank)
            live = (slot >= 0) & (rb * br < r_lim)
            r_mask = r < r_lim
            safe = jnp.maximum(slot, 0)

            def body(kk, acc):
                k = (ks * chunk + kk) * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk]
                if masked:
                    k_ok = k < hidden
                    xt = plgpu.load(x_ref.at[t, k], mask=k_ok, other=0)
                    a_mask = r_mask[:, None] & k_ok[None, :]
                else:
                    xt = plgpu.load(x_ref.at[t, k])
                    a_mask = jnp.broadcast_to(r_mask[:, None], (br, bk))
                at = plgpu.load(a_refs[s].at[safe, r[:, None], k[None, :]], mask=a_mask, other=0)
                return acc + _row_dot(at, xt)

            def total():
                acc = jnp.zeros((br,), jnp.float32)
                if chunk == 1:
                    return body(0, acc) * jnp.float32(scale)
                return jax.lax.fori_loop(0, chunk, body, acc) * jnp.float32(scale)

            o_at = o_ref.at[s, t, r]
            if split == 1:

                @pl.when(live)
                def _():
                    plgpu.store(o_at, total(), mask=out_mask)

                @pl.when(jnp.logical_not(live))
                def _():
                    plgpu.store(o_at, jnp.zeros((br,), jnp.float32), mask=out_mask)

            else:  # the k ranges' sums are added into the zeroed output

                @pl.when(live)
                def _():
                    _add_to(o_ref, (s, t, r), total(), out_mask, interpret)


def shrink(x, lora_a, token_lora_indices, slot_ranks, *, scale: float, bs: BlockSizes, interpret):
    """f32 [S, T, R]: a program per (token, slice, k range x rank block)."""
    num_tokens, hidden = x.shape
    num_slices = len(lora_a)
    rank = lora_a[0].shape[1]
    rank_p = max(16, next_pow2(rank))
    br = min(bs.block_r, rank_p)
    bk = min(bs.block_k, max(16, next_pow2(hidden)))
    split = max(1, min(bs.split_k, -(-hidden // bk)))  # no k range without a step
    bs = dataclasses.replace(bs, block_r=br, block_k=bk, split_k=split)
    has_ranks = slot_ranks is not None
    kernel = functools.partial(
        _shrink_kernel,
        num_slices=num_slices,
        has_ranks=has_ranks,
        hidden=hidden,
        rank=rank,
        scale=scale,
        bs=bs,
        interpret=interpret,
    )
    inputs = [token_lora_indices.astype(jnp.int32)]
    inputs += ([slot_ranks] if has_ranks else []) + [x, *lora_a]
    out_shape = jax.ShapeDtypeStruct((num_slices, num_tokens, rank), jnp.float32)
    aliases = {}
    if split > 1:
        aliases = {len(inputs): 0}
        inputs.append(jnp.zeros(out_shape.shape, jnp.float32))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_tokens, num_slices, split * (rank_p // br)),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="lora_shrink_bgmv",
    )(*inputs)


def _expand_kernel(
    idx_ref,  # [T] int32: token_lora_indices
    *refs,
    num_slices: int,
    has_ranks: bool,
    offsets: tuple[int, ...],
    widths: tuple[int, ...],
    rank: int,
    bs: BlockSizes,
    compute_dtype,
):
    ranks_ref, h_ref, b_refs, y_ref = expand_refs(refs, has_ranks, num_slices)
    t, sid, grp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bn, tiles = bs.block_n, bs.tiles_n
    rank_p = max(16, next_pow2(rank))
    slot = idx_ref[t]
    r = jnp.arange(rank_p, dtype=jnp.int32)

    for s in range(num_slices):
        n_s, off = widths[s], offsets[s]
        blocks_s = -(-n_s // bn)

        @pl.when((sid == s) & (slot >= 0) & (grp * tiles < blocks_s))
        def _(s=s, n_s=n_s, off=off, blocks_s=blocks_s):
            r_mask = r < _true_rank(ranks_ref, s, slot, rank)
            ht = plgpu.load(h_ref.at[s, t, r], mask=r_mask, other=0)
            ht = ht.astype(compute_dtype).astype(jnp.float32)  # the segment expand's rounding

            def tile(j, carry):
                c = (grp * tiles + j) * bn + jnp.arange(bn, dtype=jnp.int32)  # [bn]
                c_ok = c < n_s
                y_at = y_ref.at[t, off + c]
                yt = plgpu.load(y_at, mask=c_ok, other=0)  # in flight while B loads
                bt = plgpu.load(
                    b_refs[s].at[slot, c[:, None], r[None, :]],
                    mask=c_ok[:, None] & r_mask[None, :],
                    other=0,
                )  # [bn, rank_p]
                new = yt.astype(jnp.float32) + _row_dot(bt, ht)
                plgpu.store(y_at, new.astype(y_ref.dtype), mask=c_ok)
                return carry

            if tiles == 1:
                tile(0, 0)
            else:
                jax.lax.fori_loop(0, jnp.minimum(tiles, blocks_s - grp * tiles), tile, 0)


def expand(y, h, lora_b, token_lora_indices, slot_ranks, *, offsets, bs: BlockSizes, interpret):
    """New y [T, N]: a program per (token, slice, group of ``tiles_n`` column tiles)."""
    num_slices = len(lora_b)
    rank = lora_b[0].shape[2]
    widths = tuple(b.shape[1] for b in lora_b)
    bn = min(bs.block_n, max(16, next_pow2(max(widths))))
    max_tiles = -(-max(widths) // bn)
    tiles = max(1, min(bs.tiles_n, max_tiles))
    bs = dataclasses.replace(bs, block_n=bn, tiles_n=tiles)
    has_ranks = slot_ranks is not None
    kernel = functools.partial(
        _expand_kernel,
        num_slices=num_slices,
        has_ranks=has_ranks,
        offsets=tuple(offsets),
        widths=widths,
        rank=rank,
        bs=bs,
        compute_dtype=_expand_dtype(lora_b, y),
    )
    inputs = [token_lora_indices.astype(jnp.int32)]
    inputs += ([slot_ranks] if has_ranks else []) + [h, *lora_b, y]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(y.shape[0], num_slices, -(-max_tiles // tiles)),
        input_output_aliases={len(inputs) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="lora_expand_bgmv",
    )(*inputs)
