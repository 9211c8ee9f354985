"""DoRA (PEFT `use_dora`) for the linear LoRA layers: a per-slot scale of each output unit.

PEFT's DoRA output is `g ⊙ (x @ W + s · x @ Aᵀ @ Bᵀ) + bias` with
`g = magnitude / ||W + s · B @ A||` per output unit (the norm over the input dim, taken
as a constant). The norm depends only on the weights, so it is computed once when an
adapter is written to a slot, and the forward multiplies the slot's tokens' outputs by
their slot's `g` after the LoRA joined (after the row-parallel reduction too: the scale is
per output column). The slot stores `g - 1`, so a zeroed slot is plain LoRA.

`dora_scale [max_loras, out]` (f32) is laid out like the base output (packed slices, kv
head replicas, split on the tensor axis for column layers). Layers over a plain Flax
layer (whose forward adds its bias inside) and MoE experts have none.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.layers.context import lora_mapping
from lora_jax.linear import LinearBase, unpack_shards

_Y_AXIS = {"replicated": None, "column": "tensor", "row": None}


class DoRAScale(nnx.Variable):
    """`f32[max_loras, out]`: each slot's DoRA scale minus one (0 = plain LoRA)."""


def dora_axes(base: LinearBase) -> tuple:
    return ("lora_slot", _Y_AXIS[base.parallel])


def init_dora(layer) -> None:
    """Allocates `layer.dora_scale` when the config enables DoRA and the base supports it."""
    base = layer.base_layer
    ok = layer.lora_config.enable_dora and isinstance(base, LinearBase) and base.dora_ok
    if not ok:
        layer.dora_scale = None
        return
    L = layer.lora_config.max_loras
    zeros = jnp.zeros((L, base.out_features), jnp.float32)  # [max_loras, out (physical)]
    layer.dora_scale = DoRAScale(base.rules.place(zeros, *dora_axes(base)))


def apply_dora(y: jax.Array, scale_l: jax.Array, slots: jax.Array) -> jax.Array:
    """`y [T, out_l]` times `1 + scale[slot]` per token (-1 tokens unchanged)."""
    d = jnp.where((slots >= 0)[:, None], scale_l[jnp.maximum(slots, 0)], 0.0)
    return (y.astype(jnp.float32) * (1.0 + d)).astype(y.dtype)


def weight_norms(layer, slot: int) -> np.ndarray:
    """`||g ⊙ (W + B @ A)||` per physical output unit of `slot` (f32 host `[out]`), from
    the layer's own forward of the identity (every row on `slot`) less the bias, so
    packing, replicas and sharding are the forward's. `g` is the slot's DoRA scale: 1
    where it is zero (as a slot write leaves it), giving `||W + B @ A||`."""
    base = layer.base_layer
    eye = jnp.eye(base.in_features, dtype=base.dtype or base.param_dtype)  # [in, in]
    slots = jnp.full((base.in_features,), slot, jnp.int32)
    y = _identity_forward(layer, eye, slots)  # [in, out]: W + (B @ A)ᵀ
    return np.sqrt(np.sum(np.square(np.asarray(y, np.float64)), axis=0)).astype(np.float32)


@nnx.jit
def _identity_forward(layer, eye, slots):
    with lora_mapping(layer, slots):
        return base_output_without_bias(layer, eye)


def base_output_without_bias(layer, x: jax.Array) -> jax.Array:
    y = layer(x)
    if isinstance(y, tuple):  # return_bias
        y = y[0]
    bias = layer.base_layer.bias
    if bias is not None and not layer.base_layer.skip_bias_add:
        y = y - bias[...].astype(y.dtype)
    return y


def dora_scale_for(layer, magnitudes: Sequence[np.ndarray | None], norms: np.ndarray):
    """`g - 1` `[out]` (physical, packed) from per-member magnitudes (logical, `None` for a
    member without DoRA: scale 1) and the slot's `weight_norms`."""
    base = layer.base_layer
    subs = []
    for group, m in zip(layer.slice_groups, magnitudes):
        sizes = [base.output_sizes[i] for i in group]
        if m is None:
            subs += [np.full((n,), np.nan, np.float32) for n in sizes]
        else:
            subs += np.split(np.asarray(m, np.float32), np.cumsum(sizes)[:-1])
    mag = np.asarray(base.pack([jnp.asarray(v) for v in subs], axis=0), np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        g = np.where(np.isnan(mag), 1.0, mag / norms)
    return (g - 1.0).astype(np.float32)


def slot_magnitudes(layer, slot: int) -> np.ndarray:
    """PEFT's `lora_magnitude_vector` of the DoRA adapter in `slot` per physical output
    unit (f32 host `[out]`): `g · ||W + B @ A||`, the norm of the slot's forward (which
    applies `g`) with `g`'s sign. A slot of plain LoRA (`g = 1`) gives `||W + B @ A||`,
    the magnitude PEFT starts a DoRA adapter with."""
    g = 1.0 + np.asarray(layer.dora_scale[...][int(slot)], np.float32)
    return (np.sign(g) * weight_norms(layer, slot)).astype(np.float32)


def check_magnitudes(layer, magnitudes: Sequence[np.ndarray | None]) -> None:
    """Each member's magnitude is `[out_s]` (its logical width) and finite, else a
    ValueError naming the layer."""
    if layer.dora_scale is None:
        raise ValueError(
            f"{layer.name}: the adapter is a DoRA adapter (PEFT use_dora); serve it with "
            "LoRAConfig(enable_dora=True) on lora_jax's linear layers"
        )
    if len(magnitudes) != layer.n_slices:
        raise ValueError(
            f"{layer.name}: {len(magnitudes)} DoRA magnitudes for {layer.n_slices} slices"
        )
    for s, (m, n) in enumerate(zip(magnitudes, layer.logical_slice_sizes)):
        if m is None:
            continue
        arr = np.asarray(m, np.float32)
        if arr.shape != (n,) or not np.isfinite(arr).all():
            raise ValueError(
                f"{layer.name}: the DoRA magnitude of slice {s} must be [{n}] finite values, "
                f"got shape {arr.shape}"
            )


def is_dora_slot(layer, slot: int) -> bool:
    """Whether `slot` of `layer` holds a DoRA adapter (a non-zero scale)."""
    scale = getattr(layer, "dora_scale", None)
    return scale is not None and bool(np.any(np.asarray(scale[...][int(slot)]) != 0))


def check_layer_dora(layer, magnitudes) -> None:
    """A DoRA module's magnitudes fit its layer (lora_jax's linear layers), else a
    ValueError naming the layer kind."""
    if getattr(layer, "check_dora", None) is None:
        raise ValueError(
            f"DoRA (PEFT use_dora) on a {type(layer).__name__} is not supported; lora_jax "
            "serves DoRA on its linear layers"
        )
    layer.check_dora(magnitudes)


def unpacked_magnitudes(layer, slot: int) -> list[np.ndarray]:
    """`slot_magnitudes` per base sub-slice (physical sizes: kv-head replicas kept)."""
    base = layer.base_layer
    mags = slot_magnitudes(layer, slot)
    return [np.asarray(v) for v in unpack_shards(mags, base.physical_sizes, 0, base.out_tp)]
