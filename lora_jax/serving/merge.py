"""Fold one slot's adapter into the base weights for zero-overhead single-tenant serving.

`merge_adapter(model, slot)` adds that slot's `B @ A` into the base weights of every LoRA
layer, as PEFT's `merge_adapter` does:

* linears: `kernel += (B @ A).T`, per packed slice;
* fused MoE experts: `w13[e] += (B13 @ A13).T` per slice (gate / up placed as the base
  stores them: concatenated or interleaved per tensor shard) and `w2[e] += (B2 @ A2).T`;
* vocab embeddings: `table[v] += B @ A[:, v]` (A is a lookup table over token ids);
* lm_heads: `table += B @ A` (B in the head's row order).

Each delta is computed per shard inside `shard_map` in the weight's own physical layout
(packed slices per tensor shard, kv-head replicas, S-LoRA rank / out shards gathered
first), so the weight keeps its sharding and no whole array is gathered. The original
weights are kept (`MergedKernel` variables on the layers) and `unmerge_adapter` puts them
back bit for bit. While merged, the model's `LoRAContext` is cleared so layers run the
base math only; do not set a LoRA mapping until `unmerge_adapter`.

Weights shared by several LoRA layers (tied embeddings / lm_head, tied kernels) cannot
take one layer's delta without changing the others: a slot with an adapter on such a
layer is refused, and with the slot empty those layers are left as they are.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.layers import BaseLayerWithLoRA, LoRASlotRanks, find_lora_context
from lora_jax.layers.embedding import VocabParallelEmbeddingWithLoRA
from lora_jax.layers.flax_embed import FlaxEmbedWithLoRA
from lora_jax.layers.flax_general import FlaxGeneralLinear, unmergeable_reason
from lora_jax.layers.flax_linear import FlaxLinearWithLoRA
from lora_jax.layers.logits import ParallelLMHeadWithLoRA, TiedLMHeadWithLoRA, _head_of
from lora_jax.layers.moe import FusedMoEWithLoRA
from lora_jax.linear import _KERNEL_AXES
from lora_jax.moe import _W2_AXES, _W13_AXES
from lora_jax.serving.wrap import lora_layers, reference_paths, unwrap_model
from lora_jax.sharding import shard_map

_TABLE_AXES = ("vocab", "embed")  # VocabParallelEmbedding / ParallelLMHead `[V_pad, D]`


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


def _pick(w: jax.Array, idx) -> jax.Array:
    """Slot `idx` of a stacked LoRA array, in f32."""
    return jax.lax.dynamic_index_in_dim(w, idx, 0, keepdims=False).astype(jnp.float32)


def _add(w: jax.Array, delta: jax.Array) -> jax.Array:
    return (w.astype(jnp.float32) + delta).astype(w.dtype)


def _linear_plan(layer: BaseLayerWithLoRA):
    """`kernel [in, out_physical] += (B @ A).T` per slice, per shard."""
    base = layer.base_layer
    rules = base.rules
    a_axes, b_axes = layer.lora_axes()
    tp_axis = rules.mesh_axis("tensor")
    sharded = layer.fully_sharded and tp_axis is not None and base.tp > 1
    row = base.parallel == "row"

    def local(k, a, b, idx):
        deltas = []
        for a_s, b_s in zip(a, b):
            a_rk, b_nr = _pick(a_s, idx), _pick(b_s, idx)  # [R(/tp), in_l], [out_l, R]
            if sharded and not row:
                a_rk = jax.lax.all_gather(a_rk, rules.mesh_axis(a_axes[1]), axis=0, tiled=True)
            if sharded and row:
                b_nr = jax.lax.all_gather(b_nr, tp_axis, axis=0, tiled=True)
            deltas.append((b_nr @ a_rk).T)  # [in_l, out_s_l]
        delta = jnp.concatenate(deltas, axis=1)
        if isinstance(base, FlaxGeneralLinear):  # the flat map → the source kernel's axes
            delta = base.kernel_delta(delta)
        return (_add(k, delta),)  # the local kernel layout

    n = len(layer.lora_a)
    k_axes = _KERNEL_AXES[base.parallel]
    specs = ((k_axes,), ((a_axes,) * n, (b_axes,) * n))
    lora = (tuple(v[...] for v in layer.lora_a), tuple(v[...] for v in layer.lora_b))
    return (base.kernel,), local, specs, lora


def _moe_plan(layer: FusedMoEWithLoRA):
    """`w13[e] += (B13 @ A13).T` (gate / up in the base's per-shard layout) and
    `w2[e] += (B2 @ A2).T`, per shard."""
    base = layer.base_layer
    rules = base.rules
    a13_axes, b13_axes, a2_axes, b2_axes = layer.lora_axes()
    tp_axis = rules.mesh_axis("tensor")
    sharded = layer.fully_sharded and tp_axis is not None and base.tp > 1
    interleave = len(layer.w13_lora_a) == 2 and base.gate_up_layout == "interleaved"

    def local(w13, w2, a13, b13, a2, b2, idx):
        deltas = []
        for a_s, b_s in zip(a13, b13):
            a = _pick(a_s, idx)  # [E_l, R(/tp), H]
            if sharded:
                a = jax.lax.all_gather(a, rules.mesh_axis(a13_axes[2]), axis=1, tiled=True)
            deltas.append(jnp.einsum("enr,erh->ehn", _pick(b_s, idx), a))  # [E_l, H, n_l]
        if interleave:  # gate at even, up at odd columns of each shard's range
            d13 = jnp.stack(deltas, axis=-1).reshape(*deltas[0].shape[:2], -1)
        else:  # [gate_i | up_i] (or the one fused / non-gated slice)
            d13 = jnp.concatenate(deltas, axis=-1)
        b = _pick(b2, idx)  # [E_l, H(/tp), R]
        if sharded:
            b = jax.lax.all_gather(b, tp_axis, axis=1, tiled=True)
        d2 = jnp.einsum("ehr,eri->eih", b, _pick(a2, idx))  # [E_l, I_l, H]
        return _add(w13, d13), _add(w2, d2)

    n = len(layer.w13_lora_a)
    specs = (
        (_W13_AXES, _W2_AXES),
        ((a13_axes,) * n, (b13_axes,) * n, a2_axes, b2_axes),
    )
    lora = (
        tuple(v[...] for v in layer.w13_lora_a),
        tuple(v[...] for v in layer.w13_lora_b),
        layer.w2_lora_a[...],
        layer.w2_lora_b[...],
    )
    return (base.w13, base.w2), local, specs, lora


def _embedding_plan(layer: VocabParallelEmbeddingWithLoRA):
    """`table [V_pad, D] += A.T @ B.T` (row v gains `B @ A[:, v]`), per shard."""

    def local(table, a, b, idx):
        return (_add(table, (_pick(b, idx) @ _pick(a, idx)).T),)  # [V_l, D_l]

    specs = ((_TABLE_AXES,), (layer.A_AXES, layer.B_AXES))
    return (layer.base_layer.embedding,), local, specs, (layer.lora_a[...], layer.lora_b[...])


def _lm_head_plan(layer: ParallelLMHeadWithLoRA):
    """`table [V_pad, D] += B @ A` (B already in the table's row order), per shard."""
    proc = layer.logits_processor

    def local(table, a, b, idx):
        return (_add(table, _pick(b, idx) @ _pick(a, idx)),)  # [V_l, D_l]

    specs = ((_TABLE_AXES,), (proc.A_AXES, proc.B_AXES))
    table = _head_of(layer.base_layer).embedding
    return (table,), local, specs, (proc.lora_a[...], proc.lora_b[...])


# Why a layer kind cannot be merged (when its slot holds an adapter).
def _unmergeable(layer) -> str | None:
    """Why a LoRA layer of a known kind cannot take its adapter into its weights, or None."""
    if isinstance(layer, FlaxEmbedWithLoRA):
        return (
            "a plain nnx.Embed's table may also be read through attend() as a tied lm_head, "
            "which merge_adapter cannot see"
        )
    if isinstance(getattr(layer, "base_layer", None), FlaxGeneralLinear):
        return unmergeable_reason(layer)
    if isinstance(layer, FlaxLinearWithLoRA):
        dot = getattr(layer.base_layer.source, "dot_general", jax.lax.dot_general)
        if dot is not jax.lax.dot_general:
            return (
                "its nnx.Linear computes with its own dot_general, which need not be linear "
                "in the kernel (a scaled or quantized matmul): B @ A added to the kernel "
                "would not give the served output"
            )
    return None


def _plan(layer):
    """`(weights, local_fn, (weight specs, lora specs), lora arrays)` for a mergeable layer,
    or None; `local_fn(*weights, *lora, slot)` gives the merged weights of one shard."""
    if _unmergeable(layer) is not None:
        return None
    if isinstance(layer, FusedMoEWithLoRA):
        return _moe_plan(layer)
    if isinstance(layer, BaseLayerWithLoRA):
        return _linear_plan(layer)
    if isinstance(layer, VocabParallelEmbeddingWithLoRA):
        return _embedding_plan(layer)
    if isinstance(layer, ParallelLMHeadWithLoRA):
        return _lm_head_plan(layer)
    return None


def _rules_of(layer):
    if isinstance(layer, ParallelLMHeadWithLoRA):
        return layer.logits_processor.rules
    return layer.base_layer.rules


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


def _slot_in_use(layer, slot: int) -> bool:
    """Whether any `LoRASlotRanks` inside `layer` records an adapter in `slot`."""
    return any(
        np.asarray(node.get_value())[..., slot].any()
        for _, node in nnx.iter_graph(layer)
        if isinstance(node, LoRASlotRanks)
    )


def _tied_table(model: nnx.Module) -> int | None:
    """`id` of the embedding table that a tied model reads both as its embedding and as
    its lm_head (as `wrap_model` knows them: `lm_head` None, or a `TiedLMHeadWithLoRA`,
    over `model.model.embed_tokens`), whichever of the two is LoRA-wrapped."""
    head = getattr(model, "lm_head", True)
    if isinstance(head, TiedLMHeadWithLoRA):
        return id(_head_of(head.base_layer).embedding)
    if head is not None:
        return None
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    table = getattr(getattr(emb, "base_layer", emb), "embedding", None)
    return None if table is None else id(table)


def _check_not_traced(all_layers: dict, what: str) -> None:
    """Merging edits the base weights in place, on the host: under a jax transform it
    would only change the trace (or fail on a traced rank table), so it is refused."""
    for name, layer in all_layers.items():
        for _, node in nnx.iter_graph(layer):
            if isinstance(node, LoRASlotRanks) and isinstance(node.get_value(), jax.core.Tracer):
                raise ValueError(
                    f"{what}: layer {name!r} is traced; merging edits the weights on the "
                    f"host, call {what} outside jit"
                )


def _slot_index(slot) -> int:
    """`slot` as a Python int: an int, a numpy integer (as `token_mapping` / `slot_of`
    values may come) or a concrete integer scalar array; never a bool or a traced value."""
    if isinstance(slot, (np.ndarray, jax.Array)) and not isinstance(slot, jax.core.Tracer):
        if slot.shape == () and np.issubdtype(slot.dtype, np.integer):
            return int(slot)
    elif isinstance(slot, (int, np.integer)) and not isinstance(slot, (bool, np.bool_)):
        return int(slot)
    raise ValueError(
        f"merge_adapter: slot must be a Python int or a concrete integer scalar (merging "
        f"runs outside jit), got {type(slot).__name__} {slot!r}"
    )


def merge_adapter(model: nnx.Module, slot: int) -> int:
    """Adds slot `slot`'s `B @ A` into every LoRA layer's base weights; returns how many
    layers were merged.

    Linears, fused MoE experts, vocab embeddings and lm_heads are merged. Raises
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
        for n in names:
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
