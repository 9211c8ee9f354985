"""Reference decoder models (Llama / Qwen2 / Qwen3 / Mistral shapes) built on lora_jax linears.

`DecoderForCausalLM(config, rules=..., rngs=...)` mirrors HF module names with vLLM's packed
projections; `load_hf_model(dir)` reads an HF safetensors checkpoint into it;
`PACKED_MODULES_MAPPING` tells the PEFT loader which HF modules were packed.
"""

from lora_jax.models.attention import Attention as Attention
from lora_jax.models.attention import RMSNorm as RMSNorm
from lora_jax.models.config import DecoderConfig as DecoderConfig
from lora_jax.models.config import RopeScaling as RopeScaling
from lora_jax.models.decoder import MLP as MLP
from lora_jax.models.decoder import DecoderForCausalLM as DecoderForCausalLM
from lora_jax.models.decoder import DecoderLayer as DecoderLayer
from lora_jax.models.decoder import DecoderModel as DecoderModel
from lora_jax.models.kv_cache import KVCache as KVCache
from lora_jax.models.loading import SafetensorsCheckpoint as SafetensorsCheckpoint
from lora_jax.models.loading import load_hf_model as load_hf_model
from lora_jax.models.loading import read_hf_config as read_hf_config
from lora_jax.models.moe_decoder import MoEConfig as MoEConfig
from lora_jax.models.moe_decoder import MoEDecoderForCausalLM as MoEDecoderForCausalLM
from lora_jax.models.moe_decoder import load_hf_moe_model as load_hf_moe_model

# HF module names packed into one lora_jax module (vLLM's `packed_modules_mapping`).
PACKED_MODULES_MAPPING: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
