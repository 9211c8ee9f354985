"""Where a decode step's (or a prefill's) device time goes: per-kernel times from a
profiler trace.

Builds the Llama-3-8B-shaped decoder of `tp.py` (random bf16 weights, `--layers` of
them), runs `--steps` decode steps in one jit under `jax.profiler`, reads the trace
back with `jax.profiler.ProfileData` and splits each step's GPU time into: the kernels
of the LoRA ops (Pallas calls named ``lora_*`` and the XLA fusions that exist only
with LoRA are told apart by diffing against the base run's kernel names), the rest,
and idle gaps between kernels (launch/host-bound time). Prints a table, writes JSON.

    python benchmarks/profile_decode.py --layers 4 --batch 64 --out prof.json   # GPU
    python benchmarks/profile_decode.py --small                                  # CPU smoke
    python benchmarks/profile_decode.py --layers 4 --prefill 4x1024 --rank 64 \
        --backends default,hinted                      # one prefill of 4 prompts (GPU)

Backends: "pallas", "pallas_fused", "xla" force one; "default" is the library's choice,
"hinted" the same with the host's hints in the step's mapping (as `generate` passes them).
With ``--prefill BxS`` a "step" is one prefill of B prompts of S tokens, one adapter each
(``--adapters`` is ignored), the hints are `tp.prefill_hints`, and backend "unshared" is
the default without the layers' shared input (`SHARE_LAYER_INPUT` off).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tp import (  # noqa: E402
    TARGETS,
    bench_model,
    fill_random_adapters,
    make_decode,
    prefill_step,
    token_slots,
)

import lora_jax as lj  # noqa: E402
from lora_jax.layers import base as lora_base  # noqa: E402
from lora_jax.models.kv_cache import KVCache  # noqa: E402
from lora_jax.serving.wrap import unwrap_model, wrap_model  # noqa: E402

_STREAM = re.compile(r"^Stream #\d+")


def device_events(log_dir: str) -> list[tuple[str, int, int]]:
    """(name, start_ns, duration_ns) of every kernel/memcpy on the first GPU's streams."""
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        return []
    pd = jax.profiler.ProfileData.from_file(paths[-1])
    out = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU:0"):
            continue
        for line in plane.lines:
            if not _STREAM.match(line.name):
                continue
            out += [(e.name, int(e.start_ns), int(e.duration_ns)) for e in line.events]
    return sorted(out, key=lambda e: e[1])


def summarize(events, calls: int, steps: int) -> dict:
    """Per decode step: kernel time by name, busy time (union) and span; ``idle_us`` of
    the span, of it ``between_calls_us`` (the ``calls - 1`` longest gaps, taken to be the
    host's dispatch between back-to-back calls), and ``idle_before`` (the other gaps, by
    the name of the kernel that ends them)."""
    if not events:
        return dict(
            kernels={}, busy_us=float("nan"), span_us=float("nan"), launches=0,
            idle_us=float("nan"), between_calls_us=float("nan"), idle_before={},
        )  # fmt: skip
    by_name: dict[str, float] = collections.defaultdict(float)
    gaps: list[tuple[int, str]] = []
    busy, end = 0, events[0][1]
    for name, start, dur in events:
        by_name[name] += dur
        if start > end:
            gaps.append((start - end, name))
        lo = max(start, end)
        busy += max(0, start + dur - lo)
        end = max(end, start + dur)
    span = end - events[0][1]
    per = calls * steps
    gaps.sort(reverse=True)
    between = gaps[: calls - 1]
    idle_before: dict[str, float] = collections.defaultdict(float)
    for gap, name in gaps[calls - 1 :]:
        idle_before[name] += gap
    return dict(
        kernels={k: v / per / 1e3 for k, v in by_name.items()},
        busy_us=busy / per / 1e3,
        span_us=span / per / 1e3,
        launches=len(events) / per,
        idle_us=(span - busy) / per / 1e3,
        between_calls_us=sum(g for g, _ in between) / per / 1e3,
        idle_before={k: v / per / 1e3 for k, v in idle_before.items()},
    )


def profile_case(model, cfg, batch, n_adapters, steps, calls, hinted: bool = False, max_loras=0):
    """``hinted``: the step's mapping carries the host's tokens-per-slot hint (as
    `generate`'s does; `tp.py --hinted-batches`), found from ``max_loras`` slots."""
    slots = token_slots(batch, n_adapters) if n_adapters else np.full(batch, -1, np.int32)
    hint = lj.mapping.host_tokens_per_slot(slots, max_loras) if hinted else None
    run, state = make_decode(model, steps, hint)
    cache = KVCache.init(cfg, batch, 512 + steps + 1, dtype=jnp.bfloat16)
    ids = jnp.zeros((batch,), jnp.int32)
    pos = jnp.full((batch,), 512, jnp.int32)
    idx = jnp.asarray(slots)
    jax.block_until_ready(run(state, cache, ids, pos, idx))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(run(state, cache, ids, pos, idx))
        return summarize(device_events(d), calls, steps)


def profile_prefill(model, batch, seq, n_adapters, calls, hinted: bool = False):
    """One prefill of ``batch`` prompts of ``seq`` tokens (``n_adapters`` > 0: one adapter a
    prompt, `tp.token_slots`), timed ``calls`` times under the profiler."""
    run, (state, ids, pos, idx) = prefill_step(model, batch, seq, n_adapters, hinted)
    jax.block_until_ready(run(state, ids, pos, idx))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(run(state, ids, pos, idx))
        return summarize(device_events(d), calls, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--adapters", default="8,64")
    p.add_argument("--backends", default="pallas,pallas_fused,xla")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--top", type=int, default=12, help="kernels listed per case")
    p.add_argument("--prefill", default="", help="BxS: profile one prefill instead of decode")
    p.add_argument(
        "--serial-decode",
        action="store_true",
        help="compile the decode steps in XLA's default order (LORA_JAX_CONCURRENT_DECODE=0)",
    )
    p.add_argument("--small", action="store_true", help="tiny f32 model (CPU smoke test)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.serial_decode:
        os.environ["LORA_JAX_CONCURRENT_DECODE"] = "0"
    cfg, model, max_loras = bench_model(a.layers, a.small)
    prefill = tuple(int(v) for v in a.prefill.split("x")) if a.prefill else None

    def case(n, backend):
        if prefill is None:
            hinted = backend == "hinted"
            return profile_case(model, cfg, a.batch, n, a.steps, a.calls, hinted, max_loras)
        return profile_prefill(model, *prefill, n, a.calls, backend == "hinted")

    rows = [dict(case="base", **case(0, None))]
    base_names = set(rows[0]["kernels"])
    wrap_model(
        model, lj.LoRAConfig(max_loras=max_loras, max_lora_rank=a.rank), target_modules=TARGETS
    )
    fill_random_adapters(model, a.rank)
    adapter_counts = (
        [int(v) for v in a.adapters.split(",") if v] if prefill is None else [prefill[0]]
    )
    for n in adapter_counts:
        for backend in [b for b in a.backends.split(",") if b]:
            lib = backend in ("default", "hinted", "unshared")
            lj.ops.set_default_backend(None if lib else backend)
            lora_base.SHARE_LAYER_INPUT = backend != "unshared"
            try:
                r = case(min(n, max_loras), backend)
            finally:
                lj.ops.set_default_backend(None)
                lora_base.SHARE_LAYER_INPUT = True
            r["lora_only_us"] = sum(v for k, v in r["kernels"].items() if k not in base_names)
            rows.append(dict(case=f"lora[{backend}] n={n}", **r))
    unwrap_model(model)
    b0 = rows[0]
    what = f"prefill {a.prefill}" if prefill else f"decode step, batch {a.batch}"
    print(f"device: {jax.devices()[0]}; per {what}, {cfg.num_hidden_layers} layers")
    print(
        f"{'case':<26} {'span us':>9} {'busy us':>9} {'idle us':>9} {'+busy':>8} "
        f"{'lora-only us':>12} {'launches':>9} {'between calls':>13}"
    )
    for r in rows:
        print(
            f"{r['case']:<26} {r['span_us']:>9.1f} {r['busy_us']:>9.1f} "
            f"{r['span_us'] - r['busy_us']:>9.1f} {r['busy_us'] - b0['busy_us']:>8.1f} "
            f"{r.get('lora_only_us', 0.0):>12.1f} {r['launches']:>9.1f} "
            f"{r.get('between_calls_us', float('nan')):>13.1f}"
        )
    for r in rows:
        print(f"\n{r['case']}: top kernels (us per step)")
        for k, v in sorted(r["kernels"].items(), key=lambda kv: -kv[1])[: a.top]:
            tag = "" if k in base_names else "  [lora]"
            print(f"  {v:9.2f}  {k[:90]}{tag}")
    for r in rows:
        before = r.get("idle_before", {})
        print(f"\n{r['case']}: idle inside a call, by the kernel that ends it (us per step)")
        for k, v in sorted(before.items(), key=lambda kv: -kv[1])[: a.top]:
            print(f"  {v:9.2f}  {k[:90]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), argv=sys.argv, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
