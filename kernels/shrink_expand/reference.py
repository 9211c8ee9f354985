"""Pure-jnp oracles for shrink and expand.

They read only ``token_lora_indices`` (and ``slot_ranks``): the sort metadata
is accepted so that the signatures match the kernels, and ignored. Each token
gathers its own adapter, which is the most literal reading of the contract
and the slowest; use them for checking, or on backends without a kernel. The
gathered weights are formed a chunk of tokens at a time (at most
``_CHUNK_BYTES``), so a long prompt at a high rank does not need T copies of
the adapter at once (16384 tokens at rank 128, H 4096 would be 32 GiB).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST
_CHUNK_BYTES = 1 << 30  # the most f32 gathered weights one chunk of tokens forms


def _by_token_chunks(fn, per_token_bytes: int, *arrays):
    """``fn(*arrays)`` for arrays with tokens on axis 0, run over chunks of tokens whose
    ``per_token_bytes`` of intermediates fit ``_CHUNK_BYTES`` (all at once if they fit)."""
    num_tokens = arrays[0].shape[0]
    chunk = max(1, _CHUNK_BYTES // max(1, per_token_bytes))
    if num_tokens <= chunk:
        return fn(*arrays)
    num_chunks = -(-num_tokens // chunk)
    pad = num_chunks * chunk - num_tokens
    split = tuple(
        jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(num_chunks, chunk, *a.shape[1:])
        for a in arrays
    )
    out = jax.lax.map(lambda parts: fn(*parts), split)
    return out.reshape(num_chunks * chunk, *out.shape[2:])[:num_tokens]


def _rank_mask(slot_ranks, s: int, safe_idx, rank: int):
    """[T, R] bool: rank column r is inside the true rank of token t's adapter."""
    if slot_ranks is None:
        return None
    true_rank = slot_ranks[s][safe_idx]  # [T]
    return jnp.arange(rank)[None, :] < true_rank[:, None]


def lora_shrink_reference(
    x: jax.Array,
    lora_a: Sequence[jax.Array],
    *,
    token_lora_indices: jax.Array,
    sorted_token_ids: jax.Array | None = None,
    slot_token_counts: jax.Array | None = None,
    slot_token_starts: jax.Array | None = None,
    active_slots: jax.Array | None = None,
    num_active: jax.Array | None = None,
    scale: float = 1.0,
    slot_ranks: jax.Array | None = None,
    block_sizes=None,
    interpret: bool = False,
) -> jax.Array:
    """``out[s, t] = scale * x[t] @ lora_a[s][idx[t]].T`` in f32; rows with idx -1 are 0.

    Example::

        out = lora_shrink_reference(x, (lora_a,), token_lora_indices=idx)  # [1, T, R]
    """
    del sorted_token_ids, slot_token_counts, slot_token_starts, active_slots, num_active
    del block_sizes, interpret
    idx = token_lora_indices  # [T]
    valid = (idx >= 0) & (idx < lora_a[0].shape[0])  # as lora_jax.mapping cleans them
    safe = jnp.where(valid, idx, 0)
    outs = []
    for s, a in enumerate(lora_a):  # a: [L, R, H]

        def shrink_rows(x_c, safe_c, a=a):
            a_t = a[safe_c].astype(jnp.float32)  # [t, R, H]
            return jnp.einsum("th,trh->tr", x_c.astype(jnp.float32), a_t, precision=_HIGHEST)

        out = _by_token_chunks(shrink_rows, 4 * a.shape[1] * a.shape[2], x, safe)
        out = out * jnp.float32(scale)
        keep = valid[:, None]
        rank_mask = _rank_mask(slot_ranks, s, safe, a.shape[1])
        if rank_mask is not None:
            keep = keep & rank_mask
        outs.append(jnp.where(keep, out, 0.0))
    return jnp.stack(outs)  # [S, T, R]


def lora_expand_reference(
    y: jax.Array,
    h: jax.Array,
    lora_b: Sequence[jax.Array],
    *,
    offsets: Sequence[int],
    token_lora_indices: jax.Array,
    sorted_token_ids: jax.Array | None = None,
    slot_token_counts: jax.Array | None = None,
    slot_token_starts: jax.Array | None = None,
    active_slots: jax.Array | None = None,
    num_active: jax.Array | None = None,
    slot_ranks: jax.Array | None = None,
    block_sizes=None,
    interpret: bool = False,
) -> jax.Array:
    """``y[t, off_s:off_s+n_s] += h[s, t] @ lora_b[s][idx[t]].T``; rows with idx -1 unchanged.

    The sum is formed in f32 and cast to ``y.dtype`` once.

    Example::

        y = lora_expand_reference(y, h, (lora_b,), offsets=(0,), token_lora_indices=idx)
    """
    del sorted_token_ids, slot_token_counts, slot_token_starts, active_slots, num_active
    del block_sizes, interpret
    idx = token_lora_indices  # [T]
    valid = (idx >= 0) & (idx < lora_b[0].shape[0])  # as lora_jax.mapping cleans them
    safe = jnp.where(valid, idx, 0)
    out = y
    for s, (b, off) in enumerate(zip(lora_b, offsets, strict=True)):  # b: [L, n_s, R]
        h_s = h[s].astype(jnp.float32)  # [T, R]
        rank_mask = _rank_mask(slot_ranks, s, safe, b.shape[2])
        if rank_mask is not None:
            h_s = jnp.where(rank_mask, h_s, 0.0)

        def expand_rows(h_c, safe_c, b=b):
            b_t = b[safe_c].astype(jnp.float32)  # [t, n_s, R]
            return jnp.einsum("tr,tnr->tn", h_c, b_t, precision=_HIGHEST)

        delta = _by_token_chunks(expand_rows, 4 * b.shape[1] * b.shape[2], h_s, safe)
        n_s = b.shape[1]
        cur = out[:, off : off + n_s]
        new = (cur.astype(jnp.float32) + delta).astype(y.dtype)
        new = jnp.where(valid[:, None], new, cur)
        out = out.at[:, off : off + n_s].set(new)
    return out


def lora_shrink_expand_reference(
    x: jax.Array,
    y: jax.Array,
    lora_a: Sequence[jax.Array],
    lora_b: Sequence[jax.Array],
    *,
    offsets: Sequence[int],
    token_lora_indices: jax.Array,
    scale: float = 1.0,
    slot_ranks: jax.Array | None = None,
    **unused,
) -> jax.Array:
    """``y[t, off_s:off_s+n_s] += scale * (x[t] @ A_s[idx[t]].T) @ B_s[idx[t]].T``.

    The composition of the two oracles (h in f32, never rounded); rows with idx -1
    unchanged. Other keyword arguments (sort metadata, block sizes) are ignored.

    Example::

        y = lora_shrink_expand_reference(x, y, (a,), (b,), offsets=(0,), token_lora_indices=idx)
    """
    del unused
    h = lora_shrink_reference(
        x, lora_a, token_lora_indices=token_lora_indices, scale=scale, slot_ranks=slot_ranks
    )  # f32 [S, T, R]
    return lora_expand_reference(
        y, h, lora_b, offsets=offsets, token_lora_indices=token_lora_indices, slot_ranks=slot_ranks
    )


def lora_slot_outer_reference(
    a: jax.Array, b: jax.Array, *, token_lora_indices: jax.Array, num_slots: int, **_meta
) -> jax.Array:
    """f32 ``[num_slots, P, Q]``: per slot l, ``sum_{t : idx[t] = l} a[t]^T b[t]`` in
    f32 (the LoRA stacks' gradient: dA from ``dh`` and ``x``, dB from ``dy`` and ``h``).
    Tokens with index -1 (or past the slots) add nothing; the rest of ``_meta`` is
    ignored, as in the other references."""
    idx = token_lora_indices
    valid = (idx >= 0) & (idx < num_slots)
    one_hot = jax.nn.one_hot(jnp.where(valid, idx, num_slots), num_slots, dtype=jnp.float32)
    weighted = one_hot[:, :, None] * a.astype(jnp.float32)[:, None, :]  # [T, L, P]
    return jnp.einsum("tlp,tq->lpq", weighted, b.astype(jnp.float32), precision=_HIGHEST)
