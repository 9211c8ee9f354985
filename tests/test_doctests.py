"""Every docstring example (`>>>` lines not marked `+SKIP`) runs and prints what it says.

The examples use the names a reader has at hand after the README's imports (`np`, `jnp`,
`jax`, `nnx`, `lj` and lora_jax's public names), besides their module's own.
"""

import doctest
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax
import lora_jax.kernels.shrink_expand as shrink_expand  # the top-level kernels/ folder

MODULES = sorted(
    m.name
    for package in (lora_jax, shrink_expand)
    for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
)
GLOBS = {
    **{k: v for k, v in vars(lora_jax).items() if not k.startswith("_")},
    "np": np,
    "jnp": jnp,
    "jax": jax,
    "nnx": nnx,
    "lj": lora_jax,
}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    default_backend = lora_jax.ops.dispatch_state()
    try:
        for test in doctest.DocTestFinder().find(module, name, globs={**GLOBS, **vars(module)}):
            runner.run(test)
    finally:
        lora_jax.ops.set_default_backend(default_backend[0])
    assert runner.failures == 0, f"{runner.failures} docstring example(s) of {name} failed"
