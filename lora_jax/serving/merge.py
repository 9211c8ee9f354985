"""Fold one slot's adapter into the base kernels for zero-overhead single-tenant serving.

`merge_adapter(model, slot)` sets, in every LoRA linear, `kernel += (B @ A).T` for that
slot, computed per shard inside `shard_map` in the kernel's own physical layout (packed
slices per tensor shard, kv-head replicas, S-LoRA rank/out shards gathered first), so the
kernel keeps its sharding and no whole array is gathered. The original kernels are kept
(`MergedKernel` variables on the layers) and `unmerge_adapter` puts them back bit for
bit. While merged, the model's `LoRAContext` is cleared so layers run the base matmul
only; do not set a LoRA mapping until `unmerge_adapter`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.layers import BaseLayerWithLoRA, LoRASlotRanks, find_lora_context
from lora_jax.layers.moe import FusedMoEWithLoRA
from lora_jax.linear import _KERNEL_AXES
from lora_jax.serving.wrap import lora_layers
from lora_jax.sharding import shard_map


class MergedKernel(nnx.Variable):
    """A base kernel as it was before `merge_adapter` (restored by `unmerge_adapter`).

    Example:
        >>> layer.merged_original.get_value().shape  # while merged  # doctest: +SKIP
        (64, 128)
    """


def _merge_fn(layer: BaseLayerWithLoRA):
    """`(kernel, a, b, slot) -> kernel + (B[slot] @ A[slot]).T`, per shard, for one layer."""
    base = layer.base_layer
    rules = base.rules
    a_axes, b_axes = layer.lora_axes()
    tp_axis = rules.mesh_axis("tensor")
    sharded = layer.fully_sharded and tp_axis is not None and base.tp > 1
    row = base.parallel == "row"

    def local(k, a, b, idx):
        deltas = []
        for a_s, b_s in zip(a, b):
            a_rk = jax.lax.dynamic_index_in_dim(a_s, idx, 0, keepdims=False)  # [R(/tp), in_l]
            b_nr = jax.lax.dynamic_index_in_dim(b_s, idx, 0, keepdims=False)  # [out_l, R]
            if sharded and not row:
                a_rk = jax.lax.all_gather(a_rk, rules.mesh_axis(a_axes[1]), axis=0, tiled=True)
            if sharded and row:
                b_nr = jax.lax.all_gather(b_nr, tp_axis, axis=0, tiled=True)
            d = jnp.dot(b_nr.astype(jnp.float32), a_rk.astype(jnp.float32))  # [out_l, in_l]
            deltas.append(d.T)
        delta = jnp.concatenate(deltas, axis=1)  # [in_l, out_l]: the local kernel layout
        return (k.astype(jnp.float32) + delta).astype(k.dtype)

    if rules.mesh is None:
        return local
    k_axes = _KERNEL_AXES[base.parallel]
    n = len(layer.lora_a)
    specs = (k_axes, (a_axes,) * n, (b_axes,) * n, ())
    return shard_map(rules, local, specs, k_axes)


def _merged_kernels(layers: list[BaseLayerWithLoRA], slot: int) -> list[jax.Array]:
    """Every layer's merged kernel, from one jitted call."""
    fns = [_merge_fn(layer) for layer in layers]
    args = [
        (
            layer.base_layer.kernel[...],  # [in, out_physical]
            tuple(v[...] for v in layer.lora_a),  # per slice [L, R, in]
            tuple(v[...] for v in layer.lora_b),  # per slice [L, out_s, R]
        )
        for layer in layers
    ]
    run = jax.jit(lambda args, idx: [f(*a, idx) for f, a in zip(fns, args)])
    return run(args, jnp.int32(slot))


def _slot_in_use(layer, slot: int) -> bool:
    """Whether any `LoRASlotRanks` inside `layer` records an adapter in `slot`."""
    return any(
        np.asarray(node.get_value())[..., slot].any()
        for _, node in nnx.iter_graph(layer)
        if isinstance(node, LoRASlotRanks)
    )


def merge_adapter(model: nnx.Module, slot: int) -> int:
    """Adds slot `slot`'s `B @ A` into every LoRA linear's base kernel; returns the count.

    Raises `ValueError` (changing nothing) if the model is already merged, `slot` is out of
    range, or a layer that cannot be merged (embedding, lm_head or MoE expert LoRA, or a
    linear whose kernel is shared with another LoRA linear: tied weights) holds an adapter
    in `slot`; such layers with the slot empty are left as they are.

    Example:
        >>> mgr.activate_adapter(7)  # doctest: +SKIP
        >>> merge_adapter(model, mgr.slot_of(7))  # doctest: +SKIP
        >>> logits = model(ids, positions)  # base matmuls only  # doctest: +SKIP
        >>> unmerge_adapter(model)  # doctest: +SKIP
    """
    all_layers = lora_layers(model)
    if not all_layers:
        raise ValueError("merge_adapter: the model has no LoRA layers")
    if isinstance(slot, np.integer):  # as `token_mapping` / `slot_of` values may come
        slot = int(slot)
    layers = {}
    for name, layer in all_layers.items():
        L = layer.lora_config.max_loras
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < L:
            raise ValueError(f"merge_adapter: slot {slot!r} outside [0, {L})")
        if getattr(layer, "merged_original", None) is not None:
            raise ValueError(f"merge_adapter: layer {name!r} is already merged; unmerge first")
        if isinstance(layer, BaseLayerWithLoRA) and not isinstance(layer, FusedMoEWithLoRA):
            layers[name] = layer
        elif _slot_in_use(layer, slot):
            # Embedding / lm_head / MoE expert LoRA: only an empty slot can be skipped.
            raise ValueError(
                f"merge_adapter: layer {name!r} ({type(layer).__name__}) holds an adapter in "
                f"slot {slot} and cannot be merged; only LoRA linears can"
            )
    # Layers that share one kernel variable (tied weights): a delta merged into it would
    # reach every one of them, so such a slot is refused; with the slot empty they are
    # left as they are.
    groups: dict[int, list[str]] = {}
    for name, layer in layers.items():
        groups.setdefault(id(layer.base_layer.kernel), []).append(name)
    for names in groups.values():
        if len(names) < 2:
            continue
        in_use = [n for n in names if _slot_in_use(layers[n], slot)]
        if in_use:
            raise ValueError(
                f"merge_adapter: layers {names} share one kernel and {in_use} hold an adapter "
                f"in slot {slot}: merging it would change every layer of that kernel"
            )
        for n in names:
            del layers[n]
    new = dict(zip(layers, _merged_kernels(list(layers.values()), slot)))
    for name, layer in layers.items():
        kernel = layer.base_layer.kernel
        layer.merged_original = MergedKernel(kernel.get_value())
        layer.merged_slot = slot
        kernel.set_value(new[name])
    ctx = find_lora_context(model)
    if ctx is not None:
        ctx.set_value(None)
    return len(layers)


def unmerge_adapter(model: nnx.Module) -> bool:
    """Restores the kernels saved by `merge_adapter` exactly; False if nothing was merged.

    Example:
        >>> unmerge_adapter(model)  # doctest: +SKIP
        True
    """
    done = False
    for layer in lora_layers(model).values():
        original = getattr(layer, "merged_original", None)
        if original is None:
            continue
        layer.base_layer.kernel.set_value(original.get_value())
        del layer.merged_original
        del layer.merged_slot
        done = True
    return done


def merged_slot(model: nnx.Module) -> int | None:
    """The slot currently merged into `model`'s kernels, or None.

    Example:
        >>> merge_adapter(model, 2)  # doctest: +SKIP
        >>> merged_slot(model)  # doctest: +SKIP
        2
    """
    for layer in lora_layers(model).values():
        if getattr(layer, "merged_original", None) is not None:
            return layer.merged_slot
    return None
