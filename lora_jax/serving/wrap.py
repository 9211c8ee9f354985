"""LoRA-ize a Flax NNX model in place: every target base linear → its vLLM LoRA class.

`wrap_model` walks the NNX graph, and for each module whose path is targeted asks the
registered LoRA classes (`LORA_LAYER_CLASSES`, tried in order) which one
`can_replace_layer(source_layer, lora_config, packed_modules_list)`; the first that
accepts wraps the module, and the wrapper replaces it at the same attribute or list
index. All wrappers share one `LoRAContext`, so the model's call signature does not
change: the step's token→slot mapping reaches every layer through that variable.

Module names are the dotted NNX paths (`model.layers.0.self_attn.qkv_proj`), which
match HF/PEFT names once the packed modules are expanded through the packed mapping
(`qkv_proj` → `q_proj`, `k_proj`, `v_proj`). A packed module is targeted when any of
its packed names is. New layer kinds (lm_head, embeddings, MoE) join by appending to
`LORA_LAYER_CLASSES` (or `register_lora_layer`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx
from flax.nnx import graphlib

from lora_jax.config import MAX_LORA_VOCAB_SIZE, LoRAConfig
from lora_jax.layers import (
    BaseLayerWithLoRA,
    ColumnParallelLinearWithLoRA,
    ColumnParallelLinearWithShardedLoRA,
    FlaxEinsumWithLoRA,
    FlaxEmbedWithLoRA,
    FlaxLinearGeneralWithLoRA,
    FlaxLinearWithLoRA,
    LoRAContext,
    MergedColumnParallelLinearVariableSliceWithLoRA,
    MergedColumnParallelLinearVariableSliceWithShardedLoRA,
    MergedColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithShardedLoRA,
    MergedQKVParallelLinearWithLoRA,
    MergedQKVParallelLinearWithShardedLoRA,
    ParallelLMHeadWithLoRA,
    QKVParallelLinearWithLoRA,
    QKVParallelLinearWithShardedLoRA,
    ReplicatedLinearWithLoRA,
    RowParallelLinearWithLoRA,
    RowParallelLinearWithShardedLoRA,
    TiedLMHeadWithLoRA,
    VocabParallelEmbeddingWithLoRA,
    find_lora_context,
)
from lora_jax.layers.moe import FusedMoE3DWithLoRA, FusedMoEWithLoRA
from lora_jax.vocab import VocabParallelEmbedding

# Tried in order; the first class whose `can_replace_layer` accepts a module wraps it.
# Sharded (S-LoRA) classes come first: they only accept when `fully_sharded_loras`.
LORA_LAYER_CLASSES: list[type] = [
    ColumnParallelLinearWithShardedLoRA,
    MergedColumnParallelLinearWithShardedLoRA,
    MergedColumnParallelLinearVariableSliceWithShardedLoRA,
    QKVParallelLinearWithShardedLoRA,
    MergedQKVParallelLinearWithShardedLoRA,
    RowParallelLinearWithShardedLoRA,
    ReplicatedLinearWithLoRA,
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearVariableSliceWithLoRA,
    QKVParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
    VocabParallelEmbeddingWithLoRA,  # embed_tokens
    ParallelLMHeadWithLoRA,  # lm_head (a tied lm_head: see _tied_lm_head)
    FusedMoE3DWithLoRA,  # FusedMoE experts: one LoRA over fused gate|up, one over down
    FusedMoEWithLoRA,  # FusedMoE experts named as separate w1 / w3 (2-item packed list)
    FlaxLinearWithLoRA,  # a plain flax.nnx.Linear (models not built from lora_jax.linear)
    FlaxEmbedWithLoRA,  # a plain flax.nnx.Embed
    FlaxLinearGeneralWithLoRA,  # a plain flax.nnx.LinearGeneral (nnx.MultiHeadAttention)
    FlaxEinsumWithLoRA,  # a plain flax.nnx.Einsum that is one flat linear map
]

TargetModules = Sequence[str] | str | None


def register_lora_layer(cls: type, *, first: bool = False) -> type:
    """Adds a LoRA layer class to the registry `wrap_model` tries (usable as a decorator).

    The class needs `can_replace_layer(source_layer, lora_config, packed_modules_list)`
    and a constructor `cls(base_layer, lora_config, context, *, name=...)`.

    Example:
        >>> register_lora_layer(MyLayerWithLoRA)  # doctest: +SKIP
    """
    if cls not in LORA_LAYER_CLASSES:
        LORA_LAYER_CLASSES.insert(0, cls) if first else LORA_LAYER_CLASSES.append(cls)
    return cls


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


def is_lora_layer(node: Any) -> bool:
    """True for the LoRA wrappers `wrap_model` creates (any registered class)."""
    return isinstance(node, (BaseLayerWithLoRA, *LORA_LAYER_CLASSES))


def module_name(path: Sequence[Any]) -> str:
    """NNX path parts → the dotted module name (`("model", "layers", 0)` → `model.layers.0`)."""
    return ".".join(str(p) for p in path)


def packed_names(name: str, packed_modules: Sequence[str]) -> list[str]:
    """Full checkpoint names a (packed) module answers to: `a.qkv_proj` → `a.q_proj`, ..."""
    prefix = name.rpartition(".")[0]
    return [f"{prefix}.{p}" if prefix else p for p in packed_modules]


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


def _pick_class(node, lora_config: LoRAConfig, packed: Sequence[str]) -> type | None:
    for cls in LORA_LAYER_CLASSES:
        if cls.can_replace_layer(node, lora_config, list(packed)):
            return cls
    return None


def _get_child(parent, key):
    return (
        parent[key] if isinstance(key, int) or isinstance(parent, Mapping) else getattr(parent, key)
    )


_GRAPH_EDITS = [0]


def graph_edits() -> int:
    """How many layers `wrap_model` / `unwrap_model` have swapped in this process (a
    `Generator` re-walks its model's graph when this moved)."""
    return _GRAPH_EDITS[0]


def _set_child(parent, key, value) -> None:
    _GRAPH_EDITS[0] += 1
    if isinstance(key, int) or isinstance(parent, Mapping):
        parent[key] = value
    else:
        setattr(parent, key, value)


def _resolve(model: nnx.Module, path: Sequence[Any]):
    node = model
    for key in path:
        node = _get_child(node, key)
    return node


def _candidates(model: nnx.Module, lora_config, mapping):
    """(path, module, packed list, class) for every module some LoRA class can wrap."""
    out = []
    inside_lora: list[tuple] = []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module) or not path:
            continue
        if is_lora_layer(node):
            inside_lora.append(tuple(path))
            continue
        name = module_name(path)
        packed = list(mapping.get(str(path[-1]), [str(path[-1])]))
        if isinstance(
            node, (nnx.Linear, nnx.Embed, nnx.LinearGeneral, nnx.Einsum)
        ):  # one plain layer: one checkpoint module
            packed = [str(path[-1])]
        cls = _pick_class(node, lora_config, packed)
        if cls is not None:
            out.append((tuple(path), node, packed, cls, name))
    # iter_graph visits children before parents: drop the base layers of existing wrappers.
    return [c for c in out if not any(c[0][: len(p)] == p for p in inside_lora)]


def reference_paths(model: nnx.Module) -> dict[int, list[tuple]]:
    """Every path at which each module and variable of `model` can be reached, by `id`
    (`nnx.iter_graph` names a shared one once: this finds the others).

    The walk is `nnx.iter_graph`'s (Flax's graph protocol), so it sees what NNX and so
    `wrap_model` / `merge_adapter` see: private (`_name`) attributes and plain
    `nnx.Pytree` containers included.

    Example:
        >>> lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        >>> class Tied(nnx.Module):
        ...     def __init__(self):
        ...         self.enc, self.dec = lin, lin
        >>> sorted(reference_paths(Tied())[id(lin)])
        [('dec',), ('enc',)]
    """
    paths: dict[int, list[tuple]] = {}
    on_path: set[int] = set()

    def visit(node, path):
        if isinstance(node, nnx.Variable):
            paths.setdefault(id(node), []).append(path)
            return
        impl = graphlib.get_node_impl(node) if graphlib.is_node(node) else None
        if impl is None:  # a leaf
            return
        if isinstance(node, nnx.Pytree):  # modules and containers outlive this walk
            paths.setdefault(id(node), []).append(path)
        if id(node) in on_path:  # a cycle
            return
        on_path.add(id(node))
        for key, child in impl.node_dict(node).items():
            visit(child, (*path, key))
        on_path.discard(id(node))

    visit(model, ())
    return paths


def _wrapped_names(model: nnx.Module) -> list[str]:
    """Names (and packed member names) of the model's existing LoRA layers."""
    return [
        n
        for name, layer in lora_layers(model).items()
        for n in [name, *packed_names(name, layer_packed_modules(name, layer))]
    ]


def _tied_candidates(model: nnx.Module, candidates) -> list[tuple]:
    """Extra candidates of a model with tied embeddings (`lm_head is None`, logits from
    `model.model.embed_tokens`): the lm_head LoRA goes to `model.lm_head`, over the shared
    table; once it is there the graph walk meets the table under `lm_head.base_layer`
    first (and skips it), so `embed_tokens` is offered here too."""
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if emb is None:
        return []
    head = getattr(model, "lm_head", True)
    if head is None:
        table = getattr(emb, "base_layer", emb)
        if not isinstance(table, VocabParallelEmbedding):  # e.g. a plain nnx.Embed
            return []
        return [(("lm_head",), table, ["lm_head"], TiedLMHeadWithLoRA, "lm_head")]
    path = ("model", "embed_tokens")
    if (
        isinstance(head, TiedLMHeadWithLoRA)
        and not is_lora_layer(emb)
        and not any(c[0] == path for c in candidates)
    ):
        return [(path, emb, ["embed_tokens"], VocabParallelEmbeddingWithLoRA, "model.embed_tokens")]
    return []


def _head_too_wide(candidate) -> bool:
    """Whether a candidate is an lm_head whose vocabulary is past LoRA's limit (vLLM's
    `MAX_LORA_VOCAB_SIZE`): named in `target_modules` it raises; `None` skips it, warning."""
    _, node, _, cls, name = candidate
    if cls not in (ParallelLMHeadWithLoRA, TiedLMHeadWithLoRA):
        return False
    vocab = getattr(node, "base_layer", node).num_embeddings
    if vocab <= MAX_LORA_VOCAB_SIZE:
        return False
    warnings.warn(
        f"wrap_model: {name!r} gets no LoRA: its vocabulary of {vocab} is past LoRA's limit "
        f"of {MAX_LORA_VOCAB_SIZE} (target_modules=None wraps every supported module)",
        stacklevel=3,
    )
    return True


def _why_not(model: nnx.Module, missing: Sequence[str]) -> str:
    """Why the plain Flax layers that ``missing`` names cannot take a LoRA ("" if none)."""
    from lora_jax.layers.flax_general import FlaxGeneralLinear

    reasons = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, (nnx.LinearGeneral, nnx.Einsum)) and path:
            name = module_name(path)
            if _matches(tuple(missing), [name]):
                try:
                    FlaxGeneralLinear(node, name=name)
                except ValueError as e:
                    reasons.append(str(e))
    return "".join(f"; {r}" for r in reasons[:4])


def wrap_model(
    model: nnx.Module,
    lora_config: LoRAConfig,
    *,
    target_modules: TargetModules = None,
    packed_modules_mapping: Mapping[str, Sequence[str]] | None = None,
    context: LoRAContext | None = None,
) -> LoRAContext:
    """Replaces every targeted base linear of `model` by its LoRA class, in place.

    Args:
      model: an NNX module built from `lora_jax.linear` layers, or from plain
        `flax.nnx.Linear` / `flax.nnx.Embed` / `flax.nnx.LinearGeneral` / `flax.nnx.Einsum`
        layers (wrapped as `FlaxLinearWithLoRA` / `FlaxEmbedWithLoRA` /
        `FlaxLinearGeneralWithLoRA` / `FlaxEinsumWithLoRA`), or both.
      lora_config: slot count, max rank, `fully_sharded_loras` (picks the S-LoRA classes).
      target_modules: PEFT-style list of names (a module matches when its dotted path
        equals a name or ends with `.name`), a regex string (`re.fullmatch` on the path),
        or `None` for every supported module. Packed modules match through their
        packed names.
      packed_modules_mapping: packed module → checkpoint names, e.g.
        `{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}`; defaults to
        `lora_jax.models.PACKED_MODULES_MAPPING`.
      context: the `LoRAContext` to share; defaults to the model's existing one or a new one
        (a model that already has LoRA layers takes only its own: one step has one mapping).

    Returns the shared `LoRAContext`. Raises `ValueError` when a target name matches no
    module of the model (nothing is changed then).

    Example:
        >>> ctx = wrap_model(model, LoRAConfig(max_loras=4, max_lora_rank=8))  # doctest: +SKIP
        >>> set_lora_mapping(model, jnp.array([0, -1, 3], jnp.int32))  # doctest: +SKIP
    """
    if not isinstance(lora_config, LoRAConfig):
        raise ValueError(f"wrap_model: lora_config must be a LoRAConfig, got {type(lora_config)}")
    mapping = (
        default_packed_modules_mapping()
        if packed_modules_mapping is None
        else _check_packed_mapping(packed_modules_mapping)
    )
    targets = _normalize_targets(target_modules)
    # the walk below skips the root: nothing holds it, so nothing could take its wrapper
    if any(_pick_class(model, lora_config, ["x"] * n) is not None for n in range(4)):
        raise ValueError(
            f"wrap_model: the model is itself a {type(model).__name__} layer, which cannot be "
            "replaced in place by its LoRA layer; wrap a model (an nnx.Module) that holds it "
            "as an attribute"
        )
    candidates = _candidates(model, lora_config, mapping)
    # last: embed_tokens is wrapped before a tied lm_head takes the shared table
    candidates += _tied_candidates(model, candidates)
    all_names = [n for c in candidates for n in [c[4], *packed_names(c[4], c[2])]]
    all_names += _wrapped_names(model)
    if isinstance(targets, tuple):
        missing = [t for t in targets if not _matches((t,), all_names)]
        if missing:
            leaves = sorted({n.rpartition(".")[2] for n in all_names})
            raise ValueError(
                f"wrap_model: target_modules {missing} match no supported module of the model; "
                f"supported module names: {leaves}{_why_not(model, missing)}"
            )
    elif isinstance(targets, str):
        if not _matches(targets, all_names):
            raise ValueError(
                f"wrap_model: target_modules regex {targets!r} matches no supported module; "
                f"e.g. {[c[4] for c in candidates[:4]]}"
            )

    def key(c: LoRAConfig):
        dtype = None if c.lora_dtype is None else np.dtype(c.lora_dtype).name
        return (c.max_loras, c.max_lora_rank, c.fully_sharded_loras, dtype)

    other = {key(la.lora_config) for la in lora_layers(model).values()} - {key(lora_config)}
    if other:
        raise ValueError(
            f"wrap_model: the model's LoRA layers were built with (max_loras, max_lora_rank, "
            f"fully_sharded_loras, lora_dtype) = {sorted(other, key=str)[0]}, not "
            f"{key(lora_config)}: one step has one mapping over one set of slots; "
            "unwrap_model first to change them"
        )
    existing = find_lora_context(model)
    if context is None:
        context = LoRAContext(None) if existing is None else existing
    elif existing is not None and context is not existing:
        raise ValueError(
            "wrap_model: context= is another LoRAContext than the one the model's LoRA layers "
            "already share; a second one would leave the model with two mappings (one step "
            "has one). Pass the model's own (lj.find_lora_context(model)) or leave context out"
        )
    chosen = [c for c in candidates if _matches(targets, [c[4], *packed_names(c[4], c[2])])]
    if targets is None:  # "every supported module": an lm_head past the LoRA vocab limit is not
        chosen = [c for c in chosen if not _head_too_wide(c)]
    refs = reference_paths(model)
    # a LoRA wrapper holding the module (a tied lm_head over the embedding) is by design
    wrapped_at = {p for la in lora_layers(model).values() for p in refs.get(id(la), [])}
    for _path, node, _, cls, name in chosen:
        places = [
            p for p in refs.get(id(node), []) if not any(p[:k] in wrapped_at for k in range(len(p)))
        ]
        if len(places) > 1 and not getattr(cls, "tied", False):
            raise ValueError(
                f"wrap_model: {name!r} is one module reached from {len(places)} places "
                f"{sorted(module_name(p) for p in places)}; its LoRA layer would replace it "
                "at one of them only. Give each place its own module, or leave it out of "
                "target_modules"
            )
    # Every wrapper is built (and may refuse) before the first one is swapped in.
    swaps = []
    for path, node, packed, cls, name in chosen:
        parent = _resolve(model, path[:-1])
        if isinstance(parent, tuple):
            raise ValueError(
                f"wrap_model: {name!r} sits in a tuple, which cannot take its LoRA layer; hold "
                "the layers in an nnx.List (or a list / dict)"
            )
        layer = cls(node, lora_config, context, name=name)
        layer.packed_modules = tuple(packed)
        # A tied model's `lm_head = None` is a static attribute: mark the new module as data.
        value = nnx.data(layer) if getattr(cls, "tied", False) else layer
        swaps.append((parent, path[-1], value))
    for parent, key, value in swaps:
        _set_child(parent, key, value)
    _mark_tied_embedding(model)
    return context


def _mark_tied_embedding(model: nnx.Module) -> None:
    """Marks the embedding LoRA layer of a tied model (`lm_head` None, or a tied head over
    `model.model.embed_tokens`): its table is the lm_head too, which a merge given only a
    part of the model (or a wrapper of it) could not see."""
    head = getattr(model, "lm_head", True)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if (head is None or isinstance(head, TiedLMHeadWithLoRA)) and isinstance(
        emb, VocabParallelEmbeddingWithLoRA
    ):
        emb.tied_table = True


def unwrap_model(model: nnx.Module, *, keep_merged: bool = False) -> int:
    """Puts every LoRA layer's base layer back in its place; returns how many were removed.

    A model with a merged adapter (`merge_adapter`) is refused unless `keep_merged=True`,
    which keeps that adapter in the base weights for good (PEFT's `merge_and_unload`;
    see `lora_jax.serving.merge.merge_and_unload`): unwrapping drops the saved originals.

    Example:
        >>> from lora_jax.models import DecoderConfig, DecoderForCausalLM
        >>> model = DecoderForCausalLM(DecoderConfig.tiny(), rngs=nnx.Rngs(0))  # 2 layers
        >>> _ = wrap_model(model, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> unwrap_model(model)  # 4 projections a layer, embed_tokens, lm_head
        10
    """
    found = [(tuple(p), n) for p, n in nnx.iter_graph(model) if p and is_lora_layer(n)]
    merged = [module_name(p) for p, n in found if getattr(n, "merged_original", None) is not None]
    if merged and not keep_merged:
        raise ValueError(
            f"unwrap_model: layers {merged[:4]} hold a merged adapter (merge_adapter); "
            "unmerge_adapter first, or pass keep_merged=True to keep it in the base weights"
        )
    # Outermost first so a nested wrapper (never made by wrap_model) is not half-restored.
    found.sort(key=lambda pn: len(pn[0]))
    done = 0
    for path, layer in found:
        try:
            current = _resolve(model, path)
        except (AttributeError, IndexError, KeyError):
            continue
        if current is layer:
            original = None if getattr(layer, "tied", False) else layer.base_layer
            original = getattr(original, "source", original)  # FlaxLinear / FlaxEmbed's own
            _set_child(_resolve(model, path[:-1]), path[-1], original)
            done += 1
    return done


def lora_layers(model: nnx.Module) -> dict[str, Any]:
    """The model's LoRA layers by dotted module name, in graph order.

    Example:
        >>> from lora_jax.models import DecoderConfig, DecoderForCausalLM
        >>> model = DecoderForCausalLM(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
        >>> _ = wrap_model(model, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> list(lora_layers(model))[:3]
        ['lm_head', 'model.embed_tokens', 'model.layers.0.mlp.down_proj']
    """
    layers = {}
    for path, node in nnx.iter_graph(model):
        if path and is_lora_layer(node):
            layers[module_name(path)] = node
    return dict(sorted(layers.items(), key=lambda kv: _natural_key(kv[0])))


def layer_packed_modules(name: str, layer) -> tuple[str, ...]:
    """The checkpoint (leaf) names a LoRA layer's slices answer to."""
    packed = getattr(layer, "packed_modules", None)
    return tuple(packed) if packed else (name.rpartition(".")[2],)


def _natural_key(name: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]
