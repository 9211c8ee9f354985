"""Input checks of the ops in `lora_jax.ops`, the same on every backend.

The XLA backend would broadcast (or silently misread) what the kernels refuse, so every
op checks its mapping, scale, stacks, ranks and column offsets here before it dispatches.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lora_jax.mapping import LoRAMapping


def _check_mapping(name: str, mapping) -> None:
    if not isinstance(mapping, LoRAMapping):
        raise ValueError(
            f"{name}: mapping must be a LoRAMapping (make_lora_mapping(token_lora_indices, "
            f"max_loras)'s result), got {type(mapping).__name__}"
        )


def _check_scale(name: str, scale) -> None:
    # bools and strings would be taken as 1.0 / crash deep in the ops; a scale array of
    # any other shape would broadcast into the outputs' shape on the XLA backend only
    number = isinstance(scale, int | float | np.integer | np.floating)
    scalar = (
        isinstance(scale, jax.Array | np.ndarray)
        and scale.ndim == 0
        and (jnp.issubdtype(scale.dtype, jnp.integer) or jnp.issubdtype(scale.dtype, jnp.floating))
    )
    if isinstance(scale, bool | np.bool_) or not (number or scalar):
        raise ValueError(
            f"{name}: scale must be a real number or a 0-d int / float array (a traced one "
            f"too), got {scale!r}"
        )


def _check_stacks(name: str, stacks: Sequence[jax.Array], mapping: LoRAMapping) -> None:
    if not stacks:
        raise ValueError(f"{name}: need at least one slice, got none")
    for s, w in enumerate(stacks):
        if w.ndim != 3:
            raise ValueError(f"{name}[{s}] must be 3-D [max_loras, ., .], got shape {w.shape}")
        if w.shape[0] != mapping.max_loras:
            raise ValueError(
                f"{name}[{s}] has {w.shape[0]} slots but the mapping was built for "
                f"max_loras={mapping.max_loras}"
            )


def _check_ranks(name: str, slot_ranks, num_slices: int, max_loras: int) -> None:
    if slot_ranks is None:
        return
    shape, dtype = jnp.shape(slot_ranks), jnp.result_type(slot_ranks)
    if shape != (num_slices, max_loras) or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"{name}: slot_ranks must be integers of shape (num_slices, max_loras) = "
            f"({num_slices}, {max_loras}), got {dtype} {shape}"
        )


def _check_float(name: str, what: str, arr, ndim: int) -> None:
    if jnp.ndim(arr) != ndim or not jnp.issubdtype(jnp.result_type(arr), jnp.floating):
        raise ValueError(
            f"{name}: {what} must be a {ndim}-D float array, got {jnp.result_type(arr)} "
            f"{jnp.shape(arr)}"
        )


def _check_shrink(x, lora_a, mapping, slot_ranks) -> None:
    """The same input checks on every backend (XLA broadcast what the kernels refuse)."""
    _check_stacks("lora_a", lora_a, mapping)
    _check_float("lora_shrink", "x [T, H]", x, 2)
    if x.shape[0] != mapping.num_tokens:
        raise ValueError(
            f"lora_shrink: x has {x.shape[0]} tokens, the mapping {mapping.num_tokens}"
        )
    for s, a in enumerate(lora_a):
        _check_float("lora_shrink", f"lora_a[{s}]", a, 3)
        if a.shape[1:] != (lora_a[0].shape[1], x.shape[1]):
            raise ValueError(
                f"lora_shrink: lora_a[{s}] must be [max_loras, {lora_a[0].shape[1]}, "
                f"{x.shape[1]}] (one rank for every slice, H of x), got {a.shape}"
            )
    _check_ranks("lora_shrink", slot_ranks, len(lora_a), mapping.max_loras)


def _check_expand(y, h, lora_b, mapping, slot_ranks) -> None:
    _check_stacks("lora_b", lora_b, mapping)
    _check_float("lora_expand", "y [T, N]", y, 2)
    _check_float("lora_expand", "h [S, T, R]", h, 3)
    if not y.shape[0] == h.shape[1] == mapping.num_tokens:
        raise ValueError(
            f"lora_expand: y has {y.shape[0]} tokens, h {h.shape[1]}, the mapping "
            f"{mapping.num_tokens}: they must agree"
        )
    for s, b in enumerate(lora_b):
        _check_float("lora_expand", f"lora_b[{s}]", b, 3)
        if b.shape[2] != h.shape[2]:
            raise ValueError(f"lora_expand: lora_b[{s}] has rank {b.shape[2]}, h has {h.shape[2]}")
    _check_ranks("lora_expand", slot_ranks, len(lora_b), mapping.max_loras)


def _offset(o) -> int:
    """A column offset as a Python int (a concrete integer jax / numpy scalar too)."""
    if isinstance(o, jax.Array) and o.ndim == 0 and jnp.issubdtype(o.dtype, jnp.integer):
        try:
            return int(o)
        except jax.errors.ConcretizationTypeError:
            pass
    if isinstance(o, bool | np.bool_) or not isinstance(o, int | np.integer):
        raise ValueError(f"lora_expand: offsets must be ints known at trace time, got {o!r}")
    return int(o)


def _expand_offsets(y, lora_b, h_slices: int, offsets) -> tuple[int, ...]:
    """Each slice's column offset in y, checked: ints, one a slice, inside y, no overlap
    (default: the slices side by side from column 0)."""
    if offsets is None:
        offsets, acc = [], 0
        for b in lora_b:
            offsets.append(acc)
            acc += b.shape[1]
    offsets = tuple(_offset(o) for o in offsets)
    if len(offsets) != len(lora_b) or h_slices != len(lora_b):
        raise ValueError(
            f"lora_expand: {len(lora_b)} B slices, {len(offsets)} offsets and h with "
            f"{h_slices} slices must agree"
        )
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        if off < 0 or off + b.shape[1] > y.shape[-1]:
            raise ValueError(
                f"lora_expand: slice {s} [{off}, {off + b.shape[1]}) exceeds y width {y.shape[-1]}"
            )
    spans = sorted((off, off + b.shape[1], s) for s, (b, off) in enumerate(zip(lora_b, offsets)))
    for (_, end, s), (start, _, t) in zip(spans, spans[1:]):
        if start < end:  # the kernels add each slice into y without atomics
            raise ValueError(f"lora_expand: slices {s} and {t} overlap at columns {start}..{end}")
    return offsets
