"""PEFT trainable tokens (`trainable_token_indices`) of a LoRA checkpoint → the rows each
vocab LoRA layer serves for its slot (`lora_jax.layers.token_rows`).

PEFT saves, per wrapped table, `<module>.token_adapter.trainable_tokens_delta [n, D]`: the
adapter's own rows (absolute values, despite the name) of the n ids the config lists, in
its order. A list in the config is the input embedding's; an object names the modules
(`{"embed_tokens": [...], "lm_head": [...]}`). On a model with tied embeddings PEFT ties
the lm_head to the embedding's adapter (nothing of it is saved): its logits of those ids
use the embedding's rows, which the tied lm_head here reads too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from lora_jax.layers import ParallelLMHeadWithLoRA, VocabParallelEmbeddingWithLoRA
from lora_jax.serving.adapters import TrainableTokens
from lora_jax.serving.peft_config import PEFTConfig
from lora_jax.serving.peft_keys import PEFT_PREFIX

TOKEN_SUFFIX = ".token_adapter.trainable_tokens_delta"


def token_module(key: str) -> str | None:
    """The checkpoint module of a trainable-tokens tensor key, else None."""
    if not key.endswith(TOKEN_SUFFIX):
        return None
    raw = key[: -len(TOKEN_SUFFIX)]
    return raw[len(PEFT_PREFIX) :] if raw.startswith(PEFT_PREFIX) else raw


def _entry(cfg: PEFTConfig, raw: str, layer) -> tuple[int, ...] | None:
    """The config's ids for checkpoint module `raw` (a list: the input embedding's)."""
    for module, ids in cfg.trainable_token_indices or ():
        if module == "" and isinstance(layer, VocabParallelEmbeddingWithLoRA):
            return ids
        if module and (raw == module or raw.endswith("." + module)):
            return ids
    return None


def trainable_tokens(
    found: Mapping[str, tuple[str, np.ndarray]],
    cfg: PEFTConfig,
    layers: Mapping[str, object],
    source: str,
    name_map: Callable[[str], str] | None = None,
) -> dict[str, TrainableTokens]:
    """`{LoRA layer name: TrainableTokens}` from the file's trainable-tokens tensors
    (`found`: checkpoint module → (key, rows)), checked against the config and the layers.

    Example:
        >>> trainable_tokens({}, PEFTConfig(r=8, lora_alpha=16), {}, "a.safetensors")
        {}
    """
    entries = cfg.trainable_token_indices or ()
    if found and not entries:
        key = next(iter(found.values()))[0]
        raise ValueError(
            f"{source}: tensor {key!r} holds trainable tokens but {cfg.source} has no "
            "trainable_token_indices"
        )
    out: dict[str, TrainableTokens] = {}
    tied_ids: tuple[int, ...] | None = None
    for raw, (key, rows) in found.items():
        mod = name_map(raw) if name_map else raw
        layer = layers.get(mod)
        if not isinstance(layer, VocabParallelEmbeddingWithLoRA | ParallelLMHeadWithLoRA):
            hint = "; wrap it (wrap_model's target_modules)" if layer is None else ""
            raise ValueError(
                f"{source}: tensor {key!r}: trainable tokens need the embedding or the lm_head "
                f"as a LoRA layer of the model, and {mod!r} is not one{hint}"
            )
        ids = _entry(cfg, raw, layer)
        if ids is None:
            raise ValueError(
                f"{source}: tensor {key!r}: {cfg.source}'s trainable_token_indices "
                f"{dict(entries)} names no ids for module {raw!r}"
            )
        if getattr(layer, "tied", False):
            tied_ids = ids  # checked against the embedding's below
            continue
        try:
            layer.prepare_tokens(0, ids, rows)
        except ValueError as e:
            raise ValueError(f"{source}: tensor {key!r}: {e}") from e
        out[mod] = TrainableTokens(mod, ids, np.asarray(rows, np.float32))
    emb_ids = next(
        (
            t.token_ids
            for n, t in out.items()
            if isinstance(layers[n], VocabParallelEmbeddingWithLoRA)
        ),
        None,
    )
    if tied_ids is not None and tied_ids != emb_ids:
        raise ValueError(
            f"{source}: the lm_head is tied to the embedding, and its trainable tokens "
            f"{list(tied_ids)} are not the embedding's: a tied lm_head serves the "
            "embedding's rows"
        )
    missing = []
    for module, ids in entries:
        if module == "":
            if emb_ids is None:
                missing.append("the input embedding")
            continue
        if any(r == module or r.endswith("." + module) for r in found):
            continue
        tied = any(
            (n == module or n.endswith("." + module)) and getattr(x, "tied", False)
            for n, x in layers.items()
        )
        if not (tied and ids == emb_ids):  # PEFT saves nothing of a tied lm_head
            missing.append(module)
    if out and cfg.alora_invocation_tokens is not None:
        # PEFT's token rows act on every token, its aLoRA from the invocation on
        raise ValueError(
            f"{source}: an activated LoRA (alora_invocation_tokens) with trainable tokens is "
            "not supported: PEFT replaces the token rows before the invocation too, where "
            "lora_jax serves the base model"
        )
    if missing:
        raise ValueError(
            f"{source}: {cfg.source}'s trainable_token_indices names {missing} but the file "
            f"has no trainable-tokens tensor (*{TOKEN_SUFFIX}) for it"
        )
    return out
