"""Benchmark: vLLM's Triton ``lora_shrink`` / ``lora_expand`` on the cells of benchmarks/ops.py.

The baseline half of DESIGN.md §5's "beat vLLM's Triton lora_shrink/lora_expand, measured
side by side in one run". Torch only (no jax: it has the GPU to itself). Same cells and
token -> slot mappings as ops.py (same seed and numpy draws, 64 slots, bf16 weights and
activations, f32 shrink output, one weight stack per call so small stacks miss the L2).
Each call is what vLLM's punica wrapper (``add_lora_linear``) launches: the shrink
zero-fills its [1, T, R] f32 output and runs (scale 1.0); the expand adds h @ B[idx].T
into y [T, H] bf16 in place (``add_inputs=True``, offset 0). vLLM's per-step metadata
(``LoRAKernelMeta.prepare_tensors``) is made outside the timing, as ops.py's work lists.
As in a default vLLM server the grid spans max_loras + 1 = 65 adapters
(``--specialize-active-lora``: the active count, rounded up to a power of two); vLLM
ships no H200 tuned config, so its default tiles run.

Time: GPU busy time per call, the union of kernel / memset / memcpy intervals in a
``torch.profiler`` trace of ``reps`` x ``calls`` distinct calls (as ops.py's ``--timer
trace``: launch gaps and host jitter drop out), after the compile and a >= 50 ms warm-up;
CUDA-event wall time, said in the row, if the trace has no GPU events. Each cell's first
call is checked against an f32 torch oracle with ops.py's relative error and bounds.
``--out`` gets {"meta", "rows" (ops.py's row format, impl "vllm"), "versus"}: with
``--against OURS.json`` (ops.py's JSON, same cells and layout), ours µs, vllm µs and
vllm / ours per cell, > 1 where ours is faster.

The vLLM sources are a local, uncommitted copy (``.vllm_ref/``, gitignored): never commit
them. To make one, put vLLM's ``vllm/lora/ops/triton_ops/{lora_shrink_op,lora_expand_op,
kernel_utils,utils,lora_kernel_metadata}.py`` at one commit (we use main at 5eaa70dac581,
2026-08-07) verbatim under ``.vllm_ref/vllm/lora/ops/triton_ops/``, with stubs for what
they import: ``vllm.envs`` (the four VLLM_* flags they read, from the environment, off by
default: no tuned-config folder, no dual stream), ``vllm.logger.init_logger`` (with
``warning_once``), ``vllm.platforms.current_platform``, ``vllm.triton_utils`` (``triton``,
``tl``), ``vllm.utils.math_utils.next_power_of_2``, ``vllm.utils.torch_utils``
(``direct_register_custom_op`` as a no-op, so the ops stay plain functions;
``async_tensor_h2d``) and a ``triton_ops/__init__.py`` exporting ``lora_shrink``,
``lora_expand`` and ``LoRAKernelMeta``. ``.vllm_ref/SOURCE.txt`` says what came from where.

On the device (repo root, ``.vllm_ref`` carried), ours then vLLM's in one command, as
``bash benchmarks/gpu_pending.sh vllm`` runs it (session 16, benchmarks/RESULTS.md)::

    G="--ops shrink,expand --tokens 1,16,64,256,4096 --hiddens 4096 --ranks 16,64,128 \\
       --adapters 8,64"
    python3 -P benchmarks/ops.py --timer trace --compile-budget 15 $G --impls ours \\
        --out $OUT/vs_ours && \\
    python3 -P benchmarks/vllm_ops.py $G --out $OUT/vs_vllm/vllm.json \\
        --against $OUT/vs_ours/ops.json

On a CPU (Triton's interpreter, in fp16: it gets bf16 dots wrong; times mean nothing)::

    python benchmarks/vllm_ops.py --interpret --tokens 16,64 --hiddens 256 --ranks 16,64 \\
        --adapters 1,8 --out /tmp/vllm.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# ops.py's cells, bounds and mappings (cells.py imports no jax)
from cells import ERR_BOUND, HBM_GBPS, MAX_LORAS, Case, ideal_bytes, mappings, rotation  # noqa: E402
from cells import grid as _grid  # noqa: E402

IMPL = "vllm"


def cases(ops: list[str], tokens, hiddens, ranks, adapters) -> list[Case]:
    """ops.py's grid of these axes (cells.grid)."""
    return _grid(ops, hiddens, ranks, tokens, adapters)


def captured_counts(max_loras: int) -> list[int]:
    """Grid sizes a ``specialize_active_lora`` server captures: powers of two, max + 1."""
    return [n for n in range(1, max_loras + 2) if n & (n - 1) == 0 or n == max_loras + 1]


def build(vllm, c: Case, calls: int, layout: str, device, specialize: bool, dt=torch.bfloat16):
    """Per-call inputs, weights and vLLM metadata. Shrink: xs [T, H], outs [1, T, R] f32,
    A [L, R, H]; expand: hs [1, T, R] f32, ys [T, H] rotated, B [L, H, R]; ``dt``: x, y,
    A and B."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=dt, scale=1.0):
        return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)

    idxs = [
        torch.as_tensor(i, dtype=torch.int32, device=device) for i in mappings(c, calls, layout)
    ]
    metas = []
    for idx in idxs:  # vLLM's per-step metadata, made here, outside the timing
        m = vllm.LoRAKernelMeta.make(
            MAX_LORAS, c.tokens, device, captured_counts(MAX_LORAS) if specialize else None
        )
        m.prepare_tensors(idx)
        metas.append(m.meta_args(c.tokens, specialize))
    if c.op == "shrink":
        ins = [randn(c.tokens, c.hidden) for _ in range(calls)]
        # One output buffer: each vLLM layer takes a fresh one from the caching allocator.
        outs = [torch.empty(1, c.tokens, c.rank, dtype=torch.float32, device=device)]
        ws = [randn(MAX_LORAS, c.rank, c.hidden, scale=c.hidden**-0.5) for _ in range(calls)]
    else:
        ins = [randn(1, c.tokens, c.rank, dtype=torch.float32) for _ in range(calls)]
        outs = [randn(c.tokens, c.hidden) for _ in range(rotation(c.tokens * c.hidden * 2, calls))]
        ws = [randn(MAX_LORAS, c.hidden, c.rank) for _ in range(calls)]
    return idxs, ins, outs, ws, metas


def vllm_call(vllm, op: str, i: int, ins, outs, ws, metas, out=None) -> torch.Tensor:
    """Call i as vLLM's punica wrapper makes it; ``out`` replaces its output buffer."""
    out = outs[i % len(outs)] if out is None else out
    if op == "shrink":
        vllm.lora_shrink(ins[i], [ws[i]], out, *metas[i], 1.0)
    else:
        vllm.lora_expand(ins[i], [ws[i]], out, *metas[i], offset_start=0, add_inputs=True)
    return out


def reference(op: str, x, w, idx, y=None) -> torch.Tensor:
    """f32 torch oracle of one call, one matmul per used slot. Shrink: x [T, H] @ A[s].T;
    expand: y + h[0] @ B[s].T summed in f32, cast to y's dtype once (as ops.py's)."""
    x = x[0] if op == "expand" else x  # h [1, T, R] -> [T, R]
    out = torch.zeros(x.shape[0], w.shape[1], device=x.device) if op == "shrink" else y.float()
    for s in torch.unique(idx).tolist():
        if s < 0:  # no adapter: the shrink leaves zeros, the expand leaves y
            continue
        rows = torch.nonzero(idx == s)[:, 0]
        delta = x[rows].float() @ w[s].float().T
        out[rows] = delta if op == "shrink" else out[rows] + delta
    return out if op == "shrink" else out.to(y.dtype).float()


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (ops.py's definition)."""
    got = got.float().reshape(ref.shape)
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def busy_us(run, reps: int, sync) -> tuple[float, dict[str, float], str]:
    """(GPU busy µs per ``run()``, µs per run by kernel name, timer) from a torch.profiler
    trace: the union of device intervals, so launch gaps and host jitter drop out."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                run()
            sync()
        spans = sorted(
            (e.time_range.start, e.time_range.end, e.name)
            for e in prof.events()
            if e.device_type == DeviceType.CUDA
        )
        why = "no kernels in trace"
    except Exception as e:  # noqa: BLE001 - a broken profiler: CUDA events instead
        spans, why = [], f"trace: {type(e).__name__}: {str(e)[:60]}"
    if not spans:  # no GPU events in the trace: CUDA-event wall time instead
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            run()
        end.record()
        sync()
        return start.elapsed_time(end) * 1e3 / reps, {}, f"cuda events ({why})"
    busy, by_name = union_us(spans)
    return busy / reps, {k: v / reps for k, v in by_name.items()}, "trace"


def union_us(spans: list[tuple[float, float, str]]) -> tuple[float, dict[str, float]]:
    """(length of the union of sorted (start, end, name) intervals, total length by name)."""
    busy, end, by_name = 0.0, spans[0][0] if spans else 0.0, {}
    for lo, hi, name in spans:
        busy += max(0.0, hi - max(lo, end))
        end = max(end, hi)
        by_name[name] = by_name.get(name, 0.0) + (hi - lo)
    return busy, by_name


def time_cell(vllm, c: Case, calls: int, reps: int, data, interpret: bool):
    """(µs per call, top kernels' µs per call, timer) for ``calls`` distinct calls."""
    idxs, ins, outs, ws, metas = data

    def run():
        for i in range(calls):
            vllm_call(vllm, c.op, i, ins, outs, ws, metas)

    if interpret:  # Triton's CPU interpreter: a smoke test, not a measurement
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e6 / calls, {}, "interpret (CPU wall)"
    sync = torch.cuda.synchronize
    run()  # compiles whatever the check did not
    sync()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.05:  # >= 50 ms of GPU work: clocks up
        run()
        sync()
    us, kernels, timer = busy_us(run, reps, sync)
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:4])
    return us / calls, {k[:80]: round(v / calls, 2) for k, v in top.items()}, timer


def check_cell(vllm, c: Case, data) -> float:
    """Max rel err of the cell's first call (on copies: the timed buffers stay as built)."""
    idxs, ins, outs, ws, metas = data
    if c.op == "shrink":
        got = vllm_call(vllm, c.op, 0, ins, outs, ws, metas, out=torch.empty_like(outs[0]))
        return max_rel_err(got, reference("shrink", ins[0], ws[0], idxs[0]))
    y = outs[0].clone()
    got = vllm_call(vllm, c.op, 0, ins, outs, ws, metas, out=y.clone())
    return max_rel_err(got, reference("expand", ins[0], ws[0], idxs[0], y))


def kernel_config(vllm_utils, c: Case) -> dict:
    """The tiles vLLM picks for this cell (its defaults: no tuned file for this GPU). The
    ops pass max_loras = their metadata's length, MAX_LORAS + 1."""
    args = (c.tokens, c.hidden, c.rank, 1)
    if c.op == "shrink":
        return vllm_utils.get_lora_op_configs("shrink", MAX_LORAS + 1, *args)
    return vllm_utils.get_lora_op_configs("expand", MAX_LORAS + 1, *args, add_inputs=True)


def compare(ours_rows: list[dict], vllm_rows: list[dict], ours_impl: str = "ours") -> list[dict]:
    """Side by side per cell: ours µs, vllm µs and vllm / ours (> 1: ours is faster)."""
    key = ("op", "tokens", "hidden", "rank", "adapters")
    ours = {tuple(r[k] for k in key): r["impls"].get(ours_impl, {}).get("us") for r in ours_rows}
    out = []
    for r in vllm_rows:
        o, v = ours.get(tuple(r[k] for k in key)), r["impls"].get(IMPL, {}).get("us")
        ratio = v / o if o and v else None
        out.append(dict({k: r[k] for k in key}, ours_us=o, vllm_us=v, vllm_over_ours=ratio))
    return out


def versus_table(vs: list[dict]) -> str:
    lines = ["| op | T | H | R | n | ours µs | vllm µs | vllm / ours |", "|" + "---|" * 8]
    for r in vs:
        cells = [f"{r[k]:.1f}" if r[k] else "–" for k in ("ours_us", "vllm_us")]
        ratio = f"{r['vllm_over_ours']:.2f}" if r["vllm_over_ours"] else "–"
        lines.append(
            f"| {r['op']} | {r['tokens']} | {r['hidden']} | {r['rank']} | {r['adapters']} "
            f"| {cells[0]} | {cells[1]} | {ratio} |"
        )
    ratios = [r["vllm_over_ours"] for r in vs if r["vllm_over_ours"]]
    if ratios:
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        wins = sum(x > 1 for x in ratios)
        lines.append(f"\nours faster in {wins}/{len(ratios)} cells; geomean vllm / ours {geo:.2f}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = "| op | T | H | R | n | ideal µs | vllm µs | GB/s | % roofline | max rel err |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        v = r["impls"][IMPL]
        cell = f"| {r['op']} | {r['tokens']} | {r['hidden']} | {r['rank']} | {r['adapters']} "
        err = f"{r['max_rel_err']:.1e}" + ("" if r["err_ok"] else " (over bound)")
        if "us" not in v:
            lines.append(cell + f"| {r['ideal_us']:.1f} | skip: {v['skipped'][:40]} | | | {err} |")
            continue
        pct = 100 * r["ideal_us"] / v["us"]
        lines.append(
            cell
            + f"| {r['ideal_us']:.1f} | {v['us']:.1f} | {v['gbps']:.0f} | {pct:.0f} % | {err} |"
        )
    return "\n".join(lines)


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def vllm_src(src: str) -> str:
    """``src`` made absolute; exits with a message if it holds no vLLM copy."""
    src = os.path.abspath(src)
    if not os.path.isfile(os.path.join(src, "vllm/lora/ops/triton_ops/lora_shrink_op.py")):
        sys.exit(
            f"error: no vLLM copy at --vllm-src {src} (expected "
            "vllm/lora/ops/triton_ops/lora_shrink_op.py there). Make one as this script's "
            "docstring says, or pass --vllm-src DIR."
        )
    return src


def load_vllm(src: str):
    """(vLLM's triton_ops package, its utils module, SOURCE.txt's first line)."""
    sys.path.insert(0, src)
    try:
        from vllm.lora.ops import triton_ops
        from vllm.lora.ops.triton_ops import utils
    except ImportError as e:
        sys.exit(f"error: cannot import vLLM's LoRA ops from --vllm-src {src}: {e}")

    source = os.path.join(src, "SOURCE.txt")
    first = open(source).readline().strip() if os.path.isfile(source) else "no SOURCE.txt"
    return triton_ops, utils, first


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-src", default=".vllm_ref", help="folder holding the vllm package")
    p.add_argument("--ops", default="shrink,expand")
    p.add_argument("--tokens", default="1,16,64,256,1024,4096,16384")
    p.add_argument("--hiddens", default="4096,8192")
    p.add_argument("--ranks", default="16,64,128")
    p.add_argument("--adapters", default="1,8,64")
    p.add_argument("--layout", default="shuffled", choices=("shuffled", "runs"))
    p.add_argument("--reps", type=int, default=3, help="traced runs of `calls` calls each")
    p.add_argument(
        "--specialize-active-lora",
        action="store_true",
        help="grid by the active adapter count (vLLM's specialize_active_lora), not 65",
    )
    p.add_argument("--interpret", action="store_true", help="TRITON_INTERPRET=1, CPU tensors")
    p.add_argument("--against", default=None, help="ops.py JSON (--impls ours) of the same cells")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "vllm_ops.json"))
    a = p.parse_args(argv)
    if a.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported, just below
    src = vllm_src(a.vllm_src)
    if not a.interpret and not torch.cuda.is_available():
        print("skipped: no CUDA GPU here (pass --interpret for a CPU smoke test)", flush=True)
        return
    vllm, vllm_utils, source = load_vllm(src)
    torch.backends.cuda.matmul.allow_tf32 = False  # the f32 oracle in full f32
    device = torch.device("cpu" if a.interpret else "cuda")
    # Triton's CPU interpreter computes tl.dot of bf16 operands wrongly (3.9: garbage out):
    # the --interpret smoke test runs the same kernels in fp16.
    dt = torch.float16 if a.interpret else torch.bfloat16
    grid = [[int(v) for v in s.split(",")] for s in (a.tokens, a.hiddens, a.ranks, a.adapters)]
    import triton

    meta = dict(
        vllm_source=source,
        torch=torch.__version__,
        triton=triton.__version__,
        device=torch.cuda.get_device_name() if not a.interpret else "cpu (interpret)",
        layout=a.layout,
        specialize_active_lora=a.specialize_active_lora,
        reps=a.reps,
        dtype=str(dt),
    )
    print(meta, flush=True)
    rows = []
    doc = dict(meta=meta, rows=rows)
    for c in cases(a.ops.split(","), *grid):
        calls = 2 if a.interpret else (8 if c.tokens >= 4096 else 32)
        data = build(vllm, c, calls, a.layout, device, a.specialize_active_lora, dt)
        grid_loras = int(data[4][0][-1])  # num_active_loras: vLLM's grid over adapters
        res = dict(dataclasses.asdict(c), ideal_us=ideal_bytes(c) / HBM_GBPS / 1e3, impls={})
        res.update(layout=a.layout, grid_loras=grid_loras)
        res["config"] = kernel_config(vllm_utils, c)
        try:
            res["max_rel_err"] = check_cell(vllm, c, data)
        except Exception as e:  # noqa: BLE001 - report the cell, keep the run going
            res["max_rel_err"] = float("nan")
            print(f"accuracy check failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        res["err_ok"] = res["max_rel_err"] <= ERR_BOUND[c.op]
        try:
            us, kernels, timer = time_cell(vllm, c, calls, a.reps, data, a.interpret)
            v = dict(us=us, gbps=ideal_bytes(c) / us / 1e3, timer=timer, kernels_us=kernels)
        except Exception as e:  # noqa: BLE001
            v = dict(skipped=f"run: {type(e).__name__}: {str(e)[:100]}")
        res["impls"][IMPL] = v
        rows.append(res)
        took = f"{v['us']:.1f} us" if "us" in v else v["skipped"]
        print(
            f"{c.op} T={c.tokens} H={c.hidden} R={c.rank} n={c.adapters}: vllm {took}, "
            f"max rel err {res['max_rel_err']:.1e}",
            flush=True,
        )
        write_json(a.out, doc)  # after every cell, as ops.py: a cut-off run keeps its rows
        del data
        vllm_utils._LORA_A_PTR_DICT.clear()  # they hold the weights (and key on addresses)
        vllm_utils._LORA_B_PTR_DICT.clear()
    print("\n" + table(rows))
    checked = [r for r in rows if r["err_ok"]]
    print(f"\naccuracy: {len(checked)}/{len(rows)} cells within the bound {ERR_BOUND}")
    if a.against:
        with open(a.against) as f:
            ours = json.load(f)
        doc["versus"] = compare(ours["rows"] if isinstance(ours, dict) else ours, rows)
        print("\n" + versus_table(doc["versus"]))
        write_json(a.out, doc)


if __name__ == "__main__":
    main()
