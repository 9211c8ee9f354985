"""`BaseLayerWithLoRA`: stacked adapter slots around a base linear, per-token mapping.

Each LoRA layer wraps a base linear from `lora_jax.linear` and owns, per slice s,
`lora_a[s] [max_loras, max_rank, in]` and `lora_b[s] [max_loras, out_s, max_rank]`
(`nnx.LoRAParam`, so `nnx.split(model, nnx.LoRAParam, ...)` separates the adapters).
The per-step token→slot mapping reaches every layer through one `LoRAContext`
variable shared by reference, so the wrapped model's call signature never changes.

A "slice" is what vLLM calls one LoRA of a packed layer: gate and up are 2 slices of a
merged column layer; QKVParallelLinearWithLoRA has 1 slice over the packed q|k|v.
`slice_groups[s]` lists the base sub-slices (base `output_sizes`) that slice s covers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lora_jax.config import LoRAConfig
from lora_jax.linear import LinearBase, pack_shards
from lora_jax.mapping import PROMPT_TILE_TOKENS, LoRAMapping, make_lora_mapping

# One copy of a LoRA layer's input for both of its readers, the base matmul and the shrink.
# Without the barrier XLA's GPU fusion recomputes the input's elementwise producer (say an
# RMSNorm's scale) once per reader, each a full pass over the activations: at 4 x 1024
# tokens of hidden 4096 two extra 32 MB passes a norm (session 23's profile). Setting it
# False is for the benchmark that measures this.
SHARE_LAYER_INPUT = True


class LoRAContext(nnx.Variable):
    """Holds the step's `LoRAMapping` (or None); one instance is shared by all layers.

    Example:
        >>> ctx = LoRAContext(None)
        >>> ctx.set_value(make_lora_mapping(jnp.array([0, -1]), max_loras=2))
    """


@dataclasses.dataclass(frozen=True)
class PreparedLoRA:
    """One adapter for one layer, validated and laid out as the layer stores it.

    Host arrays, zero-padded to `max_lora_rank`; a slice the adapter lacks is all zeros
    with rank 0. Made by `BaseLayerWithLoRA.prepare_lora`.
    """

    a: tuple[np.ndarray, ...]  # per slice f32 [max_rank, in]
    b: tuple[np.ndarray, ...]  # per slice f32 [out_s (physical), max_rank]
    ranks: tuple[int, ...]  # per slice true rank, 0 = absent


def check_finite(name: str, prepared: PreparedLoRA, dtype) -> PreparedLoRA:
    """`prepared` if every value stays finite in the stacks' `dtype`, else a ValueError.

    A non-finite value in a slot would not stay in its slot: the XLA path's one-hot
    expand multiplies every slot's B by 0 for other slots' tokens, and 0 * inf is NaN.
    """
    for what, arrays in (("lora_a", prepared.a), ("lora_b", prepared.b)):
        for s, arr in enumerate(arrays):
            with np.errstate(over="ignore", invalid="ignore"):
                stored = np.asarray(arr).astype(dtype).astype(np.float32)
            if not np.isfinite(stored).all():
                raise ValueError(
                    f"{name}.set_lora: {what} (slice {s}) holds values that are not finite in "
                    f"{np.dtype(dtype).name} (inf / NaN, or past that dtype's range): an "
                    "adapter's weights (scaling folded in) must be finite"
                )
    return prepared


def host_f32(name: str, what: str, value) -> np.ndarray:
    """An adapter tensor as host f32: real numbers (any float incl. bfloat16, ints,
    bools), never traced, else a ValueError naming ``name`` and ``what``."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"{name}.set_lora: {what} is traced: set_lora checks and pads on the host; call "
            "it outside jit"
        )
    dtype = np.asarray(value).dtype
    if not (jnp.issubdtype(dtype, jnp.floating) or dtype.kind in "iub"):
        raise ValueError(f"{name}.set_lora: {what} must be real numbers, got dtype {dtype}")
    with np.errstate(over="ignore"):  # a value past f32 is refused by check_finite
        return np.asarray(value, np.float32)


def put_like(new: np.ndarray, old: jax.Array) -> jax.Array:
    """A host edit of ``old`` put back where ``old`` lives: with its sharding when it is
    committed (on a mesh after a jitted step), else uncommitted as it was. Committing an
    uncommitted array changes the key of every jit it is passed to: one slot write made
    each compiled serving program compile again."""
    if getattr(old, "committed", True):
        return jax.device_put(new, old.sharding)
    return jnp.asarray(new)


def check_host_write(name: str, what: str, slot_ranks: nnx.Variable) -> None:
    """Slot writes are host-side edits of the stacks: under a jax transform (a traced
    layer) they would only change the trace, so they are refused by name."""
    if isinstance(slot_ranks.get_value(), jax.core.Tracer):
        raise ValueError(
            f"{name}.{what}: the layer is traced; slot writes are host-side, call {what} "
            "outside jit"
        )


def check_mapping_slots(name: str, mapping: LoRAMapping, max_loras: int) -> None:
    """The mapping was built for the layer's slot count. Layers that rebuild the mapping
    from its indices (per data shard, per logits row) would otherwise read indices past
    their slots as "no adapter" where the ops refuse the mismatch."""
    if mapping.max_loras != max_loras:
        raise ValueError(
            f"{name}: the LoRA mapping was built for max_loras={mapping.max_loras}, the "
            f"layer has {max_loras} slots"
        )


class LoRASlotRanks(nnx.Variable):
    """True adapter rank per (slice, slot), `i32[S, max_loras]`; 0 = empty slot.

    The ops mask each slot's rank columns past its rank, so stacks written other than by
    `set_lora` / the managers (`nnx.update`, a restored state) need their ranks too:
    `nnx.state(model, nnx.LoRAParam, LoRASlotRanks)` carries both.
    """


@jax.jit
def _write_slot(stack: jax.Array, index: jax.Array, value: jax.Array) -> jax.Array:
    return stack.at[index].set(value.astype(stack.dtype))


def _place_like(value: np.ndarray, stack: jax.Array) -> jax.Array:
    """Puts one slot's value with the stack's sharding minus the slot dim."""
    sharding = getattr(stack, "sharding", None)
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (stack.ndim - len(sharding.spec))
        return jax.device_put(value, NamedSharding(sharding.mesh, P(*spec[1:])))
    return jnp.asarray(value)


class BaseLayerWithLoRA(nnx.Module):
    """Common slot logic; see the concrete `*WithLoRA` classes.

    Subclasses set `fully_sharded` and implement `_lora_local`, and may override
    `_slice_groups` and `_split_single`.

    Example:
        >>> base = ReplicatedLinear(16, 32, rngs=nnx.Rngs(0))
        >>> layer = ReplicatedLinearWithLoRA(base, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> layer.set_lora(1, np.ones((4, 16)), np.ones((32, 4)))  # rank 4 <= 8
        >>> _ = set_lora_mapping(layer, jnp.array([1, -1], jnp.int32))  # token -> slot
        >>> y = layer(jnp.ones((2, 16)))  # row 0: base + B @ A x, row 1: base only
        >>> layer.reset_lora(1)
    """

    fully_sharded: bool = False

    def __init__(
        self,
        base_layer: LinearBase,
        lora_config: LoRAConfig,
        context: LoRAContext | None = None,
        *,
        name: str | None = None,
    ):
        self.base_layer = base_layer
        self.lora_config = lora_config
        self.lora_context = context if context is not None else LoRAContext(None)
        self.name = name or type(self).__name__
        self.slice_groups = self._slice_groups(base_layer)
        self._check_base(base_layer)
        rules = base_layer.rules
        cfg = lora_config
        L, R = cfg.max_loras, cfg.max_lora_rank
        rules.check_lora_axes(self.name, self.fully_sharded)
        a_axes, b_axes = self.lora_axes()
        # Only layers that split A's rank rows need the rank to divide (the column S-LoRA);
        # the row S-LoRA splits A on its in dim and B on its out dim, any rank runs.
        rank_shards = rules.size("lora_rank_sharded") if "lora_rank_sharded" in a_axes else 1
        if R % rank_shards:
            raise ValueError(
                f"{self.name}: max_lora_rank={R} must be divisible by the tensor axis "
                f"({rank_shards}) with fully_sharded_loras"
            )
        dtype = cfg.dtype_for(base_layer.param_dtype)
        self.lora_dtype = dtype
        self.lora_a = nnx.List(
            [
                nnx.LoRAParam(rules.place(jnp.zeros((L, R, n_in), dtype), *a_axes))
                for n_in in [base_layer.in_features] * len(self.slice_groups)
            ]
        )  # per slice [max_loras, max_rank, in]
        self.lora_b = nnx.List(
            [
                nnx.LoRAParam(rules.place(jnp.zeros((L, n, R), dtype), *b_axes))
                for n in self.slice_widths
            ]
        )  # per slice [max_loras, out_s (physical), max_rank]
        ranks = jnp.zeros((len(self.slice_groups), L), jnp.int32)  # [S, max_loras]
        self.slot_ranks = LoRASlotRanks(rules.place(ranks, None, None))

    # -- structure ------------------------------------------------------------------------
    def _slice_groups(self, base: LinearBase) -> tuple[tuple[int, ...], ...]:
        return (tuple(range(len(base.output_sizes))),)

    def _check_base(self, base: LinearBase) -> None:
        pass

    def lora_axes(self) -> tuple[tuple, tuple]:
        """Logical axes of A `[L, R, in]` and B `[L, out, R]` for this layer kind."""
        raise NotImplementedError

    @property
    def n_slices(self) -> int:
        return len(self.slice_groups)

    @property
    def slice_widths(self) -> tuple[int, ...]:
        """Physical out width of each slice (kv replicas included)."""
        phys = self.base_layer.physical_sizes
        return tuple(sum(phys[i] for i in g) for g in self.slice_groups)

    @property
    def logical_slice_sizes(self) -> tuple[int, ...]:
        out = self.base_layer.output_sizes
        return tuple(sum(out[i] for i in g) for g in self.slice_groups)

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ) -> bool:
        return False

    # -- slot writes ----------------------------------------------------------------------
    def _normalize(self, lora_a, lora_b) -> tuple[list, list]:
        n = self.n_slices
        if not isinstance(lora_b, (list, tuple)) and n > 1:
            # A single-tensor checkpoint: B split by out size; one A shared by all slices
            # (or one per slice: vLLM converts A and B independently).
            b = np.asarray(lora_b)
            if b.ndim != 2 or b.shape[0] != sum(self.logical_slice_sizes):
                raise ValueError(
                    f"{self.name}.set_lora: a single lora_b must be "
                    f"[{sum(self.logical_slice_sizes)}, rank] (sum of output sizes "
                    f"{self.logical_slice_sizes}), got {b.shape}"
                )
            cuts = np.cumsum(self.logical_slice_sizes)[:-1]
            bs = list(np.split(b, cuts, axis=0))
            if isinstance(lora_a, (list, tuple)):
                if len(lora_a) != n:
                    raise ValueError(
                        f"{self.name}.set_lora: expected {n} slice(s) of lora_a, got {len(lora_a)}"
                    )
                return list(lora_a), bs
            return [lora_a] * n, bs
        b_list = list(lora_b) if isinstance(lora_b, (list, tuple)) else [lora_b]
        if not isinstance(lora_a, (list, tuple)) and len(b_list) == n > 1:
            lora_a = [lora_a] * n  # one A shared by the slices, B per slice (as vLLM takes it)
        a_list = list(lora_a) if isinstance(lora_a, (list, tuple)) else [lora_a]
        if len(a_list) != n or len(b_list) != n:
            raise ValueError(
                f"{self.name}.set_lora: expected {n} slice(s) of lora_a and lora_b, got "
                f"{len(a_list)} and {len(b_list)}"
            )
        return a_list, b_list

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        """Writes an adapter into slot `index` (scaling already folded into B).

        `lora_a`: `[r, in]` (or one per slice), `lora_b`: `[out, r]` (or one per slice,
        `None` for a slice the adapter lacks). Ranks below `max_lora_rank` are zero-padded.
        Every check runs before any write: on error no slot changes.

        Example:
            >>> layer.set_lora(0, a_rk, b_nr)  # doctest: +SKIP
        """
        self.write_lora(index, self.prepare_lora(index, lora_a, lora_b))

    def prepare_lora(self, index: int, lora_a, lora_b) -> PreparedLoRA:
        """Validates an adapter for slot `index` and builds the padded physical arrays.

        Host-side only: nothing is written. Raises `ValueError` naming the layer on a bad
        index, slice count, rank or shape. `write_lora` then stores the result; the adapter
        manager prepares every layer first and writes them all in one jitted update.

        Example:
            >>> prepared = layer.prepare_lora(0, a_rk, b_nr)  # doctest: +SKIP
            >>> layer.write_lora(0, prepared)  # doctest: +SKIP
        """
        R = self.lora_config.max_lora_rank
        self._check_index(index, "set_lora")
        a_list, b_list = self._normalize(lora_a, lora_b)
        in_features = self.base_layer.in_features
        new_a, new_b, ranks = [], [], []
        for s, (a, b, out) in enumerate(zip(a_list, b_list, self.logical_slice_sizes)):
            if (a is None) != (b is None):
                raise ValueError(f"{self.name}.set_lora: slice {s} has only one of A and B")
            if a is None:
                new_a.append(np.zeros((R, in_features), np.float32))
                new_b.append(np.zeros((self.slice_widths[s], R), np.float32))
                ranks.append(0)
                continue
            a = host_f32(self.name, f"slice {s} lora_a", a)
            b = host_f32(self.name, f"slice {s} lora_b", b)
            if a.ndim != 2 or a.shape[1] != in_features:
                raise ValueError(
                    f"{self.name}.set_lora: slice {s} lora_a must be [rank, {in_features}], "
                    f"got {a.shape}"
                )
            r = a.shape[0]
            if not 1 <= r <= R:
                raise ValueError(
                    f"{self.name}.set_lora: slice {s} rank {r} is outside [1, max_lora_rank={R}]"
                )
            if b.shape != (out, r):
                raise ValueError(
                    f"{self.name}.set_lora: slice {s} lora_b must be [{out}, {r}], got {b.shape}"
                )
            new_a.append(np.pad(a, ((0, R - r), (0, 0))))
            new_b.append(np.asarray(self._physical_b(s, np.pad(b, ((0, 0), (0, R - r))))))
            ranks.append(r)
        prepared = PreparedLoRA(a=tuple(new_a), b=tuple(new_b), ranks=tuple(ranks))
        return check_finite(self.name, prepared, self.lora_dtype)

    def write_lora(self, index: int, prepared: PreparedLoRA) -> None:
        """Stores a `prepare_lora` result into slot `index` (no further checks)."""
        self._check_index(index, "write_lora")
        check_host_write(self.name, "set_lora", self.slot_ranks)
        for s in range(self.n_slices):
            self._write(self.lora_a[s], index, prepared.a[s])
            self._write(self.lora_b[s], index, prepared.b[s])
        self._set_ranks(index, prepared.ranks)

    def slot_updates(
        self, prepared: PreparedLoRA | None
    ) -> list[tuple[nnx.Variable, int, np.ndarray | None]]:
        """`(variable, slot axis, new slot content)` per stacked variable, for writers that
        update many layers in one jitted call (the adapter manager). `prepared=None` means a
        reset: every content is `None` (zeros)."""
        if prepared is None:
            return [(v, 0, None) for v in (*self.lora_a, *self.lora_b)] + [
                (self.slot_ranks, 1, None)
            ]
        ups = [(v, 0, x) for v, x in zip(self.lora_a, prepared.a)]
        ups += [(v, 0, x) for v, x in zip(self.lora_b, prepared.b)]
        return ups + [(self.slot_ranks, 1, np.asarray(prepared.ranks, np.int32))]

    def _check_index(self, index, what: str) -> None:
        L = self.lora_config.max_loras
        if isinstance(index, bool | np.bool_) or not isinstance(index, int | np.integer):
            # a bool would write slot 1's stacks and, as a numpy mask, every slot's rank
            raise ValueError(
                f"{self.name}.{what}: index must be an int (a Python or numpy integer), got "
                f"{index!r}"
            )
        if not 0 <= int(index) < L:
            raise ValueError(f"{self.name}.{what}: index {index!r} outside [0, {L})")

    def _physical_b(self, s: int, b: np.ndarray) -> jax.Array:
        """Logical `[out_s, R]` → physical (kv replicas, per-shard packing of sub-slices)."""
        base = self.base_layer
        group = self.slice_groups[s]
        cuts = np.cumsum([base.output_sizes[i] for i in group])[:-1]
        parts = [base._replicate(i, p, 0) for i, p in zip(group, np.split(b, cuts, axis=0))]
        return parts[0] if len(parts) == 1 else pack_shards(parts, 0, base.out_tp)

    def _write(self, var: nnx.Variable, index: int, value) -> None:
        stack = var[...]
        var.set_value(_write_slot(stack, jnp.int32(index), _place_like(np.asarray(value), stack)))

    def reset_lora(self, index: int) -> None:
        """Zeroes slot `index`: it then gives exactly the base output."""
        self._check_index(index, "reset_lora")
        check_host_write(self.name, "reset_lora", self.slot_ranks)
        for var in (*self.lora_a, *self.lora_b):
            self._write(var, index, np.zeros(var.shape[1:], np.float32))
        self._set_ranks(index, [0] * self.n_slices)

    def _set_ranks(self, index: int, ranks: Sequence[int]) -> None:
        old = self.slot_ranks[...]
        new = np.array(old)
        new[:, int(index)] = ranks
        self.slot_ranks.set_value(put_like(new, old))

    # -- forward --------------------------------------------------------------------------
    def _lora_local(self, y, x, a, b, ranks, mapping: LoRAMapping):
        """Per-shard: add the LoRA of `x` into the base output `y` (incl. collectives)."""
        raise NotImplementedError

    def __call__(self, x: jax.Array):
        base = self.base_layer
        mapping = self.lora_context.get_value()
        if mapping is None:
            return base(x)
        if x.shape[-1] != base.in_features:
            raise ValueError(
                f"{self.name}: input last dim {x.shape[-1]} != in_features {base.in_features}"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, base.in_features)
        if mapping.num_tokens != x2.shape[0]:
            raise ValueError(
                f"{self.name}: the LoRA mapping has {mapping.num_tokens} tokens but the input "
                f"has {x2.shape[0]} (leading dims {lead})"
            )
        rules = base.rules
        L = self.lora_config.max_loras
        check_mapping_slots(self.name, mapping, L)
        local_tokens = rules.size("batch") > 1 and x2.shape[0] % rules.size("batch") == 0
        if local_tokens:
            # Sort metadata is per shard of tokens: rebuild it locally from the indices.
            map_arg, map_spec = mapping.token_lora_indices, ("batch",)
        else:
            map_arg, map_spec = mapping, jax.tree.map(lambda _: (), mapping)
        a = tuple(v[...] for v in self.lora_a)
        b = tuple(v[...] for v in self.lora_b)
        ranks = self.slot_ranks[...]
        a_axes, b_axes = self.lora_axes()

        # A shard's tiles of tokens are the step's when its share is whole tiles: what the
        # step's mapping says of its prompt tiles (and of its tiles wholly of one slot: "all"
        # of 128-row tiles is "all" of 64-row ones too) then holds for every shard.
        aligned = x2.shape[0] // rules.size("batch") % PROMPT_TILE_TOKENS == 0
        shard_tiles = mapping.prompt_tiles if aligned else None
        shard_whole = mapping.whole_tiles if aligned else None

        def local(xl, kl, a, b, ranks, m):
            if not isinstance(m, LoRAMapping):
                # tokens_per_slot: a hint (1 holds for any share of the tokens)
                m = make_lora_mapping(
                    m,
                    L,
                    is_prefill=mapping.is_prefill,
                    prompt_tiles=shard_tiles,
                    tokens_per_slot=mapping.tokens_per_slot,
                    whole_tiles=shard_whole,
                )
            if SHARE_LAYER_INPUT:
                xl = jax.lax.optimization_barrier(xl)
            y = base.local_matmul(xl, kl)
            return self._lora_local(y, xl, a, b, ranks, m)

        specs = ((a_axes,) * len(a), (b_axes,) * len(b), (None, None), map_spec)
        y = base.run_local(x2, local, (a, b, ranks, map_arg), specs)
        return base.finish(y, lead)


def local_offsets(widths: Sequence[int], shards: int) -> tuple[int, ...]:
    """Column offset of each slice inside one shard's packed output."""
    offs, acc = [], 0
    for w in widths:
        offs.append(acc)
        acc += w // shards
    return tuple(offs)


def find_lora_context(model: nnx.Module) -> LoRAContext | None:
    """The `LoRAContext` shared by the LoRA layers of `model` (None if not wrapped).

    Raises if the model's LoRA layers hold more than one context: one step has one mapping.

    Example:
        >>> find_lora_context(model) is None  # before wrap_model  # doctest: +SKIP
        True
    """
    found = {}
    for _, node in nnx.iter_graph(model):
        if isinstance(node, LoRAContext):
            found[id(node)] = node
    if len(found) > 1:
        raise ValueError(
            f"model has {len(found)} LoRA contexts; its LoRA layers must share one (one step "
            "has one mapping). Under a plain jax transform (jax.jit, jax.grad, ...) the model "
            "is a pytree and each layer gets its own copy of the shared context: use nnx.jit, "
            "or pass nnx.split(model)'s state in and nnx.merge it inside. Outside transforms: "
            "wrap the model with one shared context"
        )
    return next(iter(found.values()), None)


def set_lora_mapping(
    model: nnx.Module,
    token_lora_indices: jax.Array | LoRAMapping,
    seq_lora_indices: jax.Array | None = None,
    *,
    is_prefill: bool | None = None,
    prompt_tiles: str | None = None,
    tokens_per_slot: int | None = None,
    whole_tiles: str | None = None,
) -> LoRAMapping | None:
    """Sets the step's mapping on every LoRA layer of `model` (call inside your jit), until
    changed. Inside `nnx.jit` prefer `lora_mapping`'s block: a mapping left here is written
    back by `nnx.jit` and enters the next call's compile key.
    ``is_prefill=False`` marks a decode step (`LoRAMapping.is_prefill`); ``prompt_tiles``,
    ``whole_tiles`` and ``tokens_per_slot`` say what the caller knows of its prompts'
    layout and of its tokens per adapter (`make_lora_mapping`).

    Example:
        >>> set_lora_mapping(model, jnp.array([0, 0, -1, 2], jnp.int32))  # doctest: +SKIP
    """
    ctx = find_lora_context(model)
    if ctx is None:
        _refuse_slots_without_lora(token_lora_indices, seq_lora_indices)
        return None
    if isinstance(token_lora_indices, LoRAMapping):
        mapping = token_lora_indices
    else:
        max_loras = _context_max_loras(model)
        mapping = make_lora_mapping(
            token_lora_indices,
            max_loras,
            seq_lora_indices,
            is_prefill=is_prefill,
            prompt_tiles=prompt_tiles,
            tokens_per_slot=tokens_per_slot,
            whole_tiles=whole_tiles,
        )
    ctx.set_value(mapping)
    return mapping


def _refuse_slots_without_lora(token_lora_indices, seq_lora_indices) -> None:
    """For a model with no LoRA layers (wrap_model forgotten, or unwrapped): the indices
    checked as `make_lora_mapping` checks them, and a slot >= 0 refused, since the base
    model would serve it. Traced indices can be checked for dtype and shape only."""
    if isinstance(token_lora_indices, LoRAMapping):
        seq_lora_indices = token_lora_indices.seq_lora_indices
        token_lora_indices = token_lora_indices.token_lora_indices
    for name, idx in (
        ("token_lora_indices", token_lora_indices),
        ("seq_lora_indices", seq_lora_indices),
    ):
        if idx is None:
            continue
        if not isinstance(idx, jax.Array):
            idx = np.asarray(idx)
        if idx.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {idx.shape}")
        if not jnp.issubdtype(idx.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers, got {idx.dtype}")
        try:
            host = np.asarray(idx)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            continue
        bad = np.unique(host[host >= 0])
        if bad.size:
            raise ValueError(
                f"set_lora_mapping: adapter slots {bad.tolist()} in {name} outside -1 (the "
                "model has no LoRA layers; wrap_model it first)"
            )


@contextlib.contextmanager
def lora_mapping(
    model: nnx.Module,
    token_lora_indices: jax.Array | LoRAMapping,
    seq_lora_indices: jax.Array | None = None,
    **hints,
) -> Iterator[LoRAMapping | None]:
    """`set_lora_mapping` for the ``with`` block only: the previous value (usually None)
    is back on exit. Use it inside `nnx.jit`: a mapping left in the model's context is
    written back by `nnx.jit` and becomes part of the next call's compile key (a recompile
    per batch bucket pair) and the mapping of later calls that set none.

    Example:
        >>> @nnx.jit  # doctest: +SKIP
        ... def step(model, x, slots):
        ...     with lora_mapping(model, slots):
        ...         return model(x)
    """
    ctx = find_lora_context(model)
    old = None if ctx is None else ctx.get_value()
    try:
        yield set_lora_mapping(model, token_lora_indices, seq_lora_indices, **hints)
    finally:
        if ctx is not None:
            ctx.set_value(old)


def clear_lora_mapping(model: nnx.Module) -> None:
    """Removes the step's mapping from the model's LoRA context: the LoRA layers then give
    their base outputs (what `lora_mapping`'s block does on exit)."""
    ctx = find_lora_context(model)
    if ctx is not None:
        ctx.set_value(None)


def _context_max_loras(model: nnx.Module) -> int:
    for _, node in nnx.iter_graph(model):
        if isinstance(node, BaseLayerWithLoRA) or hasattr(node, "lora_config"):
            return node.lora_config.max_loras
    raise ValueError("model has a LoRA context but no LoRA layer")
