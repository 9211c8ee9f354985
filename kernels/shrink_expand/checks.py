"""Argument checks shared by the public ops (api.py) and the fused op
(pallas_triton_fused.py): each error names the argument, its shape or dtype, and what is
allowed."""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)


def check_float(name: str, arr) -> None:
    if arr.dtype not in FLOATS:
        raise ValueError(f"{name} has dtype {arr.dtype}; expected bfloat16, float16 or float32.")


def check_meta(
    num_tokens: int,
    max_loras: int,
    token_lora_indices,
    sorted_token_ids,
    slot_token_counts,
    slot_token_starts,
    slot_ranks,
    num_slices: int,
    rank: int,
):
    for name, arr, shape in (
        ("token_lora_indices", token_lora_indices, (num_tokens,)),
        ("sorted_token_ids", sorted_token_ids, (num_tokens,)),
        ("slot_token_counts", slot_token_counts, (max_loras,)),
        ("slot_token_starts", slot_token_starts, (max_loras,)),
    ):
        if tuple(arr.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(arr.shape)}; expected {shape}.")
    if slot_ranks is not None and tuple(slot_ranks.shape) != (num_slices, max_loras):
        raise ValueError(
            f"slot_ranks has shape {tuple(slot_ranks.shape)}; expected "
            f"(num_slices, max_loras) = {(num_slices, max_loras)} with values <= {rank}."
        )
    if slot_ranks is not None and not jnp.issubdtype(slot_ranks.dtype, jnp.integer):
        raise ValueError(f"slot_ranks has dtype {slot_ranks.dtype}; expected integers.")


def check_a_slices(op: str, lora_a: tuple, hidden: int) -> None:
    """Every A slice: float, [max_loras, R, H], one shape for all slices."""
    for s, a in enumerate(lora_a):
        check_float(f"lora_a[{s}]", a)
        if a.ndim != 3 or a.shape != lora_a[0].shape or a.shape[2] != hidden:
            raise ValueError(
                f"{op}: lora_a[{s}] has shape {a.shape}; every slice must be "
                f"[max_loras, R, H={hidden}] with one shape {lora_a[0].shape}."
            )


def check_b_slices(
    op: str, lora_b: tuple, offsets: tuple, max_loras: int, rank: int, width: int
) -> None:
    """Every B slice: float, [max_loras, n_s, R], its columns inside y's width."""
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        check_float(f"lora_b[{s}]", b)
        if b.ndim != 3 or b.shape[0] != max_loras or b.shape[2] != rank:
            raise ValueError(
                f"{op}: lora_b[{s}] has shape {b.shape}; expected "
                f"[max_loras={max_loras}, n_s, R={rank}]."
            )
        if b.shape[1] == 0:
            raise ValueError(f"{op}: lora_b[{s}] has no columns; every slice needs at least one.")
        if off < 0 or off + b.shape[1] > width:
            raise ValueError(
                f"{op}: slice {s} covers columns [{off}, {off + b.shape[1]}) "
                f"outside y's {width} columns."
            )
    check_disjoint(op, [b.shape[1] for b in lora_b], offsets)


def check_disjoint(op: str, widths, offsets) -> None:
    """The slices' column ranges `[off_s, off_s + n_s)` must not overlap: the kernels
    add each slice into y without atomics."""
    spans = sorted((off, off + n, s) for s, (n, off) in enumerate(zip(widths, offsets)) if n)
    for (_, end, s), (start, _, t) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(
                f"{op}: slices {s} and {t} overlap at columns [{start}, {end}); every "
                "slice needs columns of its own."
            )


def static_args(op):
    """Wraps a public jitted op: `jax.jit` hashes static arguments before the body runs,
    so ``offsets`` given as a list or array and ``scale`` given as a numpy / concrete jax
    scalar are made Python values first; a traced ``scale`` or a non-integer offset is
    refused by name (a raw hash error, or a silently truncated offset, before)."""

    @functools.wraps(op)
    def run(*args, **kwargs):
        if "offsets" in kwargs:
            kwargs["offsets"] = _static_offsets(kwargs["offsets"])
        if "scale" in kwargs:
            kwargs["scale"] = _static_scale(kwargs["scale"])
        return op(*args, **kwargs)

    return run


def _static_offsets(offsets) -> tuple[int, ...]:
    try:
        values = list(np.asarray(offsets).reshape(-1)) if np.ndim(offsets) else [offsets]
        if np.ndim(offsets) == 0:
            raise TypeError
        return tuple(operator.index(o) for o in values)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(
            f"offsets must be a sequence of ints known at trace time, got {offsets!r}"
        ) from e


def _static_scale(scale) -> float:
    if isinstance(scale, bool | np.bool_):
        raise ValueError(f"scale must be a number, got {scale!r}")
    try:
        return float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError,
            jax.errors.TracerArrayConversionError) as e:  # fmt: skip
        raise ValueError(
            "scale is a static (Python) number of the kernels; a traced or array scale "
            "multiplies the output afterwards (lora_jax.ops does so)"
        ) from e
