"""`lora-jax-serve`: one mixed batch, each request with its own LoRA adapter.

With no arguments it builds an embedded default: a tiny random Llama checkpoint and three
PEFT adapters (different ranks, alphas and targets; one rsLoRA, one with a rank
pattern) written to a temporary directory, then loaded through the same paths a real
run uses (`load_hf_model`, `wrap_model`, the PEFT loader, the LRU adapter manager).
Nothing is downloaded; text goes through a built-in byte-level tokenizer.

    python examples/serve.py
    lora-jax-serve --model DIR --adapter sql=DIR --adapter chat=DIR \\
        --prompt "SELECT" --max-new-tokens 16 --temperature 0.7 --top-p 0.9 --tp 2

The batch holds one request per adapter plus one without an adapter, and one more
without an adapter for every prompt left over; prompts are given out round-robin, so
every prompt is served. For each request the adapter name, the generated token ids and
their decoded text are printed.

Models: the decoders of `lora_jax.models` (Llama, Mistral, Qwen2, Qwen3) and of
`lora_jax.models.moe_decoder` (Mixtral, Qwen3-MoE), by `config.json`'s `model_type`.
Text goes through the model's own tokenizer (`tokenizer.json` / `tokenizer.model`, read
with transformers), or UTF-8 bytes where the directory has none.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
from collections.abc import Sequence

import numpy as np

from lora_jax.config import SUPPORTED_MAX_LORA_RANKS
from lora_jax.serve_default import (  # noqa: F401  (the CLI's names, as before)
    ALL_MODULES,
    DEFAULT_ADAPTERS,
    DEFAULT_MODEL,
    write_default,
    write_default_adapter,
    write_default_model,
)
from lora_jax.serve_memory import _cache_bytes as _cache_bytes
from lora_jax.serve_memory import _cache_error as _cache_error
from lora_jax.serve_memory import _memory_bytes as _memory_bytes  # tests patch it here
from lora_jax.serve_rank import _fused_w13_rank as _fused_w13_rank
from lora_jax.serve_rank import _max_rank as _max_rank
from lora_jax.serve_rank import _max_trainable_tokens as _max_trainable_tokens
from lora_jax.serve_rank import _uses_dora as _uses_dora
from lora_jax.serve_text import (  # noqa: F401
    TOKENIZER_FILES,
    ByteTokenizer,
    byte_tokenizer,
    eos_ids,
    hf_tokenizer,
)

DEFAULT_PROMPTS = ("SELECT name FROM", "Hello, how are", "Roses are red,", "The capital of")


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """One request's outcome."""

    adapter: str | None  # adapter name, None = base model
    prompt: str
    tokens: tuple[int, ...]  # generated token ids
    text: str  # decoded generated text


# -- the job ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of `lora-jax-serve` (exits with a usage message on bad input).

    Example:
        >>> parse_args(["--max-new-tokens", "4", "--tp", "2"]).tp
        2
    """
    p = argparse.ArgumentParser(
        prog="lora-jax-serve",
        description="Generate for a mixed batch in which every request uses its own LoRA adapter.",
    )
    p.add_argument(
        "--model",
        help="HF model directory (config.json + safetensors); "
        "default: an embedded tiny random model",
    )
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a PEFT LoRA adapter directory; repeat for more",
    )
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a prompt; repeat for more (given out round-robin to one request per adapter "
        "and one without; prompts left over get requests without an adapter)",
    )
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (any int)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel mesh over N devices")
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help=f"one of {', '.join(map(str, SUPPORTED_MAX_LORA_RANKS))}; default: the smallest "
        "that fits every adapter",
    )
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    if not 0 <= args.temperature < math.inf:  # nan fails both comparisons
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.tp < 1:
        p.error("--tp must be >= 1")
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        p.error(f"--max-lora-rank {args.max_lora_rank}: must be >= 1 (leave it out for auto)")
    names = []
    for spec in args.adapter:
        if "=" not in spec or not spec.split("=", 1)[0]:
            p.error(f"--adapter {spec!r}: expected NAME=DIR")
        names.append(spec.split("=", 1)[0])
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        p.error(f"--adapter: the names {twice} are given more than once")
    if args.adapter and not args.model:
        p.error("--adapter needs --model (the default model comes with its own adapters)")
    return args


def _cpu_devices_for(tp: int) -> None:
    """Lets `--tp N` run on a CPU-only machine: N host devices, if the backend has not
    started yet (XLA reads the flag when the first device is created; GPUs ignore it)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if tp > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={tp}".strip()


def _rules(tp: int):
    import jax

    from lora_jax.sharding import ShardingRules

    if tp == 1:
        return ShardingRules()
    if tp > len(jax.devices()):
        raise ValueError(f"--tp {tp}: only {len(jax.devices())} devices are visible")
    mesh = jax.make_mesh((1, tp), ("dp", "tp"), devices=jax.devices()[:tp])
    return ShardingRules(mesh)


def run(argv: Sequence[str] | None = None) -> list[RequestResult]:
    """Parses `argv`, serves one mixed batch and returns the per-request results.

    Example:
        >>> results = run([])  # the embedded default  # doctest: +SKIP
        >>> [r.adapter for r in results]  # doctest: +SKIP
        ['sql', 'chat', 'poet', None]
    """
    args = parse_args(argv)
    _cpu_devices_for(args.tp)
    with tempfile.TemporaryDirectory(prefix="lora_jax_serve_") as tmp:
        if args.model is None:  # the same model whatever --seed (that seeds sampling)
            model_dir, adapter_dirs = write_default(tmp)
        else:
            model_dir = args.model
            adapter_dirs = dict(spec.split("=", 1) for spec in args.adapter)
        return _serve(args, model_dir, adapter_dirs)


def _serve(args, model_dir: str, adapter_dirs: dict[str, str]) -> list[RequestResult]:
    import jax

    from lora_jax.config import LoRAConfig
    from lora_jax.models import load_hf_model
    from lora_jax.models.config import SUPPORTED_MODEL_TYPES
    from lora_jax.models.loading import read_config_json
    from lora_jax.models.moe_decoder import MOE_MODEL_TYPES, load_hf_moe_model
    from lora_jax.serving.generate import generate
    from lora_jax.serving.manager import LRUCacheLoRAModelManager
    from lora_jax.serving.wrap import wrap_model

    rules = _rules(args.tp)
    model_dir, config = read_config_json(model_dir)  # a file in the checkpoint: its directory
    served = (*SUPPORTED_MODEL_TYPES, *MOE_MODEL_TYPES)
    if config.get("model_type") not in served:  # the dense loader would name only its own
        raise ValueError(
            f"{os.path.join(model_dir, 'config.json')}: model_type="
            f"{config.get('model_type')!r} is not supported; allowed: {served}"
        )
    moe = config.get("model_type") in MOE_MODEL_TYPES
    own_dir = None if args.model is None else model_dir
    # before the weights, which can take minutes: a bad tokenizer or adapter fails at once
    tokenizer = hf_tokenizer(own_dir)
    eos = eos_ids(own_dir)
    rank = args.max_lora_rank
    if rank is None:  # the default wrap fuses an MoE's gate and up (FusedMoE3DWithLoRA)
        rank = _max_rank(adapter_dirs, config.get("model_type"), fused_experts=moe)
    model = (load_hf_moe_model if moe else load_hf_model)(model_dir, rules=rules)
    if tokenizer is None:
        tokenizer = byte_tokenizer(own_dir, model.config.vocab_size)
    n = max(1, len(adapter_dirs))
    tokens = _max_trainable_tokens(adapter_dirs)  # PEFT trainable_token_indices
    cfg = LoRAConfig(
        max_loras=n,
        max_cpu_loras=n,
        max_lora_rank=rank,
        max_lora_trainable_tokens=tokens,
        enable_dora=_uses_dora(adapter_dirs),
    )
    wrap_model(model, cfg)
    manager = LRUCacheLoRAModelManager(model, cfg)
    adapters = manager.load_adapters(adapter_dirs, activate=True) if adapter_dirs else []
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    requests = [a.name for a in adapters] + [None]
    requests += [None] * max(0, len(prompts) - len(requests))  # every prompt is served
    by_name = {a.name: a.id for a in adapters}
    texts = [prompts[i % len(prompts)] for i in range(len(requests))]
    token_prompts = [tokenizer.encode(t) for t in texts]
    # an activated LoRA (aLoRA) acts from its invocation in the prompt on
    slots, starts = manager.adapter_starts([by_name.get(r) for r in requests], token_prompts)
    have, whose = _memory_bytes(model)  # checked before generate allocates the cache
    longest = max(len(p) for p in token_prompts)
    need = _cache_bytes(model, len(token_prompts), longest + args.max_new_tokens)
    if have is not None and need > have:
        raise _cache_error(model, args, token_prompts, f"{whose} memory ({have / 2**30:.3g} GiB)")
    try:
        out = generate(
            model,
            token_prompts,
            slots,
            max_new_tokens=args.max_new_tokens,
            sampling=_sampling(args),
            eos_token_id=eos,
            adapter_starts=starts,
        )
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        what = f"the device could allocate ({str(e).splitlines()[0]})"
        raise _cache_error(model, args, token_prompts, what) from e
    results = []
    for name, text, toks in zip(requests, texts, _token_lists(out)):
        toks = tuple(int(t) for t in toks)
        results.append(RequestResult(name, text, toks, tokenizer.decode(toks)))
    return results


def _sampling(args):
    from lora_jax.serving.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def _token_lists(out) -> list[list[int]]:
    return [list(np.asarray(t).reshape(-1)) for t in out.tokens]


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: prints one block per request."""
    try:
        results = run(argv)
    except ValueError as e:  # bad input: the loaders' messages name the file and tensor
        if os.environ.get("LORA_JAX_TRACEBACK"):
            raise
        print(f"lora-jax-serve: error: {e} (LORA_JAX_TRACEBACK=1 shows where)", file=sys.stderr)
        return 2
    for i, r in enumerate(results):
        print(f"[{i}] adapter={r.adapter or '<base>'}")
        print(f"    prompt: {r.prompt!r}")
        print(f"    tokens: {list(r.tokens)}")
        print(f"    text:   {r.text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
