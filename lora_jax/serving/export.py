"""A device slot → a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`).

The inverse of loading: `adapter_from_slot` (`lora_jax.serving.export_slot`, importable
from here) reads the slot back to the host, cut to its true rank per slice, and this
module lays it out as the checkpoint's modules (a packed
`qkv_proj` → `q_proj` / `k_proj` / `v_proj`, kv-head replicas and per-shard packing
undone; the token embedding as `lora_embedding_A` / `lora_embedding_B`, the lm_head's
rows back in token order). B holds the scaling, so each module is written with
`lora_alpha` equal to its rank (scaling 1) and per-module ranks go to `rank_pattern` /
`alpha_pattern`. A DoRA slot (PEFT `use_dora`) is written with each module's
`lora_magnitude_vector`: `g · ||W + B @ A||` per output unit, its scale `g` times the norm
of its merged weight (`lora_jax.layers.dora.slot_magnitudes`).
PEFT (`PeftModel.from_pretrained`), vLLM and `load_peft_adapter` load the result; a slot
trained with `lora_jax.serving.training` leaves the library this way.

Fused MoE experts are written as PEFT writes LoRA on transformers 5's fused expert
weights (`target_parameters` `<experts>.gate_up_proj` / `<experts>.down_proj`), or with
`expert_layout="per_expert"` as it writes them on transformers 4, one module per expert
(`lora_jax.serving.export_experts`).
A slot with LoRA in a layer of another kind (a user-registered class) is refused by name
rather than written without it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from lora_jax.config import float_dtype
from lora_jax.layers.embedding import VocabParallelEmbeddingWithLoRA
from lora_jax.layers.moe import FusedMoEWithLoRA
from lora_jax.serving.export_experts import (
    check_expert_layout,
    expert_members,
    expert_pattern_keys,
    moe_blocks,
    per_expert_every,
    per_expert_pairs,
    target_alternatives,
    transformers4_name,
)
from lora_jax.serving.export_slot import adapter_from_slot as adapter_from_slot
from lora_jax.serving.peft import (
    CONFIG_NAME,
    PEFT_PREFIX,
    WEIGHTS_NAME,
    LoRAAdapter,
    write_safetensors,
)
from lora_jax.serving.peft_experts import expert_tensors
from lora_jax.serving.peft_keys import model_type_of, module_index
from lora_jax.serving.peft_tokens import TOKEN_SUFFIX
from lora_jax.serving.training import trainable_layers
from lora_jax.serving.wrap import layer_packed_modules, packed_names

# PEFT's tensor keys after the module name: `lora_A.weight` / `lora_B.weight` for linear
# layers and the lm_head; an embedding's factors are bare parameters.
LINEAR_KEYS = (".lora_A.weight", ".lora_B.weight")
EMBEDDING_KEYS = (".lora_embedding_A", ".lora_embedding_B")
MAGNITUDE_KEY = ".lora_magnitude_vector"  # DoRA's, as PEFT writes it


class _Pair(NamedTuple):
    """One LoRA of the checkpoint: PEFT's tensors `<module><keys[0]>`, `<module><keys[1]>`."""

    module: str  # the checkpoint module its keys start with
    a: np.ndarray  # [r, in]
    b: np.ndarray  # [out, r]
    keys: tuple[str, str]
    param: str | None = None  # target_parameters: the LoRA is on `<module>.<param>`
    experts: int = 1  # a ParamWrapper over E experts: A `[r*E, in]`, B `[out, r*E]`
    magnitude: np.ndarray | None = None  # DoRA: `<module>.lora_magnitude_vector` `[out]`

    @property
    def rank(self) -> int:
        return self.a.shape[0] // self.experts

    @property
    def name(self) -> str:
        """What `target_modules` / `target_parameters` and the rank pattern name."""
        return self.module if self.param is None else f"{self.module}.{self.param}"


def _checkpoint_modules(model, adapter: LoRAAdapter, expert_layout: str) -> list[_Pair]:
    layers = trainable_layers(model)
    members_of_expert = expert_members(model_type_of(model))
    out = []
    for lname, m in adapter.modules.items():
        layer = layers[lname]
        members = packed_names(lname, layer_packed_modules(lname, layer))
        if isinstance(layer, VocabParallelEmbeddingWithLoRA):  # A [r, V], B [D, r]
            mag = None if m.magnitude is None else m.magnitude[0]
            out.append(_Pair(members[0], m.lora_a[0], m.lora_b[0], EMBEDDING_KEYS, magnitude=mag))
        elif isinstance(layer, FusedMoEWithLoRA) and expert_layout == "per_expert":
            for sub, (a, b) in per_expert_pairs(layer, m, members_of_expert).items():
                out.append(_Pair(f"{lname}.{sub}", a, b, LINEAR_KEYS))
        elif isinstance(layer, FusedMoEWithLoRA):  # PEFT's ParamWrapper on fused experts
            tensors = expert_tensors(layer, m)
            for param, (a, b) in tensors.items():
                # PEFT nests the wrapper of gate_up_proj under that of down_proj
                nested = param == "gate_up_proj" and "down_proj" in tensors
                keys = tuple(".base_layer" * nested + k for k in LINEAR_KEYS)
                out.append(_Pair(lname, a, b, keys, param, layer.base_layer.num_experts))
        elif len(members) == len(m.lora_a):
            mags = m.magnitude or (None,) * len(members)
            for member, a, b, mag in zip(members, m.lora_a, m.lora_b, mags):
                if a is not None:
                    out.append(_Pair(member, a, b, LINEAR_KEYS, magnitude=mag))
        elif len(members) == 1:  # one module over every slice: one A, B side by side
            present = [a for a in m.lora_a if a is not None]
            if len(present) != len(m.lora_a) or any(
                not np.array_equal(a, present[0]) for a in present
            ):
                raise ValueError(
                    f"export: {lname} is one checkpoint module ({members[0]}) but its "
                    "slices hold different A matrices: not one PEFT module"
                )
            b = np.concatenate(m.lora_b, axis=0)
            mag = None if m.magnitude is None else np.concatenate(m.magnitude)
            out.append(_Pair(members[0], present[0], b, LINEAR_KEYS, magnitude=mag))
        else:
            raise ValueError(f"export: {lname} has {len(m.lora_a)} slices but answers to {members}")
    return out


def _targets(model, mods: list[str], name_map, expert_layout: str) -> list[str] | str:
    """PEFT's `target_modules`: leaf names when the adapter covers every module of the
    model with those leaves, else a regex of exactly its modules (PEFT would put an empty
    LoRA on the others, and warn of missing keys)."""
    every = None
    if name_map is None:
        index, layers, every = module_index(model)  # every module and packed member name
        if expert_layout == "per_expert":  # the transformers 4 model's modules
            every = per_expert_every(model, every, index, layers, model_type_of(model))
        leaves = sorted({m.rpartition(".")[2] for m in mods})
        if {m for m in every if m.rpartition(".")[2] in leaves} == set(mods):
            return leaves
    return "(" + "|".join(target_alternatives(mods, every)) + ")"


def _mapped(pairs: list[_Pair], name_map) -> list[_Pair]:
    """The checkpoint's module names through ``name_map``: strings, one LoRA each."""
    out, source = [], {}
    for pair in pairs:
        new = pair._replace(module=name_map(pair.module))
        if not isinstance(new.module, str) or not new.module:
            raise ValueError(
                f"export: name_map({pair.module!r}) gave {new.module!r}; it must give a name"
            )
        if new.name in source:
            raise ValueError(
                f"export: name_map gives {new.name!r} for both {source[new.name]!r} and "
                f"{pair.name!r}"
            )
        source[new.name] = pair.name
        out.append(new)
    return out


def _finite_in(value, dtype, what: str) -> np.ndarray:
    """`value` cast to `dtype`, or a ValueError if a value falls past its range."""
    with np.errstate(over="ignore"):
        stored = np.asarray(value).astype(dtype)
    if not np.isfinite(stored.astype(np.float32)).all():
        raise ValueError(
            f"export: {what} has values past {dtype.name}'s range; save it in a wider dtype"
        )
    return stored


def save_peft_adapter(
    model,
    slot: int,
    directory: str | os.PathLike,
    *,
    name_map: Callable[[str], str] | None = None,
    base_model_name_or_path: str | None = None,
    dtype=np.float32,
    task_type: str | None = "auto",
    expert_layout: str = "fused",
) -> str:
    """Writes ``slot`` as a PEFT LoRA adapter directory; returns its path.

    ``name_map`` maps the model's module names to the checkpoint's (the inverse of the
    loader's ``name_map``); ``dtype`` is the tensors' dtype (f32, or `ml_dtypes.bfloat16`
    / `np.float16` to halve the file). ``task_type`` is PEFT's: "auto" writes
    "CAUSAL_LM" for a `lora_jax.models` decoder and None (a plain `PeftModel`, what PEFT
    makes of a custom torch model) for any other model. ``expert_layout`` is how MoE
    experts are written: "fused" (`target_parameters` on transformers 5's fused weights)
    or "per_expert" (transformers 4: one LoRA per expert and projection, in
    `target_modules`, e.g. Mixtral `block_sparse_moe.experts.{j}.w1`; see
    `lora_jax.serving.export_experts`; a ``name_map`` is given `<experts>.{j}.<member>`).

    Example:
        >>> save_peft_adapter(model, 1, "adapters/tuned")  # doctest: +SKIP
        'adapters/tuned'
    """
    dtype = float_dtype(dtype, "export: dtype")
    if task_type == "auto":
        task_type = "CAUSAL_LM" if model_type_of(model) is not None else None
    elif task_type is not None and not isinstance(task_type, str):
        raise ValueError(f"export: task_type must be a string, None or 'auto', got {task_type!r}")
    check_expert_layout(expert_layout)
    adapter = adapter_from_slot(model, slot)
    pairs = _checkpoint_modules(model, adapter, expert_layout)
    if name_map is not None:
        pairs = _mapped(pairs, name_map)
    elif expert_layout == "per_expert":
        rename = transformers4_name(model_type_of(model), moe_blocks(model))
        pairs = [p._replace(module=rename(p.module)) for p in pairs]
    tensors = {}
    for pair in pairs:
        for suffix, value in zip(pair.keys, (pair.a, pair.b)):  # A [r, in], B [out, r]
            stored = _finite_in(value, dtype, f"{pair.module}{suffix}")
            tensors[f"{PEFT_PREFIX}{pair.module}{suffix}"] = stored
        if pair.magnitude is not None:
            key = f"{pair.module}{MAGNITUDE_KEY}"
            tensors[PEFT_PREFIX + key] = _finite_in(pair.magnitude, dtype, key)
    r = max(pair.rank for pair in pairs)
    # PEFT on transformers 5 wraps a module that is no nn.Linear (an MoE router) through
    # its weight and looks its rank up as `<module>.weight`: a key matches either way
    grouped = expert_pattern_keys({p.name: p.rank for p in pairs if p.param is None})
    pattern = {}
    for p in (p for p in pairs if p.rank != r):
        own = re.escape(p.name) + (r"(\.weight)?" if p.param is None else "")
        pattern[grouped.get(p.name, own)] = p.rank
    modules = [p.name for p in pairs if p.param is None]
    params = sorted(p.name for p in pairs if p.param is not None)
    config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": r,  # B holds the scaling
        "rank_pattern": pattern,
        "alpha_pattern": dict(pattern),
        "target_modules": _targets(model, modules, name_map, expert_layout) if modules else None,
        "target_parameters": params or None,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": any(p.magnitude is not None for p in pairs),
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
    }
    if adapter.invocation_tokens is not None:  # an activated LoRA's slot stays one
        config["alora_invocation_tokens"] = list(adapter.invocation_tokens)
    if adapter.trainable_tokens:  # PEFT's trainable tokens: rows of the named tables
        config["trainable_token_indices"] = {}
        for t in adapter.trainable_tokens.values():
            module = name_map(t.module_name) if name_map is not None else t.module_name
            config["trainable_token_indices"][module] = list(t.token_ids)
            stored = _finite_in(t.rows, dtype, f"{module}{TOKEN_SUFFIX}")
            tensors[f"{PEFT_PREFIX}{module}{TOKEN_SUFFIX}"] = stored
    os.makedirs(directory, exist_ok=True)
    write_safetensors(os.path.join(directory, WEIGHTS_NAME), tensors)
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=2)
    return os.fspath(directory)
