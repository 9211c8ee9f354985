"""How each LoRA layer kind folds a slot's `B @ A` into its base weights (`merge_adapter`).

A plan is `(weights, local_fn, (weight specs, lora specs), lora arrays)`: the base weight
variables to change, a function giving one shard's merged weights in the weight's own
physical layout, the logical axes both are sharded over, and the stacked LoRA arrays.
A DoRA slot's linear kernels (and embedding tables) also take its per-output-unit gain.
`_plan(layer)` picks the plan for a layer's kind (linears, fused MoE experts, vocab
embeddings, lm_heads), or None where `_unmergeable(layer)` says why it cannot be merged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lora_jax.layers import BaseLayerWithLoRA
from lora_jax.layers.dora import dora_axes, dora_gain, has_dora
from lora_jax.layers.embedding import VocabParallelEmbeddingWithLoRA
from lora_jax.layers.flax_embed import FlaxEmbedWithLoRA
from lora_jax.layers.flax_general import FlaxGeneralLinear, unmergeable_reason
from lora_jax.layers.flax_linear import FlaxLinearWithLoRA
from lora_jax.layers.logits import ParallelLMHeadWithLoRA, _head_of
from lora_jax.layers.logits_processor import sharded_to_full_mapping
from lora_jax.layers.moe import FusedMoEWithLoRA
from lora_jax.layers.token_rows import token_row_args
from lora_jax.linear import _KERNEL_AXES
from lora_jax.moe import _W2_AXES, _W13_AXES

_TABLE_AXES = ("vocab", "embed")  # VocabParallelEmbedding / ParallelLMHead `[V_pad, D]`


def _pick(w: jax.Array, idx) -> jax.Array:
    """Slot `idx` of a stacked LoRA array, in f32."""
    return jax.lax.dynamic_index_in_dim(w, idx, 0, keepdims=False).astype(jnp.float32)


def _add(w: jax.Array, delta: jax.Array) -> jax.Array:
    return (w.astype(jnp.float32) + delta).astype(w.dtype)


def _linear_plan(layer: BaseLayerWithLoRA, norms: bool = False):
    """`kernel [in, out_physical] += (B @ A).T` per slice, per shard; a DoRA slot's kernel
    then times its gain `g = magnitude / ||W + B @ A||` per output unit, the norm taken
    here from the merged kernel (PEFT's DoRA merge: `g ⊙ (W + B @ A)`, the bias as it
    was). ``norms=True``: the local function gives that norm `[out_l]` instead (f32, the
    DoRA stacks not passed)."""
    base = layer.base_layer
    rules = base.rules
    a_axes, b_axes = layer.lora_axes()
    tp_axis = rules.mesh_axis("tensor")
    sharded = layer.fully_sharded and tp_axis is not None and base.tp > 1
    row = base.parallel == "row"

    def column_norms(w):  # [in_l, out_l] → [out_l], over the whole input dim
        sq = jnp.sum(jnp.square(w), axis=0)
        return jnp.sqrt(jax.lax.psum(sq, tp_axis) if row and tp_axis and base.tp > 1 else sq)

    def local(k, a, b, *dora_idx):
        *dora, idx = dora_idx
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
        if norms:
            return column_norms(k.astype(jnp.float32) + delta)
        if not dora:
            return (_add(k, delta),)  # the local kernel layout
        w = k.astype(jnp.float32) + delta
        on = _pick(dora[1], idx) > 0  # [out_l]: the slot's DoRA units (the rest: gain 1)
        g = dora_gain(_pick(dora[0], idx), jnp.where(on, column_norms(w), 0.0))
        return ((w * g).astype(k.dtype),)

    n = len(layer.lora_a)
    k_axes = _KERNEL_AXES[base.parallel]
    lora = (tuple(v[...] for v in layer.lora_a), tuple(v[...] for v in layer.lora_b))
    l_specs = ((a_axes,) * n, (b_axes,) * n)
    if has_dora(layer) and not norms:
        lora += (layer.dora_magnitude[...], layer.dora_norm[...])
        l_specs += (dora_axes(base),) * 2
    return (base.kernel,), local, ((k_axes,), l_specs), lora


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
    """`table [V_pad, D] += A.T @ B.T` (row v gains `B @ A[:, v]`), per shard; a DoRA
    slot's table then times its gain per embedding unit, the norm over the vocab taken
    here from the merged table (PEFT's DoRA merge: `g ⊙ (W + (B @ A)ᵀ)`); then the slot's
    trainable-token rows replace their ids' rows."""
    base = layer.base_layer
    rules = base.rules
    vocab_axis = rules.collective_axis("vocab")
    tok, tok_specs = token_row_args(layer)
    dora, dora_specs = layer._dora_args()
    n_dora = len(dora)

    def column_norms(w):  # [V_l, D_l] → [D_l], over the real (unpadded) vocab
        start = 0 if vocab_axis is None else jax.lax.axis_index(vocab_axis) * w.shape[0]
        real = start + jnp.arange(w.shape[0]) < base.num_embeddings
        sq = jnp.sum(jnp.where(real[:, None], jnp.square(w), 0.0), axis=0)
        return jnp.sqrt(sq if vocab_axis is None else jax.lax.psum(sq, vocab_axis))

    def local(table, a, b, *rest):
        dora, (*tok, idx) = rest[:n_dora], rest[n_dora:]
        w = table.astype(jnp.float32) + (_pick(b, idx) @ _pick(a, idx)).T  # [V_l, D_l]
        if dora:
            on = _pick(dora[1], idx) > 0  # [D_l]: the slot's DoRA units (the rest: gain 1)
            w = w * dora_gain(_pick(dora[0], idx), jnp.where(on, column_norms(w), 0.0))
        merged = w.astype(table.dtype)
        return (_replace_rows(merged, *tok, idx, rules) if tok else merged,)

    specs = ((_TABLE_AXES,), (layer.A_AXES, layer.B_AXES, *dora_specs, *tok_specs))
    lora = (layer.lora_a[...], layer.lora_b[...], *dora, *tok)
    return (base.embedding,), local, specs, lora


def _lm_head_plan(layer: ParallelLMHeadWithLoRA):
    """`table [V_pad, D] += B @ A` (B already in the table's row order), per shard; a DoRA
    slot's rows then times their gains (the norm over the hidden dim); then an untied
    head's trainable-token rows replace their ids' rows (a tied head's are the
    embedding's, merged there)."""
    proc = layer.logits_processor
    rules = proc.rules
    embed_axis = rules.collective_axis("embed")
    tok, tok_specs = token_row_args(proc) if layer.token_ids is not None else ((), ())
    if tok and sharded_to_full_mapping(layer.base_layer) is not None:
        tok, tok_specs = (), ()  # rows not in token order: `_check_token_rows` refuses
    dora, dora_specs = proc._dora_args()
    n_dora = len(dora)

    def row_norms(w):  # [V_l, D_l] → [V_l], over the whole hidden dim
        sq = jnp.sum(jnp.square(w), axis=1)
        return jnp.sqrt(sq if embed_axis is None else jax.lax.psum(sq, embed_axis))

    def local(table, a, b, *rest):
        dora, (*tok, idx) = rest[:n_dora], rest[n_dora:]
        w = table.astype(jnp.float32) + _pick(b, idx) @ _pick(a, idx)  # [V_l, D_l]
        if dora:  # PEFT's DoRA merge of a Linear: `g ⊙ (W + B @ A)` per row (vocab id)
            on = _pick(dora[1], idx) > 0  # [V_l]: the slot's DoRA rows (the rest: gain 1)
            w = w * dora_gain(_pick(dora[0], idx), jnp.where(on, row_norms(w), 0.0))[:, None]
        merged = w.astype(table.dtype)
        return (_replace_rows(merged, *tok, idx, rules) if tok else merged,)

    specs = ((_TABLE_AXES,), (proc.A_AXES, proc.B_AXES, *dora_specs, *tok_specs))
    table = _head_of(layer.base_layer).embedding
    return (table,), local, specs, (proc.lora_a[...], proc.lora_b[...], *dora, *tok)


def _replace_rows(table, ids, rows, idx, rules):
    """One shard's table `[V_l, D_l]` with slot `idx`'s trainable-token rows in place of
    its ids' rows (`ids [L, M]` id + 1, 0 unused; `rows [L, M, D_l]`)."""
    t_ids = jax.lax.dynamic_index_in_dim(ids, idx, 0, keepdims=False) - 1  # [M]
    V_l = table.shape[0]
    axis = rules.mesh_axis("vocab")
    local = t_ids - (0 if axis is None else jax.lax.axis_index(axis) * V_l)
    local = jnp.where((t_ids >= 0) & (local >= 0) & (local < V_l), local, V_l)
    return table.at[local].set(_pick(rows, idx).astype(table.dtype), mode="drop")


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
