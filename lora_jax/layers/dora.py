"""DoRA (PEFT `use_dora`) for the linear LoRA layers: a per-slot scale of each output unit.

(The vocab layers keep the same two stacks: the token embedding per embedding unit, its
norms over the vocab; the lm_head per vocab row, its norms over the hidden dim;
`lora_jax.layers.vocab_slots`.)

PEFT's DoRA output is `g ⊙ (x @ W + s · x @ Aᵀ @ Bᵀ) + bias` with
`g = magnitude / ||W + s · B @ A||` per output unit (the norm over the input dim, taken
as a constant: PEFT detaches it). Each layer keeps, per slot and output unit, the
magnitude (`dora_magnitude`, an `nnx.LoRAParam`: trained with the slot's LoRA) and the
norm (`dora_norm`, a plain Variable: no gradient reaches it). The norm depends only on the
weights, so it is computed when an adapter is written to a slot (a forward of the
identity through the layer) and, while a slot trains, again after each update
(`lora_jax.serving.training.refresh_dora_norms`: PEFT takes it at each forward). The
forward multiplies the slot's tokens' outputs by `g = magnitude / norm` after the LoRA
joined (after the row-parallel reduction too: the scale is per output column). A norm of
zero means plain LoRA (`g = 1`), so a zeroed slot is plain LoRA.

Both stacks are `f32[max_loras, out]`, laid out like the base output (packed slices, kv
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


class DoRAMagnitude(nnx.LoRAParam):
    """`f32[max_loras, out]`: each slot's DoRA magnitude (PEFT `lora_magnitude_vector`)."""


class DoRANorm(nnx.Variable):
    """`f32[max_loras, out]`: each slot's `||W + B @ A||` per output unit (0: plain LoRA)."""


def dora_axes(base: LinearBase) -> tuple:
    return ("lora_slot", _Y_AXIS[base.parallel])


def has_dora(layer) -> bool:
    """Whether the layer keeps DoRA magnitudes (LoRAConfig.enable_dora on a lora_jax linear)."""
    return getattr(layer, "dora_norm", None) is not None


def init_dora(layer) -> None:
    """Allocates `dora_magnitude` and `dora_norm` when the config enables DoRA and the base
    supports it (else both are None)."""
    base = layer.base_layer
    ok = layer.lora_config.enable_dora and isinstance(base, LinearBase) and base.dora_ok
    if not ok:
        layer.dora_magnitude = layer.dora_norm = None
        return
    L = layer.lora_config.max_loras

    def zeros():  # [max_loras, out (physical)]: one buffer each (slot writes donate them)
        return base.rules.place(jnp.zeros((L, base.out_features), jnp.float32), *dora_axes(base))

    layer.dora_magnitude = DoRAMagnitude(zeros())
    layer.dora_norm = DoRANorm(zeros())


def dora_gain(magnitude: jax.Array, norm: jax.Array) -> jax.Array:
    """`g = magnitude / norm` where the norm is positive, 1 where it is zero (plain LoRA)."""
    on = norm > 0
    return jnp.where(on, magnitude / jnp.where(on, norm, 1.0), 1.0)


def apply_dora(y: jax.Array, m_l: jax.Array, n_l: jax.Array, slots: jax.Array) -> jax.Array:
    """`y [T, out_l]` times its slot's `g` per token (-1 tokens unchanged)."""
    at = jnp.maximum(slots, 0)
    g = jnp.where((slots >= 0)[:, None], dora_gain(m_l[at], n_l[at]), 1.0)
    return (y.astype(jnp.float32) * g).astype(y.dtype)


def weight_norms(layer, slot: int) -> np.ndarray:
    """`||W + B @ A||` per physical output unit of `slot` (f32 host `[out]`, summed in
    f64), from the layer's own forward of the identity (every row on `slot`, DoRA off)
    less the bias, so packing, replicas and sharding are the forward's. A layer with its
    own `weight_norms` (the embedding: norms over the vocab) gives them."""
    own = getattr(layer, "weight_norms", None)
    if own is not None:
        return own(slot)
    base = layer.base_layer
    eye = jnp.eye(base.in_features, dtype=base.dtype or base.param_dtype)  # [in, in]
    slots = jnp.full((base.in_features,), slot, jnp.int32)
    y = _identity_forward(layer, eye, slots)  # [in, out]: W + (B @ A)ᵀ
    return np.sqrt(np.sum(np.square(np.asarray(y, np.float64)), axis=0)).astype(np.float32)


@nnx.jit
def _identity_forward(layer, eye, slots):
    return _forward_without_dora(layer, eye, slots)


def _forward_without_dora(layer, x: jax.Array, slots: jax.Array) -> jax.Array:
    """The layer's forward of `x` on `slots` less the bias, with every slot's DoRA gain 1
    (the norms set to zero for the call, then put back)."""
    norms = layer.dora_norm[...] if has_dora(layer) else None
    if norms is not None:
        layer.dora_norm.set_value(jnp.zeros_like(norms))
    try:
        with lora_mapping(layer, slots):
            return base_output_without_bias(layer, x)
    finally:
        if norms is not None:
            layer.dora_norm.set_value(norms)


def base_output_without_bias(layer, x: jax.Array) -> jax.Array:
    y = layer(x)
    if isinstance(y, tuple):  # return_bias
        y = y[0]
    bias = layer.base_layer.bias
    if bias is not None and not layer.base_layer.skip_bias_add:
        y = y - bias[...].astype(y.dtype)
    return y


def dora_values(layer, magnitudes: Sequence[np.ndarray | None], norms: np.ndarray):
    """`(magnitude, norm)`, each `[out]` (physical, packed), of a slot from per-member
    magnitudes (logical, `None` for a member without DoRA: both zero, gain 1) and the
    slot's `weight_norms`."""
    base = layer.base_layer
    subs = []
    for group, m in zip(layer.slice_groups, magnitudes):
        sizes = [base.output_sizes[i] for i in group]
        if m is None:
            subs += [np.full((n,), np.nan, np.float32) for n in sizes]
        else:
            subs += np.split(np.asarray(m, np.float32), np.cumsum(sizes)[:-1])
    mag = np.asarray(base.pack([jnp.asarray(v) for v in subs], axis=0), np.float32)
    off = np.isnan(mag)
    return np.where(off, 0.0, mag).astype(np.float32), np.where(off, 0.0, norms).astype(np.float32)


def slot_magnitudes(layer, slot: int) -> np.ndarray:
    """PEFT's `lora_magnitude_vector` of the DoRA adapter in `slot` per physical output
    unit (f32 host `[out]`): the slot's magnitudes where it has DoRA, `||W + B @ A||`
    elsewhere (a slot of plain LoRA: the magnitude PEFT starts a DoRA adapter with)."""
    slot = int(slot)
    norms = np.asarray(layer.dora_norm[...][slot], np.float32)
    mags = np.asarray(layer.dora_magnitude[...][slot], np.float32)
    if np.all(norms > 0):
        return mags
    return np.where(norms > 0, mags, weight_norms(layer, slot)).astype(np.float32)


def check_magnitudes(layer, magnitudes: Sequence[np.ndarray | None]) -> None:
    """Each member's magnitude is `[out_s]` (its logical width) and finite, else a
    ValueError naming the layer."""
    if not has_dora(layer):
        raise ValueError(
            f"{layer.name}: the adapter is a DoRA adapter (PEFT use_dora); serve it with "
            "LoRAConfig(enable_dora=True) on lora_jax's linear and embedding layers"
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
    """Whether `slot` of `layer` holds a DoRA adapter (a non-zero norm)."""
    if not has_dora(layer):
        return False
    return bool(np.any(np.asarray(layer.dora_norm[...][int(slot)]) != 0))


def check_layer_dora(layer, magnitudes) -> None:
    """A DoRA module's magnitudes fit its layer (lora_jax's linear layers), else a
    ValueError naming the layer kind."""
    if getattr(layer, "check_dora", None) is None:
        raise ValueError(
            f"DoRA (PEFT use_dora) on a {type(layer).__name__} is not supported; lora_jax "
            "serves DoRA on its linear and embedding layers"
        )
    layer.check_dora(magnitudes)


def unpacked_magnitudes(layer, slot: int) -> list[np.ndarray]:
    """`slot_magnitudes` per base sub-slice (physical sizes: kv-head replicas kept)."""
    base = layer.base_layer
    mags = slot_magnitudes(layer, slot)
    return [np.asarray(v) for v in unpack_shards(mags, base.physical_sizes, 0, base.out_tp)]
