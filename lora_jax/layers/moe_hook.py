"""The per-shard LoRA math of one `FusedMoEWithLoRA` call: the hook `FusedMoE.experts_local`
calls at its two matmuls, and the `ragged_dot` shrink/expand of `lora_impl="ragged"`.

Fast path ("grouped"): the (token, expert) pairs, already sorted by expert for the base
`ragged_dot`, get a combined index `slot * E_local + expert` (-1 without adapter or for
another shard's expert), and the LoRA runs as Punica shrink/expand over the flattened
`[L * E_local, ...]` stacks: `lora_jax.ops` (Pallas kernels on GPU) when `lora_impl="ops"`,
or `jax.lax.ragged_dot` over pairs sorted by (slot, expert) when `lora_impl="ragged"`.
The "dense" base impl runs the per-token ops once per local expert (the reference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from lora_jax import ops
from lora_jax.mapping import LoRAMapping, make_lora_mapping
from lora_jax.moe_routing import ExpertRoutes

if TYPE_CHECKING:
    from lora_jax.layers.moe import FusedMoEWithLoRA


class _MoELoRAHook:
    """Per-shard LoRA of one MoE call; `FusedMoE.experts_local` calls it at its two matmuls."""

    def __init__(
        self,
        layer: FusedMoEWithLoRA,
        stacks,
        ranks,
        token_idx,
        *,
        is_prefill=None,
    ):
        self.layer = layer
        self.is_prefill = is_prefill  # the step's `LoRAMapping.is_prefill`, for the rows
        self.base = layer.base_layer
        self.a13, self.b13, self.a2, self.b2 = stacks
        self.num_local = self.a2.shape[1]
        self.max_loras = self.a2.shape[0]
        self.ranks = ranks  # [S13 + 1, L]
        self.token_idx = token_idx  # i32[T_local]
        self.tp_axis = self.base.rules.mesh_axis("tensor")
        self.rank_sharded = layer.fully_sharded and self.tp_axis is not None and self.base.tp > 1

    # Rows are either the sorted pairs of the grouped impl (expert=None, flattened
    # [L * E_local] stacks, combined index) or all tokens for one expert (dense impl).
    def rows(self, *, routes: ExpertRoutes | None = None, expert=None):
        if routes is None:
            m = make_lora_mapping(self.token_idx, self.max_loras, is_prefill=self.is_prefill)
            return m, expert
        slot = self.token_idx[routes.pair_token]  # [P]
        combined = jnp.where(
            (slot >= 0) & routes.local, slot * self.num_local + routes.pair_expert, -1
        )
        combos = self.max_loras * self.num_local
        return make_lora_mapping(combined, combos, is_prefill=self.is_prefill), None

    def _stack(self, w, expert):
        if expert is None:
            return w.reshape(-1, *w.shape[2:])  # [L * E_local, ., .], index slot * E + e
        return jax.lax.dynamic_index_in_dim(w, expert, axis=1, keepdims=False)  # [L, ., .]

    def _ranks(self, rows, which):
        ranks = self.ranks[which]
        return ranks if rows[1] is not None else jnp.repeat(ranks, self.num_local, axis=1)

    def _shrink(self, x, a, rows, ranks):
        m, expert = rows
        a = [self._stack(w, expert) for w in a]
        if self.layer.lora_impl == "ragged" and expert is None:
            return _ragged_shrink(x, a, m)
        return ops.lora_shrink(x, a, m, 1.0, slot_ranks=ranks, backend=self.layer.ops_backend)

    def _expand(self, y, h, b, rows, ranks, offsets):
        m, expert = rows
        b = [self._stack(w, expert) for w in b]
        if self.layer.lora_impl == "ragged" and expert is None:
            return _ragged_expand(y, h, b, m, offsets)
        return ops.lora_expand(
            y, h, b, m, offsets=offsets, slot_ranks=ranks, backend=self.layer.ops_backend
        )

    def w13(self, g, x, rows):
        """Adds the w1/w3 (or fused w13) LoRA into the local w13 output `g [P, w13_local]`."""
        n_s = len(self.a13)
        ranks = self._ranks(rows, slice(0, n_s))
        h = self._shrink(x, self.a13, rows, None if self.rank_sharded else ranks)  # [S, P, R/tp]
        if self.rank_sharded:
            h = jax.lax.all_gather(h, self.tp_axis, axis=2, tiled=True)  # [S, P, R]
        widths = [b.shape[2] for b in self.b13]
        interleave = n_s == 2 and self.base.gate_up_layout == "interleaved"
        if not interleave:
            offsets = tuple(int(o) for o in np.cumsum([0, *widths[:-1]]))
            return self._expand(g, h, self.b13, rows, ranks, offsets)
        # Separate gate/up LoRAs on an interleaved base: expand into [gate | up], interleave.
        d = self._expand(jnp.zeros(g.shape, jnp.float32), h, self.b13, rows, ranks, (0, widths[0]))
        d = d.reshape(g.shape[0], 2, -1).transpose(0, 2, 1).reshape(g.shape)
        return (g.astype(jnp.float32) + d).astype(g.dtype)

    def w2(self, o, a, rows):
        """Adds the w2 LoRA into the local (partial) w2 output `o [P, hidden]`."""
        ranks = self._ranks(rows, slice(-1, None))
        h = self._shrink(a, [self.a2], rows, ranks)  # partial over tensor shards [1, P, R]
        if not (self.layer.fully_sharded and self.tp_axis is not None and self.base.tp > 1):
            return self._expand(o, h, [self.b2], rows, ranks, (0,))
        h = jax.lax.psum(h, self.tp_axis)
        width = self.b2.shape[2]  # hidden / tp
        d = self._expand(
            jnp.zeros((o.shape[0], width), jnp.float32), h, [self.b2], rows, ranks, (0,)
        )
        off = jax.lax.axis_index(self.tp_axis) * width
        cols = jax.lax.dynamic_slice_in_dim(o, off, width, axis=1)
        cols = (cols.astype(jnp.float32) + d).astype(o.dtype)
        return jax.lax.dynamic_update_slice_in_dim(o, cols, off, axis=1)


def _ragged_shrink(x, lora_a, m: LoRAMapping) -> jax.Array:
    """`ops.lora_shrink` via `ragged_dot` over rows sorted by slot; f32 `[S, P, R]`."""
    order = m.sorted_token_ids
    xs = x[order]  # [P, H]; rows without a slot sort last and fall outside every group
    outs = []
    for a in lora_a:
        dt = jnp.promote_types(xs.dtype, a.dtype)  # as the ops' shrink: f32 A stays f32
        hs = jax.lax.ragged_dot(
            xs.astype(dt),
            jnp.swapaxes(a, 1, 2).astype(dt),
            m.slot_token_counts,
            preferred_element_type=jnp.float32,
        )  # [P, R]
        outs.append(jnp.zeros_like(hs).at[order].set(hs))
    return jnp.stack(outs)


def _ragged_expand(y, h, lora_b, m: LoRAMapping, offsets) -> jax.Array:
    """`ops.lora_expand` via `ragged_dot`; rows without a slot stay bit-identical."""
    order = m.sorted_token_ids
    keep = (m.token_lora_indices >= 0)[:, None]
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        # as the ops' expand: h rounds to B's bf16 / f16 only for a y that is not f32
        low = b.dtype in (jnp.bfloat16, jnp.float16) and y.dtype != jnp.float32
        cdt = b.dtype if low else jnp.float32
        hs = h[s][order].astype(cdt)  # [P, R]
        d = jax.lax.ragged_dot(
            hs,
            jnp.swapaxes(b, 1, 2).astype(cdt),
            m.slot_token_counts,
            preferred_element_type=jnp.float32,
        )  # [P, n]
        d = jnp.zeros_like(d).at[order].set(d)
        cols = y[:, off : off + b.shape[1]]
        new = (cols.astype(jnp.float32) + d).astype(y.dtype)
        y = ops.set_columns(y, off, jnp.where(keep, new, cols))
    return y
