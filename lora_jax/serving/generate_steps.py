"""`generate`'s jitted steps: the prefill over the padded prompts and the decode loop.

Both are pure over `(graphdef, state)` plus the batch's arrays: `_prefill_fn` runs every
prompt token (right padded, `[B, S]`) and samples each request's first token;
`_decode_fn` is a `lax.while_loop` of one token per request per step, stopping early
once every request hit an eos id. Each sets the LoRA mapping from the requests' slots
inside the jit (`_set_mapping`), so new adapters or a new mix never recompile.
`_prefill` is the jitted prefill and `_decode_jit(options)` the decode loop jitted with
one set of `decode_compiler_options()` (`lora_jax.serving.generate._decode` picks it);
`Generator` jits the same two functions over its own flat state. `TRACE_COUNTS` counts
their traces.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lora_jax.layers.base import set_lora_mapping
from lora_jax.mapping import PROMPT_ROWS_MIN_TOKENS, PROMPT_TILE_TOKENS
from lora_jax.models.kv_cache import cache_batch_axis
from lora_jax.serving.sampling import row_keys, sample_tokens
from lora_jax.sharding import ShardingRules, shard_map, unshard

# Traces of the jitted steps ("prefill", "decode"); a trace is a (re)compile.
TRACE_COUNTS: collections.Counter[str] = collections.Counter()


def _last_hidden(rules: ShardingRules, hidden: jax.Array, lengths: jax.Array, S: int):
    """`hidden [B*S, D]` → `[B, D]` at each row's last prompt token (`lengths - 1`)."""

    def pick(h, n):
        h = h.reshape(n.shape[0], S, h.shape[-1])
        return jnp.take_along_axis(h, (n - 1)[:, None, None], axis=1)[:, 0]

    if rules.mesh is None:
        return pick(hidden, lengths)
    b = cache_batch_axis(rules, lengths.shape[0])
    return shard_map(rules, pick, ((b, None), (b,)), (b, None))(hidden, lengths)


def _set_mapping(
    model,
    token_slots,
    seq_slots,
    *,
    is_prefill: bool,
    prompt_tiles=None,
    whole_tiles=None,
    tokens_per_slot=None,
):
    # The mapping's sort over tokens needs them unsharded (Explicit meshes refuse a sort
    # over a sharded dim); LoRA layers re-split tokens over "batch" themselves.
    rules = model.rules
    set_lora_mapping(
        model,
        rules.constrain(token_slots, None),
        rules.constrain(seq_slots, None),
        is_prefill=is_prefill,
        prompt_tiles=prompt_tiles,
        whole_tiles=whole_tiles,
        tokens_per_slot=tokens_per_slot,
    )


def _prefill_fn(
    graphdef,
    state,
    cache,
    ids,
    starts,
    lengths,
    slots,
    row_ids,
    seed_key,
    temperature,
    top_p,
    *,
    mode,
    ops_state=None,  # `ops.dispatch_state()`: a static key only
    activated=False,
):
    TRACE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, state)
    B, S = ids.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    # Row-major: row b's tokens use slot[b]. S is a power of two: from 32 tokens the rows
    # fill the prompt tiles (`PROMPT_ROWS_MIN_TOKENS`), from 128 they are whole tiles of
    # one slot each (`PROMPT_TILE_TOKENS`: the expand's Mosaic kernel takes them all).
    tiles = "all" if S >= PROMPT_ROWS_MIN_TOKENS else None
    whole = "all" if S >= PROMPT_TILE_TOKENS else None
    # Repeated from the replicated slots: under `jax.set_mesh` of an Explicit mesh,
    # jnp.repeat refuses a batch-sharded operand without an `out_sharding` (the mapping
    # wants the tokens unsharded anyway).
    token_slots = jnp.repeat(unshard(slots), S)  # [B*S]
    if activated:
        # An activated LoRA (`lora_jax.serving.alora`): row b's tokens before starts[b] run
        # the base model. Rows then change slot inside a tile: the kernels find the tiles.
        from_start = positions.reshape(-1) >= jnp.repeat(unshard(starts), S)
        token_slots = jnp.where(from_start, token_slots, -1)
        tiles = whole = None
    _set_mapping(model, token_slots, slots, is_prefill=True, prompt_tiles=tiles, whole_tiles=whole)
    mask = positions < lengths[:, None]
    hidden, cache = model.model(ids, positions, cache, attention_mask=mask, flat=True)
    logits = model.compute_logits(_last_hidden(model.rules, hidden, lengths, S))  # [B, V]
    keys = row_keys(seed_key, row_ids, 0)
    return sample_tokens(logits, keys, temperature, top_p, mode=mode), cache


def _decode_fn(
    graphdef,
    state,
    cache,
    first,
    lengths,
    slots,
    row_ids,
    seed_key,
    temperature,
    top_p,
    active,
    max_new,
    eos,
    *,
    mode,
    new_bucket,
    tokens_per_slot=None,
    ops_state=None,  # `ops.dispatch_state()`: a static key only
):
    TRACE_COUNTS["decode"] += 1
    model = nnx.merge(graphdef, state)
    B = first.shape[0]
    # one token per request
    _set_mapping(model, slots, slots, is_prefill=False, tokens_per_slot=tokens_per_slot)
    # Fixed shardings for the loop carry (Explicit meshes want them equal on every trip).
    b = cache_batch_axis(model.rules, B)
    rows = lambda x: model.rules.constrain(x, b)  # noqa: E731
    out = jnp.full((B, new_bucket), -1, jnp.int32).at[:, 0].set(first)  # [B, N]
    out = model.rules.constrain(out, b, None)
    is_eos = lambda tok: (tok[:, None] == eos[None, :]).any(-1)  # noqa: E731  eos: i32[K]
    done = rows(is_eos(first) | (max_new <= 1) | ~active)  # pad rows never hold the loop

    def cond(carry):
        t, _, _, _, done = carry
        return (t < max_new) & ~jnp.all(done)

    def body(carry):
        t, tok, cache, out, done = carry
        # `tok` (generated token t-1) sits at position len + t - 1.
        pos = (lengths + t - 1)[:, None]
        hidden, cache = model.model(tok[:, None], pos, cache, flat=True)  # [B, D]
        logits = model.compute_logits(hidden)
        new = sample_tokens(logits, row_keys(seed_key, row_ids, t), temperature, top_p, mode=mode)
        new = rows(jnp.where(done, -1, new))
        out = jax.lax.dynamic_update_slice(out, new[:, None], (0, t))
        done = done | is_eos(new)
        # Finished rows keep stepping (static shapes) on a harmless token.
        return t + 1, rows(jnp.where(done, 0, new)), cache, out, done

    carry = (jnp.int32(1), rows(jnp.where(done, 0, first)), cache, out, done)
    _, _, cache, out, _ = jax.lax.while_loop(cond, body, carry)
    return out, cache


_prefill = jax.jit(
    _prefill_fn,
    static_argnames=("graphdef", "mode", "ops_state", "activated"),
    donate_argnames=("cache",),
)


@functools.cache
def _decode_jit(options: tuple[tuple[str, str], ...]):
    return jax.jit(
        _decode_fn,
        static_argnames=("graphdef", "mode", "new_bucket", "tokens_per_slot", "ops_state"),
        donate_argnames=("cache",),
        compiler_options=dict(options) or None,
    )
