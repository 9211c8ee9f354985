"""LoRA-ize a Flax NNX model in place: every target base linear → its vLLM LoRA class.

`wrap_model` walks the NNX graph, and for each module whose path is targeted asks the
registered LoRA classes (`LORA_LAYER_CLASSES`, tried in order) which one
`can_replace_layer(source_layer, lora_config, packed_modules_list)`; the first that
accepts wraps the module, and the wrapper replaces it at the same attribute or list
index. All wrappers share one `LoRAContext`, so the model's call signature does not
change: the step's token→slot mapping reaches every layer through that variable.

Module names are the dotted NNX paths (`model.layers.0.self_attn.qkv_proj`), which
match HF/PEFT names once the packed modules are expanded through the packed mapping
(`qkv_proj` → `q_proj`, `k_proj`, `v_proj`). A packed module is targeted when any of
its packed names is. New layer kinds (lm_head, embeddings, MoE) join by appending to
`LORA_LAYER_CLASSES` (or `register_lora_layer`).

This module holds the entry points (`wrap_model`, `unwrap_model`, `lora_layers`); beside
it are the registry of LoRA classes (`wrap_registry`), module names and targets
(`wrap_names`), the graph walk and edits (`wrap_graph`) and the candidates a model offers
(`wrap_candidates`). Their names are importable from here too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from lora_jax.config import LoRAConfig
from lora_jax.layers import (
    LoRAContext,
    TiedLMHeadWithLoRA,
    VocabParallelEmbeddingWithLoRA,
    find_lora_context,
)
from lora_jax.serving.wrap_candidates import _candidates as _candidates
from lora_jax.serving.wrap_candidates import _head_too_wide as _head_too_wide
from lora_jax.serving.wrap_candidates import _tied_candidates as _tied_candidates
from lora_jax.serving.wrap_candidates import _why_not as _why_not
from lora_jax.serving.wrap_graph import _GRAPH_EDITS as _GRAPH_EDITS
from lora_jax.serving.wrap_graph import _get_child as _get_child
from lora_jax.serving.wrap_graph import _resolve as _resolve
from lora_jax.serving.wrap_graph import _set_child as _set_child
from lora_jax.serving.wrap_graph import graph_edits as graph_edits
from lora_jax.serving.wrap_graph import reference_paths as reference_paths
from lora_jax.serving.wrap_names import TargetModules as TargetModules
from lora_jax.serving.wrap_names import _check_packed_mapping as _check_packed_mapping
from lora_jax.serving.wrap_names import _matches as _matches
from lora_jax.serving.wrap_names import _normalize_targets as _normalize_targets
from lora_jax.serving.wrap_names import (
    default_packed_modules_mapping as default_packed_modules_mapping,
)
from lora_jax.serving.wrap_names import layer_packed_modules as layer_packed_modules
from lora_jax.serving.wrap_names import module_name as module_name
from lora_jax.serving.wrap_names import packed_names as packed_names
from lora_jax.serving.wrap_registry import LORA_LAYER_CLASSES as LORA_LAYER_CLASSES
from lora_jax.serving.wrap_registry import _pick_class as _pick_class
from lora_jax.serving.wrap_registry import is_lora_layer as is_lora_layer
from lora_jax.serving.wrap_registry import register_lora_layer as register_lora_layer


def wrap_model(
    model: nnx.Module,
    lora_config: LoRAConfig,
    *,
    target_modules: TargetModules = None,
    packed_modules_mapping: Mapping[str, Sequence[str]] | None = None,
    context: LoRAContext | None = None,
) -> LoRAContext:
    """Replaces every targeted base linear of `model` by its LoRA class, in place.

    Args:
      model: an NNX module built from `lora_jax.linear` layers, or from plain
        `flax.nnx.Linear` / `flax.nnx.Embed` / `flax.nnx.LinearGeneral` / `flax.nnx.Einsum`
        layers (wrapped as `FlaxLinearWithLoRA` / `FlaxEmbedWithLoRA` /
        `FlaxLinearGeneralWithLoRA` / `FlaxEinsumWithLoRA`), or both.
      lora_config: slot count, max rank, `fully_sharded_loras` (picks the S-LoRA classes).
      target_modules: PEFT-style list of names (a module matches when its dotted path
        equals a name or ends with `.name`), a regex string (`re.fullmatch` on the path),
        or `None` for every supported module. Packed modules match through their
        packed names.
      packed_modules_mapping: packed module → checkpoint names, e.g.
        `{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}`; defaults to
        `lora_jax.models.PACKED_MODULES_MAPPING`.
      context: the `LoRAContext` to share; defaults to the model's existing one or a new one
        (a model that already has LoRA layers takes only its own: one step has one mapping).

    Returns the shared `LoRAContext`. Raises `ValueError` when a target name matches no
    module of the model (nothing is changed then).

    Example:
        >>> ctx = wrap_model(model, LoRAConfig(max_loras=4, max_lora_rank=8))  # doctest: +SKIP
        >>> set_lora_mapping(model, jnp.array([0, -1, 3], jnp.int32))  # doctest: +SKIP
    """
    if not isinstance(lora_config, LoRAConfig):
        raise ValueError(f"wrap_model: lora_config must be a LoRAConfig, got {type(lora_config)}")
    mapping = (
        default_packed_modules_mapping()
        if packed_modules_mapping is None
        else _check_packed_mapping(packed_modules_mapping)
    )
    targets = _normalize_targets(target_modules)
    # the walk below skips the root: nothing holds it, so nothing could take its wrapper
    if any(_pick_class(model, lora_config, ["x"] * n) is not None for n in range(4)):
        raise ValueError(
            f"wrap_model: the model is itself a {type(model).__name__} layer, which cannot be "
            "replaced in place by its LoRA layer; wrap a model (an nnx.Module) that holds it "
            "as an attribute"
        )
    candidates = _candidates(model, lora_config, mapping)
    # last: embed_tokens is wrapped before a tied lm_head takes the shared table
    candidates += _tied_candidates(model, candidates)
    all_names = [n for c in candidates for n in [c[4], *packed_names(c[4], c[2])]]
    all_names += _wrapped_names(model)
    if isinstance(targets, tuple):
        missing = [t for t in targets if not _matches((t,), all_names)]
        if missing:
            leaves = sorted({n.rpartition(".")[2] for n in all_names})
            raise ValueError(
                f"wrap_model: target_modules {missing} match no supported module of the model; "
                f"supported module names: {leaves}{_why_not(model, missing)}"
            )
    elif isinstance(targets, str):
        if not _matches(targets, all_names):
            raise ValueError(
                f"wrap_model: target_modules regex {targets!r} matches no supported module; "
                f"e.g. {[c[4] for c in candidates[:4]]}"
            )

    def key(c: LoRAConfig):
        dtype = None if c.lora_dtype is None else np.dtype(c.lora_dtype).name
        return (c.max_loras, c.max_lora_rank, c.fully_sharded_loras, dtype)

    other = {key(la.lora_config) for la in lora_layers(model).values()} - {key(lora_config)}
    if other:
        raise ValueError(
            f"wrap_model: the model's LoRA layers were built with (max_loras, max_lora_rank, "
            f"fully_sharded_loras, lora_dtype) = {sorted(other, key=str)[0]}, not "
            f"{key(lora_config)}: one step has one mapping over one set of slots; "
            "unwrap_model first to change them"
        )
    existing = find_lora_context(model)
    if context is None:
        context = LoRAContext(None) if existing is None else existing
    elif existing is not None and context is not existing:
        raise ValueError(
            "wrap_model: context= is another LoRAContext than the one the model's LoRA layers "
            "already share; a second one would leave the model with two mappings (one step "
            "has one). Pass the model's own (lj.find_lora_context(model)) or leave context out"
        )
    chosen = [c for c in candidates if _matches(targets, [c[4], *packed_names(c[4], c[2])])]
    if targets is None:  # "every supported module": an lm_head past the LoRA vocab limit is not
        chosen = [c for c in chosen if not _head_too_wide(c)]
    refs = reference_paths(model)
    # a LoRA wrapper holding the module (a tied lm_head over the embedding) is by design
    wrapped_at = {p for la in lora_layers(model).values() for p in refs.get(id(la), [])}
    for _path, node, _, cls, name in chosen:
        places = [
            p for p in refs.get(id(node), []) if not any(p[:k] in wrapped_at for k in range(len(p)))
        ]
        if len(places) > 1 and not getattr(cls, "tied", False):
            raise ValueError(
                f"wrap_model: {name!r} is one module reached from {len(places)} places "
                f"{sorted(module_name(p) for p in places)}; its LoRA layer would replace it "
                "at one of them only. Give each place its own module, or leave it out of "
                "target_modules"
            )
    # Every wrapper is built (and may refuse) before the first one is swapped in.
    swaps = []
    for path, node, packed, cls, name in chosen:
        parent = _resolve(model, path[:-1])
        if isinstance(parent, tuple):
            raise ValueError(
                f"wrap_model: {name!r} sits in a tuple, which cannot take its LoRA layer; hold "
                "the layers in an nnx.List (or a list / dict)"
            )
        layer = cls(node, lora_config, context, name=name)
        layer.packed_modules = tuple(packed)
        # A tied model's `lm_head = None` is a static attribute: mark the new module as data.
        value = nnx.data(layer) if getattr(cls, "tied", False) else layer
        swaps.append((parent, path[-1], value))
    for parent, key, value in swaps:
        _set_child(parent, key, value)
    _mark_tied_embedding(model)
    return context


def _wrapped_names(model: nnx.Module) -> list[str]:
    """Names (and packed member names) of the model's existing LoRA layers."""
    return [
        n
        for name, layer in lora_layers(model).items()
        for n in [name, *packed_names(name, layer_packed_modules(name, layer))]
    ]


def _mark_tied_embedding(model: nnx.Module) -> None:
    """Marks the embedding LoRA layer of a tied model (`lm_head` None, or a tied head over
    `model.model.embed_tokens`): its table is the lm_head too, which a merge given only a
    part of the model (or a wrapper of it) could not see."""
    head = getattr(model, "lm_head", True)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if (head is None or isinstance(head, TiedLMHeadWithLoRA)) and isinstance(
        emb, VocabParallelEmbeddingWithLoRA
    ):
        emb.tied_table = True
        if isinstance(head, TiedLMHeadWithLoRA) and emb.token_ids is not None:
            # PEFT ties the lm_head's trainable tokens to the embedding's: the head reads
            # the embedding's token rows (the same variables, as it reads the same table)
            head.logits_processor.token_ids = emb.token_ids
            head.logits_processor.token_rows = emb.token_rows


def unwrap_model(model: nnx.Module, *, keep_merged: bool = False) -> int:
    """Puts every LoRA layer's base layer back in its place; returns how many were removed.

    A model with a merged adapter (`merge_adapter`) is refused unless `keep_merged=True`,
    which keeps that adapter in the base weights for good (PEFT's `merge_and_unload`;
    see `lora_jax.serving.merge.merge_and_unload`): unwrapping drops the saved originals.

    Example:
        >>> from lora_jax.models import DecoderConfig, DecoderForCausalLM
        >>> model = DecoderForCausalLM(DecoderConfig.tiny(), rngs=nnx.Rngs(0))  # 2 layers
        >>> _ = wrap_model(model, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> unwrap_model(model)  # 4 projections a layer, embed_tokens, lm_head
        10
    """
    found = [(tuple(p), n) for p, n in nnx.iter_graph(model) if p and is_lora_layer(n)]
    merged = [module_name(p) for p, n in found if getattr(n, "merged_original", None) is not None]
    if merged and not keep_merged:
        raise ValueError(
            f"unwrap_model: layers {merged[:4]} hold a merged adapter (merge_adapter); "
            "unmerge_adapter first, or pass keep_merged=True to keep it in the base weights"
        )
    # Outermost first so a nested wrapper (never made by wrap_model) is not half-restored.
    found.sort(key=lambda pn: len(pn[0]))
    done = 0
    for path, layer in found:
        try:
            current = _resolve(model, path)
        except (AttributeError, IndexError, KeyError):
            continue
        if current is layer:
            original = None if getattr(layer, "tied", False) else layer.base_layer
            original = getattr(original, "source", original)  # FlaxLinear / FlaxEmbed's own
            _set_child(_resolve(model, path[:-1]), path[-1], original)
            done += 1
    return done


def lora_layers(model: nnx.Module) -> dict[str, Any]:
    """The model's LoRA layers by dotted module name, in graph order.

    Example:
        >>> from lora_jax.models import DecoderConfig, DecoderForCausalLM
        >>> model = DecoderForCausalLM(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
        >>> _ = wrap_model(model, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> list(lora_layers(model))[:3]
        ['lm_head', 'model.embed_tokens', 'model.layers.0.mlp.down_proj']
    """
    layers = {}
    for path, node in nnx.iter_graph(model):
        if path and is_lora_layer(node):
            layers[module_name(path)] = node
    return dict(sorted(layers.items(), key=lambda kv: _natural_key(kv[0])))


def _natural_key(name: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]
