"""An `adapter_config.json` dict → `PEFTConfig`'s fields (`PEFTConfig.from_dict`):
every field checked, and what lora_jax cannot serve exactly or PEFT refuses refused,
naming the file and the field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from lora_jax.serving.peft_config import (
    BASE_CHANGING_INITS,
    EXPERT_PARAMS,
    WEIGHT_PARAM,
    BdLoRA,
)


def config_fields(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    """`PEFTConfig`'s keyword arguments from an `adapter_config.json` dict."""
    peft_type = str(d.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{source}: peft_type={peft_type!r} is not supported; only LORA")
    if d.get("modules_to_save"):
        raise ValueError(
            f"{source}: modules_to_save={d['modules_to_save']!r}: lora_jax only supports "
            "modules_to_save being None"
        )
    if d.get("bias", "none") != "none":
        raise ValueError(f"{source}: bias={d['bias']!r} is not supported; only 'none'")
    if d.get("lora_bias"):
        raise ValueError(f"{source}: lora_bias=True is not supported")
    # Options that change what the adapter computes at inference: served as plain LoRA
    # they would give other outputs than PEFT, so they are refused.
    for key, what in (
        ("use_qalora", "QALoRA (pooled inputs to A)"),
        ("layer_replication", "layer replication (a model with repeated layers)"),
        ("arrow_config", "Arrow routing (per-token mixing of adapters)"),
        ("kasa_config", "KaSA (a learned diagonal between A and B)"),
        ("monteclora_config", "MonteCLoRA (sampled mixtures of A)"),
    ):
        if d.get(key):
            raise ValueError(f"{source}: {key}={d[key]!r}: {what} is not supported")
    layers = _layer_indices(d.get("layers_to_transform"), source)
    pattern = d.get("layers_pattern")
    if isinstance(pattern, str):
        pattern = (pattern,) if pattern else None
    elif isinstance(pattern, list | tuple):
        if not all(isinstance(p, str) for p in pattern):
            raise ValueError(f"{source}: layers_pattern={pattern!r} must be strings")
        pattern = tuple(pattern) or None
    elif pattern is not None:
        raise ValueError(f"{source}: layers_pattern={pattern!r} must be a string or a list")
    # PEFT's LoraConfig refuses these (its `__post_init__`); "all-linear" is a string too
    raw_targets, raw_pattern = d.get("target_modules"), d.get("layers_pattern")
    for key in ("layers_to_transform", "layers_pattern"):
        value = d.get(key)
        if isinstance(raw_targets, str) and value is not None:
            raise ValueError(
                f"{source}: {key}={value!r} with target_modules={raw_targets!r}: PEFT "
                f"refuses {key} with a string target_modules (a regex or 'all-linear'); "
                "give target_modules as a list of module names, or drop the layer filter"
            )
    if raw_pattern and layers is None:
        raise ValueError(
            f"{source}: layers_pattern={raw_pattern!r} without layers_to_transform: PEFT "
            "refuses it; give layers_to_transform too, or drop layers_pattern"
        )
    init = d.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise ValueError(
            f"{source}: init_lora_weights={init!r} trains against a changed base model "
            "(PEFT loads it onto W - scale * B0 @ A0), which lora_jax does not serve; "
            "save the adapter as plain LoRA with PEFT's "
            "path_initial_model_for_weight_conversion"
        )
    params = d.get("target_parameters") or ()
    if not isinstance(params, list | tuple) or not all(isinstance(t, str) for t in params):
        # a string would be split into its characters
        raise ValueError(
            f"{source}: target_parameters={params!r} must be a list of strings (or null)"
        )
    params = tuple(params)
    # PEFT's rule: an entry names a parameter equal to it or ending in ".entry"
    bad = [
        t
        for t in params
        if not any(
            p.endswith(t) and (len(p) == len(t) or p[-len(t) - 1] == ".") for p in EXPERT_PARAMS
        )
        and not t.endswith(tuple("." + p for p in EXPERT_PARAMS))
        and not (t.endswith("." + WEIGHT_PARAM) and len(t) > len(WEIGHT_PARAM) + 1)
    ]
    if bad:
        raise ValueError(
            f"{source}: target_parameters {bad} are not supported; only fused MoE expert "
            f"weights ending in {EXPERT_PARAMS} (or a suffix of them such as "
            "'gate_up_proj') and 2-D linear weights '<module>.weight' (such as the MoE "
            "router 'gate.weight')"
        )
    if "r" not in d or "lora_alpha" not in d:
        raise ValueError(f"{source}: needs 'r' and 'lora_alpha'")
    targets = _module_names(d, "target_modules", source)
    excluded = _module_names(d, "exclude_modules", source)
    if excluded is not None and not isinstance(excluded, str):
        excluded = excluded or None
    _check_alpha("lora_alpha", d["lora_alpha"], source)
    patterns = {}
    for key in ("rank_pattern", "alpha_pattern"):
        value = d.get(key) or {}
        if not isinstance(value, dict):
            raise ValueError(
                f"{source}: {key}={value!r} must be an object mapping module name patterns "
                f"to {'ranks' if key == 'rank_pattern' else 'alphas'}"
            )
        patterns[key] = tuple((str(k), v) for k, v in value.items())
    for k, v in patterns["alpha_pattern"]:
        _check_alpha(f"alpha_pattern[{k!r}]", v, source)
    return dict(
        r=d["r"],
        lora_alpha=float(d["lora_alpha"]),
        use_rslora=bool(d.get("use_rslora", False)),
        target_modules=targets,
        rank_pattern=patterns["rank_pattern"],
        alpha_pattern=tuple((k, float(v)) for k, v in patterns["alpha_pattern"]),
        source=source,
        target_parameters=params,
        exclude_modules=excluded,
        layers_to_transform=layers,
        layers_pattern=pattern,
        ensure_weight_tying=bool(d.get("ensure_weight_tying", False)),
        targets_by_model_type=targets is None,
        alora_invocation_tokens=_invocation_tokens(d.get("alora_invocation_tokens"), source),
        use_bdlora=_bdlora(d.get("use_bdlora"), source),
        trainable_token_indices=_trainable_tokens(d.get("trainable_token_indices"), source),
        use_dora=_flag(d, "use_dora", source),
    )


def _flag(d: Mapping[str, Any], key: str, source: str) -> bool:
    value = d.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key}={value!r} must be true or false")
    return value


def _trainable_tokens(value, source: str) -> tuple[tuple[str, tuple[int, ...]], ...] | None:
    """`trainable_token_indices`: a list of token ids (for the input embedding: module
    "") or an object `{module: ids}`; None (or empty) for none."""
    if value is None or (isinstance(value, list | tuple | Mapping) and not value):
        return None
    what = (
        f"{source}: trainable_token_indices={value!r} must be a list of distinct token ids "
        "(ints >= 0) or an object mapping module names to such lists"
    )
    items = value.items() if isinstance(value, Mapping) else [("", value)]
    out = []
    for module, ids in items:
        bad_ids = (
            not isinstance(ids, list | tuple)
            or not ids
            or any(
                isinstance(t, bool | np.bool_) or not isinstance(t, int | np.integer) or t < 0
                for t in ids
            )
        )
        if not isinstance(module, str) or (isinstance(value, Mapping) and not module) or bad_ids:
            raise ValueError(what)
        if len(set(ids)) != len(ids):
            raise ValueError(f"{what}; {module or 'the list'} repeats an id")
        out.append((module, tuple(int(t) for t in ids)))
    return tuple(sorted(out))


def _bdlora(value, source: str) -> BdLoRA | None:
    """`use_bdlora`: None, or PEFT's `BdLoraConfig` as a dict (its other keys, such as
    `match_strict`, only bind training)."""
    if value is None or isinstance(value, BdLoRA):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{source}: use_bdlora={value!r} must be an object of BdLoraConfig's fields "
            "(target_modules_bd_a, target_modules_bd_b, nblocks) or null"
        )
    lists = {}
    for key in ("target_modules_bd_a", "target_modules_bd_b"):
        names = value.get(key) or ()
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{source}: use_bdlora.{key}={names!r} must be a list of names")
        lists[key] = tuple(names)
    overlap = sorted(set(lists["target_modules_bd_a"]) & set(lists["target_modules_bd_b"]))
    if overlap:  # PEFT's BdLoraConfig refuses it
        raise ValueError(f"{source}: use_bdlora names {overlap} in both A and B lists")
    n = value.get("nblocks", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{source}: use_bdlora.nblocks={n!r} must be an int >= 1")
    return BdLoRA(nblocks=n, **lists)


def _invocation_tokens(value, source: str) -> tuple[int, ...] | None:
    """`alora_invocation_tokens`: None (or an empty list: PEFT's plain LoRA) or token ids."""
    if value is None or (isinstance(value, list | tuple) and not value):
        return None
    if not isinstance(value, list | tuple) or any(
        isinstance(t, bool | np.bool_) or not isinstance(t, int | np.integer) or t < 0
        for t in value
    ):
        raise ValueError(
            f"{source}: alora_invocation_tokens={value!r} must be a list of token ids "
            "(ints >= 0) or null"
        )
    return tuple(int(t) for t in value)


def _layer_indices(value, source: str) -> tuple[int, ...] | int | None:
    """`layers_to_transform`: None, one layer index, or a list of them (as a tuple)."""
    layers = tuple(value) if isinstance(value, list | tuple) else value
    ok = layers is None or isinstance(layers, int) or isinstance(layers, tuple)
    if not ok or any(
        isinstance(i, bool) or not isinstance(i, int)
        for i in (layers if isinstance(layers, tuple) else [layers] if layers is not None else [])
    ):
        raise ValueError(
            f"{source}: layers_to_transform={value!r} must be an int or a list of ints"
        )
    return layers


def _module_names(d: Mapping[str, Any], key: str, source: str) -> tuple[str, ...] | str | None:
    """`target_modules` / `exclude_modules` of a config: None, one regex, or a list of
    names (sorted, as PEFT keeps them in a set)."""
    value = d.get(key)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and all(isinstance(t, str) for t in value):
        return tuple(sorted(value))
    raise ValueError(
        f"{source}: {key}={value!r} must be a string (a regex matching whole module names), a "
        "list of module names, or null"
    )


def _check_alpha(what: str, value, source: str) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    try:
        ok = ok and math.isfinite(value)
    except OverflowError:  # an int beyond float range
        ok = False
    if not ok:
        raise ValueError(f"{source}: {what}={value!r} must be a finite number")
