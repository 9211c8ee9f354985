"""Punica's two batched per-token adapter ops: shrink (x @ A.T) and expand (y += h @ B.T).

One folder per op, Tokamax style: ``reference.py`` is the jnp oracle,
``pallas_triton.py`` the Pallas Triton backend's expand (``pallas_triton_common.py`` what
its kernels share),
``pallas_triton_shrink.py`` its shrink over a work list, ``pallas_triton_rect.py`` its
shrink over rectangles of x (prompts), ``pallas_triton_bgmv.py`` the per-token
(Punica BGMV) shrink and expand for steps where tokens have adapters of their own,
``mosaic_gpu_shrink.py`` the Mosaic GPU
(Hopper TMA + WGMMA) shrink for prompts' tiles of x (``mosaic_gpu_shrink_ws.py`` its
warp-specialized form, ``mosaic_gpu_jobs.py`` the persistent job walk the Mosaic GPU
kernels share), ``mosaic_gpu_expand.py`` the Mosaic
GPU expand for tiles of y wholly of one slot, ``block_sizes.py`` the tile
config, ``tuning.py`` its H200 tuning table (``tuning_per_token.py`` the per-token
kernels' tiles and when a step runs them, ``tuning_long_shrink.py`` the long-prompt
shrink's), ``work_list.py`` the (slot, token block)
schedule shared by backends, ``api.py`` the jitted public functions (``api_expand.py`` the
expand), ``checks.py`` their argument checks, and ``routing.py`` which tokens go to the
Mosaic GPU kernels.
``pallas_triton_grad.py`` the stacks' gradient `lora_slot_outer` (per slot, the sum of
its tokens' outer products; jitted in ``api_grad.py``).
``pallas_triton_fused.py`` holds the fused decode op `lora_shrink_expand`
(shrink and expand of every slice in one launch) with its own jitted entry.
"""

from lora_jax.kernels.shrink_expand.api import lora_expand as lora_expand
from lora_jax.kernels.shrink_expand.api import lora_shrink as lora_shrink
from lora_jax.kernels.shrink_expand.api_grad import lora_slot_outer as lora_slot_outer
from lora_jax.kernels.shrink_expand.block_sizes import BlockSizes as BlockSizes
from lora_jax.kernels.shrink_expand.pallas_triton_fused import (
    lora_shrink_expand as lora_shrink_expand,
)
from lora_jax.kernels.shrink_expand.reference import (
    lora_expand_reference as lora_expand_reference,
)
from lora_jax.kernels.shrink_expand.reference import (
    lora_shrink_expand_reference as lora_shrink_expand_reference,
)
from lora_jax.kernels.shrink_expand.reference import (
    lora_shrink_reference as lora_shrink_reference,
)
from lora_jax.kernels.shrink_expand.reference import (
    lora_slot_outer_reference as lora_slot_outer_reference,
)
from lora_jax.kernels.shrink_expand.work_list import build_work_lists as build_work_lists

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
