"""`Contraction`: an `nnx.LinearGeneral` / `nnx.Einsum` contraction read as one flat linear
map (`lora_jax.layers.flax_general` holds the LoRA layers built on it).

`parse_einsum` and `linear_general_contraction` give the `Contraction` of an equation or
a layer, or a `ValueError` saying why it is not one flat linear map; a `Contraction` moves
x, the output and a kernel delta between their own layout and the flat `[T, in]` /
`[T, out]` / `[in, out]` one.
"""

from __future__ import annotations

import dataclasses
import math
import string

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Contraction:
    """One einsum `inp,ker->out` read as a flat linear map (letters, one per axis).

    ``contract`` / ``feature``: the kernel's contracted / kept letters, in kernel order;
    ``tokens``: x's letters that are not contracted, in x's order."""

    inp: str
    ker: str
    out: str

    @property
    def contract(self) -> str:
        return "".join(c for c in self.ker if c in self.inp)

    @property
    def feature(self) -> str:
        return "".join(c for c in self.ker if c in self.out)

    @property
    def tokens(self) -> str:
        return "".join(c for c in self.inp if c not in self.ker)

    def flat_x(self, x: jax.Array) -> jax.Array:
        """x → `[T, in]` (tokens in x's order, contracted axes in the kernel's order)."""
        perm = [self.inp.index(c) for c in self.tokens + self.contract]
        return _flatten(jnp.transpose(x, perm), len(self.tokens))

    def flat_y(self, y: jax.Array) -> jax.Array:
        """The output → `[T, out]` (features in the kernel's order)."""
        perm = [self.out.index(c) for c in self.tokens + self.feature]
        return _flatten(jnp.transpose(y, perm), len(self.tokens))

    def unflat_y(self, y2: jax.Array, like: jax.Array) -> jax.Array:
        """`flat_y`'s inverse, into the layout of ``like`` (the base output)."""
        order = self.tokens + self.feature
        shape = [like.shape[self.out.index(c)] for c in order]
        n = len(self.tokens)
        # split the tokens, then the features (one reshape of both groups is refused on
        # Explicit meshes when either is sharded)
        y = y2.reshape(*shape[:n], y2.shape[-1]).reshape(shape)
        return jnp.transpose(y, [order.index(c) for c in self.out])

    def kernel_delta(self, delta: jax.Array, kernel_shape) -> jax.Array:
        """A flat `[in, out]` delta → the kernel's shape and axis order."""
        order = self.contract + self.feature
        shape = [kernel_shape[self.ker.index(c)] for c in order]
        return jnp.transpose(delta.reshape(shape), [order.index(c) for c in self.ker])


def _flatten(a: jax.Array, n: int) -> jax.Array:
    """``a``'s first ``n`` axes to one, its others to one: the trailing group first, then
    the leading one (one reshape of both is refused on Explicit meshes when either group
    is sharded)."""
    a = a.reshape(*a.shape[:n], math.prod(a.shape[n:]))
    return a.reshape(math.prod(a.shape[:n]), a.shape[-1])


def parse_einsum(equation: str, kernel_ndim: int, x_ndim: int | None = None) -> Contraction:
    """The `Contraction` of an `nnx.Einsum` equation, or a `ValueError` saying why it is
    not one flat linear map. An ellipsis (x's leading axes) is expanded for ``x_ndim``
    (None: left as token axes of unknown count).

    Example:
        >>> c = parse_einsum("BTD,NDH->BTNH", 3)
        >>> c.tokens, c.contract, c.feature
        ('BT', 'D', 'NH')
    """
    eq = equation.replace(" ", "")
    if eq.count("->") != 1 or eq.count(",") != 1:
        raise ValueError(f"einsum {equation!r}: expected 'x,kernel->out'")
    lhs, out = eq.split("->")
    inp, ker = lhs.split(",")
    if "..." in ker:
        raise ValueError(f"einsum {equation!r}: an ellipsis in the kernel is not supported")
    if ("..." in inp) != ("..." in out):
        raise ValueError(f"einsum {equation!r}: the ellipsis must be in x and in the output")
    if "..." in inp:
        used = set(inp + ker + out)
        free = [c for c in string.ascii_letters if c not in used]
        n = 1 if x_ndim is None else x_ndim - (len(inp) - 3)
        if n < 0:
            raise ValueError(f"einsum {equation!r}: x has {x_ndim} axes, too few")
        fill = "".join(free[:n])
        inp, out = inp.replace("...", fill), out.replace("...", fill)
    for what, s in (("x", inp), ("kernel", ker), ("output", out)):
        if not s.isalpha() or len(set(s)) != len(s):
            raise ValueError(f"einsum {equation!r}: {what} letters {s!r} must be distinct letters")
    if len(ker) != kernel_ndim:
        raise ValueError(
            f"einsum {equation!r}: the kernel has {kernel_ndim} axes, the equation {len(ker)}"
        )
    if x_ndim is not None and len(inp) != x_ndim:
        raise ValueError(f"einsum {equation!r}: x has {x_ndim} axes, the equation {len(inp)}")
    shared = [c for c in ker if c in inp and c in out]
    if shared:
        raise ValueError(
            f"einsum {equation!r}: axes {shared} are in x, kernel and output (a kernel per "
            "group): not one flat linear map"
        )
    summed = [c for c in inp + ker if c not in out and not (c in inp and c in ker)]
    if summed:
        raise ValueError(f"einsum {equation!r}: axes {summed} are summed out of one operand")
    c = Contraction(inp, ker, out)
    if not c.contract or not c.feature:
        raise ValueError(f"einsum {equation!r}: nothing contracted or no output feature axis")
    return c


def linear_general_contraction(source: nnx.LinearGeneral, x_ndim: int) -> Contraction:
    """The `Contraction` of an `nnx.LinearGeneral` applied to an x of ``x_ndim`` axes."""
    if source.batch_axis:
        raise ValueError(
            f"nnx.LinearGeneral with batch_axis={dict(source.batch_axis)}: a kernel per batch "
            "group is not one flat linear map"
        )
    # Flax pairs the kernel's in axes with x's contracted axes in ascending order, whatever
    # order `axis` names them in
    axes = sorted(a % x_ndim for a in source.axis)
    if len(set(axes)) != len(axes):
        raise ValueError(f"nnx.LinearGeneral axis={source.axis}: repeated axes")
    letters = string.ascii_letters
    inp = letters[:x_ndim]
    feat = letters[x_ndim : x_ndim + len(source.out_features)]
    ker = "".join(inp[a] for a in axes) + feat
    out = "".join(c for i, c in enumerate(inp) if i not in axes) + feat
    return Contraction(inp, ker, out)


def _contracted_positions(c: Contraction) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Kernel axis positions that are contracted, and those kept (order-free form)."""
    return (
        tuple(c.ker.index(x) for x in c.contract),
        tuple(c.ker.index(x) for x in c.feature),
    )
