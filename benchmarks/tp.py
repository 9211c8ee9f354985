"""Decoder step time: base vs LoRA vs fully sharded LoRA, at tp = 1 and tp = N.

A Llama-3-8B-shaped decoder (random bf16 weights, nothing downloaded), rank-16 LoRA on
all 7 projections (q, k, v, o, gate, up, down), decode batches with as many distinct
adapters as requests (capped at max_loras) plus 8-adapter cases, and a prefill case.

Device time, not host dispatch: each timed call runs `--steps` decode steps inside one
jit (a `fori_loop` feeding back argmax tokens), so the ~50-80 us dispatch of one call is
spread over the steps; they are compiled as the library's own decode steps are
(`lj.decode_compiler_options()`; `--serial-decode`: XLA's default order). Collective
bytes per step are read from the compiled HLO (the loop body). Targets (DESIGN.md §5):
B=64, 8 adapters: LoRA step <= 1.10 x base; 64 adapters: LoRA's added time <= 1.3 x the
time to read the used adapters once at HBM bandwidth (per GPU).

    python benchmarks/tp.py --tp 1,2 --out results.json       # on the GPU machine
    python benchmarks/tp.py --small --tp 1,2                   # CPU smoke test
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lora_jax as lj
from lora_jax.kernels.shrink_expand.work_list import prompt_tiles, whole_tiles
from lora_jax.layers import base as lora_base
from lora_jax.models import DecoderConfig, DecoderForCausalLM
from lora_jax.models.kv_cache import KVCache
from lora_jax.serving.wrap import unwrap_model, wrap_model

HBM_BYTES_PER_S = 4.3e12  # H200 copy ceiling
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_COLL = re.compile(
    r"=\s*(\(?[^=]*?)\s+(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
    r"(?:-start)?\("
)
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def collective_bytes(hlo: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in _COLL.finditer(hlo):
        n = 0
        for dt, dims in _SHAPE.findall(m.group(1)):
            size = _BYTES.get(dt, 4)
            for d in filter(None, dims.split(",")):
                size *= int(d)
            n += size
        out[m.group(2)] = out.get(m.group(2), 0) + n
    return out


def fill_random_adapters(model, rank: int, seed: int = 0) -> None:
    """Random adapters in every slot (fast, on device, keeping each stack's sharding).

    One small jit per distinct (shape, dtype, sharding), reused across layers: a single
    jit drawing all ~224 stacks took 4 min 21 s to compile on the GPU (threefry
    unrolled per output), and a jit per stack recompiled the same program hundreds of times.
    """
    state = nnx.state(model, nnx.LoRAParam)
    leaves, treedef = jax.tree.flatten(state)
    draws = {}
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = []
    for key, leaf in zip(keys, leaves):
        spec = (leaf.shape, leaf.dtype, leaf.sharding)
        if spec not in draws:
            shape, dtype, sharding = spec
            draws[spec] = jax.jit(
                lambda k, shape=shape, dtype=dtype: (jax.random.normal(k, shape) * 0.02).astype(
                    dtype
                ),
                out_shardings=sharding,
            )
        new.append(draws[spec](key))
    nnx.update(model, jax.tree.unflatten(treedef, new))
    for _, node in nnx.iter_graph(model):
        if isinstance(node, lj.LoRASlotRanks):
            node.set_value(jnp.full(node.shape, rank, jnp.int32, device=node[...].sharding))


def adapter_bytes_per_gpu(model) -> float:
    """Bytes of one adapter (one slot of every stack) held by one GPU."""
    total = 0.0
    for leaf in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
        shard = leaf.addressable_shards[0].data
        total += shard.nbytes / shard.shape[0]
    return total


def token_slots(batch: int, n_adapters: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    slots = np.arange(batch) % n_adapters
    rng.shuffle(slots)  # adapters scattered over the batch, as in serving
    return slots.astype(np.int32)


def split_flat(model):
    """(graphdef, the state's arrays as a flat list, their treedef): the steps take the
    list, whose dispatch costs jax ~0.5 us an array, where an `nnx.State` costs ~5 us a
    variable of Python-level flattening on every call (`benchmarks/host_overhead.py`)."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    return graphdef, leaves, treedef


def make_decode(model, steps: int, tokens_per_slot: int | None = None):
    """``tokens_per_slot``: the host's hint for the step's mapping (`LoRAMapping`)."""
    graphdef, leaves, treedef = split_flat(model)

    # Compiled as lora_jax's own decode steps are (`lj.decode_compiler_options`: kernels
    # with no data dependence side by side on a GPU, unless LORA_JAX_CONCURRENT_DECODE=0).
    @functools.partial(jax.jit, compiler_options=lj.decode_compiler_options() or None)
    def run(leaves, cache, ids, pos, idx):
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        lj.set_lora_mapping(m, idx, tokens_per_slot=tokens_per_slot)

        def body(i, carry):
            cache, ids = carry
            logits, cache = m(ids[:, None], (pos + i)[:, None], cache)
            return cache, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

        return jax.lax.fori_loop(0, steps, body, (cache, ids))

    return run, leaves


def make_prefill(model, hints: dict | None = None):
    """``hints``: what the host found of the step's prompts (`prefill_hints`), for its
    mapping (`LoRAMapping.prompt_tiles` / ``whole_tiles``), as `generate` passes them."""
    hints = hints or {}
    graphdef, leaves, treedef = split_flat(model)

    @jax.jit
    def run(leaves, ids, pos, idx):
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        lj.set_lora_mapping(m, idx, **hints)
        hidden, _ = m.model(ids, pos, None, flat=False)
        return m.compute_logits(hidden[:, -1])

    return run, leaves


def timeit(fn, *args, reps: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), compile_s


def bench_decode(model, cfg, rules, batch, n_adapters, args, hinted: bool = False):
    slots = token_slots(batch, n_adapters) if n_adapters else np.full(batch, -1, np.int32)
    hint = lj.mapping.host_tokens_per_slot(slots, args.max_loras) if hinted else None
    run, state = make_decode(model, args.steps, hint)
    max_len = args.context + args.steps + 1
    cache = KVCache.init(cfg, batch, max_len, rules=rules, dtype=jnp.bfloat16)
    ids = jnp.zeros((batch,), jnp.int32)
    pos = jnp.full((batch,), args.context, jnp.int32)
    idx = jnp.asarray(slots)
    hlo = run.lower(state, cache, ids, pos, idx).compile().as_text()
    t, c = timeit(run, state, cache, ids, pos, idx, reps=args.reps)
    return t / args.steps, c, collective_bytes(hlo)


def prefill_hints(host_idx: np.ndarray) -> dict:
    """What the host finds of a prefill's token -> slot indices: its prompt tiles (the
    shrink's) and whole tiles (the expand's), as `generate`'s prefill passes them."""
    return dict(prompt_tiles=prompt_tiles(host_idx), whole_tiles=whole_tiles(host_idx))


def prefill_step(model, batch, seq, n_adapters, hinted: bool = False):
    """(run, args) of one prefill of ``batch`` prompts of ``seq`` tokens (``n_adapters`` >
    0: adapters over the prompts, `token_slots`; 0: none); ``hinted``: the mapping carries
    the host's `prefill_hints`. ``run(*args)`` returns the last tokens' logits."""
    slots = token_slots(batch, n_adapters) if n_adapters else np.full(batch, -1, np.int32)
    host_idx = np.repeat(slots, seq)
    run, state = make_prefill(model, prefill_hints(host_idx) if hinted else None)
    ids = jnp.zeros((batch, seq), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    return run, (state, ids, pos, jnp.asarray(host_idx))


def bench_model(layers: int, small: bool):
    """(cfg, model, max_loras): the Llama-3-8B-shaped decoder with ``layers`` layers in
    bf16 (random weights, 64 slots), or with ``small`` a tiny f32 one (8 slots) for a CPU
    smoke test."""
    if small:
        cfg, dtype, max_loras = DecoderConfig.tiny(num_hidden_layers=2), jnp.float32, 8
    else:
        cfg = DecoderConfig.llama3_8b(num_hidden_layers=layers)
        dtype, max_loras = jnp.bfloat16, 64
    model = DecoderForCausalLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    return cfg, model, max_loras


def bench_prefill(model, cfg, batch, seq, n_adapters, args, hinted: bool = False):
    """``hinted``: the mapping carries the host's `prefill_hints`."""
    run, (state, ids, pos, idx) = prefill_step(model, batch, seq, n_adapters, hinted)
    hlo = run.lower(state, ids, pos, idx).compile().as_text()
    t, c = timeit(run, state, ids, pos, idx, reps=args.reps)
    return t, c, collective_bytes(hlo)


def force_op_backends(shrink: str = "", expand: str = "") -> None:
    """A probe of mixed backends: `lj.ops.lora_shrink` (``shrink``) and `lj.ops.lora_expand`
    (``expand``) take the named backend ("xla" / "pallas"), an empty one the library's
    choice. Replaces `lj.ops.resolve_backend` for this process (the ops look it up by
    name; it tells the two apart by its caller's name)."""
    chosen = {"lora_shrink": shrink, "lora_expand": expand}
    library = lj.ops.resolve_backend

    def resolve(backend=None, num_tokens=None, hinted=False):
        forced = chosen.get(sys._getframe(1).f_code.co_name)
        return forced or library(backend, num_tokens, hinted)

    lj.ops.resolve_backend = resolve


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", default="1,2", help="comma list of tensor-parallel sizes")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=64)
    p.add_argument("--context", type=int, default=512, help="KV positions already in cache")
    p.add_argument("--steps", type=int, default=8, help="decode steps inside one jit call")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prefill", default="4x512", help="BxS prefill case ('' to skip)")
    p.add_argument("--no-sharded", action="store_true", help="skip fully sharded LoRA")
    p.add_argument(
        "--variants",
        default="base,lora,lora_fully_sharded",
        help="comma list of the variants to time (base is needed for the ratios)",
    )
    p.add_argument(
        "--xla-batches",
        default="",
        help="also time plain LoRA with the XLA ops backend at these decode batches",
    )
    p.add_argument(
        "--pallas-batches",
        default="",
        help="also time plain LoRA with the Pallas ops backend forced at these decode batches "
        "(the GPU default is XLA below lora_jax.ops.PALLAS_MIN_TOKENS tokens)",
    )
    p.add_argument(
        "--onehot-batches",
        default="",
        help="also time plain LoRA with the XLA backend multiplying against every slot "
        "(lora_jax.ops.ONE_HOT_TOKENS_PER_SLOT = 0) at these decode batches",
    )
    p.add_argument(
        "--hinted-prefill",
        action="store_true",
        help="also time the prefill case with the host's hints in its mapping "
        "(LoRAMapping.prompt_tiles / whole_tiles, as generate passes them)",
    )
    p.add_argument(
        "--unshared-prefill",
        action="store_true",
        help="also time the prefill case without the LoRA layers' shared input "
        "(lora_jax.layers.base.SHARE_LAYER_INPUT off)",
    )
    p.add_argument(
        "--hinted-batches",
        default="",
        help="also time plain LoRA on the Pallas backend with the host's tokens per slot in "
        "its mapping (LoRAMapping.tokens_per_slot: per-token kernels where each request "
        "has its own adapter) at these decode batches",
    )
    p.add_argument(
        "--fused-batches",
        default="",
        help="also time plain LoRA with the fused 'pallas_fused' ops backend at these batches",
    )
    p.add_argument(
        "--serial-decode",
        action="store_true",
        help="compile the decode steps in XLA's default order (LORA_JAX_CONCURRENT_DECODE=0)",
    )
    for op in ("shrink", "expand"):
        p.add_argument(
            f"--{op}-backend",
            default="",
            choices=("", "xla", "pallas"),
            help=f"a probe: every {op} on this backend, whatever the variant (force_op_backends)",
        )
    p.add_argument("--small", action="store_true", help="tiny model for a CPU smoke test")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    force_op_backends(args.shrink_backend, args.expand_backend)
    if args.serial_decode:
        os.environ["LORA_JAX_CONCURRENT_DECODE"] = "0"

    if args.small:
        # 8 query heads so that the smoke test also runs at tp = 4 and 8 (CPU devices)
        cfg = DecoderConfig.tiny(num_hidden_layers=2, num_attention_heads=8)
        args.max_loras, args.context, args.steps, args.reps = 8, 16, 2, 1
        dtype = jnp.float32
    else:
        cfg = DecoderConfig.llama3_8b(num_hidden_layers=args.layers)
        dtype = jnp.bfloat16
    batches = [int(b) for b in args.batches.split(",") if b]
    rows = []
    print(f"devices: {jax.devices()}", flush=True)
    for tp in [int(t) for t in args.tp.split(",")]:
        if tp > jax.device_count():
            print(f"skip tp={tp}: only {jax.device_count()} devices", flush=True)
            continue
        mesh = jax.make_mesh((1, tp), ("dp", "tp"), devices=jax.devices()[:tp])
        rules = lj.ShardingRules(mesh)
        t0 = time.perf_counter()
        model = DecoderForCausalLM(
            cfg, rules=rules, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)
        )
        print(f"tp={tp}: model built in {time.perf_counter() - t0:.1f}s", flush=True)
        variants = [("base", None), ("lora", False)]
        if tp > 1 and not args.no_sharded:
            variants.append(("lora_fully_sharded", True))
        variants = [v for v in variants if v[0] in args.variants.split(",")]
        for variant, fully in variants:
            if fully is not None:
                lcfg = lj.LoRAConfig(
                    max_loras=args.max_loras, max_lora_rank=args.rank, fully_sharded_loras=fully
                )
                wrap_model(model, lcfg, target_modules=TARGETS)
                fill_random_adapters(model, args.rank)
                per_adapter = adapter_bytes_per_gpu(model)
            cases = []
            for b in batches:
                # As many adapters as requests (capped), plus the 8-adapter target case.
                ns = (
                    [0]
                    if fully is None
                    else sorted({min(b, args.max_loras)} | ({8} if b >= 64 else set()))
                )
                cases += [("decode", b, n) for n in ns]
            if args.prefill:
                pb, ps = (int(v) for v in args.prefill.split("x"))
                cases.append(("prefill", pb * ps, 0 if fully is None else pb))
            # Plain LoRA again with one ops backend forced, at the decode batches each
            # flag names.
            forced = [
                ("xla", args.xla_batches),
                ("pallas", args.pallas_batches),
                ("xla_onehot", args.onehot_batches),
                ("pallas_fused", args.fused_batches),
                ("hinted", args.hinted_batches),
            ]
            if args.prefill and args.hinted_prefill and fully is False:
                cases.append((*cases[-1][:3], "hinted"))
            if args.prefill and args.unshared_prefill and fully is False:
                cases.append((*cases[-1][:3], "unshared"))
            defaults = [c for c in cases if c[0] == "decode"]
            for backend, flag in forced if fully is False else []:
                wanted = {int(v) for v in flag.split(",") if v}
                cases += [(k, b, n, backend) for k, b, n in defaults if b in wanted]
            for case in cases:
                kind, b, n = case[:3]
                backend = case[3] if len(case) > 3 else None
                ratio = lj.ops.ONE_HOT_TOKENS_PER_SLOT
                if backend == "xla_onehot":
                    lj.ops.ONE_HOT_TOKENS_PER_SLOT = 0.0
                forced_backend = {"xla_onehot": "xla", "hinted": "pallas"}.get(backend, backend)
                if kind == "prefill":  # the hint only: prefill takes the kernels on a GPU
                    forced_backend = None
                lj.ops.set_default_backend(forced_backend)
                lora_base.SHARE_LAYER_INPUT = backend != "unshared"
                if kind == "decode":
                    t, c, coll = bench_decode(model, cfg, rules, b, n, args, backend == "hinted")
                else:
                    t, c, coll = bench_prefill(
                        model, cfg, b // ps, ps, n, args, backend == "hinted"
                    )
                lj.ops.set_default_backend(None)
                lora_base.SHARE_LAYER_INPUT = True
                lj.ops.ONE_HOT_TOKENS_PER_SLOT = ratio
                row = dict(
                    tp=tp,
                    variant=variant + (f"[{backend}]" if backend else ""),
                    kind=kind,
                    tokens=b,
                    adapters=n,
                    step_ms=t * 1e3,
                    compile_s=c,
                    collective_bytes=coll,
                )
                if fully is not None:
                    row["adapter_read_ms"] = n * per_adapter / HBM_BYTES_PER_S * 1e3
                rows.append(row)
                print(json.dumps(row), flush=True)
            if fully is not None:
                unwrap_model(model)
        del model
    report(rows)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), argv=sys.argv, rows=rows), f, indent=1)


def report(rows):
    base = {(r["tp"], r["kind"], r["tokens"]): r["step_ms"] for r in rows if r["variant"] == "base"}
    cols = ("tp", 3), ("variant", -19), ("kind", -7), ("T", 5), ("n", 3), ("ms", 8)
    cols += ("x base", 7), ("added/read", 10), ("coll MB", 8)
    hdr = " ".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in cols)
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        b = base.get((r["tp"], r["kind"], r["tokens"]))
        ratio = r["step_ms"] / b if b else float("nan")
        added = (
            (r["step_ms"] - b) / r["adapter_read_ms"]
            if b and r.get("adapter_read_ms")
            else float("nan")
        )
        # JSON has no NaN: a ratio without a base (or without adapters) is written as null
        r["ratio_vs_base"] = None if math.isnan(ratio) else ratio
        r["added_over_read"] = None if math.isnan(added) else added
        coll = sum(r["collective_bytes"].values()) / 1e6
        print(
            f"{r['tp']:>3} {r['variant']:<19} {r['kind']:<7} {r['tokens']:>5} {r['adapters']:>3} "
            f"{r['step_ms']:>8.3f} {ratio:>7.3f} {added:>10.2f} {coll:>8.2f}"
        )


if __name__ == "__main__":
    main()
