"""The LoRA stacks' gradient op alone: `lora_slot_outer` (per slot, the sum over its tokens
of ``a[t]^T b[t]``) against the XLA forms a backward pass would otherwise take.

Cells: dA (``a`` = the shrink's cotangent ``dh [T, R]``, ``b`` = its input ``x [T, H]``)
and dB (``a`` = the expand's cotangent ``dy [T, N]``, ``b`` = ``h [T, R]``), bf16, over
``--slots`` slots of which ``n`` are used (tokens in runs, as a training batch's). Variants:

* kernel   `lora_jax.kernels.lora_slot_outer`
* dense    one matmul against the one used slot (n = 1: the `single_slot` backward)
* onehot   XLA's einsum against every slot (``tl,tp,tq->lpq``: the one-hot VJP's product)

Each variant runs ``--calls`` calls inside one jit, each on inputs of its own (together
past L2), each output returned whole; the figure is the GPU's busy time per call from a profiler
trace (wall time where the trace has no GPU, e.g. the CPU). Roofline bytes: a and b read
once, the f32 output written once; GB/s and the fraction of ``--hbm-gbps``.

    python benchmarks/grad_ops.py --out grad_ops.json            # on the GPU machine
    python benchmarks/grad_ops.py --small                         # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from lora_jax.kernels import lora_slot_outer
from lora_jax.mapping import make_lora_mapping

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # profile_decode, with -P


def cells(small: bool):
    """(what, T, P, Q, n): dA [R, H] from dh [T, R] and x [T, H]; dB [N, R] from dy and h."""
    if small:
        return [("dA", 256, 16, 128, 1), ("dB", 256, 128, 16, 2)]
    out = []
    for t in (4096, 16384):
        for r in (16, 64, 128):
            for n in (1, 8):
                out.append(("dA", t, r, 4096, n))
    for n_out in (4096, 14336):
        for n in (1, 8):
            out.append(("dB", 4096, n_out, 64, n))
    return out


def ideal_bytes(t: int, p: int, q: int, slots: int) -> int:
    return t * (p + q) * 2 + slots * p * q * 4


def variants(t, p, q, n, slots):
    """{name: fn(a, b) -> f32 [slots, p, q]} for this cell's mapping (n slots in runs)."""
    idx = np.repeat(np.arange(n, dtype=np.int32), -(-t // n))[:t]
    mapping = make_lora_mapping(idx, slots)
    meta = mapping.kernel_kwargs()
    interpret = jax.default_backend() != "gpu"  # the CPU smoke test: interpret mode
    out = {"kernel": lambda a, b: lora_slot_outer(a, b, **meta, interpret=interpret)}
    if n == 1:

        def dense(a, b):
            d = jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)  # fmt: skip
            return jnp.zeros((slots, p, q), jnp.float32).at[0].set(d)

        out["dense"] = dense
    one_hot = jax.nn.one_hot(jnp.asarray(idx), slots, dtype=jnp.bfloat16)  # [T, L]

    def onehot(a, b):
        wide = (one_hot[:, :, None] * a[:, None, :]).reshape(t, slots * p)  # [T, L * P]
        d = jax.lax.dot_general(wide, b, (((0,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)  # fmt: skip
        return d.reshape(slots, p, q)

    out["onehot"] = onehot
    return out


def time_variant(fn, a_copies, b_copies, calls: int, reps: int) -> float:
    """µs per call of ``fn``: ``calls`` calls in one jit over the rotated copies."""

    @jax.jit
    def many(a_copies, b_copies):
        # every call on its own inputs (a repeated pair would be one call after XLA's CSE)
        # and every output returned whole (a slice of a dot is a smaller dot to XLA)
        return tuple(fn(a, b) for a, b in zip(a_copies, b_copies))

    jax.block_until_ready(many(a_copies, b_copies))  # compile + warm up
    from ops import trace_busy_us  # benchmarks/ops.py: GPU busy µs from a trace, or NaN

    busy = trace_busy_us(lambda: many(a_copies, b_copies), reps)
    if busy == busy:
        return busy / calls
    t0 = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(many(a_copies, b_copies))
    return (time.perf_counter() - t0) / (reps * calls) * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hbm-gbps", type=float, default=3350.0, help="H100 3350, H200 4300")
    p.add_argument("--small", action="store_true", help="tiny cells for a CPU smoke test")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.small:
        args.calls, args.reps, args.slots = 2, 1, 4
    print(f"device: {jax.devices()[0]}; {args.slots} slots, {args.calls} calls a jit", flush=True)
    rows = []
    key = jax.random.key(0)
    for what, t, pp, q, n in cells(args.small):
        copies = args.calls  # distinct inputs for every call (together past L2)
        ka, kb = jax.random.split(jax.random.fold_in(key, t * pp + q))
        a_copies = [jax.random.normal(jax.random.fold_in(ka, i), (t, pp), jnp.bfloat16)
                    for i in range(copies)]  # fmt: skip
        b_copies = [jax.random.normal(jax.random.fold_in(kb, i), (t, q), jnp.bfloat16)
                    for i in range(copies)]  # fmt: skip
        fns = variants(t, pp, q, n, args.slots)
        want = fns["onehot"](a_copies[0], b_copies[0])
        ideal = ideal_bytes(t, pp, q, args.slots)
        for name, fn in fns.items():
            err = float(jnp.max(jnp.abs(fn(a_copies[0], b_copies[0]) - want)))
            err /= max(float(jnp.max(jnp.abs(want))), 1e-30)
            us = time_variant(fn, a_copies, b_copies, args.calls, args.reps)
            gbps = ideal / us / 1e3
            row = dict(what=what, tokens=t, p=pp, q=q, adapters=n, impl=name, us=us,
                       gbps=gbps, roofline=gbps / args.hbm_gbps, rel_err=err)  # fmt: skip
            rows.append(row)
            print(
                f"{what} T={t:>5} P={pp:>5} Q={q:>5} n={n} {name:>6}: {us:9.1f} us "
                f"{gbps:7.0f} GB/s {100 * row['roofline']:5.1f} % err {err:.1e}",
                flush=True,
            )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), device=str(jax.devices()[0]), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
