"""PEFT checkpoint names → the wrapped model's LoRA layers: parsing tensor keys, the
index of the model's modules and packed members, and the checks the loader
(`lora_jax.serving.peft`) makes on names, tables and shapes before it keeps anything."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

from lora_jax.layers import (
    LogitsProcessorWithLoRA,
    ParallelLMHeadWithLoRA,
    VocabParallelEmbeddingWithLoRA,
)
from lora_jax.serving.peft_config import ALL_LINEAR, PEFTConfig, matches_targets
from lora_jax.serving.wrap import layer_packed_modules, lora_layers, module_name, packed_names

PEFT_PREFIX = "base_model.model."
# PEFT key suffix → which factor it is. lm_head LoRA uses plain lora_A / lora_B.
KEY_KINDS: dict[str, str] = {
    ".lora_A.weight": "a",
    ".lora_B.weight": "b",
    ".lora_embedding_A": "a",
    ".lora_embedding_B": "b",
    ".lora_magnitude_vector": "m",  # DoRA (older PEFT: `.lora_magnitude_vector.weight`)
    ".lora_magnitude_vector.weight": "m",
}
# PEFT's `save_embedding_layers` also stores the base embedding / lm_head tables; like
# vLLM (`is_base_embedding_weights`) they are not served, and must equal the model's
# (`check_base_table`).
BASE_EMBEDDING_SUFFIXES = (".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")
# Buffers PEFT saves that only training reads: VeLoRA's projection compresses the
# activations stored for the backward pass; its forward is plain LoRA, so they are skipped.
TRAINING_ONLY_SUFFIXES = (".lora_velora_embed",)
# LoRA layers that PEFT's `all-linear` never targets: embeddings, and the output layer
NOT_ALL_LINEAR = (VocabParallelEmbeddingWithLoRA, ParallelLMHeadWithLoRA, LogitsProcessorWithLoRA)


def parse_key(key: str, file: str, name_map) -> tuple[str, str, str]:
    """(the model's module name, the checkpoint's module name, "a" | "b") of a tensor key.
    PEFT's rank / alpha patterns name the checkpoint's modules, so they match the latter."""
    for suffix, kind in KEY_KINDS.items():
        if key.endswith(suffix):
            name = key[: -len(suffix)]
            name = name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name
            return (name_map(name) if name_map else name), name, kind
    allowed = ", ".join(f"*{s}" for s in KEY_KINDS)
    raise ValueError(f"{file}: tensor {key!r} is not a LoRA weight; allowed keys: {allowed}")


def module_index(model) -> tuple[dict[str, tuple[str, int, int]], dict[str, Any], set[str]]:
    """checkpoint module name → (LoRA layer name, member index, member count)."""
    layers = lora_layers(model)
    index = {}
    for name, layer in layers.items():
        members = packed_names(name, layer_packed_modules(name, layer))
        for i, full in enumerate(members):
            index[full] = (name, i, len(members))
    all_names = set(index)
    for path, node in nnx.iter_graph(model):
        if path and isinstance(node, nnx.Module):
            all_names.add(module_name(path))
    return index, layers, all_names


def model_type_of(model) -> str | None:
    """The `config.json` model type of a lora_jax model (an MoE model's `config` holds its
    attention family, its `moe_config` the type); None for another model."""
    for attr in ("moe_config", "config"):
        model_type = getattr(getattr(model, attr, None), "model_type", None)
        if isinstance(model_type, str):
            return model_type
    return None


def tied_embedding(cfg: PEFTConfig, layer, layers: Mapping[str, Any], names) -> str | None:
    """The checkpoint name of the embedding whose LoRA factors PEFT shares with this lm_head
    (`ensure_weight_tying` on a tied model, an embedding targeted), else None."""
    if not (cfg.ensure_weight_tying and getattr(layer, "tied", False) and cfg.targets_embedding()):
        return None
    emb = next((n for n, x in layers.items() if x is layer.base_layer), "model.embed_tokens")
    return names.get(emb, emb)


def check_targets(cfg: PEFTConfig, all_names: set[str]) -> None:
    """As PEFT: an error only when `target_modules` matches no module of the model (a list
    may name modules of other architectures too, e.g. `["q_proj", "c_attn"]`)."""
    t = cfg.target_modules
    if t is None or t == ALL_LINEAR or cfg.target_parameters:
        return
    if isinstance(t, str):
        if not any(re.fullmatch(t, n) for n in all_names):
            raise ValueError(f"{cfg.source}: target_modules regex {t!r} matches no model module")
        return
    if not any(matches_targets(t, n) for n in all_names):
        leaves = sorted({n.rpartition(".")[2] for n in all_names if not n[-1:].isdigit()})
        raise ValueError(
            f"{cfg.source}: target_modules {list(t)} match no module of the model; "
            f"its modules: {leaves}"
        )


def check_base_table(key: str, value, mod: str, layers: Mapping[str, Any], source: str) -> None:
    """PEFT's `save_embedding_layers` stores the base embedding / lm_head table, and PEFT
    loads it into the model: an adapter trained with changed or new token rows needs its
    own table. One table serves every adapter here, so a saved table must be the model's
    (compared in the narrower of the two dtypes); else the adapter is refused."""
    layer = layers.get(mod)
    base = getattr(layer, "base_layer", None)
    table_mod = getattr(base, "base_layer", base)  # a tied head over the embedding LoRA
    table_var = getattr(table_mod, "embedding", None)
    if table_var is None:
        return  # not a table of a LoRA layer: nothing of it is served
    model_table = np.asarray(table_var[...])[: table_mod.num_embeddings]  # [V, D]
    saved = np.asarray(value)
    narrow = min((saved.dtype, model_table.dtype), key=lambda d: np.dtype(d).itemsize)
    same = saved.shape == model_table.shape and np.array_equal(
        saved.astype(narrow), model_table.astype(narrow)
    )
    if not same:
        rows = ""
        if saved.shape == model_table.shape:
            diff = np.flatnonzero((saved.astype(narrow) != model_table.astype(narrow)).any(1))
            rows = f"; rows (token ids) {diff[:8].tolist()}{'...' if diff.size > 8 else ''} differ"
        raise ValueError(
            f"{source}: tensor {key!r} {list(saved.shape)} is the adapter's own copy of the "
            f"base table of {mod!r}, and it is not the model's {list(model_table.shape)}{rows}: "
            "the adapter was trained with changed token embeddings, which lora_jax cannot "
            "serve beside other adapters (one base table serves them all)"
        )


def check_member_shape(layer, i, n, a, b, ka, kb, source) -> None:
    """Per-member in/out sizes for the linear LoRA layers (others check at prepare)."""
    base = getattr(layer, "base_layer", None)
    sizes = getattr(layer, "logical_slice_sizes", None)
    if base is None or sizes is None or not hasattr(base, "in_features"):
        return
    if n == len(sizes):
        out = sizes[i]
    elif n == 1:
        out = sum(sizes)
    else:
        return
    if a.shape[1] != base.in_features or b.shape[0] != out:
        raise ValueError(
            f"{source}: tensors {ka!r} {list(a.shape)} / {kb!r} {list(b.shape)} do not fit "
            f"module {layer.name!r}: expected [r, {base.in_features}] / [{out}, r]"
        )
