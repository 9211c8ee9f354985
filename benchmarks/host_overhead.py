"""Host time of one generation call: `generate(model, ...)` against a `Generator`.

`generate` splits the model's graph (`nnx.split`) on every call and passes it to its
jitted steps as a static argument (hashed and compared per call); a `Generator` walks the
graph once and passes the current weights as a flat list. The model here is the tiny
decoder with ``--layers`` layers, LoRA-wrapped on its 7 projections (or not, "base"), so
the device's compute is small and the host's share shows: on a CPU the difference of the
two columns is host time. Prints a table (median ms of ``--reps`` calls after a warm-up)
and writes JSON.

    python benchmarks/host_overhead.py --layers 8,32 --out host.json
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
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp import TARGETS, fill_random_adapters  # noqa: E402

import lora_jax as lj  # noqa: E402
from lora_jax.models import DecoderConfig, DecoderForCausalLM  # noqa: E402
from lora_jax.serving.generate import Generator, generate  # noqa: E402
from lora_jax.serving.wrap import wrap_model  # noqa: E402

PROMPTS = [[1, 2, 3], [4, 5]]


def median_ms(fn, reps: int) -> float:
    fn()  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def measure(model, slots, new_tokens: int, reps: int) -> tuple[float, float]:
    """(generate ms, Generator ms) per call, after checking they give the same tokens."""
    gen = Generator(model)
    kw = dict(max_new_tokens=new_tokens)
    if gen(PROMPTS, slots, **kw).tokens != generate(model, PROMPTS, slots, **kw).tokens:
        raise SystemExit("Generator and generate disagree")
    t_gen = median_ms(lambda: generate(model, PROMPTS, slots, **kw), reps)
    return t_gen, median_ms(lambda: gen(PROMPTS, slots, **kw), reps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="8,32")
    p.add_argument("--new-tokens", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    rows = []
    print(f"device: {jax.devices()[0]}; tiny decoder, {len(PROMPTS)} prompts, "
          f"{a.new_tokens} new token(s), median of {a.reps}")  # fmt: skip
    print(f"{'layers':>6} {'model':>5} {'variables':>9} {'generate ms':>12} "
          f"{'Generator ms':>13} {'ratio':>6}")  # fmt: skip
    for layers in [int(v) for v in a.layers.split(",") if v]:
        cfg = DecoderConfig.tiny(num_hidden_layers=layers)
        model = DecoderForCausalLM(
            cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
        )
        for kind in ("base", "lora"):
            slots = [-1, -1]
            if kind == "lora":
                lcfg = lj.LoRAConfig(max_loras=8, max_lora_rank=8)
                wrap_model(model, lcfg, target_modules=TARGETS)
                fill_random_adapters(model, 8)
                slots = [0, 3]
            t_gen, t_cls = measure(model, slots, a.new_tokens, a.reps)
            n_vars = len(jax.tree.leaves(nnx.state(model)))
            rows.append(dict(layers=layers, model=kind, variables=n_vars, generate_ms=t_gen,
                             generator_ms=t_cls))  # fmt: skip
            print(f"{layers:>6} {kind:>5} {n_vars:>9} {t_gen:>12.1f} {t_cls:>13.1f} "
                  f"{t_gen / t_cls:>6.1f}")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), argv=sys.argv, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
