"""A relaxed f32 atomic add for the Pallas Triton kernels.

`jax.experimental.pallas.triton.atomic_add` orders every add as acquire-release at GPU
scope: each element's add also orders the program's other memory accesses around it,
the form a kernel that signals other programs through memory needs. The shrink's split-K
adds need no ordering: each program adds its partial sums into a zeroed output that only
later kernels read, and a kernel boundary orders everything. This module binds a twin of
Pallas's atomic-add primitive that lowers to a relaxed add.

It reaches into jax internals (`jax._src.pallas.triton`): `available()` says whether
they are there, and `atomic_add` falls back to the public acquire-release add where
they are not, or where ``LORA_JAX_RELAXED_ATOMICS=0`` (to compare the two).
"""

from __future__ import annotations

import functools
import os

from jax.experimental.pallas import triton as plgpu


@functools.cache
def _primitive():
    """The relaxed add primitive, registered with Pallas's Triton lowering, or None."""
    try:
        from jax._src import core as jax_core
        from jax._src.lib.mlir.dialects import arith as arith_dialect
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering as tl
        from jax._src.pallas.triton import primitives as tp

        relaxed = tt_dialect.MemSemantic.RELAXED
        fadd = tt_dialect.RMWOp.FADD
    except (ImportError, AttributeError):
        return None

    prim = jax_core.Primitive("lora_jax_relaxed_atomic_add")
    # Same operands and effects as Pallas's atomic_rmw: its abstract evaluation applies.
    prim.def_effectful_abstract_eval(tp.atomic_rmw_p.abstract_eval)

    @tl.register_lowering(prim)
    def _lowering(ctx, *args_flat, args_tree, atomic_type):
        del atomic_type  # always an add
        ptr, transforms, val, mask = args_tree.unflatten(args_flat)
        *_, val_aval, mask_aval = args_tree.unflatten(ctx.avals_in)
        (indexer,) = transforms
        got = tl._compute_pointers_from_indices(ptr, ctx.block_infos[0], indexer)
        # jax >= 0.11 also returns a mask of the in-bounds elements.
        ptr, in_bounds = got if isinstance(got, tuple) else (got, None)
        val = tl._ensure_ir_value(val, val_aval)
        if mask is not None:
            mask = tl._ensure_ir_value(mask, mask_aval)
        if in_bounds is not None:
            mask = in_bounds if mask is None else arith_dialect.andi(mask, in_bounds)
        return tl._atomic_rmw(fadd, ptr, val, mask=mask, semantic=relaxed)

    return prim


def available() -> bool:
    """Whether `atomic_add` lowers to a relaxed add (jax internals found, not turned off)."""
    return os.environ.get("LORA_JAX_RELAXED_ATOMICS", "1") != "0" and _primitive() is not None


def atomic_add(ref, idx, val, *, mask):
    """``ref[idx] += val`` where ``mask``, atomically per element with relaxed ordering
    (`available`), else with Pallas's acquire-release add. ``val`` and ``mask`` must have
    the indexed shape (no broadcasting)."""
    if not available():
        return plgpu.atomic_add(ref, idx, val, mask=mask)
    from jax._src import tree_util
    from jax._src.pallas.triton import primitives as tp
    from jax._src.state import primitives as state_primitives

    if val.shape != mask.shape:
        raise ValueError(f"atomic_add: val {val.shape} and mask {mask.shape} differ in shape.")
    x_ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "atomic_rmw")
    args_flat, args_tree = tree_util.tree_flatten((x_ref, transforms, val, mask))
    return _primitive().bind(*args_flat, args_tree=args_tree, atomic_type=tp.AtomicOpType.ADD)
