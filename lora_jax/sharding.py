"""Logical axis names → mesh axes: the one table every layer's sharding comes from.

Layers name *logical* axes ("tensor", "batch", "lora_rank", ...); `ShardingRules` maps
them onto the axes of a `jax.sharding.Mesh`. vLLM's manual `tp_rank` slicing becomes a
`PartitionSpec` here, and each layer runs its local math inside `jax.shard_map` with
those specs, so the compiled program does exactly the collectives vLLM does by hand.
Meshes with Explicit axes (`jax.make_mesh`'s default) and Auto axes both work: inputs
are resharded to the layer's specs before entering the map.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# The rules table. Values are mesh axis names (or None = replicated). A logical axis
# whose mesh axis is absent from the mesh is replicated.
DEFAULT_RULES: Mapping[str, str | None] = {
    "batch": "dp",  # tokens / sequences
    "embed": None,  # model hidden dim (replicated between tp shards)
    "tensor": "tp",  # column-parallel out dim, row-parallel in dim, heads, mlp
    "vocab": "tp",  # lm_head / embedding vocabulary
    "expert": "ep",  # MoE experts
    "lora_slot": None,  # the max_loras dim of adapter stacks
    "lora_rank": None,  # adapter rank (plain LoRA)
    "lora_rank_sharded": "tp",  # adapter rank under fully_sharded_loras (S-LoRA)
}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """A mesh plus the logical→mesh axis table.

    Example:
        >>> mesh = jax.make_mesh((1, 2), ("dp", "tp"))  # doctest: +SKIP
        >>> ShardingRules(mesh).spec("batch", "tensor")  # doctest: +SKIP
        P('dp', 'tp')
    """

    mesh: Mesh | None = None
    rules: tuple[tuple[str, str | None], ...] = tuple(DEFAULT_RULES.items())

    def __post_init__(self):
        if isinstance(self.rules, Mapping):
            object.__setattr__(self, "rules", tuple(self.rules.items()))
        table = dict(self.rules)
        for logical, axis in table.items():
            # A tuple of mesh axes (PartitionSpec's multi-axis form) is not supported: the
            # layers' shard counts and collectives take one axis, and an axis name the mesh
            # lacks means "replicated", which would run it unsharded without a word.
            if axis is not None and not isinstance(axis, str):
                raise ValueError(
                    f"ShardingRules: logical axis {logical!r} maps to {axis!r}; a rule's value "
                    "must be one mesh axis name (a str) or None (replicated)"
                )
        # S-LoRA's rank shards go where the tensor axis goes: a table that moves "tensor"
        # and keeps the default "lora_rank_sharded" means the same axis for both
        if (
            table.get("lora_rank_sharded") == DEFAULT_RULES["lora_rank_sharded"]
            and table.get("tensor", DEFAULT_RULES["tensor"]) != DEFAULT_RULES["tensor"]
        ):
            table["lora_rank_sharded"] = table["tensor"]
            object.__setattr__(self, "rules", tuple(table.items()))

    def check_lora_axes(self, name: str, fully_sharded: bool) -> None:
        """Raises, naming layer ``name``, on a table whose adapter axes the LoRA layers
        cannot run: the slot and plain rank axes are replicated (nothing sums rank shards
        or splits the token mapping over slots), and S-LoRA's rank shards lie on the
        tensor axis (its collectives run there)."""
        for key in ("lora_slot", "lora_rank"):
            if self.size(key) > 1:
                raise ValueError(
                    f"{name}: the rules map {key!r} to mesh axis {self.mesh_axis(key)!r}; "
                    "LoRA stacks keep it replicated (for rank shards use fully_sharded_loras, "
                    "which splits the rank over the tensor axis)"
                )
        if fully_sharded:
            rank_axis, tensor_axis = self.mesh_axis("lora_rank_sharded"), self.mesh_axis("tensor")
            if rank_axis != tensor_axis:
                raise ValueError(
                    f"{name}: fully_sharded_loras shards the rank over mesh axis {rank_axis!r} "
                    f"('lora_rank_sharded') but the tensor axis is {tensor_axis!r}: map both "
                    "to one axis in the ShardingRules"
                )

    def mesh_axis(self, logical: str | None) -> str | None:
        """Mesh axis for a logical name, or None when it is replicated/absent."""
        if logical is None or self.mesh is None:
            return None
        table = dict(self.rules)
        if logical not in table:
            raise ValueError(f"unknown logical axis {logical!r}; known: {sorted(table)}")
        axis = table[logical]
        return axis if axis in self.mesh.axis_names else None

    def size(self, logical: str | None) -> int:
        """Number of shards along a logical axis (1 when not sharded)."""
        axis = self.mesh_axis(logical)
        return 1 if axis is None else self.mesh.shape[axis]

    def collective_axis(self, logical: str | None) -> str | None:
        """Mesh axis to run a collective over for a logical name, or None when it has a
        single shard (no psum / all_gather of one participant in the program).

        Example:
            >>> ShardingRules().collective_axis("tensor") is None
            True
        """
        return self.mesh_axis(logical) if self.size(logical) > 1 else None

    def spec(self, *logical: str | None) -> P:
        return P(*(self.mesh_axis(name) for name in logical))

    def named(self, *logical: str | None) -> NamedSharding | None:
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, self.spec(*logical))

    @property
    def sharded(self) -> bool:
        return self.mesh is not None and self.mesh.size > 1

    def place(self, x: jax.Array, *logical: str | None) -> jax.Array:
        """Puts a host/device array on the mesh with the logical spec (eager only)."""
        sharding = self.named(*logical)
        return x if sharding is None else jax.device_put(x, sharding)

    def constrain(self, x: jax.Array, *logical: str | None) -> jax.Array:
        """Reshards a traced value to the logical spec; works on Explicit and Auto axes."""
        sharding = self.named(*logical)
        if sharding is None:
            return x
        if _is_explicit(self.mesh):
            return jax.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)


def _is_explicit(mesh: Mesh) -> bool:
    types = getattr(mesh, "axis_types", None)
    if not types:
        return False
    explicit = jax.sharding.AxisType.Explicit
    return any(t == explicit for t in types)


def shard_map(rules: ShardingRules, fn, in_specs, out_specs):
    """`jax.shard_map` over the rules' mesh, resharding inputs to `in_specs` first.

    Explicit-axis meshes refuse inputs whose sharding differs from the specs, so every
    input is resharded (a no-op when it already matches). `in_specs` / `out_specs` are
    pytrees of logical-name tuples, converted through the rules table. Called outside a
    trace (a model run without `jit`), it compiles the body into one program instead of
    jax's eager shard_map, which runs the body op by op on every shard.

    Example:
        >>> rules = ShardingRules(jax.make_mesh((1, 2), ("dp", "tp")))  # doctest: +SKIP
        >>> spec = ("batch", "tensor")  # logical names, per input / output  # doctest: +SKIP
        >>> f = shard_map(rules, lambda x: x * 2, (spec,), spec)  # doctest: +SKIP
        >>> f(jnp.ones((4, 8))).sharding.spec  # doctest: +SKIP
        P('dp', 'tp')
    """
    mesh = rules.mesh
    to_p = lambda names: rules.spec(*names)  # noqa: E731
    is_names = lambda s: (
        isinstance(s, tuple)
        and all(  # noqa: E731
            n is None or isinstance(n, str) for n in s
        )
    )
    pin = jax.tree.map(to_p, in_specs, is_leaf=is_names)
    pout = jax.tree.map(to_p, out_specs, is_leaf=is_names)

    def run(*args):
        args = tuple(
            jax.tree.map(lambda s, a: rules.constrain(a, *s), spec, arg, is_leaf=is_names)
            for spec, arg in zip(in_specs, args)
        )
        return jax.shard_map(fn, mesh=mesh, in_specs=pin, out_specs=pout, check_vma=False)(*args)

    def wrapped(*args):
        if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(args)):
            return run(*args)
        # Eager: a 2-layer MoE decoder on a tp=2 x ep=2 CPU mesh took 11.8 s a forward op
        # by op, 1.1 s compiled
        return _run_eagerly(run, args, mesh)

    return wrapped


# Eager shard_map calls' compiled programs, keyed by what they compute (see `_run_eagerly`).
_EAGER_PROGRAMS: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
_EAGER_PROGRAMS_MAX = 512
# What a program's text does not hold: large closed-over arrays (jax >= 0.12 passes them
# as arguments, `jax.const`), and host callbacks (a call names this lowering's Python
# function by a handle, so a reused program would call the old closure).
_NOT_IN_TEXT = re.compile(r"jax\.const|custom_call @\w*callback")


def _leaf_key(a) -> tuple:
    """What the text misses of an argument: its devices, its weak type, a Python scalar."""
    if isinstance(a, jax.Array):
        return (tuple(sorted(d.id for d in a.sharding.device_set)), a.weak_type)
    return (type(a).__name__,)


def _run_eagerly(run, args, mesh: Mesh):
    """`jax.jit(run)(*args)`, compiling only programs not met before.

    Each eager call brings a fresh closure, so jit's own cache (keyed by the function)
    never hits: every call would compile anew. Lowering is cheap next to compiling, so the
    lowered module's text (no debug locations), its pytree and output types and the
    devices (the mesh's, the arguments': the text names devices by position only) key a
    small LRU of compiled programs instead. The tiny decoder (2 layers) on a tp = 2 CPU
    mesh: ~1.2 s an eager forward before, ~0.35 s after its first (`benchmarks/eager_mesh.py`).
    """
    lowered = jax.jit(run).lower(*args)
    text = lowered.as_text()
    if _NOT_IN_TEXT.search(text):
        return lowered.compile()(*args)  # for this call only
    key = (
        hashlib.sha256(text.encode()).hexdigest(),
        len(text),
        str(lowered.in_tree),
        str(lowered.out_tree),
        str(lowered.out_info),
        tuple(d.id for d in mesh.devices.flat),
        tuple(map(_leaf_key, jax.tree.leaves(args))),
    )
    compiled = _EAGER_PROGRAMS.get(key)
    if compiled is None:
        compiled = lowered.compile()
        _EAGER_PROGRAMS[key] = compiled
        if len(_EAGER_PROGRAMS) > _EAGER_PROGRAMS_MAX:
            _EAGER_PROGRAMS.popitem(last=False)
    else:
        _EAGER_PROGRAMS.move_to_end(key)
    return compiled(*args)


def unshard(x: jax.Array) -> jax.Array:
    """Replicates a traced value that carries an Explicit-axis sharding in its type.

    Sorting and per-row vmaps refuse sharded operands on Explicit meshes ("Arguments to
    sort must be unsharded"); small host-decided arrays (token→slot indices, sampling
    keys) are cheap to replicate. A no-op for unsharded values and Auto meshes.

    Example:
        >>> unshard(jnp.arange(4)).shape  # doctest: +SKIP
        (4,)
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or all(s is None for s in sharding.spec):
        return x
    if not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return x
    return jax.reshard(x, NamedSharding(mesh, P()))
