"""Multi-LoRA around a plain `flax.nnx.Linear`, so that `wrap_model` takes any Flax model.

A model built from `nnx.Linear` layers (not from `lora_jax.linear`) is wrapped in place:
each targeted `nnx.Linear` becomes a `FlaxLinearWithLoRA` whose base is a `FlaxLinear`,
a `ReplicatedLinear` view that shares the original layer's kernel variable and runs the
original layer's own forward (its dtype promotion, precision, `dot_general` and bias)
for the base output. The LoRA stacks, slot writes, PEFT loading, the manager and merging
are the replicated layer's; `unwrap_model` puts the very same `nnx.Linear` back.

These layers are not tensor parallel: a sharded `nnx.Linear` kernel stays as the user
placed it (jit's sharding propagation handles the base matmul), and its LoRA stacks are
replicated. For vLLM's column / row parallel layers, build the model from
`lora_jax.linear` (as `lora_jax.models` does).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from lora_jax.config import LoRAConfig
from lora_jax.layers.base import LoRAContext
from lora_jax.layers.column import ReplicatedLinearWithLoRA
from lora_jax.linear import ReplicatedLinear
from lora_jax.sharding import ShardingRules

# nnx.Linear's public fields (flax 0.12), readable on its LoRA layer
_LINEAR_FIELDS = (
    "kernel",
    "bias",
    "in_features",
    "out_features",
    "use_bias",
    "dtype",
    "param_dtype",
    "precision",
    "dot_general",
    "promote_dtype",
    "preferred_element_type",
)


class FlaxLinear(ReplicatedLinear):
    """A `ReplicatedLinear` view of an `nnx.Linear` (kernel shared, not copied).

    Example:
        >>> lin = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
        >>> view = FlaxLinear(lin)
        >>> view.kernel is lin.kernel, view(jnp.ones((2, 16))).shape
        (True, (2, 8))
    """

    dora_ok = False  # the source layer adds its bias inside its own forward

    def __init__(self, source: nnx.Linear, *, name: str | None = None):  # no new kernel drawn
        if not isinstance(source, nnx.Linear):
            raise ValueError(f"FlaxLinear: expected a flax.nnx.Linear, got {type(source).__name__}")
        shape = tuple(source.kernel.shape)
        if shape != (int(source.in_features), int(source.out_features)):
            raise ValueError(
                f"{name or 'FlaxLinear'}: an nnx.Linear({source.in_features}, "
                f"{source.out_features}) with "
                f"a kernel of shape {shape}: stacked layers (nnx.vmap / scan over layers) are "
                "not supported; build the layers unstacked (one nnx.Linear per layer)"
            )
        self.source = source
        self.in_features = int(source.in_features)
        self.output_sizes = (int(source.out_features),)
        self.physical_sizes = self.output_sizes
        # the source adds its own bias inside `local_matmul`
        self.use_bias, self.skip_bias_add, self.return_bias = False, False, False
        self.bias = None
        self.dtype = source.dtype
        self.param_dtype = source.param_dtype
        self.rules = ShardingRules()
        self.tp = self.out_tp = 1
        self.kernel = source.kernel  # the same variable: merging edits the source's kernel

    def local_matmul(self, x: jax.Array, kernel: jax.Array) -> jax.Array:
        """The source layer's own forward (bias included; `kernel` is its kernel)."""
        del kernel
        return self.source(x)


def forward_source_fields(*names: str) -> Callable[[type], type]:
    """Class decorator: read-only properties that read the wrapped Flax layer's own public
    fields (`layer.kernel is layer.base_layer.source.kernel`), so that code written against
    the plain layer (`h @ layer.kernel[...].T`, `layer.out_features`) runs on its wrapper,
    as PEFT's wrappers keep `weight` and `in_features`. Properties, not `__getattr__`:
    NNX's graph walk, `nnx.split` and pickling see only the wrapper's own attributes.

    Example:
        >>> @forward_source_fields("kernel", "in_features")  # doctest: +SKIP
        ... class MyLinearWithLoRA(FlaxLinearWithLoRA): ...
    """

    def field(name: str) -> property:
        def get(self):
            return getattr(self.base_layer.source, name)

        def refuse(self, value):
            if value is getattr(self.base_layer.source, name):
                return  # `nnx.Module.set_attributes` sets the source (visited first), then this
            # the wrapper's base view holds the source's variables: a new one set here
            # (or on the source now) would part the served weight from the one written
            raise AttributeError(
                f"{self.name}: .{name} is read from the wrapped "
                f"{type(self.base_layer.source).__name__} and cannot be set on its LoRA "
                "layer; set it before wrap_model (or unwrap_model, set it, wrap again)"
            )

        return property(get, refuse, doc=f"The wrapped Flax layer's `{name}` (read-only).")

    def decorate(cls: type) -> type:
        for name in names:
            setattr(cls, name, field(name))
        return cls

    return decorate


@forward_source_fields(*_LINEAR_FIELDS)
class FlaxLinearWithLoRA(ReplicatedLinearWithLoRA):
    """Per-token multi-LoRA around a plain `nnx.Linear` (replicated, as
    `ReplicatedLinearWithLoRA`); `wrap_model` picks it for `nnx.Linear` modules. The
    `nnx.Linear`'s public fields (`kernel`, `bias`, `in_features`, ...) read through it.

    Example:
        >>> lin = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
        >>> layer = FlaxLinearWithLoRA(lin, LoRAConfig(max_loras=2, max_lora_rank=8))
        >>> layer.set_lora(1, np.ones((4, 16)), np.ones((8, 4)))  # A [r, in], B [out, r]
        >>> layer.base_layer.source is lin, layer.kernel is lin.kernel, layer.out_features
        (True, True, 8)
    """

    def __init__(
        self,
        base_layer: nnx.Linear | FlaxLinear,
        lora_config: LoRAConfig,
        context: LoRAContext | None = None,
        *,
        name: str | None = None,
    ):
        if isinstance(base_layer, nnx.Linear):
            base_layer = FlaxLinear(base_layer, name=name)
        super().__init__(base_layer, lora_config, context, name=name)

    def __call__(self, x: jax.Array, out_sharding=None):
        """As `nnx.Linear.__call__` (`out_sharding` goes to the source layer's matmul)."""
        if out_sharding is None:
            return super().__call__(x)
        source = self.base_layer.source
        y = source(x, out_sharding=out_sharding)  # the base output, sharded as asked
        mapping = self.lora_context.get_value()
        if mapping is None:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        if mapping.num_tokens != x2.shape[0]:
            raise ValueError(
                f"{self.name}: the LoRA mapping has {mapping.num_tokens} tokens but the input "
                f"has {x2.shape[0]} (leading dims {x.shape[:-1]})"
            )
        a = tuple(v[...] for v in self.lora_a)
        b = tuple(v[...] for v in self.lora_b)
        y2 = self._lora_local(y2, x2, a, b, self.slot_ranks[...], mapping)
        return y2.reshape(y.shape)

    def _check_base(self, base):
        if not isinstance(base, FlaxLinear):
            raise ValueError(
                f"{self.name}: base layer must be a flax.nnx.Linear, got {type(base).__name__}"
            )

    @classmethod
    def can_replace_layer(
        cls, source_layer, lora_config, packed_modules_list=(), model_config=None
    ):
        return isinstance(source_layer, nnx.Linear) and len(packed_modules_list) <= 1
