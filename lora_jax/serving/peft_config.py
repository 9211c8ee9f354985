"""A PEFT `adapter_config.json` → `PEFTConfig`: what decides how an adapter is served.

Refuses what cannot be served exactly (`modules_to_save`, LoRA bias,
`target_parameters` other than fused MoE experts and 2-D `<module>.weight`s such as
the MoE router `gate.weight`) and what PEFT's `LoraConfig` refuses (a layer filter with a
string `target_modules`), keeps PEFT's layer filter (`layers_to_transform` /
`layers_pattern`), reads a null `target_modules` as PEFT's default for the model type
(`for_model_type`) and resolves per-module ranks and alphas with PEFT's pattern rule (the
first key `k` with `re.match(rf"(.*\\.)?({k})$", name)`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

CONFIG_NAME = "adapter_config.json"
# PEFT `target_parameters` on transformers 5's fused experts (ParamWrapper): A is
# `[r * E, in]` (expert-major rows), B is `[out, r * E]` (rank-major columns); a second
# targeted parameter of the same module nests its keys under `.base_layer`.
EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")
# PEFT `target_parameters` on a 2-D weight (`<module>.weight`, e.g. the MoE router `gate.weight`
# that `all-linear` gives on transformers 5 Mixtral / Qwen3-MoE): its ParamWrapper is a plain
# linear LoRA on `<module>` (A `[r, in]`, B `[out, r]`), resolved on `<module>.weight`.
WEIGHT_PARAM = "weight"


# `init_lora_weights` values whose training changed the base weights too (PEFT loads such
# an adapter onto a residual base W - scale * B0 @ A0): served on the plain base they
# would give other outputs. PEFT converts them to plain LoRA when saved with
# `path_initial_model_for_weight_conversion`.
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "lora-ga")
# `target_modules` shorthand for every linear but the output layer (PEFT expands it, and
# matches it in any case): never the embeddings (not linear) nor lm_head.
ALL_LINEAR = "all-linear"


# PEFT's embedding layer names (`peft.utils.constants.EMBEDDING_LAYER_NAMES`)
EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")

# What PEFT targets when `target_modules` is null, by `config.json` model type
# (`peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`, for the types
# lora_jax serves). None for Mixtral / Qwen3-MoE: on transformers 5 PEFT converts their
# configs first (`_convert_peft_config_moe`), which makes a null `target_modules` empty.
DEFAULT_TARGET_MODULES = {t: ("q_proj", "v_proj") for t in ("llama", "mistral", "qwen2", "qwen3")}


@dataclasses.dataclass(frozen=True)
class BdLoRA:
    """PEFT's `BdLoraConfig` (BD-LoRA, `use_bdlora`): the modules whose A (row-parallel
    ones) or B (column-parallel ones) is block-diagonal in `nblocks` blocks, matched as PEFT
    matches them (a pattern contained in the module's name). The file keeps only the
    diagonal blocks, stacked; the loader makes the dense factor (`block_diagonal`), so a
    BD-LoRA adapter serves as the plain LoRA it equals.

    Example:
        >>> bd = BdLoRA(target_modules_bd_b=("q_proj",), nblocks=2)
        >>> bd.block_diagonal("model.layers.0.self_attn.q_proj")
        (False, True)
    """

    target_modules_bd_a: tuple[str, ...] = ()
    target_modules_bd_b: tuple[str, ...] = ()
    nblocks: int = 1

    def block_diagonal(self, name: str) -> tuple[bool, bool]:
        """Whether module `name`'s A and B are block-diagonal (PEFT's substring match)."""
        on_a = any(p in name for p in self.target_modules_bd_a)
        on_b = any(p in name for p in self.target_modules_bd_b)
        return on_a, on_b


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def matches_targets(targets: tuple[str, ...] | str | None, name: str) -> bool:
    """PEFT's module rule: a regex string must match the whole name; a list matches a name
    equal to an entry or ending in `.entry`. None matches everything.

    Example:
        >>> matches_targets(("q_proj",), "model.layers.0.self_attn.q_proj")
        True
    """
    if targets is None:
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def _pattern_key(keys: Sequence[str], name: str) -> str | None:
    for key in keys:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PEFTConfig:
    """The parts of a PEFT `LoraConfig` that decide how an adapter is served.

    Example:
        >>> cfg = PEFTConfig(r=8, lora_alpha=16, rank_pattern=(("q_proj", 4),))
        >>> cfg.rank_for("model.layers.0.self_attn.q_proj"), cfg.scaling_for("x.v_proj")
        (4, 2.0)
    """

    r: int
    """Default rank."""
    lora_alpha: float
    """Default alpha; the scaling is alpha / r (alpha / sqrt(r) with rsLoRA)."""
    use_rslora: bool = False
    """rsLoRA scaling alpha / sqrt(r)."""
    target_modules: tuple[str, ...] | str | None = None
    """PEFT names (a module matches `name` or `*.name`) or one regex (full match)."""
    rank_pattern: tuple[tuple[str, int], ...] = ()
    """(pattern, rank) pairs in the config's order; the first match wins."""
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    """(pattern, alpha) pairs in the config's order; the first match wins."""
    source: str = CONFIG_NAME
    """Where the config came from (for error messages)."""
    target_parameters: tuple[str, ...] = ()
    """PEFT `target_parameters`: fused MoE expert weights (`*experts.gate_up_proj`,
    `*experts.down_proj`, or a suffix of them such as `gate_up_proj`), served by
    `FusedMoE3DWithLoRA`, and 2-D linear weights `<module>.weight` (e.g. the router
    `gate.weight`), served as a plain LoRA on `<module>`."""
    exclude_modules: tuple[str, ...] | str | None = None
    """PEFT `exclude_modules`: names (or one regex) of modules that get no LoRA."""
    layers_to_transform: tuple[int, ...] | int | None = None
    """PEFT `layers_to_transform`: only modules of these layer indices get a LoRA (where
    `target_modules` is a list and names the module by suffix, as in PEFT)."""
    ensure_weight_tying: bool = False
    """PEFT `ensure_weight_tying`: on a tied model an embedding target also gives the tied
    lm_head a LoRA (saved as `lm_head.lora_A/B`, though the saved `target_modules` may
    not name it)."""
    layers_pattern: tuple[str, ...] | None = None
    """PEFT `layers_pattern`: the name part before the layer index (`layers`, `h`, ...);
    None: the first numbered part after a dot."""
    targets_by_model_type: bool = False
    """The file's `target_modules` is null: PEFT then targets its default for the model
    type, which `for_model_type` resolves when the adapter is loaded. (A config made in
    code with `target_modules=None` targets every module.)"""
    use_bdlora: BdLoRA | None = None
    """PEFT `use_bdlora`: block-diagonal factors (`BdLoRA`), or a dict of its fields."""
    alora_invocation_tokens: tuple[int, ...] | None = None
    """PEFT `alora_invocation_tokens`: an activated LoRA (aLoRA), which acts only from the
    last occurrence of these token ids in the prompt on (`lora_jax.serving.alora`)."""
    use_dora: bool = False
    """PEFT `use_dora`: each module also has a `lora_magnitude_vector` (DoRA), served with
    `LoRAConfig.enable_dora` (`lora_jax.layers.dora`)."""
    trainable_token_indices: tuple[tuple[str, tuple[int, ...]], ...] | None = None
    """PEFT `trainable_token_indices`: `(module, token ids)` pairs whose embedding (and
    lm_head) rows the adapter replaces with its own; module "" is the input embedding
    (PEFT's list form)."""

    def targets(self, name: str) -> bool:
        """Whether PEFT would give the checkpoint module `name` a LoRA layer (its
        `target_modules`, less its `exclude_modules`).

        Example:
            >>> PEFTConfig(r=8, lora_alpha=8, target_modules=("q_proj",)).targets("a.q_proj")
            True
        """
        if self.exclude_modules is not None and matches_targets(self.exclude_modules, name):
            return False
        t = self.target_modules
        if t is None and self.target_parameters:  # only the expert parameters are targeted
            return False
        if self.ensure_weight_tying and _leaf(name) == "lm_head" and self.targets_embedding():
            return True  # PEFT ties a LoRA onto the head tied with the targeted embedding
        if t == ALL_LINEAR:  # PEFT expands it to the full names: no layer filter
            return _leaf(name) not in EMBEDDING_LAYER_NAMES  # not linear / the output layer
        if not matches_targets(t, name):
            return False
        if isinstance(t, str):
            return True  # PEFT filters by layer only the names a list matches by suffix
        if isinstance(t, tuple) and name in t:
            return True
        return self.in_layers(name)

    def targets_embedding(self) -> bool:
        """PEFT's test of whether `target_modules` names an embedding layer (tied weights)."""
        t = self.target_modules
        if isinstance(t, str):
            return t != ALL_LINEAR and any(re.fullmatch(t, m) for m in EMBEDDING_LAYER_NAMES)
        return t is not None and any(_leaf(m) in EMBEDDING_LAYER_NAMES for m in t)

    def in_layers(self, name: str) -> bool:
        """PEFT's `layers_to_transform` rule for module `name`: its layer index (the first
        number after `<layers_pattern>.`, or after any dotted part) is one of them; a name
        with no index is not. True when the config sets no layers.

        Example:
            >>> cfg = PEFTConfig(r=8, lora_alpha=8, layers_to_transform=(0, 2))
            >>> cfg.in_layers("model.layers.2.mlp.down_proj"), cfg.in_layers("model.layers.1.x")
            (True, False)
        """
        want = self.layers_to_transform
        if want is None or want == ():
            return True
        if not self.layers_pattern:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        else:
            m = None
            for pattern in self.layers_pattern:
                m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
                if m is not None:
                    break
        if m is None:
            return False
        idx = int(m.group("idx"))
        return idx == want if isinstance(want, int) else idx in want

    def targets_parameter(self, name: str) -> bool:
        """Whether `target_parameters` names the parameter `name` (PEFT: equal, or a
        suffix after a dot); an empty list names none."""
        return any(name == t or name.endswith("." + t) for t in self.target_parameters)

    def targets_weight(self, name: str) -> bool:
        """Whether PEFT wraps the 2-D weight of checkpoint module `name` through
        `target_parameters` (its `<name>.weight`). Like PEFT's parameter matching, neither
        `exclude_modules` nor the layer filter applies.

        Example:
            >>> cfg = PEFTConfig(r=8, lora_alpha=8, target_parameters=("gate.weight",))
            >>> router = "model.layers.0.mlp.gate"
            >>> cfg.targets_weight(router), cfg.targets(router)
            (True, False)
        """
        return self.targets_parameter(f"{name}.{WEIGHT_PARAM}")

    def for_model_type(self, model_type: str | None) -> PEFTConfig:
        """PEFT's reading of a null `target_modules` (`_prepare_adapter_config`): the model
        type's default list, even beside `target_parameters`; without a default only the
        `target_parameters` are targeted, and with neither PEFT refuses the config.

        Example:
            >>> cfg = PEFTConfig.from_dict({"r": 8, "lora_alpha": 8, "target_modules": None})
            >>> cfg.for_model_type("llama").target_modules
            ('q_proj', 'v_proj')
        """
        if not self.targets_by_model_type:
            return self
        default = DEFAULT_TARGET_MODULES.get(model_type)
        if default is None and not self.target_parameters:
            known = "an unknown type" if model_type is None else f"type {model_type!r}"
            raise ValueError(
                f"{self.source}: target_modules is null (and no target_parameters), which PEFT "
                f"reads as its default for the model type, and it has none for this model "
                f"({known}; lora_jax knows PEFT's defaults for {sorted(DEFAULT_TARGET_MODULES)}); "
                "give target_modules in the adapter config"
            )
        return dataclasses.replace(self, target_modules=default, targets_by_model_type=False)

    def __post_init__(self):
        # a config made in code gets the checks `from_dict` gives a file's fields
        from lora_jax.serving.peft_config_json import (
            _bdlora,
            _check_alpha,
            _invocation_tokens,
            _layer_indices,
            _module_names,
        )

        for what in ("target_modules", "exclude_modules"):
            names = _module_names({what: getattr(self, what)}, what, self.source)
            object.__setattr__(self, what, names)
        object.__setattr__(
            self, "layers_to_transform", _layer_indices(self.layers_to_transform, self.source)
        )
        object.__setattr__(self, "use_bdlora", _bdlora(self.use_bdlora, self.source))
        tokens = _invocation_tokens(self.alora_invocation_tokens, self.source)
        object.__setattr__(self, "alora_invocation_tokens", tokens)
        for what in ("use_rslora", "ensure_weight_tying"):
            v = getattr(self, what)
            if not isinstance(v, bool | np.bool_):  # a str such as "false" would read as True
                raise ValueError(f"{self.source}: {what}={v!r} must be a bool")
        for what in ("rank_pattern", "alpha_pattern"):
            pairs = getattr(self, what)
            # PEFT's own form is a dict; kept as pairs in its order (the first match wins)
            pairs = tuple(pairs.items()) if isinstance(pairs, Mapping) else pairs
            if not isinstance(pairs, list | tuple) or not all(
                isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs
            ):
                raise ValueError(
                    f"{self.source}: {what}={pairs!r} must be a dict (or (pattern, value) "
                    "pairs) of module name patterns to "
                    f"{'ranks' if what == 'rank_pattern' else 'alphas'}"
                )
            object.__setattr__(self, what, tuple((k, v) for k, v in pairs))
        _check_alpha("lora_alpha", self.lora_alpha, self.source)
        for k, v in self.alpha_pattern:
            _check_alpha(f"alpha_pattern[{k!r}]", v, self.source)
        t = self.target_modules
        if isinstance(t, str) and t.lower() == ALL_LINEAR:
            object.__setattr__(self, "target_modules", ALL_LINEAR)
        # PEFT's LoraConfig refuses these (`from_dict` names the raw fields first)
        for what, value in (
            ("layers_to_transform", self.layers_to_transform),
            ("layers_pattern", self.layers_pattern),
        ):
            if isinstance(t, str) and value is not None:
                raise ValueError(
                    f"{self.source}: {what}={value!r} with target_modules={t!r}: PEFT refuses "
                    f"{what} with a string target_modules (a regex or 'all-linear'); give "
                    "target_modules as a list of module names, or drop the layer filter"
                )
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError(
                f"{self.source}: layers_pattern={self.layers_pattern!r} without "
                "layers_to_transform: PEFT refuses it; give layers_to_transform too"
            )
        for what, r in [
            ("r", self.r),
            *((f"rank_pattern[{k!r}]", v) for k, v in self.rank_pattern),
        ]:
            if isinstance(r, bool) or not isinstance(r, int | np.integer) or r <= 0:
                raise ValueError(f"{self.source}: {what}={r!r} must be a positive integer")
        # Compiled here, in the form they are matched in, so that a bad pattern fails
        # naming the file rather than as a bare `re.error` at the first module.
        regexes = [
            (f"{what}={t!r}", t)
            for what, t in (
                ("target_modules", self.target_modules),
                ("exclude_modules", self.exclude_modules),
            )
            if isinstance(t, str) and t != ALL_LINEAR
        ]
        regexes += [
            (f"{what} key {k!r}", rf"(.*\.)?({k})$")
            for what, pairs in (
                ("rank_pattern", self.rank_pattern),
                ("alpha_pattern", self.alpha_pattern),
            )
            for k, _ in pairs
        ]
        regexes += [
            (f"layers_pattern {p!r}", rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.")
            for p in self.layers_pattern or ()
        ]
        for what, regex in regexes:
            try:
                re.compile(regex)
            except re.error as e:
                raise ValueError(
                    f"{self.source}: {what} is not a valid regular expression ({e})"
                ) from e

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = CONFIG_NAME) -> PEFTConfig:
        """Parses an `adapter_config.json` dict; refuses what lora_jax cannot serve.

        Example:
            >>> PEFTConfig.from_dict({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}).r
            8
        """
        from lora_jax.serving.peft_config_json import config_fields

        return cls(**config_fields(d, source))

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> PEFTConfig:
        """Reads `<path>/adapter_config.json`."""
        file = os.path.join(os.fspath(path), CONFIG_NAME)
        if not os.path.isfile(file):
            raise ValueError(f"{path}: no {CONFIG_NAME} (not a PEFT adapter directory)")
        try:
            with open(file, encoding="utf-8") as f:  # JSON is UTF-8, whatever the locale
                d = json.load(f)
        # ValueError covers bad JSON and bytes that are not UTF-8; deep nesting recurses
        except (OSError, ValueError, RecursionError) as e:
            raise ValueError(f"{file}: cannot read the adapter config: {e}") from e
        if not isinstance(d, dict):
            raise ValueError(f"{file}: expected a JSON object")
        return cls.from_dict(d, source=file)

    def rank_for(self, name: str) -> int:
        key = _pattern_key([k for k, _ in self.rank_pattern], name)
        return self.r if key is None else int(dict(self.rank_pattern)[key])

    def alpha_for(self, name: str) -> float:
        key = _pattern_key([k for k, _ in self.alpha_pattern], name)
        return self.lora_alpha if key is None else float(dict(self.alpha_pattern)[key])

    def scaling_for(self, name: str) -> float:
        r, alpha = self.rank_for(name), self.alpha_for(name)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r
