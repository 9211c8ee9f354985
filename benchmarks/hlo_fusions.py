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

import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp import TARGETS, fill_random_adapters, make_prefill, token_slots  # noqa: E402

import lora_jax as lj  # noqa: E402
from lora_jax.models import DecoderConfig, DecoderForCausalLM  # noqa: E402
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
    if a.small:
        cfg, dtype, max_loras = DecoderConfig.tiny(num_hidden_layers=2), jnp.float32, 8
    else:
        cfg, dtype, max_loras = (
            DecoderConfig.llama3_8b(num_hidden_layers=a.layers),
            jnp.bfloat16,
            64,
        )
    model = DecoderForCausalLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    wrap_model(
        model, lj.LoRAConfig(max_loras=max_loras, max_lora_rank=a.rank), target_modules=TARGETS
    )
    fill_random_adapters(model, a.rank)
    batch, seq = (int(v) for v in a.prefill.split("x"))
    idx = jnp.asarray(np.repeat(token_slots(batch, batch), seq))
    run, state = make_prefill(model)
    ids = jnp.zeros((batch, seq), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    text = run.lower(state, ids, pos, idx).compile().as_text()
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
