"""Slot logic shared by the vocab LoRA layers (the token embedding, the lm_head's logits
processor): one `lora_a` / `lora_b` pair per slot, written with the protocol of
`BaseLayerWithLoRA`, and their DoRA (PEFT `use_dora`) stacks: per slot a magnitude and a
norm per output unit, as the linear layers keep theirs (`lora_jax.layers.dora`). Each
layer gives its own `dora_norms` (the embedding's over the vocab, the lm_head's over the
hidden dim) and the order its stacks keep.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.config import LoRAConfig
from lora_jax.layers.base import (
    LoRASlotRanks,
    PreparedLoRA,
    _place_like,
    _write_slot,
    check_finite,
    check_host_write,
    host_f32,
    put_like,
)
from lora_jax.layers.dora import (
    DoRAMagnitude,
    DoRANorm,
    check_magnitudes,
    has_dora,
    slot_magnitudes,
)


def check_slot(name: str, what: str, index, max_loras: int) -> int:
    """`index` as an int in `[0, max_loras)`, else a ValueError naming the layer."""
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
        raise ValueError(f"{name}.{what}: index must be an int, got {index!r}")
    if not 0 <= int(index) < max_loras:
        raise ValueError(f"{name}.{what}: index {int(index)} outside [0, {max_loras})")
    return int(index)


def as_matrix(name: str, tensor: str, value, shape: tuple[int | None, int | None]) -> np.ndarray:
    """`value` as a float32 2-D array whose dims match `shape` (None = any)."""
    if value is None:
        raise ValueError(f"{name}.set_lora: {tensor} is missing")
    arr = host_f32(name, tensor, value)
    want = "[" + ", ".join("rank" if s is None else str(s) for s in shape) + "]"
    if arr.ndim != 2 or any(s is not None and s != n for s, n in zip(shape, arr.shape)):
        raise ValueError(f"{name}.set_lora: {tensor} must be {want}, got shape {arr.shape}")
    return arr


def check_rank(name: str, rank: int, max_rank: int, *others: tuple[str, int]) -> None:
    """Rank in `[1, max_rank]` and equal to every `(tensor, rank)` in `others`."""
    if not 1 <= rank <= max_rank:
        raise ValueError(f"{name}.set_lora: rank {rank} is outside [1, max_lora_rank={max_rank}]")
    for tensor, r in others:
        if r != rank:
            raise ValueError(f"{name}.set_lora: {tensor} has rank {r}, lora_a has rank {rank}")


def _write(var: nnx.Variable, index: int, value: np.ndarray) -> None:
    stack = var[...]
    var.set_value(_write_slot(stack, jnp.int32(index), _place_like(np.asarray(value), stack)))


class VocabSlotsMixin:
    """Slot writes over one `lora_a`/`lora_b` pair and `slot_ranks [1, max_loras]`, with
    the protocol of `BaseLayerWithLoRA` (`prepare_lora` / `write_lora` / `slot_updates`)
    so the adapter manager writes these layers in its one jitted update.

    Subclasses implement `_layout(lora_a, lora_b) -> (a_stored, b_stored, rank)`.
    """

    name: str
    lora_config: LoRAConfig
    lora_a: nnx.LoRAParam
    lora_b: nnx.LoRAParam
    slot_ranks: LoRASlotRanks

    def _layout(self, lora_a, lora_b) -> tuple[np.ndarray, np.ndarray, int]:
        raise NotImplementedError

    def _unlayout(self, a: np.ndarray, b: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def read_lora(self, index: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Slot `index` as `set_lora` takes it (PEFT's layout, scaling in B), host f32;
        None for an empty slot. The inverse of `set_lora`.

        Example:
            >>> a, b = layer.read_lora(0)  # doctest: +SKIP
        """
        index = check_slot(self.name, "read_lora", index, self.lora_config.max_loras)
        rank = int(np.asarray(self.slot_ranks[...])[0, index])
        if rank == 0:
            return None
        a = np.asarray(self.lora_a[...][index], np.float32)
        b = np.asarray(self.lora_b[...][index], np.float32)
        return self._unlayout(a, b, rank)

    def prepare_lora(self, index: int, lora_a, lora_b) -> PreparedLoRA:
        """Validates an adapter for slot `index` and lays it out as stored; writes nothing."""
        check_slot(self.name, "set_lora", index, self.lora_config.max_loras)
        a, b, r = self._layout(lora_a, lora_b)
        return check_finite(self.name, PreparedLoRA(a=(a,), b=(b,), ranks=(r,)), self.lora_dtype)

    def write_lora(self, index: int, prepared: PreparedLoRA) -> None:
        """Stores a `prepare_lora` result into slot `index`."""
        index = check_slot(self.name, "write_lora", index, self.lora_config.max_loras)
        check_host_write(self.name, "set_lora", self.slot_ranks)
        _write(self.lora_a, index, prepared.a[0])
        _write(self.lora_b, index, prepared.b[0])
        self._set_rank(index, prepared.ranks[0])
        if has_dora(self):
            self._zero_dora(index)  # plain LoRA until `set_dora`

    def slot_updates(self, prepared: PreparedLoRA | None) -> list[tuple[nnx.Variable, int, Any]]:
        """`(variable, slot axis, new slot content or None = zeros)` for batched writers; a
        slot written is plain LoRA until its DoRA updates (`dora_updates`) follow."""
        dora = [(v, 0, None) for v in _dora_stacks(self)]
        if prepared is None:
            return [
                (self.lora_a, 0, None),
                (self.lora_b, 0, None),
                (self.slot_ranks, 1, None),
            ] + dora
        ranks = np.asarray(prepared.ranks, np.int32)
        return [
            (self.lora_a, 0, prepared.a[0]),
            (self.lora_b, 0, prepared.b[0]),
            (self.slot_ranks, 1, ranks),
        ] + dora

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        """Writes an adapter (scaling folded into B) into slot `index`; ranks below max
        are zero-padded. All checks run before any write.

        Example:
            >>> layer.set_lora(0, lora_a, lora_b)  # doctest: +SKIP
        """
        self.write_lora(index, self.prepare_lora(index, lora_a, lora_b))

    def reset_lora(self, index: int, *, tokens: bool = True) -> None:
        """Zeroes slot `index`, its trainable tokens too (``tokens``): it then gives
        exactly the base output."""
        index = check_slot(self.name, "reset_lora", index, self.lora_config.max_loras)
        check_host_write(self.name, "reset_lora", self.slot_ranks)
        for var in (self.lora_a, self.lora_b, *_dora_stacks(self)):
            _write(var, index, np.zeros(var.shape[1:], np.float32))
        self._set_rank(index, 0)
        if tokens and getattr(self, "token_ids", None) is not None:
            self.reset_tokens(index)

    # -- DoRA (PEFT use_dora) stacks: per slot, a magnitude and a norm per output unit ---
    DORA_AXES: tuple[str, str]

    def _init_dora(self, width: int, rules) -> None:
        """`dora_magnitude`, `dora_norm` `f32[max_loras, width]` with `enable_dora`, as the
        linear layers keep theirs (else both None)."""
        if not self.lora_config.enable_dora:
            self.dora_magnitude = self.dora_norm = None
            return

        def zeros():  # one buffer each (slot writes donate them)
            L = self.lora_config.max_loras
            return rules.place(jnp.zeros((L, width), jnp.float32), *self.DORA_AXES)

        self.dora_magnitude = DoRAMagnitude(zeros())
        self.dora_norm = DoRANorm(zeros())

    def _dora_args(self) -> tuple[tuple, tuple]:
        """The forward's DoRA stacks and their axes (none with DoRA off)."""
        if not has_dora(self):
            return (), ()
        return (self.dora_magnitude[...], self.dora_norm[...]), (self.DORA_AXES,) * 2

    def _zero_dora(self, index: int) -> None:
        """Makes slot `index` plain LoRA (DoRA gain 1)."""
        for var in _dora_stacks(self):
            _write(var, index, np.zeros(var.shape[1:], np.float32))

    def _set_rank(self, index: int, rank: int) -> None:
        old = self.slot_ranks[...]
        new = np.array(old)
        new[:, index] = rank
        self.slot_ranks.set_value(put_like(new, old))


class VocabDoRAMixin:
    """DoRA's slot API (`check_dora`, `dora_updates`, `set_dora`, ...) over one member of
    width `logical_slice_sizes[0]`, for the token embedding and the lm_head wrapper.

    Needs `name`, `lora_config`, `slot_ranks`, `dora_magnitude`, `dora_norm`,
    `logical_slice_sizes` and `dora_norms(slot)` (the norms as the stacks keep them);
    `_stored_magnitude` / `_logical_magnitude` map PEFT's order to the stacks' and back.
    """

    n_slices = 1  # one LoRA pair (DoRA's magnitudes are checked per slice)

    def dora_norms(self, slot) -> jax.Array:
        """`||W + B @ A||` per stored output unit of slot `slot` (f32; traceable)."""
        raise NotImplementedError

    def _stored_magnitude(self, m: np.ndarray) -> np.ndarray:
        """PEFT's magnitude (logical order) in the stacks' layout."""
        return m

    def _logical_magnitude(self, m: np.ndarray) -> np.ndarray:
        """The inverse of `_stored_magnitude`."""
        return m

    def check_dora(self, magnitudes) -> None:
        """Validates a DoRA adapter's magnitudes (one member) for this layer."""
        check_magnitudes(self, magnitudes)

    def weight_norms(self, slot: int) -> np.ndarray:
        """`dora_norms(slot)` on the host (f32)."""
        return np.asarray(_dora_norms(self, jnp.int32(slot)), np.float32)

    def dora_updates(self, index: int, magnitudes) -> list:
        """`[(dora_magnitude, 0, m), (dora_norm, 0, ||W + B @ A||)]` for slot `index`, whose
        LoRA is written: PEFT's gain `magnitude / ||W + B @ A||`."""
        check_magnitudes(self, magnitudes)
        (m,) = magnitudes
        if m is None:  # plain LoRA: both zero
            zero = np.zeros(self.dora_norm.shape[1:], np.float32)
            return [(self.dora_magnitude, 0, zero), (self.dora_norm, 0, zero)]
        stored = self._stored_magnitude(np.asarray(m, np.float32))
        return [(self.dora_magnitude, 0, stored), (self.dora_norm, 0, self.weight_norms(index))]

    def set_dora(self, index: int, magnitudes) -> None:
        """Makes slot `index`'s adapter (written with `set_lora`) a DoRA adapter:
        ``magnitudes`` is `[magnitude]`, PEFT's `lora_magnitude_vector`.

        Example:
            >>> emb.set_lora(0, a, b); emb.set_dora(0, [magnitude])  # doctest: +SKIP
        """
        index = check_slot(self.name, "set_dora", index, self.lora_config.max_loras)
        check_host_write(self.name, "set_dora", self.slot_ranks)
        for var, _, value in self.dora_updates(index, magnitudes):
            _write(var, index, value)

    def start_dora(self, index: int) -> None:
        """Makes slot `index` DoRA with PEFT's starting magnitude `||W + B @ A||` (gain 1)."""
        norms = self.weight_norms(index)
        for var in _dora_stacks(self):
            _write(var, index, norms)

    def read_magnitudes(self, index: int) -> np.ndarray:
        """PEFT's `lora_magnitude_vector` of slot `index` (`slot_magnitudes`, logical order)."""
        return self._logical_magnitude(slot_magnitudes(self, index))


def dora_unit_norms(table, a, b, over: int, axis: str | None, real=None) -> jax.Array:
    """`||W_u + (B @ A)_u||` per output unit `u` (f32 `[U]`) of a table `W` whose dim
    ``over`` (the one the norm sums over, `K`) meets A `[R, K]`, B `[U, R]`, without
    forming `W + B @ A`: `||W_u||² + 2 Σ_r B[u, r] (W Aᵀ)[u, r] + (B A Aᵀ Bᵀ)_uu`. The three
    sums over `K` are partial on a shard of it and summed over the mesh ``axis``; ``real``
    (a mask broadcastable to `W`) leaves padded rows out of `||W_u||²` (A is zero there)."""
    hi = jax.lax.Precision.HIGHEST
    sq = jnp.square(table.astype(jnp.float32))
    sq = jnp.sum(sq if real is None else jnp.where(real, sq, 0.0), over)  # [U]
    dt = jnp.promote_types(a.dtype, table.dtype)
    wa = jnp.tensordot(table.astype(dt), a.astype(dt), ((over,), (1,)), precision=hi,
                       preferred_element_type=jnp.float32)  # [U, R]  # fmt: skip
    a = a.astype(jnp.float32)
    aa = jnp.dot(a, a.T, precision=hi)  # [R, R]
    if axis is not None:
        sq, wa, aa = jax.lax.psum((sq, wa, aa), axis)
    b = b.astype(jnp.float32)
    n2 = sq + 2 * jnp.sum(b * wa, 1) + jnp.sum(jnp.dot(b, aa, precision=hi) * b, 1)
    return jnp.sqrt(jnp.maximum(n2, 0.0))


def _dora_stacks(layer) -> tuple[nnx.Variable, ...]:
    """The layer's DoRA magnitude and norm stacks, or none (DoRA off)."""
    if getattr(layer, "dora_norm", None) is None:
        return ()
    return (layer.dora_magnitude, layer.dora_norm)


@nnx.jit
def _dora_norms(layer, slot):
    return layer.dora_norms(slot)
