"""Writing one adapter slot of every LoRA layer in one jitted, donated update.

The managers (manager.py) validate an adapter for every layer on the host first, then
hand the per-layer `(variable, slot axis, value)` triples to `write_slot_updates`, so a
bad adapter changes nothing. Each update keeps its stack's sharding minus the slot axis.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lora_jax.layers import LoRAContext


def _slot_sharding(stack: jax.Array, axis: int):
    sharding = getattr(stack, "sharding", None)
    if isinstance(sharding, NamedSharding):
        spec = list(tuple(sharding.spec) + (None,) * (stack.ndim - len(sharding.spec)))
        del spec[axis]
        return NamedSharding(sharding.mesh, P(*spec))
    return None


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(3,))
def _write_slots(stacks, index, values, axes):
    out = []
    for stack, value, axis in zip(stacks, values, axes):
        at = (slice(None),) * axis + (index,)
        # A scatter (not a dynamic_update_slice): it accepts an update whose sharding is
        # the stack's minus the slot dim on Explicit meshes too.
        out.append(stack.at[at].set(value.astype(stack.dtype)))
    return tuple(out)


@functools.lru_cache(maxsize=512)
def _zero_slot(shape: tuple[int, ...], dtype, sharding) -> jax.Array:
    """One slot of zeros, made on the device(s) and kept: a layer an adapter leaves out
    gets this array, so every adapter hands `_write_slots` the same argument types
    whatever modules it targets (a `None` there would compile once per combination)."""
    return jnp.zeros(shape, dtype, device=sharding)


def write_slot_updates(index: int, updates: Sequence[tuple[nnx.Variable, int, Any]]) -> None:
    """Writes `(variable, slot axis, content or None = zeros)` triples in one jitted call.

    The old stacks are donated: their buffers are reused for the new values.

    Example:
        >>> write_slot_updates(0, layer.slot_updates(layer.prepare_lora(0, a, b)))  # doctest: +SKIP
    """
    if not updates:
        return
    for var, axis, _ in updates:
        slots = var.get_value().shape[axis]
        if (
            isinstance(index, bool | np.bool_)
            or not isinstance(index, int | np.integer)
            or not 0 <= index < slots
        ):
            raise ValueError(
                f"write_slot_updates: index {index!r} must be an int in [0, {slots}) (the "
                "stacks' slots); nothing was written"
            )
    stacks, values, axes = [], [], []
    for var, axis, value in updates:
        stack = var.get_value()
        stacks.append(stack)
        axes.append(axis)
        sharding = _slot_sharding(stack, axis)
        if value is None:
            shape = stack.shape[:axis] + stack.shape[axis + 1 :]
            values.append(_zero_slot(shape, np.dtype(stack.dtype), sharding))
            continue
        value = np.asarray(value).astype(stack.dtype)  # cast on host: fewer bytes to move
        # always a jax array: jit keys numpy and jax arguments apart
        values.append(jax.device_put(value, sharding))
    shardings = [getattr(stack, "sharding", None) for stack in stacks]
    new = _write_slots(tuple(stacks), jnp.int32(index), tuple(values), tuple(axes))
    for (var, _, _), arr, old in zip(updates, new, shardings):
        var.set_value(_same_sharding(arr, old))


def _same_sharding(arr: jax.Array, old) -> jax.Array:
    """``arr`` under the stack's own sharding object where the write gave an equivalent
    one spelled otherwise (Auto meshes: `P(None, None)` comes back `P()`): jit keys its
    cache on the spelling, so a forward compiled before the first write would compile
    again. The shards are reused, not copied."""
    if old is None or arr.sharding == old or not arr.sharding.is_equivalent_to(old, arr.ndim):
        return arr
    return jax.make_array_from_single_device_arrays(
        arr.shape, old, [s.data for s in arr.addressable_shards]
    )


def layer_variables(layer) -> list[nnx.Variable]:
    """A LoRA layer's own variables (not the base layer's, not the shared context)."""
    out = []
    for path, node in nnx.iter_graph(layer):
        if isinstance(node, nnx.Variable) and not isinstance(node, LoRAContext):
            if not path or path[0] != "base_layer":
                out.append(node)
    return out
