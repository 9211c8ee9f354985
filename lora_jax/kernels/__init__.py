"""GPU kernels for lora_jax: the ops of the top-level ``kernels/`` folder, installed as
``lora_jax.kernels.shrink_expand``.

Layers never import this package: they call ``lora_jax.ops``, which dispatches
here on GPU and to the jnp references elsewhere.
"""

from lora_jax.kernels.shrink_expand import BlockSizes as BlockSizes
from lora_jax.kernels.shrink_expand import build_work_lists as build_work_lists
from lora_jax.kernels.shrink_expand import lora_expand as lora_expand
from lora_jax.kernels.shrink_expand import lora_expand_reference as lora_expand_reference
from lora_jax.kernels.shrink_expand import lora_shrink as lora_shrink
from lora_jax.kernels.shrink_expand import lora_shrink_expand as lora_shrink_expand
from lora_jax.kernels.shrink_expand import (
    lora_shrink_expand_reference as lora_shrink_expand_reference,
)
from lora_jax.kernels.shrink_expand import lora_shrink_reference as lora_shrink_reference
from lora_jax.kernels.shrink_expand import lora_slot_outer as lora_slot_outer
from lora_jax.kernels.shrink_expand import (
    lora_slot_outer_reference as lora_slot_outer_reference,
)

__all__ = [
    "BlockSizes",
    "build_work_lists",
    "lora_expand",
    "lora_expand_reference",
    "lora_shrink",
    "lora_shrink_expand",
    "lora_shrink_expand_reference",
    "lora_shrink_reference",
    "lora_slot_outer",
    "lora_slot_outer_reference",
]
