"""Training a DoRA adapter (PEFT `use_dora`) in a slot.

`init_lora_slot(..., use_dora=True)` starts every targeted linear module as PEFT starts a
DoRA adapter: B is zero, so the magnitude is `||W||` per output unit and the gain
`magnitude / ||W + B @ A||` is 1. A targeted token embedding starts the same way (A is
zero there; its norms are over the vocab, per embedding unit), and a targeted lm_head
(a gain per vocab row). The magnitudes are `nnx.LoRAParam`s
(`lora_jax.layers.dora.DoRAMagnitude`): an optimizer over `wrt=nnx.LoRAParam` trains them
with the factors. The norm is a constant of the forward (PEFT detaches it) that follows
the factors: `refresh_dora_norms` takes it again from the slot's current weights. Call it
after every optimizer update (inside the jitted step), so that each forward sees the
norm of the weights it runs with, as PEFT's does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lora_jax.layers.dora import dora_axes, dora_values, has_dora, weight_norms
from lora_jax.serving.merge_plans import _linear_plan
from lora_jax.serving.wrap import lora_layers
from lora_jax.sharding import shard_map


def check_dora_targets(layers: Mapping[str, object]) -> None:
    """Every layer an adapter trains in a DoRA slot keeps DoRA magnitudes, else a
    ValueError naming the layers (PEFT's use_dora makes every module DoRA)."""
    without = sorted(name for name, layer in layers.items() if not has_dora(layer))
    if without:
        raise ValueError(
            f"init_lora_slot: use_dora=True targets {without}, which keep no DoRA "
            "magnitudes; DoRA trains on lora_jax's linear, embedding and lm_head layers of a "
            "model wrapped with LoRAConfig(enable_dora=True) (not MoE experts or a plain "
            "Flax linear layer)"
        )


def start_dora(layer, slot: int, chosen: Sequence[bool]) -> None:
    """Makes the chosen slices of slot `slot` (whose factors are written) DoRA with PEFT's
    starting magnitude `||W + B @ A||` (gain 1); the others stay plain LoRA."""
    if hasattr(layer, "start_dora"):  # a vocab layer (embedding, lm_head): one member
        if chosen[0]:
            layer.start_dora(slot)
        return
    ones = [
        np.ones(n, np.float32) if keep else None
        for n, keep in zip(layer.logical_slice_sizes, chosen)
    ]
    mask, norms = dora_values(layer, ones, weight_norms(layer, slot))
    layer._write(layer.dora_magnitude, slot, norms * mask)
    layer._write(layer.dora_norm, slot, norms * mask)


def refresh_dora_norms(model, slots: Sequence[int] | int) -> None:
    """Sets the DoRA norms of ``slots`` in every LoRA layer to `||W + B @ A||` of the
    slots' current weights (a slot or output unit without DoRA keeps none).

    PEFT takes the norm at every forward; here it is kept per slot, so call this after
    each optimizer update of a DoRA slot (inside the jitted step; ``slots`` may be traced).
    It costs what PEFT's does: per layer and slot, `W + B @ A` per shard in the kernel's
    own layout (as `merge_adapter` makes it) and its column norms, summed over the
    tensor axis where the kernel's input dim is split (a token embedding's norms come
    from `A W` and `A Aᵀ` instead, without `[V, D]`).

    Example:
        >>> opt.update(model, grads); refresh_dora_norms(model, [1])  # doctest: +SKIP
    """
    if np.ndim(slots) == 0:  # one slot (an int, or a traced scalar)
        slots = [slots]
    for layer in lora_layers(model).values():
        if has_dora(layer):
            for slot in slots:
                refresh_slot_norm(layer, slot)


def refresh_slot_norm(layer, slot) -> None:
    """Sets slot `slot`'s DoRA norms to `||W + B @ A||` of its current weights, where the
    slot has DoRA (units of plain LoRA keep a norm of zero). `slot` may be traced."""
    slot = jnp.asarray(slot, jnp.int32)
    if hasattr(layer, "dora_norms"):  # a vocab layer: its own norms, as its stacks keep them
        fresh = layer.dora_norms(slot)
    else:
        fresh = _norms_fn(layer)(layer.base_layer.kernel[...], *_factors(layer), slot)  # [out]
    norms = layer.dora_norm[...]
    old = jax.lax.dynamic_index_in_dim(norms, slot, axis=0, keepdims=False)
    new = jnp.where(old > 0, fresh.astype(jnp.float32), 0.0)
    layer.dora_norm.set_value(jax.lax.dynamic_update_index_in_dim(norms, new, slot, axis=0))


def _factors(layer) -> tuple:
    return tuple(v[...] for v in layer.lora_a), tuple(v[...] for v in layer.lora_b)


def _norms_fn(layer):
    """`(kernel, a, b, slot) -> [out]`: the column norms of the slot's merged kernel, per
    shard, from the merge's plan."""
    rules = layer.base_layer.rules
    _, local, (w_specs, l_specs), _ = _linear_plan(layer, norms=True)
    if rules.mesh is None:
        return local
    return shard_map(rules, local, (*w_specs, *l_specs, ()), (dora_axes(layer.base_layer)[1],))
