"""Row-parallel LoRA layers.

`RowParallelLinearWithLoRA`: A is split on the in dim like the base kernel, B is whole.
Each shard's shrink gives a partial `(T, R)`; expanding a partial sum is still a partial
sum, so the LoRA output joins the base partial sum *before* the layer's one all-reduce.

`RowParallelLinearWithShardedLoRA` (S-LoRA): B is also split on its out dim. The partial
`(T, R)` shrink is all-reduced (small); each shard expands its out-slice of B and adds it
into that slice of its base partial sum, zero elsewhere, so the layer's one all-reduce
both sums the base and gathers the LoRA slices (vLLM's fused S-LoRA row). The LoRA adds
only the (T, R) collective; tokens without an adapter get the base output bit for bit.
"""

from __future__ import annotations

import jax

from lora_jax import ops
from lora_jax.layers.base import BaseLayerWithLoRA
from lora_jax.linear import RowParallelLinear


class RowParallelLinearWithLoRA(BaseLayerWithLoRA):
    """LoRA around a `RowParallelLinear`.

    Example:
        >>> base = RowParallelLinear(64, 16, rngs=nnx.Rngs(0), rules=rules)  # doctest: +SKIP
        >>> layer = RowParallelLinearWithLoRA(base, LoRAConfig(max_loras=4), ctx)  # doctest: +SKIP
    """

    def _check_base(self, base):
        if not isinstance(base, RowParallelLinear):
            raise ValueError(f"{self.name}: base layer must be RowParallelLinear, got {type(base)}")

    def lora_axes(self):
        b_out = "tensor" if self.fully_sharded else None
        return ("lora_slot", "lora_rank", "tensor"), ("lora_slot", b_out, "lora_rank")

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ):
        if cls.fully_sharded != lora_config.fully_sharded_loras:
            return False
        return isinstance(source_layer, RowParallelLinear)

    def _lora_local(self, y, x, a, b, ranks, mapping):
        # h = x @ A.T is a partial sum over the in shards; expand is linear in h, so the
        # partial products are summed by the base reduce (one fused launch with "pallas_fused").
        y = ops.add_lora_linear(y, x, a, b, mapping, 1.0, offsets=(0,), slot_ranks=ranks)
        return self.base_layer.reduce(y)


class RowParallelLinearWithShardedLoRA(RowParallelLinearWithLoRA):
    """S-LoRA row layer: only (T, rank)-sized collectives for the LoRA part.

    Example:
        >>> base = RowParallelLinear(32, 16, rngs=nnx.Rngs(0))
        >>> cfg = LoRAConfig(max_lora_rank=8, fully_sharded_loras=True)
        >>> RowParallelLinearWithShardedLoRA(base, cfg).lora_b[0].shape  # [L, out, R]
        (1, 16, 8)
    """

    fully_sharded = True

    def _check_base(self, base):
        super()._check_base(base)
        tp = base.rules.size("tensor")
        out = sum(base.output_sizes)
        if out % tp:
            raise ValueError(
                f"{self.name}: fully_sharded_loras splits B's out dim ({out}) over the tensor "
                f"axis ({tp}); it must be divisible (or use plain LoRA for this layer)"
            )

    def _lora_local(self, y, x, a, b, ranks, mapping):
        base = self.base_layer
        axis = base.rules.mesh_axis("tensor")
        if axis is None or base.tp == 1:
            return super()._lora_local(y, x, a, b, ranks, mapping)
        h = ops.lora_shrink(x, a, mapping, 1.0, slot_ranks=ranks)  # partial [1, T, R]
        h = jax.lax.psum(h, axis)
        # This shard's out-slice of B: add its expand into the same columns of the local
        # base partial sum; the other shards add zeros there, so the one all-reduce below
        # sums the base and places every LoRA slice.
        width = b[0].shape[1]  # out / tp
        start = jax.lax.axis_index(axis) * width
        part = jax.lax.dynamic_slice_in_dim(y, start, width, axis=1)  # [T, out/tp]
        part = ops.lora_expand(part, h, b, mapping, offsets=(0,), slot_ranks=ranks)
        y = jax.lax.dynamic_update_slice_in_dim(y, part, start, axis=1)
        return base.reduce(y)  # [T, out]
