"""Token sampling: greedy, temperature and nucleus (top-p), with per-row PRNG keys.

Every row draws from its own key, `fold_in(fold_in(key(seed), request_index), step)`, so a
request's samples depend on the seed, its index and the step only — not on which other
requests share the batch or how the batch was padded. Temperature and top-p are traced
scalars (changing them never recompiles); only the `mode` ("greedy", "sample", "top_p")
is static.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from lora_jax.sharding import unshard

SAMPLING_MODES = ("greedy", "sample", "top_p")
# Temperatures below this sample as greedy (vLLM's `_SAMPLING_EPS`): dividing logits by
# them overflows f32, and the distribution is the argmax's to within rounding anyway.
SAMPLING_EPS = 1e-5


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How the next token is chosen.

    Example:
        >>> SamplingParams(temperature=0.7, top_p=0.9, seed=3).mode
        'top_p'
        >>> SamplingParams().mode
        'greedy'
    """

    temperature: float = 0.0
    """0 (or below `SAMPLING_EPS`) = greedy (argmax); above, divides the logits before
    sampling."""
    top_p: float = 1.0
    """Nucleus: sample from the smallest set of tokens whose probability is >= top_p."""
    seed: int = 0
    """PRNG seed; the same seed, prompts and params give the same tokens."""

    def __post_init__(self):
        t, p, seed = self.temperature, self.top_p, self.seed
        # Checked as the float that is stored: an int past float's range (10**400) raised a
        # bare OverflowError, and a Fraction that rounds to 0.0 passed the top_p check.
        tf, pf = _as_float(t), _as_float(p)
        if tf is None or not 0 <= tf < float("inf"):
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {t!r}")
        if pf is None or not 0 < pf <= 1:
            raise ValueError(f"SamplingParams.top_p must be a number in (0, 1], got {p!r}")
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool | np.bool_):
            raise ValueError(f"SamplingParams.seed must be an int, got {seed!r}")
        # numpy scalars (from config code) stored as plain Python numbers
        object.__setattr__(self, "temperature", tf)
        object.__setattr__(self, "top_p", pf)
        object.__setattr__(self, "seed", int(seed))

    @property
    def mode(self) -> str:
        """The static sampling branch: "greedy", "sample" or "top_p"."""
        if self.temperature < SAMPLING_EPS:
            return "greedy"
        return "top_p" if self.top_p < 1 else "sample"


def _as_float(v) -> float | None:
    """`v` as a float, or None when it is not a real number (bools are not) or overflows."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool | np.bool_):
        return None
    try:
        return float(v)
    except OverflowError:
        return None


def seed_key(seed: int) -> jax.Array:
    """The PRNG key of any int seed, distinct seeds distinct keys: `key(seed)` for a seed
    in `[0, 2**32)`; past that (or below 0) the low 32 bits' key with the higher 32-bit
    words and the sign folded in (`jax.random.key` alone keeps 32 bits, so -1 and
    2**32 - 1 were one stream).

    Example:
        >>> data = lambda s: jax.random.key_data(seed_key(s)).tolist()
        >>> data(-1) != data(2**32 - 1), data(5) == data(5)
        (True, True)
    """
    seed = int(seed)
    key = jax.random.key(seed & 0xFFFFFFFF)
    rest = seed >> 32
    if rest == 0:
        return key
    while rest not in (0, -1):
        key = jax.random.fold_in(key, rest & 0xFFFFFFFF)
        rest >>= 32
    return jax.random.fold_in(key, 1 if rest < 0 else 2)  # the sign: no collisions across it


def row_keys(seed_key: jax.Array, row_ids: jax.Array, step: jax.Array) -> jax.Array:
    """One key per row: `fold_in(fold_in(seed_key, row_id), step)`; `row_ids i32[B]`."""
    per_row = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(seed_key, row_ids)
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(per_row, step)


def top_p_filter(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Sets logits outside each row's nucleus to -inf; `logits f32[B, V]`.

    The nucleus is the smallest prefix of the tokens sorted by probability whose mass
    reaches `top_p` (the most likely token is always kept; ties at the edge are kept).

    Example:
        >>> top_p_filter(jnp.log(jnp.array([[0.5, 0.3, 0.2]])), 0.7)[0, 2]
        Array(-inf, dtype=float32)
    """
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # [B, V] descending
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p) | (top_p >= 1.0)  # f32 cumsum may reach 1 early
    # The most likely token stays even when top_p is below f32's smallest normal (XLA
    # flushes it to 0 and nothing is `< 0`): an empty nucleus sampled token 0.
    keep = keep.at[:, 0].set(True)
    # The smallest kept logit of each row is its threshold.
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    *,
    mode: str,
) -> jax.Array:
    """Next tokens `i32[B]` from `logits f32[B, V]` and per-row `keys [B]`.

    Example:
        >>> keys = row_keys(jax.random.key(0), jnp.arange(2), 0)
        >>> sample_tokens(jnp.eye(2, 4), keys, 0.0, 1.0, mode="greedy").tolist()
        [0, 1]
    """
    if mode not in SAMPLING_MODES:
        raise ValueError(f"sampling mode must be one of {SAMPLING_MODES}, got {mode!r}")
    logits = logits.astype(jnp.float32)
    if mode == "greedy":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # The row's largest logit becomes 0 before the division (no overflow to +inf), and
    # the divisor is at least SAMPLING_EPS (a denormal may be flushed to 0).
    top = jnp.max(logits, axis=-1, keepdims=True)
    t = jnp.maximum(jnp.asarray(temperature, jnp.float32), SAMPLING_EPS)
    scaled = (logits - top) / t
    if mode == "top_p":
        scaled = top_p_filter(scaled, jnp.asarray(top_p, jnp.float32))
    draw = jax.vmap(lambda k, row: jax.random.categorical(k, row))
    # Per-row keys are replicated; batch-sharded logits (Explicit meshes) must match.
    return draw(unshard(keys), unshard(scaled)).astype(jnp.int32)
