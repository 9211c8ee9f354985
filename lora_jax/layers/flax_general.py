"""Multi-LoRA around `flax.nnx.LinearGeneral` and `flax.nnx.Einsum`, so that `wrap_model`
takes Flax's own attention (`nnx.MultiHeadAttention` projects with `LinearGeneral`) and
einsum-style models.

Both layers contract some axes of x with some axes of a kernel. Seen as a linear map, the
contracted axes flatten to `in = prod(contracted sizes)` and the kernel's other axes to
`out = prod(feature sizes)`, each in the kernel's axis order; x's remaining axes are the
tokens. The LoRA is the flat one: `A [r, in]`, `B [out, r]`, the layout of an `nn.Linear`
whose weight is the kernel flattened that way (`LinearGeneral(E, (H, D))`'s kernel
`[E, H, D]` is torch's `q_proj.weight [H * D, E]` transposed). The base output is the
source layer's own forward (dtype promotion, precision, bias, `out_sharding`); the LoRA
delta is computed on the flat view and added back in the output's layout.

Refused (not LoRA-able as one flat linear): `LinearGeneral` with `batch_axis`, einsum
axes shared by x, kernel and output (per-group kernels), axes summed out of x or of the
kernel alone, repeated letters, an ellipsis in the kernel, and an `nnx.Einsum` built
without its equation. Like `FlaxLinearWithLoRA`, these layers are replicated (no tensor
parallelism of their own).

The flat reading of a contraction (`Contraction`, `parse_einsum`,
`linear_general_contraction`) lives in `flax_general_contraction` and is re-exported here.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from lora_jax.config import LoRAConfig
from lora_jax.layers.base import LoRAContext
from lora_jax.layers.column import ReplicatedLinearWithLoRA
from lora_jax.layers.flax_general_contraction import Contraction as Contraction
from lora_jax.layers.flax_general_contraction import _contracted_positions as _contracted_positions
from lora_jax.layers.flax_general_contraction import _flatten as _flatten
from lora_jax.layers.flax_general_contraction import (
    linear_general_contraction as linear_general_contraction,
)
from lora_jax.layers.flax_general_contraction import parse_einsum as parse_einsum
from lora_jax.layers.flax_linear import forward_source_fields
from lora_jax.linear import ReplicatedLinear
from lora_jax.sharding import ShardingRules


def _stacked_reason(source: nnx.LinearGeneral | nnx.Einsum, label: str) -> str | None:
    """Why ``source`` is a stacked layer (`nnx.vmap` / scan over layers: a kernel with
    more axes than the layer was built for), or None."""
    kshape = tuple(source.kernel.shape)
    if isinstance(source, nnx.LinearGeneral):
        ins, outs = tuple(source.in_features), tuple(source.out_features)
        if kshape != (*tuple(source.batch_axis.values()), *ins, *outs):
            return (
                f"{label}: an nnx.LinearGeneral({ins}, {outs}) with a kernel of shape "
                f"{kshape}: stacked layers (nnx.vmap / scan over layers) are not "
                "supported; build the layers unstacked"
            )
    elif isinstance(source, nnx.Einsum) and tuple(source.kernel_shape) != kshape:
        return (
            f"{label}: an nnx.Einsum with kernel_shape {tuple(source.kernel_shape)} "
            f"but a kernel of shape {kshape}: stacked layers (nnx.vmap / scan over layers) "
            "are not supported; build the layers unstacked"
        )
    return None


class FlaxGeneralLinear(ReplicatedLinear):
    """A flat `ReplicatedLinear` view of an `nnx.LinearGeneral` or `nnx.Einsum` (kernel
    shared, not copied): `in_features` / `output_sizes` are the flattened contracted /
    feature sizes. Calling it runs the source layer.

    Example:
        >>> lg = nnx.LinearGeneral(8, (2, 4), rngs=nnx.Rngs(0))
        >>> view = FlaxGeneralLinear(lg)
        >>> view.kernel is lg.kernel, view.in_features, view.output_sizes
        (True, 8, (8,))
    """

    dora_ok = False  # the source layer adds its bias inside its own forward

    def __init__(self, source: nnx.LinearGeneral | nnx.Einsum, *, name: str | None = None):
        label = name or type(source).__name__
        if isinstance(source, (nnx.LinearGeneral, nnx.Einsum)):
            why = _stacked_reason(source, label)
            if why is not None:
                raise ValueError(why)
        kshape = tuple(source.kernel.shape)
        if isinstance(source, nnx.LinearGeneral):
            ins, outs = tuple(source.in_features), tuple(source.out_features)
            try:
                # the kernel's axes read the same for any x: probe with x axes enough for
                # every axis to be its own, the positive ones apart from the negative ones
                # (axis=(1, -2) names one axis of a 3-D x, two of a 4-D x), plus a token axis
                n = (
                    max([a + 1 for a in source.axis if a >= 0], default=0)
                    + max([-a for a in source.axis if a < 0], default=0)
                    + 1
                )
                self.contraction = linear_general_contraction(source, n)
            except ValueError as e:
                raise ValueError(f"{label}: {e}") from None
            in_flat, out_flat = math.prod(ins), math.prod(outs)
        elif isinstance(source, nnx.Einsum):
            if source.einsum_str is None:
                raise ValueError(
                    f"{label}: an nnx.Einsum built without its equation (given at call "
                    "time): the LoRA's shapes need it at construction"
                )
            try:
                self.contraction = parse_einsum(source.einsum_str, len(kshape))
            except ValueError as e:
                raise ValueError(f"{label}: {e}") from None
            c = self.contraction
            in_flat = math.prod(kshape[c.ker.index(x)] for x in c.contract)
            out_flat = math.prod(kshape[c.ker.index(x)] for x in c.feature)
        else:
            raise ValueError(
                f"FlaxGeneralLinear: expected a flax.nnx.LinearGeneral or nnx.Einsum, got "
                f"{type(source).__name__}"
            )
        self.source = source
        self.positions = _contracted_positions(self.contraction)
        self.in_features = int(in_flat)
        self.output_sizes = (int(out_flat),)
        self.physical_sizes = self.output_sizes
        self.use_bias, self.skip_bias_add, self.return_bias = False, False, False
        self.bias = None  # the source adds its own
        self.dtype = source.dtype
        self.param_dtype = source.param_dtype
        self.rules = ShardingRules()
        self.tp = self.out_tp = 1
        self.kernel = source.kernel  # the same variable: merging edits the source's kernel

    def contraction_for(self, x_ndim: int, einsum_str: str | None = None) -> Contraction:
        """The contraction of a call on an x of ``x_ndim`` axes (an `nnx.Einsum` may be
        called with its own equation: it must contract the same kernel axes)."""
        src = self.source
        if isinstance(src, nnx.LinearGeneral):
            c = linear_general_contraction(src, x_ndim)
        else:
            c = parse_einsum(einsum_str or src.einsum_str, src.kernel.ndim, x_ndim)
        if _contracted_positions(c) != self.positions:
            raise ValueError(
                f"einsum {einsum_str!r} contracts kernel axes {_contracted_positions(c)[0]} "
                f"(keeps {_contracted_positions(c)[1]}), the LoRA was built for "
                f"{self.positions[0]} (keeps {self.positions[1]})"
            )
        return c

    def kernel_delta(self, delta: jax.Array) -> jax.Array:
        """A flat `[in, out]` kernel delta in the source kernel's shape."""
        return self.contraction.kernel_delta(delta, self.kernel.shape)

    def __call__(self, x: jax.Array, *args, **kwargs) -> jax.Array:
        return self.source(x, *args, **kwargs)


class _FlaxGeneralWithLoRA(ReplicatedLinearWithLoRA):
    """Per-token multi-LoRA around an `nnx.LinearGeneral` / `nnx.Einsum` (replicated)."""

    source_type: type = object

    def __init__(
        self,
        base_layer,
        lora_config: LoRAConfig,
        context: LoRAContext | None = None,
        *,
        name: str | None = None,
    ):
        if isinstance(base_layer, self.source_type):
            base_layer = FlaxGeneralLinear(base_layer, name=name)
        super().__init__(base_layer, lora_config, context, name=name)

    def _check_base(self, base):
        if not isinstance(base, FlaxGeneralLinear) or not isinstance(base.source, self.source_type):
            raise ValueError(
                f"{self.name}: base layer must be a flax.nnx.{self.source_type.__name__}, got "
                f"{type(getattr(base, 'source', base)).__name__}"
            )

    def _run(self, x: jax.Array, einsum_str: str | None, call) -> jax.Array:
        y = call()  # the source's own forward
        mapping = self.lora_context.get_value()
        if mapping is None:
            return y
        try:
            c = self.base_layer.contraction_for(x.ndim, einsum_str)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        x2, y2 = c.flat_x(x), c.flat_y(y)
        if mapping.num_tokens != x2.shape[0]:
            raise ValueError(
                f"{self.name}: the LoRA mapping has {mapping.num_tokens} tokens but the input "
                f"has {x2.shape[0]} (token axes {[x.shape[c.inp.index(t)] for t in c.tokens]})"
            )
        a = tuple(v[...] for v in self.lora_a)
        b = tuple(v[...] for v in self.lora_b)
        y2 = self._lora_local(y2, x2, a, b, self.slot_ranks[...], mapping)
        return c.unflat_y(y2, y)

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ):
        if not isinstance(source_layer, cls.source_type) or len(packed_modules_list) > 1:
            return False
        if _stacked_reason(source_layer, "") is not None:
            return True  # taken, so that building it refuses by name, as a stacked nnx.Linear
        try:  # only what is one flat linear map; the rest is left as it is
            FlaxGeneralLinear(source_layer)
        except ValueError:
            return False
        return True


# the public fields (flax 0.12) of nnx.LinearGeneral / nnx.Einsum, readable on their
# LoRA layers
_LINEAR_GENERAL_FIELDS = (
    "kernel",
    "bias",
    "in_features",
    "out_features",
    "axis",
    "batch_axis",
    "use_bias",
    "dtype",
    "param_dtype",
    "precision",
    "dot_general",
    "dot_general_cls",
    "promote_dtype",
    "preferred_element_type",
)
_EINSUM_FIELDS = (
    "kernel",
    "bias",
    "einsum_str",
    "kernel_shape",
    "bias_shape",
    "dtype",
    "param_dtype",
    "precision",
    "einsum_op",
    "promote_dtype",
    "preferred_element_type",
)


@forward_source_fields(*_LINEAR_GENERAL_FIELDS)
class FlaxLinearGeneralWithLoRA(_FlaxGeneralWithLoRA):
    """Per-token multi-LoRA around a plain `nnx.LinearGeneral` (flat `A [r, in]`,
    `B [out, r]`: see the module doc); `wrap_model` picks it for `nnx.LinearGeneral`
    modules (e.g. `nnx.MultiHeadAttention`'s query / key / value / out). The source's
    public fields (`kernel`, `out_features`, ...) read through it.

    Example:
        >>> lg = nnx.LinearGeneral(16, (2, 4), rngs=nnx.Rngs(0))
        >>> layer = FlaxLinearGeneralWithLoRA(lg, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> layer.set_lora(1, np.ones((4, 16)), np.ones((8, 4)))  # A [r, in], B [2 * 4, r]
        >>> layer(jnp.ones((3, 16))).shape, layer.kernel is lg.kernel  # no mapping: the base
        ((3, 2, 4), True)
    """

    source_type = nnx.LinearGeneral

    def __call__(self, x: jax.Array, out_sharding=None):
        """As `nnx.LinearGeneral.__call__`, plus each token's LoRA."""
        source = self.base_layer.source
        return self._run(x, None, lambda: source(x, out_sharding=out_sharding))


@forward_source_fields(*_EINSUM_FIELDS)
class FlaxEinsumWithLoRA(_FlaxGeneralWithLoRA):
    """Per-token multi-LoRA around a plain `nnx.Einsum` whose equation is one flat linear
    map (flat `A [r, in]`, `B [out, r]`, in the kernel's axis order: see the module doc);
    `wrap_model` picks it for such `nnx.Einsum` modules.

    Example:
        >>> ein = nnx.Einsum("btd,ndh->btnh", (2, 16, 4), rngs=nnx.Rngs(0))
        >>> layer = FlaxEinsumWithLoRA(ein, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> layer.set_lora(0, np.ones((4, 16)), np.ones((8, 4)))  # A [r, 16], B [2 * 4, r]
        >>> layer(jnp.ones((1, 3, 16))).shape
        (1, 3, 2, 4)
    """

    source_type = nnx.Einsum

    def __call__(self, x: jax.Array, einsum_str: str | None = None, out_sharding=None):
        """As `nnx.Einsum.__call__`, plus each token's LoRA."""
        source = self.base_layer.source
        return self._run(
            x, einsum_str, lambda: source(x, einsum_str=einsum_str, out_sharding=out_sharding)
        )


def unmergeable_reason(layer) -> str | None:
    """Why `merge_adapter` cannot fold this layer's adapter into its kernel, or None."""
    src = layer.base_layer.source
    if isinstance(src, nnx.LinearGeneral):
        dot = src.dot_general
        if src.dot_general_cls is not None or (dot is not None and dot is not jax.lax.dot_general):
            return (
                "its nnx.LinearGeneral computes with its own dot_general, which need not be "
                "linear in the kernel: B @ A added to the kernel would not give the served output"
            )
    elif src.einsum_op is not jnp.einsum:
        return (
            "its nnx.Einsum computes with its own einsum_op, which need not be linear in the "
            "kernel: B @ A added to the kernel would not give the served output"
        )
    return None


__all__ = [
    "Contraction",
    "FlaxEinsumWithLoRA",
    "FlaxGeneralLinear",
    "FlaxLinearGeneralWithLoRA",
    "linear_general_contraction",
    "parse_einsum",
    "unmergeable_reason",
]
