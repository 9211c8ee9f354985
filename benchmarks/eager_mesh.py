"""Benchmark: a LoRA decoder's forward on a mesh, called outside jit (a notebook's way).

Outside a trace every sharded layer runs its shard_map as one compiled program
(`lora_jax.sharding.shard_map`); each call's closure is new, so without the library's
cache of those programs every eager forward compiled every layer anew. This script times
`--calls` eager forwards of the tiny decoder (LoRA on every projection, a new token ->
slot mix each call) with the cache and with it emptied before each call (the old way),
beside one `nnx.jit` step, and checks every eager output against the jitted one.

    python benchmarks/eager_mesh.py --tp 2 --out eager_mesh.json     # any machine
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    flag = f"--xla_force_host_platform_device_count={args.tp}"
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import lora_jax as lj
    from lora_jax import sharding
    from lora_jax.models import DecoderConfig, DecoderForCausalLM
    from lora_jax.serving.wrap import wrap_model

    if jax.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} devices, {jax.device_count()} visible")
    mesh = jax.make_mesh((1, args.tp), ("dp", "tp"), devices=jax.devices()[: args.tp])
    config = dataclasses.replace(DecoderConfig.tiny(), num_hidden_layers=args.layers)
    model = DecoderForCausalLM(config, rules=lj.ShardingRules(mesh), rngs=nnx.Rngs(0))
    lora_config = lj.LoRAConfig(max_loras=4, max_lora_rank=8)
    wrap_model(model, lora_config)
    rng = np.random.default_rng(0)
    layers = [
        node
        for _, node in nnx.iter_graph(model)
        if isinstance(node, lj.BaseLayerWithLoRA) and hasattr(node, "logical_slice_sizes")
    ]
    for layer in layers:  # random adapters in every slot of every linear
        for slot in range(lora_config.max_loras):
            n_in = layer.base_layer.in_features
            a = [rng.normal(0, 0.1, (8, n_in)) for _ in range(layer.n_slices)]
            b = [rng.normal(0, 0.1, (n, 8)) for n in layer.logical_slice_sizes]
            layer.set_lora(slot, a, b)
    T = args.tokens
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (1, T)), jnp.int32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    mixes = [jnp.asarray(rng.integers(-1, 4, T), jnp.int32) for _ in range(args.calls)]

    def eager(idx):
        with lj.lora_mapping(model, idx):
            return model(ids, pos)[0]

    @nnx.jit
    def jitted(model, idx):
        with lj.lora_mapping(model, idx):
            return model(ids, pos)[0]

    def timed(fn, *a):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*a))
        return out, (time.perf_counter() - t0) * 1e3

    rows = []
    for cached in (False, True):
        sharding._EAGER_PROGRAMS.clear()
        for i, idx in enumerate(mixes):
            if not cached:
                sharding._EAGER_PROGRAMS.clear()
            y, ms = timed(eager, idx)
            ref, jit_ms = timed(jitted, model, idx)
            err = float(jnp.max(jnp.abs(y - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))
            if err > 1e-5:
                raise SystemExit(f"eager call {i} differs from the jitted step by {err:.2e}")
            programs = len(sharding._EAGER_PROGRAMS)
            row = dict(cache=cached, call=i, eager_ms=ms, jit_ms=jit_ms, programs=programs)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"tiny decoder, {args.layers} layers, tp = {args.tp}, {T} tokens, {jax.devices()[0]}")
    print(f"{'call':>4} {'eager ms, no cache':>19} {'eager ms, cache':>16} {'nnx.jit ms':>11}")
    for i in range(args.calls):
        off, on = rows[i], rows[args.calls + i]
        print(f"{i:>4} {off['eager_ms']:>19.1f} {on['eager_ms']:>16.1f} {on['jit_ms']:>11.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), argv=sys.argv, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
