"""A device slot → a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`).

The inverse of loading: each LoRA layer's stacks at the slot are read back to the host,
cut to the slot's true rank per slice, and laid out as the checkpoint's modules (a packed
`qkv_proj` → `q_proj` / `k_proj` / `v_proj`, kv-head replicas and per-shard packing
undone; the token embedding as `lora_embedding_A` / `lora_embedding_B`, the lm_head's
rows back in token order). B holds the scaling, so each module is written with `lora_alpha` equal
to its rank (scaling 1) and per-module ranks go to `rank_pattern` / `alpha_pattern`.
PEFT (`PeftModel.from_pretrained`), vLLM and `load_peft_adapter` load the result; a slot
trained with `lora_jax.serving.training` leaves the library this way.

Fused-MoE LoRA is not exported: a slot with one is refused by name rather than written
without it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from lora_jax.layers.embedding import VocabParallelEmbeddingWithLoRA
from lora_jax.linear import unpack_shards
from lora_jax.serving.peft import (
    CONFIG_NAME,
    PEFT_PREFIX,
    WEIGHTS_NAME,
    LoRAAdapter,
    ModuleLoRA,
    _module_index,
    write_safetensors,
)
from lora_jax.serving.training import VOCAB_LAYERS, trainable_layers
from lora_jax.serving.wrap import layer_packed_modules, lora_layers, packed_names

# PEFT's tensor keys after the module name: `lora_A.weight` / `lora_B.weight` for linear
# layers and the lm_head; an embedding's factors are bare parameters.
LINEAR_KEYS = (".lora_A.weight", ".lora_B.weight")
EMBEDDING_KEYS = (".lora_embedding_A", ".lora_embedding_B")


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
                f"export: slot {slot} holds LoRA in {name} ({type(layer).__name__}); fused "
                "MoE experts are not exported (linear layers, the embedding and lm_head are)"
            )


def _logical_b(layer, s: int, b: np.ndarray, name: str) -> np.ndarray:
    """Physical `[out_s, r]` of slice s → logical (the inverse of `_physical_b`)."""
    base = layer.base_layer
    group = layer.slice_groups[s]
    parts = unpack_shards(b, [base.physical_sizes[i] for i in group], 0, base.out_tp)
    out = []
    for i, part in zip(group, parts):
        part = np.asarray(part)
        reps = getattr(base, "num_kv_head_replicas", 1)
        if i > 0 and reps > 1:  # kv heads repeated for tp > kv heads: one copy of each
            heads = part.reshape(base.total_num_kv_heads, reps, base.head_size, -1)
            if not np.array_equal(heads, np.broadcast_to(heads[:, :1], heads.shape)):
                raise ValueError(
                    f"export: {name}: the replicas of a kv head's B differ (trained apart), "
                    "so the slot is not one adapter of the logical model"
                )
            part = heads[:, 0].reshape(-1, part.shape[-1])
        out.append(part)
    return np.concatenate(out, axis=0)


def adapter_from_slot(
    model, slot: int, *, adapter_id: int = 1, name: str = "adapter"
) -> LoRAAdapter:
    """The adapter in ``slot`` of the model's LoRA layers (all but fused MoE), as host f32
    arrays.

    Modules are keyed by LoRA layer name, as `load_peft_adapter` keys them, so
    `manager.add_adapter(adapter_from_slot(...))` serves a copy of the slot.

    Example:
        >>> adapter = adapter_from_slot(model, 1, adapter_id=7, name="tuned")  # doctest: +SKIP
    """
    _check_slot(model, slot)
    modules = {}
    for lname, layer in trainable_layers(model).items():
        if isinstance(layer, VOCAB_LAYERS):
            found = layer.read_lora(int(slot))  # (A, B) as set_lora takes them, or None
            if found is not None:
                modules[lname] = ModuleLoRA(lname, (found[0],), (found[1],))
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
        modules[lname] = ModuleLoRA(lname, tuple(a_list), tuple(b_list))
    if not modules:
        raise ValueError(f"export: slot {slot} holds no adapter")
    rank = max(m.rank for m in modules.values())
    return LoRAAdapter(id=int(adapter_id), name=name, rank=rank, modules=modules)


def _checkpoint_modules(model, adapter: LoRAAdapter) -> dict[str, tuple[np.ndarray, ...]]:
    """checkpoint module name → (A `[r, in]`, B `[out, r]`, PEFT's key suffixes)."""
    layers = trainable_layers(model)
    out = {}
    for lname, m in adapter.modules.items():
        layer = layers[lname]
        members = packed_names(lname, layer_packed_modules(lname, layer))
        if isinstance(layer, VocabParallelEmbeddingWithLoRA):  # A [r, V], B [D, r]
            out[members[0]] = (m.lora_a[0], m.lora_b[0], EMBEDDING_KEYS)
        elif len(members) == len(m.lora_a):
            for member, a, b in zip(members, m.lora_a, m.lora_b):
                if a is not None:
                    out[member] = (a, b, LINEAR_KEYS)
        elif len(members) == 1:  # one module over every slice: one A, B side by side
            present = [a for a in m.lora_a if a is not None]
            if len(present) != len(m.lora_a) or any(
                not np.array_equal(a, present[0]) for a in present
            ):
                raise ValueError(
                    f"export: {lname} is one checkpoint module ({members[0]}) but its "
                    "slices hold different A matrices: not one PEFT module"
                )
            out[members[0]] = (present[0], np.concatenate(m.lora_b, axis=0), LINEAR_KEYS)
        else:
            raise ValueError(f"export: {lname} has {len(m.lora_a)} slices but answers to {members}")
    return out


def _targets(model, mods: list[str], name_map) -> list[str] | str:
    """PEFT's `target_modules`: leaf names when the adapter covers every module of the
    model with those leaves, else a regex of exactly its modules (PEFT would put an empty
    LoRA on the others, and warn of missing keys)."""
    if name_map is None:
        _, _, every = _module_index(model)  # every module and packed member name
        leaves = sorted({m.rpartition(".")[2] for m in mods})
        if {m for m in every if m.rpartition(".")[2] in leaves} == set(mods):
            return leaves
    return "(" + "|".join(re.escape(m) for m in sorted(mods)) + ")"


def _mapped(modules: dict, name_map) -> dict:
    """The checkpoint's names through ``name_map``: strings, one module each."""
    out, source = {}, {}
    for mod, value in modules.items():
        new = name_map(mod)
        if not isinstance(new, str) or not new:
            raise ValueError(f"export: name_map({mod!r}) gave {new!r}; it must give a name")
        if new in out:
            raise ValueError(f"export: name_map gives {new!r} for both {source[new]!r} and {mod!r}")
        out[new], source[new] = value, mod
    return out


def save_peft_adapter(
    model,
    slot: int,
    directory: str | os.PathLike,
    *,
    name_map: Callable[[str], str] | None = None,
    base_model_name_or_path: str | None = None,
    dtype=np.float32,
) -> str:
    """Writes ``slot`` as a PEFT LoRA adapter directory; returns its path.

    ``name_map`` maps the model's module names to the checkpoint's (the inverse of the
    loader's ``name_map``); ``dtype`` is the tensors' dtype (f32, or `ml_dtypes.bfloat16`
    / `np.float16` to halve the file).

    Example:
        >>> save_peft_adapter(model, 1, "adapters/tuned")  # doctest: +SKIP
        'adapters/tuned'
    """
    try:
        dtype = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"export: dtype {dtype!r} is not a dtype") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"export: dtype must be a float dtype (f32, bf16, f16), got {dtype}")
    modules = _checkpoint_modules(model, adapter_from_slot(model, slot))
    if name_map is not None:
        modules = _mapped(modules, name_map)
    tensors, ranks = {}, {}
    for mod, (a, b, keys) in modules.items():
        for suffix, value in zip(keys, (a, b)):  # A [r, in], B [out, r]
            with np.errstate(over="ignore"):
                stored = np.asarray(value).astype(dtype)
            if not np.isfinite(stored.astype(np.float32)).all():
                raise ValueError(
                    f"export: {mod}{suffix} has values past {dtype.name}'s range; save it "
                    "in a wider dtype"
                )
            tensors[f"{PEFT_PREFIX}{mod}{suffix}"] = stored
        ranks[mod] = int(a.shape[0])
    r = max(ranks.values())
    pattern = {re.escape(mod): rk for mod, rk in ranks.items() if rk != r}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": r,  # B holds the scaling
        "rank_pattern": pattern,
        "alpha_pattern": dict(pattern),
        "target_modules": _targets(model, list(modules), name_map),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
    }
    os.makedirs(directory, exist_ok=True)
    write_safetensors(os.path.join(directory, WEIGHTS_NAME), tensors)
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=2)
    return os.fspath(directory)
