"""Hardware counters for chosen ops cells: run each cell's kernels once, under Nsight
Compute (``ncu``), and summarize what it read.

The trace timer (ops.py) says how long a kernel takes; this says why: DRAM throughput
against the GPU's peak, achieved occupancy, registers and shared memory per program, L2
hit rate, and which pipes (tensor cores as WGMMA ``gmma`` or the older ``hmma``) the
kernel issued to. Each cell runs once, on the library's default tiles and the host's
prompt tiles, as in the ops grid (shuffled tokens, 64 slots, bf16). ncu replays the
kernel once per counter pass with the caches flushed, so the figures are for a cold L2.

On the GPU machine (``-k regex:lora_``: only the LoRA kernels are profiled)::

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:lora_ \\
        --section SpeedOfLight --section Occupancy ... --csv --page raw \\
        python3 -P benchmarks/ncu_cells.py --cells shrink:4096x4096x16x1 > out/c1.csv
    python3 benchmarks/ncu_cells.py --summarize out/c*.csv

Leave jax's memory pool off (``XLA_PYTHON_CLIENT_PREALLOCATE=false``): ncu saves and
restores the memory a kernel may touch between its passes, and with jax's pool that
is most of the GPU (session 16: six cells did not finish in 420 s with it on).

A cell is ``op:TxHxRxn`` (tokens, hidden, rank, adapters of 64 slots).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# ncu --page raw columns: (what the table calls it, metric name, scale)
METRICS = (
    ("µs", "gpu__time_duration.sum", 1e-3),
    ("DRAM GB/s", "dram__bytes.sum.per_second", 1e-9),
    ("DRAM % peak", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("L2 hit %", "lts__t_sector_hit_rate.pct", 1),
    ("occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
    ("regs", "launch__registers_per_thread", 1),
    ("smem KiB", "launch__shared_mem_per_block", 1 / 1024),
    ("grid", "launch__grid_size", 1),
    ("warps", "launch__block_size", 1 / 32),
    ("issue %", "sm__inst_issued.avg.pct_of_peak_sustained_elapsed", 1),
    ("tensor pipe %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", 1),
    ("gmma inst %", "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active", 1),
    ("hmma inst %", "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active", 1),
)
STALLS = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")
"""Raw-page prefix and suffix of the warp stall reasons (warps stalled per issue)."""


def run_cells(cells: list[str]) -> None:
    import jax
    import ops as ops_bench

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", file=sys.stderr)
    for cell in cells:
        op, shape = cell.split(":")
        t, h, r, n = map(int, shape.split("x"))
        c = ops_bench.Case(op, t, h, r, n)
        inputs, w, metas = ops_bench.build(c, 1)
        fn = ops_bench.ours(
            c,
            None,
            prompt_tiles=ops_bench.host_prompt_tiles(metas),
            tokens_per_slot=ops_bench.host_tokens_per_slot(metas),
        )
        compiled = jax.jit(fn).lower(inputs, w, metas).compile()
        jax.block_until_ready(compiled(inputs, w, metas))
        print(f"ran {cell}", file=sys.stderr, flush=True)


def _number(v: str) -> float | None:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


def _records(path: str):
    """The kernel records of one ncu --csv --page raw file (the program's output dropped)."""
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    return list(csv.DictReader(lines))


def summarize(paths: list[str]) -> list[dict]:
    """One dict per profiled kernel: the METRICS (None where ncu did not collect one; the
    WGMMA ``gmma`` and ``mma.sync`` ``hmma`` shares are 0 where the kernel issued none)
    and the top three stall reasons."""
    rows = []
    for rec in (r for p in paths for r in _records(p)):
        if not rec.get("Kernel Name") or _number(rec.get("ID", "")) is None:
            continue  # the units row
        row = {"kernel": rec["Kernel Name"][:40]}
        for label, name, scale in METRICS:
            v = _number(rec.get(name, ""))
            row[label] = None if v is None else v * scale
        pre, post = STALLS
        stalls = {
            k[len(pre) : -len(post)]: _number(v)
            for k, v in rec.items()
            if k.startswith(pre) and k.endswith(post) and _number(v)
        }
        top = sorted(stalls.items(), key=lambda kv: -kv[1])[:3]
        row["top stalls"] = ", ".join(f"{k} {v:.1f}" for k, v in top)
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    cols = ["kernel"] + [m[0] for m in METRICS] + ["top stalls"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("–" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default="", help="comma-separated op:TxHxRxn")
    p.add_argument("--summarize", nargs="*", default=[], help="ncu --csv --page raw files")
    a = p.parse_args(argv)
    if a.summarize:
        print_table(summarize(a.summarize))
    if a.cells:
        run_cells(a.cells.split(","))


if __name__ == "__main__":
    main()
