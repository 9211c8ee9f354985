"""A slot's MoE experts → PEFT's per-expert modules (`save_peft_adapter(...,
expert_layout="per_expert")`), as PEFT saves LoRA on a transformers 4 model, where each
expert is its own `nn.Linear`.

Names follow the model type: Mixtral writes `<block>.experts.{j}.w1` (gate), `w3` (up),
`w2` (down) with the MoE block, router included, under transformers 4's name
`block_sparse_moe`; any other model (Qwen3-MoE) writes `<experts>.{j}.gate_proj` /
`up_proj` / `down_proj` under its own names. Each expert's pair is `A [r, in]`,
`B [out, r]`; `load_peft_adapter` stacks them back (`peft_experts.per_expert_lora`).

A fused w13 LoRA (`FusedMoE3DWithLoRA`: one A over gate|up) becomes a gate and an up LoRA
that share that A, each with its half of B, which is exact. Rank columns one half's B
never uses (a slot loaded from separate gate / up LoRAs: B block-diagonal) are left out
of that half; a half whose B is zero where the other's is not is left out whole (it adds
nothing), so a per-expert adapter goes round a `FusedMoE3DWithLoRA` slot unchanged. Read
back into a `FusedMoE3DWithLoRA`, gate and up fuse again, at rank r1 + r3: a slot of
rank r written from one needs `max_lora_rank >= 2 * r` there (`FusedMoEWithLoRA`, w1 / w3
apart, takes each at its own rank).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import numpy as np
from flax import nnx

from lora_jax.moe import FusedMoE
from lora_jax.serving.adapters import ModuleLoRA
from lora_jax.serving.peft_experts import MOE_BLOCK_ALIAS, expert_modules, strip_base_layer
from lora_jax.serving.wrap import module_name

EXPERT_LAYOUTS = ("fused", "per_expert")
# the layer's projection (w1 gate, w2 down, w3 up) → the checkpoint's per-expert module
MIXTRAL_MEMBERS = {"w1": "w1", "w2": "w2", "w3": "w3"}
DEFAULT_MEMBERS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# a per-expert module: its `target_modules` / `rank_pattern` entry may cover every expert
_PER_EXPERT_NAME = re.compile(r"(?P<owner>.+\.experts)\.\d+\.(?P<member>[^.]+)")


def check_expert_layout(layout) -> None:
    """Refuses an ``expert_layout`` that is not one of `EXPERT_LAYOUTS`."""
    if not isinstance(layout, str) or layout not in EXPERT_LAYOUTS:
        raise ValueError(
            f"export: expert_layout must be one of {list(EXPERT_LAYOUTS)}, got {layout!r}"
        )


def expert_members(model_type: str | None) -> dict[str, str]:
    """The checkpoint's per-expert module names by the layer's projection (w1, w2, w3)."""
    return MIXTRAL_MEMBERS if model_type == "mixtral" else DEFAULT_MEMBERS


def per_expert_pairs(
    layer, m: ModuleLoRA, members: Mapping[str, str]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A MoE LoRA layer's adapter (as `read_lora` gives it) → `{"{j}.<member>": (A [r, in],
    B [out, r])}` for every expert j of each projection the slot holds."""
    base = layer.base_layer
    by_proj = dict(zip(layer.projections, zip(m.lora_a, m.lora_b)))
    stacks = {}  # projection → (A [E, r, in], B [E, out, r])
    w13 = by_proj.pop("w13", None)
    if w13 is not None and w13[0] is not None:
        a13, b13 = w13
        if base.is_act_and_mul:
            halves = dict(zip(("w1", "w3"), base.split_w13(b13, axis=1)))  # [E, inter, r]
            used = {p: np.any(b != 0, axis=(0, 1)) for p, b in halves.items()}  # [r]
            for p, b in halves.items():
                if not used[p].any() and any(u.any() for u in used.values()):
                    continue  # zero where the other half is not: no LoRA of its own
                keep = used[p] if used[p].any() else slice(None)  # all zero: PEFT's init
                stacks[p] = (a13[:, keep], b[:, :, keep])
        else:
            stacks["w1"] = (a13, b13)
    for p, (a, b) in by_proj.items():
        if a is not None:
            stacks[p] = (a, b)
    out = {}
    for p in ("w1", "w3", "w2"):
        if p in stacks:
            a, b = stacks[p]
            for j in range(base.num_experts):
                out[f"{j}.{members[p]}"] = (a[j], b[j])
    return out


def moe_blocks(model) -> set[str]:
    """The modules holding the model's fused experts (`model.layers.0.mlp`)."""
    owners, _ = expert_modules(model)
    return {o.rpartition(".")[0] for o in owners}


def transformers4_name(model_type: str | None, blocks: set[str]) -> Callable[[str], str]:
    """The model's module name → transformers 4's: Mixtral's MoE blocks are
    `block_sparse_moe` there (transformers 5 and lora_jax: `mlp`)."""
    mlp, moe = MOE_BLOCK_ALIAS[1].strip("."), MOE_BLOCK_ALIAS[0].strip(".")

    def rename(name: str) -> str:
        if model_type != "mixtral":
            return name
        for block in blocks:
            head, _, leaf = block.rpartition(".")
            if leaf == mlp and (name == block or name.startswith(block + ".")):
                new = f"{head}.{moe}" if head else moe
                return new + name[len(block) :]
        return name

    return rename


def per_expert_every(
    model, every: set[str], index: Mapping[str, tuple], layers, model_type: str | None
) -> set[str]:
    """Every module of the transformers 4 model (what PEFT's `target_modules` leaves would
    match there): the model's own, renamed, less the packed members a MoE layer answers to
    (`mlp.w1`, no module there), plus each expert's own modules."""
    blocks = moe_blocks(model)
    rename = transformers4_name(model_type, blocks)
    moe = {name for name, layer in layers.items() if hasattr(layer, "fused_w13")}
    names = {rename(n) for n in every if not (n in index and n not in moe and index[n][0] in moe)}
    members = expert_members(model_type)
    for path, node in nnx.iter_graph(model):
        if path and isinstance(node, FusedMoE):
            owner = rename(strip_base_layer(module_name(path)))
            projections = ("w1", "w2", "w3") if node.is_act_and_mul else ("w1", "w2")
            names.update(
                f"{owner}.{j}.{members[p]}" for j in range(node.num_experts) for p in projections
            )
    return names


def _expert_key(name: str) -> str | None:
    """A per-expert module's name → a regex of that module in every expert, else None."""
    m = _PER_EXPERT_NAME.fullmatch(name)
    return None if m is None else rf"{re.escape(m['owner'])}\.\d+\.{re.escape(m['member'])}"


def target_alternatives(mods: list[str], every: set[str] | None) -> list[str]:
    """The alternatives of a `target_modules` regex of exactly ``mods``: one for a
    projection's experts (`<experts>\\.\\d+\\.w1`) where ``every`` (the model's modules, None:
    unknown) has no other module it matches, else one per module."""
    covered = set()
    if every is not None:  # a name fullmatches an expert key iff it gives that key
        given = set(mods)
        outside = {_expert_key(n) for n in every if n not in given}
        covered = {_expert_key(n) for n in mods} - outside - {None}
    out = []
    for name in sorted(mods):
        key = _expert_key(name)
        if key not in covered:
            out.append(re.escape(name))
        elif key not in out:
            out.append(key)
    return out


def expert_pattern_keys(ranks: Mapping[str, int]) -> dict[str, str]:
    """Per-expert module name → one rank-pattern key for every expert of its projection
    (`<experts>\\.\\d+\\.w1`), where each module that key matches (by PEFT's rule,
    `(.*\\.)?key$`: the name or a dotted tail of it) has the same rank; else no entry, and
    the module keeps a key of its own."""
    hits: dict[str, set[int]] = {}
    for name, r in ranks.items():
        parts = name.split(".")
        for i in range(len(parts)):
            key = _expert_key(".".join(parts[i:]))
            if key is not None:
                hits.setdefault(key, set()).add(r)
    out = {}
    for name in ranks:
        key = _expert_key(name)
        if key is not None and len(hits[key]) == 1:
            out[name] = key
    return out
