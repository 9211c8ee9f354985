"""MoE LoRA layers: vLLM's `FusedMoEWithLoRA` and `FusedMoE3DWithLoRA`, plus expert parallelism.

Each (token, chosen expert) pair uses its token's adapter slot `l` and the expert `e`:

    g = x @ w13[e] + Σ_s place_s(x @ A13_s[l, e].T @ B13_s[l, e].T)   (before the activation)
    o = a @ w2[e]  + a @ A2[l, e].T @ B2[l, e].T                       (a = act(gate) * up)

and the routing weight multiplies `o` (vLLM applies it on the w2 output, LoRA included).
Token slot -1 (or a reset slot) gives exactly the base output.

Stacks (vLLM layout with its singleton dim dropped), `nnx.LoRAParam`:
* `w13_lora_a[s] [L, E, R, hidden]`, `w13_lora_b[s] [L, E, n_s, R]`: 2 slices (gate w1, up
  w3) for gated experts, 1 (w1) for non-gated; `FusedMoE3DWithLoRA` has 1 slice covering
  the fused w13, B in the base's gate/up layout (concat or interleaved).
* `w2_lora_a [L, E, R, inter]`, `w2_lora_b [L, E, hidden, R]`.

Sharding: experts on "expert", the intermediate dim on "tensor" (w13's B out dim, w2's A
in dim), so the w2 LoRA is a partial sum that joins the base partial sum before the one
all-reduce. Fully sharded (S-LoRA): w13's A is split on rank (all-gather of the `(T*k, R)`
shrink), w2's B on hidden (all-reduce of the `(T*k, R)` shrink; each shard adds its hidden
columns, and the final all-reduce assembles them) — as in vLLM's `fused_moe_lora`.

The per-shard LoRA math (grouped fast path, "ops" / "ragged" `lora_impl`) is in
`lora_jax.layers.moe_hook`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.config import LoRAConfig
from lora_jax.layers.base import (
    BaseLayerWithLoRA,
    LoRAContext,
    LoRASlotRanks,
    PreparedLoRA,
    check_finite,
    check_host_write,
    check_mapping_slots,
    host_f32,
    put_like,
)
from lora_jax.layers.moe_hook import _MoELoRAHook as _MoELoRAHook
from lora_jax.layers.moe_hook import _ragged_expand as _ragged_expand
from lora_jax.layers.moe_hook import _ragged_shrink as _ragged_shrink
from lora_jax.linear import unpack_shards
from lora_jax.mapping import make_lora_mapping as make_lora_mapping  # its examples use it
from lora_jax.moe import FusedMoE

LORA_IMPLS = ("ops", "ragged")


class FusedMoEWithLoRA(BaseLayerWithLoRA):
    """Per-(token, expert) LoRA on a `FusedMoE`: w1/w3 (gated) or w1, and w2.

    `set_lora(index, [w1_a, w2_a, w3_a], [w1_b, w2_b, w3_b])` with `w1_a/w3_a [E, r, hidden]`,
    `w2_a [E, r, inter]`, `w1_b/w3_b [E, inter, r]`, `w2_b [E, hidden, r]` (vLLM's order;
    w3 is omitted or None for non-gated experts; None = the adapter lacks that module).

    Example:
        >>> base = FusedMoE(8, 2, 64, 32, rngs=nnx.Rngs(0))  # 8 experts, top 2
        >>> layer = FusedMoEWithLoRA(base, LoRAConfig(max_loras=4, max_lora_rank=8))
        >>> a13, a2 = np.ones((8, 4, 64)), np.ones((8, 4, 32))  # [E, r, in]
        >>> b13, b2 = np.ones((8, 32, 4)), np.ones((8, 64, 4))  # [E, out, r]
        >>> layer.set_lora(0, [a13, a2, a13], [b13, b2, b13])  # w1, w2, w3
        >>> layer.lora_context.set_value(make_lora_mapping(jnp.array([0, -1, 0]), 4))
        >>> layer(jnp.ones((3, 64)), jnp.zeros((3, 8))).shape
        (3, 64)
    """

    fused_w13: bool = False  # FusedMoE3DWithLoRA: one A/B over the fused gate|up

    def __init__(
        self,
        base_layer: FusedMoE,
        lora_config: LoRAConfig,
        context: LoRAContext | None = None,
        *,
        name: str | None = None,
        lora_impl: str = "ops",
        ops_backend: str | None = None,
    ):
        self.name = name or type(self).__name__
        if not isinstance(base_layer, FusedMoE):
            raise ValueError(f"{self.name}: base layer must be FusedMoE, got {type(base_layer)}")
        if lora_impl not in LORA_IMPLS:
            raise ValueError(
                f"{self.name}: lora_impl must be one of {LORA_IMPLS}, got {lora_impl!r}"
            )
        self.base_layer = base_layer
        self.lora_config = lora_config
        self.lora_context = context if context is not None else LoRAContext(None)
        self.lora_impl, self.ops_backend = lora_impl, ops_backend
        base, rules, cfg = base_layer, base_layer.rules, lora_config
        L, R, E = cfg.max_loras, cfg.max_lora_rank, base.num_experts
        H, n = base.hidden_size, base.intermediate_size
        tp = base.tp
        self.fully_sharded = cfg.fully_sharded_loras
        rules.check_lora_axes(self.name, self.fully_sharded)
        if self.fully_sharded and (R % tp or H % tp):
            raise ValueError(
                f"{self.name}: fully_sharded_loras needs max_lora_rank={R} and hidden_size={H} "
                f"divisible by the tensor axis ({tp})"
            )
        dtype = cfg.dtype_for(base.param_dtype)
        self.lora_dtype = dtype
        a13, b13, a2, b2 = self.lora_axes()
        zeros = lambda shape, axes: nnx.LoRAParam(rules.place(jnp.zeros(shape, dtype), *axes))  # noqa: E731
        self.w13_lora_a = nnx.List([zeros((L, E, R, H), a13) for _ in self.w13_widths])
        self.w13_lora_b = nnx.List([zeros((L, E, w, R), b13) for w in self.w13_widths])
        self.w2_lora_a = zeros((L, E, R, n), a2)  # [L, E, R, inter]
        self.w2_lora_b = zeros((L, E, H, R), b2)  # [L, E, hidden, R]
        # True rank per (projection, slot): w13 slices first, then w2. 0 = empty.
        ranks = jnp.zeros((len(self.w13_widths) + 1, L), jnp.int32)
        self.slot_ranks = LoRASlotRanks(rules.place(ranks, None, None))

    # -- structure ------------------------------------------------------------------------
    @property
    def w13_widths(self) -> tuple[int, ...]:
        """Logical out width of each w13 slice."""
        base = self.base_layer
        if self.fused_w13 or not base.is_act_and_mul:
            return (base.w13_width,)
        return (base.intermediate_size, base.intermediate_size)

    @property
    def projections(self) -> tuple[str, ...]:
        """The modules `set_lora` takes, in order."""
        if self.fused_w13:
            return ("w13", "w2")
        return ("w1", "w2", "w3") if self.base_layer.is_act_and_mul else ("w1", "w2")

    def lora_axes(self) -> tuple[tuple, tuple, tuple, tuple]:
        """Logical axes of w13 A, w13 B, w2 A, w2 B."""
        fs = self.fully_sharded
        return (
            ("lora_slot", "expert", "lora_rank_sharded" if fs else "lora_rank", None),
            ("lora_slot", "expert", "tensor", "lora_rank"),
            ("lora_slot", "expert", "lora_rank", "tensor"),
            ("lora_slot", "expert", "tensor" if fs else None, "lora_rank"),
        )

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ) -> bool:
        """vLLM: separate w1/w2/w3 modules → this class; one fused w13 → the 3D class."""
        n = 1 if cls.fused_w13 else 2
        return isinstance(source_layer, FusedMoE) and len(packed_modules_list) == n

    # -- slot writes ----------------------------------------------------------------------
    def _pair(self, proj: str, a, b, in_size: int, out_size: int):
        """Validates one projection's `A [E, r, in]`, `B [E, out, r]`; pads to max rank."""
        E, R = self.base_layer.num_experts, self.lora_config.max_lora_rank
        if (a is None) != (b is None):
            raise ValueError(f"{self.name}.set_lora: {proj} has only one of lora_a and lora_b")
        if a is None:
            return np.zeros((E, R, in_size), np.float32), np.zeros((E, out_size, R), np.float32), 0
        a, b = host_f32(self.name, f"{proj} lora_a", a), host_f32(self.name, f"{proj} lora_b", b)
        if a.ndim != 3 or b.ndim != 3 or a.shape[0] != E or b.shape[0] != E:
            raise ValueError(
                f"{self.name}.set_lora: {proj} lora_a/lora_b must be [num_experts={E}, ., .], "
                f"got {a.shape} and {b.shape}"
            )
        r = a.shape[1]
        if not 1 <= r <= R:
            raise ValueError(
                f"{self.name}.set_lora: {proj} rank {r} is outside [1, max_lora_rank={R}]"
            )
        if a.shape[2] != in_size:
            raise ValueError(
                f"{self.name}.set_lora: {proj} lora_a must be [{E}, r, {in_size}], got {a.shape}"
            )
        if b.shape != (E, out_size, r):
            raise ValueError(
                f"{self.name}.set_lora: {proj} lora_b must be [{E}, {out_size}, {r}], got {b.shape}"
            )
        pad = ((0, 0), (0, R - r), (0, 0))
        return np.pad(a, pad), np.pad(b, ((0, 0), (0, 0), (0, R - r))), r

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        """Writes an adapter into slot `index` (scaling folded into B); see the class doc.

        Every check runs before any write: on error no slot changes.

        Example:
            >>> layer.set_lora(1, [w1_a, w2_a, w3_a], [w1_b, w2_b, w3_b])  # doctest: +SKIP
        """
        self.write_lora(index, self.prepare_lora(index, lora_a, lora_b))

    def prepare_lora(self, index: int, lora_a, lora_b) -> PreparedLoRA:
        """Validates an adapter (lists over `projections`) and lays it out as stored.

        Host-side only; `a`/`b` hold the w13 slices then w2, `[E, R, in]` / `[E, out, R]`.

        Example:
            >>> prepared = layer.prepare_lora(0, [a13, a2], [b13, b2])  # doctest: +SKIP
        """
        self._check_index(index, "set_lora")
        names = self.projections
        a_list = list(lora_a) if isinstance(lora_a, (list, tuple)) else None
        b_list = list(lora_b) if isinstance(lora_b, (list, tuple)) else None
        if not self.base_layer.is_act_and_mul and not self.fused_w13 and a_list and b_list:
            # vLLM passes (w1, w2, w3) for non-gated experts too; w3 must then be empty.
            if len(a_list) == 3 and len(b_list) == 3 and a_list[2] is None and b_list[2] is None:
                a_list, b_list = a_list[:2], b_list[:2]
        if (
            a_list is None
            or b_list is None
            or len(a_list) != len(names)
            or len(b_list) != len(names)
        ):
            got = [None if v is None else len(v) for v in (a_list, b_list)]
            raise ValueError(
                f"{self.name}.set_lora: lora_a and lora_b must be lists over {names}, got "
                f"lengths {got}"
            )
        base = self.base_layer
        H, n = base.hidden_size, base.intermediate_size
        sizes = {"w1": (H, n), "w3": (H, n), "w13": (H, base.w13_width), "w2": (n, H)}
        checked = {p: self._pair(p, a, b, *sizes[p]) for p, a, b in zip(names, a_list, b_list)}
        order = [p for p in names if p != "w2"] + ["w2"]  # storage order: w13 slices, w2
        new_a, new_b = [], []
        for p in order:
            a, b, _ = checked[p]
            if p == "w13" and base.is_act_and_mul:
                gate, up = base.split_w13(b, axis=1)
                b = np.asarray(base.pack_w13(gate, up, axis=1))  # per-shard [gate_i | up_i]
            new_a.append(a)
            new_b.append(b)
        prepared = PreparedLoRA(
            a=tuple(new_a), b=tuple(new_b), ranks=tuple(checked[p][2] for p in order)
        )
        return check_finite(self.name, prepared, self.lora_dtype)

    def _stacks(self) -> tuple[list, list]:
        return [*self.w13_lora_a, self.w2_lora_a], [*self.w13_lora_b, self.w2_lora_b]

    def write_lora(self, index: int, prepared: PreparedLoRA) -> None:
        """Stores a `prepare_lora` result into slot `index` (no further checks)."""
        self._check_index(index, "write_lora")
        check_host_write(self.name, "set_lora", self.slot_ranks)
        for var, value in zip((*self._stacks()[0], *self._stacks()[1]), (*prepared.a, *prepared.b)):
            self._write(var, index, value)
        self._set_ranks(index, prepared.ranks)

    def slot_updates(self, prepared: PreparedLoRA | None):
        """`(variable, slot axis, new slot content | None = zeros)` for batched writers."""
        a_vars, b_vars = self._stacks()
        if prepared is None:
            return [(v, 0, None) for v in (*a_vars, *b_vars)] + [(self.slot_ranks, 1, None)]
        ups = [(v, 0, x) for v, x in zip((*a_vars, *b_vars), (*prepared.a, *prepared.b))]
        return ups + [(self.slot_ranks, 1, np.asarray(prepared.ranks, np.int32))]

    def _set_ranks(self, index: int, ranks) -> None:
        # Host-side edit put back with the old sharding: after a jitted step the
        # variable may live on the mesh, where mixing in a 1-device array fails.
        old = self.slot_ranks[...]
        new = np.array(old)
        new[:, int(index)] = ranks
        self.slot_ranks.set_value(put_like(new, old))

    def read_lora(self, index: int) -> tuple[list, list] | None:
        """Slot `index` as `set_lora` takes it (lists over `projections`, `A [E, r, in]`,
        `B [E, out, r]` at the slot's rank, w13's B in the base's gate/up layout, None for
        an empty projection), host f32; None for an empty slot. The inverse of `set_lora`.

        Example:
            >>> a_list, b_list = layer.read_lora(0)  # doctest: +SKIP
        """
        self._check_index(index, "read_lora")
        ranks = np.asarray(self.slot_ranks[...])[:, int(index)]  # storage order
        if not ranks.any():
            return None
        a_vars, b_vars = self._stacks()
        stored = {}
        order = [p for p in self.projections if p != "w2"] + ["w2"]  # storage order
        for p, r, a_var, b_var in zip(order, ranks, a_vars, b_vars):
            a = np.asarray(a_var[...][int(index)], np.float32)[:, :r]  # [E, r, in]
            b = np.asarray(b_var[...][int(index)], np.float32)[..., :r]  # [E, out, r]
            base = self.base_layer
            if p == "w13" and base.is_act_and_mul and base.gate_up_layout != "interleaved":
                n = base.intermediate_size  # per-shard [gate_i | up_i] → [gate; up]
                b = np.concatenate(unpack_shards(b, [n, n], 1, base.tp), axis=1)
            stored[p] = (a, b) if r else (None, None)
        return [stored[p][0] for p in self.projections], [stored[p][1] for p in self.projections]

    def reset_lora(self, index: int) -> None:
        """Zeroes slot `index`: it then gives exactly the base output."""
        self._check_index(index, "reset_lora")
        check_host_write(self.name, "reset_lora", self.slot_ranks)
        a_vars, b_vars = self._stacks()
        for var in (*a_vars, *b_vars):
            self._write(var, index, np.zeros(var.shape[1:], np.float32))
        self._set_ranks(index, 0)

    # -- forward --------------------------------------------------------------------------
    def __call__(self, hidden_states: jax.Array, router_logits: jax.Array) -> jax.Array:
        base = self.base_layer
        mapping = self.lora_context.get_value()
        if mapping is None:
            return base(hidden_states, router_logits)
        x = base.check_input(hidden_states)
        if mapping.num_tokens != x.shape[0]:
            raise ValueError(
                f"{self.name}: the LoRA mapping has {mapping.num_tokens} tokens but the input "
                f"has {x.shape[0]}"
            )
        check_mapping_slots(self.name, mapping, self.lora_config.max_loras)
        base.check_router_logits(router_logits, x.shape[0])
        a13, b13, a2, b2 = self.lora_axes()
        stacks = (
            tuple(v[...] for v in self.w13_lora_a),
            tuple(v[...] for v in self.w13_lora_b),
            self.w2_lora_a[...],
            self.w2_lora_b[...],
        )
        specs = ((a13,) * len(stacks[0]), (b13,) * len(stacks[1]), a2, b2)
        extra = (stacks, self.slot_ranks[...], mapping.token_lora_indices)
        extra_specs = (specs, (None, None), (base.batch_axis(x.shape[0]),))
        make = lambda st, ranks, idx: _MoELoRAHook(  # noqa: E731
            self, st, ranks, idx, is_prefill=mapping.is_prefill
        )
        y = base.run(x, router_logits, make, extra, extra_specs)
        return y.reshape(hidden_states.shape)


class FusedMoE3DWithLoRA(FusedMoEWithLoRA):
    """One LoRA over the fused w13 (gate and up together), B in the base's gate/up layout.

    `set_lora(index, [w13_a [E, r, hidden], w2_a [E, r, inter]],
    [w13_b [E, 2*inter, r], w2_b [E, hidden, r]])`; `w13_b` is concatenated `[gate; up]`
    or interleaved (GPT-OSS) exactly like the base layer's `gate_up_layout`.

    Example:
        >>> layer = FusedMoE3DWithLoRA(base, LoRAConfig(max_loras=2))  # doctest: +SKIP
        >>> layer.set_lora(0, [a13, a2], [b13, b2])  # doctest: +SKIP
    """

    fused_w13 = True
