"""Probe: does sharing the adapter's tile between two SMs (TMA multicast in a cluster) speed
up the one-adapter prefill shrink?

Issue #3's worst cells are the shrink at 4096 tokens, rank 128, over one adapter (58 % of
the roofline on the H200). x is read once, but every 64-row tile of x reads the whole of
A (R x H) from L2 as well: at rank 128 that is 64 MB of L2 traffic for A against x's 32
MB. On Hopper, two CTAs of a cluster that work on neighbouring row tiles can load A's tile
once and multicast it into both SMs' shared memory, halving that traffic. Our kernels have
no cluster path; jax ships a Hopper matmul (`jax.experimental.pallas.ops.gpu.
hopper_matmul_mgpu`) that has one (``cluster_dimension=M``: the right-hand operand
multicast along M), so this probe times the plain product ``x [T, H] @ Aᵀ [H, R]`` on it
with and without the cluster, at the same tiles, beside XLA's dot (cuBLAS) and the
library's shrink (`lora_jax.ops.lora_shrink`, one adapter, f32 output).

Each variant runs ``--copies`` different weight copies inside one jit (rotated, so L2 does
not hold A across calls); µs per call from a profiler trace (`ops.time_calls`). x is one
array for every call, so at 4096 tokens (32 MB) it stays in an H100's 50 MB L2: compare
kernels only within a run, never against `ops.py` or `mosaic_probe.py` (session 56: a
kernel at 9.3 µs here took 17 µs with x cold). jax's
kernel writes bf16 and has no hidden split, so it is a probe of the effect, not a
candidate: a cluster that wins here would go into the Mosaic segment shrink. GPU (Hopper)
only.

    python3 -P benchmarks/cluster_probe.py --tokens 4096,16384 --ranks 64,128 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ops as bench_ops  # noqa: E402

import lora_jax as lj  # noqa: E402

HBM_BYTES_PER_S = 4.3e12


def mgpu_configs(rank: int):
    """(name, TuningConfig) pairs: the same tiles with and without a 2-CTA cluster on M."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    dim = hm.MatmulDimension
    out = []
    for tile_m, wg, steps in ((64, dim.N, 4), (64, dim.N, 6), (64, dim.M, 4), (64, dim.M, 6)):
        tile_n = rank // 2 if wg == dim.N else rank
        if tile_n < 64:  # the kernel's swizzled tiles are 64 columns wide
            continue
        for cluster in (None, dim.M):
            cfg = hm.TuningConfig(
                tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=steps,
                epi_tile_n=min(64, tile_n), epi_tile_m=64, wg_dimension=wg,
                cluster_dimension=cluster,
            )  # fmt: skip
            name = f"mgpu m{tile_m} n{tile_n} wg{wg} s{steps}" + (
                " clusterM" if cluster is not None else ""
            )
            out.append((name, cfg))
    return out


def own_variants(rank: int):
    """`cluster_shrink.cluster_shrink` (slot 0 of the stacks, f32 out) with and without the
    cluster, at the stages that fit shared memory and one or two WGMMA warpgroups."""
    import cluster_shrink as cs

    out = []
    for stages in (4, 6) if rank <= 64 else (4, 5):
        for wgs in (1, 2):
            for cluster in (2, 1):

                def f(x, a_t, a, stages=stages, wgs=wgs, cluster=cluster):
                    pairs = x.shape[0] // (128 * cluster)
                    split = max(1, 128 // (cluster * pairs))
                    slot = jnp.zeros((1,), jnp.int32)
                    return [
                        cs.cluster_shrink(
                            x, a[c], slot, split=split, stages=stages, wgs=wgs, cluster=cluster
                        )
                        for c in range(a.shape[0])
                    ]

                out.append(
                    (f"own s{stages} wg{wgs} " + ("cluster2" if cluster > 1 else "no cluster"), f)
                )
    return out


def variants(rank: int, mapping):
    import inspect

    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    # jax 0.11's matmul takes an optional addend c (None: bf16 out); other versions may not
    extra = (None,) if "c" in inspect.signature(hm.matmul).parameters else ()

    def dot(x, a_t, a):
        return [jnp.dot(x, a_t[c], preferred_element_type=jnp.float32) for c in range(a_t.shape[0])]

    def ours(x, a_t, a):
        return [lj.ops.lora_shrink(x, [a[c]], mapping)[0] for c in range(a.shape[0])]

    out = [("xla dot (f32 out)", dot), ("ours (lora_shrink)", ours)]
    for name, cfg in mgpu_configs(rank):

        def f(x, a_t, a, cfg=cfg):
            return [hm.matmul(x, a_t[c], *extra, config=cfg) for c in range(a_t.shape[0])]

        out.append((name, f))
    return out + own_variants(rank)  # last: a kernel that hangs stops only its own rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ranks", default="64,128")
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--compile-budget", type=float, default=60.0)
    p.add_argument(
        "--only",
        default="",
        help="comma-separated substrings: run only the variants whose name has one of them",
    )
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    bench_ops.TIMER = "trace"
    H, slots = a.hidden, 8
    rows = []
    print(f"device: {jax.devices()[0]}; H={H}, {a.copies} weight copies, µs per call")
    print(f"{'T':>6} {'R':>4} {'variant':<34} {'us':>7} {'% roof':>7} {'max rel err':>11}")
    for T in [int(v) for v in a.tokens.split(",") if v]:
        mapping = lj.make_lora_mapping(np.zeros(T, np.int32), slots)
        x = jax.random.normal(jax.random.key(0), (T, H), jnp.bfloat16)
        for R in [int(v) for v in a.ranks.split(",") if v]:
            stacks = jax.random.normal(jax.random.key(1), (a.copies, slots, R, H), jnp.bfloat16)
            a_t = jnp.swapaxes(stacks[:, 0], 1, 2)  # [copies, H, R]: slot 0's A, transposed
            ref = np.asarray(jnp.dot(x, a_t[0], preferred_element_type=jnp.float32))
            ideal_us = (T * H * 2 + R * H * 2 + T * R * 4) / HBM_BYTES_PER_S * 1e6
            keep = [v for v in a.only.split(",") if v]
            for name, fn in variants(R, mapping):
                if keep and not any(k in name for k in keep):
                    continue
                compiled, why = bench_ops.compile_with_budget(
                    fn, (x, a_t, stacks), a.compile_budget
                )
                row = dict(tokens=T, rank=R, hidden=H, variant=name, ideal_us=ideal_us)
                if compiled is None:
                    row["skipped"] = why
                    print(f"{T:>6} {R:>4} {name:<34} skipped: {why[:90]}")
                    rows.append(row)
                    continue
                got = np.asarray(compiled(x, a_t, stacks)[0], np.float32)
                err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
                us = bench_ops.time_calls(compiled, (x, a_t, stacks), a.copies, reps=a.reps)
                row.update(us=us, roofline=ideal_us / us, max_rel_err=err)
                rows.append(row)
                print(
                    f"{T:>6} {R:>4} {name:<34} {us:>7.1f} {100 * ideal_us / us:>6.0f}% {err:>11.2e}"
                )
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), argv=sys.argv, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
