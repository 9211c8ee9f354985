"""Calling the Pallas kernels from `lora_jax.ops`: the kernels package (when present),
the scale they take as a static argument, and the XLA VJP that is their gradient with
`ops.KERNEL_BACKWARD` off (else `ops_grad`'s backward pass is).
"""

from __future__ import annotations

import functools

import jax


@functools.cache
def _kernels():
    try:
        from lora_jax import kernels
    except ImportError:  # pragma: no cover - only when the kernels package is absent
        return None
    return kernels if hasattr(kernels, "lora_shrink") else None


def _static_scale(scale):
    """``scale`` as a Python float when it is known at trace time (a number, a numpy or
    concrete jax scalar), else None (a traced value: the kernels take it as a static
    argument, so it is applied to their f32 output instead)."""
    try:
        return float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def _with_vjp(kernel, backward):
    """``kernel(*diff, *rest)`` with ``backward(diff, rest, g) -> cotangents of diff`` as
    its backward pass: ``diff`` are the float inputs (x, h, y, the A / B stacks), ``rest``
    the integer ones (the mapping, the slots' ranks), which get no cotangent."""

    @jax.custom_vjp
    def run(diff, rest):
        return kernel(*diff, *rest)

    def fwd(diff, rest):
        return kernel(*diff, *rest), (diff, rest)

    def bwd(res, g):
        diff, rest = res
        return backward(diff, rest, g), None

    run.defvjp(fwd, bwd)
    return run


def _with_xla_vjp(kernel, xla):
    """``kernel(*diff, *rest)`` with the XLA backend's VJP as its backward pass.

    Pallas calls have no autodiff (the kernels alias their outputs and add with atomics);
    with `ops.KERNEL_BACKWARD` off the gradient of a forward that ran the kernels is that
    of `xla`, the same function on XLA (multiplied against every slot once tokens
    outnumber slots; `ops_grad` is the default). See `_with_vjp` for ``diff`` / ``rest``.
    """

    def backward(diff, rest, g):
        _, vjp = jax.vjp(lambda *d: xla(*d, *rest), *diff)
        return vjp(g)

    return _with_vjp(kernel, backward)
