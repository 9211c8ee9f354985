"""`DecoderConfig`: the static shape of a Llama / Qwen2 / Qwen3 / Mistral decoder.

Built from a Hugging Face `config.json` dict with `DecoderConfig.from_hf`, or from a
named preset (`tiny()`, `llama3_8b()`) for random-weight benchmarks. Frozen and made of
hashable fields only, so it can live in an NNX graphdef that is a `jax.jit` static arg.

RoPE scaling (`RopeScaling`, both HF layouts of it) is read in `lora_jax.models.config_rope`;
its names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

from lora_jax.models.config_rope import HF_MAX_POSITIONS as HF_MAX_POSITIONS
from lora_jax.models.config_rope import SUPPORTED_ROPE_TYPES as SUPPORTED_ROPE_TYPES
from lora_jax.models.config_rope import RopeScaling as RopeScaling
from lora_jax.models.config_rope import _max_positions as _max_positions
from lora_jax.models.config_rope import _read_rope as _read_rope

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ACTIVATIONS = ("silu",)
# transformers' defaults (its config classes, 5.25) for shape fields config.json may leave
# out; None: derived as HF does (kv heads = attention heads, head_dim = hidden // heads)
HF_SHAPE_DEFAULTS = {
    "llama": {"num_key_value_heads": None, "head_dim": None},
    "mistral": {"num_key_value_heads": 8, "head_dim": None},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128},
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Shapes and options of a decoder-only causal LM.

    Example:
        >>> cfg = DecoderConfig.tiny()
        >>> cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads
        (64, 2)
    """

    model_type: str = "llama"
    """One of `SUPPORTED_MODEL_TYPES`; decides the HF defaults (e.g. Qwen2's qkv bias)."""
    vocab_size: int
    """Vocabulary size V (unpadded)."""
    hidden_size: int
    """Model width D."""
    intermediate_size: int
    """MLP width (gate and up each)."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads H."""
    num_key_value_heads: int
    """Key/value heads (GQA); must divide H."""
    head_dim: int
    """Per-head width hd (Qwen3 sets it explicitly; else D // H)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: RopeScaling | None = None
    """RoPE frequency scaling, or None."""
    qkv_bias: bool = False
    """Bias on q, k, v (Qwen2 always; Llama/Qwen3 when `attention_bias`)."""
    o_bias: bool = False
    """Bias on o_proj (Llama/Qwen3 when `attention_bias`; never Qwen2)."""
    mlp_bias: bool = False
    """Bias on gate, up, down (Llama `mlp_bias`)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    tie_word_embeddings: bool = False
    """lm_head reuses the embedding table."""
    hidden_act: str = "silu"
    """MLP activation; only "silu" is supported."""
    max_position_embeddings: int = 4096
    """Informational; the KV cache length is chosen by the caller."""
    sliding_window: int | None = None
    """Attention window W: a query at position p sees keys in (p - W, p]; None = full."""
    layer_types: tuple[str, ...] | None = None
    """Per layer "full_attention" or "sliding_attention"; None = every layer uses
    `sliding_window` (Mistral)."""

    def __post_init__(self):
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"DecoderConfig.model_type={self.model_type!r} is not supported; allowed: "
                f"{SUPPORTED_MODEL_TYPES}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DecoderConfig.{name} must be an int >= 1, got {v!r}")
        # theta <= 0 or eps < 0 make NaN / inf logits, with no error where they are used
        if not _finite(self.rope_theta) or self.rope_theta <= 0:
            raise ValueError(
                f"DecoderConfig.rope_theta must be a finite number > 0, got {self.rope_theta!r}"
            )
        if not _finite(self.rms_norm_eps) or self.rms_norm_eps < 0:
            raise ValueError(
                "DecoderConfig.rms_norm_eps must be a finite number >= 0, "
                f"got {self.rms_norm_eps!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DecoderConfig: num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"DecoderConfig.hidden_act={self.hidden_act!r} is not supported; allowed: "
                f"{SUPPORTED_ACTIVATIONS}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"DecoderConfig.layer_types has {len(self.layer_types)} entries, expected "
                    f"num_hidden_layers={self.num_hidden_layers}"
                )
            bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
            if bad:
                raise ValueError(
                    f"DecoderConfig.layer_types: unknown {sorted(bad)}; allowed: "
                    "'full_attention', 'sliding_attention'"
                )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"DecoderConfig.sliding_window must be >= 1, got {self.sliding_window}"
            )

    def layer_window(self, i: int) -> int | None:
        """The attention window of layer i (None = full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> DecoderConfig:
        """From a Hugging Face `config.json` dict (transformers 4 or 5 layout).

        Example:
            >>> DecoderConfig.from_hf({"model_type": "qwen2", "vocab_size": 64,
            ...     "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            ...     "num_attention_heads": 4, "num_key_value_heads": 2}).qkv_bias
            True
        """
        mt = hf.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type={mt!r} is not supported; allowed: {SUPPORTED_MODEL_TYPES}"
            )
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if hf.get(k) is None
        ]
        if missing:
            raise ValueError(f"config.json ({mt}) lacks required fields {missing}")
        heads = int(hf["num_attention_heads"])
        # A field missing from config.json takes transformers' default for the model type,
        # as HF reads the file; an explicit null is derived (kv = heads, hd = D // H).
        shape = {k: hf.get(k, v) for k, v in HF_SHAPE_DEFAULTS[mt].items()}
        head_dim = shape["head_dim"] or int(hf["hidden_size"]) // heads
        kv_heads = shape["num_key_value_heads"] or heads
        if hf.get("partial_rotary_factor", 1.0) not in (None, 1.0):
            raise ValueError(
                f"config.json partial_rotary_factor={hf['partial_rotary_factor']} is not "
                "supported (only 1.0)"
            )
        theta, scaling = _read_rope(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        if mt == "qwen2":
            qkv_bias, o_bias = True, False
        elif mt == "mistral":
            qkv_bias = o_bias = False
        else:
            qkv_bias = o_bias = attention_bias
        # A field missing from config.json takes transformers' default for the model type
        # (sliding_window 4096 for Mistral and Qwen, max_window_layers 28 for Qwen), as HF
        # reads the file; an explicit null means no window.
        window = hf.get("sliding_window", 4096)
        layer_types = hf.get("layer_types")
        if mt in ("qwen2", "qwen3"):
            if not hf.get("use_sliding_window", False):
                window, layer_types = None, None
            elif layer_types is None:
                first = int(hf.get("max_window_layers", 28))
                n = int(hf["num_hidden_layers"])
                layer_types = [
                    "sliding_attention" if i >= first else "full_attention" for i in range(n)
                ]
        elif mt == "llama":
            window, layer_types = None, None
        return cls(
            model_type=mt,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if mt == "llama" else False,
            qk_norm=mt == "qwen3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            hidden_act=hf.get("hidden_act", "silu"),
            max_position_embeddings=int(_max_positions(hf)),
            sliding_window=None if window is None else int(window),
            layer_types=None if layer_types is None else tuple(layer_types),
        )

    @classmethod
    def tiny(cls, **overrides) -> DecoderConfig:
        """A 2-layer GQA Llama for tests (V=256, D=64, H=4, kv=2, hd=16)."""
        kw = dict(
            model_type="llama",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def llama3_8b(cls, **overrides) -> DecoderConfig:
        """Llama-3.1-8B shapes (for random-weight benchmarks)."""
        kw = dict(
            model_type="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling=RopeScaling(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        )
        kw.update(overrides)
        return cls(**kw)


def _finite(v) -> bool:
    """A real finite number (a bool is not one)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
