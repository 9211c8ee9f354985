"""Per-adapter replacement rows of chosen tokens: PEFT's trainable tokens
(`trainable_token_indices`), vLLM's `max_lora_trainable_tokens`.

An adapter trained with trainable tokens carries, for a few token ids, whole new rows of
the embedding table (and of the lm_head's table: the tied one, or its own). Its tokens
then embed to its rows, and its logits of those ids are the hidden state's dot with its
rows; every other token and column is the base's (its LoRA included). Slot `s` holds up
to `M = max_lora_trainable_tokens` of them:

* `token_ids [max_loras, M]` i32: `id + 1` of each row, 0 = unused (a zeroed slot is
  empty, so the managers' zero-fill of a freed slot resets it);
* `token_rows [max_loras, M, D]`: the rows, absolute (not deltas), split on `embed` like
  the table.

The rows are `nnx.LoRAParam`s: an optimizer over `wrt=nnx.LoRAParam` trains a slot's
rows with its LoRA (`lora_jax.serving.training_tokens`); the ids are not parameters.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.layers.slots import _place_like, _write_slot, check_host_write, host_f32

TOKEN_IDS_AXES = ("lora_slot", None)
TOKEN_ROWS_AXES = ("lora_slot", None, "embed")


class TrainableTokenIds(nnx.Variable):
    """`i32[max_loras, max_lora_trainable_tokens]`: each row's token id + 1, 0 = unused."""


class TrainableTokenRows(nnx.LoRAParam):
    """`[max_loras, max_lora_trainable_tokens, D]`: each adapter's replacement rows (an
    `nnx.LoRAParam`: trained with the slot's LoRA, as PEFT trains them)."""


class TokenRowsMixin:
    """Trainable-token slots for a vocab layer (the embedding, the logits processor).

    The layer sets `name`, `lora_config`, `rules` use and calls `_init_token_rows`;
    with `max_lora_trainable_tokens == 0` it holds none (`token_ids is None`).
    """

    name: str
    token_ids: TrainableTokenIds | None
    token_rows: TrainableTokenRows | None

    def _init_token_rows(self, lora_config, vocab: int, dim: int, dtype, rules) -> None:
        M, L = lora_config.max_lora_trainable_tokens, lora_config.max_loras
        self.token_vocab = int(vocab)
        if M == 0:
            self.token_ids = self.token_rows = None
            return
        self.token_ids = TrainableTokenIds(
            rules.place(jnp.zeros((L, M), jnp.int32), *TOKEN_IDS_AXES)
        )  # [max_loras, M]: id + 1
        self.token_rows = TrainableTokenRows(
            rules.place(jnp.zeros((L, M, dim), dtype), *TOKEN_ROWS_AXES)
        )  # [max_loras, M, D]

    def prepare_tokens(self, index: int, token_ids, rows) -> tuple[np.ndarray, np.ndarray]:
        """Checks an adapter's trainable tokens (ids `[n]`, rows `[n, D]`) and pads them to
        the slot's `[M]` / `[M, D]`; writes nothing.

        Example:
            >>> ids, rows = emb.prepare_tokens(0, [3, 7], np.ones((2, 16)))  # doctest: +SKIP
        """
        if self.token_ids is None:
            raise ValueError(
                f"{self.name}: the adapter has trainable tokens (PEFT trainable_token_indices) "
                "but LoRAConfig.max_lora_trainable_tokens=0; set it to at least "
                f"{len(token_ids)}"
            )
        L, M = self.token_ids.shape
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise ValueError(f"{self.name}.set_tokens: index must be an int, got {index!r}")
        if not 0 <= int(index) < L:
            raise ValueError(f"{self.name}.set_tokens: index {int(index)} outside [0, {L})")
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise ValueError(
                f"{self.name}: trainable token ids must be a non-empty 1-D list of ints, got "
                f"{np.asarray(token_ids).tolist()!r}"
            )
        if ids.size > M:
            raise ValueError(
                f"{self.name}: the adapter has {ids.size} trainable tokens, more than "
                f"LoRAConfig.max_lora_trainable_tokens={M}; set it to at least {ids.size}"
            )
        bad = ids[(ids < 0) | (ids >= self.token_vocab)]
        if bad.size:
            raise ValueError(
                f"{self.name}: trainable token ids {bad.tolist()} are outside the vocabulary "
                f"[0, {self.token_vocab})"
            )
        if np.unique(ids).size != ids.size:
            raise ValueError(f"{self.name}: trainable token ids {ids.tolist()} repeat an id")
        D = self.token_rows.shape[2]
        arr = host_f32(self.name, "trainable token rows", rows)
        if arr.shape != (ids.size, D):
            raise ValueError(
                f"{self.name}: trainable token rows must be [{ids.size}, {D}] (one row per "
                f"id), got shape {arr.shape}"
            )
        with np.errstate(over="ignore", invalid="ignore"):
            stored = arr.astype(self.token_rows.dtype).astype(np.float32)
        if not np.isfinite(stored).all():
            raise ValueError(
                f"{self.name}: trainable token rows hold values that are not finite in "
                f"{np.dtype(self.token_rows.dtype)}"
            )
        ids_p = np.zeros((M,), np.int32)
        ids_p[: ids.size] = ids + 1
        rows_p = np.zeros((M, D), np.float32)
        rows_p[: ids.size] = arr
        return ids_p, rows_p

    def token_updates(self, prepared) -> list[tuple[nnx.Variable, int, Any]]:
        """`(variable, slot axis, content or None = zeros)` for the managers' batched write."""
        if self.token_ids is None:
            return []
        if prepared is None:
            return [(self.token_ids, 0, None), (self.token_rows, 0, None)]
        return [(self.token_ids, 0, prepared[0]), (self.token_rows, 0, prepared[1])]

    def set_tokens(self, index: int, token_ids, rows) -> None:
        """Writes an adapter's trainable tokens into slot `index` (all checks first).

        Example:
            >>> emb.set_tokens(1, [3, 7], rows_nd)  # doctest: +SKIP
        """
        ids_p, rows_p = self.prepare_tokens(index, token_ids, rows)
        check_host_write(self.name, "set_tokens", self.token_ids)
        for var, value in ((self.token_ids, ids_p), (self.token_rows, rows_p)):
            stack = var[...]
            var.set_value(_write_slot(stack, jnp.int32(index), _place_like(value, stack)))

    def reset_tokens(self, index: int) -> None:
        """Empties slot `index`'s trainable tokens (its ids and rows zero)."""
        if self.token_ids is None:
            return
        check_host_write(self.name, "reset_tokens", self.token_ids)
        for var in (self.token_ids, self.token_rows):
            stack = var[...]
            zeros = np.zeros(var.shape[1:], np.dtype(var.dtype))
            var.set_value(_write_slot(stack, jnp.int32(index), _place_like(zeros, stack)))

    def read_tokens(self, index: int) -> tuple[tuple[int, ...], np.ndarray] | None:
        """Slot `index`'s trainable tokens `(ids, rows [n, D] f32)`, or None."""
        if self.token_ids is None:
            return None
        ids = np.asarray(self.token_ids[...][index])
        used = ids > 0
        if not used.any():
            return None
        rows = np.asarray(self.token_rows[...][index], np.float32)[used]
        return tuple(int(i) - 1 for i in ids[used]), rows


def replace_rows(y, ids, slots, table_ids, rows):
    """`y [T, D]` with row t replaced by its slot's row of token `ids[t]` where the slot
    has one (`slots[t] >= 0`); `table_ids [L, M]` (id + 1), `rows [L, M, D]`."""
    s = jnp.maximum(slots, 0)
    hit = (table_ids[s] == (ids + 1)[:, None]) & (slots >= 0)[:, None]  # [T, M]
    j = jnp.argmax(hit, axis=-1)  # the matching row (ids do not repeat in a slot)
    new = rows[s, j].astype(y.dtype)  # [T, D]
    return jnp.where(hit.any(-1)[:, None], new, y)


def replacement_logits(x, slots, rows):
    """`[N, M]` f32: each row's dot with its slot's replacement rows (`rows [L, M, D]`)."""
    r = rows[jnp.maximum(slots, 0)]  # [N, M, D]
    return jnp.einsum("nd,nmd->nm", x, r.astype(x.dtype), preferred_element_type=jnp.float32)


def replace_columns(logits, values, slots, table_ids):
    """`logits [N, V]` with column `id` of row n set to `values[n, m]` for each used row m
    of row n's slot (`table_ids [L, M]`, id + 1); other columns and -1 rows unchanged."""
    N, V = logits.shape
    cols = table_ids[jnp.maximum(slots, 0)] - 1  # [N, M], -1 = unused
    keep = (cols >= 0) & (cols < V) & (slots >= 0)[:, None]
    cols = jnp.where(keep, cols, V)  # out of range: dropped by the scatter
    rows = jnp.broadcast_to(jnp.arange(N)[:, None], cols.shape)
    return logits.at[rows, cols].set(values.astype(logits.dtype), mode="drop")


def token_row_args(layer) -> tuple[tuple, tuple]:
    """`(args, specs)` of a layer's token tables for a `shard_map`, or `((), ())`."""
    if getattr(layer, "token_ids", None) is None:
        return (), ()
    return (layer.token_ids[...], layer.token_rows[...]), (TOKEN_IDS_AXES, TOKEN_ROWS_AXES)


def has_token_rows(layer) -> bool:
    return getattr(layer, "token_ids", None) is not None
