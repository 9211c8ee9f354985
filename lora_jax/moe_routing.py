"""MoE routing: vLLM's top-k expert selection, the expert activations, and the (token, expert)
pairs sorted by expert that `FusedMoE`'s grouped implementation runs on.

Routing (vLLM's `fused_topk`): scores = softmax (or sigmoid) of the router logits in f32,
the top-k experts per token, renormalised to sum to 1 when `renormalize`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu2")
SCORING_FUNCS = ("softmax", "sigmoid")


def select_experts(
    router_logits: jax.Array,
    top_k: int,
    *,
    renormalize: bool = True,
    scoring_func: str = "softmax",
) -> tuple[jax.Array, jax.Array]:
    """vLLM's `fused_topk`: `(topk_weights f32 [T, k], topk_ids i32 [T, k])`.

    Softmax-then-top-k followed by renormalisation equals a softmax over the top-k logits
    (Mixtral, Qwen3-MoE with `norm_topk_prob`).

    Example:
        >>> w, ids = select_experts(jnp.array([[0.0, 2.0, 1.0]]), 2)
        >>> ids.tolist(), round(float(w.sum()), 5)
        ([[1, 2]], 1.0)
    """
    logits = router_logits.astype(jnp.float32)
    if scoring_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif scoring_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    weights, ids = jax.lax.top_k(scores, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def activation_fn(name: str) -> Callable[[jax.Array], jax.Array]:
    """The expert activation by vLLM name (computed in f32 by the callers)."""
    if name == "silu":
        return jax.nn.silu
    if name == "gelu":
        return lambda v: jax.nn.gelu(v, approximate=False)
    if name == "gelu_tanh":
        return lambda v: jax.nn.gelu(v, approximate=True)
    if name == "relu2":
        return lambda v: jnp.square(jax.nn.relu(v))
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertRoutes:
    """One shard's (token, expert) pairs, sorted by local expert (the grouped layout).

    Pairs routed to another shard's experts sort last and carry weight 0.
    """

    pair_token: jax.Array  # i32[P]  token of each sorted pair (P = T * k)
    pair_expert: jax.Array  # i32[P]  local expert, E_local for pairs of other shards
    pair_weight: jax.Array  # f32[P]  routing weight, 0 for pairs of other shards
    group_sizes: jax.Array  # i32[E_local]  pairs per local expert

    @property
    def local(self) -> jax.Array:
        """bool[P]: the pair's expert lives on this shard."""
        return self.pair_expert < self.group_sizes.shape[0]


def make_routes(
    topk_weights: jax.Array, topk_ids: jax.Array, first_expert: jax.Array | int, num_local: int
) -> ExpertRoutes:
    """Sorts the `[T, k]` pairs by local expert `topk_ids - first_expert` (stable)."""
    t, k = topk_ids.shape
    local = topk_ids.reshape(-1) - first_expert  # [P]
    on_shard = (local >= 0) & (local < num_local)
    key = jnp.where(on_shard, local, num_local).astype(jnp.int32)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((num_local + 1,), jnp.int32).at[key].add(1)[:num_local]
    weight = jnp.where(on_shard, topk_weights.reshape(-1).astype(jnp.float32), 0.0)
    return ExpertRoutes(
        pair_token=(order // k).astype(jnp.int32),
        pair_expert=key[order],
        pair_weight=weight[order],
        group_sizes=sizes,
    )
