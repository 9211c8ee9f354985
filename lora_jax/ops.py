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

Gradients: the ops have their own backward pass (`ops_grad`, `KERNEL_BACKWARD`): behind
the kernels it runs kernels too (each token's own slot), and where every mapped token
uses one slot (`LoRAMapping.single_slot`) it is dense matmuls against that slot's weights
on every backend; elsewhere the XLA backend's autodiff.

This module holds the public ops and the dispatcher's settings (read at trace time, set
or patched here); beside it are the input checks (`ops_checks`), the XLA backend
(`ops_xla`), the Pallas kernels' plumbing with the XLA-VJP fallback (`ops_pallas`) and the
backward pass (`ops_grad`). Their names are importable from here too.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from lora_jax import ops_grad
from lora_jax.mapping import LoRAMapping
from lora_jax.ops_checks import _check_expand as _check_expand
from lora_jax.ops_checks import _check_float as _check_float
from lora_jax.ops_checks import _check_mapping as _check_mapping
from lora_jax.ops_checks import _check_ranks as _check_ranks
from lora_jax.ops_checks import _check_scale as _check_scale
from lora_jax.ops_checks import _check_shrink as _check_shrink
from lora_jax.ops_checks import _check_stacks as _check_stacks
from lora_jax.ops_checks import _expand_offsets as _expand_offsets
from lora_jax.ops_checks import _offset as _offset
from lora_jax.ops_pallas import _kernels as _kernels
from lora_jax.ops_pallas import _static_scale as _static_scale
from lora_jax.ops_pallas import _with_vjp as _with_vjp
from lora_jax.ops_pallas import _with_xla_vjp as _with_xla_vjp
from lora_jax.ops_xla import _expand_xla as _expand_xla
from lora_jax.ops_xla import _gather_slot as _gather_slot
from lora_jax.ops_xla import _shrink_xla as _shrink_xla
from lora_jax.ops_xla import _within_rank as _within_rank
from lora_jax.ops_xla import set_columns as set_columns

BACKENDS = ("xla", "pallas", "pallas_fused")


def _fused_split(value: str):
    """``LORA_JAX_FUSED_SPLIT``: "0" (off), "1" (on, default tiles), or the tiles as
    ``chunk_k:block_n:programs:num_warps``."""
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    from lora_jax.kernels.shrink_expand.pallas_triton_fused_split import SplitTiles

    try:
        chunk_k, block_n, programs, num_warps = (int(v) for v in value.split(":"))
    except ValueError:
        raise ValueError(
            f"LORA_JAX_FUSED_SPLIT={value!r}: use 0, 1 or chunk_k:block_n:programs:num_warps"
        ) from None
    return SplitTiles(chunk_k=chunk_k, block_n=block_n, programs=programs, num_warps=num_warps)


FUSED_SPLIT = _fused_split(os.environ.get("LORA_JAX_FUSED_SPLIT", "0"))
"""Whether "pallas_fused" runs the kernel that splits the shrink's hidden dim over the grid
(`lora_shrink_expand(split=True)`, or its `SplitTiles`: one launch with a grid-wide
barrier) rather than the one that recomputes each block's shrink per column group.
Opt-in: slower than the two-kernel pair at decode (benchmarks/RESULTS.md, session 59)."""
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
KERNEL_BACKWARD = True
"""The ops' own backward pass (`ops_grad`): on the Pallas backends through the kernels
(each token's own slot; `lora_jax.kernels.lora_slot_outer` for the stacks), and on every
backend, for a mapping whose tokens use one slot (`LoRAMapping.single_slot`, a training
batch), dense matmuls against that slot's weights. False: XLA's autodiff of the XLA
backend (`ops_pallas._with_xla_vjp`), which multiplies against every slot once tokens
outnumber slots. Read at trace time."""


def _differentiable(kernel, xla, backward):
    """``kernel`` with its backward pass: ``backward`` (`ops_grad`) or, with
    ``KERNEL_BACKWARD`` off, the VJP of ``xla``."""
    if KERNEL_BACKWARD:
        return _with_vjp(kernel, backward)
    return _with_xla_vjp(kernel, xla)


def _own_backward(pallas: bool, mapping: LoRAMapping) -> bool:
    """Whether an op takes `ops_grad`'s backward pass: the kernels' forward always has it
    (they have no autodiff), the XLA forward where the tokens use one slot."""
    return pallas or (bool(mapping.single_slot) and KERNEL_BACKWARD)


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


ONE_HOT_TOKENS_PER_SLOT = 1.0
"""The XLA backend multiplies against every slot (one matmul) once tokens outnumber slots
by this factor, and gathers each token's adapter below it (a per-token gather copies one
adapter per token, which beats touching every slot only when tokens are fewer). On an
H200, every slot at 16-64 tokens and 64 slots made a Llama-3-8B-shaped decode step
3.2-3.5 ms slower than the gather (benchmarks/RESULTS.md, session 14)."""


def _use_one_hot(num_tokens: int, num_slots: int) -> bool:
    return num_tokens > ONE_HOT_TOKENS_PER_SLOT * num_slots


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
    chosen = resolve_backend(backend, x.shape[0], _hinted(mapping, rank))
    pallas = chosen in ("pallas", "pallas_fused")
    if _own_backward(pallas, mapping):
        static = _static_scale(scale)
        kscale = 1.0 if static is None else static
        xla = functools.partial(_shrink_xla, scale=kscale)

        def kernel(x, lora_a, mapping, slot_ranks):
            if not pallas:
                return xla(x, lora_a, mapping, slot_ranks)
            return _kernels().lora_shrink(
                x,
                lora_a,
                scale=kscale,
                slot_ranks=slot_ranks,
                **mapping.shrink_kwargs(),
                interpret=PALLAS_INTERPRET,
            )

        def backward(diff, rest, g):
            return ops_grad.shrink_backward(*diff, *rest, g, scale=kscale)

        h = _differentiable(kernel, xla, backward)((x, lora_a), (mapping, slot_ranks))
        return h if static is not None else h * jnp.asarray(scale, jnp.float32)
    return _shrink_xla(x, lora_a, mapping, slot_ranks, scale=scale)


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
    pallas = resolve_backend(backend, y.shape[0], hinted) in ("pallas", "pallas_fused")
    if _own_backward(pallas, mapping):
        xla = functools.partial(_expand_xla, offsets=offsets)

        def kernel(y, h, lora_b, mapping, slot_ranks):
            if not pallas:
                return xla(y, h, lora_b, mapping, slot_ranks)
            return _kernels().lora_expand(
                y,
                h,
                lora_b,
                offsets=offsets,
                slot_ranks=slot_ranks,
                **mapping.expand_kwargs(),
                interpret=PALLAS_INTERPRET,
            )

        def backward(diff, rest, g):
            y, h, lora_b = diff
            return ops_grad.expand_backward(y.dtype, h, lora_b, *rest, g, offsets=offsets)

        return _differentiable(kernel, xla, backward)((y, h, lora_b), (mapping, slot_ranks))
    return _expand_xla(y, h, lora_b, mapping, slot_ranks, offsets=offsets)


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
                split=FUSED_SPLIT,
                interpret=PALLAS_INTERPRET,
            )

        def xla(y, x, lora_a, lora_b, mapping, slot_ranks):
            h = _shrink_xla(x, lora_a, mapping, slot_ranks, scale=scale)
            return _expand_xla(y, h, lora_b, mapping, slot_ranks, offsets=offsets)

        def backward(diff, rest, g):
            return ops_grad.add_backward(*diff, *rest, g, scale=scale, offsets=offsets)

        diff = (y, x, lora_a, lora_b)
        return _differentiable(kernel, xla, backward)(diff, (mapping, slot_ranks))
    h = lora_shrink(x, lora_a, mapping, scale, slot_ranks=slot_ranks, backend=backend)
    return lora_expand(
        y, h, lora_b, mapping, offsets=offsets, slot_ranks=slot_ranks, backend=backend
    )
