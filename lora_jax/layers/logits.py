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
An untied lm_head's trainable tokens (`lora_jax.layers.token_rows`) set the logits columns
of their ids from the slot's rows after the re-index; a tied one reads the embedding's.

This module holds the lm_head wrappers `wrap_model` puts at `model.lm_head`
(`ParallelLMHeadWithLoRA`, `TiedLMHeadWithLoRA`); the rest lives beside it and is
re-exported here: `logits_processor` (the base `LogitsProcessor`, `sharded_to_full_mapping`)
and `logits_lora` (`LogitsProcessorWithLoRA`, `VocabRowOrder`).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from lora_jax.config import LoRAConfig
from lora_jax.layers.base import LoRAContext, PreparedLoRA
from lora_jax.layers.logits_lora import LogitsProcessorWithLoRA as LogitsProcessorWithLoRA
from lora_jax.layers.logits_lora import VocabRowOrder as VocabRowOrder
from lora_jax.layers.logits_processor import LogitsProcessor as LogitsProcessor
from lora_jax.layers.logits_processor import _f32_finite as _f32_finite
from lora_jax.layers.logits_processor import _head_of as _head_of
from lora_jax.layers.logits_processor import sharded_to_full_mapping as sharded_to_full_mapping
from lora_jax.layers.vocab_slots import VocabDoRAMixin
from lora_jax.vocab import ParallelLMHead, VocabParallelEmbedding


class ParallelLMHeadWithLoRA(VocabDoRAMixin, nnx.Module):
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
        """Zeroes slot `index` (an untied head's trainable tokens too; a tied head's rows
        are the embedding's, which its own `reset_lora` drops)."""
        self.logits_processor.reset_lora(index, tokens=not self.tied)

    def read_lora(self, index: int):
        """Slot `index` as `set_lora` takes it (`lora_A [r, D]`, `lora_B [V, r]`), or None."""
        return self.logits_processor.read_lora(index)

    # trainable tokens of an untied lm_head (`lora_jax.layers.token_rows`)
    @property
    def token_ids(self):
        return None if self.tied else self.logits_processor.token_ids

    def prepare_tokens(self, index: int, token_ids, rows):
        return self.logits_processor.prepare_tokens(index, token_ids, rows)

    def token_updates(self, prepared):
        return [] if self.tied else self.logits_processor.token_updates(prepared)

    def set_tokens(self, index: int, token_ids, rows) -> None:
        self.logits_processor.set_tokens(index, token_ids, rows)

    def reset_tokens(self, index: int) -> None:
        if not self.tied:  # a tied head's rows are the embedding's
            self.logits_processor.reset_tokens(index)

    def read_tokens(self, index: int):
        return None if self.tied else self.logits_processor.read_tokens(index)

    # DoRA (PEFT use_dora on the lm_head, a Linear): a gain per vocab row, its norm over
    # the hidden dim; the stacks are the processor's, in the head's row order
    @property
    def dora_magnitude(self):
        return self.logits_processor.dora_magnitude

    @property
    def dora_norm(self):
        return self.logits_processor.dora_norm

    @property
    def slot_ranks(self):
        return self.logits_processor.slot_ranks

    @property
    def logical_slice_sizes(self) -> tuple[int]:
        return (self.logits_processor.vocab_size,)

    def _rows(self) -> np.ndarray:
        """The head row of each token id `[V]`."""
        proc = self.logits_processor
        return np.arange(proc.vocab_size) if proc.b_rows is None else np.asarray(proc.b_rows[...])

    def dora_norms(self, slot) -> jax.Array:
        """`||W_v + (B @ A)_v||` per head row `f32[V_pad]`, 0 on rows of no token id."""
        used = np.zeros(self.logits_processor.vocab_padded, np.float32)
        used[self._rows()] = 1.0
        return self.logits_processor.dora_norms(self.base_layer, slot) * used

    def _zero_dora(self, index: int) -> None:
        self.logits_processor._zero_dora(index)

    def _stored_magnitude(self, m: np.ndarray) -> np.ndarray:
        out = np.zeros(self.logits_processor.vocab_padded, np.float32)
        out[self._rows()] = m
        return out

    def _logical_magnitude(self, m: np.ndarray) -> np.ndarray:
        return np.asarray(m)[self._rows()]

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
