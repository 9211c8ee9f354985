"""Fold one slot's adapter into the base weights for zero-overhead single-tenant serving.

`merge_adapter(model, slot)` adds that slot's `B @ A` into the base weights of every LoRA
layer, as PEFT's `merge_adapter` does:

* linears: `kernel += (B @ A).T`, per packed slice; a DoRA slot's kernel then times its
  per-output-unit scale `g` (PEFT's DoRA merge: `g ⊙ (W + B @ A)`, the bias unscaled);
* fused MoE experts: `w13[e] += (B13 @ A13).T` per slice (gate / up placed as the base
  stores them: concatenated or interleaved per tensor shard) and `w2[e] += (B2 @ A2).T`;
* vocab embeddings: `table[v] += B @ A[:, v]` (A is a lookup table over token ids);
* lm_heads: `table += B @ A` (B in the head's row order);
* trainable tokens (PEFT `trainable_token_indices`): the slot's rows replace their ids'
  rows of the embedding table and of an untied lm_head's (a tied model's one table serves
  both, as PEFT ties them).

Each delta is computed per shard inside `shard_map` in the weight's own physical layout
(packed slices per tensor shard, kv-head replicas, S-LoRA rank / out shards gathered
first), so the weight keeps its sharding and no whole array is gathered. The original
weights are kept (`MergedKernel` variables on the layers) and `unmerge_adapter` puts them
back bit for bit. While merged, the model's `LoRAContext` is cleared so layers run the
base math only; do not set a LoRA mapping until `unmerge_adapter`.

Weights shared by several LoRA layers (tied embeddings / lm_head, tied kernels) cannot
take one layer's delta without changing the others: a slot with an adapter on such a
layer is refused, and with the slot empty those layers are left as they are.

The per-layer-kind plans live in `merge_plans`, the checks made before any weight changes
in `merge_checks`; this module holds the merged state, the jitted merge and the public API.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.layers import find_lora_context
from lora_jax.layers.logits import ParallelLMHeadWithLoRA
from lora_jax.layers.logits_processor import sharded_to_full_mapping
from lora_jax.serving.merge_checks import _check_not_traced as _check_not_traced
from lora_jax.serving.merge_checks import _slot_in_use as _slot_in_use
from lora_jax.serving.merge_checks import _slot_index as _slot_index
from lora_jax.serving.merge_checks import _tied_table as _tied_table
from lora_jax.serving.merge_plans import _TABLE_AXES as _TABLE_AXES
from lora_jax.serving.merge_plans import _add as _add
from lora_jax.serving.merge_plans import _embedding_plan as _embedding_plan
from lora_jax.serving.merge_plans import _linear_plan as _linear_plan
from lora_jax.serving.merge_plans import _lm_head_plan as _lm_head_plan
from lora_jax.serving.merge_plans import _moe_plan as _moe_plan
from lora_jax.serving.merge_plans import _pick as _pick
from lora_jax.serving.merge_plans import _plan as _plan
from lora_jax.serving.merge_plans import _rules_of as _rules_of
from lora_jax.serving.merge_plans import _unmergeable as _unmergeable
from lora_jax.serving.wrap import lora_layers, reference_paths, unwrap_model
from lora_jax.sharding import shard_map


class MergedKernel(nnx.Variable):
    """A base weight as it was before `merge_adapter` (restored by `unmerge_adapter`).

    Example:
        >>> layer.merged_original[0].get_value().shape  # while merged  # doctest: +SKIP
        (64, 128)
    """


class MergedSlot(nnx.Variable):
    """The slot a layer's base weights hold while merged (`i32[]`; a variable, not a
    Python attribute, so that merging another slot does not change the model's graph
    and recompile what is jitted over it)."""


def layer_merged_slot(layer) -> int | None:
    """The slot merged into one LoRA layer's base weights, or None.

    Example:
        >>> layer_merged_slot(lora_layers(model)["lm_head"])  # doctest: +SKIP
        2
    """
    if getattr(layer, "merged_original", None) is None:
        return None
    return int(np.asarray(layer.merged_slot.get_value()))


# model -> (its merged layers, weakly, and the jitted merge over them): merging another
# slot of the same layers reuses the compiled program (the slot is traced).
_MERGE_JITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _merge_jit(model: nnx.Module, layers: list, plans: list, rules: list) -> Callable:
    cached = _MERGE_JITS.get(model)
    if cached is not None:
        refs, run = cached
        if len(refs) == len(layers) and all(r() is la for r, la in zip(refs, layers)):
            return run
    fns: list[Callable] = []
    for (_, local, (w_specs, l_specs), _), r in zip(plans, rules):
        if r.mesh is None:
            fns.append(local)
        else:
            fns.append(shard_map(r, local, (*w_specs, *l_specs, ()), w_specs))
    run = jax.jit(lambda args, idx: [f(*w, *lo, idx) for f, (w, lo) in zip(fns, args)])
    _MERGE_JITS[model] = ([weakref.ref(la) for la in layers], run)
    return run


def _merged_weights(model, layers: list, plans: list, slot: int) -> list[tuple[jax.Array, ...]]:
    """Every layer's merged weights, from one jitted call."""
    run = _merge_jit(model, layers, plans, [_rules_of(la) for la in layers])
    args = [(tuple(w[...] for w in weights), lora) for weights, _, _, lora in plans]
    return run(args, jnp.int32(slot))


def _check_not_activated(model: nnx.Module, slot: int) -> None:
    """An activated LoRA (aLoRA) acts from its invocation on; merged, it would act on every
    token (PEFT refuses to merge one too)."""
    from lora_jax.serving.manager import managers_of  # it imports this module

    for manager in managers_of(model):
        adapter = manager.adapter_in_slot(slot)
        if adapter is not None and adapter.invocation_tokens is not None:
            raise ValueError(
                f"merge_adapter: slot {slot} holds adapter {adapter.id} ({adapter.name!r}), an "
                "activated LoRA (alora_invocation_tokens): merged, it would act on every "
                "token rather than from its invocation on (PEFT does not merge one either)"
            )


def _tokens_in_use(layer, slot: int) -> bool:
    """Whether `layer` holds trainable-token rows of its own in `slot`."""
    return hasattr(layer, "read_tokens") and layer.read_tokens(slot) is not None


def _check_token_rows(model: nnx.Module, slot: int) -> None:
    """A head whose rows are not in token order (its own `get_sharded_to_full_mapping`)
    cannot take a slot's trainable-token rows by id."""
    for name, layer in lora_layers(model).items():
        if (
            isinstance(layer, ParallelLMHeadWithLoRA)
            and _tokens_in_use(layer, slot)
            and sharded_to_full_mapping(layer.base_layer) is not None
        ):
            raise ValueError(
                f"merge_adapter: slot {slot} has trainable tokens in {name!r}, whose table "
                "rows are not in token order (get_sharded_to_full_mapping); serve the slot "
                "unmerged"
            )


def merge_adapter(model: nnx.Module, slot: int) -> int:
    """Adds slot `slot`'s `B @ A` into every LoRA layer's base weights; returns how many
    layers were merged.

    Linears, fused MoE experts, vocab embeddings and lm_heads are merged, DoRA scales and
    trainable-token rows included. Raises
    `ValueError` (changing nothing) if the model is already merged, `slot` is not an int
    (or a concrete integer scalar) in range,
    or a layer that cannot be merged holds an adapter in `slot`: a layer whose weight is
    shared with another LoRA layer (tied embeddings / lm_head, tied kernels), a plain
    `nnx.Embed` (its table may be a tied lm_head that no LoRA layer sees), or one of an
    unknown kind. Such layers with the slot empty are left as they are.

    Example:
        >>> mgr.activate_adapter(7)  # doctest: +SKIP
        >>> merge_adapter(model, mgr.slot_of(7))  # doctest: +SKIP
        >>> logits = model(ids, positions)  # base matmuls only  # doctest: +SKIP
        >>> unmerge_adapter(model)  # doctest: +SKIP
    """
    all_layers = lora_layers(model)
    if not all_layers:
        raise ValueError("merge_adapter: the model has no LoRA layers")
    _check_not_traced(all_layers, "merge_adapter")
    slot = _slot_index(slot)
    plans = {}
    for name, layer in all_layers.items():
        L = layer.lora_config.max_loras
        if not 0 <= slot < L:
            raise ValueError(f"merge_adapter: slot {slot} outside [0, {L})")
        if getattr(layer, "merged_original", None) is not None:
            raise ValueError(f"merge_adapter: layer {name!r} is already merged; unmerge first")
        plan = _plan(layer)
        if plan is not None:
            plans[name] = plan
        elif _slot_in_use(layer, slot):
            why = _unmergeable(layer)
            raise ValueError(
                f"merge_adapter: layer {name!r} ({type(layer).__name__}) holds an adapter in "
                f"slot {slot} and cannot be merged" + (f": {why}" if why else "")
            )
    _check_not_activated(model, slot)
    _check_token_rows(model, slot)
    # Layers that share a weight variable (tied weights): a delta merged into it would
    # reach every one of them, so such a slot is refused; with the slot empty they are
    # left as they are.
    groups: dict[int, list[str]] = {}
    for name, (weights, *_) in plans.items():
        for w in weights:
            groups.setdefault(id(w), []).append(name)
    # ... and so would one read outside its LoRA layers too (an nnx.Linear's kernel
    # that another, unwrapped module also holds; the table of a tied lm_head)
    refs = reference_paths(model)
    outside = {tied} if (tied := _tied_table(model)) is not None else set()
    # a tied embedding marked at wrapping: its lm_head may be outside the module given
    # (merge_adapter(model.model), or a wrapper holding the model)
    for name, plan in plans.items():
        if getattr(all_layers[name], "tied_table", False):
            outside.update(id(w) for w in plan[0])
    for key, names in groups.items():
        homes = [lp for n in names for lp in refs.get(id(all_layers[n]), [])]
        if any(not any(p[: len(h)] == h for h in homes) for p in refs.get(key, [])):
            outside.add(key)
    for key, names in groups.items():
        if len(names) < 2 and key not in outside:
            continue
        in_use = [n for n in names if _slot_in_use(all_layers[n], slot)]
        if in_use:
            with_ = "modules outside the LoRA layers" if len(names) < 2 else "each other"
            raise ValueError(
                f"merge_adapter: layers {names} share one weight with {with_} and {in_use} "
                f"hold an adapter in slot {slot}: merging it would change every user of "
                "that weight"
            )
        # trainable-token rows in a shared table (a tied model's embedding) are every
        # user's, as PEFT ties them: the layer that holds them merges them, once
        for n in names:
            if not _tokens_in_use(all_layers[n], slot):
                plans.pop(n, None)
    layers = [all_layers[n] for n in plans]
    new = _merged_weights(model, layers, list(plans.values()), slot)
    for layer, (weights, *_), values in zip(layers, plans.values(), new):
        layer.merged_original = nnx.List([MergedKernel(w.get_value()) for w in weights])
        layer.merged_slot = MergedSlot(np.int32(slot))
        for w, v in zip(weights, values):
            w.set_value(v)
    ctx = find_lora_context(model)
    if ctx is not None:
        ctx.set_value(None)
    return len(layers)


def unmerge_adapter(model: nnx.Module) -> bool:
    """Restores the weights saved by `merge_adapter` exactly; False if nothing was merged.

    Example:
        >>> unmerge_adapter(model)  # doctest: +SKIP
        True
    """
    all_layers = lora_layers(model)
    _check_not_traced(all_layers, "unmerge_adapter")
    done = False
    for layer in all_layers.values():
        original = getattr(layer, "merged_original", None)
        if original is None:
            continue
        for w, saved in zip(_plan(layer)[0], original):
            w.set_value(saved.get_value())
        del layer.merged_original
        del layer.merged_slot
        done = True
    return done


def merged_slot(model: nnx.Module) -> int | None:
    """The slot currently merged into `model`'s weights, or None.

    Example:
        >>> merge_adapter(model, 2)  # doctest: +SKIP
        >>> merged_slot(model)  # doctest: +SKIP
        2
    """
    for layer in lora_layers(model).values():
        slot = layer_merged_slot(layer)
        if slot is not None:
            return slot
    return None


def merge_and_unload(model: nnx.Module, slot: int) -> int:
    """PEFT's `merge_and_unload`: merges slot `slot` into the base weights for good and
    removes every LoRA layer (`unwrap_model(keep_merged=True)`); returns how many layers
    were merged. The model is then a plain model computing base + that adapter.

    Example:
        >>> merge_and_unload(model, mgr.slot_of(7))  # doctest: +SKIP
        7
    """
    n = merge_adapter(model, slot)
    unwrap_model(model, keep_merged=True)
    return n
