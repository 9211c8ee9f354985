"""How `wrap_model` names modules and matches them: dotted NNX paths, the packed
modules mapping (`qkv_proj` → `q_proj`, `k_proj`, `v_proj`) and `target_modules`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

TargetModules = Sequence[str] | str | None


def default_packed_modules_mapping() -> dict[str, list[str]]:
    """`lora_jax.models.PACKED_MODULES_MAPPING` when available, else `{}`."""
    try:
        from lora_jax.models import PACKED_MODULES_MAPPING
    except ImportError:
        return {}
    return {k: list(v) for k, v in PACKED_MODULES_MAPPING.items()}


def _check_packed_mapping(mapping) -> dict[str, list[str]]:
    """A copy of ``mapping`` as ``{packed name: [member names]}``; a str value would be read
    one character per member, so only lists / tuples of names are taken."""
    if not isinstance(mapping, Mapping):
        raise ValueError(
            "wrap_model: packed_modules_mapping must be a mapping of packed module name → "
            f"list of checkpoint names, got {type(mapping).__name__} {mapping!r}"
        )
    for k, v in mapping.items():
        if (
            not isinstance(k, str)
            or not k
            or not isinstance(v, list | tuple)
            or not v
            or not all(isinstance(m, str) and m for m in v)
        ):
            raise ValueError(
                f"wrap_model: packed_modules_mapping[{k!r}] must map a non-empty str to a "
                f"non-empty list / tuple of non-empty str names, got {v!r}"
            )
    return {k: list(v) for k, v in mapping.items()}


def module_name(path: Sequence[Any]) -> str:
    """NNX path parts → the dotted module name (`("model", "layers", 0)` → `model.layers.0`)."""
    return ".".join(str(p) for p in path)


def packed_names(name: str, packed_modules: Sequence[str]) -> list[str]:
    """Full checkpoint names a (packed) module answers to: `a.qkv_proj` → `a.q_proj`, ..."""
    prefix = name.rpartition(".")[0]
    return [f"{prefix}.{p}" if prefix else p for p in packed_modules]


def layer_packed_modules(name: str, layer) -> tuple[str, ...]:
    """The checkpoint (leaf) names a LoRA layer's slices answer to."""
    packed = getattr(layer, "packed_modules", None)
    return tuple(packed) if packed else (name.rpartition(".")[2],)


def _matches(target: TargetModules, names: Sequence[str]) -> bool:
    if target is None:
        return True
    if isinstance(target, str):
        return any(re.fullmatch(target, n) for n in names)
    return any(n == t or n.endswith("." + t) for n in names for t in target)


def _normalize_targets(target_modules: TargetModules) -> TargetModules:
    if target_modules is None or isinstance(target_modules, str):
        if isinstance(target_modules, str):
            try:
                re.compile(target_modules)
            except re.error as e:
                raise ValueError(f"target_modules regex {target_modules!r} is invalid: {e}") from e
        return target_modules
    # a dict's keys (or an int) would silently stand for a list of names
    if isinstance(target_modules, Mapping) or not isinstance(target_modules, Iterable):
        raise ValueError(
            "wrap_model: target_modules must be a list of module names, a regex string or "
            f"None, got {type(target_modules).__name__} {target_modules!r}"
        )
    targets = tuple(target_modules)
    for t in targets:
        if not isinstance(t, str) or not t:
            raise ValueError(f"target_modules entries must be non-empty strings, got {t!r}")
    return targets
