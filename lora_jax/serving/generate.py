"""Jitted multi-adapter generation: prefill + KV-cache decode, every request its own adapter.

`generate(model, prompts, adapter_slots, max_new_tokens=...)` pads the batch and the
prompts to power-of-two buckets, runs one jitted prefill (all prompt tokens, right
padded) and one jitted decode loop (`lax.while_loop`, one token per request per step,
stopping early when every request hit `eos_token_id`). Each token's adapter slot is its
request's (from `adapter_starts[i]` on: an activated LoRA's invocation start,
`lora_jax.serving.alora`); the step sets it with `set_lora_mapping(model, token_slots[B*S],
seq_lora_indices=slots[B])` inside the jit, so a new adapter, a new mix of adapters or new
prompts in the same buckets never recompile: compiles happen once per
(batch bucket, prompt bucket, new-token bucket, sampling mode; the prefill once more for
batches with a start inside a prompt), and on a GPU the decode
loop once per tokens-per-slot hint (`decode_hint`: the `TOKENS_PER_SLOT` bucket of the
requests' slots, 1, 2, 64 or 0 below 257 requests).

The decode loop is compiled with `lora_jax.compile_options.decode_compiler_options()`: on a
GPU, XLA then runs kernels with no data dependence side by side (a layer's LoRA shrink
beside its base matmul), which cut a decode step's LoRA cost; the prefill keeps XLA's
default order. The model is split once per call (`nnx.split`) and the jitted functions are pure over
`(graphdef, state)`; the KV cache is donated from prefill to decode. `TRACE_COUNTS`
counts traces of each step, which is what the no-recompile tests assert on.

This module holds `generate` and `Generator`, which bind the steps to a model and read
`decode_compiler_options()` at each call; the rest lives beside it and is re-exported
here: `generate_inputs` (argument checks, `bucket`, `decode_hint`), `generate_steps` (the
jitted prefill and decode loop, `TRACE_COUNTS`) and `generate_batch` (one batch run
around them, `GenerationResult`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
from flax import nnx

from lora_jax.compile_options import decode_compiler_options
from lora_jax.layers.base import LoRAContext, _context_max_loras, find_lora_context
from lora_jax.layers.base import set_lora_mapping as set_lora_mapping  # importable as before
from lora_jax.serving import wrap
from lora_jax.serving.generate_batch import GenerationResult as GenerationResult
from lora_jax.serving.generate_batch import _generate as _generate
from lora_jax.serving.generate_inputs import EOS_BUCKET as EOS_BUCKET
from lora_jax.serving.generate_inputs import _check_inputs as _check_inputs
from lora_jax.serving.generate_inputs import _eos_ids as _eos_ids
from lora_jax.serving.generate_inputs import _sampling_params as _sampling_params
from lora_jax.serving.generate_inputs import _slot as _slot
from lora_jax.serving.generate_inputs import bucket as bucket
from lora_jax.serving.generate_inputs import decode_hint as decode_hint
from lora_jax.serving.generate_steps import TRACE_COUNTS as TRACE_COUNTS
from lora_jax.serving.generate_steps import _decode_fn as _decode_fn
from lora_jax.serving.generate_steps import _decode_jit as _decode_jit
from lora_jax.serving.generate_steps import _last_hidden as _last_hidden
from lora_jax.serving.generate_steps import _prefill as _prefill
from lora_jax.serving.generate_steps import _prefill_fn as _prefill_fn
from lora_jax.serving.generate_steps import _set_mapping as _set_mapping
from lora_jax.serving.merge import layer_merged_slot
from lora_jax.serving.sampling import SamplingParams


def _options_key() -> tuple[tuple[str, str], ...]:
    return tuple(sorted(decode_compiler_options().items()))


def _decode(*args, **kwargs):
    """The jitted decode loop, compiled with `decode_compiler_options` as they are now."""
    return _decode_jit(_options_key())(*args, **kwargs)


def _model_max_loras(model) -> int | None:
    """The LoRA slots of the model's layers; None where it has no LoRA layers."""
    return _context_max_loras(model) if find_lora_context(model) is not None else None


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    adapter_slots: Sequence[int] | None = None,
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    min_batch_bucket: int = 1,
    min_prompt_bucket: int = 16,
    cache_dtype=None,
    adapter_starts: Sequence[int] | None = None,
) -> GenerationResult:
    """Generates up to `max_new_tokens` per prompt, request i with adapter slot
    `adapter_slots[i]` (-1 = base model).

    Args:
      model: a `DecoderForCausalLM` (LoRA-wrapped or not).
      prompts: token ids per request.
      adapter_slots: device slot per request, -1 for none; `None` = all -1.
      max_new_tokens: tokens to generate per request (fewer when eos stops it).
      sampling: `SamplingParams`, or a dict of its fields (greedy by default).
      eos_token_id: stops a request once generated (it is included in the result); a
        list stops at any of them (HF configs such as Llama 3's give several).
      min_batch_bucket / min_prompt_bucket: lower bounds of the power-of-two buckets.
      cache_dtype: KV cache dtype; defaults to the model's compute dtype.
      adapter_starts: per request, the first prompt position whose token uses the
        request's adapter (the earlier ones run the base model): an activated LoRA's
        invocation start, which `LoRAModelManager.adapter_starts` finds; `None` = all 0.

    Example:
        >>> out = generate(model, [[1, 2], [3]], [0, -1], max_new_tokens=8)  # doctest: +SKIP
        >>> len(out.tokens[1])  # doctest: +SKIP
        8
    """
    graphdef, state = _split_without_mapping(model)
    return _generate(
        model,
        _model_max_loras(model),
        _merged_slot(wrap.lora_layers(model).values()),
        functools.partial(_prefill, graphdef, state),
        functools.partial(_decode, graphdef, state),
        prompts,
        adapter_slots,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        eos_token_id=eos_token_id,
        min_batch_bucket=min_batch_bucket,
        min_prompt_bucket=min_prompt_bucket,
        cache_dtype=cache_dtype,
        adapter_starts=adapter_starts,
    )


def _split_without_mapping(model: nnx.Module):
    """`nnx.split(model)` with the LoRA context's value left out (None): the steps set
    their own mapping, and one left there by the caller (`set_lora_mapping` outside a
    jit) would join the compiled signature, its arrays and static fields recompiling.
    The model's own context keeps its value."""
    graphdef, state = nnx.split(model)
    ctx = find_lora_context(model)
    if ctx is None or ctx.get_value() is None:
        return graphdef, state
    flat = [
        (p, v.replace(value=None) if isinstance(v, LoRAContext) else v)
        for p, v in nnx.to_flat_state(state)
    ]
    return graphdef, nnx.from_flat_state(flat)


def _merged_slot(layers) -> int | None:
    """The slot `merge_adapter` folded into these LoRA layers' kernels, or None."""
    for layer in layers:
        slot = layer_merged_slot(layer)
        if slot is not None:
            return slot
    return None


def _raw_value(var: nnx.Variable):
    get = getattr(var, "get_raw_value", None)  # flax >= 0.12: no hooks, ~0.2 us
    return get() if get is not None else var.get_value()


class Generator:
    """`generate` for one model, with its graph split once.

    `generate` splits the model (`nnx.split`) on every call and hands the jitted steps its
    graph as a static argument, which jax hashes and compares on every call. That host
    time grows with the model's variables (`benchmarks/host_overhead.py`: a 32-layer tiny
    LoRA model, 259 ms a call on a 2-core CPU host; 26 ms with a `Generator`).

    A `Generator` walks the graph once and keeps the model's own variables. Each call
    reads their current values and passes them as one flat list, so adapter loads and
    weight updates (``set_value``, as `LoRAManager` and the layers write) are seen. Its
    steps compile once per bucket (on a GPU the decode loop once per tokens-per-slot hint,
    `decode_hint`), as `generate`'s do (`TRACE_COUNTS`).

    A change of the model's *structure* (a new submodule or variable) needs `refresh`;
    `wrap_model` / `unwrap_model` are noticed and refreshed for automatically.

    Example:
        >>> gen = Generator(model)  # doctest: +SKIP
        >>> gen([[1, 2], [3]], [0, -1], max_new_tokens=8).tokens  # doctest: +SKIP
    """

    def __init__(self, model: nnx.Module):
        self.model = model
        self.refresh()

    def refresh(self) -> None:
        """Walks the model's graph again (after a change of its structure). The compiled
        steps are kept when the graph and its variables' kinds are what they were (e.g.
        another model was wrapped, or this one unwrapped and wrapped alike)."""
        graphdef, state = _split_without_mapping(self.model)
        flat = list(nnx.to_flat_state(state))
        own = {p: v for p, v in nnx.iter_graph(self.model) if isinstance(v, nnx.Variable)}
        self._vars = [own[p] for p, _ in flat]
        # The steps set their own mapping: a LoRA context is always handed in as None.
        self._is_context = [isinstance(v, LoRAContext) for v in self._vars]
        self._graph_edits = wrap.graph_edits()
        self._max_loras = _model_max_loras(self.model)
        self._lora_layers = list(wrap.lora_layers(self.model).values())
        structure = (graphdef, tuple((p, type(v)) for p, v in flat))
        if structure == getattr(self, "_structure", None):
            return
        self._structure = structure
        # Each variable's kind and metadata, without its array (no stale weights kept alive).
        shells = [(p, v.replace(value=None)) for p, v in flat]

        def state_of(values):
            return nnx.from_flat_state(
                [(p, shell.replace(value=v)) for (p, shell), v in zip(shells, values)]
            )

        def prefill(values, cache, *args, mode, ops_state, activated):
            return _prefill_fn(
                graphdef, state_of(values), cache, *args, mode=mode, activated=activated
            )

        def decode(values, cache, *args, mode, new_bucket, tokens_per_slot, ops_state):
            return _decode_fn(
                graphdef, state_of(values), cache, *args, mode=mode, new_bucket=new_bucket,
                tokens_per_slot=tokens_per_slot,
            )  # fmt: skip

        self._prefill = jax.jit(
            prefill,
            static_argnames=("mode", "ops_state", "activated"),
            donate_argnames=("cache",),
        )
        # one decode jit per `decode_compiler_options()` value, made when first needed
        self._decode_step, self._decodes = decode, {}

    def _decode_for(self, options: tuple[tuple[str, str], ...]):
        if options not in self._decodes:
            self._decodes[options] = jax.jit(
                self._decode_step,
                static_argnames=("mode", "new_bucket", "tokens_per_slot", "ops_state"),
                donate_argnames=("cache",),
                compiler_options=dict(options) or None,
            )
        return self._decodes[options]

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        adapter_slots: Sequence[int] | None = None,
        *,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        min_batch_bucket: int = 1,
        min_prompt_bucket: int = 16,
        cache_dtype=None,
        adapter_starts: Sequence[int] | None = None,
    ) -> GenerationResult:
        """As `generate(model, ...)`, for this generator's model."""
        if wrap.graph_edits() != self._graph_edits:
            self.refresh()
        values = [None if c else _raw_value(v) for v, c in zip(self._vars, self._is_context)]
        return _generate(
            self.model,
            self._max_loras,
            _merged_slot(self._lora_layers),
            functools.partial(self._prefill, values),
            functools.partial(self._decode_for(_options_key()), values),
            prompts,
            adapter_slots,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            eos_token_id=eos_token_id,
            min_batch_bucket=min_batch_bucket,
            min_prompt_bucket=min_prompt_bucket,
            cache_dtype=cache_dtype,
            adapter_starts=adapter_starts,
        )
