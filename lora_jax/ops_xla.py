"""The XLA backend of `lora_jax.ops`: a gather einsum, or one matmul over all slots.

Runs anywhere; its VJP is also the gradient of the Pallas backends (`ops_pallas`). Which of
the two paths a slice takes is the dispatcher's setting (`lora_jax.ops._use_one_hot`,
`ONE_HOT_TOKENS_PER_SLOT`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _ops():
    """`lora_jax.ops`, whose one-hot rule (`_use_one_hot`, `ONE_HOT_TOKENS_PER_SLOT`) this
    backend reads at trace time, so that setting or patching it there applies (ops imports
    this module: it is looked up when called, not at import)."""
    from lora_jax import ops

    return ops


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


def _shrink_xla(x, lora_a, mapping, slot_ranks, *, scale) -> jax.Array:
    """The XLA backend's shrink (checked inputs): f32 `[S, T, R]`."""
    idx = mapping.token_lora_indices
    keep = (idx >= 0)[:, None]
    outs = []
    for s, a in enumerate(lora_a):
        if _ops()._use_one_hot(idx.shape[0], a.shape[0]):
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
        if _ops()._use_one_hot(idx.shape[0], b.shape[0]):
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
