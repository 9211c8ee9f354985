"""Column-parallel LoRA layers (and the replicated one), vLLM names and semantics.

Per shard: `y_i = x @ W_i + expand(shrink(x, A), B_i)` with B split on the out dim like
the base kernel: the LoRA adds no collective and the output stays sharded.
Fully sharded (S-LoRA) variants split A on its rank dim instead of replicating it:
each shard computes `(T, R/tp)` of the shrink, and one all-gather of that small buffer
gives every shard the full `(T, R)` before its local expand.
"""

from __future__ import annotations

import jax

from lora_jax import ops
from lora_jax.layers.base import BaseLayerWithLoRA, local_offsets
from lora_jax.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    MergedReplicatedLinear,
    QKVParallelLinear,
    ReplicatedLinear,
)


class _ColumnLoRA(BaseLayerWithLoRA):
    def lora_axes(self):
        rank = "lora_rank_sharded" if self.fully_sharded else "lora_rank"
        return ("lora_slot", rank, None), ("lora_slot", "tensor", "lora_rank")

    def _lora_local(self, y, x, a, b, ranks, mapping):
        base = self.base_layer
        # where A's rank rows are split (a rules table for plain LoRA may lack the key)
        axis = base.rules.mesh_axis("lora_rank_sharded") if self.fully_sharded else None
        sharded_rank = axis is not None and base.tp > 1
        offsets = local_offsets(self.slice_widths, base.out_tp)
        if not sharded_rank:  # shrink then expand (one fused launch with "pallas_fused")
            return ops.add_lora_linear(y, x, a, b, mapping, 1.0, offsets=offsets, slot_ranks=ranks)
        # A rank-sharded shard holds rank rows [i*R/tp, (i+1)*R/tp): true ranks don't
        # apply to its local block, so the kernels get no rank hint then.
        h = ops.lora_shrink(x, a, mapping, 1.0, slot_ranks=None)  # f32 [S, T, R/tp]
        h = jax.lax.all_gather(h, axis, axis=2, tiled=True)  # [S, T, R]
        return ops.lora_expand(y, h, b, mapping, offsets=offsets, slot_ranks=ranks)


class ReplicatedLinearWithLoRA(_ColumnLoRA):
    """LoRA around a `ReplicatedLinear` (no tensor parallelism).

    Example:
        >>> base = ReplicatedLinear(16, 32, rngs=nnx.Rngs(0))
        >>> layer = ReplicatedLinearWithLoRA(base, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> layer.set_lora(1, np.ones((4, 16)), np.ones((32, 4)))  # A [r, in], B [out, r]
        >>> layer(jnp.ones((3, 16))).shape  # no mapping set: the base output
        (3, 32)
    """

    def _check_base(self, base):
        if not isinstance(base, ReplicatedLinear):
            raise ValueError(f"{self.name}: base layer must be ReplicatedLinear, got {type(base)}")

    def lora_axes(self):
        return ("lora_slot", "lora_rank", None), ("lora_slot", None, "lora_rank")

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ):
        if isinstance(source_layer, MergedReplicatedLinear):  # one LoRA over its outputs
            return len(packed_modules_list) <= 1
        return type(source_layer) is ReplicatedLinear


class ColumnParallelLinearWithLoRA(_ColumnLoRA):
    """One LoRA over a column-parallel layer; B split with the base kernel's out dim.

    Example:
        >>> base = ColumnParallelLinear(16, 32, rngs=nnx.Rngs(0))
        >>> layer = ColumnParallelLinearWithLoRA(base, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> layer.set_lora(0, np.ones((4, 16)), np.ones((32, 4)))  # A [r, in], B [out, r]
        >>> layer.lora_b[0].shape  # [max_loras, out, max_rank]
        (2, 32, 8)
    """

    def _check_base(self, base):
        if not isinstance(
            base, ColumnParallelLinear | MergedColumnParallelLinear | QKVParallelLinear
        ):
            raise ValueError(f"{self.name}: base layer must be column-parallel, got {type(base)}")

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ):
        if cls.fully_sharded != lora_config.fully_sharded_loras:
            return False
        if type(source_layer) is ColumnParallelLinear:
            return True
        # A merged layer that the checkpoint names as one module (vLLM: 1-item packed list).
        if isinstance(source_layer, MergedColumnParallelLinear):
            return len(packed_modules_list) == 1 and len(source_layer.output_sizes) <= 2
        return False


class MergedColumnParallelLinearWithLoRA(_ColumnLoRA):
    """gate_up-style layer: 2 slices, each its own A and B.

    Example:
        >>> base = MergedColumnParallelLinear(16, [32, 32], rngs=nnx.Rngs(0))
        >>> layer = MergedColumnParallelLinearWithLoRA(base, LoRAConfig(max_lora_rank=8))
        >>> a, b = np.ones((4, 16)), np.ones((32, 4))
        >>> layer.set_lora(0, [a, a], [b, b])  # per slice: gate, up
        >>> len(layer.lora_a), layer.lora_a[0].shape
        (2, (1, 8, 16))
    """

    n_required: int | None = 2

    def _slice_groups(self, base):
        return tuple((i,) for i in range(len(base.output_sizes)))

    def _check_base(self, base):
        if not isinstance(base, MergedColumnParallelLinear | QKVParallelLinear):
            raise ValueError(f"{self.name}: base must be a merged column layer, got {type(base)}")
        if self.n_required is not None and len(base.output_sizes) != self.n_required:
            raise ValueError(
                f"{self.name}: needs {self.n_required} output slices, base has "
                f"{len(base.output_sizes)}"
            )

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ):
        if cls.fully_sharded != lora_config.fully_sharded_loras:
            return False
        return (
            (
                type(source_layer) is MergedColumnParallelLinear
                or isinstance(source_layer, MergedColumnParallelLinear)
            )
            and len(packed_modules_list) == 2
            and len(source_layer.output_sizes) == 2
        )


class MergedReplicatedLinearWithLoRA(MergedColumnParallelLinearWithLoRA):
    """vLLM's `MergedReplicatedLinearWithLoRA`: a replicated layer of 2+ packed outputs (a
    `MergedReplicatedLinear`, e.g. DeepSeek's `fused_qkv_a_proj`), each slice its own A
    and B; no tensor parallelism, so no collective (with or without `fully_sharded_loras`,
    as in vLLM).

    Example:
        >>> base = MergedReplicatedLinear(16, [8, 24], rngs=nnx.Rngs(0))
        >>> layer = MergedReplicatedLinearWithLoRA(base, LoRAConfig(max_lora_rank=8))
        >>> a = np.ones((4, 16))
        >>> layer.set_lora(0, [a, a], [np.ones((8, 4)), np.ones((24, 4))])
        >>> layer.logical_slice_sizes
        (8, 24)
    """

    n_required = None

    def _check_base(self, base):
        if not isinstance(base, MergedReplicatedLinear):
            raise ValueError(
                f"{self.name}: base must be a MergedReplicatedLinear, got {type(base)}"
            )
        if len(base.output_sizes) < 2:
            raise ValueError(f"{self.name}: needs >= 2 output slices, got {len(base.output_sizes)}")

    def lora_axes(self):
        return ("lora_slot", "lora_rank", None), ("lora_slot", None, "lora_rank")

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ):
        return isinstance(source_layer, MergedReplicatedLinear) and len(packed_modules_list) >= 2


class MergedColumnParallelLinearVariableSliceWithLoRA(MergedColumnParallelLinearWithLoRA):
    """3+ slices of any sizes; a single-tensor checkpoint (one A, one B) is split by
    `output_sizes`.

    Example:
        >>> base = MergedColumnParallelLinear(16, [8, 8, 16], rngs=nnx.Rngs(0))
        >>> cfg = LoRAConfig(max_lora_rank=8)
        >>> MergedColumnParallelLinearVariableSliceWithLoRA(base, cfg).slice_widths
        (8, 8, 16)
    """

    n_required = None

    def _check_base(self, base):
        super()._check_base(base)
        if len(base.output_sizes) < 3:
            raise ValueError(f"{self.name}: needs >= 3 output slices, got {len(base.output_sizes)}")

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ):
        if cls.fully_sharded != lora_config.fully_sharded_loras:
            return False
        if not isinstance(source_layer, MergedColumnParallelLinear):
            return False
        n = len(source_layer.output_sizes)
        return n >= 3 and len(packed_modules_list) in (0, 1, n)  # none given: by its sizes


class QKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """One LoRA over packed qkv: B's q, k, v parts are laid out per shard like the base
    kernel's, with kv heads replicated when tp > num_kv_heads.

    Example:
        >>> base = QKVParallelLinear(16, 4, 4, 2, rngs=nnx.Rngs(0))  # q 16, k 8, v 8
        >>> layer = QKVParallelLinearWithLoRA(base, LoRAConfig(max_lora_rank=8))
        >>> layer.set_lora(0, np.ones((4, 16)), np.ones((32, 4)))  # B [q+k+v, r]
    """

    def _check_base(self, base):
        if not isinstance(base, QKVParallelLinear):
            raise ValueError(f"{self.name}: base layer must be QKVParallelLinear, got {type(base)}")

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ):
        if cls.fully_sharded != lora_config.fully_sharded_loras:
            return False
        return isinstance(source_layer, QKVParallelLinear) and len(packed_modules_list) == 1


class MergedQKVParallelLinearWithLoRA(MergedColumnParallelLinearWithLoRA):
    """q, k, v as 3 slices (q may be wider than k/v under GQA).

    Example:
        >>> base = QKVParallelLinear(16, 4, 4, 2, rngs=nnx.Rngs(0))
        >>> layer = MergedQKVParallelLinearWithLoRA(base, LoRAConfig(max_lora_rank=8))
        >>> a = np.ones((4, 16))
        >>> layer.set_lora(0, [a, a, a], [np.ones((16, 4)), np.ones((8, 4)), np.ones((8, 4))])
        >>> layer.logical_slice_sizes
        (16, 8, 8)
    """

    n_required = 3

    def _check_base(self, base):
        if not isinstance(base, QKVParallelLinear):
            raise ValueError(f"{self.name}: base layer must be QKVParallelLinear, got {type(base)}")

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ):
        if cls.fully_sharded != lora_config.fully_sharded_loras:
            return False
        return isinstance(source_layer, QKVParallelLinear) and len(packed_modules_list) == 3


class ColumnParallelLinearWithShardedLoRA(ColumnParallelLinearWithLoRA):
    """S-LoRA column: A split on rank, one (T, rank) all-gather.

    `wrap_model` picks it (and the other `*WithShardedLoRA` classes) when
    `LoRAConfig(fully_sharded_loras=True)`.

    Example:
        >>> cfg = LoRAConfig(max_lora_rank=8, fully_sharded_loras=True)
        >>> base = ColumnParallelLinear(16, 32, rngs=nnx.Rngs(0))
        >>> ColumnParallelLinearWithShardedLoRA.can_replace_layer(base, cfg)
        True
    """

    fully_sharded = True


class MergedColumnParallelLinearWithShardedLoRA(MergedColumnParallelLinearWithLoRA):
    """S-LoRA gate_up: each slice's A split on rank, one (T, rank) all-gather.

    Example:
        >>> base = MergedColumnParallelLinear(16, [32, 32], rngs=nnx.Rngs(0))
        >>> cfg = LoRAConfig(max_lora_rank=8, fully_sharded_loras=True)
        >>> MergedColumnParallelLinearWithShardedLoRA(base, cfg).fully_sharded
        True
    """

    fully_sharded = True


class MergedColumnParallelLinearVariableSliceWithShardedLoRA(
    MergedColumnParallelLinearVariableSliceWithLoRA
):
    """S-LoRA variant of `MergedColumnParallelLinearVariableSliceWithLoRA` (A split on rank).

    Example:
        >>> base = MergedColumnParallelLinear(16, [8, 8, 16], rngs=nnx.Rngs(0))
        >>> cfg = LoRAConfig(max_lora_rank=8, fully_sharded_loras=True)
        >>> len(MergedColumnParallelLinearVariableSliceWithShardedLoRA(base, cfg).lora_a)
        3
    """

    fully_sharded = True


class QKVParallelLinearWithShardedLoRA(QKVParallelLinearWithLoRA):
    """S-LoRA variant of `QKVParallelLinearWithLoRA` (A split on rank).

    Example:
        >>> base = QKVParallelLinear(16, 4, 4, 2, rngs=nnx.Rngs(0))
        >>> cfg = LoRAConfig(max_lora_rank=8, fully_sharded_loras=True)
        >>> QKVParallelLinearWithShardedLoRA(base, cfg).lora_a[0].shape
        (1, 8, 16)
    """

    fully_sharded = True


class MergedQKVParallelLinearWithShardedLoRA(MergedQKVParallelLinearWithLoRA):
    """S-LoRA variant of `MergedQKVParallelLinearWithLoRA` (each slice's A split on rank).

    Example:
        >>> base = QKVParallelLinear(16, 4, 4, 2, rngs=nnx.Rngs(0))
        >>> cfg = LoRAConfig(max_lora_rank=8, fully_sharded_loras=True)
        >>> len(MergedQKVParallelLinearWithShardedLoRA(base, cfg).lora_b)
        3
    """

    fully_sharded = True
