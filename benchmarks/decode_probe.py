"""Probe: LoRA's decode ops at the shapes of a Llama-3-8B layer, with given tiles.

For each projection (qkv, o, gate_up, down) at decode batch sizes, GPU busy µs per call
(trace timer, ``--calls`` different weight copies inside one jit) of:

* ``xla_base``: the base matmul alone, ``x @ W`` (XLA);
* ``xla+xla``: XLA's matmul, then `lora_jax.ops.lora_expand` on the XLA backend (the
  library's default below 128 tokens);
* ``xla+pallas``: the same with the Pallas expand at its default tiles;
* ``xla+pallas[tiles]``: the Pallas expand with the given tiles (``--expand-tiles``);
* with ``--shrink-tiles``: ``shrink:xla``, ``shrink:pallas`` and ``shrink:pallas[tiles]``.

Every Pallas result is checked against the XLA one (relative max error). Prints a row a
cell, writes JSON. (Session 25 also timed a base matmul with the expand folded in here:
commit 8aabeb1, benchmarks/RESULTS.md.)

    python3 -P benchmarks/decode_probe.py --tokens 64 --adapters 8 --expand-tiles pt:128
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ops as ops_bench  # noqa: E402

from lora_jax import mapping as mapping_lib  # noqa: E402
from lora_jax import ops as lora_ops  # noqa: E402
from lora_jax.kernels import lora_expand as kernel_expand  # noqa: E402
from lora_jax.kernels import lora_shrink as kernel_shrink  # noqa: E402
from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes  # noqa: E402

# name -> (hidden, slice widths): Llama-3-8B at tp = 1
PROJECTIONS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
MAX_LORAS = 64
INTERPRET = False
"""CPU smoke runs (tests): the Pallas kernels in interpret mode."""


def parse_expand_tiles(spec: str) -> BlockSizes:
    """``bm:bn:stages:warps:tiles_n:live_programs``, ``pt:bn`` (the per-token kernel) or
    ``bg:bm:bn:stages:warps:groups`` (programs walking the live blocks: ``block_groups``)."""
    if spec.startswith("pt:"):
        return BlockSizes(per_token=True, block_n=int(spec[3:]), num_stages=1)
    if spec.startswith("bg:"):
        bm, bn, st, w, groups = (int(v) for v in spec[3:].split(":"))
        return BlockSizes(block_m=bm, block_n=bn, num_stages=st, num_warps=w, block_groups=groups)
    bm, bn, st, w, tn, live = (int(v) for v in spec.split(":"))
    return BlockSizes(
        block_m=bm, block_n=bn, num_stages=st, num_warps=w, tiles_n=tn, live_programs=live
    )


def parse_shrink_tiles(spec: str) -> BlockSizes:
    """``bm:br:bk:warps:stages:split:atomic_programs:persistent``, or ``pt:br:bk`` (the
    per-token kernel, the hidden split over k ranges of ``bk``)."""
    if spec.startswith("pt:"):
        br, bk = (int(v) for v in spec[3:].split(":"))
        return BlockSizes(per_token=True, block_r=br, block_k=bk, split_k=64, num_stages=1)
    bm, br, bk, w, st, split, atomic, pers = (int(v) for v in spec.split(":"))
    return BlockSizes(
        block_m=bm, block_r=br, block_k=bk, num_warps=w, num_stages=st, split_k=split,
        atomic_programs=atomic, persistent=bool(pers),
    )  # fmt: skip


def build(proj: str, tokens: int, adapters: int, rank: int, calls: int, seed: int = 0):
    hidden, widths = PROJECTIONS[proj]
    width = sum(widths)
    offsets = tuple(int(v) for v in np.cumsum((0,) + widths[:-1]))
    rng = np.random.default_rng(seed)
    k = jax.random.key(seed)
    dt = jnp.bfloat16
    calls_in = []
    for i in range(calls):
        ki = jax.random.fold_in(k, i)
        x = jax.random.normal(jax.random.fold_in(ki, 0), (tokens, hidden), dt)
        w = jax.random.normal(jax.random.fold_in(ki, 1), (hidden, width), dt) * hidden**-0.5
        bs = tuple(
            jax.random.normal(jax.random.fold_in(ki, 2 + s), (MAX_LORAS, n, rank), dt)
            for s, n in enumerate(widths)
        )
        h = jax.random.normal(jax.random.fold_in(ki, 9), (len(widths), tokens, rank), jnp.float32)
        slots = rng.permutation(MAX_LORAS)[:adapters]
        idx = slots[rng.integers(0, adapters, tokens)].astype(np.int32)
        if tokens >= adapters:  # every adapter used
            idx[:adapters] = slots
        m = mapping_lib.make_lora_mapping(idx, MAX_LORAS, is_prefill=False)
        a_s = tuple(
            jax.random.normal(jax.random.fold_in(ki, 20 + s), (MAX_LORAS, rank, hidden), dt)
            * hidden**-0.5
            for s in range(len(widths))
        )
        calls_in.append((x, w, bs, h, m, a_s))
    return calls_in, offsets


def variants(offsets, expand_specs=(), shrink_specs=()):
    def xla_base(cs):
        return [jnp.dot(x, w, preferred_element_type=x.dtype) for x, w, *_ in cs]

    def with_expand(backend):
        def f(cs):
            out = []
            for x, w, bs, h, m, _ in cs:
                y = jnp.dot(x, w, preferred_element_type=x.dtype)
                out.append(lora_ops.lora_expand(y, h, bs, m, offsets=offsets, backend=backend))
            return out

        return f

    def with_tiles(bs):
        def f(cs):
            out = []
            for x, w, b, h, m, _ in cs:
                y = jnp.dot(x, w, preferred_element_type=x.dtype)
                kw = m.expand_kwargs()
                out.append(
                    kernel_expand(
                        y, h, b, offsets=offsets, block_sizes=bs, interpret=INTERPRET, **kw
                    )
                )
            return out

        return f

    def shrink(backend=None, bs=None):
        def f(cs):
            if bs is None:
                return [lora_ops.lora_shrink(x, a, m, backend=backend) for x, *_, m, a in cs]
            return [
                kernel_shrink(x, a, block_sizes=bs, interpret=INTERPRET, **m.shrink_kwargs())
                for x, *_, m, a in cs
            ]

        return f

    out = {}
    if shrink_specs:
        out["shrink:xla"] = shrink("xla")
        out["shrink:pallas"] = shrink("pallas")
        for spec in shrink_specs:
            out[f"shrink:pallas[{spec}]"] = shrink(bs=parse_shrink_tiles(spec))
    out |= {
        "xla_base": xla_base,
        "xla+xla": with_expand("xla"),
        "xla+pallas": with_expand("pallas"),
    }
    for spec in expand_specs:
        out[f"xla+pallas[{spec}]"] = with_tiles(parse_expand_tiles(spec))
    return out


def rel_err(got, want) -> float:
    g = jnp.stack([a.astype(jnp.float32) for a in got])
    w = jnp.stack([a.astype(jnp.float32) for a in want])
    return float(jnp.max(jnp.abs(g - w)) / jnp.maximum(jnp.max(jnp.abs(w)), 1e-30))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--projections", default="qkv,o,gate_up,down")
    p.add_argument("--tokens", default="64")
    p.add_argument("--adapters", default="8,64")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--expand-tiles",
        default="",
        help="the Pallas expand after XLA's matmul with these tiles: "
        "bm:bn:stages:warps:tiles_n:live_programs or pt:bn (per-token), comma-separated",
    )
    p.add_argument(
        "--shrink-tiles",
        default="",
        help="also time the shrink (XLA, the Pallas default and these tiles): "
        "bm:br:bk:warps:stages:split:atomic_programs:persistent or pt:br:bk",
    )
    p.add_argument("--interpret", action="store_true", help="Pallas in interpret mode (CPU)")
    p.add_argument("--compile-budget", type=float, default=60)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    global INTERPRET
    if a.interpret:
        INTERPRET = lora_ops.PALLAS_INTERPRET = True
    ops_bench.TIMER = "trace"
    rows = []
    print(f"device: {jax.devices()[0]}; rank {a.rank}, {a.calls} calls a jit, trace busy µs")
    for proj in a.projections.split(","):
        for tokens in (int(v) for v in a.tokens.split(",")):
            for adapters in (int(v) for v in a.adapters.split(",")):
                if adapters > tokens:
                    continue
                cs, offsets = build(proj, tokens, adapters, a.rank, a.calls)
                want = {}  # is a shrink -> its reference outputs
                row = {"proj": proj, "tokens": tokens, "adapters": adapters, "us": {}, "err": {}}
                for name, fn in variants(
                    offsets,
                    [v for v in a.expand_tiles.split(",") if v],
                    [v for v in a.shrink_tiles.split(",") if v],
                ).items():
                    compiled, why = ops_bench.compile_with_budget(fn, (cs,), a.compile_budget)
                    if compiled is None:
                        row["us"][name] = None
                        row["err"][name] = why
                        print(f"  {proj} T={tokens} n={adapters} {name}: skipped ({why})")
                        continue
                    out = compiled(cs)
                    if name in ("xla+xla", "shrink:xla"):
                        want[name.startswith("shrink")] = out
                    elif name.startswith(("xla+pallas", "shrink:pallas")):
                        ref = want.get(name.startswith("shrink"))
                        if ref is not None:
                            row["err"][name] = rel_err(out, ref)
                    row["us"][name] = ops_bench.time_calls(compiled, (cs,), a.calls, a.reps)
                rows.append(row)
                base = row["us"].get("xla_base")
                cells = "  ".join(
                    f"{k}={v:.1f}" + (f"({v / base:.2f})" if base and "shrink" not in k else "")
                    for k, v in row["us"].items()
                    if v is not None
                )
                errs = max((v for v in row["err"].values() if isinstance(v, float)), default=0)
                print(f"{proj:8s} T={tokens:4d} n={adapters:3d}  {cells}  maxerr={errs:.1e}")
                sys.stdout.flush()
    ops_bench.write_json(
        a.out, {"device": str(jax.devices()[0]), "argv": argv or sys.argv, "rows": rows}
    )


if __name__ == "__main__":
    main()
