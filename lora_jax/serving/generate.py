"""Jitted multi-adapter generation: prefill + KV-cache decode, every request its own adapter.

`generate(model, prompts, adapter_slots, max_new_tokens=...)` pads the batch and the
prompts to power-of-two buckets, runs one jitted prefill (all prompt tokens, right
padded) and one jitted decode loop (`lax.while_loop`, one token per request per step,
stopping early when every request hit `eos_token_id`). Each token's adapter slot is its
request's; the step sets it with `set_lora_mapping(model, token_slots[B*S],
seq_lora_indices=slots[B])` inside the jit, so a new adapter, a new mix of adapters or new
prompts in the same buckets never recompile: compiles happen once per
(batch bucket, prompt bucket, new-token bucket, sampling mode), and on a GPU the decode
loop once per tokens-per-slot hint (`decode_hint`: the `TOKENS_PER_SLOT` bucket of the
requests' slots, 1, 2, 64 or 0 below 257 requests).

The decode loop is compiled with `lora_jax.compile_options.decode_compiler_options()`: on a
GPU, XLA then runs kernels with no data dependence side by side (a layer's LoRA shrink
beside its base matmul), which cut a decode step's LoRA cost; the prefill keeps XLA's
default order. The model is split once per call (`nnx.split`) and the jitted functions are pure over
`(graphdef, state)`; the KV cache is donated from prefill to decode. `TRACE_COUNTS`
counts traces of each step, which is what the no-recompile tests assert on.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax import ops
from lora_jax.compile_options import decode_compiler_options
from lora_jax.layers.base import (
    LoRAContext,
    _context_max_loras,
    find_lora_context,
    set_lora_mapping,
)
from lora_jax.mapping import PROMPT_ROWS_MIN_TOKENS, PROMPT_TILE_TOKENS, host_tokens_per_slot
from lora_jax.models.kv_cache import KVCache, cache_batch_axis, float_cache_dtype
from lora_jax.serving import wrap
from lora_jax.serving.merge import layer_merged_slot
from lora_jax.serving.sampling import SamplingParams, row_keys, sample_tokens, seed_key
from lora_jax.sharding import ShardingRules, shard_map, unshard

# Traces of the jitted steps ("prefill", "decode"); a trace is a (re)compile.
TRACE_COUNTS: collections.Counter[str] = collections.Counter()
# The decode step's eos ids are padded to a power of two of at least this many.
EOS_BUCKET = 4


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """Per-request generated token ids (the eos token included when it stopped one).

    Example:
        >>> out = generate(model, [[1, 2, 3]], [-1], max_new_tokens=4)  # doctest: +SKIP
        >>> out.tokens[0], out.finish_reasons[0]  # doctest: +SKIP
        ([17, 5, 5, 9], 'length')
    """

    tokens: list[list[int]]
    finish_reasons: list[str]  # "eos" or "length"
    batch_bucket: int  # padded batch size B
    prompt_bucket: int  # padded prompt length S
    new_tokens_bucket: int  # padded decode length N (cache length is S + N)


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum).

    Example:
        >>> bucket(5), bucket(5, minimum=16), bucket(16)
        (8, 16, 16)
    """
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def _last_hidden(rules: ShardingRules, hidden: jax.Array, lengths: jax.Array, S: int):
    """`hidden [B*S, D]` → `[B, D]` at each row's last prompt token (`lengths - 1`)."""

    def pick(h, n):
        h = h.reshape(n.shape[0], S, h.shape[-1])
        return jnp.take_along_axis(h, (n - 1)[:, None, None], axis=1)[:, 0]

    if rules.mesh is None:
        return pick(hidden, lengths)
    b = cache_batch_axis(rules, lengths.shape[0])
    return shard_map(rules, pick, ((b, None), (b,)), (b, None))(hidden, lengths)


def _set_mapping(
    model,
    token_slots,
    seq_slots,
    *,
    is_prefill: bool,
    prompt_tiles=None,
    whole_tiles=None,
    tokens_per_slot=None,
):
    # The mapping's sort over tokens needs them unsharded (Explicit meshes refuse a sort
    # over a sharded dim); LoRA layers re-split tokens over "batch" themselves.
    rules = model.rules
    set_lora_mapping(
        model,
        rules.constrain(token_slots, None),
        rules.constrain(seq_slots, None),
        is_prefill=is_prefill,
        prompt_tiles=prompt_tiles,
        whole_tiles=whole_tiles,
        tokens_per_slot=tokens_per_slot,
    )


def decode_hint(max_loras: int | None, slots: np.ndarray) -> int | None:
    """The decode steps' tokens-per-slot hint (`LoRAMapping.tokens_per_slot`), found from
    the requests' slots on the host: on a GPU, where it picks the kernels (the Pallas ops
    from `lora_jax.ops.PALLAS_MIN_TOKENS_HINTED` tokens, a program per token where each
    request has an adapter of its own, below rank `lora_jax.ops.PER_TOKEN_XLA_MIN_RANK`),
    so a batch bucket compiles one decode program per hint value (at most the five
    buckets of `lora_jax.mapping.TOKENS_PER_SLOT`, fewer for small batches); None
    elsewhere or without LoRA layers (one program).

    Example:
        >>> decode_hint(None, np.array([0, 1, -1]))  # no LoRA layers
    """
    if max_loras is None or jax.default_backend() != "gpu":
        return None
    return host_tokens_per_slot(np.asarray(slots), max_loras)


def _prefill_fn(
    graphdef,
    state,
    cache,
    ids,
    lengths,
    slots,
    row_ids,
    seed_key,
    temperature,
    top_p,
    *,
    mode,
    ops_state=None,  # `ops.dispatch_state()`: a static key only
):
    TRACE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, state)
    B, S = ids.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    # Row-major: row b's tokens use slot[b]. S is a power of two: from 32 tokens the rows
    # fill the prompt tiles (`PROMPT_ROWS_MIN_TOKENS`), from 128 they are whole tiles of
    # one slot each (`PROMPT_TILE_TOKENS`: the expand's Mosaic kernel takes them all).
    tiles = "all" if S >= PROMPT_ROWS_MIN_TOKENS else None
    whole = "all" if S >= PROMPT_TILE_TOKENS else None
    # Repeated from the replicated slots: under `jax.set_mesh` of an Explicit mesh,
    # jnp.repeat refuses a batch-sharded operand without an `out_sharding` (the mapping
    # wants the tokens unsharded anyway).
    token_slots = jnp.repeat(unshard(slots), S)  # [B*S]
    _set_mapping(model, token_slots, slots, is_prefill=True, prompt_tiles=tiles, whole_tiles=whole)
    mask = positions < lengths[:, None]
    hidden, cache = model.model(ids, positions, cache, attention_mask=mask, flat=True)
    logits = model.compute_logits(_last_hidden(model.rules, hidden, lengths, S))  # [B, V]
    keys = row_keys(seed_key, row_ids, 0)
    return sample_tokens(logits, keys, temperature, top_p, mode=mode), cache


def _decode_fn(
    graphdef,
    state,
    cache,
    first,
    lengths,
    slots,
    row_ids,
    seed_key,
    temperature,
    top_p,
    active,
    max_new,
    eos,
    *,
    mode,
    new_bucket,
    tokens_per_slot=None,
    ops_state=None,  # `ops.dispatch_state()`: a static key only
):
    TRACE_COUNTS["decode"] += 1
    model = nnx.merge(graphdef, state)
    B = first.shape[0]
    # one token per request
    _set_mapping(model, slots, slots, is_prefill=False, tokens_per_slot=tokens_per_slot)
    # Fixed shardings for the loop carry (Explicit meshes want them equal on every trip).
    b = cache_batch_axis(model.rules, B)
    rows = lambda x: model.rules.constrain(x, b)  # noqa: E731
    out = jnp.full((B, new_bucket), -1, jnp.int32).at[:, 0].set(first)  # [B, N]
    out = model.rules.constrain(out, b, None)
    is_eos = lambda tok: (tok[:, None] == eos[None, :]).any(-1)  # noqa: E731  eos: i32[K]
    done = rows(is_eos(first) | (max_new <= 1) | ~active)  # pad rows never hold the loop

    def cond(carry):
        t, _, _, _, done = carry
        return (t < max_new) & ~jnp.all(done)

    def body(carry):
        t, tok, cache, out, done = carry
        # `tok` (generated token t-1) sits at position len + t - 1.
        pos = (lengths + t - 1)[:, None]
        hidden, cache = model.model(tok[:, None], pos, cache, flat=True)  # [B, D]
        logits = model.compute_logits(hidden)
        new = sample_tokens(logits, row_keys(seed_key, row_ids, t), temperature, top_p, mode=mode)
        new = rows(jnp.where(done, -1, new))
        out = jax.lax.dynamic_update_slice(out, new[:, None], (0, t))
        done = done | is_eos(new)
        # Finished rows keep stepping (static shapes) on a harmless token.
        return t + 1, rows(jnp.where(done, 0, new)), cache, out, done

    carry = (jnp.int32(1), rows(jnp.where(done, 0, first)), cache, out, done)
    _, _, cache, out, _ = jax.lax.while_loop(cond, body, carry)
    return out, cache


_prefill = jax.jit(
    _prefill_fn, static_argnames=("graphdef", "mode", "ops_state"), donate_argnames=("cache",)
)


@functools.cache
def _decode_jit(options: tuple[tuple[str, str], ...]):
    return jax.jit(
        _decode_fn,
        static_argnames=("graphdef", "mode", "new_bucket", "tokens_per_slot", "ops_state"),
        donate_argnames=("cache",),
        compiler_options=dict(options) or None,
    )


def _options_key() -> tuple[tuple[str, str], ...]:
    return tuple(sorted(decode_compiler_options().items()))


def _decode(*args, **kwargs):
    """The jitted decode loop, compiled with `decode_compiler_options` as they are now."""
    return _decode_jit(_options_key())(*args, **kwargs)


def _model_max_loras(model) -> int | None:
    """The LoRA slots of the model's layers; None where it has no LoRA layers."""
    return _context_max_loras(model) if find_lora_context(model) is not None else None


def _slot(i: int, s) -> int:
    """Request ``i``'s slot: an int (-1 or None: no adapter, as `token_mapping` gives)."""
    if s is None:
        return -1
    if isinstance(s, jax.Array) and s.ndim == 0 and jnp.issubdtype(s.dtype, jnp.integer):
        s = int(s)  # a concrete jax scalar (from a slot vector)
    if isinstance(s, bool | np.bool_) or not isinstance(s, int | np.integer):
        raise ValueError(
            f"generate: adapter slot of request {i} must be an int (-1 or None: no adapter), "
            f"got {s!r}"
        )
    return int(s)


def _check_inputs(model, max_loras, prompts, adapter_slots, max_new_tokens, eos_token_id):
    vocab = model.config.vocab_size
    if len(prompts) == 0:
        raise ValueError("generate: prompts is empty")
    clean = []
    for i, p in enumerate(prompts):
        arr = np.asarray(p)
        # numpy takes True in [True, 2, 3] as token 1
        mixed_bool = isinstance(p, list | tuple) and any(isinstance(t, bool | np.bool_) for t in p)
        if arr.ndim != 1 or arr.size == 0 or mixed_bool or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"generate: prompt {i} must be a non-empty sequence of token ids (ints, not bools)"
            )
        if arr.min() < 0 or arr.max() >= vocab:
            raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab})")
        clean.append(arr.astype(np.int32))
    slots = (
        [-1] * len(prompts)
        if adapter_slots is None
        else [_slot(i, s) for i, s in enumerate(adapter_slots)]
    )
    if len(slots) != len(prompts):
        raise ValueError(f"generate: {len(prompts)} prompts but {len(slots)} adapter_slots")
    has_lora = max_loras is not None
    max_loras = max_loras or 0
    bad = [s for s in slots if not -1 <= s < max_loras]
    if bad:
        allowed = f"[-1, {max_loras})" if has_lora else "-1 (the model has no LoRA layers)"
        raise ValueError(f"generate: adapter slots {bad} outside {allowed}")
    if (
        isinstance(max_new_tokens, bool | np.bool_)
        or not isinstance(max_new_tokens, (int, np.integer))
        or max_new_tokens < 1
    ):
        raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    return clean, slots, _eos_ids(eos_token_id, vocab)


def _sampling_params(sampling) -> SamplingParams:
    """`sampling` (None, a `SamplingParams` or a dict of its fields) → `SamplingParams`."""
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, SamplingParams):
        return sampling
    fields = tuple(f.name for f in dataclasses.fields(SamplingParams))
    if not isinstance(sampling, Mapping):
        raise ValueError(
            f"generate: sampling must be None, a SamplingParams or a dict of its fields "
            f"{fields}, got {sampling!r}"
        )
    unknown = [k for k in sampling if k not in fields]
    if unknown:
        raise ValueError(f"generate: sampling has unknown fields {unknown}; allowed: {fields}")
    return SamplingParams(**sampling)


def _eos_ids(eos_token_id, vocab: int) -> tuple[int, ...]:
    """`eos_token_id` (None, an id, or several as HF configs give them) → a tuple of ids."""
    if eos_token_id is None:
        return ()
    ids = np.atleast_1d(np.asarray(eos_token_id))
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"generate: eos_token_id must be None, a token id or a list of them, got "
            f"{eos_token_id!r}"
        )
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"generate: eos_token_id {eos_token_id} outside [0, {vocab})")
    return tuple(int(i) for i in ids)


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


def _generate(
    model,
    max_loras,
    merged,
    prefill,
    decode,
    prompts,
    adapter_slots,
    *,
    max_new_tokens,
    sampling,
    eos_token_id,
    min_batch_bucket,
    min_prompt_bucket,
    cache_dtype,
) -> GenerationResult:
    """`generate`'s steps around ``prefill(cache, ids, *common, mode)`` and ``decode(cache,
    first, *common, active, max_new, eos, mode, new_bucket, tokens_per_slot)`` (the jitted
    steps bound to one model's graph and state)."""
    sampling = _sampling_params(sampling)
    for name, value in (
        ("min_batch_bucket", min_batch_bucket),
        ("min_prompt_bucket", min_prompt_bucket),
    ):
        if (
            isinstance(value, bool | np.bool_)
            or not isinstance(value, int | np.integer)
            or value < 1
        ):
            raise ValueError(f"generate: {name} must be an int >= 1, got {value!r}")
    if cache_dtype is not None:
        cache_dtype = float_cache_dtype(cache_dtype, "generate: cache_dtype")
    clean, slots, eos_ids = _check_inputs(
        model, max_loras, prompts, adapter_slots, max_new_tokens, eos_token_id
    )
    if merged is not None and any(s >= 0 for s in slots):
        # the merged kernels already carry that adapter: a LoRA slot would add it twice
        raise ValueError(
            f"generate: slot {merged} is merged into the model's kernels (merge_adapter); "
            "serve with adapter slots -1, or unmerge_adapter first"
        )
    rules: ShardingRules = model.rules
    n = len(clean)
    B = bucket(n, max(min_batch_bucket, rules.size("batch")))
    S = bucket(max(len(p) for p in clean), min_prompt_bucket)
    N = bucket(max_new_tokens)
    if S + N > np.iinfo(np.int32).max:  # the cache's positions are int32
        raise ValueError(
            f"generate: a prompt of up to {max(len(p) for p in clean)} tokens + max_new_tokens "
            f"{max_new_tokens} need {S + N} cache positions (buckets of {S} + {N}), more "
            f"than int32 positions hold ({np.iinfo(np.int32).max}); lower max_new_tokens"
        )
    ids = np.zeros((B, S), np.int32)
    lengths = np.ones((B,), np.int32)  # pad rows: one dummy token
    for i, p in enumerate(clean):
        ids[i, : len(p)] = p
        lengths[i] = len(p)
    slot_arr = np.full((B,), -1, np.int32)
    slot_arr[:n] = slots
    hint = decode_hint(max_loras, slot_arr)
    row_ids = np.arange(B, dtype=np.int32)
    b = cache_batch_axis(rules, B)
    put = lambda x, *ax: rules.place(jnp.asarray(x), *ax)  # noqa: E731
    ids, lengths, slot_arr, row_ids = (
        put(ids, b, None),
        put(lengths, b),
        put(slot_arr, b),
        put(row_ids, b),
    )
    if cache_dtype is None:
        cache_dtype = getattr(model, "dtype", None) or jnp.float32
    cache = KVCache.init(model.config, B, S + N, rules=rules, dtype=cache_dtype)
    key = seed_key(sampling.seed)
    temperature = jnp.float32(sampling.temperature)
    top_p = jnp.float32(sampling.top_p)
    common = (lengths, slot_arr, row_ids, key, temperature, top_p)
    ops_state = ops.dispatch_state()  # a new backend setting compiles anew
    first, cache = prefill(cache, ids, *common, mode=sampling.mode, ops_state=ops_state)
    if max_new_tokens == 1:
        out = first[:, None]
    else:
        # [K], K a power of two >= 4 so that a new count of eos ids rarely recompiles;
        # -2 pads (no token is -2)
        k = bucket(len(eos_ids), EOS_BUCKET)
        eos = jnp.asarray(eos_ids + (-2,) * (k - len(eos_ids)), jnp.int32)
        active = put(np.arange(B) < n, b)
        out, _ = decode(
            cache, first, *common, active, jnp.int32(max_new_tokens), eos,
            mode=sampling.mode, new_bucket=N, tokens_per_slot=hint, ops_state=ops_state,
        )  # fmt: skip
    out = np.asarray(jax.device_get(out))[:n, :max_new_tokens]
    tokens, reasons = [], []
    for row in out:
        row = row[row >= 0]
        hit = row.size and int(row[-1]) in eos_ids
        tokens.append([int(t) for t in row])
        reasons.append("eos" if hit else "length")
    return GenerationResult(tokens, reasons, B, S, N)


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

        def prefill(values, cache, *args, mode, ops_state):
            return _prefill_fn(graphdef, state_of(values), cache, *args, mode=mode)

        def decode(values, cache, *args, mode, new_bucket, tokens_per_slot, ops_state):
            return _decode_fn(
                graphdef, state_of(values), cache, *args, mode=mode, new_bucket=new_bucket,
                tokens_per_slot=tokens_per_slot,
            )  # fmt: skip

        self._prefill = jax.jit(
            prefill, static_argnames=("mode", "ops_state"), donate_argnames=("cache",)
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
        )
