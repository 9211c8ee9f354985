"""Mixture-of-experts adapters in PEFT checkpoints → the MoE LoRA layers' stacks.

Two layouts: PEFT's ParamWrapper over fused 3-D expert weights (`target_parameters`
`<experts>.gate_up_proj` / `<experts>.down_proj`, `[r*E, in]` / `[out, r*E]`), and
per-expert modules (`<experts>.{j}.w1/w2/w3` or `gate_proj/up_proj/down_proj`, as
transformers 4 and vLLM name them), stacked as vLLM's `pack_moe` stacks them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from lora_jax.moe import FusedMoE
from lora_jax.serving.adapters import ModuleLoRA
from lora_jax.serving.peft_config import EXPERT_PARAMS
from lora_jax.serving.wrap import module_name

# Per-expert checkpoint modules (transformers 4, vLLM) → the `FusedMoEWithLoRA` projection.
EXPERT_MEMBERS = {
    "w1": "w1",
    "w2": "w2",
    "w3": "w3",
    "gate_proj": "w1",
    "down_proj": "w2",
    "up_proj": "w3",
}
PER_EXPERT = re.compile(
    rf"(?P<owner>.+\.experts)\.(?P<j>\d+)\.(?P<member>{'|'.join(EXPERT_MEMBERS)})"
)
# transformers 5 loads Mixtral's `block_sparse_moe.*` as `mlp.*` (its checkpoint conversion
# renames them), which is how lora_jax's MoE decoders name the block.
MOE_BLOCK_ALIAS = (".block_sparse_moe.", ".mlp.")


def expert_modules(model) -> tuple[set[str], set[str]]:
    """(the names of the model's fused experts, the per-expert module names a checkpoint may
    give them: `<experts>.{j}.w1` ..., also under Mixtral's `block_sparse_moe`)."""
    from flax import nnx

    owners, members = set(), set()
    for path, node in nnx.iter_graph(model):
        if path and isinstance(node, FusedMoE):
            owner = strip_base_layer(module_name(path))
            owners.add(owner)
            members.update(
                f"{o}.{j}.{m}"
                for o in (owner, _unalias(owner))
                for j in range(node.num_experts)
                for m in EXPERT_MEMBERS
            )
    return owners, members


def _unalias(name: str) -> str:
    """`a.mlp.b` → `a.block_sparse_moe.b` (the transformers 4 Mixtral name)."""
    new, old = MOE_BLOCK_ALIAS
    return f".{name}.".replace(old, new)[1:-1]


def moe_block_alias(name: str, all_names: set[str]) -> str:
    """A checkpoint's Mixtral `block_sparse_moe` module under the model's `mlp`, when the
    model has no `block_sparse_moe` there."""
    old, new = MOE_BLOCK_ALIAS
    dotted = f".{name}."
    if old not in dotted:
        return name
    block = dotted[: dotted.index(old) + len(old) - 1][1:]
    return name if block in all_names else dotted.replace(old, new)[1:-1]


def moe_layer_name(owner: str, index, layers) -> str | None:
    """The MoE LoRA layer named `owner` (by its own name or a packed member's), else None."""
    for ln in (owner, index.get(owner, (None,))[0]):
        if ln is not None and hasattr(layers.get(ln), "fused_w13"):
            return ln
    return None


def experts_not_wrapped(key, owner, index, all_names, source) -> ValueError:
    known = sorted({n.rpartition(".")[2] for n in index})
    if owner in all_names:
        why = (
            " (it exists but is not LoRA-wrapped: wrap it with wrap_model(..., "
            "target_modules=[..., 'experts']))"
        )
    else:
        why = ""
    return ValueError(
        f"{source}: tensor {key!r}: the experts module {owner!r} is not a LoRA module of the "
        f"model{why}; LoRA modules: {known}"
    )


def strip_base_layer(name: str) -> str:
    while name.endswith(".base_layer"):
        name = name[: -len(".base_layer")]
    return name


def fused_expert_lora(
    layer, name: str, checkpoint_name: str, found: Mapping[str, Mapping], cfg, source, untargeted
) -> ModuleLoRA | None:
    """PEFT ParamWrapper tensors of one fused-experts module → `[w13, w2]` 3D LoRA (a
    layer with w1 and w3 apart: `[w1, w2, w3]`, each half of B with the shared A).

    Which parameter a pair belongs to follows from its shapes (w13: in = hidden,
    out = w13 width; w2: in = inter, out = hidden), not from the nesting order. Each
    has its own rank and scaling: PEFT matches the patterns against
    `<module>.gate_up_proj` / `<module>.down_proj`.
    """
    base = layer.base_layer
    E, H, n = base.num_experts, base.hidden_size, base.intermediate_size
    shapes = {(H, base.w13_width): 0, (n, H): 1}  # (in, out) → w13 / w2
    params = [p.rpartition(".")[2] for p in EXPERT_PARAMS]  # w13, w2 as PEFT names them
    out_a: list = [None, None]
    out_b: list = [None, None]
    for mod, ab in found.items():
        if set(ab) != {"a", "b"}:
            raise ValueError(f"{source}: module {mod!r} lacks its lora_A/lora_B pair")
        (ka, a), (kb, b) = ab["a"], ab["b"]
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        which = shapes.get((a.shape[-1], b.shape[0])) if a.ndim == b.ndim == 2 else None
        param = f"{checkpoint_name}.{params[0 if which is None else which]}"
        r = cfg.rank_for(param)
        if which is None or a.shape[0] != r * E or b.shape[1] != r * E:
            raise ValueError(
                f"{source}: tensors {ka!r} {list(a.shape)} / {kb!r} {list(b.shape)} do not fit "
                f"the experts of {name!r}: expected [r*E, in] / [out, r*E] with r={r}, E={E}, "
                f"(in, out) in {sorted(shapes)}"
            )
        if cfg.target_parameters and not cfg.targets_parameter(param):
            untargeted += [ka, kb]  # PEFT makes no LoRA for that expert weight
            continue
        if out_a[which] is not None:
            raise ValueError(f"{source}: module {name!r} has two LoRAs for one expert weight")
        scale = np.float32(cfg.scaling_for(param))
        out_a[which] = a.reshape(E, r, -1)  # [E, r, in]
        out_b[which] = b.reshape(b.shape[0], r, E).transpose(2, 0, 1) * scale  # [E, out, r]
    if all(a is None for a in out_a):
        return None
    if layer.fused_w13 or not base.is_act_and_mul:
        return ModuleLoRA(module_name=name, lora_a=tuple(out_a), lora_b=tuple(out_b))
    # w1 and w3 apart: each takes the shared A with its half of B (exact)
    (a13, a2), (b13, b2) = out_a, out_b
    halves = [(None, None), (None, None)]
    if b13 is not None:
        for i, half in enumerate(base.split_w13(b13, axis=1)):  # [E, inter, r]
            halves[i] = _used_rank(a13, half)
    (a1, b1), (a3, b3) = halves
    if a1 is None and a2 is None and a3 is None:
        return None
    return ModuleLoRA(module_name=name, lora_a=(a1, a2, a3), lora_b=(b1, b2, b3))


def _used_rank(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """`A [E, r, in]`, `B [E, out, r]` less the rank columns B never uses: a w13 LoRA of
    rank r1 + r3 (what the export writes for w1 / w3 apart: B block-diagonal) gives each
    half back its own rank rather than r1 + r3 with zero columns. (None, None) when B is 0."""
    used = np.any(b != 0, axis=(0, 1))  # [r]
    if not used.any():
        return None, None
    return a[:, used], b[:, :, used]


def per_expert_lora(
    layer, name: str, found: Mapping[tuple[int, str], Mapping], cfg, lora_config, source
) -> ModuleLoRA:
    """Per-expert LoRA pairs (`experts.{j}.w1` ...) → the MoE layer's stacked projections.

    As vLLM's `pack_moe`: each projection stacks its experts into `[E, r, in]` /
    `[E, out, r]` (r: the largest of its experts; a smaller or missing expert is
    zero-padded). `FusedMoE3DWithLoRA` takes one LoRA over the fused gate|up: A is
    `[A1; A3]` on the rank axis and B block-diagonal, so each half sees only its own rank
    rows (PEFT's conversion of such adapters on transformers 5).
    """
    base = layer.base_layer
    E, H, n = base.num_experts, base.hidden_size, base.intermediate_size
    sizes = {"w1": (H, n), "w3": (H, n), "w2": (n, H)}  # (in, out)
    stacks: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for proj, (n_in, n_out) in sizes.items():
        experts = {j: ab for (j, p), ab in found.items() if p == proj}
        if not experts:
            continue
        pairs = {}
        for j, ab in sorted(experts.items()):
            have = next(iter(ab.values()))[0]
            if j >= E:
                raise ValueError(
                    f"{source}: tensor {have!r}: expert {j} is past the {E} experts of {name!r}"
                )
            if set(ab) != {"a", "b"}:
                raise ValueError(f"{source}: tensor {have!r}: it lacks its lora_A/lora_B pair")
            (ka, a, raw), (kb, b, _) = ab["a"], ab["b"]
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            r = cfg.rank_for(raw)
            if a.shape != (r, n_in) or b.shape != (n_out, r):
                raise ValueError(
                    f"{source}: tensors {ka!r} {list(a.shape)} / {kb!r} {list(b.shape)} do not "
                    f"fit expert {j} of {name!r}: expected [{r}, {n_in}] / [{n_out}, {r}] "
                    f"(r={r} from {cfg.source})"
                )
            pairs[j] = (a, b * np.float32(cfg.scaling_for(raw)))
        r = max(a.shape[0] for a, _ in pairs.values())
        stack_a = np.zeros((E, r, n_in), np.float32)  # [E, r, in]
        stack_b = np.zeros((E, n_out, r), np.float32)  # [E, out, r]
        for j, (a, b) in pairs.items():
            stack_a[j, : a.shape[0]], stack_b[j, :, : b.shape[1]] = a, b
        stacks[proj] = (stack_a, stack_b)
    w2 = stacks.get("w2", (None, None))
    if not layer.fused_w13:
        w1, w3 = stacks.get("w1", (None, None)), stacks.get("w3", (None, None))
        return ModuleLoRA(name, (w1[0], w2[0], w3[0]), (w1[1], w2[1], w3[1]))
    if "w3" in stacks and not base.is_act_and_mul:
        raise ValueError(
            f"{source}: module {name!r}: its experts have no up projection (not gated), but "
            "the adapter has w3 / up_proj LoRAs"
        )
    halves = [stacks.get(p) for p in (("w1", "w3") if base.is_act_and_mul else ("w1",))]
    if all(h is None for h in halves):
        return ModuleLoRA(name, (None, w2[0]), (None, w2[1]))
    ranks = [0 if h is None else h[0].shape[1] for h in halves]
    R = lora_config.max_lora_rank
    if sum(ranks) > R:
        raise ValueError(
            f"{source}: module {name!r}: its per-expert gate and up LoRAs (ranks "
            f"{' + '.join(map(str, ranks))}) fuse into one w13 LoRA of rank {sum(ranks)} on "
            f"{type(layer).__name__}, greater than max_lora_rank={R}; raise max_lora_rank, or "
            "wrap the experts as FusedMoEWithLoRA (wrap_model(..., packed_modules_mapping="
            "{'experts': ['w1', 'w3'], ...})), which keeps them apart"
        )
    a13 = np.zeros((E, sum(ranks), H), np.float32)  # [E, r1 + r3, hidden]
    parts = [np.zeros((E, n, sum(ranks)), np.float32) for _ in halves]  # gate, up [E, n, r]
    offsets = np.cumsum([0, *ranks])
    for h, part, lo, hi in zip(halves, parts, offsets[:-1], offsets[1:]):
        if h is not None:
            a13[:, lo:hi], part[:, :, lo:hi] = h
    return ModuleLoRA(name, (a13, w2[0]), (_logical_w13(base, parts), w2[1]))


def expert_tensors(layer, m: ModuleLoRA) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A MoE LoRA layer's adapter (as `read_lora` gives it) → PEFT's ParamWrapper tensors
    per fused expert weight: `{"gate_up_proj": (A [r*E, hidden], B [w13 out, r*E]),
    "down_proj": (A [r*E, inter], B [hidden, r*E])}`, the inverse of `fused_expert_lora`.

    Separate w1 / w3 LoRAs become one w13 LoRA of rank r1 + r3: A stacked on the rank
    axis, B block-diagonal (each half sees only its own rank rows), which is exact.
    """
    base = layer.base_layer
    E = base.num_experts
    by_proj = dict(zip(layer.projections, zip(m.lora_a, m.lora_b)))
    w13 = by_proj.get("w13")
    if w13 is None:  # w1 (gate) and w3 (up) apart
        halves = [by_proj.get("w1"), by_proj.get("w3")] if base.is_act_and_mul else [by_proj["w1"]]
        present = [h for h in halves if h[0] is not None]
        w13 = (None, None)
        if present:
            a13 = np.concatenate([a for a, _ in present], axis=1)  # [E, r1 + r3, hidden]
            parts, lo = [], 0
            for a, b in halves:
                r = 0 if a is None else a.shape[1]
                part = np.zeros((E, base.intermediate_size, a13.shape[1]), np.float32)
                if b is not None:
                    part[:, :, lo : lo + r] = b
                parts.append(part)  # [E, inter, r1 + r3]
                lo += r
            w13 = (a13, _logical_w13(base, parts))
    out = {}
    for param, (a, b) in (("gate_up_proj", w13), ("down_proj", by_proj["w2"])):
        if a is None:
            continue
        r = a.shape[1]
        # PEFT: A's rows are expert-major (e*r + k), B's columns rank-major (k*E + e)
        out[param] = (a.reshape(E * r, -1), b.transpose(1, 2, 0).reshape(b.shape[1], r * E))
    return out


def _logical_w13(base: FusedMoE, parts: list[np.ndarray]) -> np.ndarray:
    """(gate, up) `[E, inter, r]` → the checkpoint's w13 `[E, w13 out, r]` (`split_w13`'s
    inverse); a non-gated layer's one part is its w13."""
    if len(parts) == 1:
        return parts[0]
    if base.gate_up_layout == "interleaved":
        E, n, r = parts[0].shape
        return np.stack(parts, axis=2).reshape(E, 2 * n, r)
    return np.concatenate(parts, axis=1)
