"""`LogitsProcessor`: vLLM's logits layer without LoRA, over a vocab-sharded lm_head.

`logits = hidden @ W.T (+ bias)` per vocab shard, gathered over the shards, vocabulary
padding removed, then soft cap `tanh(l / cap) * cap` and `scale` (in that order, as vLLM).
Also the lm_head helpers its LoRA (`lora_jax.layers.logits_lora`) shares: `_head_of` (the
base table of an lm_head) and `sharded_to_full_mapping` (gathered column → token id).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.vocab import ParallelLMHead as ParallelLMHead  # for the docstring examples
from lora_jax.vocab import VocabParallelEmbedding


def _head_of(lm_head) -> VocabParallelEmbedding:
    """The base table module of an lm_head (unwraps an embedding LoRA for tied heads)."""
    head = getattr(lm_head, "base_layer", lm_head)
    if not isinstance(head, VocabParallelEmbedding):
        raise ValueError(
            "lm_head must be a ParallelLMHead or VocabParallelEmbedding, got "
            f"{type(lm_head).__name__}"
        )
    return head


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
