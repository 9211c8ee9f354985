"""Read the PTX of the library's Pallas Triton kernels without a GPU.

Lowers `lora_shrink` / `lora_expand` (the library's default tiles for the shape) for CUDA
on the CPU, against an abstract H200, keeps the Triton IR of each Pallas Triton kernel,
and, where PyPI's ``triton`` is installed (``pip install triton``; not a dependency of
lora_jax), compiles it for sm_90 to PTX. Prints, for each kernel, the instructions that
say how it moves data: its global loads, ``cp.async`` copies, MMAs and atomic adds
(session 35 used it to see that the shrink's split-K adds are vectorized
``red.global.gpu.relaxed.add.v4.f32``). The PTX comes from PyPI's Triton, not from the
one inside jaxlib that the GPU would run, so read it as a close guide.

Example::

    pip install triton
    python benchmarks/triton_ptx.py --op shrink --tokens 4096 --hidden 4096 --rank 16 \
        --adapters 1 --out /tmp/ptx

It reaches into jax internals (`jax._src.pallas.triton.lowering`) to keep the IR.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import lora_jax as lj  # noqa: E402
from lora_jax.kernels import lora_expand, lora_shrink  # noqa: E402
from lora_jax.kernels.shrink_expand import pallas_triton  # noqa: E402

PATTERNS = {
    "ld.global": r"\bld\.global",
    "cp.async": r"\bcp\.async\.c[ag]\.shared\.global",
    "mma": r"\bmma\.sync|\bwgmma\.mma_async",
    "atomic add": r"\b(?:red|atom)\.global\.[a-z0-9._]*add[a-z0-9._]*",
}


def abstract_h200():
    """A context with an abstract mesh whose device is an H200, so that Pallas lowers for
    CUDA without a GPU (older jax lowers without one and has no abstract devices)."""
    try:
        from jax._src.mesh import AbstractDevice

        device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    except (ImportError, TypeError):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh)


def triton_modules(fn, *args):
    """(name, Triton IR text, num_warps, num_stages) of each Pallas Triton kernel that
    ``fn(*args)`` lowers to for CUDA."""
    from jax._src.pallas.triton import lowering

    kept = []
    original = lowering.lower_jaxpr_to_triton_module

    def keep(*a, **k):
        result = original(*a, **k)
        kept.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = keep
    try:
        with abstract_h200():
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    configs = re.findall(
        r"xla\.gpu\.triton.*?mhlo\.backend_config = \{(.*?)\}\s*:", text, flags=re.S
    )
    out = []
    for ir, config in zip(kept, configs):
        name = re.search(r'name = "([^"]+)"', config).group(1)
        warps = int(re.search(r"num_warps = (\d+)", config).group(1))
        stages = int(re.search(r"num_stages = (\d+)", config).group(1))
        out.append((name, ir, warps, stages))
    if len(out) != len(kept):
        raise RuntimeError(f"found {len(kept)} Triton modules but {len(out)} launch configs")
    return out


def to_ptx(ttir_path: str, warps: int, stages: int) -> str | None:
    """PTX for sm_90 from PyPI's triton, or None where it is not installed."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError:
        return None
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    kernel = triton.compile(
        ttir_path,
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )
    return kernel.asm["ptx"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--op", choices=("shrink", "expand"), default="shrink")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=1, help="distinct adapters, shuffled")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument(
        "--candidate",
        type=int,
        default=None,
        help="the tiles of ops.py's PREFILL_SWEEP[op][N] instead of the library's default",
    )
    p.add_argument("--out", default="triton_ptx")
    a = p.parse_args(argv)
    tiles = None
    if a.candidate is not None:
        import ops

        tiles = ops.PREFILL_SWEEP[a.op][a.candidate]
    os.makedirs(a.out, exist_ok=True)
    idx = np.random.default_rng(0).integers(0, a.adapters, a.tokens).astype(np.int32)
    mapping = lj.make_lora_mapping(idx, a.slots)
    t, h, r, slots = a.tokens, a.hidden, a.rank, a.slots
    if a.op == "shrink":
        kw = mapping.shrink_kwargs()
        args = (
            jax.ShapeDtypeStruct((t, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((slots, r, h), jnp.bfloat16),
        )

        def fn(x, lora_a):
            return lora_shrink(x, (lora_a,), **kw, block_sizes=tiles)

    else:
        kw = mapping.expand_kwargs()
        args = (
            jax.ShapeDtypeStruct((t, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, t, r), jnp.float32),
            jax.ShapeDtypeStruct((slots, h, r), jnp.bfloat16),
        )

        def fn(y, lora_h, lora_b):
            return lora_expand(y, lora_h, (lora_b,), offsets=(0,), **kw, block_sizes=tiles)

    with _h200_smem_budget(a.op == "shrink"):
        _write_modules(a, fn, args)


@contextlib.contextmanager
def _h200_smem_budget(wanted: bool):
    """The shrink's tiles on an H200 use the shared memory its SMs opt in to; off a GPU the
    library falls back to 48 KiB, and would pick other tiles (the expand keeps 48 KiB on
    the GPU too unless the variable is set). Sets LORA_JAX_TRITON_SMEM_BUDGET to an
    H200's while inside (unless it is set), then puts it back: called in-process (the
    tests), the rest of the process keeps its own budget."""
    if not wanted or os.environ.get("LORA_JAX_TRITON_SMEM_BUDGET"):
        yield
        return
    os.environ["LORA_JAX_TRITON_SMEM_BUDGET"] = str(pallas_triton._OPT_IN_SMEM[(9, 0)])
    pallas_triton.opt_in_smem_budget.cache_clear()
    try:
        yield
    finally:
        del os.environ["LORA_JAX_TRITON_SMEM_BUDGET"]
        pallas_triton.opt_in_smem_budget.cache_clear()


def _write_modules(a, fn, args):
    """Each Triton module of ``fn(*args)``: its IR and, with PyPI's triton, PTX and a
    summary of how it moves data."""
    t, h, r = a.tokens, a.hidden, a.rank
    print(f"jax {jax.__version__}; {a.op} T={t} H={h} R={r} n={a.adapters}")
    for i, (name, ir, warps, stages) in enumerate(triton_modules(fn, *args)):
        path = os.path.join(a.out, f"{i}_{name}.ttir")
        with open(path, "w") as f:
            f.write(ir)
        ptx = to_ptx(path, warps, stages)
        if ptx is None:
            print(f"{name} (warps {warps}, stages {stages}): {path}; no triton to compile it")
            continue
        with open(path.replace(".ttir", ".ptx"), "w") as f:
            f.write(ptx)
        counts = {k: len(re.findall(v, ptx)) for k, v in PATTERNS.items()}
        adds = sorted(set(re.findall(PATTERNS["atomic add"], ptx)))
        print(f"{name} (warps {warps}, stages {stages}): {counts} {adds}")


if __name__ == "__main__":
    main()
