"""PEFT LoRA checkpoints → host-side `LoRAAdapter`s ready for the adapter manager.

A PEFT directory holds `adapter_config.json` and `adapter_model.safetensors` with keys
like `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (`[r, in]`) and
`....lora_B.weight` (`[out, r]`); embeddings use `lora_embedding_A` (`[r, V]`) and
`lora_embedding_B` (`[D, r]`). Loading:

1. reads the config and refuses what cannot be served exactly (QALoRA,
   `modules_to_save`, LoRA bias, layer replication, initialisations that
   changed the base weights such as PiSSA / OLoRA / LoftQ) or what PEFT refuses; a null
   `target_modules` is PEFT's default for the model's type (`q_proj`, `v_proj` for the
   dense types; none for Mixtral / Qwen3-MoE on transformers 5: only their
   `target_parameters`), refused for a model of no known type;
2. reads the safetensors file with a strict parser (never unpickles; a `.bin`
   checkpoint is refused) — a truncated or corrupt file fails before anything is kept;
3. resolves every module against the wrapped model's LoRA layers, packing `q/k/v` →
   `qkv_proj` and `gate/up` → `gate_up_proj` (a missing member is a `None` slice);
   tensors of modules the config does not target (`target_modules`, `exclude_modules`,
   `target_parameters`, by PEFT's rules; `all-linear` never names an embedding or the
   lm_head) are ignored with a warning, as PEFT ignores them; a targeted module that the
   model has but did not LoRA-wrap is an error; a served module's rank must fit
   `max_lora_rank` (a `rank_pattern` rank that no module uses need not); a saved copy of a
   base embedding / lm_head table must equal the model's; training-only buffers (VeLoRA's
   `lora_velora_embed`: its forward is plain LoRA) are skipped;
4. MoE experts come in two layouts. Fused (PEFT `target_parameters` on transformers 5's
   `experts.gate_up_proj` / `experts.down_proj`) goes to `FusedMoE3DWithLoRA` as it is.
   Per expert (transformers 4 names: Mixtral `block_sparse_moe.experts.{j}.w1/w2/w3`,
   read as transformers 5 reads them, under `mlp`; Qwen-MoE
   `mlp.experts.{j}.gate_proj/up_proj/down_proj`) is stacked over the experts as vLLM's
   `pack_moe` does (an expert or member missing from the file is zeros): into
   `FusedMoEWithLoRA`'s w1 / w2 / w3, or for `FusedMoE3DWithLoRA` w13's A is `[A1; A3]`
   on the rank axis and its B block-diagonal `[[B1, 0], [0, B3]]` (rank r1 + r3, as PEFT
   converts such adapters on transformers 5);
5. folds the scaling into B: `alpha / r`, or `alpha / sqrt(r)` with rsLoRA, with `r` and
   `alpha` from `rank_pattern` / `alpha_pattern` when a pattern matches the module's name
   in the checkpoint (before any `name_map`; fused experts: `<module>.gate_up_proj` /
   `<module>.down_proj`, each its own rank; a `target_parameters` weight:
   `<module>.weight`; per expert: each expert's own module) by PEFT's rule: the first key
   `k` with `re.match(rf"(.*\\.)?({k})$", name)`. A tied lm_head under `ensure_weight_tying`
   shares the embedding's factors in PEFT: its rank is the embedding's, its scaling its own.

A BD-LoRA adapter (`use_bdlora`) has its block-diagonal factors made dense
(`dense_bdlora`): the plain LoRA it equals. Ranks stay as in the file; zero-padding to
`max_lora_rank` happens at the slot write. An
activated LoRA (`alora_invocation_tokens`) keeps its invocation sequence on the adapter
(`LoRAAdapter.invocation_tokens`; `lora_jax.serving.alora` says how it is served).
Trainable tokens (`trainable_token_indices`) become `LoRAAdapter.trainable_tokens`
(`lora_jax.serving.peft_tokens`); DoRA's `lora_magnitude_vector`s (`use_dora`) become
`ModuleLoRA.magnitude` (`lora_jax.layers.dora`).
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable, Mapping

import numpy as np

from lora_jax.config import LoRAConfig
from lora_jax.layers import VocabParallelEmbeddingWithLoRA
from lora_jax.layers.dora import check_layer_dora
from lora_jax.serving.adapters import LoRAAdapter as LoRAAdapter
from lora_jax.serving.adapters import ModuleLoRA as ModuleLoRA
from lora_jax.serving.alora import check_alora_modules
from lora_jax.serving.peft_config import ALL_LINEAR
from lora_jax.serving.peft_config import CONFIG_NAME as CONFIG_NAME
from lora_jax.serving.peft_config import EXPERT_PARAMS as EXPERT_PARAMS
from lora_jax.serving.peft_config import PEFTConfig as PEFTConfig
from lora_jax.serving.peft_experts import (
    EXPERT_MEMBERS,
    PER_EXPERT,
    expert_modules,
    experts_not_wrapped,
    fused_expert_lora,
    moe_block_alias,
    moe_layer_name,
    per_expert_lora,
    strip_base_layer,
)
from lora_jax.serving.peft_keys import (
    BASE_EMBEDDING_SUFFIXES,
    NOT_ALL_LINEAR,
    TRAINING_ONLY_SUFFIXES,
    check_base_table,
    check_member_shape,
    check_targets,
    model_type_of,
    module_index,
    parse_key,
    tied_embedding,
)
from lora_jax.serving.peft_keys import PEFT_PREFIX as PEFT_PREFIX
from lora_jax.serving.peft_tokens import token_module, trainable_tokens
from lora_jax.serving.safetensors_io import read_safetensors as read_safetensors
from lora_jax.serving.safetensors_io import write_safetensors as write_safetensors

WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
_ids = itertools.count(1)


def dense_bdlora(bd, name: str, ka: str, a: np.ndarray, kb: str, b: np.ndarray, source: str):
    """A BD-LoRA module's factors made dense: PEFT saves a block-diagonal A `[r, in]` as its
    blocks stacked on the rank axis, `[r, in / n]`, and a block-diagonal B `[out, r]` as
    `[out, r / n]` (`torch.block_diag` of the `n` row chunks gives the matrix)."""
    on_a, on_b = bd.block_diagonal(name)
    if on_a and on_b:  # PEFT refuses it
        raise ValueError(
            f"{source}: module {name!r} matches both use_bdlora.target_modules_bd_a and _bd_b"
        )
    if on_a:
        a = _block_diagonal(a, bd.nblocks, ka, source)
    if on_b:
        b = _block_diagonal(b, bd.nblocks, kb, source)
    return a, b


def _block_diagonal(w: np.ndarray, n: int, key: str, source: str) -> np.ndarray:
    """`[rows, cols]` stacked blocks → the `[rows, cols * n]` block-diagonal matrix."""
    if w.ndim != 2 or w.shape[0] % n:
        raise ValueError(
            f"{source}: tensor {key!r} {list(w.shape)}: a block-diagonal factor of "
            f"use_bdlora.nblocks={n} blocks needs 2 dims, the first divisible by {n}"
        )
    rows, cols = w.shape[0] // n, w.shape[1]
    dense = np.zeros((w.shape[0], cols * n), w.dtype)
    for i in range(n):
        dense[i * rows : (i + 1) * rows, i * cols : (i + 1) * cols] = w[i * rows : (i + 1) * rows]
    return dense


def load_peft_adapter(
    path: str | os.PathLike,
    model,
    lora_config: LoRAConfig,
    *,
    adapter_id: int | None = None,
    name: str | None = None,
    name_map: Callable[[str], str] | None = None,
) -> LoRAAdapter:
    """Loads a PEFT LoRA directory against a wrapped model (see the module docstring).

    Args:
      path: directory with `adapter_config.json` and `adapter_model.safetensors`.
      model: the model after `wrap_model` (its LoRA layers decide names and shapes).
      lora_config: the serving limits (`max_lora_rank`).
      adapter_id: the manager key (int >= 1); a fresh one when None.
      name: a display name; defaults to the directory name.
      name_map: optional checkpoint-module-name rewrite (vLLM's `WeightsMapper`).

    Raises `ValueError` naming the file and tensor on any problem; nothing is returned
    half-loaded.

    Example:
        >>> adapter = load_peft_adapter("adapters/sql", model, cfg, adapter_id=1)  # doctest: +SKIP
    """
    path = os.fspath(path)
    cfg = PEFTConfig.from_dir(path)
    file = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(file):
        pickles = [p for p in PICKLE_NAMES if os.path.isfile(os.path.join(path, p))]
        if pickles:
            raise ValueError(
                f"{os.path.join(path, pickles[0])}: pickle checkpoints are never loaded (unsafe); "
                f"save the adapter as {WEIGHTS_NAME} "
                "(PEFT: save_pretrained(safe_serialization=True))"
            )
        raise ValueError(f"{path}: no {WEIGHTS_NAME}")
    tensors = read_safetensors(file)
    return adapter_from_tensors(
        tensors,
        cfg,
        model,
        lora_config,
        adapter_id=adapter_id,
        name=name or os.path.basename(os.path.normpath(path)),
        source=file,
        name_map=name_map,
    )


def adapter_from_tensors(
    tensors: Mapping[str, np.ndarray],
    cfg: PEFTConfig,
    model,
    lora_config: LoRAConfig,
    *,
    adapter_id: int | None = None,
    name: str = "adapter",
    source: str = WEIGHTS_NAME,
    name_map: Callable[[str], str] | None = None,
) -> LoRAAdapter:
    """Builds a `LoRAAdapter` from PEFT-keyed tensors (the body of `load_peft_adapter`).

    Example:
        >>> key = "base_model.model.model.layers.0.self_attn.q_proj"  # doctest: +SKIP
        >>> tensors = {f"{key}.lora_A.weight": a_rk, f"{key}.lora_B.weight": b_nr}  # doctest: +SKIP
        >>> adapter = adapter_from_tensors(  # doctest: +SKIP
        ...     tensors, PEFTConfig(r=8, lora_alpha=16), model, lora_config, adapter_id=1)
        >>> manager.add_adapter(adapter)  # doctest: +SKIP
        True
    """
    given, cfg = cfg, cfg.for_model_type(model_type_of(model))
    index, layers, all_names = module_index(model)
    moe_owners, expert_members = expert_modules(model)
    all_names |= expert_members
    if name_map is None:  # with one, the config names the checkpoint's modules, not ours
        check_targets(cfg, all_names)
    if adapter_id is None:
        adapter_id = next(_ids)
    if (
        isinstance(adapter_id, bool)
        or not isinstance(adapter_id, int | np.integer)
        or adapter_id < 1
    ):
        raise ValueError(f"{source}: adapter_id must be an int >= 1, got {adapter_id!r}")
    pairs: dict[str, dict[str, tuple[str, np.ndarray]]] = {}
    expert_keys: dict[str, dict[str, list]] = {}
    per_expert: dict[str, dict[tuple[int, str], dict]] = {}  # layer → (j, proj) → kind → ...
    checkpoint_names: dict[str, str] = {}  # model module → the checkpoint's name for it
    untargeted = []
    token_found: dict[str, tuple[str, np.ndarray]] = {}  # checkpoint module → (key, rows)
    for key, value in tensors.items():
        if key.endswith(TRAINING_ONLY_SUFFIXES):
            continue
        raw_tokens = token_module(key)
        if raw_tokens is not None:
            token_found[raw_tokens] = (key, np.asarray(value))
            continue
        if key.endswith(BASE_EMBEDDING_SUFFIXES):
            raw = key[: -len(".base_layer.weight")]
            raw = raw[len(PEFT_PREFIX) :] if raw.startswith(PEFT_PREFIX) else raw
            mod = name_map(raw) if name_map else raw
            check_base_table(key, value, mod, layers, source)
            continue
        mod, raw, kind = parse_key(key, source, name_map)
        if kind == "m" and not cfg.use_dora:
            untargeted.append(key)  # a magnitude without use_dora: PEFT makes no DoRA
            continue
        if name_map is None:
            mod = moe_block_alias(mod, all_names)
        owner = strip_base_layer(mod)
        moe = moe_layer_name(owner, index, layers)
        if kind == "m" and (moe is not None or (mod not in index and PER_EXPERT.fullmatch(mod))):
            raise ValueError(f"{source}: tensor {key!r}: DoRA on MoE experts is not supported")
        if moe is not None:
            expert_keys.setdefault(moe, {}).setdefault(mod, {})[kind] = (key, value)
            checkpoint_names[moe] = strip_base_layer(raw)
            continue
        fused = owner in moe_owners or owner.endswith(".experts")
        if fused and any(
            cfg.targets_parameter(f"{strip_base_layer(raw)}.{p.rpartition('.')[2]}")
            for p in EXPERT_PARAMS
        ):  # the config targets these experts' weights: PEFT gave them a LoRA
            raise experts_not_wrapped(key, owner, index, all_names, source)
        expert = PER_EXPERT.fullmatch(mod) if mod not in index else None
        if expert is not None and cfg.targets(raw):
            moe = moe_layer_name(expert["owner"], index, layers)
            if moe is None:
                raise experts_not_wrapped(key, expert["owner"], index, all_names, source)
            which = (int(expert["j"]), EXPERT_MEMBERS[expert["member"]])
            found = per_expert.setdefault(moe, {}).setdefault(which, {})
            if kind in found:
                raise ValueError(
                    f"{source}: tensor {key!r}: expert {which[0]} {which[1]} of {moe!r} has two "
                    f"lora_{kind} tensors (also {found[kind][0]!r})"
                )
            found[kind] = (key, value, raw)
            continue
        by_weight = not cfg.targets(raw) and cfg.targets_weight(raw)
        if not (by_weight or cfg.targets(raw)):  # PEFT makes no LoRA layer there: ignored
            untargeted.append(key)
            continue
        # PEFT resolves a targeted parameter's rank / alpha on `<module>.weight`
        checkpoint_names[mod] = f"{raw}.weight" if by_weight else raw
        if mod not in index:
            known = sorted({n.rpartition(".")[2] for n in index})
            hint = " (it exists but is not LoRA-wrapped)" if mod in all_names else ""
            raise ValueError(
                f"{source}: tensor {key!r}: module {mod!r} is not a LoRA module of the model"
                f"{hint}; LoRA modules: {known}"
            )
        layer = layers[index[mod][0]]
        if cfg.target_modules == ALL_LINEAR and not by_weight and isinstance(layer, NOT_ALL_LINEAR):
            untargeted.append(key)  # PEFT's all-linear: not an embedding, not the output layer
            continue
        if by_weight and (
            isinstance(layer, VocabParallelEmbeddingWithLoRA) or getattr(layer, "tied", False)
        ):
            raise ValueError(
                f"{source}: tensor {key!r}: target_parameters names {raw + '.weight'!r}, an "
                "embedding table; lora_jax serves target_parameters only on 2-D linear weights "
                "and fused MoE experts"
            )
        if kind in pairs.setdefault(mod, {}):
            raise ValueError(
                f"{source}: tensor {key!r}: module {mod!r} has two lora_{kind} tensors"
            )
        pairs[mod][kind] = (key, np.asarray(value))
    if cfg.use_bdlora is not None:
        expert_names = [
            raw for d in per_expert.values() for f in d.values() for *_, raw in f.values()
        ]
        expert_names += [checkpoint_names[m] for m in expert_keys]
        bad = [n for n in expert_names if any(cfg.use_bdlora.block_diagonal(n))]
        if bad:
            raise ValueError(
                f"{source}: use_bdlora makes the MoE experts {bad[0]!r} block-diagonal; "
                "lora_jax serves BD-LoRA on linear modules only"
            )
    both = sorted(set(expert_keys) & set(per_expert))
    if both:
        raise ValueError(
            f"{source}: module {both[0]!r} has both fused-expert (target_parameters) and "
            "per-expert (experts.{j}.*) LoRA tensors; an adapter has one or the other"
        )
    if not pairs and not expert_keys and not per_expert:
        raise ValueError(f"{source}: no LoRA tensors")
    members: dict[str, list] = {}
    for mod, ab in pairs.items():
        mag = ab.pop("m", None)
        if cfg.use_dora and mag is None and set(ab) == {"a", "b"}:
            raise ValueError(
                f"{source}: module {mod!r} has no lora_magnitude_vector, which {cfg.source}'s "
                "use_dora gives every module"
            )
        if set(ab) != {"a", "b"}:
            have = next(iter(ab.values()))[0]
            raise ValueError(
                f"{source}: tensor {have!r}: module {mod!r} lacks its lora_A/lora_B pair"
            )
        (ka, a), (kb, b) = ab["a"], ab["b"]
        if cfg.use_bdlora is not None:
            a, b = dense_bdlora(cfg.use_bdlora, checkpoint_names[mod], ka, a, kb, b, source)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{source}: tensors {ka!r} {list(a.shape)} and {kb!r} {list(b.shape)} must be "
                "[r, in] and [out, r] with the same r"
            )
        layer_name, i, n = index[mod]
        # a tied lm_head's factors are the embedding's in PEFT: its rank too
        tied = tied_embedding(cfg, layers[layer_name], layers, checkpoint_names)
        r = cfg.rank_for(checkpoint_names[mod] if tied is None else tied)
        if a.shape[0] != r:
            tie = "" if tied is None else f" (the rank of {tied!r}, tied by ensure_weight_tying)"
            raise ValueError(
                f"{source}: tensor {ka!r} has rank {a.shape[0]} but {cfg.source} gives r={r} for "
                f"module {mod!r}{tie}"
            )
        check_member_shape(layers[layer_name], i, n, a, b, ka, kb, source)
        scale = np.float32(cfg.scaling_for(checkpoint_names[mod]))
        slot = members.setdefault(layer_name, [[None] * n, [None] * n, [None] * n])
        slot[0][i] = a.astype(np.float32)
        slot[1][i] = b.astype(np.float32) * scale
        slot[2][i] = None if mag is None else np.asarray(mag[1], np.float32).reshape(-1)
    modules = {
        ln: ModuleLoRA(
            module_name=ln,
            lora_a=tuple(a),
            lora_b=tuple(b),
            magnitude=tuple(m) if any(v is not None for v in m) else None,
        )
        for ln, (a, b, m) in members.items()
    }
    for ln, found in expert_keys.items():
        m = fused_expert_lora(layers[ln], ln, checkpoint_names[ln], found, cfg, source, untargeted)
        if m is not None:
            modules[ln] = m
    for ln, found in per_expert.items():
        modules[ln] = per_expert_lora(layers[ln], ln, found, cfg, lora_config, source)
    tokens = trainable_tokens(token_found, cfg, layers, source, name_map)
    both = sorted(ln for ln in tokens if ln in modules and modules[ln].magnitude is not None)
    if both:
        raise ValueError(
            f"{source}: module {both[0]!r} has a DoRA adapter (use_dora) and trainable tokens "
            "(trainable_token_indices); lora_jax serves each on an embedding, not both on one"
        )
    if cfg.alora_invocation_tokens is not None:
        check_alora_modules(cfg, modules, layers, set(expert_keys), source)
    R = lora_config.max_lora_rank
    for ln, m in modules.items():
        if m.rank > R:  # only ranks of served modules: PEFT loads any rank_pattern
            raise ValueError(
                f"{source}: module {ln!r} has rank {m.rank} (from {cfg.source}), greater than "
                f"max_lora_rank={R}"
            )
    for ln, m in modules.items():
        prepare = getattr(layers[ln], "prepare_lora", None)
        try:
            if prepare is not None:
                prepare(0, *m.set_lora_args())
            if m.magnitude is not None:
                check_layer_dora(layers[ln], m.magnitude)
        except ValueError as e:
            raise ValueError(f"{source}: module {ln!r}: {e}") from e
    if untargeted:
        default = ""
        if given.targets_by_model_type and cfg.target_modules is not None:
            default = (
                f"; its null target_modules is PEFT's default for {model_type_of(model)!r}, "
                f"{list(cfg.target_modules)}"
            )
        warnings.warn(
            f"{source}: {len(untargeted)} tensors are for modules that {cfg.source} does not "
            f"target (target_modules / exclude_modules / target_parameters{default}) and are "
            f"ignored, as PEFT ignores them: {untargeted[:4]}"
            f"{' ...' if len(untargeted) > 4 else ''}",
            stacklevel=2,
        )
    if not modules:
        raise ValueError(f"{source}: no LoRA tensors for a module {cfg.source} targets")
    rank = max(m.rank for m in modules.values())
    return LoRAAdapter(
        id=int(adapter_id),
        name=name,
        rank=rank,
        modules=modules,
        source=source,
        invocation_tokens=cfg.alora_invocation_tokens,
        trainable_tokens=tokens,
    )
