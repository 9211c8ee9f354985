"""Adapter slots of the stacked LoRA layers: validating an adapter on the host
(`PreparedLoRA`, `check_finite`, `host_f32`), writing it into or clearing a slot of the
stacks (`SlotWriter`, mixed into `BaseLayerWithLoRA`), and the placement helpers the other
stacked layers (embedding, MoE, logits) share for their own slot writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lora_jax.linear import pack_shards


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


class LoRASlotRanks(nnx.Variable):
    """True adapter rank per (slice, slot), `i32[S, max_loras]`; 0 = empty slot.

    The ops mask each slot's rank columns past its rank, so stacks written other than by
    `set_lora` / the managers (`nnx.update`, a restored state) need their ranks too:
    `nnx.state(model, nnx.LoRAParam, LoRASlotRanks)` carries both (and
    `lora_jax.layers.token_rows.TrainableTokenIds` the ids of trainable-token rows, where
    the model has room for them, and `lora_jax.layers.dora.DoRANorm` the DoRA norms, where
    it keeps DoRA).
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


class SlotWriter:
    """Host-side slot writes of `BaseLayerWithLoRA`: `set_lora` = `prepare_lora` (checks,
    padding, physical layout) then `write_lora`; `reset_lora`; `slot_updates` for writers
    that update many layers at once. Reads what `BaseLayerWithLoRA` sets up: `name`,
    `lora_config`, `base_layer`, `slice_groups` (and the widths derived from them), the
    `lora_a` / `lora_b` / `slot_ranks` stacks and `lora_dtype`.

    Example:
        >>> layer.set_lora(1, a_rk, b_nr)  # doctest: +SKIP
        >>> layer.reset_lora(1)  # doctest: +SKIP
    """

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
        self._zero_dora(index)  # plain LoRA until `set_dora`

    def slot_updates(
        self, prepared: PreparedLoRA | None
    ) -> list[tuple[nnx.Variable, int, np.ndarray | None]]:
        """`(variable, slot axis, new slot content)` per stacked variable, for writers that
        update many layers in one jitted call (the adapter manager). `prepared=None` means a
        reset: every content is `None` (zeros)."""
        dora = [(v, 0, None) for v in _dora_stacks(self)]
        if prepared is None:
            return (
                [(v, 0, None) for v in (*self.lora_a, *self.lora_b)]
                + [(self.slot_ranks, 1, None)]
                + dora
            )
        ups = [(v, 0, x) for v, x in zip(self.lora_a, prepared.a)]
        ups += [(v, 0, x) for v, x in zip(self.lora_b, prepared.b)]
        return ups + [(self.slot_ranks, 1, np.asarray(prepared.ranks, np.int32))] + dora

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
        self._zero_dora(index)

    def _zero_dora(self, index: int) -> None:
        for var in _dora_stacks(self):
            self._write(var, index, np.zeros(var.shape[1:], np.float32))

    def _set_ranks(self, index: int, ranks: Sequence[int]) -> None:
        old = self.slot_ranks[...]
        new = np.array(old)
        new[:, int(index)] = ranks
        self.slot_ranks.set_value(put_like(new, old))


def _dora_stacks(layer) -> tuple[nnx.Variable, ...]:
    """The layer's DoRA magnitude and norm stacks (none without DoRA)."""
    if getattr(layer, "dora_norm", None) is None:
        return ()
    return (layer.dora_magnitude, layer.dora_norm)
