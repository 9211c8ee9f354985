"""Training adapters in device slots, beside the ones being served.

The LoRA stacks are `nnx.LoRAParam`s and every op has a gradient on every backend (the
Pallas kernels' backward pass is the XLA backend's), so an adapter can be trained in a
slot of a wrapped model while the other slots keep serving:

1. `init_lora_slot` writes a fresh adapter into one slot, as PEFT initialises one:
   linear layers, the lm_head and MoE experts get A kaiming-uniform (`U(±1/sqrt(in))`)
   and B zero, the token embedding A zero and B standard normal, so the model starts
   out as the base model for that slot's tokens;
2. `nnx.Optimizer(model, optax.chain(tie_kv_replicas(model), opt, train_only_slots([slot])),
   wrt=nnx.LoRAParam)` updates that slot only: the other slots' adapters, even under
   weight decay, and every rank column past the slot's rank stay as they were;
   `tie_kv_replicas` (the identity unless tp > kv heads) trains the B rows that the
   stacks hold once per kv-head replica as the one parameter the adapter has;
3. `lora_jax.serving.export.save_peft_adapter` writes the slot as a PEFT adapter
   directory that PEFT, vLLM and `load_peft_adapter` load.

The stacks hold B with the scaling folded in (`alpha / r` is 1 for a slot made here), so
the exported adapter says `lora_alpha = r`. Beside a manager serving the same model, first
`manager.reserve_slot(slot)` a slot it holds no adapter in: the manager then never
activates an adapter into it (nor counts it free) until `manager.release_slot(slot)`.
`init_lora_slot` refuses a slot in which a live manager of the model holds an adapter
(whose requests would get the new weights); it cannot see an unreserved free slot being
taken later, hence the reservation.
An optax optimizer over `nnx.LoRAParam` keeps state for every slot (Adam: two copies of
all the stacks): a large model trains best in a copy with few slots (`max_loras=1`),
whose saved adapter the serving model then loads. On a GPU the forward pass runs the
kernels and the backward pass XLA's gather einsums (the kernels have no autodiff):
`benchmarks/train_step.py` (an H100, 4 Llama-3-8B layers, 4096 tokens, rank 16) measured
the kernels' forward at 1.11 x the base forward, forward + backward at 2.96 x.
A functional loop (`nnx.split`, plain `jax.grad`) sets the token mapping before the split:
Flax refuses to change a Variable (the mapping) inside `jax.grad`; `nnx.grad` /
`nnx.value_and_grad`, as above, take `lj.lora_mapping` inside.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lora_jax.layers.base import BaseLayerWithLoRA
from lora_jax.layers.embedding import VocabParallelEmbeddingWithLoRA
from lora_jax.layers.logits import ParallelLMHeadWithLoRA
from lora_jax.layers.moe import FusedMoEWithLoRA
from lora_jax.serving.manager import managers_of
from lora_jax.serving.merge import merged_slot
from lora_jax.serving.peft_config import ALL_LINEAR, matches_targets
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
    rng = np.random.default_rng(seed)
    plans, covered = {}, []
    for name, layer in trainable_layers(model).items():
        if isinstance(layer, WHOLE_LAYERS):
            if targets is not None and matches_targets(targets, name):
                plans[name] = layer.prepare_lora(slot, *_whole_init(layer, rank, rng))
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
        covered += [m for m, keep in zip(members, chosen) if keep]
    if not covered:  # e.g. None on a model whose linear layers are all one module over
        # several slices (skipped)
        raise ValueError(
            f"init_lora_slot: target_modules {targets!r} cover no module that trains here"
        )
    for name, layer in everything.items():  # every layer checked before the first write
        if name in plans:
            layer.write_lora(slot, plans[name])
        else:
            layer.reset_lora(slot)
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


def train_only_slots(slots: Sequence[int]) -> optax.GradientTransformation:
    """An optax transformation that zeroes every update outside ``slots``.

    Put it last in the chain (after weight decay) and pass ``wrt=nnx.LoRAParam``: every
    LoRA stack has the slot as its first axis, so the adapters in the other slots keep
    their exact values while one is trained.

    Example:
        >>> tx = optax.chain(optax.adamw(1e-3), train_only_slots([1]))
        >>> opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)  # doctest: +SKIP
    """
    given = slots
    if isinstance(slots, jax.Array | np.ndarray):
        slots = slots.tolist() if slots.ndim == 1 else None
    if isinstance(slots, str | bytes) or not isinstance(slots, Iterable):
        raise ValueError(f"train_only_slots: slots must be a list of ints, got {given!r}")
    slots = list(slots)
    bad = [
        s for s in slots if isinstance(s, bool | np.bool_) or not isinstance(s, int | np.integer)
    ]
    if bad:
        raise ValueError(f"train_only_slots: slots must be ints, got {bad!r} in {slots!r}")
    keep_slots = tuple(int(s) for s in slots)
    if not keep_slots:
        raise ValueError("train_only_slots: name at least one slot")

    def update(updates, state, params=None):
        del params

        def mask(u):
            if u is None or jnp.ndim(u) == 0:
                return u
            if max(keep_slots) >= u.shape[0] or min(keep_slots) < -u.shape[0]:
                raise ValueError(
                    f"train_only_slots: slots {list(keep_slots)} outside the {u.shape[0]} "
                    "slots of a LoRA stack"
                )
            keep = jnp.zeros(u.shape[0], bool).at[jnp.asarray(keep_slots)].set(True)
            return jnp.where(keep.reshape((-1,) + (1,) * (u.ndim - 1)), u, jnp.zeros_like(u))

        return jax.tree.map(mask, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def tie_kv_replicas(model) -> optax.GradientTransformation:
    """An optax transformation that trains the replicas of a kv head's B as one parameter.

    With more tensor shards than kv heads, a QKV layer's B stacks hold each kv head's
    rows once per replica (`num_kv_head_replicas`), and each replica gets its own gradient;
    the adapter (PEFT's, the tp=1 model's) has one B per kv head, whose gradient is the sum
    of its replicas'. This puts that sum in every replica. Put it first in the chain,
    before the optimizer: replicas that start equal (as `init_lora_slot` and `set_lora`
    write them) then stay equal under elementwise optimizers (SGD, Adam, weight decay),
    and training follows the unsharded model's. (Transforms that read across entries, such
    as `clip_by_global_norm`, still count a tied row once per replica.) On a model without
    kv replicas it changes nothing.

    Example:
        >>> tied = tie_kv_replicas(model)  # doctest: +SKIP
        >>> tx = optax.chain(tied, optax.adamw(1e-3), train_only_slots([1]))  # doctest: +SKIP
        >>> opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)  # doctest: +SKIP
    """
    if not lora_layers(model):
        raise ValueError("tie_kv_replicas: the model has no LoRA layers (wrap_model it first)")
    ties = _kv_replica_ties(model)

    def update(updates, state, params=None):
        del params
        if not ties:
            return updates, state
        seen = set()

        def tie(path, u):
            key = tuple(_path_key(k) for k in path)
            if key and key[-1] == "value" and key not in ties:  # `nnx.split` state: Variables
                key = key[:-1]
            found = ties.get(key)
            if found is None:
                return u
            name, rows, shape, rules, axes = found
            if u.shape != shape:
                raise ValueError(
                    f"tie_kv_replicas: the update at {'.'.join(map(str, key))} has shape "
                    f"{u.shape}, but {name}'s B there is {shape}: build it with the model "
                    "the optimizer trains"
                )
            seen.add(key)
            return _tie_rows(u, rows, rules, axes)

        out = jax.tree_util.tree_map_with_path(tie, updates)
        missing = sorted(".".join(map(str, k)) for k in ties.keys() - seen)
        if missing:
            raise ValueError(
                f"tie_kv_replicas: the updates hold no B stack at {missing}: it takes the "
                "gradients of the model it was built with, over wrt=nnx.LoRAParam"
            )
        return out, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _kv_replica_ties(model) -> dict[tuple, tuple]:
    """Per B stack holding kv replicas, by its state path: (layer name, the logical row of
    each physical row, the stack's shape, the layer's rules, B's logical axes)."""
    paths = {
        id(node): tuple(path)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.LoRAParam)
    }
    ties = {}
    for name, layer in lora_layers(model).items():
        if not is_linear(layer) or getattr(layer.base_layer, "num_kv_head_replicas", 1) < 2:
            continue
        axes = layer.lora_axes()[1]
        for s, var in enumerate(layer.lora_b):
            n = layer.logical_slice_sizes[s]
            # the layer's own logical → physical layout, applied to row numbers
            rows = np.asarray(layer._physical_b(s, np.arange(n)[:, None]))[:, 0]  # [out_s]
            if len(rows) > n:
                ties[paths[id(var)]] = (name, rows, var.shape, layer.base_layer.rules, axes)
    return ties


def _path_key(entry):
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def _tie_rows(u: jax.Array, rows: np.ndarray, rules, axes) -> jax.Array:
    """Every physical row of B's update `[L, out_s, R]` set to the sum over the rows that
    hold the same logical row."""
    # replicas of a head sit on different tensor shards: sum on one replicated copy
    full = rules.constrain(u, *(None,) * u.ndim)
    n = int(rows.max()) + 1
    summed = jnp.zeros((u.shape[0], n, *u.shape[2:]), u.dtype).at[:, rows].add(full)
    return rules.constrain(summed[:, rows], *axes)
