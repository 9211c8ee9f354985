"""Training adapters in device slots, beside the ones being served.

The LoRA stacks are `nnx.LoRAParam`s and every op has a gradient on every backend (the
Pallas kernels' backward pass is the XLA backend's), so an adapter can be trained in a
slot of a wrapped model while the other slots keep serving:

1. `init_lora_slot` writes a fresh adapter into one slot of the linear LoRA layers, as
   PEFT initialises one: A kaiming-uniform (`U(±1/sqrt(in))`), B zero, so the model
   starts out as the base model for that slot's tokens;
2. `nnx.Optimizer(model, optax.chain(opt, train_only_slots([slot])), wrt=nnx.LoRAParam)`
   updates that slot only: the other slots' adapters, even under weight decay, and every
   rank column past the slot's rank stay as they were;
3. `lora_jax.serving.export.save_peft_adapter` writes the slot as a PEFT adapter
   directory that PEFT, vLLM and `load_peft_adapter` load.

The stacks hold B with the scaling folded in (`alpha / r` is 1 for a slot made here), so
the exported adapter says `lora_alpha = r`. A manager serving the same model does not know
of the slot: train in one it holds no adapter in (`manager.lora_index_to_id` shows None
there) and activate nothing else meanwhile, or it may write another adapter over it.
On a GPU the forward pass runs the kernels and the backward pass XLA's gather einsums
(the kernels have no autodiff); the backward's cost was not measured on the GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lora_jax.layers.base import BaseLayerWithLoRA
from lora_jax.layers.moe import FusedMoEWithLoRA
from lora_jax.serving.peft_config import matches_targets
from lora_jax.serving.wrap import layer_packed_modules, lora_layers, packed_names


def trainable_layers(model) -> dict[str, BaseLayerWithLoRA]:
    """The linear LoRA layers (every `BaseLayerWithLoRA` but fused MoE) by module name:
    the layers `init_lora_slot` initialises and `save_peft_adapter` exports."""
    return {
        name: layer
        for name, layer in lora_layers(model).items()
        if isinstance(layer, BaseLayerWithLoRA) and not isinstance(layer, FusedMoEWithLoRA)
    }


def init_lora_slot(
    model,
    slot: int,
    rank: int,
    *,
    seed: int = 0,
    target_modules: Sequence[str] | str | None = None,
) -> list[str]:
    """Writes a fresh PEFT-initialised adapter of ``rank`` into ``slot``; returns the
    checkpoint names of the modules it covers.

    Each targeted module (a packed layer's members each their own: `q_proj`, `k_proj`,
    ...) gets A `[rank, in]` drawn from `U(-1/sqrt(in), 1/sqrt(in))` (PEFT's
    `kaiming_uniform_(a=sqrt(5))`) and B `[out, rank]` zero. ``target_modules`` as in
    PEFT (leaf names or a full-match regex of checkpoint names); None: every linear LoRA
    layer (PEFT's "all-linear": no embedding, lm_head or MoE experts). The layers'
    `set_lora` checks everything first; a layer that refuses leaves no slot changed.

    Example:
        >>> init_lora_slot(model, 1, 8, target_modules=["v_proj"])  # doctest: +SKIP
        ['model.layers.0.self_attn.v_proj', 'model.layers.1.self_attn.v_proj']
    """
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or rank < 1:
        raise ValueError(f"init_lora_slot: rank must be a positive int, got {rank!r}")
    if isinstance(slot, bool) or not isinstance(slot, int | np.integer):
        raise ValueError(f"init_lora_slot: slot must be an int, got {slot!r}")
    if isinstance(target_modules, str):
        targets = target_modules
    elif target_modules is not None:
        targets = tuple(target_modules)
    else:
        targets = None
    _check_targets(model, targets)
    rng = np.random.default_rng(seed)
    plans, covered = [], []
    for name, layer in trainable_layers(model).items():
        members = packed_names(name, layer_packed_modules(name, layer))
        if len(members) not in (1, layer.n_slices):
            raise ValueError(
                f"init_lora_slot: {name} has {layer.n_slices} slices but answers to "
                f"{len(members)} checkpoint modules {members}"
            )
        chosen = [targets is None or matches_targets(targets, m) for m in members]
        if not any(chosen):
            continue
        fan_in = layer.base_layer.in_features
        bound = 1.0 / np.sqrt(fan_in)
        a = rng.uniform(-bound, bound, (len(members), rank, fan_in)).astype(np.float32)
        b = [np.zeros((out, rank), np.float32) for out in layer.logical_slice_sizes]
        if len(members) == 1:  # one module over every slice: one A, B cut per slice
            a_list, b_list = [a[0]] * layer.n_slices, b
        else:  # a module per slice, each its own A [r, in] and B [out_s, r]
            a_list = [a_s if keep else None for a_s, keep in zip(a, chosen)]
            b_list = [b_s if keep else None for b_s, keep in zip(b, chosen)]
        plans.append((layer, layer.prepare_lora(slot, a_list, b_list)))
        covered += [m for m, keep in zip(members, chosen) if keep]
    for layer, prepared in plans:  # every layer checked before the first write
        layer.write_lora(slot, prepared)
    return covered


def _check_targets(model, targets) -> None:
    if targets is None:
        return
    others = [
        name
        for name, layer in lora_layers(model).items()
        if name not in trainable_layers(model)
        and any(
            matches_targets(targets, m)
            for m in packed_names(name, layer_packed_modules(name, layer))
        )
    ]
    if others:
        raise ValueError(
            f"init_lora_slot: target_modules {targets!r} name {others}, which are not linear "
            "LoRA layers (embeddings, lm_head and MoE experts are not trained here)"
        )
    names = [
        m
        for name, layer in trainable_layers(model).items()
        for m in packed_names(name, layer_packed_modules(name, layer))
    ]
    if not any(matches_targets(targets, m) for m in names):
        warnings.warn(
            f"init_lora_slot: target_modules {targets!r} match no linear LoRA layer",
            stacklevel=3,
        )


def train_only_slots(slots: Sequence[int]) -> optax.GradientTransformation:
    """An optax transformation that zeroes every update outside ``slots``.

    Put it last in the chain (after weight decay) and pass ``wrt=nnx.LoRAParam``: every
    LoRA stack has the slot as its first axis, so the adapters in the other slots keep
    their exact values while one is trained.

    Example:
        >>> tx = optax.chain(optax.adamw(1e-3), train_only_slots([1]))
        >>> opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)  # doctest: +SKIP
    """
    keep_slots = tuple(int(s) for s in slots)
    if not keep_slots:
        raise ValueError("train_only_slots: name at least one slot")

    def update(updates, state, params=None):
        del params

        def mask(u):
            if u is None or jnp.ndim(u) == 0:
                return u
            if max(keep_slots) >= u.shape[0] or min(keep_slots) < -u.shape[0]:
                raise ValueError(
                    f"train_only_slots: slots {list(keep_slots)} outside the {u.shape[0]} "
                    "slots of a LoRA stack"
                )
            keep = jnp.zeros(u.shape[0], bool).at[jnp.asarray(keep_slots)].set(True)
            return jnp.where(keep.reshape((-1,) + (1,) * (u.ndim - 1)), u, jnp.zeros_like(u))

        return jax.tree.map(mask, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
