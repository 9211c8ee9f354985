"""Fused decode LoRA with the shrink's hidden dim split over the whole grid: one launch.

``y[t, off_s:off_s+n_s] += scale * (x[t] @ A_s[idx[t]].T) @ B_s[idx[t]].T``

`pallas_triton_fused` recomputes a block's whole shrink in every program that expands
it, so each program walks the hidden dim alone and the launch is latency-bound
(session 3). The 2-launch path (`lora_shrink` + `lora_expand`) splits the hidden dim but
pays a launch, a fill and a drain twice. This kernel keeps one launch and splits the
hidden dim, with a barrier across the grid between the two halves:

1. A persistent grid of ``programs`` (at most one per SM, so all are resident at once)
   walks the shrink's items (live work block, slice, hidden chunk of ``chunk_k``
   columns) in turn and stores each item's f32 partial ``x[rows, chunk] @ A_s[slot,
   :, chunk].T`` to its own place in a partial-sum buffer [chunks, S, T, R] (plain
   stores: nothing to zero, no atomics on data).
2. Each program then raises its flag and waits until every program's flag is up: a
   block barrier (`debug_barrier`) orders its threads' stores before the flag's
   acquire-release exchange at GPU scope, and the waiting loop reads the flags with
   acquire-release atomic ORs of 0, so the partials that any program stored are visible
   after. (Not atomic adds of 0: jax 0.11's Triton lowering turns a vector int32 add
   into an f32 add, which flushes a flag of 1, a denormal, to 0 — the first try hung.)
   Only the flags need zeroing (one int32 per program).
3. The same programs walk the expand's items (live work block, slice, column tile):
   sum the block's partials over the chunks, scale, round to B's dtype,
   and add ``h @ B_s[slot, tile].T`` into y's tile (aliased; y's bytes move once).

Interpret mode runs programs one after another, so a program waiting for the others
would wait forever: there (``split_phases``) the two halves run as two launches of the
same kernel, the second reading the first's partials.

Measured (H100, benchmarks/RESULTS.md, session 59): correct, but slower than the pair it
would replace. 32 square 4096 layers at 64 tokens over 8 adapters, rank 16: 17.7 µs a
layer against 13.9 (GPU busy 12.9 against 7.0: each program's items are chains of
dependent loads, and the barrier waits for the slowest program); the Llama-shaped decode
step over 8 adapters 12.6 ms against 9.9. So it is opt-in (`lora_shrink_expand(split=)`,
``LORA_JAX_FUSED_SPLIT`` for the "pallas_fused" backend).

Rows past a block's count repeat its last real token (same values to the same row),
unmapped tokens form no live block, and rank columns past ``slot_ranks`` are masked on
load, as in pallas_triton.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lora_jax.kernels.shrink_expand.block_sizes import next_pow2
from lora_jax.kernels.shrink_expand.pallas_triton import (
    _block_rows,
    _dot_precision,
    _true_rank,
    expand_tile,
)
from lora_jax.kernels.shrink_expand.pallas_triton_shrink import _shrink_tile

__all__ = ["SplitTiles", "shrink_expand_split"]

BOTH, SHRINK, EXPAND = "both", "shrink", "expand"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitTiles:
    """Static tiling of the split fused kernel.

    Example::

        y = shrink_expand_split(x, y, (a,), (b,), tab, None, offsets=(0,), scale=1.0,
                                tiles=SplitTiles(programs=132), interpret=False)
    """

    block_m: int = 16
    """Tokens per work block (the work list's ``block_m``; Triton dots need >= 16)."""
    block_k: int = 128
    """Hidden columns per shrink step."""
    chunk_k: int = 512
    """Hidden columns per shrink item (a multiple of ``block_k``): the split's grain."""
    block_n: int = 128
    """Output columns per expand item."""
    programs: int = 132
    """Programs of the persistent grid. All must be resident together (the barrier):
    keep it at or under the GPU's SM count."""
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_k", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"SplitTiles.{name}={v}: use a power of two >= 16.")
        if self.chunk_k < self.block_k or self.chunk_k % self.block_k:
            raise ValueError(
                f"SplitTiles.chunk_k={self.chunk_k}: use a multiple of block_k={self.block_k}."
            )
        if self.programs < 1:
            raise ValueError(f"SplitTiles.programs={self.programs}: must be >= 1.")


def _items_of(pid, total, programs: int):
    """How many of ``total`` items program ``pid`` takes (items pid, pid + P, ...)."""
    return jnp.maximum(total - pid + programs - 1, 0) // programs


def _wait_for_all(flags_ref, pid, programs: int):
    """Raise this program's flag, then wait until all ``programs`` flags are up."""
    plgpu.debug_barrier()  # every thread's partial stores before the flag
    plgpu.atomic_xchg(flags_ref, (pid,), jnp.int32(1))
    lanes = jnp.arange(next_pow2(programs), dtype=jnp.int32)
    ok = lanes < programs

    def raised(_):  # an OR of 0 reads the flags (jax 0.11's vector int add is an f32 add)
        f = plgpu.atomic_or(flags_ref, (jnp.where(ok, lanes, 0),), jnp.zeros_like(lanes), mask=ok)
        return jnp.sum(jnp.where(ok, f, 0))

    jax.lax.while_loop(lambda n: n < programs, raised, raised(0))
    plgpu.debug_barrier()


def _kernel(
    tab_ref,  # [4 + block_m, NB] int32 (work_list.py; row 3: live block count)
    *refs,
    phase: str,
    num_slices: int,
    has_ranks: bool,
    offsets: tuple[int, ...],
    widths: tuple[int, ...],
    hidden: int,
    rank: int,
    scale: float,
    shrink_dtype,
    expand_dtype,
    tiles: SplitTiles,
):
    ranks_ref, refs = (refs[0], refs[1:]) if has_ranks else (None, refs)
    x_ref, refs = refs[0], refs[1:]
    a_refs, b_refs = refs[:num_slices], refs[num_slices : 2 * num_slices]
    refs = refs[2 * num_slices :]
    if phase == BOTH:  # ins: y, flags; outs: y, partials, flags
        _, _, y_ref, part_ref, flags_ref = refs
    elif phase == SHRINK:  # ins: (none past B); outs: partials
        (part_ref,) = refs
    else:  # ins: y, partials; outs: y
        _, part_ref, y_ref = refs
    pid = pl.program_id(0)
    programs = tiles.programs
    bm, bk, bn = tiles.block_m, tiles.block_k, tiles.block_n
    steps = tiles.chunk_k // bk
    chunks = -(-hidden // tiles.chunk_k)
    rank_p = max(16, next_pow2(rank))
    r = jnp.arange(rank_p, dtype=jnp.int32)
    live = tab_ref[3, 0]
    k_limit = None if hidden % tiles.chunk_k == 0 else hidden

    if phase in (BOTH, SHRINK):
        shrink_precision = _dot_precision(shrink_dtype)
        per_block = num_slices * chunks

        def shrink_item(i, carry):
            item = pid + i * programs
            blk, rest = item // per_block, item % per_block
            sid, ch = rest // chunks, rest % chunks
            slot, _, rows = _block_rows(tab_ref, blk, bm)
            for s in range(num_slices):

                @pl.when(sid == s)
                def _(s=s):
                    r_mask = r < _true_rank(ranks_ref, s, slot, rank)

                    def step(kk, acc):
                        k = (ch * steps + kk) * bk + jnp.arange(bk, dtype=jnp.int32)
                        return acc + _shrink_tile(
                            x_ref, a_refs[s], rows, slot, r, r_mask, k, k_limit, shrink_dtype,
                            shrink_precision,
                        )  # fmt: skip

                    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bm, rank_p), jnp.float32))
                    plgpu.store(part_ref.at[ch, s, rows[:, None], r[None, :]], acc)

            return carry

        jax.lax.fori_loop(0, _items_of(pid, live * per_block, programs), shrink_item, 0)

    if phase == BOTH:
        _wait_for_all(flags_ref, pid, programs)

    if phase in (BOTH, EXPAND):
        expand_precision = _dot_precision(expand_dtype)
        counts = [-(-w // bn) for w in widths]
        starts = [sum(counts[:s]) for s in range(num_slices)]
        per_block = sum(counts)

        def expand_item(i, carry):
            item = pid + i * programs
            blk, tile = item // per_block, item % per_block
            slot, _, rows = _block_rows(tab_ref, blk, bm)
            for s in range(num_slices):

                @pl.when((tile >= starts[s]) & (tile < starts[s] + counts[s]))
                def _(s=s):
                    r_mask = r < _true_rank(ranks_ref, s, slot, rank)
                    h = jnp.zeros((bm, rank_p), jnp.float32)
                    for ch in range(chunks):  # independent loads, all in flight
                        h += plgpu.load(part_ref.at[ch, s, rows[:, None], r[None, :]])
                    h = (h * jnp.float32(scale)).astype(expand_dtype)
                    c = (tile - starts[s]) * bn + jnp.arange(bn, dtype=jnp.int32)
                    expand_tile(
                        y_ref, b_refs[s], h, rows, slot, r, r_mask, c, widths[s], offsets[s],
                        expand_dtype, expand_precision, None,
                    )  # fmt: skip

            return carry

        jax.lax.fori_loop(0, _items_of(pid, live * per_block, programs), expand_item, 0)


def _launch(phase, x, y, lora_a, lora_b, tab, slot_ranks, part, *, common, tiles, interpret):
    num_tokens = x.shape[0]
    num_slices = len(lora_a)
    rank_p = max(16, next_pow2(lora_a[0].shape[1]))
    chunks = -(-x.shape[1] // tiles.chunk_k)
    part_shape = jax.ShapeDtypeStruct((chunks, num_slices, num_tokens, rank_p), jnp.float32)
    head = [tab] + ([slot_ranks] if slot_ranks is not None else []) + [x, *lora_a, *lora_b]
    if phase == BOTH:
        flags = jnp.zeros((tiles.programs,), jnp.int32)
        inputs = head + [y, flags]
        out_shape = (
            jax.ShapeDtypeStruct(y.shape, y.dtype),
            part_shape,
            jax.ShapeDtypeStruct(flags.shape, flags.dtype),
        )
        aliases = {len(head): 0, len(head) + 1: 2}
    elif phase == SHRINK:
        inputs, out_shape, aliases = head, (part_shape,), {}
    else:
        inputs = head + [y, part]
        out_shape, aliases = (jax.ShapeDtypeStruct(y.shape, y.dtype),), {len(head): 0}
    kernel = functools.partial(_kernel, phase=phase, tiles=tiles, **common)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(tiles.programs,),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=interpret,
        name=f"lora_shrink_expand_split_{phase}",
    )(*inputs)


def shrink_expand_split(
    x,
    y,
    lora_a,
    lora_b,
    tab,
    slot_ranks,
    *,
    offsets: tuple[int, ...],
    scale: float,
    shrink_dtype,
    expand_dtype,
    tiles: SplitTiles,
    interpret: bool,
    split_phases: bool = False,
):
    """New y [T, N] with every slice's adapter contribution added (module docstring).

    ``tab``: the work list of ``tiles.block_m`` (work_list.py). ``split_phases`` (always
    in interpret mode) runs the shrink and the expand as two launches instead of one
    with the barrier.
    """
    common = dict(
        num_slices=len(lora_a),
        has_ranks=slot_ranks is not None,
        offsets=tuple(offsets),
        widths=tuple(b.shape[1] for b in lora_b),
        hidden=x.shape[1],
        rank=lora_a[0].shape[1],
        scale=float(scale),
        shrink_dtype=shrink_dtype,
        expand_dtype=expand_dtype,
    )
    run = functools.partial(
        _launch, x=x, y=y, lora_a=lora_a, lora_b=lora_b, tab=tab, slot_ranks=slot_ranks,
        common=common, tiles=tiles, interpret=interpret,
    )  # fmt: skip
    if split_phases or interpret:
        (part,) = run(SHRINK, part=None)
        (y_out,) = run(EXPAND, part=part)
        return y_out
    y_out, _, _ = run(BOTH, part=None)
    return y_out
