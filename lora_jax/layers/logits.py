"""`LogitsProcessor` and `LogitsProcessorWithLoRA`: vLLM's logits layer, with a per-sequence
lm_head LoRA, over a vocab-sharded lm_head.

The base: `logits = hidden @ W.T (+ bias)` per vocab shard, gathered over the shards,
vocabulary padding removed, then soft cap `tanh(l / cap) * cap` and `scale` (in that
order, as vLLM). The LoRA (vLLM's `_get_logits` + `add_lora_logits`) joins before the
soft cap and scale: `logits += (hidden @ A[s].T) @ B[s].T` with `s` the slot of the
row's *sequence* (`LoRAMapping.seq_lora_indices`, the sampler mapping; -1 = none). When
the hidden states have one row per token instead (full-sequence logits), the per-token
mapping is used.

Stacks: `lora_a [max_loras, max_rank, D]` replicated, `lora_b [max_loras, V_pad, max_rank]`
sharded on vocab like the lm_head, so each shard expands into its own logits columns
before the one all-gather; the LoRA adds no collective. `V_pad` is the lm_head's padded
vocabulary; the gathered columns are re-indexed to token ids (vLLM's
`sharded_to_full_mapping`) and the padding is cut. B is given in token order (as PEFT
stores it) and written in the lm_head's row order, so that each token's LoRA column joins
its base column before the re-index (`VocabRowOrder`, only for heads whose rows are not in
token order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax import ops
from lora_jax.config import MAX_LORA_VOCAB_SIZE, LoRAConfig
from lora_jax.layers.base import LoRAContext, LoRASlotRanks, PreparedLoRA, check_mapping_slots
from lora_jax.layers.embedding import VocabSlotsMixin, as_matrix, check_rank
from lora_jax.mapping import LoRAMapping, make_lora_mapping
from lora_jax.sharding import shard_map
from lora_jax.vocab import ParallelLMHead, VocabParallelEmbedding


def _head_of(lm_head) -> VocabParallelEmbedding:
    """The base table module of an lm_head (unwraps an embedding LoRA for tied heads)."""
    head = getattr(lm_head, "base_layer", lm_head)
    if not isinstance(head, VocabParallelEmbedding):
        raise ValueError(
            "lm_head must be a ParallelLMHead or VocabParallelEmbedding, got "
            f"{type(lm_head).__name__}"
        )
    return head


class VocabRowOrder(nnx.Variable):
    """`i32[V]`: the lm_head table row (gathered logits column) of each token id, for a
    head that keeps its rows in another order (`get_sharded_to_full_mapping`)."""


def sharded_to_full_mapping(lm_head) -> np.ndarray | None:
    """Gathered-logit column → token id re-index (vLLM's `get_sharded_to_full_mapping`),
    or None when the gathered columns are already in token order.

    `lora_jax.vocab` gives shard i the contiguous rows `[i * V_pad/n, (i+1) * V_pad/n)` and
    puts all padding after the last token, so the re-index is the identity and only the
    padding cut remains; a head with another layout exposes `get_sharded_to_full_mapping()`.
    """
    head = _head_of(lm_head)
    get = getattr(head, "get_sharded_to_full_mapping", None)
    return None if get is None else get()


def _f32_finite(v) -> bool:
    """Whether `v` is a number that stays finite as a float32 (the logits' dtype)."""
    try:
        return abs(float(v)) <= float(np.finfo(np.float32).max)  # False for NaN
    except (TypeError, ValueError, OverflowError):
        return False


class LogitsProcessor(nnx.Module):
    """Hidden states → logits over the vocabulary: gather, cut padding, soft cap, scale.

    Example:
        >>> head = ParallelLMHead(100, 16, rngs=nnx.Rngs(0))
        >>> LogitsProcessor(100, soft_cap=30.0)(head, jnp.ones((2, 16))).shape
        (2, 100)
    """

    def __init__(
        self,
        vocab_size: int,
        org_vocab_size: int | None = None,
        scale: float = 1.0,
        logits_as_input: bool = False,
        soft_cap: float | None = None,
    ):
        # An infinite (or f32-overflowing) cap or scale gave all-NaN / all-inf logits, which
        # greedy decoding turned into token 0 without an error. vLLM allows any finite scale.
        # a cap under f32's smallest normal is flushed to 0 on the device: every logit 0
        tiny = float(np.finfo(np.float32).tiny)
        if soft_cap is not None and not (_f32_finite(soft_cap) and float(soft_cap) >= tiny):
            raise ValueError(
                "LogitsProcessor: soft_cap must be > 0 and finite (a float32 normal number, "
                f"1.2e-38 to 3.4e38), or None, got {soft_cap!r}"
            )
        if not _f32_finite(scale):
            raise ValueError(
                f"LogitsProcessor: scale must be a finite number (in float32), got {scale!r}"
            )
        self.vocab_size = int(vocab_size)
        self.org_vocab_size = int(org_vocab_size or vocab_size)
        self.scale = float(scale)
        self.logits_as_input = logits_as_input
        self.soft_cap = None if soft_cap is None else float(soft_cap)

    def postprocess(self, logits: jax.Array) -> jax.Array:
        """Soft cap then scale (vLLM's order)."""
        if self.soft_cap is not None:
            logits = jnp.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    def _check_head(self, head: VocabParallelEmbedding, hidden_states: jax.Array) -> None:
        if hidden_states.shape[-1] != head.embedding_dim:
            raise ValueError(
                f"{type(self).__name__}: hidden size {hidden_states.shape[-1]} != lm_head "
                f"embedding_dim {head.embedding_dim}"
            )
        if self.org_vocab_size > head.num_embeddings:
            raise ValueError(
                f"{type(self).__name__}: vocab size {self.org_vocab_size} exceeds the lm_head's "
                f"{head.num_embeddings} rows"
            )

    def _get_logits(self, hidden_states, lm_head, embedding_bias=None) -> jax.Array:
        head = _head_of(lm_head)
        self._check_head(head, hidden_states)
        logits = head.attend(hidden_states, gather=True)
        mapping = sharded_to_full_mapping(head)
        if mapping is not None:
            logits = jnp.take(logits, jnp.asarray(mapping[: self.org_vocab_size]), axis=-1)
        logits = logits[..., : self.org_vocab_size]
        if embedding_bias is not None:
            logits = logits + embedding_bias.astype(logits.dtype)
        return logits

    def __call__(self, lm_head, hidden_states: jax.Array, embedding_bias=None) -> jax.Array:
        if self.logits_as_input:
            logits = hidden_states
        else:
            logits = self._get_logits(hidden_states, lm_head, embedding_bias)
        return self.postprocess(logits)


class LogitsProcessorWithLoRA(VocabSlotsMixin, nnx.Module):
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
        seq = mapping.seq_lora_indices
        if seq is not None and seq.shape[0] == num_rows:
            return seq
        if mapping.num_tokens == num_rows:
            return mapping.token_lora_indices
        have = "none" if seq is None else str(seq.shape[0])
        raise ValueError(
            f"{self.name}: {num_rows} hidden-state rows match neither the mapping's sequences "
            f"({have}) nor its tokens ({mapping.num_tokens})"
        )

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

        def local(x, table_l, a, b_l, ranks, idx):
            y = x @ table_l.astype(dtype).T  # [N, V_pad / shards]
            m = make_lora_mapping(idx, L)
            if embed_axis is None:
                y = ops.add_lora_linear(y, x, (a,), (b_l,), m, 1.0, offsets=(0,), slot_ranks=ranks)
            else:  # partial sums over D: the logits and the (N, r) shrink are summed
                y = jax.lax.psum(y, embed_axis)
                h = jax.lax.psum(ops.lora_shrink(x, (a,), m, 1.0, slot_ranks=ranks), embed_axis)
                y = ops.lora_expand(y, h, (b_l,), m, offsets=(0,), slot_ranks=ranks)
            return y if axis is None else jax.lax.all_gather(y, axis, axis=1, tiled=True)

        args = (
            x,
            head.embedding[...],
            self.lora_a[...],
            self.lora_b[...],
            self.slot_ranks[...],
            idx,
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
            )
            logits = shard_map(rules, local, specs, (None, None))(*args)
        full = sharded_to_full_mapping(head)
        V = self.org_vocab_size  # the base's width (LoRA adds no vocabulary)
        if full is not None:
            logits = jnp.take(logits, jnp.asarray(full[:V]), axis=-1)
        logits = logits[:, :V].reshape(*lead, V)
        if embedding_bias is not None:
            logits = logits + embedding_bias.astype(logits.dtype)
        return logits

    def __call__(self, lm_head, hidden_states: jax.Array, embedding_bias=None) -> jax.Array:
        if self.logits_as_input:
            return self.base_layer.postprocess(hidden_states)
        return self.base_layer.postprocess(self._get_logits(hidden_states, lm_head, embedding_bias))


class ParallelLMHeadWithLoRA(nnx.Module):
    """A model's `lm_head` with LoRA: `head(hidden) → logits [..., V]` through a
    `LogitsProcessorWithLoRA` (no soft cap / scale: the model applies its own).

    This is what `wrap_model` puts at `model.lm_head`, so a model's `compute_logits`
    (`self.lm_head(hidden)`) goes through the LoRA unchanged. Slot writes go to
    `logits_processor`.

    Example:
        >>> head = ParallelLMHead(100, 16, rngs=nnx.Rngs(0))
        >>> lm = ParallelLMHeadWithLoRA(head, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> lm.set_lora(0, np.ones((8, 16)), np.ones((100, 8)))
        >>> lm(jnp.ones((3, 16))).shape  # no mapping set: the base logits
        (3, 100)
    """

    tied: bool = False

    def __init__(
        self,
        base_layer: VocabParallelEmbedding,
        lora_config: LoRAConfig,
        context: LoRAContext | None = None,
        *,
        name: str | None = None,
    ):
        self.name = name or type(self).__name__
        self.base_layer = base_layer
        self.lora_config = lora_config
        head = _head_of(base_layer)
        self.logits_processor = LogitsProcessorWithLoRA(
            LogitsProcessor(head.num_embeddings), head, lora_config, context, name=self.name
        )

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ) -> bool:
        return isinstance(source_layer, ParallelLMHead)

    @property
    def num_embeddings(self) -> int:
        return _head_of(self.base_layer).num_embeddings

    @property
    def lora_context(self) -> LoRAContext:
        return self.logits_processor.lora_context

    def prepare_lora(self, index: int, lora_a, lora_b) -> PreparedLoRA:
        return self.logits_processor.prepare_lora(index, lora_a, lora_b)

    def write_lora(self, index: int, prepared: PreparedLoRA) -> None:
        self.logits_processor.write_lora(index, prepared)

    def slot_updates(self, prepared: PreparedLoRA | None):
        return self.logits_processor.slot_updates(prepared)

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        """PEFT's lm_head `lora_A [r, D]`, `lora_B [V, r]` (scaling folded in) → slot `index`."""
        self.logits_processor.set_lora(index, lora_a, lora_b)

    def reset_lora(self, index: int) -> None:
        self.logits_processor.reset_lora(index)

    def read_lora(self, index: int):
        """Slot `index` as `set_lora` takes it (`lora_A [r, D]`, `lora_B [V, r]`), or None."""
        return self.logits_processor.read_lora(index)

    def logits(self, hidden_states: jax.Array) -> jax.Array:
        return self.logits_processor(self.base_layer, hidden_states)

    def __call__(self, hidden_states: jax.Array) -> jax.Array:
        return self.logits(hidden_states)


class TiedLMHeadWithLoRA(ParallelLMHeadWithLoRA):
    """The lm_head LoRA of a model with tied embeddings (`model.lm_head is None`): it sits
    at `model.lm_head` over the shared embedding table; `unwrap_model` puts None back.

    Example:
        >>> cfg = DecoderConfig.tiny(tie_word_embeddings=True)  # doctest: +SKIP
        >>> model = DecoderForCausalLM(cfg, rngs=nnx.Rngs(0))  # doctest: +SKIP
        >>> _ = wrap_model(model, LoRAConfig(max_lora_rank=8))  # doctest: +SKIP
        >>> type(model.lm_head).__name__  # doctest: +SKIP
        'TiedLMHeadWithLoRA'
    """

    tied = True

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ) -> bool:
        return False  # made explicitly by wrap_model for tied models
