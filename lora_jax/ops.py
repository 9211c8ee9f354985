"""Punica's two batched per-token adapter ops, with vLLM's contract, and their dispatcher.

* `lora_shrink`: `out[s, t, :] = scale * x[t] @ lora_a[s][idx[t]].T` (f32 `[S, T, R]`)
* `lora_expand`: `y[t, off_s : off_s + n_s] += h[s, t] @ lora_b[s][idx[t]].T`
* `add_lora_linear`: shrink then expand over all slices of a packed layer.

Layouts follow vLLM with its singleton dim dropped: per slice `lora_a[max_loras, R, in]`,
`lora_b[max_loras, out, R]`. Tokens whose slot is -1 are untouched (shrink rows are 0,
expand leaves `y` bit-identical).

Backends: "pallas" (the GPU kernels in `lora_jax.kernels`) and "xla" (a gather einsum, or
one matmul over all slots when tokens outnumber slots; runs anywhere). The default is
"pallas" on GPU for batches of at least `PALLAS_MIN_TOKENS` tokens, or of at least
`PALLAS_MIN_TOKENS_HINTED` where the mapping carries the host's tokens-per-slot hint (a
mapping made from numpy indices, as `generate`'s; not from rank 64 where every token has
an adapter of its own: `PER_TOKEN_XLA_MIN_RANK`), and "xla" otherwise: on an H200, in a
Llama-3-8B decode step at 64 tokens over 64 adapters, XLA was faster than the kernels
without the hint and as fast as them with it (benchmarks/RESULTS.md, "model", session 25),
while the kernels win from 256 tokens up. Force one per call with `backend=`, globally with
`set_default_backend`, or with the environment variable `LORA_JAX_OPS_BACKEND`.
"pallas_fused" (opt-in only, never a default) runs `add_lora_linear` as ONE fused
shrink->expand kernel launch (`lora_jax.kernels.lora_shrink_expand`, made for decode);
the single ops `lora_shrink` / `lora_expand` treat it as "pallas". Measured on an H200 it
is 2-5x slower than the shrink + expand pair (each program walks the whole hidden dim
serially; benchmarks/RESULTS.md, "ops"), so it stays opt-in, for experiments.

Reproducibility: the "pallas" shrink splits its hidden reduction at decode and in most
prefills and adds the partial sums with atomics, so its f32 results may differ in the last
bits from run to run (as vLLM's split-K shrink does). "xla" is bit-reproducible, and so is
`lora_jax.kernels.lora_shrink` given ``BlockSizes(atomic_programs=0, ...)``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lora_jax.mapping import LoRAMapping

BACKENDS = ("xla", "pallas", "pallas_fused")
# Below this many tokens (per shard) the GPU default is XLA: at decode a kernel call has a
# floor of ~2.5-3 us of GPU time, and on an H200 XLA's gather einsum was still faster for
# the shrink at 1-16 tokens and at 64 tokens with 64 adapters (benchmarks/RESULTS.md, ops,
# session 6), and as fast in a whole decode step at 64 tokens ("model", session 4). With
# the per-token kernels (session 18, a mapping from host indices) a 16-layer decode step
# was 4 % faster at 1 and at 64 tokens with 8 adapters, 4 % slower at 16 with 16, equal at
# 64 with 64: no clear win, so the default stayed. Under the concurrent decode (session 24)
# with the hint they won from 16 tokens (session 25): `PALLAS_MIN_TOKENS_HINTED`.
PALLAS_MIN_TOKENS = 128
PALLAS_MIN_TOKENS_HINTED = 16
"""Where the step's mapping carries the host's tokens-per-slot hint (`LoRAMapping.
tokens_per_slot`, found when the mapping is made from numpy indices, as `generate` does),
the GPU default is "pallas" from this many tokens: the hint lets the kernels run a program
per token where each request has its own adapter. H200, session 25, 32-layer Llama-3-8B
decode steps under the concurrent decode (benchmarks/RESULTS.md): 16 requests over 16
adapters 6.630 -> 6.031 ms, 64 over 8 8.264 -> 7.815, 64 over 64 8.991 -> 8.979; one
token 5.078 (XLA) vs 5.151, so a single token keeps XLA."""
PER_TOKEN_XLA_MIN_RANK = 64
"""Except from this (padded) rank where the hint says every mapped token has an adapter of
its own (`tokens_per_slot` 1): there the default stays XLA below `PALLAS_MIN_TOKENS`
tokens, as without the hint. H200, session 41, 32-layer Llama-3-8B decode steps under the
concurrent decode, a token an adapter, ms, XLA vs the hinted kernels: rank 64, 32 / 64
tokens 9.02 / 12.75-12.93 (four runs) vs 9.33 / 13.37-13.41 (two), 16 tokens a tie (7.23 /
7.52 vs 7.37); rank 128, 64 tokens 19.00 vs 20.42. The per-token kernels are the faster
ops alone (the expand 1.8 x XLA's), but XLA's gathers overlap the base model's GEMMs more
(benchmarks/RESULTS.md, session 41). At rank 16 the hinted kernels won or tied (session
25: 16 tokens 6.63 -> 6.03 ms; session 41: 64 tokens 8.86 vs 8.96), and with two tokens
an adapter they win at rank 64 too (64 tokens over 32 adapters: 13.91 -> 11.53 ms)."""
_default_backend: str | None = os.environ.get("LORA_JAX_OPS_BACKEND") or None
if _default_backend is not None and _default_backend not in BACKENDS:
    raise ValueError(
        f"LORA_JAX_OPS_BACKEND={_default_backend!r}: must be one of {BACKENDS} (or unset)"
    )
PALLAS_INTERPRET = False
"""Run the Pallas backends in interpret mode (CPU tests of the kernel paths)."""


def set_default_backend(backend: str | None) -> None:
    """Forces every op to `backend` (one of `BACKENDS`); `None` restores auto-selection.

    Read when an op is traced: a jitted function compiled before keeps the backend it was
    traced with (`generate` and `Generator` key their programs on `dispatch_state()`;
    your own jits can pass it as a static argument).

    Example:
        >>> set_default_backend("xla")
        >>> set_default_backend(None)
    """
    global _default_backend
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    _default_backend = backend


def dispatch_state() -> tuple[str | None, bool]:
    """The module-level settings the ops read at trace time (`set_default_backend`,
    `PALLAS_INTERPRET`): a jit that must follow a change of them keys on this.

    Example:
        >>> dispatch_state()
        (None, False)
    """
    return _default_backend, bool(PALLAS_INTERPRET)


@functools.cache
def _kernels():
    try:
        from lora_jax import kernels
    except ImportError:  # pragma: no cover - only when the kernels package is absent
        return None
    return kernels if hasattr(kernels, "lora_shrink") else None


def resolve_backend(
    backend: str | None = None, num_tokens: int | None = None, hinted: bool = False
) -> str:
    """The backend an op will use: explicit > global default > GPU and batch size.

    ``hinted``: the step's mapping carries the host's tokens-per-slot hint (then the GPU
    default is "pallas" from `PALLAS_MIN_TOKENS_HINTED` tokens, else from
    `PALLAS_MIN_TOKENS`).

    Example:
        >>> resolve_backend("xla")
        'xla'
    """
    choice = backend or _default_backend
    if choice is None:
        gpu = jax.default_backend() == "gpu" and _kernels() is not None
        floor = PALLAS_MIN_TOKENS_HINTED if hinted else PALLAS_MIN_TOKENS
        big = num_tokens is None or num_tokens >= floor
        choice = "pallas" if gpu and big else "xla"
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {choice!r}")
    if choice in ("pallas", "pallas_fused") and _kernels() is None:
        raise ValueError(f"backend={choice!r} requested but lora_jax.kernels is not available")
    return choice


def _hinted(mapping: LoRAMapping, rank: int) -> bool:
    """Whether the backend default may count on the host's hint (`resolve_backend`): the
    mapping carries one, unless every mapped token has an adapter of its own and ``rank``
    (the stacks' padded rank) is at least `PER_TOKEN_XLA_MIN_RANK`."""
    tps = mapping.tokens_per_slot
    return tps is not None and not (tps == 1 and rank >= PER_TOKEN_XLA_MIN_RANK)


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


def _static_scale(scale):
    """``scale`` as a Python float when it is known at trace time (a number, a numpy or
    concrete jax scalar), else None (a traced value: the kernels take it as a static
    argument, so it is applied to their f32 output instead)."""
    try:
        return float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


ONE_HOT_TOKENS_PER_SLOT = 1.0
"""The XLA backend multiplies against every slot (one matmul) once tokens outnumber slots
by this factor, and gathers each token's adapter below it (a per-token gather copies one
adapter per token, which beats touching every slot only when tokens are fewer). On an
H200, every slot at 16-64 tokens and 64 slots made a Llama-3-8B-shaped decode step
3.2-3.5 ms slower than the gather (benchmarks/RESULTS.md, session 14)."""


def _use_one_hot(num_tokens: int, num_slots: int) -> bool:
    return num_tokens > ONE_HOT_TOKENS_PER_SLOT * num_slots


def _within_rank(slot_ranks: jax.Array | None, s: int, idx: jax.Array, rank: int):
    """`bool[T, R]`: rank columns below the true rank of each token's slot in slice `s`
    (True everywhere without `slot_ranks`), as the kernels mask them."""
    if slot_ranks is None:
        return jnp.ones((1, rank), bool)
    ranks = jnp.take(slot_ranks[s], jnp.maximum(idx, 0))  # [T]
    return jnp.arange(rank)[None, :] < ranks[:, None]


def _gather_slot(stack: jax.Array, idx: jax.Array) -> jax.Array:
    # Clamp -1 to slot 0 for the gather; the caller masks those rows out.
    return jnp.take(stack, jnp.maximum(idx, 0), axis=0)


def lora_shrink(
    x: jax.Array,
    lora_a: Sequence[jax.Array],
    mapping: LoRAMapping,
    scale: float = 1.0,
    *,
    slot_ranks: jax.Array | None = None,
    backend: str | None = None,
) -> jax.Array:
    """`x [T, H]` times each slice's per-token A → f32 `[S, T, R]`.

    Example:
        >>> a = jnp.ones((2, 4, 8))  # [max_loras, R, H]
        >>> m = make_lora_mapping(jnp.array([1, -1]), 2)  # doctest: +SKIP
        >>> lora_shrink(jnp.ones((2, 8)), [a], m).shape  # doctest: +SKIP
        (1, 2, 4)
    """
    lora_a = tuple(lora_a)
    _check_mapping("lora_shrink", mapping)
    _check_scale("lora_shrink", scale)
    _check_shrink(x, lora_a, mapping, slot_ranks)
    rank = lora_a[0].shape[1]
    if resolve_backend(backend, x.shape[0], _hinted(mapping, rank)) in ("pallas", "pallas_fused"):
        static = _static_scale(scale)
        kscale = 1.0 if static is None else static

        def kernel(x, lora_a, mapping, slot_ranks):
            return _kernels().lora_shrink(
                x,
                lora_a,
                scale=kscale,
                slot_ranks=slot_ranks,
                **mapping.shrink_kwargs(),
                interpret=PALLAS_INTERPRET,
            )

        h = _with_xla_vjp(kernel, functools.partial(_shrink_xla, scale=kscale))(
            (x, lora_a), (mapping, slot_ranks)
        )
        return h if static is not None else h * jnp.asarray(scale, jnp.float32)
    return _shrink_xla(x, lora_a, mapping, slot_ranks, scale=scale)


def _shrink_xla(x, lora_a, mapping, slot_ranks, *, scale) -> jax.Array:
    """The XLA backend's shrink (checked inputs): f32 `[S, T, R]`."""
    idx = mapping.token_lora_indices
    keep = (idx >= 0)[:, None]
    outs = []
    for s, a in enumerate(lora_a):
        if _use_one_hot(idx.shape[0], a.shape[0]):
            # Many tokens per slot: one matmul against every slot, then pick the token's
            # slot (reads each adapter once, no [T, R, H] gather).
            L, R, H = a.shape
            h_all = jnp.dot(x, a.reshape(L * R, H).T, preferred_element_type=jnp.float32)
            h_all = h_all.reshape(-1, L, R)  # [T, L, R]
            h = jnp.take_along_axis(h_all, jnp.maximum(idx, 0)[:, None, None], axis=1)[:, 0]
        else:
            a_t = _gather_slot(a, idx)  # [T, R, H]
            h = jnp.einsum("th,trh->tr", x, a_t, preferred_element_type=jnp.float32)
        outs.append(jnp.where(keep & _within_rank(slot_ranks, s, idx, h.shape[1]), h * scale, 0.0))
    return jnp.stack(outs).astype(jnp.float32)  # [S, T, R]


def _with_xla_vjp(kernel, xla):
    """``kernel(*diff, *rest)`` with the XLA backend's VJP as its backward pass.

    Pallas calls have no autodiff (the kernels alias their outputs and add with atomics),
    so the gradient of a forward that ran the kernels is that of `xla`, the same function
    on XLA: training through the layers works on every backend. ``diff`` are the float
    inputs (x, h, y, the A / B stacks), ``rest`` the integer ones (the mapping, the slots'
    ranks), which get no cotangent.
    """

    @jax.custom_vjp
    def run(diff, rest):
        return kernel(*diff, *rest)

    def fwd(diff, rest):
        return kernel(*diff, *rest), (diff, rest)

    def bwd(res, g):
        diff, rest = res
        _, vjp = jax.vjp(lambda *d: xla(*d, *rest), *diff)
        return vjp(g), None

    run.defvjp(fwd, bwd)
    return run


def lora_expand(
    y: jax.Array,
    h: jax.Array,
    lora_b: Sequence[jax.Array],
    mapping: LoRAMapping,
    *,
    offsets: Sequence[int] | None = None,
    slot_ranks: jax.Array | None = None,
    backend: str | None = None,
) -> jax.Array:
    """Adds each slice's `h[s] @ B_s[idx].T` into `y [T, N]` at column `offsets[s]`.

    `offsets` defaults to the slices laid side by side from column 0. h is rounded to B's
    bf16 / fp16 for the products unless y is f32, on every backend (vLLM rounds whenever B
    is half precision; an f32 y keeps h in f32 here). Every
    slot's B must be finite, its padded rank columns included: the XLA backend multiplies
    the slots a token does not use by zero once tokens outnumber slots (the layers'
    `set_lora` refuses non-finite adapters and zero-pads ranks).

    Example:
        >>> b = jnp.ones((2, 8, 4))  # [max_loras, N, R]
        >>> m = make_lora_mapping(jnp.array([1, -1], jnp.int32), 2)
        >>> y = lora_expand(jnp.zeros((2, 8)), jnp.ones((1, 2, 4)), [b], m)  # h [S, T, R]
        >>> y[:, 0].tolist()  # token 0 uses slot 1; token 1 has no adapter
        [4.0, 0.0]
    """
    lora_b = tuple(lora_b)
    _check_mapping("lora_expand", mapping)
    _check_expand(y, h, lora_b, mapping, slot_ranks)
    offsets = _expand_offsets(y, lora_b, h.shape[0], offsets)
    hinted = _hinted(mapping, h.shape[-1])
    if resolve_backend(backend, y.shape[0], hinted) in ("pallas", "pallas_fused"):

        def kernel(y, h, lora_b, mapping, slot_ranks):
            return _kernels().lora_expand(
                y,
                h,
                lora_b,
                offsets=offsets,
                slot_ranks=slot_ranks,
                **mapping.expand_kwargs(),
                interpret=PALLAS_INTERPRET,
            )

        xla = functools.partial(_expand_xla, offsets=offsets)
        return _with_xla_vjp(kernel, xla)((y, h, lora_b), (mapping, slot_ranks))
    return _expand_xla(y, h, lora_b, mapping, slot_ranks, offsets=offsets)


def _expand_xla(y, h, lora_b, mapping, slot_ranks, *, offsets) -> jax.Array:
    """The XLA backend's expand (checked inputs, offsets as ints)."""
    idx = mapping.token_lora_indices
    keep = (idx >= 0)[:, None]
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        # h is rounded as the GPU kernels round it (to B's bf16 / fp16 unless y is f32):
        # neither the batch size nor the backend changes a token's numbers
        cdt = (
            b.dtype
            if b.dtype in (jnp.bfloat16, jnp.float16) and y.dtype != jnp.float32
            else jnp.float32
        )
        hs = h[s].astype(jnp.float32)  # [T, R]
        hs = jnp.where(_within_rank(slot_ranks, s, idx, hs.shape[1]), hs, 0.0)
        if _use_one_hot(idx.shape[0], b.shape[0]):
            L = b.shape[0]
            one_hot = jax.nn.one_hot(jnp.maximum(idx, 0), L, dtype=jnp.float32)  # [T, L]
            h_slot = one_hot[:, :, None] * hs[:, None, :]  # [T, L, R]
            delta = jnp.einsum(
                "tlr,lnr->tn",
                h_slot.astype(cdt),
                b.astype(cdt),
                preferred_element_type=jnp.float32,
            )
        else:
            b_t = _gather_slot(b, idx)  # [T, n_s, R]
            delta = jnp.einsum(
                "tr,tnr->tn", hs.astype(cdt), b_t.astype(cdt), preferred_element_type=jnp.float32
            )
        cols = y[:, off : off + b.shape[1]]
        new = (cols.astype(jnp.float32) + delta).astype(y.dtype)
        y = set_columns(y, off, jnp.where(keep, new, cols))
    return y


def set_columns(y: jax.Array, offset: int, cols: jax.Array) -> jax.Array:
    """`y` with columns `[offset, offset + cols.shape[1])` replaced by `cols`.

    A `dynamic_update_slice` rather than `y.at[:, a:b].set(...)`: inside `shard_map`, the
    latter's lowering crashes jax 0.11's Shardy export (segfault at compile time).

    Example:
        >>> set_columns(jnp.zeros((1, 4)), 1, jnp.ones((1, 2))).tolist()
        [[0.0, 1.0, 1.0, 0.0]]
    """
    if isinstance(offset, int | np.integer) and not 0 <= offset <= y.shape[1] - cols.shape[1]:
        # dynamic_update_slice would clamp it: the columns would land elsewhere
        raise ValueError(
            f"set_columns: offset {offset} with {cols.shape[1]} columns must lie in y's "
            f"{y.shape[1]} columns (0 <= offset <= {y.shape[1] - cols.shape[1]})"
        )
    return jax.lax.dynamic_update_slice(y, cols.astype(y.dtype), (0, offset))


def add_lora_linear(
    y: jax.Array,
    x: jax.Array,
    lora_a: Sequence[jax.Array],
    lora_b: Sequence[jax.Array],
    mapping: LoRAMapping,
    scale: float = 1.0,
    *,
    offsets: Sequence[int] | None = None,
    slot_ranks: jax.Array | None = None,
    backend: str | None = None,
) -> jax.Array:
    """vLLM's `add_lora_linear`: `y += expand(shrink(x))` over all slices of a layer.

    Example:
        >>> # y [T, sum(n_s)], x [T, H], lora_a[s] [L, R, H], lora_b[s] [L, n_s, R]
        >>> y = add_lora_linear(y, x, a_slices, b_slices, mapping)  # doctest: +SKIP
        >>> y = add_lora_linear(y, x, a, b, mapping, backend="pallas_fused")  # doctest: +SKIP
    """
    lora_a, lora_b = tuple(lora_a), tuple(lora_b)
    _check_mapping("add_lora_linear", mapping)
    _check_scale("add_lora_linear", scale)
    hinted = bool(lora_a) and _hinted(mapping, lora_a[0].shape[1])
    fused = resolve_backend(backend, x.shape[0], hinted) == "pallas_fused"
    if fused and _static_scale(scale) is not None:  # a traced scale: shrink, then expand
        _check_shrink(x, lora_a, mapping, slot_ranks)
        _check_stacks("lora_b", lora_b, mapping)
        _check_float("add_lora_linear", "y [T, N]", y, 2)
        if y.shape[0] != x.shape[0]:
            raise ValueError(f"add_lora_linear: y has {y.shape[0]} tokens, x {x.shape[0]}")
        scale = _static_scale(scale)
        offsets = _expand_offsets(y, lora_b, len(lora_a), offsets)  # as the unfused ops check

        def kernel(y, x, lora_a, lora_b, mapping, slot_ranks):
            return _kernels().lora_shrink_expand(
                x,
                y,
                lora_a,
                lora_b,
                offsets=offsets,
                scale=scale,
                slot_ranks=slot_ranks,
                **mapping.kernel_kwargs(),
                interpret=PALLAS_INTERPRET,
            )

        def xla(y, x, lora_a, lora_b, mapping, slot_ranks):
            h = _shrink_xla(x, lora_a, mapping, slot_ranks, scale=scale)
            return _expand_xla(y, h, lora_b, mapping, slot_ranks, offsets=offsets)

        return _with_xla_vjp(kernel, xla)((y, x, lora_a, lora_b), (mapping, slot_ranks))
    h = lora_shrink(x, lora_a, mapping, scale, slot_ranks=slot_ranks, backend=backend)
    return lora_expand(
        y, h, lora_b, mapping, offsets=offsets, slot_ranks=slot_ranks, backend=backend
    )
