"""The LoRA layer classes `wrap_model` tries, in order, and the pick among them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lora_jax.config import LoRAConfig
from lora_jax.layers import (
    BaseLayerWithLoRA,
    ColumnParallelLinearWithLoRA,
    ColumnParallelLinearWithShardedLoRA,
    FlaxEinsumWithLoRA,
    FlaxEmbedWithLoRA,
    FlaxLinearGeneralWithLoRA,
    FlaxLinearWithLoRA,
    GateLinearWithLoRA,
    MergedColumnParallelLinearVariableSliceWithLoRA,
    MergedColumnParallelLinearVariableSliceWithShardedLoRA,
    MergedColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithShardedLoRA,
    MergedQKVParallelLinearWithLoRA,
    MergedQKVParallelLinearWithShardedLoRA,
    MergedReplicatedLinearWithLoRA,
    ParallelLMHeadWithLoRA,
    QKVParallelLinearWithLoRA,
    QKVParallelLinearWithShardedLoRA,
    ReplicatedLinearWithLoRA,
    RowParallelLinearWithLoRA,
    RowParallelLinearWithShardedLoRA,
    VocabParallelEmbeddingWithLoRA,
)
from lora_jax.layers.moe import FusedMoE3DWithLoRA, FusedMoEWithLoRA

# Tried in order; the first class whose `can_replace_layer` accepts a module wraps it.
# Sharded (S-LoRA) classes come first: they only accept when `fully_sharded_loras`.
LORA_LAYER_CLASSES: list[type] = [
    ColumnParallelLinearWithShardedLoRA,
    MergedColumnParallelLinearWithShardedLoRA,
    MergedColumnParallelLinearVariableSliceWithShardedLoRA,
    QKVParallelLinearWithShardedLoRA,
    MergedQKVParallelLinearWithShardedLoRA,
    RowParallelLinearWithShardedLoRA,
    ReplicatedLinearWithLoRA,
    GateLinearWithLoRA,  # an MoE router, with or without fully_sharded_loras
    MergedReplicatedLinearWithLoRA,
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearVariableSliceWithLoRA,
    QKVParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
    VocabParallelEmbeddingWithLoRA,  # embed_tokens
    ParallelLMHeadWithLoRA,  # lm_head (a tied lm_head: see _tied_lm_head)
    FusedMoE3DWithLoRA,  # FusedMoE experts: one LoRA over fused gate|up, one over down
    FusedMoEWithLoRA,  # FusedMoE experts named as separate w1 / w3 (2-item packed list)
    FlaxLinearWithLoRA,  # a plain flax.nnx.Linear (models not built from lora_jax.linear)
    FlaxEmbedWithLoRA,  # a plain flax.nnx.Embed
    FlaxLinearGeneralWithLoRA,  # a plain flax.nnx.LinearGeneral (nnx.MultiHeadAttention)
    FlaxEinsumWithLoRA,  # a plain flax.nnx.Einsum that is one flat linear map
]


def register_lora_layer(cls: type, *, first: bool = False) -> type:
    """Adds a LoRA layer class to the registry `wrap_model` tries (usable as a decorator).

    The class needs `can_replace_layer(source_layer, lora_config, packed_modules_list)`
    and a constructor `cls(base_layer, lora_config, context, *, name=...)`.

    Example:
        >>> register_lora_layer(MyLayerWithLoRA)  # doctest: +SKIP
    """
    if cls not in LORA_LAYER_CLASSES:
        LORA_LAYER_CLASSES.insert(0, cls) if first else LORA_LAYER_CLASSES.append(cls)
    return cls


def is_lora_layer(node: Any) -> bool:
    """True for the LoRA wrappers `wrap_model` creates (any registered class)."""
    return isinstance(node, (BaseLayerWithLoRA, *LORA_LAYER_CLASSES))


def _pick_class(node, lora_config: LoRAConfig, packed: Sequence[str]) -> type | None:
    for cls in LORA_LAYER_CLASSES:
        if cls.can_replace_layer(node, lora_config, list(packed)):
            return cls
    return None
