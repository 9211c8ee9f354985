"""Writing a fresh PEFT-initialised adapter into a device slot, to train it there.

`init_lora_slot` checks the slot (free of any live manager's adapter, not merged) and the
``target_modules``, then gives every targeted module PEFT's initialisation and resets every
other LoRA layer's slot. `trainable_layers` / `is_linear` / `WHOLE_LAYERS` say which layers
train (and `save_peft_adapter` exports). The overview is in `lora_jax.serving.training`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from lora_jax.layers.base import BaseLayerWithLoRA
from lora_jax.layers.embedding import VocabParallelEmbeddingWithLoRA
from lora_jax.layers.logits import ParallelLMHeadWithLoRA
from lora_jax.layers.moe import FusedMoEWithLoRA
from lora_jax.serving.manager import managers_of
from lora_jax.serving.merge import merged_slot
from lora_jax.serving.peft_config import ALL_LINEAR, matches_targets
from lora_jax.serving.training_dora import check_dora_targets, start_dora
from lora_jax.serving.training_tokens import token_plans, write_tokens
from lora_jax.serving.wrap import (
    _normalize_targets,
    layer_packed_modules,
    lora_layers,
    packed_names,
)

# Layers whose slots are read back whole (`read_lora`), not per linear slice.
WHOLE_LAYERS = (VocabParallelEmbeddingWithLoRA, ParallelLMHeadWithLoRA, FusedMoEWithLoRA)


def is_linear(layer) -> bool:
    """A linear LoRA layer: a `BaseLayerWithLoRA` but fused MoE."""
    return isinstance(layer, BaseLayerWithLoRA) and not isinstance(layer, FusedMoEWithLoRA)


def trainable_layers(model) -> dict[str, BaseLayerWithLoRA]:
    """The LoRA layers `init_lora_slot` initialises and `save_peft_adapter` exports, by
    module name: the linear ones, the token embedding, the lm_head and fused MoE."""
    return {
        name: layer
        for name, layer in lora_layers(model).items()
        if is_linear(layer) or isinstance(layer, WHOLE_LAYERS)
    }


def init_lora_slot(
    model,
    slot: int,
    rank: int,
    *,
    seed: int = 0,
    target_modules: Sequence[str] | str | None = None,
    trainable_token_indices: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    use_dora: bool = False,
) -> list[str]:
    """Writes a fresh PEFT-initialised adapter of ``rank`` into ``slot``; returns the
    checkpoint names of the modules it covers.

    Each targeted module (a packed layer's members each their own: `q_proj`, `k_proj`,
    ...) and the lm_head get A `[rank, in]` drawn from `U(-1/sqrt(in), 1/sqrt(in))`
    (PEFT's `kaiming_uniform_(a=sqrt(5))`) and B `[out, rank]` zero; the token embedding
    gets `lora_embedding_A [rank, V]` zero and `lora_embedding_B [D, rank]` drawn from
    `N(0, 1)`, as PEFT; fused MoE experts (named by their module, e.g. "experts") get
    every projection's A `[E, rank, in]` kaiming-uniform and B zero, as PEFT's
    `target_parameters` do. Every other LoRA layer's slot is reset, so the slot is exactly
    the base model. ``target_modules`` as in PEFT (leaf names or a full-match regex of
    checkpoint names); None or "all-linear": every linear LoRA layer (PEFT's: the embedding,
    lm_head and experts only when named). Everything is checked before the first write:
    on error no slot changes.

    ``trainable_token_indices`` as in PEFT (a list of token ids: the input embedding's; or
    `{module: ids}` naming the embedding and / or an untied lm_head) gives the slot its own
    rows of those tokens (`LoRAConfig.max_lora_trainable_tokens` of room), starting as
    copies of the base rows; they are `nnx.LoRAParam`s and train with the slot's LoRA
    (`lora_jax.serving.training_tokens`). A tied lm_head reads the embedding's rows. The
    other vocab layers' trainable tokens of the slot are emptied.

    ``use_dora=True`` makes the adapter a DoRA adapter, as PEFT's `use_dora`: each targeted
    module's magnitude starts at `||W||` per output unit (so the slot is still the base
    model) and trains with the factors; every targeted module must be a linear layer with
    DoRA (`LoRAConfig(enable_dora=True)`). Call `refresh_dora_norms` after each optimizer
    update (`lora_jax.serving.training_dora`).

    A layer whose one checkpoint module spans several LoRA slices (a packed module of 3+
    output slices saved as one) is refused when targeted and skipped otherwise: its
    slices train their A apart, and the result is no longer one PEFT module.

    A slot in which a live adapter manager of the model holds an adapter is refused (its
    requests would be served the new weights): deactivate that adapter, or train in
    another slot. Reserve the slot first (`manager.reserve_slot(slot)`), so that the
    manager activates nothing into it while it trains.

    Example:
        >>> manager.reserve_slot(1)  # doctest: +SKIP
        True
        >>> init_lora_slot(model, 1, 8, target_modules=["v_proj"])  # doctest: +SKIP
        ['model.layers.0.self_attn.v_proj', 'model.layers.1.self_attn.v_proj']
    """
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or rank < 1:
        raise ValueError(f"init_lora_slot: rank must be a positive int, got {rank!r}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"init_lora_slot: seed must be an int >= 0, got {seed!r}")
    everything = lora_layers(model)
    if not everything:
        raise ValueError("init_lora_slot: the model has no LoRA layers (wrap_model it first)")
    L = next(iter(everything.values())).lora_config.max_loras
    if isinstance(slot, bool) or not isinstance(slot, int | np.integer) or not 0 <= slot < L:
        raise ValueError(f"init_lora_slot: slot must be an int in [0, {L}), got {slot!r}")
    if merged_slot(model) == int(slot):
        raise ValueError(
            f"init_lora_slot: slot {slot} is merged into the base weights; unmerge_adapter first"
        )
    for manager in managers_of(model):
        held = manager.lora_index_to_id[int(slot)]
        if held is not None:
            raise ValueError(
                f"init_lora_slot: slot {slot} holds adapter {held} of a "
                f"{type(manager).__name__} serving this model, whose requests would get the "
                f"new weights; deactivate_adapter({held}) first, or train in another slot "
                "(reserve it with manager.reserve_slot)"
            )
    if isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR:
        target_modules = None  # PEFT's shorthand: what None trains
    try:
        targets = _normalize_targets(target_modules)
    except ValueError as e:
        raise ValueError(f"init_lora_slot: {str(e).removeprefix('wrap_model: ')}") from e
    _check_targets(model, targets)
    if not isinstance(use_dora, bool | np.bool_):
        raise ValueError(f"init_lora_slot: use_dora must be a bool, got {use_dora!r}")
    rng = np.random.default_rng(seed)
    plans, covered, dora = {}, [], {}
    for name, layer in trainable_layers(model).items():
        if isinstance(layer, WHOLE_LAYERS):
            if targets is not None and matches_targets(targets, name):
                plans[name] = layer.prepare_lora(slot, *_whole_init(layer, rank, rng))
                dora[name] = [True]
                covered.append(name)
            continue
        members = packed_names(name, layer_packed_modules(name, layer))
        if len(members) not in (1, layer.n_slices):
            raise ValueError(
                f"init_lora_slot: {name} has {layer.n_slices} slices but answers to "
                f"{len(members)} checkpoint modules {members}"
            )
        chosen = [targets is None or matches_targets(targets, m) for m in members]
        if not any(chosen):
            continue
        if len(members) == 1 and layer.n_slices > 1:
            if targets is None:
                continue
            raise ValueError(
                f"init_lora_slot: {name} is one checkpoint module ({members[0]}) over "
                f"{layer.n_slices} LoRA slices, each with its own A: trained, they would "
                "no longer be one PEFT module"
            )
        fan_in = layer.base_layer.in_features
        bound = 1.0 / np.sqrt(fan_in)
        a = rng.uniform(-bound, bound, (len(members), rank, fan_in)).astype(np.float32)
        a_list = [a_s if keep else None for a_s, keep in zip(a, chosen)]  # [r, in]
        b_list = [  # [out_s, r]
            np.zeros((out, rank), np.float32) if keep else None
            for out, keep in zip(layer.logical_slice_sizes, chosen)
        ]
        plans[name] = layer.prepare_lora(slot, a_list, b_list)
        dora[name] = chosen
        covered += [m for m, keep in zip(members, chosen) if keep]
    if not covered:  # e.g. None on a model whose linear layers are all one module over
        # several slices (skipped)
        raise ValueError(
            f"init_lora_slot: target_modules {targets!r} cover no module that trains here"
        )
    tokens = token_plans(model, int(slot), trainable_token_indices)
    if use_dora:
        check_dora_targets({name: everything[name] for name in plans})
        both = sorted(set(tokens) & set(plans))
        if both:
            raise ValueError(
                f"init_lora_slot: use_dora=True and trainable_token_indices both on {both}; "
                "lora_jax trains each on an embedding, not both on one"
            )
    for name, layer in everything.items():  # every layer checked before the first write
        if name in plans:
            layer.write_lora(slot, plans[name])
            if use_dora:
                start_dora(layer, int(slot), dora[name])
        else:
            layer.reset_lora(slot)
    write_tokens(model, int(slot), tokens)
    return covered


def _whole_init(layer, rank: int, rng) -> tuple:
    """PEFT's initialisation of an embedding / lm_head / experts LoRA, as `set_lora` takes
    it."""
    if isinstance(layer, FusedMoEWithLoRA):
        base = layer.base_layer
        E, H, n = base.num_experts, base.hidden_size, base.intermediate_size
        sizes = {"w13": (H, base.w13_width), "w1": (H, n), "w3": (H, n), "w2": (n, H)}
        a_list, b_list = [], []
        for proj in layer.projections:  # (in, out) of each
            fan_in, out = sizes[proj]
            bound = 1.0 / np.sqrt(fan_in)
            a_list.append(rng.uniform(-bound, bound, (E, rank, fan_in)).astype(np.float32))
            b_list.append(np.zeros((E, out, rank), np.float32))
        return a_list, b_list
    if isinstance(layer, VocabParallelEmbeddingWithLoRA):
        V, D = layer.num_embeddings, layer.embedding_dim
        a = np.zeros((rank, V), np.float32)  # lora_embedding_A [r, V]
        return a, rng.standard_normal((D, rank)).astype(np.float32)  # lora_embedding_B [D, r]
    D = layer.logits_processor.hidden_size
    bound = 1.0 / np.sqrt(D)
    a = rng.uniform(-bound, bound, (rank, D)).astype(np.float32)  # lora_A [r, D]
    return a, np.zeros((layer.num_embeddings, rank), np.float32)  # lora_B [V, r]


def _target_names(name: str, layer) -> list[str]:
    """The names ``target_modules`` picks a layer by: its checkpoint modules (`q_proj`, ...
    of a packed layer), the module itself for a layer written whole (the embedding, the
    lm_head, experts: "experts" even when w1 / w3 are apart)."""
    if isinstance(layer, WHOLE_LAYERS):
        return [name]
    return packed_names(name, layer_packed_modules(name, layer))


def _check_targets(model, targets) -> None:
    if targets is None:
        return
    trainable = trainable_layers(model)
    others = [
        name
        for name, layer in lora_layers(model).items()
        if name not in trainable
        and any(matches_targets(targets, m) for m in _target_names(name, layer))
    ]
    if others:
        kinds = trainable.values()
        raise ValueError(
            f"init_lora_slot: target_modules {targets!r} name {others}, LoRA layers of a "
            f"kind not trained here; trained: {sorted({type(x).__name__ for x in kinds})}"
        )
    names = [m for name, layer in trainable.items() for m in _target_names(name, layer)]
    if not any(matches_targets(targets, m) for m in names):
        raise ValueError(
            f"init_lora_slot: target_modules {targets!r} match no LoRA layer; its "
            f"modules: {sorted({m.rpartition('.')[2] for m in names})}"
        )
