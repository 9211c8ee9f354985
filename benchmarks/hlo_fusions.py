"""Prints the optimized HLO of the named fusions of the tp = 1 model's prefill (a probe:
which ops a profile's kernel names stand for).

    python3 -P benchmarks/hlo_fusions.py --layers 4 --prefill 4x1024 --rank 64 \
        --names loop_multiply_fusion_11,fusion_461 --out hlo.txt
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp import TARGETS, bench_model, fill_random_adapters, prefill_step  # noqa: E402

import lora_jax as lj  # noqa: E402
from lora_jax.serving.wrap import wrap_model  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefill", default="4x1024")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--names", default="")
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    cfg, model, max_loras = bench_model(a.layers, a.small)
    wrap_model(
        model, lj.LoRAConfig(max_loras=max_loras, max_lora_rank=a.rank), target_modules=TARGETS
    )
    fill_random_adapters(model, a.rank)
    batch, seq = (int(v) for v in a.prefill.split("x"))
    run, args = prefill_step(model, batch, seq, min(batch, max_loras))
    text = run.lower(*args).compile().as_text()
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    for name in filter(None, a.names.split(",")):
        # the call site (shapes, operands, metadata) of each fusion of that name
        for line in text.splitlines():
            if re.search(rf"\b{re.escape(name)}\b = ", line):
                print(line.strip()[:1500])
                print()


if __name__ == "__main__":
    main()
