"""A device slot → a host `LoRAAdapter` (`adapter_from_slot`), the first half of the export.

Each LoRA layer's stacks at the slot are read back to the host, cut to the slot's true rank
per slice, and laid out as the logical model's (kv-head replicas and per-shard packing
undone, the embedding's and lm_head's pairs as `set_lora` takes them). A DoRA slot's
modules carry their magnitudes (`lora_jax.layers.dora.slot_magnitudes`), trainable tokens
their rows, an activated LoRA its invocation tokens. `lora_jax.serving.export` writes the
result as a PEFT directory.
"""

from __future__ import annotations

import numpy as np

from lora_jax.layers.dora import has_dora, is_dora_slot, unpacked_magnitudes
from lora_jax.linear import unpack_shards
from lora_jax.serving.adapters import LoRAAdapter, ModuleLoRA, TrainableTokens
from lora_jax.serving.manager_request import _check_id
from lora_jax.serving.training import WHOLE_LAYERS, trainable_layers
from lora_jax.serving.wrap import lora_layers


def _check_slot(model, slot) -> None:
    if isinstance(slot, bool) or not isinstance(slot, int | np.integer):
        raise ValueError(f"export: slot must be an int, got {slot!r}")
    layers = lora_layers(model)
    if not layers:
        raise ValueError("export: the model has no LoRA layers (wrap_model it first)")
    L = next(iter(layers.values())).lora_config.max_loras
    if not 0 <= int(slot) < L:
        raise ValueError(f"export: slot {slot!r} outside [0, {L})")
    trainable = trainable_layers(model)
    for name, layer in layers.items():
        if name in trainable:
            continue
        ranks = getattr(layer, "slot_ranks", None)
        if ranks is not None and np.asarray(ranks[...])[..., int(slot)].any():
            raise ValueError(
                f"export: slot {slot} holds LoRA in {name} ({type(layer).__name__}), a "
                "layer kind the export does not know"
            )


def _logical_b(layer, s: int, b: np.ndarray, name: str) -> np.ndarray:
    """Physical `[out_s, r]` of slice s → logical (the inverse of `_physical_b`)."""
    base = layer.base_layer
    group = layer.slice_groups[s]
    parts = unpack_shards(b, [base.physical_sizes[i] for i in group], 0, base.out_tp)
    return _logical_members(layer, group, parts, name)


def _logical_members(layer, group, parts, name: str, check: bool = True) -> np.ndarray:
    """Per base sub-slice physical parts (`[out_i (physical), ...]`) of one slice's members
    → the slice's logical rows: one copy of each kv head (``check``: its replicas equal)."""
    base = layer.base_layer
    out = []
    for i, part in zip(group, parts):
        part = np.asarray(part)
        reps = getattr(base, "num_kv_head_replicas", 1)
        if i > 0 and reps > 1:  # kv heads repeated for tp > kv heads: one copy of each
            heads = part.reshape(base.total_num_kv_heads, reps, base.head_size, -1)
            if check and not np.array_equal(heads, np.broadcast_to(heads[:, :1], heads.shape)):
                raise ValueError(
                    f"export: {name}: the replicas of a kv head's B differ (trained apart), "
                    "so the slot is not one adapter of the logical model; train with "
                    "lora_jax.serving.training.tie_kv_replicas(model) first in the optax chain"
                )
            part = heads[:, 0].reshape(-1, *part.shape[1:])
        out.append(part)
    return np.concatenate(out, axis=0)


def _magnitudes(layer, slot: int, ranks, name: str, dora_at: str):
    """Per slice the logical DoRA magnitudes (PEFT `lora_magnitude_vector`) of a DoRA slot,
    None for a slice without LoRA; a layer without DoRA scales is refused by name."""
    _check_dora_layer(layer, slot, name, dora_at)
    parts = unpacked_magnitudes(layer, slot)
    return tuple(
        None if r == 0 else _logical_members(layer, g, [parts[i] for i in g], name, check=False)
        for g, r in zip(layer.slice_groups, ranks)
    )


def _check_dora_layer(layer, slot: int, name: str, dora_at: str) -> None:
    """A layer with LoRA in a DoRA slot can write its magnitudes (it has DoRA scales)."""
    if not has_dora(layer):
        raise ValueError(
            f"export: slot {slot} holds a DoRA adapter (PEFT use_dora, at {dora_at!r}) and "
            f"LoRA in {name} ({type(layer).__name__}), which has no DoRA scale: PEFT's "
            "use_dora makes every module of the adapter DoRA"
        )


def adapter_from_slot(
    model, slot: int, *, adapter_id: int = 1, name: str = "adapter"
) -> LoRAAdapter:
    """The adapter in ``slot`` of the model's LoRA layers, as host f32 arrays.

    Modules are keyed by LoRA layer name, as `load_peft_adapter` keys them, so
    `manager.add_adapter(adapter_from_slot(...))` serves a copy of the slot.

    Example:
        >>> adapter = adapter_from_slot(model, 1, adapter_id=7, name="tuned")  # doctest: +SKIP
    """
    _check_id(adapter_id, "adapter_from_slot: adapter_id", "the manager key")
    _check_slot(model, slot)
    # DoRA (PEFT use_dora) is the whole adapter's: every module then has its magnitudes
    dora = next((n for n, la in lora_layers(model).items() if is_dora_slot(la, int(slot))), None)
    modules = {}
    for lname, layer in trainable_layers(model).items():
        if isinstance(layer, WHOLE_LAYERS):
            found = layer.read_lora(int(slot))  # (A, B) as set_lora takes them, or None
            mags = None
            if found is not None and dora is not None:
                _check_dora_layer(layer, int(slot), lname, dora)  # MoE experts
                mags = (layer.read_magnitudes(int(slot)),)  # the embedding's, the lm_head's
            if found is not None:
                a, b = found
                whole = not isinstance(a, list)  # the embedding / lm_head: one pair
                modules[lname] = ModuleLoRA(
                    lname, (a,) if whole else tuple(a), (b,) if whole else tuple(b), mags
                )
            continue
        ranks = np.asarray(layer.slot_ranks[...])[:, int(slot)]  # [S]
        if not ranks.any():
            continue
        a_list, b_list = [], []
        for s, r in enumerate(ranks):
            if r == 0:
                a_list.append(None)
                b_list.append(None)
                continue
            a = np.asarray(layer.lora_a[s][...][int(slot)], np.float32)[:r]  # [r, in]
            b = np.asarray(layer.lora_b[s][...][int(slot)], np.float32)[:, :r]  # [out_s, r]
            a_list.append(a)
            b_list.append(_logical_b(layer, s, b, lname))
        mags = None if dora is None else _magnitudes(layer, int(slot), ranks, lname, dora)
        modules[lname] = ModuleLoRA(lname, tuple(a_list), tuple(b_list), mags)
    if not modules:
        raise ValueError(f"export: slot {slot} holds no adapter")
    rank = max(m.rank for m in modules.values())
    tokens = {}
    for lname, layer in lora_layers(model).items():  # trainable tokens: embedding, lm_head
        found = layer.read_tokens(int(slot)) if hasattr(layer, "read_tokens") else None
        if found is not None:
            tokens[lname] = TrainableTokens(lname, *found)
    return LoRAAdapter(
        id=adapter_id,
        name=name,
        rank=rank,
        modules=modules,
        invocation_tokens=_slot_invocation(model, int(slot)),
        trainable_tokens=tokens,
    )


def _slot_invocation(model, slot: int) -> tuple[int, ...] | None:
    """The invocation sequence of the activated LoRA (aLoRA) a manager of the model holds in
    ``slot``, else None: a copy or a saved file of the slot stays an aLoRA."""
    from lora_jax.serving.manager import managers_of  # it imports the loader

    for manager in managers_of(model):
        adapter = manager.adapter_in_slot(slot)
        if adapter is not None and adapter.invocation_tokens is not None:
            return adapter.invocation_tokens
    return None
