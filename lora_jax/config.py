"""`LoRAConfig`: the static limits every LoRA layer and the adapter manager are built with.

Mirrors vLLM's `vllm.config.LoRAConfig` (same field names, same checks), frozen so it
can be hashed into jit caches and shared by reference between layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

# vLLM accepts these ranks; anything else is almost certainly a typo in a launch script.
SUPPORTED_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's LogicalProcessorWithLoRA refuses vocabularies beyond this (test_layers checks it).
MAX_LORA_VOCAB_SIZE = 258048


def float_dtype(value, what: str) -> jnp.dtype:
    """`value` as a float dtype; a `ValueError` naming `what` if it is none.

    Example:
        >>> float_dtype("bfloat16", "out_dtype")
        dtype(bfloat16)
    """
    try:
        dt = jnp.dtype(value)
    except TypeError as e:
        raise ValueError(f"{what}={value!r} is not a dtype") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{what} must be a float dtype, got {dt}")
    return dt


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Static LoRA limits; the shapes of every stacked adapter array derive from it.

    Example:
        >>> cfg = LoRAConfig(max_loras=4, max_lora_rank=16)
        >>> cfg.max_cpu_loras
        4
    """

    max_loras: int = 1
    """Device slots: adapters that can be used in one step (`lora_a.shape[0]`)."""
    max_lora_rank: int = 16
    """Largest adapter rank; smaller adapters are zero-padded to it."""
    max_cpu_loras: int | None = None
    """Host-side LRU cache size; defaults to `max_loras` and must be >= it."""
    lora_dtype: Any = None
    """dtype of the stacked adapters; `None` means the base layer's dtype."""
    fully_sharded_loras: bool = False
    """S-LoRA layout: shard A on rank (column) / B on out (row) so that the LoRA
    collectives move (T, rank) buffers only."""
    lora_extra_vocab_size: int = 0
    """Kept for vLLM parity; vLLM removed extra vocab, only 0 is accepted."""
    bias_enabled: bool = False
    """vLLM parity; LoRA biases are not supported (PEFT `bias="none"` only)."""
    enable_dora: bool = False
    """Serve (and train) DoRA adapters (PEFT `use_dora`): every linear LoRA layer keeps per
    slot the magnitude and the norm `||W + B @ A||` of each output unit (f32
    `[max_loras, out]` each) and scales its output by their ratio; a token embedding
    keeps them per embedding unit (`[max_loras, D]`, the norm over the vocab), the
    lm_head per vocab row (`[max_loras, V_pad]`)."""
    max_lora_trainable_tokens: int = 0
    """Per adapter, how many token ids may carry their own embedding / lm_head rows
    (PEFT's `trainable_token_indices`); 0 refuses such adapters and allocates nothing."""

    def __post_init__(self):
        for field in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            v = getattr(self, field)
            if v is None and field == "max_cpu_loras":
                continue
            if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer):
                raise ValueError(f"LoRAConfig.{field} must be an int, got {v!r}")
            object.__setattr__(self, field, int(v))  # numpy ints stored as Python ints
        for field in ("fully_sharded_loras", "bias_enabled", "enable_dora"):
            v = getattr(self, field)
            if not isinstance(v, bool | np.bool_):
                # a "false" string or None would match no layer class and leave the
                # linears without LoRA
                raise ValueError(f"LoRAConfig.{field} must be a bool, got {v!r}")
            object.__setattr__(self, field, bool(v))
        m = self.max_lora_trainable_tokens
        if isinstance(m, bool) or not isinstance(m, int | np.integer) or m < 0:
            raise ValueError(f"LoRAConfig.max_lora_trainable_tokens must be an int >= 0, got {m!r}")
        object.__setattr__(self, "max_lora_trainable_tokens", int(m))
        if self.max_loras < 1:
            raise ValueError(f"LoRAConfig.max_loras must be an int >= 1, got {self.max_loras!r}")
        if isinstance(self.lora_dtype, str) and self.lora_dtype == "auto":
            object.__setattr__(self, "lora_dtype", None)  # vLLM's default: the base's dtype
        if self.max_lora_rank not in SUPPORTED_MAX_LORA_RANKS:
            raise ValueError(
                f"LoRAConfig.max_lora_rank={self.max_lora_rank!r} is not supported; "
                f"allowed: {SUPPORTED_MAX_LORA_RANKS}"
            )
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"LoRAConfig.max_cpu_loras ({self.max_cpu_loras}) must be >= "
                f"max_loras ({self.max_loras})"
            )
        if self.lora_dtype is not None:
            try:
                dt = jnp.dtype(self.lora_dtype)
            except TypeError as e:
                raise ValueError(f"LoRAConfig.lora_dtype={self.lora_dtype!r} is not a dtype") from e
            allowed = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
            if dt not in allowed:  # what the kernels take (vLLM: auto / float16 / bfloat16)
                raise ValueError(
                    f"LoRAConfig.lora_dtype must be one of bfloat16, float16, float32 (or None: "
                    f"the base weight's), got {dt}"
                )
            object.__setattr__(self, "lora_dtype", dt)
        if self.lora_extra_vocab_size != 0:
            raise ValueError(
                "LoRAConfig.lora_extra_vocab_size must be 0: extra vocabulary was removed "
                "from vLLM and is not supported"
            )
        if self.bias_enabled:
            raise ValueError("LoRAConfig.bias_enabled=True is not supported (LoRA bias)")

    def dtype_for(self, base_dtype) -> jnp.dtype:
        """The adapter dtype to use next to a base weight of `base_dtype`."""
        return jnp.dtype(self.lora_dtype if self.lora_dtype is not None else base_dtype)
