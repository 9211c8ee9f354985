"""Base linear layers with vLLM's names and tensor-parallel semantics, in NNX.

Weights use Flax's `kernel [in, out]` layout. Tensor parallelism is declared with logical
axes (see `lora_jax.sharding`), and each forward runs its per-shard math in a
`shard_map`, so the compiled program holds exactly vLLM's collectives:

* `ReplicatedLinear`: no parallelism.
* `ColumnParallelLinear` / `MergedColumnParallelLinear` / `QKVParallelLinear`: the out
  dim is split over the "tensor" axis; outputs stay sharded, no collective.
* `RowParallelLinear`: the in dim is split; one all-reduce of the partial sums.

Packed layers (gate_up, qkv) store their out dim *per shard*: shard i holds
`[slice0_i | slice1_i | ...]`, exactly vLLM's per-rank weight, and `split_output` turns a
packed output back into per-slice arrays. With one shard this is the plain concatenation.
QKV replicates kv heads when the tensor axis is larger than `num_kv_heads` (vLLM's
`num_kv_head_replicas`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from lora_jax.sharding import ShardingRules, shard_map

default_kernel_init = nnx.initializers.lecun_normal()

_KERNEL_AXES = {"replicated": (None, None), "column": (None, "tensor"), "row": ("tensor", None)}
_X_AXES = {"replicated": None, "column": None, "row": "tensor"}
_Y_AXES = {"replicated": None, "column": "tensor", "row": None}


class LinearBase(nnx.Module):
    """Common machinery of the base linears; use the concrete subclasses.

    Example:
        >>> layer = ColumnParallelLinear(16, 32, rngs=nnx.Rngs(0))
        >>> isinstance(layer, LinearBase), layer.kernel.shape  # kernel [in, out]
        (True, (16, 32))
    """

    parallel: str = "replicated"
    dora_ok: bool = True  # the bias joins after the local matmul (DoRA scales before it)

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        use_bias: bool = False,
        skip_bias_add: bool = False,
        return_bias: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        rules: ShardingRules | None = None,
        kernel_init=default_kernel_init,
        rngs: nnx.Rngs,
    ):
        self.in_features = int(in_features)
        self.output_sizes = tuple(int(n) for n in output_sizes)  # logical, per sub-slice
        self.use_bias = use_bias
        self.skip_bias_add = skip_bias_add
        self.return_bias = return_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.rules = rules if rules is not None else ShardingRules()
        tp = self.rules.size("tensor") if self.parallel != "replicated" else 1
        self.tp = tp
        self.out_tp = tp if self.parallel == "column" else 1
        self.physical_sizes = tuple(
            self._physical_size(i, n) for i, n in enumerate(self.output_sizes)
        )
        name = type(self).__name__
        batch_axis = self.rules.mesh_axis("batch")
        if tp > 1 and batch_axis is not None and batch_axis == self.rules.mesh_axis("tensor"):
            # x [T, in] and y [T, out] would be split twice over one mesh axis
            raise ValueError(
                f"{name}: the rules map 'batch' and 'tensor' to one mesh axis "
                f"{batch_axis!r}; a {self.parallel}-parallel layer's tensor shards need every "
                "token: map them to different axes (or 'batch' to None)"
            )
        if self.parallel == "row" and self.in_features % tp:
            raise ValueError(f"{name}: in_features={in_features} not divisible by tensor axis {tp}")
        for n in self.physical_sizes:
            if n % self.out_tp:
                raise ValueError(
                    f"{name}: output size {n} (of {self.output_sizes}) not divisible by "
                    f"tensor axis {self.out_tp}"
                )
        keys = jax.random.split(rngs.params(), len(self.output_sizes))
        slices = [
            kernel_init(k, (self.in_features, n), param_dtype)
            for k, n in zip(keys, self.output_sizes)
        ]
        kernel = self.pack(slices, axis=1)  # [in, out_physical]
        self.kernel = nnx.Param(self.rules.place(kernel, *_KERNEL_AXES[self.parallel]))
        if use_bias:
            bias = jnp.zeros((self.out_features,), param_dtype)  # [out_physical]
            self.bias = nnx.Param(self.rules.place(bias, _Y_AXES[self.parallel]))
        else:
            self.bias = None

    # -- layout ---------------------------------------------------------------------------
    @property
    def out_features(self) -> int:
        """Width of the packed output (kv replicas included)."""
        return sum(self.physical_sizes)

    def _physical_size(self, i: int, n: int) -> int:
        return n

    def _replicate(self, i: int, arr: jax.Array, axis: int) -> jax.Array:
        """Logical sub-slice i → its physical form (QKV repeats kv heads here)."""
        return arr

    def pack(self, slices: Sequence[jax.Array], axis: int) -> jax.Array:
        """Logical per-sub-slice arrays (sizes `output_sizes` on `axis`) → packed layout."""
        if len(slices) != len(self.output_sizes):
            raise ValueError(
                f"{type(self).__name__}.pack: expected {len(self.output_sizes)} slices, "
                f"got {len(slices)}"
            )
        phys = [self._replicate(i, jnp.asarray(a), axis) for i, a in enumerate(slices)]
        return pack_shards(phys, axis, self.out_tp)

    def split_output(self, y: jax.Array) -> list[jax.Array]:
        """Packed output `[..., out_features]` → per-sub-slice arrays (physical sizes)."""
        return unpack_shards(y, self.physical_sizes, -1, self.out_tp)

    def load_kernel(self, slices: Sequence[jax.Array], bias: Sequence[jax.Array] | None = None):
        """Sets the weights from logical per-slice `[in, n_s]` kernels (and `[n_s]` biases)."""
        for i, (a, n) in enumerate(zip(slices, self.output_sizes)):
            if a.shape != (self.in_features, n):
                raise ValueError(
                    f"{type(self).__name__}.load_kernel: slice {i} has shape {a.shape}, "
                    f"expected {(self.in_features, n)}"
                )
        kernel = self.pack([jnp.asarray(a, self.param_dtype) for a in slices], axis=1)
        self.kernel.set_value(self.rules.place(kernel, *_KERNEL_AXES[self.parallel]))
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"{type(self).__name__} was built with use_bias=False")
            b = self.pack([jnp.asarray(v, self.param_dtype) for v in bias], axis=0)
            self.bias.set_value(self.rules.place(b, _Y_AXES[self.parallel]))

    # -- forward --------------------------------------------------------------------------
    def local_matmul(self, x: jax.Array, kernel: jax.Array) -> jax.Array:
        """Per-shard base matmul; subclasses may override (the LoRA wrappers call it)."""
        dtype = self.dtype or x.dtype
        return jnp.dot(x.astype(dtype), kernel.astype(dtype), preferred_element_type=dtype)

    def run_local(self, x, fn, extra_args=(), extra_specs=()):
        """Runs `fn(x_local, kernel_local, *extra_local) -> y_local` per shard.

        `x` is `[T, in]`. Returns `[T, out_features]`. Tokens are split over the
        "batch" axis when T divides evenly, otherwise replicated.
        """
        rules = self.rules
        kernel = self.kernel[...]
        if rules.mesh is None:
            return fn(x, kernel, *extra_args)
        batch = "batch" if x.shape[0] % rules.size("batch") == 0 else None
        x_spec = (batch, _X_AXES[self.parallel])
        y_spec = (batch, _Y_AXES[self.parallel])
        specs = (x_spec, _KERNEL_AXES[self.parallel], *extra_specs)
        return shard_map(rules, fn, specs, y_spec)(x, kernel, *extra_args)

    def reduce(self, y: jax.Array) -> jax.Array:
        """The row-parallel all-reduce (identity when unsharded); call inside `run_local`."""
        axis = self.rules.mesh_axis("tensor")
        if self.parallel != "row" or axis is None or self.tp == 1:
            return y
        return jax.lax.psum(y, axis)

    def finish(self, y: jax.Array, lead_shape: tuple[int, ...]):
        """Adds the bias (unless skip_bias_add) and restores the leading dims."""
        y = y.reshape(*lead_shape, y.shape[-1])
        bias = None if self.bias is None else self.bias[...].astype(y.dtype)
        if bias is not None and not self.skip_bias_add:
            y = y + bias
            bias = None
        return (y, bias) if self.return_bias else y

    def __call__(self, x: jax.Array):
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__}: input last dim {x.shape[-1]} != in_features "
                f"{self.in_features}"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = self.run_local(x2, lambda xl, k: self.reduce(self.local_matmul(xl, k)))
        return self.finish(y, lead)


def pack_shards(arrays: Sequence[jax.Array], axis: int, shards: int) -> jax.Array:
    """Concatenates arrays on `axis` so that shard i holds `[a0_i | a1_i | ...]`."""
    axis = axis % arrays[0].ndim
    if shards == 1:
        return jnp.concatenate(arrays, axis=axis)
    parts = []
    for a in arrays:
        shape = a.shape
        parts.append(a.reshape(*shape[:axis], shards, shape[axis] // shards, *shape[axis + 1 :]))
    packed = jnp.concatenate(parts, axis=axis + 1)
    shape = packed.shape
    return packed.reshape(*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2 :])


def unpack_shards(y: jax.Array, sizes: Sequence[int], axis: int, shards: int) -> list[jax.Array]:
    """Inverse of `pack_shards`: the packed `axis` → per-slice arrays of `sizes`."""
    axis = axis % y.ndim
    shape = y.shape
    local = [n // shards for n in sizes]
    yy = y.reshape(*shape[:axis], shards, sum(local), *shape[axis + 1 :])
    out, start = [], 0
    for n in local:
        part = jax.lax.slice_in_dim(yy, start, start + n, axis=axis + 1)
        out.append(part.reshape(*shape[:axis], shards * n, *shape[axis + 1 :]))
        start += n
    return out


class ReplicatedLinear(LinearBase):
    """`y = x @ kernel (+ bias)` on every device.

    Example:
        >>> lin = ReplicatedLinear(16, 32, rngs=nnx.Rngs(0))
        >>> lin(jnp.ones((4, 16))).shape
        (4, 32)
    """

    parallel = "replicated"

    def __init__(self, in_features: int, out_features: int, **kw):
        super().__init__(in_features, (out_features,), **kw)


class MergedReplicatedLinear(ReplicatedLinear):
    """Several outputs packed in one matmul on every device: vLLM's `MergedReplicatedLinear`
    (e.g. DeepSeek's `fused_qkv_a_proj`, `q_a_proj` | `kv_a_proj_with_mqa`).

    Example:
        >>> fused = MergedReplicatedLinear(16, [8, 24], rngs=nnx.Rngs(0))
        >>> [a.shape for a in fused.split_output(fused(jnp.ones((2, 16))))]
        [(2, 8), (2, 24)]
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], **kw):
        LinearBase.__init__(self, in_features, output_sizes, **kw)


class ColumnParallelLinear(LinearBase):
    """Out dim split over the "tensor" axis; the output stays sharded (no gather).

    Example:
        >>> layer = ColumnParallelLinear(16, 32, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((3, 16))).shape
        (3, 32)
    """

    parallel = "column"

    def __init__(self, in_features: int, out_features: int, **kw):
        super().__init__(in_features, (out_features,), **kw)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs packed in one matmul (e.g. gate_up).

    Example:
        >>> gate_up = MergedColumnParallelLinear(16, [32, 32], rngs=nnx.Rngs(0))
        >>> [a.shape for a in gate_up.split_output(gate_up(jnp.ones((2, 16))))]
        [(2, 32), (2, 32)]
    """

    parallel = "column"

    def __init__(self, in_features: int, output_sizes: Sequence[int], **kw):
        super().__init__(in_features, output_sizes, **kw)


class QKVParallelLinear(LinearBase):
    """Packed q, k, v projection with GQA; kv heads are replicated when the tensor axis
    has more shards than kv heads (`num_kv_head_replicas`), as in vLLM.

    `split_output` gives q `[..., heads*hd]`, k and v `[..., max(kv, tp)*hd]`.

    Example:
        >>> qkv = QKVParallelLinear(16, 4, 4, 2, rngs=nnx.Rngs(0))  # D, head_dim, heads, kv
        >>> [t.shape for t in qkv.split_output(qkv(jnp.ones((3, 16))))]
        [(3, 16), (3, 8), (3, 8)]
    """

    parallel = "column"

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        **kw,
    ):
        kv = total_num_kv_heads or total_num_heads
        self.head_size, self.total_num_heads, self.total_num_kv_heads = (
            head_size,
            total_num_heads,
            kv,
        )
        rules = kw.get("rules") or ShardingRules()
        tp = rules.size("tensor")
        if total_num_heads % tp:
            raise ValueError(f"QKVParallelLinear: {total_num_heads} heads not divisible by tp={tp}")
        if kv >= tp and kv % tp:
            raise ValueError(f"QKVParallelLinear: {kv} kv heads not divisible by tp={tp}")
        if kv < tp and tp % kv:
            raise ValueError(f"QKVParallelLinear: tp={tp} not a multiple of {kv} kv heads")
        self.num_kv_head_replicas = max(1, tp // kv)
        sizes = (total_num_heads * head_size, kv * head_size, kv * head_size)
        super().__init__(hidden_size, sizes, **kw)

    def _physical_size(self, i: int, n: int) -> int:
        return n if i == 0 else n * self.num_kv_head_replicas

    def _replicate(self, i: int, arr: jax.Array, axis: int) -> jax.Array:
        r = self.num_kv_head_replicas
        if i == 0 or r == 1:
            return arr
        axis = axis % arr.ndim
        shape = arr.shape
        heads = arr.reshape(
            *shape[:axis], self.total_num_kv_heads, self.head_size, *shape[axis + 1 :]
        )
        heads = jnp.repeat(heads, r, axis=axis)
        return heads.reshape(*shape[:axis], shape[axis] * r, *shape[axis + 1 :])


class RowParallelLinear(LinearBase):
    """In dim split over the "tensor" axis; one all-reduce of the partial sums; the bias
    is added after the reduction.

    Example:
        >>> layer = RowParallelLinear(32, 16, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((3, 32))).shape
        (3, 16)
    """

    parallel = "row"

    def __init__(self, in_features: int, out_features: int, **kw):
        super().__init__(in_features, (out_features,), **kw)
