"""The automatic `--max-lora-rank` of `lora-jax-serve`: the smallest supported rank that fits
(and the `max_lora_trainable_tokens` its adapters' trainable tokens need).

An adapter's rank is the largest its PEFT config gives (`r`, `rank_pattern`); for an MoE
model whose gate and up expert LoRAs are fused into one w13 LoRA, it is r1 + r3, read from
the adapter file's tensor names.
"""

from __future__ import annotations

import os

from lora_jax.config import SUPPORTED_MAX_LORA_RANKS


def _max_rank(adapter_dirs: dict[str, str], model_type: str | None, fused_experts: bool) -> int:
    """The smallest supported max_lora_rank that fits every adapter: the largest rank its
    config gives (r, rank_pattern), and with `fused_experts` the rank r1 + r3 that the
    loader gives per-expert gate + up LoRAs fused into one w13 LoRA."""
    from lora_jax.serving.peft import PEFTConfig

    need, needed_by = 1, None
    for name, d in adapter_dirs.items():
        cfg = PEFTConfig.from_dir(d)
        r = max([cfg.r, *(r for _, r in cfg.rank_pattern)])
        if fused_experts:
            r = max(r, _fused_w13_rank(d, cfg.for_model_type(model_type)))
        if r > need:
            need, needed_by = r, name
    fits = [r for r in SUPPORTED_MAX_LORA_RANKS if r >= need]
    if not fits:
        raise ValueError(
            f"--adapter {needed_by}={adapter_dirs[needed_by]}: needs max_lora_rank >= {need}, "
            f"more than the largest supported, {SUPPORTED_MAX_LORA_RANKS[-1]}"
        )
    return fits[0]


def _fused_w13_rank(adapter_dir: str, cfg) -> int:
    """The largest r1 + r3 over the adapter's per-expert (`experts.{j}.w1` / `w3`, or
    `gate_proj` / `up_proj`) modules, each member's rank its largest expert's, as
    `per_expert_lora` stacks them for `FusedMoE3DWithLoRA`; 0 without such modules."""
    from safetensors import safe_open

    from lora_jax.serving.peft import WEIGHTS_NAME
    from lora_jax.serving.peft_experts import EXPERT_MEMBERS, PER_EXPERT
    from lora_jax.serving.peft_keys import KEY_KINDS, parse_key

    try:  # the header only: the names
        with safe_open(os.path.join(adapter_dir, WEIGHTS_NAME), framework="numpy") as f:
            keys = list(f.keys())
    except Exception:  # missing or unreadable: the loader names the problem
        return 0
    ranks: dict[str, dict[str, int]] = {}  # experts module → w1 / w3 → largest rank
    for key in keys:
        if not key.endswith(tuple(KEY_KINDS)):
            continue
        _, raw, _ = parse_key(key, adapter_dir, None)
        m = PER_EXPERT.fullmatch(raw)
        proj = None if m is None else EXPERT_MEMBERS[m["member"]]
        if proj in ("w1", "w3") and cfg.targets(raw):
            by_proj = ranks.setdefault(m["owner"], {})
            by_proj[proj] = max(by_proj.get(proj, 0), cfg.rank_for(raw))
    return max((sum(by.values()) for by in ranks.values()), default=0)


def _max_trainable_tokens(adapter_dirs: dict[str, str]) -> int:
    """The `max_lora_trainable_tokens` that fits every adapter: the most token ids one of
    its configs' `trainable_token_indices` gives a table (0 when none has any)."""
    from lora_jax.serving.peft import PEFTConfig

    need = 0
    for d in adapter_dirs.values():
        for _, ids in PEFTConfig.from_dir(d).trainable_token_indices or ():
            need = max(need, len(ids))
    return need


def _uses_dora(adapter_dirs: dict[str, str]) -> bool:
    """Whether any adapter is a DoRA adapter (PEFT `use_dora`): `enable_dora` then."""
    from lora_jax.serving.peft import PEFTConfig

    return any(PEFTConfig.from_dir(d).use_dora for d in adapter_dirs.values())
