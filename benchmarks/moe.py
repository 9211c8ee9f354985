"""Benchmark: fused MoE with and without per-token LoRA, dense reference vs grouped fast path.

Expert shapes of Qwen3-30B-A3B (E=128, top-8, hidden 2048, moe_inter 768) and
Mixtral-8x7B (E=8, top-2, hidden 4096, inter 14336), decode (T=64) and prefill (T=4096),
n distinct adapters (contiguous runs of tokens per adapter at prefill, round-robin at
decode), rank 16, bf16, random weights (nothing downloaded). Variants:

* base/dense     FusedMoE(impl="dense"): every local expert on every token (reference)
* base/grouped   FusedMoE(impl="grouped"): pairs sorted by expert, `ragged_dot`
* lora/dense     the dense loop + Punica ops per expert (the LoRA reference)
* lora/ops       grouped + LoRA over pairs with a combined (slot, expert) index through
                 `lora_jax.ops` (Pallas kernels on GPU): the fast path
* lora/ops-xla   the same, `ops` forced to its XLA gather backend
* lora/ragged    grouped + LoRA as `ragged_dot` over pairs sorted by (slot, expert)

Device time, not host dispatch (DESIGN.md §5): one jit runs `--steps` chained MoE calls
(`x <- rmsnorm(x + moe(x, x @ router))`, so routing changes every call and XLA cannot
merge them), the program is run `--reps` times and the best wall time is divided by the
number of calls. A variant that fails to compile or run (e.g. out of memory) is reported
with its error instead of stopping the run.

    python benchmarks/moe.py --out moe.json                 # on the GPU machine
    python benchmarks/moe.py --small --out /tmp/moe.json    # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.config import LoRAConfig
from lora_jax.layers.moe import FusedMoEWithLoRA
from lora_jax.mapping import make_lora_mapping
from lora_jax.moe import FusedMoE

MODELS = {
    # name: (num_experts, top_k, hidden, moe_intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
SMALL_MODELS = {"tiny-e8": (8, 2, 64, 32)}
PHASES = {"decode": 64, "prefill": 4096}
SMALL_PHASES = {"decode": 16, "prefill": 64}
VARIANTS = ("base/dense", "base/grouped", "lora/dense", "lora/ops", "lora/ops-xla", "lora/ragged")


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    phase: str
    tokens: int
    adapters: int
    variant: str
    us_per_call: float | None
    error: str | None = None


def token_slots(tokens: int, adapters: int, phase: str) -> np.ndarray:
    """Decode: requests round-robin over adapters; prefill: one contiguous run each."""
    t = np.arange(tokens)
    return (t % adapters if phase == "decode" else t * adapters // tokens).astype(np.int32)


def fill_random(layer: FusedMoEWithLoRA, key, scale: float = 0.02) -> None:
    """Random full-rank adapters in every slot (set_lora's checks are not under test)."""
    stacks = [*layer.w13_lora_a, *layer.w13_lora_b, layer.w2_lora_a, layer.w2_lora_b]
    for var, k in zip(stacks, jax.random.split(key, len(stacks))):
        value = var[...]
        var.set_value((scale * jax.random.normal(k, value.shape, jnp.float32)).astype(value.dtype))
    r = layer.lora_config.max_lora_rank
    layer.slot_ranks.set_value(jnp.full(layer.slot_ranks[...].shape, r, jnp.int32))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _chain(graphdef, steps: int, max_loras: int, state, x, router, idx):
    layer = nnx.merge(graphdef, state)
    if max_loras:
        layer.lora_context.set_value(make_lora_mapping(idx, max_loras))

    def body(_, x):
        logits = jnp.dot(x, router, preferred_element_type=jnp.float32)  # [T, E]
        y = x.astype(jnp.float32) + layer(x, logits).astype(jnp.float32)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)
        return y.astype(x.dtype)

    return jax.lax.fori_loop(0, steps, body, x)


def time_variant(layer, max_loras, x, router, idx, steps, reps) -> float:
    graphdef, state = nnx.split(layer)
    run = lambda: _chain(graphdef, steps, max_loras, state, x, router, idx)  # noqa: E731
    jax.block_until_ready(run())  # compile + warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - t0)
    return best / steps * 1e6


def configure(variant: str, base: FusedMoE, lora: FusedMoEWithLoRA | None):
    """Sets the static impl switches; returns (module to run, uses LoRA)."""
    kind, how = variant.split("/")
    base.impl = "dense" if how == "dense" else "grouped"
    if kind == "base":
        return base, False
    lora.lora_impl = "ragged" if how == "ragged" else "ops"
    lora.ops_backend = "xla" if how == "ops-xla" else None
    return lora, True


def run_case(name, shape, phase, tokens, adapters_list, variants, a, rows):
    E, k, H, inter = shape
    key = jax.random.key(0)
    kb, kx, kr, kl = jax.random.split(key, 4)
    init = nnx.initializers.normal(0.02)
    base = FusedMoE(
        E, k, H, inter, renormalize=True, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
        kernel_init=init, rngs=nnx.Rngs(kb),
    )  # fmt: skip
    x = jax.random.normal(kx, (tokens, H), jnp.bfloat16)
    router = (jax.random.normal(kr, (H, E), jnp.float32) / np.sqrt(H)).astype(jnp.bfloat16)
    base_done: dict[str, float | None] = {}
    for n in adapters_list:
        idx = jnp.asarray(token_slots(tokens, n, phase))
        lora = None
        if any(v.startswith("lora/") for v in variants):
            cfg = LoRAConfig(max_loras=n, max_lora_rank=a.rank, lora_dtype=jnp.bfloat16)
            lora = FusedMoEWithLoRA(base, cfg)
            fill_random(lora, kl)
        for variant in variants:
            if variant.startswith("base/") and variant in base_done:
                us, err = base_done[variant], None  # independent of n: measured once
            else:
                module, uses_lora = configure(variant, base, lora)
                try:
                    us = time_variant(
                        module, n if uses_lora else 0, x, router, idx, a.steps, a.reps
                    )
                    err = None
                except Exception as e:  # noqa: BLE001 - report OOM / lowering errors per cell
                    us, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                if variant.startswith("base/"):
                    base_done[variant] = us
            row = Row(name, phase, tokens, n, variant, us, err)
            rows.append(row)
            print(fmt_row(row, rows), flush=True)
        del lora


def fmt_row(r: Row, rows) -> str:
    ref = next(
        (
            q.us_per_call
            for q in rows
            if (q.model, q.phase, q.variant) == (r.model, r.phase, "base/grouped") and q.us_per_call
        ),
        None,
    )
    us = "-" if r.us_per_call is None else f"{r.us_per_call:10.1f}"
    ratio = "" if r.us_per_call is None or not ref else f"{r.us_per_call / ref:7.2f}x"
    tail = f"  [{r.error}]" if r.error else ""
    return f"{r.model:15s} {r.phase:8s} T={r.tokens:<5d} n={r.adapters:<3d} {r.variant:13s} {us:>10s} us {ratio:>8s}{tail}"  # noqa: E501


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test")
    p.add_argument("--models", default=None, help="comma list; default all")
    p.add_argument("--phases", default="decode,prefill")
    p.add_argument("--adapters", default="1,8,32")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=None, help="MoE calls inside one jit")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument(
        "--ragged-triton",
        action="store_true",
        help="lower jax.lax.ragged_dot with JAX's Pallas Triton kernel on GPU "
        "(jax_ragged_dot_use_gpu_pallas_triton_lowering) instead of XLA's",
    )
    a = p.parse_args(argv)
    if a.ragged_triton:
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
    models = SMALL_MODELS if a.small else MODELS
    phases = SMALL_PHASES if a.small else PHASES
    if a.steps is None:
        a.steps = 2 if a.small else 10
    if a.small and a.adapters == "1,8,32":
        a.adapters = "1,4"
    names = a.models.split(",") if a.models else list(models)
    variants = a.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; allowed: {VARIANTS}")
    adapters = [int(n) for n in a.adapters.split(",")]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {a.steps} calls per jit")
    print("ratios are vs base/grouped of the same model and phase")
    rows: list[Row] = []
    for name in names:
        if name not in models:
            raise SystemExit(f"unknown model {name!r}; allowed: {list(models)}")
        for phase in a.phases.split(","):
            run_case(name, models[name], phase, phases[phase], adapters, variants, a, rows)
    print("\nsummary (ratios vs base/grouped of the same model and phase)")
    for r in rows:
        print(fmt_row(r, rows))
    if a.out:
        meta = dict(
            jax=jax.__version__,
            device=jax.devices()[0].device_kind,
            steps=a.steps,
            rank=a.rank,
            ragged_triton=a.ragged_triton,
        )
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
        print(f"wrote {a.out}")
    return rows


if __name__ == "__main__":
    main()
