"""Vocab-parallel token embedding and lm_head, vLLM's `VocabParallelEmbedding` /
`ParallelLMHead`, in NNX.

The table `embedding [V_pad, D]` is split over the "vocab" logical axis. `V_pad` rounds
the vocabulary up to a multiple of `padding_size` and of the shard count; padded rows are
zero and padded logits are dropped (`logits[..., :V]`), so the result is indexed by
token id exactly as with one device.

Lookup: each shard gathers the ids it owns (others masked to 0) and one all-reduce sums
the shards — vLLM's `get_masked_input_and_mask`, written as a `shard_map`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from lora_jax.sharding import ShardingRules, shard_map

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int, shards: int = 1) -> int:
    """Smallest multiple of `lcm(pad_to, shards)` that is >= `vocab_size`.

    Example:
        >>> pad_vocab_size(1000, 64), pad_vocab_size(1000, 64, shards=3)
        (1024, 1152)
    """
    m = math.lcm(pad_to, shards)
    return -(-vocab_size // m) * m


class VocabParallelEmbedding(nnx.Module):
    """Token embedding with the vocabulary sharded over the mesh.

    Example:
        >>> emb = VocabParallelEmbedding(100, 16, rngs=nnx.Rngs(0))
        >>> emb(jnp.array([[1, 2, 99]])).shape
        (1, 3, 16)
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        dtype=None,
        param_dtype=jnp.float32,
        rules: ShardingRules | None = None,
        embedding_init=None,
        rngs: nnx.Rngs,
    ):
        self.rules = rules if rules is not None else ShardingRules()
        vocab_axis = self.rules.mesh_axis("vocab")
        if vocab_axis is not None and vocab_axis == self.rules.mesh_axis("embed"):
            # the table [V_pad, D] would be split twice over one mesh axis
            raise ValueError(
                f"{type(self).__name__}: the rules map 'vocab' and 'embed' to one mesh axis "
                f"{vocab_axis!r}; the table splits its rows over 'vocab' and its columns over "
                "'embed': map them to different axes (or 'embed' to None)"
            )
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.shards = self.rules.size("vocab")
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size, self.shards)
        self.dtype, self.param_dtype = dtype, param_dtype
        embedding_init = embedding_init or nnx.initializers.normal(0.02)
        table = embedding_init(rngs.params(), (self.num_embeddings, embedding_dim), param_dtype)
        self.embedding = nnx.Param(self.rules.place(self._pad(table), "vocab", "embed"))

    def _pad(self, table: jax.Array) -> jax.Array:
        extra = self.num_embeddings_padded - table.shape[0]
        return jnp.pad(jnp.asarray(table, self.param_dtype), ((0, extra), (0, 0)))

    def load_table(self, table) -> None:
        """Sets the table from an unpadded `[V, D]` array."""
        if tuple(table.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"{type(self).__name__}.load_table: expected "
                f"{(self.num_embeddings, self.embedding_dim)}, got {tuple(table.shape)}"
            )
        self.embedding.set_value(self.rules.place(self._pad(table), "vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        dtype = self.dtype or self.param_dtype
        table = self.embedding[...]
        lead = ids.shape
        flat = ids.reshape(-1).astype(jnp.int32)
        if self.rules.mesh is None:
            return jnp.take(table, flat, axis=0).astype(dtype).reshape(*lead, -1)
        axis = self.rules.collective_axis("vocab")
        local_v = self.num_embeddings_padded // self.shards

        def local(ids_l, table_l):
            start = 0 if axis is None else jax.lax.axis_index(axis) * local_v
            rel = ids_l - start
            own = (rel >= 0) & (rel < local_v)
            out = jnp.where(own[:, None], jnp.take(table_l, jnp.where(own, rel, 0), axis=0), 0)
            return out if axis is None else jax.lax.psum(out, axis)

        out = shard_map(self.rules, local, ((None,), ("vocab", "embed")), (None, "embed"))(
            flat, table
        )
        return out.astype(dtype).reshape(*lead, -1)

    def attend(self, x: jax.Array, gather: bool = False) -> jax.Array:
        """Logits `[..., V_pad]` against the table (tied lm_head): sharded on vocab, or
        all-gathered to every device with `gather=True` (what the sampler needs)."""
        dtype = self.dtype or x.dtype
        table = self.embedding[...].astype(dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).astype(dtype)
        if self.rules.mesh is None:
            return (x2 @ table.T).reshape(*lead, -1)
        axis = self.rules.collective_axis("vocab")
        embed_axis = self.rules.collective_axis("embed")  # a table split on D: partial sums

        def fn(xl, tl):
            out = xl @ tl.T
            if embed_axis is not None:
                out = jax.lax.psum(out, embed_axis)
            if gather and axis is not None:
                out = jax.lax.all_gather(out, axis, axis=1, tiled=True)
            return out

        out_spec = (None, None) if gather else (None, "vocab")
        specs = ((None, "embed"), ("vocab", "embed"))
        out = shard_map(self.rules, fn, specs, out_spec)(x2, table)
        return out.reshape(*lead, -1)


class ParallelLMHead(VocabParallelEmbedding):
    """lm_head weights `[V_pad, D]` sharded on vocab; `logits(x)` gives `[..., V]`.

    Example:
        >>> head = ParallelLMHead(100, 16, rngs=nnx.Rngs(0))
        >>> head.logits(jnp.ones((2, 16))).shape
        (2, 100)
    """

    def logits(self, x: jax.Array) -> jax.Array:
        return self.attend(x, gather=True)[..., : self.num_embeddings]

    def __call__(self, x: jax.Array) -> jax.Array:  # type: ignore[override]
        return self.logits(x)
