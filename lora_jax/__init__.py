"""lora_jax: multi-LoRA serving layers for JAX/Flax NNX.

vLLM's `vllm.lora.layers` rebuilt as NNX modules in which every token of a batch may use
a different adapter, sharded over a `jax.sharding.Mesh` with `NamedSharding`, with
Pallas GPU kernels for the batched per-token gather.
"""

from lora_jax import ops as ops
from lora_jax.compile_options import decode_compiler_options as decode_compiler_options
from lora_jax.config import LoRAConfig as LoRAConfig
from lora_jax.gate_linear import GateLinear as GateLinear
from lora_jax.layers import *  # noqa: F403
from lora_jax.linear import ColumnParallelLinear as ColumnParallelLinear
from lora_jax.linear import MergedColumnParallelLinear as MergedColumnParallelLinear
from lora_jax.linear import MergedReplicatedLinear as MergedReplicatedLinear
from lora_jax.linear import QKVParallelLinear as QKVParallelLinear
from lora_jax.linear import ReplicatedLinear as ReplicatedLinear
from lora_jax.linear import RowParallelLinear as RowParallelLinear
from lora_jax.mapping import LoRAMapping as LoRAMapping
from lora_jax.mapping import make_lora_mapping as make_lora_mapping
from lora_jax.moe import FusedMoE as FusedMoE
from lora_jax.sharding import DEFAULT_RULES as DEFAULT_RULES
from lora_jax.sharding import ShardingRules as ShardingRules

__version__ = "0.1.0"
