"""Where the Mosaic shrink's time goes: the same TMA pipeline with parts taken away.

The segment shrink (`mosaic_gpu_shrink`) streams x and the adapter through a TMA +
WGMMA pipeline. At 4096 x 4096, rank 64 it has sat near 12.6 µs for sessions (the ideal
at 4.3 TB/s is 8.2 µs). This probe times simpler kernels with the kernel's tiling, one
tile x hidden-split job per program (no work list, no stream-K, no reduce-add), each a
step further from a bare read, so the difference between two rows is what one part costs:

* ``full``: x and A tiles through the pipeline, WGMMA, the f32 tile stored (a partial
  per hidden split, plain TMA stores);
* ``no_mma``: the same copies, no WGMMA, a zero tile stored;
* ``x_only``: only x's tiles copied, a zero tile stored;
* ``xla_sum`` / ``dense``: XLA reading x once (a row sum) and the cuBLAS dot x @ A.T;
* with ``--triton-tiles``: the Pallas Triton variants of `stream_floor_triton.py` (plain
  loads instead of TMA boxes).

``--pads`` widens x's rows (a stride that is not a power of two); a tile spec ending in
``:i`` interleaves the hidden splits. Session 20's findings are in benchmarks/RESULTS.md.

    python3 -P benchmarks/stream_floor.py --tokens 4096 --ranks 64,128 --out out/f.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ops as ops_bench  # noqa: E402  (the trace timer)
import stream_floor_triton  # noqa: E402

VARIANTS = ("full", "no_mma", "x_only")


def tile_kernel(
    x, a, *, variant: str, block_m: int, block_k: int, stages: int, split: int, order: str = "b"
):
    """One program per (tile, hidden split): stream its x tile (and A's columns), then,
    for ``full``, store its f32 partial into out[split, T, R]. x may have more columns
    than A (a padded row stride); only A's are read. ``order``: "b" gives each split a
    block of k steps, "i" interleaves them (split p takes steps p, p + split, ...), so
    the programs of one tile read adjacent columns at the same time."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tokens = x.shape[0]
    rank, hidden = a.shape
    steps = hidden // block_k // split
    programs = tokens // block_m * split

    def body(x_ref, a_ref, o_ref):
        prog = jax.lax.axis_index("prog")
        tile, part = prog // split, prog % split

        def col(k):
            return k * split + part if order == "i" else part * steps + k

        x_spec = plgpu.BlockSpec((block_m, block_k), lambda k: (tile, col(k)), delay_release=1)
        a_spec = plgpu.BlockSpec((rank, block_k), lambda k: (0, col(k)), delay_release=1)

        def pipeline(acc_ref):
            if variant == "x_only":
                plgpu.emit_pipeline(
                    lambda _, xs: None,
                    grid=(steps,),
                    in_specs=[x_spec],
                    max_concurrent_steps=stages,
                )(x_ref)
            else:
                plgpu.emit_pipeline(
                    lambda _, xs, As: (
                        plgpu.wgmma(acc_ref, xs, As.transpose((1, 0)))
                        if variant == "full"
                        else None
                    ),
                    grid=(steps,),
                    in_specs=[x_spec, a_spec],
                    max_concurrent_steps=stages,
                )(x_ref, a_ref)
            return acc_ref[...]

        # every variant stores its (for no_mma / x_only: zero) tile, so the kernel has an
        # effect XLA keeps and the variants differ only in the pipeline
        acc = pl.run_scoped(pipeline, plgpu.ACC((block_m, rank), jnp.float32))

        def store(o_smem):
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[part, pl.ds(tile * block_m, block_m)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(store, plgpu.SMEM((block_m, rank), jnp.float32))

    out = jax.new_ref(jnp.zeros((split, tokens, rank), jnp.float32))
    pl.kernel(
        body,
        out_type=(),
        mesh=plgpu.Mesh(grid=(programs,), grid_names=("prog",)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x, a, out)
    return jax.freeze(out).sum(0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="4096")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ranks", default="64,128")
    p.add_argument("--calls", type=int, default=8)
    p.add_argument(
        "--tiles",
        default="128:64:6:4",
        help="comma list of block_m:block_k:stages:split[:order] (programs = T / block_m *"
        " split; order b: a block of k steps per split, i: interleaved)",
    )
    p.add_argument("--pads", default="0", help="comma list: extra columns in x's rows")
    p.add_argument(
        "--triton-tiles",
        default="",
        help="comma list of block_m:block_k:warps:stages:split for the Pallas Triton "
        "variants (stream_floor_triton.py); empty: none",
    )
    p.add_argument("--triton-variants", default=",".join(stream_floor_triton.VARIANTS))
    p.add_argument("--variants", default=",".join(VARIANTS), help="empty: none")
    p.add_argument("--out", default="")
    args = p.parse_args()
    ops_bench.TIMER = "trace"
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print(
        "| T | R | tiles (block_m:block_k:stages:split) | variant | µs | kernel µs | x GB/s "
        "| max rel err |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    key = jax.random.key(0)
    for t, pad in itertools.product(
        map(int, args.tokens.split(",")), map(int, args.pads.split(","))
    ):
        h = args.hidden
        xs = [
            jax.random.normal(jax.random.fold_in(key, 100 + i), (t, h + pad), jnp.bfloat16)
            for i in range(args.calls)
        ]
        for r in map(int, args.ranks.split(",")):
            ws = [
                jax.random.normal(jax.random.fold_in(key, i), (r, h), jnp.bfloat16) * h**-0.5
                for i in range(args.calls)
            ]
            want = jnp.dot(xs[0][:, :h], ws[0].T, preferred_element_type=jnp.float32)
            cases = [("xla_sum", None), ("dense", None)]
            for spec in args.tiles.split(","):
                for v in filter(None, args.variants.split(",")):
                    cases.append((v, tuple(spec.split(":"))))
            for spec in filter(None, args.triton_tiles.split(",")):
                for v in args.triton_variants.split(","):
                    cases.append((v, tuple(spec.split(":"))))
            for name, tiles in cases:
                if name == "xla_sum":
                    fn = lambda x, a: jnp.sum(x[:, : a.shape[1]], axis=1, dtype=jnp.float32)  # noqa: E731
                elif name == "dense":
                    fn = lambda x, a: jnp.dot(
                        x[:, : a.shape[1]], a.T, preferred_element_type=jnp.float32
                    )  # noqa: E731
                elif name.startswith("triton"):
                    bm, bk, nw, st, sp = map(int, tiles)
                    atomic = name in stream_floor_triton.ATOMIC_VARIANTS
                    fn = functools.partial(
                        stream_floor_triton.tile_kernel_atomic
                        if atomic
                        else stream_floor_triton.tile_kernel,
                        variant=name,
                        block_m=bm,
                        block_k=bk,
                        warps=nw,
                        stages=st,
                        split=sp,
                    )
                else:
                    bm, bk, st, sp = map(int, tiles[:4])
                    order = tiles[4] if len(tiles) > 4 else "b"
                    # the deepest pipeline up to ``st`` whose buffers + f32 tile fit 200 KiB
                    per_row = bm + (0 if name == "x_only" else r)
                    while st > 2 and st * per_row * bk * 2 + bm * r * 4 > 200 * 1024:
                        st -= 1
                    tiles = (bm, bk, st, sp, order)
                    fn = functools.partial(
                        tile_kernel,
                        variant=name,
                        block_m=bm,
                        block_k=bk,
                        stages=st,
                        split=sp,
                        order=order,
                    )
                err = float("nan")
                try:
                    checked = ("full", "dense", "triton_full", *stream_floor_triton.ATOMIC_VARIANTS)
                    if name in checked:
                        got = jax.jit(fn)(xs[0], ws[0])
                        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                    f = jax.jit(lambda xl, wl, fn=fn: [fn(x, w) for x, w in zip(xl, wl)])
                    us = ops_bench.time_calls(f.lower(xs, ws).compile(), (xs, ws), args.calls)
                except Exception as e:  # noqa: BLE001 - report the cell, go on
                    why = f"{type(e).__name__}: {str(e)[:200]}"
                    print(f"| {t} | {r} | {tiles} | {name} | failed: {why} |")
                    continue
                kernels = {
                    k[:60]: round(v / args.calls, 2) for k, v in ops_bench.LAST_KERNELS.items()
                }
                gbps = t * h * 2 / us / 1e3
                own = sum(
                    v
                    for k, v in kernels.items()
                    if "mosaic" in k or "body" in k or name in ("xla_sum",)
                )
                rows.append(
                    dict(
                        tokens=t,
                        pad=pad,
                        rank=r,
                        tiles=tiles,
                        variant=name,
                        us=us,
                        x_gbps=gbps,
                        max_rel_err=err,
                        kernels_us=kernels,
                    )
                )
                tl = ":".join(map(str, tiles)) if tiles else "–"
                cells = f"{us:.2f} | {own:.2f} | {gbps:.0f} | {err:.1e}"
                print(f"| {t} | {r} | {tl} | {name} | {cells} | pad {pad} |", flush=True)
                print(f"    kernels µs/call: {kernels}", flush=True)
    ops_bench.write_json(args.out, rows)


if __name__ == "__main__":
    main()
