"""Probe: a grid-wide barrier in a Pallas Triton kernel (flags raised and read by atomics).

Each of P programs raises its flag, then waits (at most ``--spins`` reads) until it sees
all P flags up, and writes what it saw: the number of flags up at its last read and how
many reads it took. A bounded wait cannot hang the GPU; a program that ran out of reads
reports fewer than P flags. Variants: how a flag is raised (one counter added to; a
flag per program, exchanged by one thread or by a masked vector) and read (an atomic OR
of 0; ``*_add``: an atomic add of 0, which jax 0.11 lowers to an f32 add on int32 flags).

    python3 -P benchmarks/barrier_probe.py --programs 1,2,8,132 --out $OUT/barrier.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(flags_in, flags_ref, seen_ref, *, programs: int, spins: int, variant: str):
    del flags_in  # aliased to flags_ref
    pid = pl.program_id(0)
    lanes = jnp.arange(max(16, _next_pow2(programs)), dtype=jnp.int32)
    ok = lanes < programs
    plgpu.debug_barrier()
    if variant == "counter":  # one counter: +1 each, read by adding 0
        plgpu.atomic_add(flags_ref, (0,), jnp.int32(1))

        def read(_):
            return plgpu.atomic_add(flags_ref, (0,), jnp.int32(0))
    else:
        if variant.startswith("xchg_scalar"):
            plgpu.atomic_xchg(flags_ref, (pid,), jnp.int32(1))
        else:  # "xchg_lane*": the raise as a masked vector exchange
            mine = lanes == pid
            plgpu.atomic_xchg(
                flags_ref, (jnp.where(mine, lanes, 0),), mine.astype(jnp.int32), mask=mine
            )

        def read(_):
            zeros, idx = jnp.zeros_like(lanes), (jnp.where(ok, lanes, 0),)
            if variant.endswith("_add"):  # jax 0.11 lowers this int32 add as an f32 add
                f = plgpu.atomic_add(flags_ref, idx, zeros, mask=ok)
            else:
                f = plgpu.atomic_or(flags_ref, idx, zeros, mask=ok)
            return jnp.sum(jnp.where(ok, f, 0))

    def cond(c):
        n, i = c
        return (n < programs) & (i < spins)

    def body(c):
        _, i = c
        return read(0), i + 1

    n, i = jax.lax.while_loop(cond, body, (read(0), jnp.int32(1)))
    plgpu.debug_barrier()
    seen_ref[pid, 0] = n
    seen_ref[pid, 1] = i


def run(programs: int, spins: int, variant: str, interpret: bool = False):
    width = max(16, _next_pow2(programs))
    flags = jnp.zeros((width,), jnp.int32)
    kernel = functools.partial(_kernel, programs=programs, spins=spins, variant=variant)
    _, seen = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(flags.shape, jnp.int32),
            jax.ShapeDtypeStruct((programs, 2), jnp.int32),
        ),
        grid=(programs,),
        input_output_aliases={0: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        debug=os.environ.get("PROBE_DEBUG") == "1",
        name=f"barrier_probe_{variant}",
    )(flags)
    return seen


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", default="1,2,8,132")
    p.add_argument("--spins", type=int, default=1 << 16)
    p.add_argument("--variants", default="counter,xchg_scalar,xchg_lane,xchg_scalar_add")
    p.add_argument("--out", default="")
    p.add_argument("--interpret", action="store_true", help="CPU check (one program only)")
    a = p.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows = []
    for variant in a.variants.split(","):
        for programs in (int(v) for v in a.programs.split(",")):
            try:
                seen = jax.jit(functools.partial(run, programs, a.spins, variant, a.interpret))()
                seen = jax.device_get(seen)
                row = dict(
                    variant=variant,
                    programs=programs,
                    min_seen=int(seen[:, 0].min()),
                    max_seen=int(seen[:, 0].max()),
                    max_reads=int(seen[:, 1].max()),
                    all_passed=bool((seen[:, 0] >= programs).all()),
                )
            except Exception as e:  # noqa: BLE001 - report the variant, keep going
                row = dict(
                    variant=variant, programs=programs, error=f"{type(e).__name__}: {e}"[:300]
                )
            rows.append(row)
            print(row, flush=True)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
