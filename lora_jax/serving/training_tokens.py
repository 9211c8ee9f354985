"""Trainable tokens (PEFT `trainable_token_indices`) in a slot that `init_lora_slot` makes.

PEFT starts each named table's rows of the chosen token ids as copies of the base rows
(`TrainableTokensLayer`), so the slot starts out as the base model, and trains them as
parameters. The slot's rows (`lora_jax.layers.token_rows.TrainableTokenRows`) are
`nnx.LoRAParam`s, so the optimizer that trains the slot's LoRA trains them too; on a model
with tied embeddings the lm_head reads the embedding's rows, one parameter for both, as
PEFT ties them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lora_jax.layers.embedding import VocabParallelEmbeddingWithLoRA
from lora_jax.layers.logits import ParallelLMHeadWithLoRA
from lora_jax.layers.logits_processor import _head_of, sharded_to_full_mapping
from lora_jax.serving.peft_config_json import _trainable_tokens
from lora_jax.serving.wrap import lora_layers

VOCAB_LAYERS = (VocabParallelEmbeddingWithLoRA, ParallelLMHeadWithLoRA)


def token_plans(model, slot: int, value) -> dict[str, tuple]:
    """`{vocab LoRA layer name: (layer, ids, rows [n, D] f32)}` for ``value`` (PEFT's
    `trainable_token_indices`: a list of ids for the input embedding, or `{module: ids}`),
    each checked by the layer (`prepare_tokens`); a tied lm_head (it reads the embedding's
    rows) is left out. Writes nothing."""
    if value is None:
        return {}
    entries = _trainable_tokens(value, "init_lora_slot")
    vocab = {n: la for n, la in lora_layers(model).items() if isinstance(la, VOCAB_LAYERS)}
    plans, tied = {}, None
    for module, ids in entries or ():
        if module == "":
            names = [n for n, la in vocab.items() if isinstance(la, VocabParallelEmbeddingWithLoRA)]
        else:
            names = [n for n in vocab if n == module or n.endswith("." + module)]
        if len(names) != 1:
            raise ValueError(
                f"init_lora_slot: trainable_token_indices names {module or 'the input embedding'!r}"
                f", which is {'more than one' if names else 'none'} of the model's vocab LoRA "
                f"layers {sorted(vocab)} (wrap the embedding / lm_head to train their tokens)"
            )
        layer = vocab[names[0]]
        if getattr(layer, "tied", False):
            tied = (names[0], ids)  # the embedding's rows: checked below
            continue
        D = _table(layer).shape[1]
        try:  # ids and room first (before the rows are read), then the rows
            layer.prepare_tokens(slot, ids, np.zeros((len(ids), D), np.float32))
            rows = _base_rows(layer, ids)
            layer.prepare_tokens(slot, ids, rows)
        except ValueError as e:
            raise ValueError(f"init_lora_slot: {e}") from e
        plans[names[0]] = (layer, ids, rows)
    if tied is not None:
        emb = [p[1] for p in plans.values() if isinstance(p[0], VocabParallelEmbeddingWithLoRA)]
        if emb != [tied[1]]:
            raise ValueError(
                f"init_lora_slot: trainable_token_indices names {tied[0]!r}, an lm_head tied to "
                f"the embedding, with ids {list(tied[1])}: a tied lm_head trains the "
                "embedding's rows, so name the embedding with the same ids"
            )
    return plans


def _table(layer):
    """The base table `[V_pad, D]` of a vocab LoRA layer."""
    if isinstance(layer, VocabParallelEmbeddingWithLoRA):
        return layer.base_layer.embedding[...]
    return _head_of(layer.base_layer).embedding[...]


def _base_rows(layer, ids) -> np.ndarray:
    """The base table's rows of token ``ids`` (`[n, D]` f32), gathered on the device."""
    rows = np.asarray(ids)
    full = (
        None
        if isinstance(layer, VocabParallelEmbeddingWithLoRA)
        else sharded_to_full_mapping(layer.base_layer)
    )
    if full is not None:  # a head whose rows are not in token order: row of each id
        where = np.empty(int(np.max(full)) + 1, np.int64)
        where[np.asarray(full)] = np.arange(len(full))
        rows = where[rows]
    table = _table(layer)
    sharding = getattr(table, "sharding", None)
    if isinstance(sharding, NamedSharding):  # the rows, replicated: no whole-table gather
        out = table.at[jnp.asarray(rows)].get(out_sharding=NamedSharding(sharding.mesh, P()))
    else:
        out = jnp.take(table, jnp.asarray(rows), axis=0)
    return np.asarray(out, np.float32)


def write_tokens(model, slot: int, plans: dict[str, tuple]) -> None:
    """Writes the planned rows, and empties every other vocab layer's trainable tokens of
    ``slot`` (a fresh slot is the base model)."""
    for name, layer in lora_layers(model).items():
        if not isinstance(layer, VOCAB_LAYERS) or layer.token_ids is None:
            continue  # no trainable tokens, or a tied lm_head (the embedding's)
        if name in plans:
            layer.set_tokens(slot, *plans[name][1:])
        else:
            layer.reset_tokens(slot)
