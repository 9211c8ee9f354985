"""`GateLinear`: an MoE router whose logits may come out in another dtype than its inputs
(vLLM's `GateLinear`); its LoRA wrapper is `lora_jax.layers.gate_linear`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lora_jax.config import float_dtype
from lora_jax.linear import ReplicatedLinear


class GateLinear(ReplicatedLinear):
    """An MoE router, `hidden → num_experts` on every device, whose logits may come out in
    another dtype than its inputs: vLLM's `GateLinear`.

    `out_dtype=jnp.float32` gives f32 router logits from bf16 inputs and weights: the
    matmul accumulates in f32 and its result is never rounded to bf16 (vLLM's
    bf16 × bf16 → fp32 GEMM). f32 weights with `dtype=jnp.float32` run the whole router in
    f32 (vLLM's `force_fp32_compute`: the DeepSeek-V3 / MiniMax routers). With neither it
    is a `ReplicatedLinear`.

    Example:
        >>> gate = GateLinear(16, 8, out_dtype=jnp.float32, rngs=nnx.Rngs(0))
        >>> gate(jnp.ones((2, 16), jnp.bfloat16)).dtype
        dtype('float32')
    """

    def __init__(self, in_features: int, num_experts: int, *, out_dtype=None, **kw):
        super().__init__(in_features, num_experts, **kw)
        self.out_dtype = None
        if out_dtype is not None:
            self.set_out_dtype(out_dtype)

    def set_out_dtype(self, out_dtype) -> None:
        """Sets the logits' dtype once after construction (vLLM: when the experts'
        quantization decides it); a second call raises."""
        if self.out_dtype is not None:
            raise ValueError(f"GateLinear.out_dtype is already set ({self.out_dtype})")
        self.out_dtype = float_dtype(out_dtype, "GateLinear.out_dtype")

    def local_matmul(self, x: jax.Array, kernel: jax.Array) -> jax.Array:
        dtype = self.dtype or x.dtype
        out = self.out_dtype or dtype
        return jnp.dot(x.astype(dtype), kernel.astype(dtype), preferred_element_type=out)
