"""`LogitsProcessorWithLoRA`: the lm_head LoRA of vLLM's logits layer (see
`lora_jax.layers.logits` for the design): per-sequence slots whose `(hidden @ A[s].T) @ B[s].T`
joins each vocab shard's logits before the one all-gather, then soft cap and scale.
`VocabRowOrder` keeps B in the lm_head's row order for heads whose rows are not in token order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax import ops
from lora_jax.config import MAX_LORA_VOCAB_SIZE, LoRAConfig
from lora_jax.layers.base import LoRAContext, LoRASlotRanks, check_mapping_slots
from lora_jax.layers.dora import apply_dora
from lora_jax.layers.embedding import row_slots, token_logits
from lora_jax.layers.logits_processor import LogitsProcessor, _head_of, sharded_to_full_mapping
from lora_jax.layers.token_rows import TokenRowsMixin, has_token_rows, replace_columns
from lora_jax.layers.vocab_slots import VocabSlotsMixin, as_matrix, check_rank, dora_unit_norms
from lora_jax.mapping import LoRAMapping, make_lora_mapping
from lora_jax.sharding import shard_map
from lora_jax.vocab import ParallelLMHead as ParallelLMHead  # for the docstring examples
from lora_jax.vocab import VocabParallelEmbedding


class VocabRowOrder(nnx.Variable):
    """`i32[V]`: the lm_head table row (gathered logits column) of each token id, for a
    head that keeps its rows in another order (`get_sharded_to_full_mapping`)."""


class LogitsProcessorWithLoRA(VocabSlotsMixin, TokenRowsMixin, nnx.Module):
    """vLLM's lm_head LoRA: per-sequence slots added to the logits before soft cap/scale.

    Built next to the lm_head it will be called with (its vocab padding and mesh fix the
    stacks' shapes); called like `LogitsProcessor`: `layer(lm_head, hidden_states)`.

    Example:
        >>> head = ParallelLMHead(100, 16, rngs=nnx.Rngs(0))
        >>> lp = LogitsProcessorWithLoRA(LogitsProcessor(100), head, LoRAConfig(max_loras=2))
        >>> lp.set_lora(0, np.ones((8, 16)), np.ones((100, 8)))  # A [r, D], B [V, r]
        >>> set_lora_mapping(lp, jnp.zeros(3, jnp.int32), jnp.array([0, -1]))  # doctest: +SKIP
        >>> lp(head, jnp.ones((2, 16))).shape  # doctest: +SKIP
        (2, 100)
    """

    A_AXES = ("lora_slot", "lora_rank", "embed")
    B_AXES = ("lora_slot", "vocab", "lora_rank")
    DORA_AXES = ("lora_slot", "vocab")  # per lm_head row, in the head's row order

    def __init__(
        self,
        base_layer: LogitsProcessor,
        lm_head: VocabParallelEmbedding,
        lora_config: LoRAConfig,
        context: LoRAContext | None = None,
        *,
        name: str | None = None,
    ):
        self.name = name or type(self).__name__
        if not isinstance(base_layer, LogitsProcessor):
            raise ValueError(
                f"{self.name}: base layer must be a LogitsProcessor, got "
                f"{type(base_layer).__name__}"
            )
        head = _head_of(lm_head)
        if base_layer.vocab_size > MAX_LORA_VOCAB_SIZE:
            raise ValueError(
                f"{self.name}: when using LoRA, vocab size must be <= {MAX_LORA_VOCAB_SIZE}, "
                f"got {base_layer.vocab_size}"
            )
        if base_layer.vocab_size > head.num_embeddings:
            raise ValueError(
                f"{self.name}: vocab size {base_layer.vocab_size} exceeds the lm_head's "
                f"{head.num_embeddings} rows"
            )
        self.base_layer = base_layer
        self.lora_config = lora_config
        self.lora_context = context if context is not None else LoRAContext(None)
        self.hidden_size = head.embedding_dim
        self.vocab_padded = head.num_embeddings_padded
        self.rules = head.rules
        self.rules.check_lora_axes(self.name, False)
        L, R = lora_config.max_loras, lora_config.max_lora_rank
        dtype = lora_config.dtype_for(head.param_dtype)
        self.lora_dtype = dtype
        self.lora_a = nnx.LoRAParam(
            self.rules.place(jnp.zeros((L, R, self.hidden_size), dtype), *self.A_AXES)
        )  # [max_loras, max_rank, D]
        self.lora_b = nnx.LoRAParam(
            self.rules.place(jnp.zeros((L, self.vocab_padded, R), dtype), *self.B_AXES)
        )  # [max_loras, V_pad, max_rank], vocab-sharded like the lm_head
        ranks = jnp.zeros((1, L), jnp.int32)  # [1 slice, max_loras]
        self.slot_ranks = LoRASlotRanks(self.rules.place(ranks, None, None))
        rows = self._row_order(head, base_layer.vocab_size)
        self.b_rows = None if rows is None else VocabRowOrder(self.rules.place(rows, None))
        self._init_dora(self.vocab_padded, self.rules)  # DoRA: `f32[max_loras, V_pad]` each
        # an untied lm_head's trainable tokens (a tied one reads the embedding's)
        self._init_token_rows(
            lora_config, base_layer.org_vocab_size, self.hidden_size, head.param_dtype, self.rules
        )

    # -- vLLM API -------------------------------------------------------------------------
    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ) -> bool:
        return False  # the logits layer is wrapped specially, as in vLLM

    @property
    def vocab_size(self) -> int:
        return self.base_layer.vocab_size

    @property
    def org_vocab_size(self) -> int:
        return self.base_layer.org_vocab_size

    @property
    def scale(self) -> float:
        return self.base_layer.scale

    @property
    def soft_cap(self) -> float | None:
        return self.base_layer.soft_cap

    @property
    def logits_as_input(self) -> bool:
        return self.base_layer.logits_as_input

    def _row_order(self, head, vocab: int) -> jax.Array | None:
        """The head's row of each token id, or None when rows are in token order."""
        full = sharded_to_full_mapping(head)
        if full is None:
            return None
        rows = np.asarray(full)[:vocab]
        if (
            rows.ndim != 1
            or rows.shape[0] != vocab
            or not np.issubdtype(rows.dtype, np.integer)
            or rows.min() < 0
            or rows.max() >= self.vocab_padded
            or np.unique(rows).size != vocab
        ):
            raise ValueError(
                f"{self.name}: the lm_head's get_sharded_to_full_mapping() must give {vocab} "
                f"distinct integer rows in [0, {self.vocab_padded}), got shape "
                f"{np.shape(full)} ({np.asarray(full).dtype})"
            )
        return None if np.array_equal(rows, np.arange(vocab)) else jnp.asarray(rows, jnp.int32)

    def _layout(self, lora_a, lora_b):
        """PEFT's lm_head `lora_A [r, D]` → `[R, D]`, `lora_B [V, r]` (token order) →
        `[V_pad, R]` in the lm_head's row order."""
        V, V_pad, D = self.vocab_size, self.vocab_padded, self.hidden_size
        R = self.lora_config.max_lora_rank
        a = as_matrix(self.name, "lora_a", lora_a, (None, D))
        b = as_matrix(self.name, "lora_b", lora_b, (V, None))
        r = a.shape[0]
        check_rank(self.name, r, R, ("lora_b", b.shape[1]))
        b_rows = np.zeros((V_pad, R), b.dtype)  # [V_pad, R]
        b_rows[np.arange(V) if self.b_rows is None else np.asarray(self.b_rows[...]), :r] = b
        return np.pad(a, ((0, R - r), (0, 0))), b_rows, r

    def _unlayout(self, a, b, rank):
        """`[R, D]`, `[V_pad, R]` (head row order) → `lora_A [r, D]`, `lora_B [V, r]`."""
        rows = np.arange(self.vocab_size) if self.b_rows is None else np.asarray(self.b_rows[...])
        return a[:rank], b[rows, :rank]

    # -- forward --------------------------------------------------------------------------
    def row_lora_indices(self, mapping: LoRAMapping, num_rows: int) -> jax.Array:
        """The slot of each logits row: per sequence (sampler mapping) when the rows are
        sequences, per token when they are tokens."""
        return row_slots(self.name, mapping, num_rows)

    def _check_head(self, head: VocabParallelEmbedding) -> None:
        if (head.num_embeddings_padded, head.embedding_dim) != (
            self.vocab_padded,
            self.hidden_size,
        ):
            raise ValueError(
                f"{self.name}: called with an lm_head of {head.num_embeddings_padded}x"
                f"{head.embedding_dim} (padded) but built for "
                f"{self.vocab_padded}x{self.hidden_size}"
            )
        if head.rules.mesh != self.rules.mesh:
            raise ValueError(f"{self.name}: the lm_head lives on another mesh than the LoRA stacks")

    def _get_logits(self, hidden_states, lm_head, embedding_bias=None) -> jax.Array:
        mapping = self.lora_context.get_value()
        if mapping is None:
            return self.base_layer._get_logits(hidden_states, lm_head, embedding_bias)
        head = _head_of(lm_head)
        self._check_head(head)
        self.base_layer._check_head(head, hidden_states)
        lead = hidden_states.shape[:-1]
        dtype = head.dtype or hidden_states.dtype
        x = hidden_states.reshape(-1, self.hidden_size).astype(dtype)  # [N, D]
        idx = self.row_lora_indices(mapping, x.shape[0])  # i32[N]
        L = self.lora_config.max_loras
        check_mapping_slots(self.name, mapping, L)
        rules = self.rules
        axis = rules.collective_axis("vocab")
        embed_axis = rules.collective_axis("embed")  # x, the table and A split on D

        dora, dora_specs = self._dora_args()

        def local(x, table_l, a, b_l, ranks, idx, *dora):
            y = x @ table_l.astype(dtype).T  # [N, V_pad / shards]
            m = make_lora_mapping(idx, L)
            if embed_axis is None:
                y = ops.add_lora_linear(y, x, (a,), (b_l,), m, 1.0, offsets=(0,), slot_ranks=ranks)
            else:  # partial sums over D: the logits and the (N, r) shrink are summed
                y = jax.lax.psum(y, embed_axis)
                h = jax.lax.psum(ops.lora_shrink(x, (a,), m, 1.0, slot_ranks=ranks), embed_axis)
                y = ops.lora_expand(y, h, (b_l,), m, offsets=(0,), slot_ranks=ranks)
            if dora:  # a DoRA slot's gain per lm_head row (PEFT's DoRA on a Linear)
                y = apply_dora(y, *dora, idx)
            return y if axis is None else jax.lax.all_gather(y, axis, axis=1, tiled=True)

        args = (
            x,
            head.embedding[...],
            self.lora_a[...],
            self.lora_b[...],
            self.slot_ranks[...],
            idx,
            *dora,
        )
        if rules.mesh is None:
            logits = local(*args)
        else:
            specs = (
                (None, "embed"),
                ("vocab", "embed"),
                self.A_AXES,
                self.B_AXES,
                (None, None),
                (None,),
                *dora_specs,
            )
            logits = shard_map(rules, local, specs, (None, None))(*args)
        full = sharded_to_full_mapping(head)
        V = self.org_vocab_size  # the base's width (LoRA adds no vocabulary)
        if full is not None:
            logits = jnp.take(logits, jnp.asarray(full[:V]), axis=-1)
        logits = logits[:, :V]
        # an adapter's trainable tokens: their columns are the hidden state's dot with the
        # adapter's rows (a tied lm_head's are the embedding's: `wrap_model` shares them)
        if has_token_rows(self):
            values = token_logits(rules, self, x, idx, dtype)
            logits = replace_columns(logits, values, idx, self.token_ids[...])
        logits = logits.reshape(*lead, V)
        if embedding_bias is not None:
            logits = logits + embedding_bias.astype(logits.dtype)
        return logits

    def dora_norms(self, lm_head, slot) -> jax.Array:
        """`||W_v + (B @ A)_v||` per lm_head row `f32[V_pad]` (the head's row order; 0 for
        padded rows) of slot `slot` (an int or traced): PEFT's DoRA on the lm_head (a
        Linear), the norm over the hidden dim. As `||W_v||² + 2 Σ_r B[v, r] (W Aᵀ)[v, r] +
        (B A Aᵀ Bᵀ)_vv`, each term summed over the shards of D; no `[V, D]` is formed."""
        head = _head_of(lm_head)
        self._check_head(head)
        rules = self.rules
        embed_axis = rules.collective_axis("embed")

        def local(table, a_l, b_l, slot):  # [V_l, D_l], [L, R, D_l], [L, V_l, R]
            a = jax.lax.dynamic_index_in_dim(a_l, slot, 0, keepdims=False)  # [R, D_l]
            b = jax.lax.dynamic_index_in_dim(b_l, slot, 0, keepdims=False)  # [V_l, R]
            return dora_unit_norms(table, a, b, 1, embed_axis)  # [V_l]

        args = (head.embedding[...], self.lora_a[...], self.lora_b[...])
        slot = jnp.asarray(slot, jnp.int32)
        if rules.mesh is None:
            return local(*args, slot)
        specs = (("vocab", "embed"), self.A_AXES, self.B_AXES, ())
        return shard_map(rules, local, specs, ("vocab",))(*args, slot)

    def __call__(self, lm_head, hidden_states: jax.Array, embedding_bias=None) -> jax.Array:
        if self.logits_as_input:
            return self.base_layer.postprocess(hidden_states)
        return self.base_layer.postprocess(self._get_logits(hidden_states, lm_head, embedding_bias))
