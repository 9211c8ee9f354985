"""`FusedMoE`: vLLM's fused mixture-of-experts layer in NNX, with tensor and expert parallelism.

Routing (top-k of the router scores, vLLM's `fused_topk`) is in `lora_jax.moe_routing`. The
experts are `w13 [E, hidden, 2*inter]` (gated "act_and_mul": gate and up in one matrix, Flax
`[in, out]` per expert) or `[E, hidden, inter]` (non-gated), then `w2 [E, inter, hidden]`.
Each (token, chosen expert) pair gives `act(x @ w1) * (x @ w3) @ w2`; the routing weight
multiplies that w2 output, and the top-k outputs of a token are summed (as vLLM does in
`moe_sum`).

Gate/up layout (`gate_up_layout`): "concat" = `[gate | up]` on the out dim (vLLM, HF
Mixtral/Qwen3 once stacked); "interleaved" = gate at even and up at odd columns (GPT-OSS).
Under tensor parallelism the stored w13 holds each shard's columns together: shard i
holds `[gate_i | up_i]` (concat) or its interleaved intermediate range, i.e. vLLM's
per-rank weight. `load_weights` takes the logical (checkpoint) layout.

Parallelism (one `shard_map`, logical axes from `ShardingRules`):
* "tensor" splits the intermediate dim: w13's out columns and w2's in rows. Each shard
  computes a partial w2 output.
* "expert" splits the experts. Tokens are replicated over the expert axis and each shard
  handles *its* experts for all tokens (pairs routed elsewhere get weight 0).
* One all-reduce over (tensor, expert) sums the partial outputs; there is no all-to-all.
  This is the simplest exact scheme: it moves `T * hidden` per layer, like the TP
  all-reduce, at the price of replicated routing work; an all-to-all dispatch would move
  `T * k * hidden / ep` instead and is left for when EP spans hosts.
Tokens split over "batch" when T divides evenly.

Two implementations of the expert math (`impl`):
* "grouped": the `T * k` (token, expert) pairs are sorted by expert and both
  matmuls are `jax.lax.ragged_dot` grouped matmuls.
* "dense": a loop over the local experts that runs every expert on every token and
  weights the result (0 for tokens not routed there). The readable reference.
* "auto" (default): "grouped", except on GPU when experts get at least
  `DENSE_MIN_PAIRS_PER_EXPERT` pairs on average: XLA's GPU `ragged_dot` was slower than
  running every expert densely at prefill on an H200 (benchmarks/RESULTS.md, "moe":
  Qwen3-30B-A3B and Mixtral at 4096 tokens), while "grouped" wins at decode.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.linear import pack_shards
from lora_jax.moe_routing import ACTIVATIONS as ACTIVATIONS
from lora_jax.moe_routing import SCORING_FUNCS as SCORING_FUNCS
from lora_jax.moe_routing import ExpertRoutes as ExpertRoutes
from lora_jax.moe_routing import activation_fn as activation_fn
from lora_jax.moe_routing import make_routes as make_routes
from lora_jax.moe_routing import select_experts as select_experts
from lora_jax.sharding import ShardingRules, shard_map

GATE_UP_LAYOUTS = ("concat", "interleaved")
IMPLS = ("auto", "grouped", "dense")
# "auto" runs every expert densely on GPU from this many (token, expert) pairs per expert.
DENSE_MIN_PAIRS_PER_EXPERT = 128

# Fan-in per expert: [E, in, out] with the expert dim as a batch dim.
default_expert_init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=0)

_W13_AXES = ("expert", None, "tensor")  # [E, hidden, w13 out]
_W2_AXES = ("expert", "tensor", None)  # [E, inter, hidden]


class FusedMoE(nnx.Module):
    """Routed experts with vLLM's semantics; call with `(hidden_states, router_logits)`.

    Example:
        >>> moe = FusedMoE(8, 2, 16, 32, rngs=nnx.Rngs(0))
        >>> moe(jnp.ones((4, 16)), jnp.zeros((4, 8))).shape
        (4, 16)
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool = True,
        scoring_func: str = "softmax",
        activation: str = "silu",
        is_act_and_mul: bool = True,
        gate_up_layout: str = "concat",
        impl: str = "auto",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rules: ShardingRules | None = None,
        kernel_init=default_expert_init,
        rngs: nnx.Rngs,
    ):
        name = type(self).__name__
        self.num_experts, self.top_k = int(num_experts), int(top_k)
        self.hidden_size, self.intermediate_size = int(hidden_size), int(intermediate_size)
        self.renormalize, self.scoring_func = renormalize, scoring_func
        self.activation, self.is_act_and_mul = activation, is_act_and_mul
        self.gate_up_layout, self.impl = gate_up_layout, impl
        self.dtype, self.param_dtype = dtype, param_dtype
        self.rules = rules if rules is not None else ShardingRules()
        activation_fn(activation)
        for what, value, allowed in (
            ("scoring_func", scoring_func, SCORING_FUNCS),
            ("gate_up_layout", gate_up_layout, GATE_UP_LAYOUTS),
            ("impl", impl, IMPLS),
        ):
            if value not in allowed:
                raise ValueError(f"{name}: {what} must be one of {allowed}, got {value!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"{name}: top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.tp = self.rules.size("tensor")
        self.ep = self.rules.size("expert")
        expert_axis = self.rules.mesh_axis("expert")
        if expert_axis is not None and expert_axis == self.rules.mesh_axis("tensor"):
            raise ValueError(
                f"{name}: the logical axes 'expert' and 'tensor' both map to mesh axis "
                f"{expert_axis!r}; experts and the intermediate dim need axes of their own"
            )
        if self.intermediate_size % self.tp:
            raise ValueError(
                f"{name}: intermediate_size={intermediate_size} not divisible by the tensor "
                f"axis ({self.tp})"
            )
        if self.num_experts % self.ep:
            raise ValueError(
                f"{name}: num_experts={num_experts} not divisible by the expert axis ({self.ep})"
            )
        self.local_num_experts = self.num_experts // self.ep
        self.intermediate_size_per_partition = self.intermediate_size // self.tp
        E, H, n = self.num_experts, self.hidden_size, self.intermediate_size
        k13, k2 = jax.random.split(rngs.params())
        w13 = kernel_init(k13, (E, H, self.w13_width), param_dtype)  # [E, H, w13 out]
        if self.is_act_and_mul and self.gate_up_layout != "interleaved":
            # drawn as the logical [gate | up], then packed per shard: the same model at
            # every tp (the interleaved layout does not depend on tp)
            w13 = self.pack_w13(w13[..., :n], w13[..., n:])
        w2 = kernel_init(k2, (E, n, H), param_dtype)  # [E, I, H]
        self.w13 = nnx.Param(self.rules.place(w13, *_W13_AXES))
        self.w2 = nnx.Param(self.rules.place(w2, *_W2_AXES))

    # -- layout ---------------------------------------------------------------------------
    @property
    def w13_width(self) -> int:
        """Out width of w13: 2 * inter when gated, inter otherwise."""
        return self.intermediate_size * (2 if self.is_act_and_mul else 1)

    def pack_w13(self, gate: np.ndarray, up: np.ndarray | None, axis: int = -1) -> jax.Array:
        """Logical gate and up (`[..., inter]` on `axis`) → the stored per-shard layout."""
        if up is None:
            return jnp.asarray(gate)
        if self.gate_up_layout == "interleaved":
            both = jnp.stack([jnp.asarray(gate), jnp.asarray(up)], axis=(axis % gate.ndim) + 1)
            shape = list(gate.shape)
            shape[axis] *= 2
            return both.reshape(shape)
        return pack_shards([jnp.asarray(gate), jnp.asarray(up)], axis, self.tp)

    def split_w13(self, w13: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
        """A logical w13 (checkpoint layout) → (gate, up) along `axis`."""
        w13 = np.asarray(w13)
        axis = axis % w13.ndim
        if self.gate_up_layout == "interleaved":
            idx = np.arange(w13.shape[axis])
            return np.take(w13, idx[0::2], axis=axis), np.take(w13, idx[1::2], axis=axis)
        return tuple(np.split(w13, 2, axis=axis))

    def load_weights(self, *, w13=None, w1=None, w3=None, w2=None) -> None:
        """Sets the experts from logical arrays (Flax `[in, out]` per expert).

        Gated: `w13 [E, H, 2I]` in `gate_up_layout`, or `w1` (gate) and `w3` (up)
        `[E, H, I]`. Non-gated: `w1` or `w13` `[E, H, I]`. `w2 [E, I, H]`.

        Example:
            >>> moe.load_weights(w1=gate_ehi, w3=up_ehi, w2=down_eih)  # doctest: +SKIP
        """
        name = type(self).__name__
        E, H, n = self.num_experts, self.hidden_size, self.intermediate_size
        if w13 is not None and (w1 is not None or w3 is not None):
            raise ValueError(f"{name}.load_weights: pass w13 or w1/w3, not both")
        if w13 is not None:
            w13 = np.asarray(w13)
            if w13.shape != (E, H, self.w13_width):
                raise ValueError(
                    f"{name}.load_weights: w13 must be {(E, H, self.w13_width)}, got {w13.shape}"
                )
            gate, up = self.split_w13(w13) if self.is_act_and_mul else (w13, None)
        elif w1 is not None:
            gate, up = np.asarray(w1), None if w3 is None else np.asarray(w3)
            if (up is None) == self.is_act_and_mul:
                need = "gated experts need w1 and w3" if up is None else "non-gated: no w3"
                raise ValueError(f"{name}.load_weights: {need}")
            for label, w in (("w1", gate), ("w3", up)):
                if w is not None and w.shape != (E, H, n):
                    raise ValueError(
                        f"{name}.load_weights: {label} must be {(E, H, n)}, got {w.shape}"
                    )
        else:
            gate = up = None
        if w2 is not None and np.shape(w2) != (E, n, H):
            raise ValueError(f"{name}.load_weights: w2 must be {(E, n, H)}, got {np.shape(w2)}")
        if gate is not None:
            packed = self.pack_w13(
                gate.astype(np.float32), None if up is None else up.astype(np.float32)
            )
            self.w13.set_value(self.rules.place(packed.astype(self.param_dtype), *_W13_AXES))
        if w2 is not None:
            self.w2.set_value(self.rules.place(jnp.asarray(w2, self.param_dtype), *_W2_AXES))

    # -- forward --------------------------------------------------------------------------
    def check_router_logits(self, router_logits: jax.Array, num_tokens: int) -> None:
        """`router_logits` must be `[..., num_experts]` with one row per token."""
        if router_logits.shape[-1] != self.num_experts:
            raise ValueError(
                f"{type(self).__name__}: router_logits last dim {router_logits.shape[-1]} != "
                f"num_experts {self.num_experts}"
            )
        if router_logits.size // self.num_experts != num_tokens:
            raise ValueError(
                f"{type(self).__name__}: router_logits has {router_logits.size // self.num_experts}"
                f" rows but the input has {num_tokens} tokens"
            )

    def select_experts(self, router_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        if router_logits.shape[-1] != self.num_experts:
            raise ValueError(
                f"{type(self).__name__}: router_logits last dim {router_logits.shape[-1]} != "
                f"num_experts {self.num_experts}"
            )
        return select_experts(
            router_logits.reshape(-1, self.num_experts),
            self.top_k,
            renormalize=self.renormalize,
            scoring_func=self.scoring_func,
        )

    def tp_axis_name(self) -> str | None:
        return self.rules.mesh_axis("tensor")

    def batch_axis(self, num_tokens: int) -> str | None:
        """ "batch" when the tokens split evenly over it, else None (replicated). Tokens
        stay replicated over the expert axis: where "batch" maps to that mesh axis too,
        they are not split (each shard's experts need every token)."""
        batch = self.rules.mesh_axis("batch")
        if batch is not None and batch in (self.rules.mesh_axis("expert"), self.tp_axis_name()):
            return None  # the tensor axis splits intermediate dims: its shards need all tokens
        return "batch" if num_tokens % self.rules.size("batch") == 0 else None

    def gate_up(self, g: jax.Array) -> jax.Array:
        """Per shard: w13 output `[P, w13_local]` → activation output `[P, I_local]`."""
        act = activation_fn(self.activation)
        dtype = g.dtype
        g = g.astype(jnp.float32)
        if not self.is_act_and_mul:
            return act(g).astype(dtype)
        if self.gate_up_layout == "interleaved":
            gate, up = g[:, 0::2], g[:, 1::2]
        else:
            gate, up = jnp.split(g, 2, axis=-1)
        return (act(gate) * up).astype(dtype)

    def resolve_impl(self, num_tokens: int) -> str:
        """The expert-math implementation used for `num_tokens` tokens (see `impl`)."""
        if self.impl != "auto":
            return self.impl
        pairs_per_expert = num_tokens * self.top_k / self.num_experts
        on_gpu = jax.default_backend() == "gpu"
        return "dense" if on_gpu and pairs_per_expert >= DENSE_MIN_PAIRS_PER_EXPERT else "grouped"

    def experts_local(self, x, topk_weights, topk_ids, w13, w2, lora=None) -> jax.Array:
        """Per shard: the partial (over tensor/expert shards) MoE output, f32 `[T, H]`.

        `lora`, when given, is a hook with `rows(routes=|expert=)`, `w13(g, x, rows)` and
        `w2(o, a, rows)` (see `lora_jax.layers.moe_hook`); it edits the two matmul outputs.
        """
        dtype = self.dtype or x.dtype
        x = x.astype(dtype)
        w13, w2 = w13.astype(dtype), w2.astype(dtype)
        num_local = w13.shape[0]
        axis = self.rules.mesh_axis("expert")
        first = 0 if axis is None else jax.lax.axis_index(axis) * num_local
        if self.resolve_impl(x.shape[0]) == "grouped":
            routes = make_routes(topk_weights, topk_ids, first, num_local)
            rows = None if lora is None else lora.rows(routes=routes)
            xs = x[routes.pair_token]  # [P, H]
            g = jax.lax.ragged_dot(xs, w13, routes.group_sizes, preferred_element_type=dtype)
            if lora is not None:
                g = lora.w13(g, xs, rows)
            a = self.gate_up(g)  # [P, I_local]
            o = jax.lax.ragged_dot(a, w2, routes.group_sizes, preferred_element_type=dtype)
            if lora is not None:
                o = lora.w2(o, a, rows)
            o = o.astype(jnp.float32) * routes.pair_weight[:, None]  # [P, H]
            return jnp.zeros((x.shape[0], o.shape[1]), jnp.float32).at[routes.pair_token].add(o)

        def body(e, y):
            g = jnp.dot(x, w13[e], preferred_element_type=dtype)  # [T, w13_local]
            rows = None if lora is None else lora.rows(expert=e)
            if lora is not None:
                g = lora.w13(g, x, rows)
            a = self.gate_up(g)
            o = jnp.dot(a, w2[e], preferred_element_type=dtype)  # [T, H]
            if lora is not None:
                o = lora.w2(o, a, rows)
            cw = jnp.sum(jnp.where(topk_ids == first + e, topk_weights, 0.0), axis=1)  # [T]
            return y + o.astype(jnp.float32) * cw[:, None]

        return jax.lax.fori_loop(
            0, num_local, body, jnp.zeros((x.shape[0], w2.shape[2]), jnp.float32)
        )

    def reduce(self, y: jax.Array, dtype) -> jax.Array:
        """The one all-reduce over the tensor and expert axes, in the output dtype."""
        y = y.astype(dtype)
        axes = tuple(
            a
            for name in ("tensor", "expert")
            if (a := self.rules.mesh_axis(name)) is not None and self.rules.size(name) > 1
        )
        return jax.lax.psum(y, axes) if axes else y

    def run(self, x, router_logits, make_lora=None, extra_args=(), extra_specs=()):
        """Routes and runs the experts per shard: each shard picks the experts of its own
        tokens (no gather of the router logits over "batch"). `make_lora(*extra_local)`
        builds the LoRA hook."""
        dtype = self.dtype or x.dtype
        logits = router_logits.reshape(-1, self.num_experts)

        def local(xl, ll, w13, w2, *extra):
            wl, il = self.select_experts(ll)
            lora = None if make_lora is None else make_lora(*extra)
            return self.reduce(self.experts_local(xl, wl, il, w13, w2, lora), dtype)

        args = (x, logits, self.w13[...], self.w2[...], *extra_args)
        if self.rules.mesh is None:
            return local(*args)
        b = self.batch_axis(x.shape[0])
        specs = ((b, None), (b, None), _W13_AXES, _W2_AXES, *extra_specs)
        return shard_map(self.rules, local, specs, (b, None))(*args)

    def check_input(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"{type(self).__name__}: input last dim {x.shape[-1]} != hidden_size "
                f"{self.hidden_size}"
            )
        return x.reshape(-1, self.hidden_size)

    def __call__(self, hidden_states: jax.Array, router_logits: jax.Array) -> jax.Array:
        x = self.check_input(hidden_states)
        self.check_router_logits(router_logits, x.shape[0])
        return self.run(x, router_logits).reshape(hidden_states.shape)
