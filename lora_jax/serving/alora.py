"""Activated LoRA (aLoRA): an adapter that acts only from its invocation sequence on.

PEFT's `LoraConfig(alora_invocation_tokens=[...])`, served by vLLM as "activated LoRA": a
request that uses such an adapter runs the base model up to the *last* occurrence of the
adapter's invocation token sequence in its prompt, and the adapter from that occurrence's
first token on (the rest of the prompt and every generated token). A prompt without the
sequence runs the base model throughout. The tokens before the start keep exactly the
base model's hidden states and KV cache, which is what lets a server reuse a base
model's cache for them.

In lora_jax this is a per-token mapping and nothing else: the tokens before the start use
slot -1 ("no adapter": exactly the base output), the others the adapter's slot, so every
LoRA layer, backend and mesh serves it unchanged.

* `invocation_start` finds the start in one prompt (PEFT's `calculate_alora_offsets`
  counts the same position from the prompt's end);
* `LoRAModelManager.adapter_starts(adapter_ids, prompts)` gives a batch's slots and
  starts for `generate(..., adapter_starts=starts)` / `Generator` (its `token_mapping`
  refuses an aLoRA request: a slot alone would serve it from the first token);
* `token_slots` flattens slots and starts into a forward's per-token slots.

PEFT gives aLoRA to linear layers only (an embedding refuses it) and applies a
`target_parameters` LoRA to every token, and lora_jax's lm_head LoRA is one per sequence:
so an aLoRA adapter may target linear projections only (attention, MLP, per-expert MoE
linears). `check_alora_modules` refuses the rest when the adapter is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from lora_jax.serving.peft_keys import NOT_ALL_LINEAR


def invocation_start(prompt: Sequence[int], invocation_tokens: Sequence[int]) -> int | None:
    """Where the last occurrence of `invocation_tokens` in `prompt` begins; None where the
    prompt does not hold them.

    Example:
        >>> invocation_start([7, 5, 9, 1, 5, 9, 2], [5, 9])
        4
        >>> invocation_start([7, 5, 1], [5, 9]) is None
        True
    """
    p = np.asarray(prompt).reshape(-1)
    t = np.asarray(invocation_tokens).reshape(-1)
    if t.size == 0 or t.size > p.size:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(p, t.size)
    hits = np.flatnonzero((windows == t).all(axis=1))
    return int(hits[-1]) if hits.size else None


def token_slots(
    slots: Sequence[int], starts: Sequence[int], tokens_per_request: Sequence[int] | int
) -> np.ndarray:
    """Per-token slots (int32) of requests laid end to end: request i's first `starts[i]`
    tokens get -1, the rest `slots[i]`.

    Example:
        >>> token_slots([2, 0, -1], [1, 0, 0], 3).tolist()
        [-1, 2, 2, 0, 0, 0, -1, -1, -1]
    """
    slots = np.asarray(slots, np.int32).reshape(-1)
    starts = np.asarray(starts).reshape(-1)
    counts = np.broadcast_to(np.asarray(tokens_per_request), slots.shape)
    if starts.shape != slots.shape:
        raise ValueError(
            f"token_slots: {slots.size} slots but {starts.size} starts; give one per request"
        )
    pieces = [
        np.where(np.arange(int(n)) >= s, slot, -1) for slot, s, n in zip(slots, starts, counts)
    ]
    return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros((0,), np.int32)


def check_alora_modules(cfg, modules: Mapping, layers: Mapping, fused_experts, source: str):
    """Refuses an aLoRA adapter's modules that lora_jax cannot serve as PEFT does: an
    embedding or lm_head, and `target_parameters` LoRAs (fused MoE experts, 2-D weights),
    which PEFT applies to every token."""
    if cfg.target_parameters or fused_experts:
        raise ValueError(
            f"{source}: alora_invocation_tokens with target_parameters "
            f"{list(cfg.target_parameters)}: PEFT applies a target_parameters LoRA to every "
            "token, not from the invocation on; lora_jax serves an activated LoRA on "
            "linear modules (target_modules) only"
        )
    for name in sorted(modules):
        layer = layers[name]
        if isinstance(layer, NOT_ALL_LINEAR) or getattr(layer, "tied", False):
            raise ValueError(
                f"{source}: module {name!r}: an activated LoRA (alora_invocation_tokens) may "
                "target linear projections only, not an embedding or the lm_head (PEFT "
                "refuses aLoRA on an embedding; lora_jax's lm_head LoRA is one per sequence)"
            )
