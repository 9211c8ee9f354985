"""Probe: can a prefill expand's update ride in the base matmul's epilogue?

Today a LoRA layer runs the base matmul ``y = x @ W`` (cuBLAS), then the expand reads y,
adds ``h @ B[idx]ᵀ`` and writes y back: two passes over y besides the matmul's own
write. cuBLAS can add a matrix C in its epilogue (``D = x @ W + C``, beta = 1), which a
compute-bound matmul reads for free. If XLA folds ``x @ W + delta`` into one such call,
an expand that only *writes* delta would save one of the two passes.

For each width N this times, inside one jit over ``--copies`` different weights (trace
timer of `ops.py`, µs per layer):

- ``gemm``: ``x @ W`` alone;
- ``inplace``: the library's way (the matmul, then `lora_jax.ops.lora_expand` into y);
- ``c_zero``: ``x @ W + lora_expand(zeros, ...)`` (an expand that reads zeros: the upper
  bound of an expand that only writes);

and prints whether the compiled HLO's cuBLAS call took the add (beta = 1). One adapter
over all tokens (a prompt's tiles). GPU only.

    python3 -P benchmarks/gemm_c_probe.py --tokens 4096 --widths 4096,6144,28672 --rank 64
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ops as bench_ops  # noqa: E402

import lora_jax as lj  # noqa: E402


def variants(mapping):
    def gemm(x, w, h, b):
        return [x @ w[c] for c in range(w.shape[0])]

    def inplace(x, w, h, b):
        return [lj.ops.lora_expand(x @ w[c], h, [b[c]], mapping) for c in range(w.shape[0])]

    def c_zero(x, w, h, b):
        out = []
        for c in range(w.shape[0]):
            zeros = jnp.zeros((x.shape[0], w.shape[2]), x.dtype)
            out.append(x @ w[c] + lj.ops.lora_expand(zeros, h, [b[c]], mapping))
        return out

    return dict(gemm=gemm, inplace=inplace, c_zero=c_zero)


def cublas_betas(hlo: str) -> list[str]:
    """The beta of every cuBLAS matmul call in the compiled HLO."""
    return re.findall(r'"beta":\s*([0-9.e+-]+)', hlo)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--widths", default="4096,6144,28672")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    bench_ops.TIMER = "trace"
    T, K, R, L = a.tokens, a.hidden, a.rank, 8
    mapping = lj.make_lora_mapping(np.zeros(T, np.int32), L)
    key = jax.random.key(0)
    x = jax.random.normal(key, (T, K), jnp.bfloat16)
    h = jax.random.normal(key, (1, T, R), jnp.float32)
    rows = []
    print(f"device: {jax.devices()[0]}; T={T} K={K} R={R}, {a.copies} weight copies")
    print(f"{'N':>6} {'variant':>8} {'us/layer':>9} {'vs gemm':>8}  betas")
    for n in [int(v) for v in a.widths.split(",") if v]:
        w = jax.random.normal(key, (a.copies, K, n), jnp.bfloat16) * 0.02
        b = jax.random.normal(key, (a.copies, L, n, R), jnp.bfloat16) * 0.02
        args = (x, w, h, b)
        ref = None
        base_us = None
        for name, fn in variants(mapping).items():
            compiled = jax.jit(fn).lower(*args).compile()
            betas = cublas_betas(compiled.as_text())
            out = compiled(*args)
            if name == "inplace":
                ref = np.asarray(out[0], np.float32)
            err = None
            if name == "c_zero" and ref is not None:
                err = float(np.max(np.abs(np.asarray(out[0], np.float32) - ref)))
            us = bench_ops.time_calls(compiled, args, a.copies, reps=a.reps)
            base_us = us if name == "gemm" else base_us
            rows.append(dict(n=n, variant=name, us=us, betas=betas, max_abs_diff=err,
                             kernels=dict(bench_ops.LAST_KERNELS)))  # fmt: skip
            print(f"{n:>6} {name:>8} {us:>9.1f} {us - base_us:>+8.1f}  {','.join(betas)}"
                  + ("" if err is None else f"  |c_zero - inplace| = {err:.3g}"))  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), argv=sys.argv, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
