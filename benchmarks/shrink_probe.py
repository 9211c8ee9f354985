"""Where the Triton shrink's (or expand's) time goes: the default kernel against copies of
it with one part taken out (a diagnostic: those copies compute wrong results and are
never checked).

For each cell (shuffled tokens, as the ops grid), from a profiler trace (GPU busy time
per call, ``calls`` different calls inside one jit, each with its own x and weights):

* ``default``: `lora_shrink` as the library runs it (checked against the jnp oracle);
* ``acq_rel``: the atomic split's adds as Pallas's own (acquire-release) atomic add, the
  library's default before session 15 (``LORA_JAX_RELAXED_ATOMICS=0``);
* ``store``: the atomic split's adds made plain stores (what the atomics cost);
* ``no_x``: x's tiles not loaded (ones instead): what reading x costs;
* ``no_a``: the adapter tiles not loaded: what reading A costs;
* ``no_xa``: neither loaded: what is left (launch, work list, dots, adds);
* ``partials``: the default tiles with the split's partials written to [split, S, T, R]
  and summed by XLA (no atomics, a second kernel), a real alternative;
* ``static_slot`` (the rectangle shrink: ``--layout runs``): every block's slot a
  constant 0 instead of its first token's, read from memory (what waiting on that read
  costs before x's tiles are requested);
* ``x_first``: the rectangle tiles with `BlockSizes.x_first` (their default since
  session 43), ``x_later`` without it (session 42's default): real alternatives.

``--layout runs`` gives each adapter's tokens one run (prompts), and the shrink then runs
as the library does with the host's whole-tiles hint (the rectangle kernel where its rule
takes it).

``--op expand`` (`lora_expand`, y updated in place as in the ops benchmark): ``default``;
``no_y`` (y's tiles not loaded: the delta stored alone), ``no_b`` (B's tiles not loaded),
``no_yb`` (neither).

    python3 -P benchmarks/shrink_probe.py --cells 4096x4096x64x64,1024x8192x64x8 --out out/p.json

A cell is ``TxHxRxn`` (tokens, hidden, rank, adapters of 64 slots).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ops as ops_bench  # noqa: E402  (cells, inputs, the oracle check and the trace timer)

from lora_jax.kernels.shrink_expand import pallas_triton as ptx  # noqa: E402
from lora_jax.kernels.shrink_expand import pallas_triton_rect as prect  # noqa: E402
from lora_jax.kernels.shrink_expand import pallas_triton_shrink as pts  # noqa: E402
from lora_jax.kernels.shrink_expand import tuning_long_shrink  # noqa: E402
from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes, next_pow2  # noqa: E402

VARIANTS = {
    "shrink": (
        "default",
        "acq_rel",
        "store",
        "no_x",
        "no_a",
        "no_xa",
        "partials",
        "static_slot",
        "x_first",
        "x_later",
    ),
    "expand": ("default", "no_y", "no_b", "no_yb"),
}


def _plain_store(o_ref, idx, val, mask, interpret):
    del interpret
    pts.plgpu.store(o_ref.at[idx], val, mask=mask)


def _tile_without(part: str):
    """`_shrink_tile` with x's and/or A's load (``part`` holds "x", "a") replaced by ones."""

    def tile(x_ref, a_ref, rows, slot, r, r_mask, k, hidden, dtype, precision):
        plgpu = pts.plgpu
        if "x" in part:
            xt = jnp.ones((rows.shape[0], k.shape[0]), dtype)
        else:
            xt = plgpu.load(x_ref.at[rows[:, None], k[None, :]])
        if "a" in part:
            at = jnp.ones((r.shape[0], k.shape[0]), dtype)
        else:
            at = plgpu.load(
                a_ref.at[slot, r[:, None], k[None, :]],
                mask=jnp.broadcast_to(r_mask[:, None], (r.shape[0], k.shape[0])),
                other=0,
            )
        return plgpu.dot(xt.astype(dtype), at.astype(dtype), trans_b=True, precision=precision)

    return tile


def _expand_tile_without(part: str):
    """`expand_tile` with y's and/or B's load (``part`` holds "y", "b") skipped."""

    def tile(y_ref, b_ref, h, rows, slot, r, r_mask, c, n_s, off, dtype, precision, row_ok):
        plgpu = ptx.plgpu
        c_mask = c < n_s
        col_mask = jnp.broadcast_to(c_mask[None, :], (h.shape[0], c.shape[0]))
        y_at = y_ref.at[rows[:, None], off + c[None, :]]
        if "y" in part:
            yt = jnp.zeros((h.shape[0], c.shape[0]), jnp.float32)
        else:
            yt = plgpu.load(y_at, mask=col_mask, other=0)
        if "b" in part:
            bt = jnp.ones((c.shape[0], r.shape[0]), dtype)
        else:
            bt = plgpu.load(
                b_ref.at[slot, c[:, None], r[None, :]],
                mask=c_mask[:, None] & r_mask[None, :],
                other=0,
            )
        delta = plgpu.dot(h, bt.astype(dtype), trans_b=True, precision=precision)
        if row_ok is not None:
            col_mask = col_mask & row_ok[:, None]
        plgpu.store(y_at, (yt.astype(jnp.float32) + delta).astype(y_ref.dtype), mask=col_mask)

    return tile


class _SlotZero:
    """An index ref whose every read is slot 0 (no load)."""

    def __getitem__(self, i):
        return jnp.int32(0)


def _rect_static_slot(rect_kernel):
    def kernel(idx_ref, *refs, **kw):
        del idx_ref
        return rect_kernel(_SlotZero(), *refs, **kw)

    return kernel


@contextlib.contextmanager
def patched(variant: str):
    """The kernel module with ``variant``'s part taken out, while tracing."""
    saved = pts._add_to, pts._shrink_tile, ptx.expand_tile, prect._rect_kernel
    env = os.environ.get("LORA_JAX_RELAXED_ATOMICS")
    if variant == "acq_rel":
        os.environ["LORA_JAX_RELAXED_ATOMICS"] = "0"
    elif variant == "store":
        pts._add_to = _plain_store
    elif variant in ("no_x", "no_a", "no_xa"):
        pts._shrink_tile = _tile_without(variant[3:])
    elif variant in ("no_y", "no_b", "no_yb"):
        ptx.expand_tile = _expand_tile_without(variant[3:])
    elif variant == "static_slot":
        prect._rect_kernel = _rect_static_slot(saved[3])
    jax.clear_caches()  # the public op is jitted: trace it again under the patch
    try:
        yield
    finally:
        pts._add_to, pts._shrink_tile, ptx.expand_tile, prect._rect_kernel = saved
        if env is None:
            os.environ.pop("LORA_JAX_RELAXED_ATOMICS", None)
        else:
            os.environ["LORA_JAX_RELAXED_ATOMICS"] = env
        jax.clear_caches()


def default_tiles(c: ops_bench.Case, whole: str | None = None) -> BlockSizes:
    """The library's tiles for ``c``; with the host's ``whole`` "all", the rectangle
    shrink's where its rule takes the cell."""
    if c.op == "shrink" and whole == "all":
        rect = tuning_long_shrink.rect_shrink_tiles(c.tokens, c.hidden, next_pow2(c.rank))
        if rect is not None:
            return rect
    return BlockSizes.get_default(c.op, num_tokens=c.tokens, hidden=c.hidden, rank=c.rank)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="shrink", choices=tuple(VARIANTS))
    p.add_argument("--cells", default="4096x4096x16x64,4096x4096x64x64,1024x8192x64x8")
    p.add_argument("--variants", default="", help="comma-separated; default: all of --op's")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke)")
    p.add_argument("--layout", default="shuffled", choices=("shuffled", "runs"))
    p.add_argument("--out", default="")
    args = p.parse_args()
    ops_bench.TIMER = "trace"
    ops_bench.INTERPRET = args.interpret
    ops_bench.LAYOUT = args.layout
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    variants = args.variants.split(",") if args.variants else list(VARIANTS[args.op])
    unknown = set(variants) - set(VARIANTS[args.op])
    if unknown:
        raise SystemExit(f"--variants {sorted(unknown)}: {args.op} has {VARIANTS[args.op]}")
    print("| T | H | R | n | ideal µs | tiles | max rel err | " + " | ".join(variants) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(variants))
    rows = []
    for cell in args.cells.split(","):
        t, h, r, n = map(int, cell.split("x"))
        c = ops_bench.Case(args.op, t, h, r, n)
        calls = 2 if args.interpret else 8 if t >= 4096 else 32
        inputs, w, metas = ops_bench.build(c, calls)
        whole = ops_bench.host_whole_tiles(metas) if args.op == "shrink" else None
        bs = default_tiles(c, whole)
        err = ops_bench.max_rel_err(c, inputs, w, metas, None, "none", whole_tiles=whole)
        row = dict(dataclasses.asdict(c), ideal_us=ops_bench.ideal_bytes(c) / 4.3e6)
        row.update(tiles=str(bs), max_rel_err=err, us={}, kernels_us={})
        donate = args.op == "expand"  # y is updated in place, as in the ops benchmark
        for v in variants:
            tiles = bs
            if v == "partials":
                if not bs.atomic_programs:
                    row["us"][v] = float("nan")
                    continue
                tiles = dataclasses.replace(bs, atomic_programs=0)
            if v in ("static_slot", "x_first", "x_later") and not bs.rect:
                row["us"][v] = float("nan")
                continue
            if v in ("x_first", "x_later"):
                tiles = dataclasses.replace(bs, x_first=v == "x_first")
            # Triton alone ("none"): the Mosaic segment kernel is not what is probed here.
            fn = ops_bench.ours(c, tiles, prompt_tiles="none", whole_tiles=whole)
            fresh = jax.tree.map(jnp.copy, inputs) if donate else inputs
            with patched(v):
                jitted = jax.jit(fn, donate_argnums=(0,) if donate else ())
                compiled = jitted.lower(fresh, w, metas).compile()
            row["us"][v] = ops_bench.time_calls(compiled, (fresh, w, metas), calls, feed=donate)
            row["kernels_us"][v] = dict(ops_bench.LAST_KERNELS)
        rows.append(row)
        cells = " | ".join(f"{row['us'][v]:.1f}" for v in variants)
        shape = (
            f"{bs.block_m}x{bs.block_r}x{bs.block_k}/{bs.num_stages}/split {bs.split_k}"
            f"{' atomic' if bs.atomic_programs else ''}"
            if args.op == "shrink"
            else f"{bs.block_m}x{bs.block_n}/{bs.num_stages}/{bs.tiles_n} tiles"
        )
        print(
            f"| {t} | {h} | {r} | {n} | {row['ideal_us']:.1f} | {shape} | {err:.1e} | {cells} |",
            flush=True,
        )
    ops_bench.write_json(args.out, rows)


if __name__ == "__main__":
    main()
