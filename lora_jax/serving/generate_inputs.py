"""`generate`'s arguments checked and normalised on the host, and its power-of-two buckets.

`_check_inputs` turns prompts, adapter slots, `max_new_tokens` and `eos_token_id` into
int32 token arrays, int slots and a tuple of eos ids, with an error naming the offending
request, and `_starts` the requests' adapter starts (aLoRA) into ints; `_sampling_params`
accepts `SamplingParams` or a dict of its fields. `bucket` rounds the batch, prompt,
new-token and eos-id counts up to the powers of two the jitted steps compile for, and
`decode_hint` picks the decode loop's tokens-per-slot hint from the requests' slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from lora_jax.mapping import host_tokens_per_slot
from lora_jax.serving.sampling import SamplingParams

# The decode step's eos ids are padded to a power of two of at least this many.
EOS_BUCKET = 4


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum).

    Example:
        >>> bucket(5), bucket(5, minimum=16), bucket(16)
        (8, 16, 16)
    """
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


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


def _starts(adapter_starts, prompts: list[np.ndarray]) -> list[int]:
    """Per request, the first prompt position whose token uses the request's adapter (an
    activated LoRA's invocation start, `lora_jax.serving.alora`); 0 for all when None."""
    if adapter_starts is None:
        return [0] * len(prompts)
    starts = list(adapter_starts)
    if len(starts) != len(prompts):
        raise ValueError(f"generate: {len(prompts)} prompts but {len(starts)} adapter_starts")
    for i, (s, p) in enumerate(zip(starts, prompts)):
        if isinstance(s, jax.Array) and s.ndim == 0:
            s = starts[i] = s.item()  # a concrete jax scalar (from a start vector)
        if (
            isinstance(s, bool | np.bool_)
            or not isinstance(s, int | np.integer)
            or not 0 <= s < len(p)
        ):
            raise ValueError(
                f"generate: adapter_starts[{i}]={s!r} must be an int in [0, {len(p)}) (prompt "
                f"{i}'s length: its last token and every generated token use its adapter)"
            )
    return [int(s) for s in starts]


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
