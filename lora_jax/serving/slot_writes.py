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
        if value is None:  # zeros typed (and sharded) like one slot of the stack
            update = jnp.zeros_like(jax.lax.index_in_dim(stack, 0, axis, keepdims=False))
        else:
            update = value.astype(stack.dtype)
        out.append(stack.at[at].set(update))
    return tuple(out)


def write_slot_updates(index: int, updates: Sequence[tuple[nnx.Variable, int, Any]]) -> None:
    """Writes `(variable, slot axis, content or None = zeros)` triples in one jitted call.

    The old stacks are donated: their buffers are reused for the new values.

    Example:
        >>> write_slot_updates(0, layer.slot_updates(layer.prepare_lora(0, a, b)))  # doctest: +SKIP
    """
    if not updates:
        return
    stacks, values, axes = [], [], []
    for var, axis, value in updates:
        stack = var.get_value()
        stacks.append(stack)
        axes.append(axis)
        if value is None:
            values.append(None)
            continue
        value = np.asarray(value).astype(stack.dtype)  # cast on host: fewer bytes to move
        sharding = _slot_sharding(stack, axis)
        values.append(jax.device_put(value, sharding) if sharding is not None else value)
    new = _write_slots(tuple(stacks), jnp.int32(index), tuple(values), tuple(axes))
    for (var, _, _), arr in zip(updates, new):
        var.set_value(arr)


def layer_variables(layer) -> list[nnx.Variable]:
    """A LoRA layer's own variables (not the base layer's, not the shared context)."""
    out = []
    for path, node in nnx.iter_graph(layer):
        if isinstance(node, nnx.Variable) and not isinstance(node, LoRAContext):
            if not path or path[0] != "base_layer":
                out.append(node)
    return out
