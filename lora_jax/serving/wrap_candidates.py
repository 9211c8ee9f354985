"""Which modules of a model `wrap_model` can wrap, with which LoRA class: the graph
walk, a tied lm_head's extra candidates, an lm_head past the LoRA vocabulary limit, and
why a named plain Flax layer cannot take a LoRA.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from flax import nnx

from lora_jax.config import MAX_LORA_VOCAB_SIZE
from lora_jax.layers import (
    ParallelLMHeadWithLoRA,
    TiedLMHeadWithLoRA,
    VocabParallelEmbeddingWithLoRA,
)
from lora_jax.serving.wrap_names import _matches, module_name
from lora_jax.serving.wrap_registry import _pick_class, is_lora_layer
from lora_jax.vocab import VocabParallelEmbedding


def _candidates(model: nnx.Module, lora_config, mapping):
    """(path, module, packed list, class) for every module some LoRA class can wrap."""
    out = []
    inside_lora: list[tuple] = []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module) or not path:
            continue
        if is_lora_layer(node):
            inside_lora.append(tuple(path))
            continue
        name = module_name(path)
        packed = list(mapping.get(str(path[-1]), [str(path[-1])]))
        if isinstance(
            node, (nnx.Linear, nnx.Embed, nnx.LinearGeneral, nnx.Einsum)
        ):  # one plain layer: one checkpoint module
            packed = [str(path[-1])]
        cls = _pick_class(node, lora_config, packed)
        if cls is not None:
            out.append((tuple(path), node, packed, cls, name))
    # iter_graph visits children before parents: drop the base layers of existing wrappers.
    return [c for c in out if not any(c[0][: len(p)] == p for p in inside_lora)]


def _tied_candidates(model: nnx.Module, candidates) -> list[tuple]:
    """Extra candidates of a model with tied embeddings (`lm_head is None`, logits from
    `model.model.embed_tokens`): the lm_head LoRA goes to `model.lm_head`, over the shared
    table; once it is there the graph walk meets the table under `lm_head.base_layer`
    first (and skips it), so `embed_tokens` is offered here too."""
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if emb is None:
        return []
    head = getattr(model, "lm_head", True)
    if head is None:
        table = getattr(emb, "base_layer", emb)
        if not isinstance(table, VocabParallelEmbedding):  # e.g. a plain nnx.Embed
            return []
        return [(("lm_head",), table, ["lm_head"], TiedLMHeadWithLoRA, "lm_head")]
    path = ("model", "embed_tokens")
    if (
        isinstance(head, TiedLMHeadWithLoRA)
        and not is_lora_layer(emb)
        and not any(c[0] == path for c in candidates)
    ):
        return [(path, emb, ["embed_tokens"], VocabParallelEmbeddingWithLoRA, "model.embed_tokens")]
    return []


def _head_too_wide(candidate) -> bool:
    """Whether a candidate is an lm_head whose vocabulary is past LoRA's limit (vLLM's
    `MAX_LORA_VOCAB_SIZE`): named in `target_modules` it raises; `None` skips it, warning."""
    _, node, _, cls, name = candidate
    if cls not in (ParallelLMHeadWithLoRA, TiedLMHeadWithLoRA):
        return False
    vocab = getattr(node, "base_layer", node).num_embeddings
    if vocab <= MAX_LORA_VOCAB_SIZE:
        return False
    warnings.warn(
        f"wrap_model: {name!r} gets no LoRA: its vocabulary of {vocab} is past LoRA's limit "
        f"of {MAX_LORA_VOCAB_SIZE} (target_modules=None wraps every supported module)",
        stacklevel=3,
    )
    return True


def _why_not(model: nnx.Module, missing: Sequence[str]) -> str:
    """Why the plain Flax layers that ``missing`` names cannot take a LoRA ("" if none)."""
    from lora_jax.layers.flax_general import FlaxGeneralLinear

    reasons = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, (nnx.LinearGeneral, nnx.Einsum)) and path:
            name = module_name(path)
            if _matches(tuple(missing), [name]):
                try:
                    FlaxGeneralLinear(node, name=name)
                except ValueError as e:
                    reasons.append(str(e))
    return "".join(f"; {r}" for r in reasons[:4])
