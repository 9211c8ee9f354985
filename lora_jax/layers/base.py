"""`BaseLayerWithLoRA`: stacked adapter slots around a base linear, per-token mapping.

Each LoRA layer wraps a base linear from `lora_jax.linear` and owns, per slice s,
`lora_a[s] [max_loras, max_rank, in]` and `lora_b[s] [max_loras, out_s, max_rank]`
(`nnx.LoRAParam`, so `nnx.split(model, nnx.LoRAParam, ...)` separates the adapters).
The per-step token→slot mapping reaches every layer through one `LoRAContext`
variable shared by reference, so the wrapped model's call signature never changes.

A "slice" is what vLLM calls one LoRA of a packed layer: gate and up are 2 slices of a
merged column layer; QKVParallelLinearWithLoRA has 1 slice over the packed q|k|v.
`slice_groups[s]` lists the base sub-slices (base `output_sizes`) that slice s covers.

This module holds the layer's structure and forward; its slot writes live in
`lora_jax.layers.slots`, the shared mapping context in `lora_jax.layers.context` (both
re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from lora_jax.config import LoRAConfig
from lora_jax.layers.context import LoRAContext as LoRAContext
from lora_jax.layers.context import _context_max_loras as _context_max_loras
from lora_jax.layers.context import _refuse_slots_without_lora as _refuse_slots_without_lora
from lora_jax.layers.context import check_mapping_slots as check_mapping_slots
from lora_jax.layers.context import clear_lora_mapping as clear_lora_mapping
from lora_jax.layers.context import find_lora_context as find_lora_context
from lora_jax.layers.context import lora_mapping as lora_mapping
from lora_jax.layers.context import set_lora_mapping as set_lora_mapping
from lora_jax.layers.dora import (
    apply_dora,
    check_magnitudes,
    dora_axes,
    dora_values,
    has_dora,
    init_dora,
    weight_norms,
)
from lora_jax.layers.slots import LoRASlotRanks as LoRASlotRanks
from lora_jax.layers.slots import PreparedLoRA as PreparedLoRA
from lora_jax.layers.slots import SlotWriter as SlotWriter
from lora_jax.layers.slots import _place_like as _place_like
from lora_jax.layers.slots import _write_slot as _write_slot
from lora_jax.layers.slots import check_finite as check_finite
from lora_jax.layers.slots import check_host_write as check_host_write
from lora_jax.layers.slots import host_f32 as host_f32
from lora_jax.layers.slots import put_like as put_like
from lora_jax.linear import LinearBase
from lora_jax.mapping import PROMPT_TILE_TOKENS, LoRAMapping, make_lora_mapping

# One copy of a LoRA layer's input for both of its readers, the base matmul and the shrink.
# Without the barrier XLA's GPU fusion recomputes the input's elementwise producer (say an
# RMSNorm's scale) once per reader, each a full pass over the activations: at 4 x 1024
# tokens of hidden 4096 two extra 32 MB passes a norm (session 23's profile). Setting it
# False is for the benchmark that measures this.
SHARE_LAYER_INPUT = True


class BaseLayerWithLoRA(SlotWriter, nnx.Module):
    """Common slot logic; see the concrete `*WithLoRA` classes.

    Subclasses set `fully_sharded` and implement `_lora_local`, and may override
    `_slice_groups` and `_split_single`.

    Example:
        >>> base = ReplicatedLinear(16, 32, rngs=nnx.Rngs(0))
        >>> layer = ReplicatedLinearWithLoRA(base, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> layer.set_lora(1, np.ones((4, 16)), np.ones((32, 4)))  # rank 4 <= 8
        >>> _ = set_lora_mapping(layer, jnp.array([1, -1], jnp.int32))  # token -> slot
        >>> y = layer(jnp.ones((2, 16)))  # row 0: base + B @ A x, row 1: base only
        >>> layer.reset_lora(1)
    """

    fully_sharded: bool = False

    def __init__(
        self,
        base_layer: LinearBase,
        lora_config: LoRAConfig,
        context: LoRAContext | None = None,
        *,
        name: str | None = None,
    ):
        self.base_layer = base_layer
        self.lora_config = lora_config
        self.lora_context = context if context is not None else LoRAContext(None)
        self.name = name or type(self).__name__
        self.slice_groups = self._slice_groups(base_layer)
        self._check_base(base_layer)
        rules = base_layer.rules
        cfg = lora_config
        L, R = cfg.max_loras, cfg.max_lora_rank
        rules.check_lora_axes(self.name, self.fully_sharded)
        a_axes, b_axes = self.lora_axes()
        # Only layers that split A's rank rows need the rank to divide (the column S-LoRA);
        # the row S-LoRA splits A on its in dim and B on its out dim, any rank runs.
        rank_shards = rules.size("lora_rank_sharded") if "lora_rank_sharded" in a_axes else 1
        if R % rank_shards:
            raise ValueError(
                f"{self.name}: max_lora_rank={R} must be divisible by the tensor axis "
                f"({rank_shards}) with fully_sharded_loras"
            )
        dtype = cfg.dtype_for(base_layer.param_dtype)
        self.lora_dtype = dtype
        self.lora_a = nnx.List(
            [
                nnx.LoRAParam(rules.place(jnp.zeros((L, R, n_in), dtype), *a_axes))
                for n_in in [base_layer.in_features] * len(self.slice_groups)
            ]
        )  # per slice [max_loras, max_rank, in]
        self.lora_b = nnx.List(
            [
                nnx.LoRAParam(rules.place(jnp.zeros((L, n, R), dtype), *b_axes))
                for n in self.slice_widths
            ]
        )  # per slice [max_loras, out_s (physical), max_rank]
        ranks = jnp.zeros((len(self.slice_groups), L), jnp.int32)  # [S, max_loras]
        self.slot_ranks = LoRASlotRanks(rules.place(ranks, None, None))
        init_dora(self)  # `dora_magnitude`, `dora_norm` [max_loras, out] with enable_dora

    # -- structure ------------------------------------------------------------------------
    def _slice_groups(self, base: LinearBase) -> tuple[tuple[int, ...], ...]:
        return (tuple(range(len(base.output_sizes))),)

    def _check_base(self, base: LinearBase) -> None:
        pass

    def lora_axes(self) -> tuple[tuple, tuple]:
        """Logical axes of A `[L, R, in]` and B `[L, out, R]` for this layer kind."""
        raise NotImplementedError

    @property
    def n_slices(self) -> int:
        return len(self.slice_groups)

    @property
    def slice_widths(self) -> tuple[int, ...]:
        """Physical out width of each slice (kv replicas included)."""
        phys = self.base_layer.physical_sizes
        return tuple(sum(phys[i] for i in g) for g in self.slice_groups)

    @property
    def logical_slice_sizes(self) -> tuple[int, ...]:
        out = self.base_layer.output_sizes
        return tuple(sum(out[i] for i in g) for g in self.slice_groups)

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ) -> bool:
        return False

    # -- slot writes: set_lora, prepare_lora, write_lora, reset_lora, slot_updates come
    # from `SlotWriter` (lora_jax.layers.slots).

    # -- forward --------------------------------------------------------------------------
    def _lora_local(self, y, x, a, b, ranks, mapping: LoRAMapping):
        """Per-shard: add the LoRA of `x` into the base output `y` (incl. collectives)."""
        raise NotImplementedError

    def __call__(self, x: jax.Array):
        base = self.base_layer
        mapping = self.lora_context.get_value()
        if mapping is None:
            return base(x)
        if x.shape[-1] != base.in_features:
            raise ValueError(
                f"{self.name}: input last dim {x.shape[-1]} != in_features {base.in_features}"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, base.in_features)
        if mapping.num_tokens != x2.shape[0]:
            raise ValueError(
                f"{self.name}: the LoRA mapping has {mapping.num_tokens} tokens but the input "
                f"has {x2.shape[0]} (leading dims {lead})"
            )
        rules = base.rules
        L = self.lora_config.max_loras
        check_mapping_slots(self.name, mapping, L)
        local_tokens = rules.size("batch") > 1 and x2.shape[0] % rules.size("batch") == 0
        if local_tokens:
            # Sort metadata is per shard of tokens: rebuild it locally from the indices.
            map_arg, map_spec = mapping.token_lora_indices, ("batch",)
        else:
            map_arg, map_spec = mapping, jax.tree.map(lambda _: (), mapping)
        a = tuple(v[...] for v in self.lora_a)
        b = tuple(v[...] for v in self.lora_b)
        ranks = self.slot_ranks[...]
        a_axes, b_axes = self.lora_axes()

        # A shard's tiles of tokens are the step's when its share is whole tiles: what the
        # step's mapping says of its prompt tiles (and of its tiles wholly of one slot: "all"
        # of 128-row tiles is "all" of 64-row ones too) then holds for every shard.
        aligned = x2.shape[0] // rules.size("batch") % PROMPT_TILE_TOKENS == 0
        shard_tiles = mapping.prompt_tiles if aligned else None
        shard_whole = mapping.whole_tiles if aligned else None

        dora = () if not has_dora(self) else (self.dora_magnitude[...], self.dora_norm[...])

        def local(xl, kl, a, b, ranks, m, *dora):
            if not isinstance(m, LoRAMapping):
                # tokens_per_slot: a hint (1 holds for any share of the tokens)
                m = make_lora_mapping(
                    m,
                    L,
                    is_prefill=mapping.is_prefill,
                    prompt_tiles=shard_tiles,
                    tokens_per_slot=mapping.tokens_per_slot,
                    whole_tiles=shard_whole,
                    single_slot=mapping.single_slot,  # holds for any share of the tokens
                )
            if SHARE_LAYER_INPUT:
                xl = jax.lax.optimization_barrier(xl)
            y = base.local_matmul(xl, kl)
            y = self._lora_local(y, xl, a, b, ranks, m)
            return apply_dora(y, *dora, m.token_lora_indices) if dora else y

        specs = ((a_axes,) * len(a), (b_axes,) * len(b), (None, None), map_spec)
        specs += (dora_axes(base),) * len(dora)
        y = base.run_local(x2, local, (a, b, ranks, map_arg, *dora), specs)
        return base.finish(y, lead)

    # -- DoRA -----------------------------------------------------------------------------
    def check_dora(self, magnitudes) -> None:
        """Validates a DoRA adapter's per-member magnitudes for this layer; writes nothing."""
        check_magnitudes(self, magnitudes)

    def dora_updates(self, index: int, magnitudes) -> list:
        """`[(dora_magnitude, 0, m), (dora_norm, 0, ||W + B @ A||)]` for slot `index`, whose
        LoRA is written: PEFT's gain `magnitude / ||W + B @ A||`."""
        check_magnitudes(self, magnitudes)
        m, n = dora_values(self, magnitudes, weight_norms(self, index))
        return [(self.dora_magnitude, 0, m), (self.dora_norm, 0, n)]

    def set_dora(self, index: int, magnitudes) -> None:
        """Makes slot `index`'s adapter (written with `set_lora`) a DoRA adapter.

        Example:
            >>> layer.set_lora(0, a, b); layer.set_dora(0, [magnitude])  # doctest: +SKIP
        """
        self._check_index(index, "set_dora")
        check_magnitudes(self, magnitudes)
        self._zero_dora(index)
        for var, _, value in self.dora_updates(index, magnitudes):
            self._write(var, index, value)


def local_offsets(widths: Sequence[int], shards: int) -> tuple[int, ...]:
    """Column offset of each slice inside one shard's packed output."""
    offs, acc = [], 0
    for w in widths:
        offs.append(acc)
        acc += w // shards
    return tuple(offs)
