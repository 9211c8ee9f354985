"""Training a DoRA adapter (PEFT `use_dora`) in a slot.

`init_lora_slot(..., use_dora=True)` starts every targeted linear module as PEFT starts a
DoRA adapter: B is zero, so the magnitude is `||W||` per output unit and the gain
`magnitude / ||W + B @ A||` is 1. The magnitudes are `nnx.LoRAParam`s
(`lora_jax.layers.dora.DoRAMagnitude`): an optimizer over `wrt=nnx.LoRAParam` trains them
with the factors. The norm is a constant of the forward (PEFT detaches it) that follows
the factors: `refresh_dora_norms` takes it again from the slot's current weights. Call it
after every optimizer update (inside the jitted step), so that each forward sees the
norm of the weights it runs with, as PEFT's does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from lora_jax.layers.dora import dora_values, has_dora, refresh_slot_norm, weight_norms
from lora_jax.serving.wrap import lora_layers


def check_dora_targets(layers: Mapping[str, object]) -> None:
    """Every layer an adapter trains in a DoRA slot keeps DoRA magnitudes, else a
    ValueError naming the layers (PEFT's use_dora makes every module DoRA)."""
    without = sorted(name for name, layer in layers.items() if not has_dora(layer))
    if without:
        raise ValueError(
            f"init_lora_slot: use_dora=True targets {without}, which keep no DoRA "
            "magnitudes; DoRA trains on lora_jax's linear layers of a model wrapped with "
            "LoRAConfig(enable_dora=True) (not the embedding, the lm_head, MoE experts or "
            "a plain Flax layer)"
        )


def start_dora(layer, slot: int, chosen: Sequence[bool]) -> None:
    """Makes the chosen slices of slot `slot` (whose factors are written) DoRA with PEFT's
    starting magnitude `||W + B @ A||` (gain 1); the others stay plain LoRA."""
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
    Each DoRA layer runs a forward of its `in_features` identity rows per slot.

    Example:
        >>> opt.update(model, grads); refresh_dora_norms(model, [1])  # doctest: +SKIP
    """
    if np.ndim(slots) == 0:  # one slot (an int, or a traced scalar)
        slots = [slots]
    for layer in lora_layers(model).values():
        if has_dora(layer):
            for slot in slots:
                refresh_slot_norm(layer, slot)
