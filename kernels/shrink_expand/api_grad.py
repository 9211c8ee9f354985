"""The public, jitted `lora_slot_outer`: the LoRA stacks' gradient over the step's slot
schedule (the kernel is in pallas_triton_grad.py, its jnp oracle
`reference.lora_slot_outer_reference`).

Example::

    from lora_jax.kernels import lora_slot_outer
    da = lora_slot_outer(dh, x, **meta)     # f32 [L, R, H]: each slot's sum of dh^T x
    db = lora_slot_outer(dy, h, **meta)     # f32 [L, N, R]

where ``meta`` is the step's metadata as `lora_jax.mapping` builds it (the same keyword
arguments as `lora_shrink`'s).
"""

from __future__ import annotations

import functools

import jax

from lora_jax.kernels.shrink_expand import checks, pallas_triton_grad
from lora_jax.kernels.shrink_expand.block_sizes import next_pow2
from lora_jax.kernels.shrink_expand.work_list import build_work_list

OUTER_BLOCK_M = 256
"""The fewest tokens of one slot a program sums (`outer_block_m`): each program adds its f32
tile into the output once, so longer blocks add fewer tiles."""


def outer_block_m(p: int, q: int) -> int:
    """Tokens a program: 8 x the smaller output dim (the rank), 256 to 1024, so that the
    f32 tiles added stay ~1/4 of the input bytes or less (2 x rank / block_m of them).

    Session 52 (H100, `benchmarks/grad_ops.py`, 8 slots): from 256 tokens at every rank,
    dA at 16384 tokens, rank 128, one slot 114.2 -> 72.8 us (41 -> 64 % of the roofline),
    rank 64 70.2 -> 62.6; at 4096 tokens rank 128 over 8 slots 39.1 -> 34.4; dB of a
    14336-wide layer (rank 64) 67.3 -> 61.6 (one slot), 82.1 -> 75.5 (8); rank 16 as it was.

    Example:
        >>> outer_block_m(64, 4096), outer_block_m(16, 4096), outer_block_m(14336, 128)
        (512, 256, 1024)
    """
    return min(1024, max(OUTER_BLOCK_M, 8 * next_pow2(min(p, q))))


@functools.partial(jax.jit, static_argnames=("block_m", "interpret"))
def lora_slot_outer(
    a: jax.Array,
    b: jax.Array,
    *,
    token_lora_indices: jax.Array,
    sorted_token_ids: jax.Array,
    slot_token_counts: jax.Array,
    slot_token_starts: jax.Array,
    active_slots: jax.Array | None = None,
    num_active: jax.Array | None = None,
    work_lists=None,
    block_m: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """f32 ``[max_loras, P, Q]``: per slot l, ``sum_{t : idx[t] = l} a[t]^T b[t]``.

    ``a [T, P]`` and ``b [T, Q]`` are float arrays over the same tokens; tokens with
    index -1 add nothing, and a slot without tokens gets zeros. ``active_slots`` and
    ``num_active`` are accepted so that the mapping's keyword arguments pass as they
    are, and not read; ``work_lists`` is used when it holds a schedule of ``block_m``
    (tokens a program; None: `outer_block_m`).
    """
    del active_slots, num_active
    for name, arr in (("a [T, P]", a), ("b [T, Q]", b)):
        checks.check_float(name, arr)
        if arr.ndim != 2:
            raise ValueError(f"lora_slot_outer: {name} has shape {arr.shape}; expected 2-D.")
    if a.shape[0] != b.shape[0]:
        raise ValueError(
            f"lora_slot_outer: a has {a.shape[0]} tokens and b {b.shape[0]}; they must match."
        )
    if block_m is None:
        block_m = outer_block_m(a.shape[1], b.shape[1])
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"lora_slot_outer: block_m={block_m}; expected a power of two >= 16.")
    max_loras = slot_token_counts.shape[0]
    checks.check_meta(
        a.shape[0], max_loras, token_lora_indices, sorted_token_ids, slot_token_counts,
        slot_token_starts, None, 1, 1,
    )  # fmt: skip
    tab = (work_lists or {}).get(block_m)
    if tab is None:
        tab = build_work_list(
            slot_token_counts, slot_token_starts, sorted_token_ids, block_m=block_m
        )
    return pallas_triton_grad.slot_outer(
        a, b, tab, num_slots=max_loras, block_m=block_m, interpret=interpret
    )
