"""Reading and editing a Flax NNX model's graph in place: a node by its path, a child
swapped (counted by `graph_edits`), and every path at which a node can be reached.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flax import nnx
from flax.nnx import graphlib


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
