"""Multi-LoRA around a plain `flax.nnx.Embed`, so that `wrap_model` takes a Flax model's
token embedding as PEFT's `embed_tokens` adapters expect.

A targeted `nnx.Embed` becomes a `FlaxEmbedWithLoRA` whose base is a `FlaxEmbed`: a
`VocabParallelEmbedding` view (one shard, no padding) that shares the original layer's
`embedding` variable and calls the original layer for the base lookup (its dtype
promotion and `out_sharding`). The LoRA is PEFT's embedding LoRA, as in
`VocabParallelEmbeddingWithLoRA`: `y = emb(id) + B @ A[:, id]` for the token's slot (a
DoRA slot's row then times its gain per embedding unit).
`attend` (a tied lm_head) is the original layer's and gets no LoRA, as in PEFT.
`unwrap_model` puts the very same `nnx.Embed` back.

The LoRA stacks are replicated; a sharded table stays as the user placed it. For a
vocab-parallel embedding build the model from `lora_jax.vocab`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lora_jax import ops
from lora_jax.config import LoRAConfig
from lora_jax.layers.base import LoRAContext
from lora_jax.layers.dora import apply_dora
from lora_jax.layers.embedding import VocabParallelEmbeddingWithLoRA
from lora_jax.layers.flax_linear import forward_source_fields
from lora_jax.sharding import ShardingRules, unshard
from lora_jax.vocab import VocabParallelEmbedding


def _sharding_kw(out_sharding) -> dict:
    return {} if out_sharding is None else {"out_sharding": out_sharding}


class FlaxEmbed(VocabParallelEmbedding):
    """A `VocabParallelEmbedding` view of an `nnx.Embed` (table shared, not copied).

    Example:
        >>> emb = nnx.Embed(100, 16, rngs=nnx.Rngs(0))
        >>> view = FlaxEmbed(emb)
        >>> view.embedding is emb.embedding, view(jnp.array([1, 2])).shape
        (True, (2, 16))
    """

    def __init__(self, source: nnx.Embed, *, name: str | None = None):  # no new table drawn
        if not isinstance(source, nnx.Embed):
            raise ValueError(f"FlaxEmbed: expected a flax.nnx.Embed, got {type(source).__name__}")
        shape = tuple(source.embedding.shape)
        if shape != (int(source.num_embeddings), int(source.features)):
            raise ValueError(
                f"{name or 'FlaxEmbed'}: an nnx.Embed({source.num_embeddings}, "
                f"{source.features}) with a "
                f"table of shape {shape}: stacked layers (nnx.vmap / scan over layers) are "
                "not supported"
            )
        self.source = source
        self.rules = ShardingRules()
        self.num_embeddings = int(source.num_embeddings)
        self.embedding_dim = int(source.features)
        self.shards = 1
        self.num_embeddings_padded = self.num_embeddings  # [V, D]: the source's own table
        self.dtype, self.param_dtype = source.dtype, source.param_dtype
        self.embedding = source.embedding  # the same variable

    def __call__(self, ids: jax.Array, out_sharding=None) -> jax.Array:
        return self.source(ids, **_sharding_kw(out_sharding))

    def attend(self, x: jax.Array, out_sharding=None, *, gather: bool = False) -> jax.Array:
        """The source's `attend` (`[..., V]`; one shard, so `gather` changes nothing);
        `out_sharding` second, as `nnx.Embed.attend` takes it."""
        del gather
        return self.source.attend(x, **_sharding_kw(out_sharding))


@forward_source_fields(  # nnx.Embed's public fields (flax 0.12)
    "embedding", "num_embeddings", "features", "dtype", "param_dtype", "promote_dtype"
)
class FlaxEmbedWithLoRA(VocabParallelEmbeddingWithLoRA):
    """Per-token multi-LoRA around a plain `nnx.Embed`; `wrap_model` picks it for
    `nnx.Embed` modules. `set_lora(i, A [r, V], B [D, r])` as PEFT's
    `lora_embedding_A` / `lora_embedding_B` (scaling folded into B). The `nnx.Embed`'s
    public fields (`embedding`, `features`, ...) read through it.

    Example:
        >>> emb = nnx.Embed(100, 16, rngs=nnx.Rngs(0))
        >>> layer = FlaxEmbedWithLoRA(emb, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> layer.set_lora(1, np.ones((4, 100)), np.ones((16, 4)))
        >>> layer.base_layer.source is emb, layer.embedding is emb.embedding, layer.features
        (True, True, 16)
    """

    def __init__(
        self,
        base_layer: nnx.Embed | FlaxEmbed,
        lora_config: LoRAConfig,
        context: LoRAContext | None = None,
        *,
        name: str | None = None,
    ):
        if isinstance(base_layer, nnx.Embed):
            base_layer = FlaxEmbed(base_layer, name=name)
        if not isinstance(base_layer, FlaxEmbed):
            raise ValueError(
                f"{name or type(self).__name__}: base layer must be a flax.nnx.Embed, got "
                f"{type(base_layer).__name__}"
            )
        super().__init__(base_layer, lora_config, context, name=name)
        self.token_ids = self.token_rows = None  # trainable tokens: see prepare_tokens

    def prepare_tokens(self, index: int, token_ids, rows):
        raise ValueError(
            f"{self.name}: trainable tokens (PEFT trainable_token_indices) are served on "
            "lora_jax's VocabParallelEmbedding (the lora_jax.models decoders), not on a "
            "plain flax.nnx.Embed"
        )

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ) -> bool:
        return isinstance(source_layer, nnx.Embed) and len(packed_modules_list) <= 1

    def attend(self, query: jax.Array, out_sharding=None, *, gather: bool = False) -> jax.Array:
        """The source's `attend` (`out_sharding` second, as `nnx.Embed.attend` takes it),
        without LoRA: PEFT's embedding LoRA leaves it alone."""
        return self.base_layer.attend(query, out_sharding)

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        """As `nnx.Embed.__call__`, plus each token's slot's `B @ A[:, id]`."""
        y = self.base_layer(inputs, out_sharding)  # the base lookup, exactly the source's
        mapping = self.lora_context.get_value()
        if mapping is None:
            return y
        flat = inputs.reshape(-1).astype(jnp.int32)  # [T]
        if mapping.num_tokens != flat.shape[0]:
            raise ValueError(
                f"{self.name}: the LoRA mapping has {mapping.num_tokens} tokens but the input "
                f"has {flat.shape[0]} (ids shape {inputs.shape})"
            )
        slot = mapping.token_lora_indices
        # ids may be batch-sharded (an Explicit mesh): the gather wants them replicated
        # like the slots; the expand below re-splits the rows as `y` is split
        flat = unshard(flat)
        code = self.lora_a[...][jnp.maximum(slot, 0), :, flat]  # [T, R]: each id's A column
        code = jnp.where((slot >= 0)[:, None], code.astype(jnp.float32), 0.0)
        y2 = ops.lora_expand(
            y.reshape(flat.shape[0], -1),  # [T, D]
            code[None],
            (self.lora_b[...],),
            mapping,
            offsets=(0,),
            slot_ranks=self.slot_ranks[...],
        )
        dora, _ = self._dora_args()
        if dora:  # a DoRA slot's gain per embedding unit (PEFT's DoraEmbeddingLayer)
            y2 = apply_dora(y2, *dora, slot)
        return y2.reshape(y.shape)
