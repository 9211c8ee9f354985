"""The optax transformations that train one slot of a wrapped model.

`train_only_slots` zeroes every update outside the slots being trained (put it last in
the chain), `train_slots` runs an optimizer on those slots' rows only (its state sized to
them); `tie_kv_replicas` sums the gradients of the B rows that tp > kv heads stores
once per kv-head replica (put it first). The overview is in `lora_jax.serving.training`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lora_jax.layers.dora import dora_axes, has_dora
from lora_jax.serving.training_slots import is_linear
from lora_jax.serving.wrap import lora_layers


def _slot_list(name: str, slots) -> tuple[int, ...]:
    """``slots`` as a non-empty tuple of ints, or a ValueError naming ``name``."""
    given = slots
    if isinstance(slots, jax.Array | np.ndarray):
        slots = slots.tolist() if slots.ndim == 1 else None
    if isinstance(slots, str | bytes) or not isinstance(slots, Iterable):
        raise ValueError(f"{name}: slots must be a list of ints, got {given!r}")
    slots = list(slots)
    bad = [
        s for s in slots if isinstance(s, bool | np.bool_) or not isinstance(s, int | np.integer)
    ]
    if bad:
        raise ValueError(f"{name}: slots must be ints, got {bad!r} in {slots!r}")
    if not slots:
        raise ValueError(f"{name}: name at least one slot")
    return tuple(int(s) for s in slots)


def _check_in_stack(name: str, slots: tuple[int, ...], u) -> None:
    if max(slots) >= u.shape[0] or min(slots) < -u.shape[0]:
        raise ValueError(
            f"{name}: slots {list(slots)} outside the {u.shape[0]} slots of a LoRA stack"
        )


def train_only_slots(slots: Sequence[int]) -> optax.GradientTransformation:
    """An optax transformation that zeroes every update outside ``slots``.

    Put it last in the chain (after weight decay) and pass ``wrt=nnx.LoRAParam``: every
    LoRA stack has the slot as its first axis, so the adapters in the other slots keep
    their exact values while one is trained. The optimizer before it still keeps state
    for (and updates) every slot: `train_slots` runs it on the trained slots' rows only.

    Example:
        >>> tx = optax.chain(optax.adamw(1e-3), train_only_slots([1]))
        >>> opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)  # doctest: +SKIP
    """
    keep_slots = _slot_list("train_only_slots", slots)

    def update(updates, state, params=None):
        del params

        def mask(u):
            if u is None or jnp.ndim(u) == 0:
                return u
            _check_in_stack("train_only_slots", keep_slots, u)
            keep = jnp.zeros(u.shape[0], bool).at[jnp.asarray(keep_slots)].set(True)
            return jnp.where(keep.reshape((-1,) + (1,) * (u.ndim - 1)), u, jnp.zeros_like(u))

        return jax.tree.map(mask, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def train_slots(
    tx: optax.GradientTransformation, slots: Sequence[int]
) -> optax.GradientTransformation:
    """``tx`` run on the rows of ``slots`` of every LoRA stack only; every other slot's
    update is zero.

    What ``optax.chain(tx, train_only_slots(slots))`` computes, but ``tx``'s state (Adam's
    two moments) holds the trained slots' rows alone and its update touches only them: one
    slot trained in 8 keeps 1/8 of the optimizer state and does 1/8 of its work. ``tx``
    sees the slots' gradients and parameters, so a transform that reads across entries
    (``clip_by_global_norm``) sees the trained slots'. Pass ``wrt=nnx.LoRAParam``.

    Example:
        >>> tx = train_slots(optax.adamw(1e-3), [1])
        >>> opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)  # doctest: +SKIP
    """
    if not isinstance(tx, optax.GradientTransformation):
        raise ValueError(f"train_slots: tx must be an optax GradientTransformation, got {tx!r}")
    keep_slots = _slot_list("train_slots", slots)
    rows = np.asarray(keep_slots)

    def take(tree):
        def one(u):
            if u is None or jnp.ndim(u) == 0:
                return u
            _check_in_stack("train_slots", keep_slots, u)
            return u[rows]

        return jax.tree.map(one, tree)

    def init(params):
        return tx.init(take(params))

    def update(updates, state, params=None):
        inner, state = tx.update(take(updates), state, None if params is None else take(params))

        def put(u, v):
            if u is None or jnp.ndim(u) == 0:
                return v
            # slot i takes row `at[i]` of v where `hit[i]`, else zero: a gather over the
            # slot axis keeps v's sharding of the other axes (a scatter into zeros_like(u)
            # lost it under jax 0.11's Explicit meshes and was refused)
            at, hit = np.zeros(u.shape[0], np.int32), np.zeros(u.shape[0], bool)
            at[rows % u.shape[0]], hit[rows % u.shape[0]] = np.arange(len(rows)), True
            full = jnp.take(v.astype(u.dtype), at, axis=0)
            return jnp.where(hit.reshape((-1,) + (1,) * (u.ndim - 1)), full, 0).astype(u.dtype)

        return jax.tree.map(put, updates, inner), state

    return optax.GradientTransformation(init, update)


def tie_kv_replicas(model) -> optax.GradientTransformation:
    """An optax transformation that trains the replicas of a kv head's B as one parameter.

    With more tensor shards than kv heads, a QKV layer's B stacks hold each kv head's
    rows once per replica (`num_kv_head_replicas`), and each replica gets its own gradient;
    the adapter (PEFT's, the tp=1 model's) has one B per kv head, whose gradient is the sum
    of its replicas'. This puts that sum in every replica (and does the same for a DoRA
    layer's magnitudes of a kv head's units). Put it first in the chain,
    before the optimizer: replicas that start equal (as `init_lora_slot` and `set_lora`
    write them) then stay equal under elementwise optimizers (SGD, Adam, weight decay),
    and training follows the unsharded model's. (Transforms that read across entries, such
    as `clip_by_global_norm`, still count a tied row once per replica.) On a model without
    kv replicas it changes nothing.

    Example:
        >>> tied = tie_kv_replicas(model)  # doctest: +SKIP
        >>> tx = optax.chain(tied, optax.adamw(1e-3), train_only_slots([1]))  # doctest: +SKIP
        >>> opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)  # doctest: +SKIP
    """
    if not lora_layers(model):
        raise ValueError("tie_kv_replicas: the model has no LoRA layers (wrap_model it first)")
    ties = _kv_replica_ties(model)

    def update(updates, state, params=None):
        del params
        if not ties:
            return updates, state
        seen = set()

        def tie(path, u):
            key = tuple(_path_key(k) for k in path)
            if key and key[-1] == "value" and key not in ties:  # `nnx.split` state: Variables
                key = key[:-1]
            found = ties.get(key)
            if found is None:
                return u
            name, what, rows, shape, rules, axes = found
            if u.shape != shape:
                raise ValueError(
                    f"tie_kv_replicas: the update at {'.'.join(map(str, key))} has shape "
                    f"{u.shape}, but {name}'s {what} there is {shape}: build it with the model "
                    "the optimizer trains"
                )
            seen.add(key)
            return _tie_rows(u, rows, rules, axes)

        out = jax.tree_util.tree_map_with_path(tie, updates)
        missing = sorted(".".join(map(str, k)) for k in ties.keys() - seen)
        if missing:
            raise ValueError(
                f"tie_kv_replicas: the updates hold no B (or DoRA magnitude) stack at "
                f"{missing}: it takes the gradients of the model it was built with, over "
                "wrt=nnx.LoRAParam"
            )
        return out, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _kv_replica_ties(model) -> dict[tuple, tuple]:
    """Per B stack (and DoRA magnitude stack) holding kv replicas, by its state path:
    (layer name, what the stack is, the logical row of each physical row, the stack's
    shape, the layer's rules, the stack's logical axes)."""
    paths = {
        id(node): tuple(path)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.LoRAParam)
    }
    ties = {}
    for name, layer in lora_layers(model).items():
        if not is_linear(layer) or getattr(layer.base_layer, "num_kv_head_replicas", 1) < 2:
            continue
        base = layer.base_layer
        axes = layer.lora_axes()[1]
        for s, var in enumerate(layer.lora_b):
            n = layer.logical_slice_sizes[s]
            # the layer's own logical → physical layout, applied to row numbers
            rows = np.asarray(layer._physical_b(s, np.arange(n)[:, None]))[:, 0]  # [out_s]
            if len(rows) > n:
                ties[paths[id(var)]] = (name, "B", rows, var.shape, base.rules, axes)
        if has_dora(layer):  # the DoRA magnitudes: one per logical output unit
            cuts = np.cumsum([0, *base.output_sizes])
            rows = np.asarray(base.pack([np.arange(a, b) for a, b in zip(cuts, cuts[1:])], 0))
            var = layer.dora_magnitude
            ties[paths[id(var)]] = (
                name,
                "DoRA magnitude",
                rows,
                var.shape,
                base.rules,
                dora_axes(base),
            )
    return ties


def _path_key(entry):
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def _tie_rows(u: jax.Array, rows: np.ndarray, rules, axes) -> jax.Array:
    """Every physical row of B's update `[L, out_s, R]` (a DoRA magnitude's `[L, out]`)
    set to the sum over the rows that hold the same logical row."""
    # replicas of a head sit on different tensor shards: sum on one replicated copy
    full = rules.constrain(u, *(None,) * u.ndim)
    n = int(rows.max()) + 1
    summed = jnp.zeros((u.shape[0], n, *u.shape[2:]), u.dtype).at[:, rows].add(full)
    return rules.constrain(summed[:, rows], *axes)
