"""LoRA layers with vLLM's class names (see `lora_jax.layers.base` for the shared design)."""

from lora_jax.layers.base import BaseLayerWithLoRA as BaseLayerWithLoRA
from lora_jax.layers.base import LoRAContext as LoRAContext
from lora_jax.layers.base import LoRASlotRanks as LoRASlotRanks
from lora_jax.layers.base import clear_lora_mapping as clear_lora_mapping
from lora_jax.layers.base import find_lora_context as find_lora_context
from lora_jax.layers.base import lora_mapping as lora_mapping
from lora_jax.layers.base import set_lora_mapping as set_lora_mapping
from lora_jax.layers.column import ColumnParallelLinearWithLoRA as ColumnParallelLinearWithLoRA
from lora_jax.layers.column import (
    ColumnParallelLinearWithShardedLoRA as ColumnParallelLinearWithShardedLoRA,
)
from lora_jax.layers.column import (
    MergedColumnParallelLinearVariableSliceWithLoRA as MergedColumnParallelLinearVariableSliceWithLoRA,
)
from lora_jax.layers.column import (
    MergedColumnParallelLinearVariableSliceWithShardedLoRA as MergedColumnParallelLinearVariableSliceWithShardedLoRA,
)
from lora_jax.layers.column import (
    MergedColumnParallelLinearWithLoRA as MergedColumnParallelLinearWithLoRA,
)
from lora_jax.layers.column import (
    MergedColumnParallelLinearWithShardedLoRA as MergedColumnParallelLinearWithShardedLoRA,
)
from lora_jax.layers.column import (
    MergedQKVParallelLinearWithLoRA as MergedQKVParallelLinearWithLoRA,
)
from lora_jax.layers.column import (
    MergedQKVParallelLinearWithShardedLoRA as MergedQKVParallelLinearWithShardedLoRA,
)
from lora_jax.layers.column import (
    MergedReplicatedLinearWithLoRA as MergedReplicatedLinearWithLoRA,
)
from lora_jax.layers.column import QKVParallelLinearWithLoRA as QKVParallelLinearWithLoRA
from lora_jax.layers.column import (
    QKVParallelLinearWithShardedLoRA as QKVParallelLinearWithShardedLoRA,
)
from lora_jax.layers.column import ReplicatedLinearWithLoRA as ReplicatedLinearWithLoRA
from lora_jax.layers.embedding import (
    VocabParallelEmbeddingWithLoRA as VocabParallelEmbeddingWithLoRA,
)
from lora_jax.layers.flax_embed import FlaxEmbed as FlaxEmbed
from lora_jax.layers.flax_embed import FlaxEmbedWithLoRA as FlaxEmbedWithLoRA
from lora_jax.layers.flax_general import FlaxEinsumWithLoRA as FlaxEinsumWithLoRA
from lora_jax.layers.flax_general import FlaxGeneralLinear as FlaxGeneralLinear
from lora_jax.layers.flax_general import (
    FlaxLinearGeneralWithLoRA as FlaxLinearGeneralWithLoRA,
)
from lora_jax.layers.flax_linear import FlaxLinear as FlaxLinear
from lora_jax.layers.flax_linear import FlaxLinearWithLoRA as FlaxLinearWithLoRA
from lora_jax.layers.gate_linear import GateLinearWithLoRA as GateLinearWithLoRA
from lora_jax.layers.logits import LogitsProcessor as LogitsProcessor
from lora_jax.layers.logits import LogitsProcessorWithLoRA as LogitsProcessorWithLoRA
from lora_jax.layers.logits import ParallelLMHeadWithLoRA as ParallelLMHeadWithLoRA
from lora_jax.layers.logits import TiedLMHeadWithLoRA as TiedLMHeadWithLoRA
from lora_jax.layers.moe import FusedMoE3DWithLoRA as FusedMoE3DWithLoRA
from lora_jax.layers.moe import FusedMoEWithLoRA as FusedMoEWithLoRA
from lora_jax.layers.row import RowParallelLinearWithLoRA as RowParallelLinearWithLoRA
from lora_jax.layers.row import RowParallelLinearWithShardedLoRA as RowParallelLinearWithShardedLoRA
