"""Benchmark: the host cost of building a step's `LoRAMapping` outside jit.

A server decides each step's token -> slot indices on the host (numpy) and may build the
mapping eagerly, outside its model's jit, e.g. `set_lora_mapping(model, idx)` before a
jitted step. That cost is host time per step, not device time: this script times it as
wall time per call (blocking on the result), over `--calls` different index arrays, and
compares it with a jitted step that only consumes the mapping (one dispatch, the floor).

    python benchmarks/mapping.py --out mapping.json        # any machine
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import lora_jax as lj


def time_calls(fn, args_list) -> float:
    """Median wall ms of `fn(*args)` over `args_list` (the first call warms up)."""
    jax.block_until_ready(jax.tree.leaves(fn(*args_list[0])))
    times = []
    for args in args_list[1:]:
        t0 = time.perf_counter()
        jax.block_until_ready(jax.tree.leaves(fn(*args)))
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="64,256,2048,8192")
    p.add_argument("--max-loras", type=int, default=64)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    floor = jax.jit(lambda idx: idx + 1)  # one dispatch of a trivial jitted step
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        idxs = [(rng.integers(-1, args.max_loras, t).astype(np.int32),) for _ in range(args.calls)]
        eager = time_calls(lambda idx: lj.make_lora_mapping(idx, args.max_loras), idxs)
        one = time_calls(lambda idx: floor(jnp.asarray(idx)), idxs)
        rows.append(dict(tokens=t, max_loras=args.max_loras, eager_ms=eager, dispatch_ms=one))
        print(json.dumps(rows[-1]), flush=True)
    print(f"{'T':>6} {'eager mapping ms':>17} {'one dispatch ms':>16}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['eager_ms']:>17.3f} {r['dispatch_ms']:>16.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), argv=sys.argv, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
