"""`GateLinearWithLoRA`: vLLM's LoRA on an MoE router (`lora_jax.gate_linear.GateLinear`)."""

from __future__ import annotations

from lora_jax.gate_linear import GateLinear
from lora_jax.layers.column import ReplicatedLinearWithLoRA


class GateLinearWithLoRA(ReplicatedLinearWithLoRA):
    """vLLM's `GateLinearWithLoRA`: LoRA on an MoE router (`GateLinear`). The router is
    replicated on every device, so this class wraps it with or without
    `fully_sharded_loras`, and adds no collective.

    The delta lands in the router's logits in their dtype: f32 logits
    (`out_dtype=jnp.float32`) take it unrounded. An f32 router takes f32 adapters (the
    default, its weights' dtype) or bf16 / fp16 ones (`LoRAConfig.lora_dtype`); vLLM's
    Triton kernels refuse an fp32 router's LoRA.

    Example:
        >>> gate = GateLinear(16, 8, out_dtype=jnp.float32, rngs=nnx.Rngs(0))
        >>> layer = GateLinearWithLoRA(gate, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> layer.set_lora(0, np.ones((4, 16)), np.ones((8, 4)))  # A [r, in], B [experts, r]
        >>> _ = set_lora_mapping(layer, jnp.array([0, -1], jnp.int32))
        >>> layer(jnp.ones((2, 16), jnp.bfloat16)).dtype
        dtype('float32')
    """

    def _check_base(self, base):
        if not isinstance(base, GateLinear):
            raise ValueError(f"{self.name}: base layer must be a GateLinear, got {type(base)}")

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ):
        return isinstance(source_layer, GateLinear) and len(packed_modules_list) <= 1
