"""RoPE scaling config: `RopeScaling`, and reading RoPE from a Hugging Face `config.json`.

Both HF config layouts are read: transformers 5 (`rope_parameters` holding `rope_theta`
and the scaling) and transformers 4 (`rope_theta` + `rope_scaling` at the top level);
a file with both is read as transformers 5.25 reads it: `rope_scaling` wins.
`DecoderConfig.from_hf` (in `lora_jax.models.config`) reads the rest of the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# transformers' default max_position_embeddings per model type (also llama3 rope's
# original_max_position_embeddings when the scaling leaves it out)
HF_MAX_POSITIONS = {
    "llama": 2048,
    "mistral": 131072,
    "qwen2": 32768,
    "qwen3": 32768,
    "mixtral": 131072,
    "qwen3_moe": 32768,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_parameters` / `rope_scaling`).

    Example:
        >>> RopeScaling(rope_type="linear", factor=2.0).factor
        2.0
    """

    rope_type: str
    """"linear" (positions divided by `factor`) or "llama3" (Llama 3.1 band-wise)."""
    factor: float = 1.0
    """Context-extension factor."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths beyond `original_max / low_freq_factor` are divided by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below `original_max / high_freq_factor` are kept."""
    original_max_position_embeddings: int = 8192
    """llama3: context length of pretraining."""

    def __post_init__(self):
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(
                f"RopeScaling.rope_type={self.rope_type!r} is not supported; allowed: "
                f"{SUPPORTED_ROPE_TYPES} (or no scaling)"
            )
        if self.factor <= 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling: high_freq_factor ({self.high_freq_factor}) must be > "
                f"low_freq_factor ({self.low_freq_factor})"
            )


def _max_positions(hf: Mapping[str, Any]):
    return hf.get("max_position_embeddings", HF_MAX_POSITIONS.get(hf.get("model_type"), 4096))


def _read_rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5.25 (`convert_rope_params_to_dict`): a non-empty legacy `rope_scaling`
    # replaces `rope_parameters` whole (even when they disagree); `rope_theta` is the
    # chosen dict's, else the top-level field, else the default
    legacy, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    name, src = ("rope_scaling", legacy) if legacy else ("rope_parameters", params or {})
    if not isinstance(src, Mapping):
        raise ValueError(f"config.json {name} must be a dict, got {type(src).__name__}")
    if any(isinstance(v, Mapping) for v in src.values()):
        raise ValueError(f"config.json: per-layer-type {name} are not supported")
    if src.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ValueError(
            f"config.json {name}.partial_rotary_factor={src['partial_rotary_factor']} is not "
            "supported (only 1.0)"
        )
    theta = src.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = src.get("rope_type", src.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json rope scaling type {rope_type!r} is not supported; allowed: "
            f"{SUPPORTED_ROPE_TYPES} (or no scaling)"
        )
    # what transformers requires of the scaling (it raises a KeyError without them)
    required = ["factor"] + (
        ["low_freq_factor", "high_freq_factor"] if rope_type == "llama3" else []
    )
    missing = [k for k in required if k not in src]
    if missing:
        raise ValueError(
            f"config.json {name} of rope_type {rope_type!r} lacks required fields {missing}; "
            f"{rope_type!r} scaling needs {required}"
        )
    kw: dict[str, Any] = dict(rope_type=rope_type, factor=float(src["factor"]))
    if rope_type == "llama3":
        orig = src.get("original_max_position_embeddings", _max_positions(hf))
        kw.update(
            low_freq_factor=float(src["low_freq_factor"]),
            high_freq_factor=float(src["high_freq_factor"]),
            original_max_position_embeddings=int(orig),
        )
    return float(theta), RopeScaling(**kw)
