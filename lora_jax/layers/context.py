"""The step's token→slot mapping as the LoRA layers see it: one `LoRAContext` shared by
reference by every layer of a wrapped model, and the model-level calls that set it
(`set_lora_mapping`, the `lora_mapping` block, `clear_lora_mapping`) and find it
(`find_lora_context`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.mapping import LoRAMapping, make_lora_mapping


class LoRAContext(nnx.Variable):
    """Holds the step's `LoRAMapping` (or None); one instance is shared by all layers.

    Example:
        >>> ctx = LoRAContext(None)
        >>> ctx.set_value(make_lora_mapping(jnp.array([0, -1]), max_loras=2))
    """


def check_mapping_slots(name: str, mapping: LoRAMapping, max_loras: int) -> None:
    """The mapping was built for the layer's slot count. Layers that rebuild the mapping
    from its indices (per data shard, per logits row) would otherwise read indices past
    their slots as "no adapter" where the ops refuse the mismatch."""
    if mapping.max_loras != max_loras:
        raise ValueError(
            f"{name}: the LoRA mapping was built for max_loras={mapping.max_loras}, the "
            f"layer has {max_loras} slots"
        )


def find_lora_context(model: nnx.Module) -> LoRAContext | None:
    """The `LoRAContext` shared by the LoRA layers of `model` (None if not wrapped).

    Raises if the model's LoRA layers hold more than one context: one step has one mapping.

    Example:
        >>> find_lora_context(model) is None  # before wrap_model  # doctest: +SKIP
        True
    """
    found = {}
    for _, node in nnx.iter_graph(model):
        if isinstance(node, LoRAContext):
            found[id(node)] = node
    if len(found) > 1:
        raise ValueError(
            f"model has {len(found)} LoRA contexts; its LoRA layers must share one (one step "
            "has one mapping). Under a plain jax transform (jax.jit, jax.grad, ...) the model "
            "is a pytree and each layer gets its own copy of the shared context: use nnx.jit, "
            "or pass nnx.split(model)'s state in and nnx.merge it inside. Outside transforms: "
            "wrap the model with one shared context"
        )
    return next(iter(found.values()), None)


def set_lora_mapping(
    model: nnx.Module,
    token_lora_indices: jax.Array | LoRAMapping,
    seq_lora_indices: jax.Array | None = None,
    *,
    is_prefill: bool | None = None,
    prompt_tiles: str | None = None,
    tokens_per_slot: int | None = None,
    whole_tiles: str | None = None,
    single_slot: bool | None = None,
) -> LoRAMapping | None:
    """Sets the step's mapping on every LoRA layer of `model` (call inside your jit), until
    changed. Inside `nnx.jit` prefer `lora_mapping`'s block: a mapping left here is written
    back by `nnx.jit` (so the step computes and returns all of it, every kernel's work
    list included) and enters the next call's compile key.
    ``is_prefill=False`` marks a decode step (`LoRAMapping.is_prefill`); ``prompt_tiles``,
    ``whole_tiles`` and ``tokens_per_slot`` say what the caller knows of its prompts'
    layout and of its tokens per adapter, ``single_slot=True`` that every mapped token
    uses one slot (a training batch: the backward pass then multiplies against that
    slot's weights only; `make_lora_mapping`).

    Example:
        >>> set_lora_mapping(model, jnp.array([0, 0, -1, 2], jnp.int32))  # doctest: +SKIP
    """
    ctx = find_lora_context(model)
    if ctx is None:
        _refuse_slots_without_lora(token_lora_indices, seq_lora_indices)
        return None
    if isinstance(token_lora_indices, LoRAMapping):
        mapping = token_lora_indices
    else:
        max_loras = _context_max_loras(model)
        mapping = make_lora_mapping(
            token_lora_indices,
            max_loras,
            seq_lora_indices,
            is_prefill=is_prefill,
            prompt_tiles=prompt_tiles,
            tokens_per_slot=tokens_per_slot,
            whole_tiles=whole_tiles,
            single_slot=single_slot,
        )
    ctx.set_value(mapping)
    return mapping


def _refuse_slots_without_lora(token_lora_indices, seq_lora_indices) -> None:
    """For a model with no LoRA layers (wrap_model forgotten, or unwrapped): the indices
    checked as `make_lora_mapping` checks them, and a slot >= 0 refused, since the base
    model would serve it. Traced indices can be checked for dtype and shape only."""
    if isinstance(token_lora_indices, LoRAMapping):
        seq_lora_indices = token_lora_indices.seq_lora_indices
        token_lora_indices = token_lora_indices.token_lora_indices
    for name, idx in (
        ("token_lora_indices", token_lora_indices),
        ("seq_lora_indices", seq_lora_indices),
    ):
        if idx is None:
            continue
        if not isinstance(idx, jax.Array):
            idx = np.asarray(idx)
        if idx.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {idx.shape}")
        if not jnp.issubdtype(idx.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers, got {idx.dtype}")
        try:
            host = np.asarray(idx)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            continue
        bad = np.unique(host[host >= 0])
        if bad.size:
            raise ValueError(
                f"set_lora_mapping: adapter slots {bad.tolist()} in {name} outside -1 (the "
                "model has no LoRA layers; wrap_model it first)"
            )


@contextlib.contextmanager
def lora_mapping(
    model: nnx.Module,
    token_lora_indices: jax.Array | LoRAMapping,
    seq_lora_indices: jax.Array | None = None,
    **hints,
) -> Iterator[LoRAMapping | None]:
    """`set_lora_mapping` for the ``with`` block only: the previous value (usually None)
    is back on exit. Use it inside `nnx.jit`: a mapping left in the model's context is
    written back by `nnx.jit` and becomes part of the next call's compile key (a recompile
    per batch bucket pair) and the mapping of later calls that set none.

    Example:
        >>> @nnx.jit  # doctest: +SKIP
        ... def step(model, x, slots):
        ...     with lora_mapping(model, slots):
        ...         return model(x)
    """
    ctx = find_lora_context(model)
    old = None if ctx is None else ctx.get_value()
    try:
        yield set_lora_mapping(model, token_lora_indices, seq_lora_indices, **hints)
    finally:
        if ctx is not None:
            ctx.set_value(old)


def clear_lora_mapping(model: nnx.Module) -> None:
    """Removes the step's mapping from the model's LoRA context: the LoRA layers then give
    their base outputs (what `lora_mapping`'s block does on exit)."""
    ctx = find_lora_context(model)
    if ctx is not None:
        ctx.set_value(None)


def _context_max_loras(model: nnx.Module) -> int:
    from lora_jax.layers.base import BaseLayerWithLoRA  # base.py imports this module

    for _, node in nnx.iter_graph(model):
        if isinstance(node, BaseLayerWithLoRA) or hasattr(node, "lora_config"):
            return node.lora_config.max_loras
    raise ValueError("model has a LoRA context but no LoRA layer")
