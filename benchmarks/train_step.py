"""What training a LoRA slot costs: forward, and forward + backward, on each ops backend.

A Llama-3-8B-shaped decoder (`--layers` layers, random bf16 weights, nothing downloaded)
with LoRA on all 7 projections, `--max-loras` slots, one of them trained: every token of
the batch maps to slot 0 (a training batch), `--batch` x `--seq` tokens. The loss is the
mean square of the last hidden state (no lm_head: the layers' LoRA is what is measured).
Variants, each one jitted program:

* base/fwd       the unwrapped model's forward (no LoRA at all)
* base/grad      the unwrapped model's gradient w.r.t. the first layer's input RMSNorm
                 weight: the backward through every layer's activations and no weight
                 gradient of a projection, the floor a LoRA grad cannot go under
* {be}/fwd       the wrapped model's forward, ops on backend ``be``
* {be}/grad      `jax.value_and_grad` of the loss w.r.t. the `nnx.LoRAParam` stacks
* {be}/step      the grad plus an Adam update of slot 0 (`train_only_slots`: Adam over
                 every slot's stacks, then all but slot 0's update zeroed)
* {be}/step1     the same with `train_slots`: Adam over slot 0's rows only

with ``be`` xla (XLA forward, its autodiff backward), and where the kernels run (a GPU)
pallas (the kernels forward and backward: `lora_jax.ops_grad`) and pallas_xvjp (the
kernels forward, XLA's VJP backward: `ops.KERNEL_BACKWARD` off, as before session 52);
``*_1slot``: the same with the mapping's ``single_slot=True`` hint (every token in one
slot, so the backward is dense matmuls against that slot's weights); ``*_1slot_bd``: and
a merged layer's slices as one block-diagonal pair of them (`ops_grad.BLOCK_DIAGONAL_SLICES`).
``--backends`` picks some of them (xla always runs: the others' grads are checked against
it). A call
takes milliseconds, so the ~50-80 us host dispatch of one jitted call is ~1 % of it: the
figure is the median wall time of ``--reps`` calls after one warm-up (compile) call. The
pallas grads are checked against the xla grad (max relative error of the slot's stacks).

With ``--profile DIR`` each grad program (base and LoRA) also runs ``--reps`` calls
under `jax.profiler`; the JSON gets its GPU busy time per call and its longest kernels
(`profile_decode.device_events`), to see where a LoRA backward's time goes.

    python benchmarks/train_step.py --out train.json          # on the GPU machine
    python benchmarks/train_step.py --profile /tmp/prof --out train.json
    python benchmarks/train_step.py --small                   # CPU smoke test
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
import optax
from flax import nnx

import lora_jax as lj
from lora_jax import ops_grad
from lora_jax.models import DecoderConfig, DecoderForCausalLM
from lora_jax.serving.training import init_lora_slot, train_only_slots, train_slots
from lora_jax.serving.wrap import unwrap_model, wrap_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # profile_decode, with -P

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def timeit(fn, *args, reps: int) -> tuple[float, float]:
    """(median seconds of ``reps`` calls, seconds of the first call: compile + run)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), first


def loss_of(model, ids, pos):
    """The square of the last hidden state along a fixed direction (after the final
    RMSNorm, a plain mean square would be constant, its gradient zero)."""
    hidden, _ = model.model(ids, pos, None, flat=False)
    u = jnp.cos(jnp.arange(hidden.shape[-1], dtype=jnp.float32))
    return jnp.mean(jnp.square(hidden.astype(jnp.float32) @ u)) / hidden.shape[-1]


def programs(model, ids, pos):
    """The jitted fwd / grad / step programs of ``model`` (wrapped, its token mapping set
    beforehand: the mapping's arrays are part of the state the programs take) and their
    arguments."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, ids, pos):
        return loss_of(nnx.merge(graphdef, state), ids, pos)

    graphdef2, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss2(lora, rest, ids, pos):
        return loss_of(nnx.merge(graphdef2, lora, rest), ids, pos)

    grad = jax.jit(jax.value_and_grad(loss2))

    def stepper(tx):
        @jax.jit
        def step(lora, opt_state, rest, ids, pos):
            loss, g = jax.value_and_grad(loss2)(lora, rest, ids, pos)
            updates, opt_state = tx.update(g, opt_state, lora)
            return optax.apply_updates(lora, updates), opt_state, loss

        return step, (lora, tx.init(lora), rest, ids, pos)

    return {
        "fwd": (fwd, (state, ids, pos)),
        "grad": (grad, (lora, rest, ids, pos)),
        "step": stepper(optax.chain(optax.adam(1e-3), train_only_slots([0]))),
        "step1": stepper(train_slots(optax.adam(1e-3), [0])),
    }


def _first_norm(path, value) -> bool:
    return tuple(path[:4]) == ("model", "layers", 0, "input_layernorm")


def base_grad_program(model, ids, pos):
    """The jitted gradient of the loss w.r.t. the first layer's input RMSNorm weight (the
    unwrapped model) and its arguments: activation gradients through every layer, none
    of a projection's weights."""
    graphdef, norm, rest = nnx.split(model, _first_norm, ...)

    def loss(norm, rest, ids, pos):
        return loss_of(nnx.merge(graphdef, norm, rest), ids, pos)

    return jax.jit(jax.value_and_grad(loss)), (norm, rest, ids, pos)


def kernel_profile(fn, args, reps: int, log_dir: str, top: int = 12) -> dict:
    """GPU busy ms per call of ``fn(*args)`` over ``reps`` traced calls, and the ``top``
    kernels by time per call (us); empty where the trace has no GPU (the CPU)."""
    import profile_decode

    jax.block_until_ready(fn(*args))
    os.makedirs(log_dir, exist_ok=True)
    with jax.profiler.trace(log_dir):
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
    events = profile_decode.device_events(log_dir)
    if not events:
        return {}
    summary = profile_decode.summarize(events, reps, 1)
    kernels = sorted(summary["kernels"].items(), key=lambda kv: -kv[1])
    return dict(
        busy_ms=summary["busy_us"] / 1e3,
        launches=summary["launches"],
        top_us=[(name[:120], round(us, 1)) for name, us in kernels[:top]],
    )


def max_rel_err(a, b) -> float:
    """Max over the LoRA stacks of |a - b|.max() / |b|.max() (slot 0, where the grads live)."""
    errs = []
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x = np.asarray(x[0], np.float32)
        y = np.asarray(y[0], np.float32)
        scale = float(np.abs(y).max())
        if scale > 0:
            errs.append(float(np.abs(x - y).max()) / scale)
    return max(errs) if errs else 0.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--ranks", default="16,64")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--small", action="store_true", help="tiny f32 model for a CPU smoke test")
    p.add_argument("--profile", default=None, help="trace the grad programs into this dir")
    p.add_argument("--programs", default="fwd,grad,step,step1", help="the LoRA programs to time")
    p.add_argument(
        "--backends",
        default="",
        help="comma-separated variants to time (default: all; xla always runs, the reference)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    if args.small:
        cfg, dtype = DecoderConfig.tiny(num_hidden_layers=2), jnp.float32
        args.batch, args.seq, args.reps, args.max_loras = 2, 32, 1, 4
    else:
        cfg, dtype = DecoderConfig.llama3_8b(num_hidden_layers=args.layers), jnp.bfloat16
    # (name, ops backend, ops.KERNEL_BACKWARD, the mapping's single_slot hint,
    #  ops_grad.BLOCK_DIAGONAL_SLICES)
    backends = [
        ("xla", "xla", True, None, False),
        ("xla_1slot", "xla", True, True, False),
        ("xla_1slot_bd", "xla", True, True, True),
    ]
    if jax.default_backend() == "gpu":
        backends += [
            ("pallas", "pallas", True, None, False),
            ("pallas_1slot", "pallas", True, True, False),
            ("pallas_1slot_bd", "pallas", True, True, True),
            ("pallas_xvjp", "pallas", False, None, False),
        ]
    if args.backends:
        wanted = ["xla", *args.backends.split(",")]  # xla: the grads' reference
        backends = [b for b in backends if b[0] in wanted]
    print(f"devices: {jax.devices()}; tokens {args.batch} x {args.seq}", flush=True)
    ids = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(args.seq, dtype=jnp.int32), ids.shape)
    idx = jnp.zeros((args.batch * args.seq,), jnp.int32)  # every token trains slot 0
    rows = []
    block_diagonal_default = ops_grad.BLOCK_DIAGONAL_SLICES  # each variant sets its own

    model = DecoderForCausalLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    base_fwd = jax.jit(lambda m, ids, pos: loss_of(m, ids, pos))
    t, first = timeit(base_fwd, model, ids, pos, reps=args.reps)
    rows.append(dict(rank=0, backend="base", what="fwd", ms=t * 1e3, first_s=first))
    print(f"base/fwd: {t * 1e3:.3f} ms", flush=True)
    fn, fargs = base_grad_program(model, ids, pos)
    t, first = timeit(fn, *fargs, reps=args.reps)
    rows.append(dict(rank=0, backend="base", what="grad", ms=t * 1e3, first_s=first))
    print(f"base/grad: {t * 1e3:.3f} ms", flush=True)
    if args.profile:
        prof = kernel_profile(fn, fargs, args.reps, os.path.join(args.profile, "base"))
        rows.append(dict(rank=0, backend="base", what="grad_profile", **prof))
        report_profile(rows[-1])

    for rank in [int(r) for r in args.ranks.split(",") if r]:
        unwrap_model(model)
        wrap_model(
            model,
            lj.LoRAConfig(max_loras=args.max_loras, max_lora_rank=rank),
            target_modules=TARGETS,
        )
        init_lora_slot(model, 0, rank, seed=rank)
        # B zero would make the A grads zero: give slot 0 a trained-looking B.
        lora = nnx.state(model, nnx.LoRAParam)
        leaves, treedef = jax.tree.flatten(lora)
        keys = jax.random.split(jax.random.key(rank), len(leaves))
        leaves = [
            v.at[0].set((0.02 * jax.random.normal(k, v.shape[1:])).astype(v.dtype))
            if not bool(jnp.any(v[0] != 0))
            else v
            for k, v in zip(keys, leaves)
        ]
        lora = jax.tree.unflatten(treedef, leaves)
        nnx.update(model, lora)
        grads, profiles = {}, []
        for be, ops_backend, kernel_backward, single_slot, block_diagonal in backends:
            lj.set_lora_mapping(model, idx, single_slot=single_slot)
            lj.ops.set_default_backend(ops_backend)
            lj.ops.KERNEL_BACKWARD = kernel_backward  # read when the programs are traced
            ops_grad.BLOCK_DIAGONAL_SLICES = block_diagonal
            try:
                progs = programs(model, ids, pos)
                for what, (fn, fargs) in progs.items():
                    if what not in args.programs.split(","):
                        continue
                    t, first = timeit(fn, *fargs, reps=args.reps)
                    row = dict(rank=rank, backend=be, what=what, ms=t * 1e3, first_s=first)
                    if what == "grad":
                        grads[be] = fn(*fargs)[1]
                        if args.profile:
                            log_dir = os.path.join(args.profile, f"r{rank}_{be}")
                            prof = kernel_profile(fn, fargs, args.reps, log_dir)
                            profiles.append(
                                dict(rank=rank, backend=be, what="grad_profile", **prof)
                            )
                            report_profile(profiles[-1])
                    rows.append(row)
                    print(
                        f"r{rank} {be}/{what}: {t * 1e3:.3f} ms (first {first:.1f} s)", flush=True
                    )
            finally:
                lj.ops.set_default_backend(None)
                lj.ops.KERNEL_BACKWARD = True
                ops_grad.BLOCK_DIAGONAL_SLICES = block_diagonal_default
        rows += profiles
        for be in grads:
            if be != "xla":
                err = max_rel_err(grads[be], grads["xla"])
                rows.append(dict(rank=rank, backend=be, what="grad_err_vs_xla", err=err))
                print(f"r{rank} {be} grad vs xla grad: max rel err {err:.2e}", flush=True)

    report(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), device=str(jax.devices()[0]), rows=rows), f, indent=1)


def report(rows):
    base = next(r["ms"] for r in rows if r["backend"] == "base" and r["what"] == "fwd")
    print(f"\n{'rank':>4} {'backend':>12} {'what':>5} {'ms':>9} {'x base fwd':>10}")
    for r in rows:
        if "ms" in r:
            print(
                f"{r['rank']:>4} {r['backend']:>12} {r['what']:>5} {r['ms']:>9.3f} "
                f"{r['ms'] / base:>10.2f}"
            )


def report_profile(r) -> None:
    """A grad program's GPU busy time and longest kernels, as soon as they are traced."""
    if r.get("top_us"):
        print(f"r{r['rank']} {r['backend']} grad: GPU busy {r['busy_ms']:.3f} ms per call")
        for name, us in r["top_us"]:
            print(f"  {us:>9.1f} us  {name}", flush=True)


if __name__ == "__main__":
    main()
