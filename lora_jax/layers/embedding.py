"""`VocabParallelEmbeddingWithLoRA`: per-token LoRA on a vocab-sharded token embedding.

PEFT's embedding LoRA has no shrink matmul: `lora_embedding_A [r, V]` is a lookup table
whose column `A[:, id]` is the token's rank-r code, and `lora_embedding_B [D, r]` expands
it, `y = emb(id) + B @ A[:, id]` (scaling folded into B). vLLM keeps that: a gather of
A's column followed by `add_lora_embedding` (an expand).

Here A is stacked as `lora_a [max_loras, max_rank, V_pad]` and sharded on vocab like the
table, B as `lora_b [max_loras, D, max_rank]` (replicated). Each vocab shard gathers the
rows and A columns of the ids it owns (others give 0), expands its A code with B into
its partial output, and the one all-reduce of the base embedding sums the shards: the
LoRA adds no collective. Tokens whose slot is -1 get exactly the base embedding.
A DoRA slot (PEFT `use_dora`, PEFT's `DoraEmbeddingLayer`) scales each token's summed
row by `g = magnitude / ||W + B @ A||` per embedding unit, the norm over the vocab taken
when the slot is written (`dora_norms`) and kept, as the linear layers keep theirs
(`lora_jax.layers.dora`).
A slot's trainable tokens (`lora_jax.layers.token_rows`) then replace the summed rows of
their ids, and, through `attend` (a tied lm_head), the logits columns of those ids.

`token_logits` and `row_slots` are shared with `lora_jax.layers.logits`; the slot writes
(DoRA's too) are `lora_jax.layers.vocab_slots`'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax import ops
from lora_jax.config import LoRAConfig
from lora_jax.layers.base import LoRAContext, LoRASlotRanks
from lora_jax.layers.dora import apply_dora
from lora_jax.layers.token_rows import (
    TokenRowsMixin,
    replace_columns,
    replace_rows,
    replacement_logits,
    token_row_args,
)
from lora_jax.layers.vocab_slots import (
    VocabDoRAMixin,
    VocabSlotsMixin,
    as_matrix,
    check_rank,
    dora_unit_norms,
)
from lora_jax.mapping import LoRAMapping
from lora_jax.sharding import shard_map
from lora_jax.vocab import ParallelLMHead, VocabParallelEmbedding

# -- the layer ----------------------------------------------------------------------------


class VocabParallelEmbeddingWithLoRA(VocabSlotsMixin, VocabDoRAMixin, TokenRowsMixin, nnx.Module):
    """LoRA around a `VocabParallelEmbedding` (not an lm_head), per-token slots.

    Example:
        >>> base = VocabParallelEmbedding(100, 16, rngs=nnx.Rngs(0))
        >>> emb = VocabParallelEmbeddingWithLoRA(base, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> emb.set_lora(1, np.ones((4, 100)), np.ones((16, 4)))  # A [r, V], B [D, r]
        >>> set_lora_mapping(emb, jnp.array([1, -1, 0], jnp.int32))  # doctest: +SKIP
        >>> emb(jnp.array([5, 5, 7])).shape  # doctest: +SKIP
        (3, 16)
    """

    def __init__(
        self,
        base_layer: VocabParallelEmbedding,
        lora_config: LoRAConfig,
        context: LoRAContext | None = None,
        *,
        name: str | None = None,
    ):
        self.name = name or type(self).__name__
        if not isinstance(base_layer, VocabParallelEmbedding) or isinstance(
            base_layer, ParallelLMHead
        ):
            raise ValueError(
                f"{self.name}: base layer must be a VocabParallelEmbedding (not an lm_head), "
                f"got {type(base_layer).__name__}"
            )
        self.base_layer = base_layer
        self.lora_config = lora_config
        self.lora_context = context if context is not None else LoRAContext(None)
        rules = base_layer.rules
        rules.check_lora_axes(self.name, False)
        L, R = lora_config.max_loras, lora_config.max_lora_rank
        dtype = lora_config.dtype_for(base_layer.param_dtype)
        self.lora_dtype = dtype
        V_pad, D = base_layer.num_embeddings_padded, base_layer.embedding_dim
        self.lora_a = nnx.LoRAParam(
            rules.place(jnp.zeros((L, R, V_pad), dtype), *self.A_AXES)
        )  # [max_loras, max_rank, V_pad], a lookup table over token ids
        self.lora_b = nnx.LoRAParam(
            rules.place(jnp.zeros((L, D, R), dtype), *self.B_AXES)
        )  # [max_loras, D, max_rank]
        ranks = jnp.zeros((1, L), jnp.int32)  # [1 slice, max_loras]
        self.slot_ranks = LoRASlotRanks(rules.place(ranks, None, None))
        self._init_token_rows(
            lora_config, base_layer.num_embeddings, D, base_layer.param_dtype, rules
        )
        self._init_dora(D, rules)  # DoRA: `f32[max_loras, D]` magnitudes and norms

    A_AXES = ("lora_slot", "lora_rank", "vocab")
    B_AXES = ("lora_slot", "embed", "lora_rank")
    DORA_AXES = ("lora_slot", "embed")

    # -- vLLM API -------------------------------------------------------------------------
    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ) -> bool:
        return isinstance(source_layer, VocabParallelEmbedding) and not isinstance(
            source_layer, ParallelLMHead
        )

    @property
    def num_embeddings(self) -> int:
        return self.base_layer.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.base_layer.embedding_dim

    @property
    def embedding(self) -> nnx.Param:
        """The base table `[V_pad, D]` (tied lm_heads read it through the wrapper)."""
        return self.base_layer.embedding

    def _layout(self, lora_a, lora_b):
        """PEFT's `lora_embedding_A [r, V]` → `[R, V_pad]`, `lora_embedding_B [D, r]` → `[D, R]`."""
        base, R = self.base_layer, self.lora_config.max_lora_rank
        V, V_pad, D = base.num_embeddings, base.num_embeddings_padded, base.embedding_dim
        a = as_matrix(self.name, "lora_a (lora_embedding_A)", lora_a, (None, V))
        b = as_matrix(self.name, "lora_b (lora_embedding_B)", lora_b, (D, None))
        r = a.shape[0]
        check_rank(self.name, r, R, ("lora_b", b.shape[1]))
        return np.pad(a, ((0, R - r), (0, V_pad - V))), np.pad(b, ((0, 0), (0, R - r))), r

    def _unlayout(self, a, b, rank):
        """`[R, V_pad]`, `[D, R]` → `lora_embedding_A [r, V]`, `lora_embedding_B [D, r]`."""
        return a[:rank, : self.base_layer.num_embeddings], b[:, :rank]

    # -- DoRA -----------------------------------------------------------------------------
    @property
    def logical_slice_sizes(self) -> tuple[int]:
        return (self.base_layer.embedding_dim,)

    def dora_norms(self, slot) -> jax.Array:
        """`||W + B @ A||` per embedding unit `f32[D]` of slot `slot` (an int or traced):
        the norm over the vocab of each column of the table plus the slot's `(B @ A)ᵀ`,
        as PEFT's `DoraEmbeddingLayer` takes it. No `[V, D]` is formed: it is
        `||W_d||² + 2 Σ_r B[d, r] (A W)[r, d] + (B A Aᵀ Bᵀ)_dd`, each term summed over the
        vocab shards."""
        base = self.base_layer
        rules = base.rules
        axis = rules.collective_axis("vocab")
        local_v = base.num_embeddings_padded // base.shards

        def local(table, a_l, b_l, slot):  # [V_l, D_l], [L, R, V_l], [L, D_l, R]
            start = 0 if axis is None else jax.lax.axis_index(axis) * local_v
            real = start + jnp.arange(table.shape[0]) < base.num_embeddings  # [V_l]
            a = jax.lax.dynamic_index_in_dim(a_l, slot, 0, keepdims=False)  # [R, V_l]
            b = jax.lax.dynamic_index_in_dim(b_l, slot, 0, keepdims=False)  # [D_l, R]
            return dora_unit_norms(table, a, b, 0, axis, real[:, None])  # [D_l]

        args = (base.embedding[...], self.lora_a[...], self.lora_b[...])
        slot = jnp.asarray(slot, jnp.int32)
        if rules.mesh is None:
            return local(*args, slot)
        specs = (("vocab", "embed"), self.A_AXES, self.B_AXES, ())
        return shard_map(rules, local, specs, ("embed",))(*args, slot)

    # -- forward --------------------------------------------------------------------------
    def attend(self, x: jax.Array, gather: bool = False) -> jax.Array:
        """The base table's logits (a tied lm_head; PEFT's embedding LoRA does not touch it),
        with each row's slot's trainable-token columns from its rows (PEFT ties them)."""
        logits = self.base_layer.attend(x, gather=gather)
        mapping = self.lora_context.get_value()
        if mapping is None or self.token_ids is None or not gather:
            return logits
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        slots = row_slots(self.name, mapping, x2.shape[0])
        flat = logits.reshape(x2.shape[0], -1)
        values = token_logits(self.base_layer.rules, self, x2, slots, flat.dtype)
        return replace_columns(flat, values, slots, self.token_ids[...]).reshape(*lead, -1)

    def __call__(self, ids: jax.Array) -> jax.Array:
        base = self.base_layer
        mapping = self.lora_context.get_value()
        if mapping is None:
            return base(ids)
        lead = ids.shape
        flat = ids.reshape(-1).astype(jnp.int32)  # [T]
        if mapping.num_tokens != flat.shape[0]:
            raise ValueError(
                f"{self.name}: the LoRA mapping has {mapping.num_tokens} tokens but the input "
                f"has {flat.shape[0]} (ids shape {lead})"
            )
        rules = base.rules
        axis = rules.collective_axis("vocab")
        local_v = base.num_embeddings_padded // base.shards
        tok_args, tok_specs = token_row_args(self)
        dora_args, dora_specs = self._dora_args()
        args = (
            flat,
            base.embedding[...],
            self.lora_a[...],
            self.lora_b[...],
            self.slot_ranks[...],
            mapping,
            *dora_args,
            *tok_args,
        )
        n_dora = len(dora_args)

        def local(ids_l, table_l, a_l, b, ranks, m: LoRAMapping, *rest):
            dora, tok = rest[:n_dora], rest[n_dora:]
            start = 0 if axis is None else jax.lax.axis_index(axis) * local_v
            rel = ids_l - start
            own = (rel >= 0) & (rel < local_v)
            safe = jnp.where(own, rel, 0)
            y = jnp.where(own[:, None], jnp.take(table_l, safe, axis=0), 0)  # [T, D] partial
            y = y.astype(base.dtype or base.param_dtype)  # the LoRA adds in the compute dtype
            slot = m.token_lora_indices
            code = a_l[jnp.maximum(slot, 0), :, safe]  # [T, R]: the A column of each id
            code = jnp.where((own & (slot >= 0))[:, None], code.astype(jnp.float32), 0.0)
            y = ops.lora_expand(y, code[None], (b,), m, offsets=(0,), slot_ranks=ranks)
            y = y if axis is None else jax.lax.psum(y, axis)
            if dora:  # each DoRA slot's gain per embedding unit
                y = apply_dora(y, *dora, slot)
            if tok:  # an adapter's trainable tokens embed to its own rows
                y = replace_rows(y, ids_l, slot, *tok)
            return y

        if rules.mesh is None:
            out = local(*args)
        else:
            specs = (
                (None,),
                ("vocab", "embed"),
                self.A_AXES,
                self.B_AXES,
                (None, None),
                jax.tree.map(lambda _: (), mapping),
                *dora_specs,
                *tok_specs,
            )
            out = shard_map(rules, local, specs, (None, "embed"))(*args)
        return out.astype(base.dtype or base.param_dtype).reshape(*lead, -1)


def row_slots(name: str, mapping: LoRAMapping, num_rows: int) -> jax.Array:
    """The slot of each logits row: its sequence's (the sampler mapping) when the rows are
    sequences, its token's when they are tokens."""
    seq = mapping.seq_lora_indices
    if seq is not None and seq.shape[0] == num_rows:
        return seq
    if mapping.num_tokens == num_rows:
        return mapping.token_lora_indices
    have = "none" if seq is None else str(seq.shape[0])
    raise ValueError(
        f"{name}: {num_rows} hidden-state rows match neither the mapping's sequences "
        f"({have}) nor its tokens ({mapping.num_tokens})"
    )


def token_logits(rules, layer, x: jax.Array, slots: jax.Array, dtype) -> jax.Array:
    """`[N, M]` f32: each row of `x [N, D]` dotted with its slot's trainable-token rows of
    `layer` (D split on "embed": the partial dots are summed)."""
    embed_axis = rules.collective_axis("embed")

    def local(x, slots, rows):
        v = replacement_logits(x.astype(dtype), slots, rows)
        return v if embed_axis is None else jax.lax.psum(v, embed_axis)

    args = (x, slots, layer.token_rows[...])
    if rules.mesh is None:
        return local(*args)
    specs = ((None, "embed"), (None,), ("lora_slot", None, "embed"))
    return shard_map(rules, local, specs, (None, None))(*args)
