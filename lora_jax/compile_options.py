"""XLA compile options for jitted decode steps: let LoRA's kernels run beside the base's.

In a decode step every kernel is small, and LoRA adds several to each layer: the shrink
and the expand of each packed projection. Most of their cost is the fixed time a kernel
takes to launch, fill the GPU and drain, not their bytes. Yet the shrink does not depend
on the base matmul: both only read the layer's input. XLA's command buffers (CUDA graphs)
can run such independent kernels side by side when compiled with
``xla_gpu_command_buffer_scheduling_mode=CONCURRENT``; the default ("LHS") runs them one
after another on one stream.

On an H200, a Llama-3-8B-shaped decoder (32 layers, rank 16 on all 7 projections, 64
slots) ran its LoRA decode steps up to 14 % faster with it (benchmarks/RESULTS.md, session
24; base steps 0-3 %): LoRA's cost over base at one token fell from 1.20 x to 1.06 x
(1.11-1.12 x in two other runs), at 64 tokens over 8 adapters from 1.29 x to 1.25 x
(1.21 x with the Pallas kernels forced), at 256 tokens over 64 adapters from 1.35 x to
1.30 x. One case lost, in every run: 16 tokens over 16 adapters, 3-5 % slower (1.23 ->
1.28 x). A 4 x 512-token prefill ran 9 % *slower* (large kernels side by side contend),
so only decode steps ask for it. Measured on one GPU: a tensor-parallel decode step gets
the same option (XLA keeps collectives out of its command buffers by default, so only the
compute between them is rescheduled) but has not been timed with it.

`lora_jax.serving.generate` compiles its decode loop with `decode_compiler_options()`;
a decode step of your own can do the same:

    step = jax.jit(decode_step, compiler_options=lora_jax.decode_compiler_options())

Set ``LORA_JAX_CONCURRENT_DECODE=0`` to compile decode steps as XLA does by default.
"""

from __future__ import annotations

import os

import jax

CONCURRENT_DECODE_ENV = "LORA_JAX_CONCURRENT_DECODE"
"""Environment variable: "0" (or false / off / no) turns the concurrent decode scheduling
off; "1" (true / on / yes) or unset leaves it on."""
_OFF, _ON = ("0", "false", "off", "no"), ("", "1", "true", "on", "yes")

CONCURRENT_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
"""The XLA option `decode_compiler_options` returns on GPU."""


def decode_compiler_options() -> dict[str, str]:
    """``compiler_options`` for a jitted decode step: `CONCURRENT_OPTIONS` on a GPU, ``{}``
    on other backends or when ``LORA_JAX_CONCURRENT_DECODE=0``. Read at each call, so a
    change of the variable reaches steps compiled after it; a value it does not know
    raises ValueError.

    Example:
        >>> step = jax.jit(lambda x: x + 1, compiler_options=decode_compiler_options())
    """
    value = os.environ.get(CONCURRENT_DECODE_ENV, "").strip().lower()
    if value not in _OFF + _ON:
        raise ValueError(
            f"{CONCURRENT_DECODE_ENV}={os.environ[CONCURRENT_DECODE_ENV]!r}: use 0 / false / "
            "off / no to turn the concurrent decode off, 1 / true / on / yes (or unset) for on"
        )
    if value in _OFF:
        return {}
    if jax.default_backend() != "gpu":
        return {}
    return dict(CONCURRENT_OPTIONS)
