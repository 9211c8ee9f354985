"""Checks `merge_adapter` / `unmerge_adapter` make before changing any weight.

Whether a slot holds an adapter in a layer, which embedding table a tied model also reads
as its lm_head, that no layer is traced (merging edits weights on the host) and that the
slot is a concrete integer.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from lora_jax.layers import LoRASlotRanks
from lora_jax.layers.logits import TiedLMHeadWithLoRA, _head_of


def _slot_in_use(layer, slot: int) -> bool:
    """Whether any `LoRASlotRanks` inside `layer` records an adapter in `slot`."""
    return any(
        np.asarray(node.get_value())[..., slot].any()
        for _, node in nnx.iter_graph(layer)
        if isinstance(node, LoRASlotRanks)
    )


def _tied_table(model: nnx.Module) -> int | None:
    """`id` of the embedding table that a tied model reads both as its embedding and as
    its lm_head (as `wrap_model` knows them: `lm_head` None, or a `TiedLMHeadWithLoRA`,
    over `model.model.embed_tokens`), whichever of the two is LoRA-wrapped."""
    head = getattr(model, "lm_head", True)
    if isinstance(head, TiedLMHeadWithLoRA):
        return id(_head_of(head.base_layer).embedding)
    if head is not None:
        return None
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    table = getattr(getattr(emb, "base_layer", emb), "embedding", None)
    return None if table is None else id(table)


def _check_not_traced(all_layers: dict, what: str) -> None:
    """Merging edits the base weights in place, on the host: under a jax transform it
    would only change the trace (or fail on a traced rank table), so it is refused."""
    for name, layer in all_layers.items():
        for _, node in nnx.iter_graph(layer):
            if isinstance(node, LoRASlotRanks) and isinstance(node.get_value(), jax.core.Tracer):
                raise ValueError(
                    f"{what}: layer {name!r} is traced; merging edits the weights on the "
                    f"host, call {what} outside jit"
                )


def _slot_index(slot) -> int:
    """`slot` as a Python int: an int, a numpy integer (as `token_mapping` / `slot_of`
    values may come) or a concrete integer scalar array; never a bool or a traced value."""
    if isinstance(slot, (np.ndarray, jax.Array)) and not isinstance(slot, jax.core.Tracer):
        if slot.shape == () and np.issubdtype(slot.dtype, np.integer):
            return int(slot)
    elif isinstance(slot, (int, np.integer)) and not isinstance(slot, (bool, np.bool_)):
        return int(slot)
    raise ValueError(
        f"merge_adapter: slot must be a Python int or a concrete integer scalar (merging "
        f"runs outside jit), got {type(slot).__name__} {slot!r}"
    )
