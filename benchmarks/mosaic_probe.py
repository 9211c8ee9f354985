"""The Mosaic GPU (TMA + WGMMA) shrink alone against the Triton shrink and a plain dot.

For each (T, R, layout): checks the Mosaic kernel's rows against the jnp oracle (and that
it leaves every other row alone), then times, from a profiler trace (GPU busy time per
call, ``calls`` different calls inside one jit, each with its own x and weights):

* ``mosaic``: the Mosaic kernel over its pieces (`work_list.segment_items`, built outside the timing
  like the work lists), writing into a zeroed buffer;
* ``split``: `lora_shrink(mosaic=True)`, the library's Hopper default from 1024 tokens:
  the Triton kernel over the tokens outside pieces, then the Mosaic kernel;
* ``triton``: `lora_shrink(mosaic=False)`, the Triton kernel alone (all tokens);
* ``hinted``: `lora_shrink` with the host's hints (`work_list.prompt_tiles` and
  `whole_tiles` of each call's indices), what a serving step runs: at ranks 16-64 with
  every tile whole, the Triton rectangle shrink;
* ``dense``: one plain XLA dot with slot 0's weights for every token (a floor, n = 1 only).

Layouts: ``one`` (every token one adapter), ``runs8`` (prompts of 256-2048 tokens, each
one of 8 adapters, in order), ``evenN`` (N adapters, one equal run each: `ops.py --layout
runs`), ``shuffled64`` (64 adapters, tokens shuffled: no pieces).

    python3 -P benchmarks/mosaic_probe.py --tokens 4096,16384 --ranks 16,64,128 --out out/m.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ops as ops_bench  # noqa: E402  (the trace timer and the metadata helper)

from lora_jax.kernels import lora_shrink, lora_shrink_reference  # noqa: E402
from lora_jax.kernels.shrink_expand import mosaic_gpu_shrink as mg  # noqa: E402
from lora_jax.kernels.shrink_expand import work_list as wl  # noqa: E402

MAX_LORAS = 64


def layout(name: str, tokens: int, rng) -> np.ndarray:
    if name == "one":
        return np.full(tokens, 7, np.int64)
    if name == "runs8":
        chosen = rng.permutation(MAX_LORAS)[:8]
        out, t = [], 0
        while t < tokens:
            n = min(int(rng.integers(256, 2049)), tokens - t)
            out.append(np.full(n, chosen[rng.integers(8)]))
            t += n
        return np.concatenate(out)
    if name.startswith("even"):  # evenN: N adapters, one run each, equal (ops.py --layout runs)
        n = int(name[4:])
        chosen = rng.permutation(MAX_LORAS)[:n]
        return np.repeat(chosen, -(-tokens // n))[:tokens]
    if name == "shuffled64":
        return rng.permutation(np.arange(tokens) % MAX_LORAS)
    raise ValueError(f"layout {name!r}; expected one, runs8, evenN or shuffled64")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ranks", default="16,64,128")
    p.add_argument("--layouts", default="one,runs8,shuffled64")
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--stages", type=int, default=0, help="0: the rank's default")
    p.add_argument("--block-k", type=int, default=64)
    p.add_argument(
        "--impls",
        default="mosaic,split,triton,hinted,dense",
        help="what to time (a tile sweep needs only mosaic); the others print nan",
    )
    p.add_argument("--split", type=int, default=0)
    p.add_argument("--programs", type=int, default=0, help="persistent grid; 0: one per SM")
    p.add_argument(
        "--variants",
        default="",
        help="comma-separated block_m:stages:split:programs[:ws] tiles to time the Mosaic "
        "kernel with, one row each (0: the default of each; ws 1 or 2: warp-specialized, "
        "with that many WGMMA warpgroups); the other impls run with the first only",
    )
    p.add_argument("--out", default="")
    args = p.parse_args()
    ops_bench.TIMER = "trace"

    def tiles_for(rank: int) -> list[mg.MosaicTiles]:
        specs = (
            args.variants.split(",")
            if args.variants
            else [f"{args.block_m}:{args.stages}:{args.split}:{args.programs}"]
        )
        out = []
        for spec in specs:
            bm, stages, split, programs, *flag = map(int, spec.split(":"))
            wgs = flag[0] if flag else 0  # WGMMA warpgroups of the warp-specialized form
            ws = wgs > 0
            out.append(
                mg.MosaicTiles(
                    block_m=bm,
                    block_k=args.block_k,
                    stages=stages or mg.default_tiles(rank, bm, warp_specialized=ws).stages,
                    split_k=split,
                    programs=programs,
                    warp_specialized=ws,
                    compute_wgs=max(wgs, 1),
                )
            )
        return out

    rows = []
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print(
        "| T | R | layout | tiles (block_m:stages:split:programs) | mosaic rows "
        "| max rel err (kernel / split / hinted) | mosaic µs | split µs | triton µs "
        "| hinted µs | dense µs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in map(int, args.tokens.split(",")):
        for r in map(int, args.ranks.split(",")):
            for lay, (vi, tiles) in itertools.product(
                args.layouts.split(","), enumerate(tiles_for(r))
            ):
                rng = np.random.default_rng(0)
                k = jax.random.key(0)
                h = args.hidden
                xs = [
                    jax.random.normal(jax.random.fold_in(k, 100 + i), (t, h), jnp.bfloat16)
                    for i in range(args.calls)
                ]
                ws = [
                    jax.random.normal(jax.random.fold_in(k, i), (MAX_LORAS, r, h), jnp.bfloat16)
                    * h**-0.5
                    for i in range(args.calls)
                ]
                idxs = [layout(lay, t, rng) for _ in range(args.calls)]
                metas = [ops_bench.metadata(i, MAX_LORAS) for i in idxs]
                items = [
                    wl.segment_items(
                        m["token_lora_indices"],
                        block_m=tiles.block_m,
                        max_pieces=wl.SEGMENT_MAX_PIECES,
                    )
                    for m in metas
                ]
                zeros = jnp.zeros((1, t, r), jnp.float32)

                def mosaic_one(x, a, it, zeros=zeros, tiles=tiles):
                    return mg.shrink(x, (a,), it[0], zeros, None, scale=1.0, tiles=tiles)

                # correctness of call 0: its rows vs the oracle, other rows untouched (0)
                got = jax.jit(mosaic_one)(xs[0], ws[0], items[0])[0]
                mine = items[0][1]
                ref = lora_shrink_reference(
                    xs[0], (ws[0],), token_lora_indices=metas[0]["token_lora_indices"]
                )[0]
                want = jnp.where(mine[:, None], ref, 0.0)
                err = float(
                    jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)
                )
                n_mine = int(jnp.sum(mine))
                impls = args.impls.split(",") if vi == 0 else ["mosaic"]
                nan = float("nan")
                err_s = nan
                if "split" in impls:  # the default split path at these tokens
                    split = lora_shrink(xs[0], (ws[0],), **metas[0], mosaic=True)[0]
                    err_s = float(
                        jnp.max(jnp.abs(split - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)
                    )

                def timed(fn, *lists, per_call=None):
                    per_call = per_call or [{}] * args.calls
                    f = jax.jit(lambda *ls: [fn(*z, **k) for z, k in zip(zip(*ls), per_call)])
                    return ops_bench.time_calls(f.lower(*lists).compile(), lists, args.calls)

                hints = [
                    dict(prompt_tiles=wl.prompt_tiles(i), whole_tiles=wl.whole_tiles(i))
                    for i in idxs
                ]
                err_h = nan
                if "hinted" in impls:
                    hinted = lora_shrink(xs[0], (ws[0],), **metas[0], **hints[0])[0]
                    err_h = float(
                        jnp.max(jnp.abs(hinted - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)
                    )

                us_m = timed(mosaic_one, xs, ws, items) if "mosaic" in impls else nan
                us_s = (
                    timed(lambda x, a, m: lora_shrink(x, (a,), **m, mosaic=True), xs, ws, metas)
                    if "split" in impls
                    else nan
                )
                us_t = (
                    timed(lambda x, a, m: lora_shrink(x, (a,), **m, mosaic=False), xs, ws, metas)
                    if "triton" in impls
                    else nan
                )
                us_h = (
                    timed(
                        lambda x, a, m, **h: lora_shrink(x, (a,), **m, **h)[0],
                        xs,
                        ws,
                        metas,
                        per_call=hints,
                    )
                    if "hinted" in impls
                    else nan
                )
                us_d = (
                    timed(
                        lambda x, a: jnp.einsum(
                            "th,rh->tr", x, a[0], preferred_element_type=jnp.float32
                        ),
                        xs,
                        ws,
                    )
                    if lay == "one" and "dense" in impls
                    else nan
                )
                row = dict(
                    tokens=t,
                    rank=r,
                    layout=lay,
                    mosaic_rows=n_mine,
                    max_rel_err=err,
                    mosaic_us=us_m,
                    split_us=us_s,
                    triton_us=us_t,
                    hinted_us=us_h,
                    hinted_err=err_h,
                    hints=hints[0],
                    dense_us=us_d,
                    tiles=str(tiles),
                )
                rows.append(row)
                ws_tag = f":ws{tiles.compute_wgs}" if tiles.warp_specialized else ""
                print(
                    f"| {t} | {r} | {lay} | {tiles.block_m}:{tiles.stages}:"
                    f"{tiles.split_k}:{tiles.programs}{ws_tag} "
                    f"| {n_mine} | {err:.1e} / {err_s:.1e} / {err_h:.1e} | {us_m:.1f} "
                    f"| {us_s:.1f} | {us_t:.1f} | {us_h:.1f} | {us_d:.1f} |",
                    flush=True,
                )
    ops_bench.write_json(args.out, rows)


if __name__ == "__main__":
    main()
