"""One `generate` batch on the host, around the jitted steps, and its `GenerationResult`.

`_generate` checks the arguments (`generate_inputs`), pads the requests to the batch,
prompt and new-token buckets, places the arrays on the model's mesh, makes the KV cache,
runs a prefill and (past one new token) the decode loop it is handed, and reads each
request's tokens and finish reason back. `generate` hands it the steps bound to a fresh
split of the model, `Generator` the steps bound to its model's current values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lora_jax import ops
from lora_jax.models.kv_cache import KVCache, cache_batch_axis, float_cache_dtype
from lora_jax.serving.generate_inputs import (
    EOS_BUCKET,
    _check_inputs,
    _sampling_params,
    _starts,
    bucket,
    decode_hint,
)
from lora_jax.serving.sampling import seed_key
from lora_jax.sharding import ShardingRules


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
    adapter_starts=None,
) -> GenerationResult:
    """`generate`'s steps around ``prefill(cache, ids, starts, *common, mode, activated)`` and
    ``decode(cache,
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
    starts = _starts(adapter_starts, clean)
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
    start_arr = np.zeros((B,), np.int32)
    start_arr[:n] = starts
    # an activated LoRA's rows switch from the base to the adapter inside the prompt
    activated = any(st > 0 and sl >= 0 for st, sl in zip(starts, slots))
    hint = decode_hint(max_loras, slot_arr)
    row_ids = np.arange(B, dtype=np.int32)
    b = cache_batch_axis(rules, B)
    put = lambda x, *ax: rules.place(jnp.asarray(x), *ax)  # noqa: E731
    ids, lengths, slot_arr, row_ids, start_arr = (
        put(ids, b, None),
        put(lengths, b),
        put(slot_arr, b),
        put(row_ids, b),
        put(start_arr, b),
    )
    if cache_dtype is None:
        cache_dtype = getattr(model, "dtype", None) or jnp.float32
    cache = KVCache.init(model.config, B, S + N, rules=rules, dtype=cache_dtype)
    key = seed_key(sampling.seed)
    temperature = jnp.float32(sampling.temperature)
    top_p = jnp.float32(sampling.top_p)
    common = (lengths, slot_arr, row_ids, key, temperature, top_p)
    ops_state = ops.dispatch_state()  # a new backend setting compiles anew
    first, cache = prefill(
        cache, ids, start_arr, *common, mode=sampling.mode, ops_state=ops_state, activated=activated
    )
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
