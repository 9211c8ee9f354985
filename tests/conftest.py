"""8 simulated CPU devices for mesh tests; must run before jax is imported."""

import os
import pkgutil
import re
import tempfile

# Without a CUDA plugin the tests run on the CPU, where compiling is most of their time:
# XLA's LLVM backend at -O0 cut the suite's time by ~20 % on a 2-core machine (the shapes
# are tiny, so the slower code costs little; XLA's own HLO passes are unchanged).
_CUDA = any(m.name.startswith("jax_cuda") for m in pkgutil.iter_modules())
_FAST_COMPILE = "" if _CUDA else " --xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8" + _FAST_COMPILE)
# jax's persistent compilation cache, shared by the xdist workers and the subprocesses the
# tests start (notebook kernel, examples, benchmarks): many tests compile the same small
# programs (same model, same shapes), and on CPU a cache hit skips XLA's compile. A cold
# cache cut tests/test_layers.py + test_wrap.py from 107 to 90 s on 2 cores. Its key
# holds the jax version, backend and flags, so runs of other versions never share
# entries. LORA_JAX_TEST_COMPILE_CACHE= (empty) turns it off.
_CACHE = os.environ.get(
    "LORA_JAX_TEST_COMPILE_CACHE", os.path.join(tempfile.gettempdir(), "lora_jax_test_jax_cache")
)
if _CACHE and not _CUDA:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402
import pytest  # noqa: E402

# f32 oracles compare at ~1e-4: keep GPUs from using TF32 for f32 matmuls.
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_addoption(parser):
    parser.addoption(
        "--params-per-test",
        type=int,
        default=0,
        metavar="K",
        help="run at most K parameter sets of each parametrized test, spread evenly over its "
        "list (first and last kept); 0 (default) runs them all. CI's second jax version "
        "runs every test function this way: the first runs every case.",
    )


def _spread(n, k):
    """k indices spread evenly over range(n), the first and last included."""
    if k >= n:
        return range(n)
    if k == 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() == "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this run is on " + jax.default_backend())
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
    k = config.getoption("--params-per-test")
    if k < 0:
        raise pytest.UsageError(f"--params-per-test takes a count >= 0, got {k}")
    if k:
        groups = {}
        for item in items:
            key = (item.nodeid.split("[", 1)[0], getattr(item, "originalname", item.name))
            groups.setdefault(key, []).append(item)
        keep = {id(g[i]) for g in groups.values() for i in _spread(len(g), k)}
        dropped = [item for item in items if id(item) not in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if id(item) in keep]


# Only jax 0.10.2's cache crashed (newer versions never did in CI): on those the mark is a
# no-op and the marked tests share the cache like the rest.
_CACHE_CRASHES = jax.__version_info__ < (0, 11)


@pytest.fixture(autouse=True)
def _no_compile_cache(request):
    """Under the ``no_compile_cache`` mark the test compiles without the persistent
    compilation cache: nothing read from it, nothing written. CI on jax 0.10.2 lost an
    xdist worker to a segfault inside the cache five times in sessions 53-56, serializing
    an executable (`put_executable_and_time`) or deserializing one
    (`get_executable_and_time`), each time in tests/test_wrap.py, and four times in
    sessions 57-58 in tests/test_training.py's mesh tests; those tests never crashed
    alone. jax decides once per process whether the cache is used, so the switch goes
    with `reset_cache`, and back after the test."""
    if (
        request.node.get_closest_marker("no_compile_cache") is None
        or not _CACHE
        or _CUDA
        or not _CACHE_CRASHES
    ):
        yield
        return
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


_FEW_DEVICES = re.compile(r"Number of devices (\d+) must be >= the product of mesh_shape (\(.*?\))")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A mesh test on a machine with fewer devices than its mesh (one GPU, where the CPU
    runs simulate 8) skips with the reason instead of failing in `jax.make_mesh`."""
    outcome = yield
    err = outcome.excinfo[1] if outcome.excinfo else None
    found = _FEW_DEVICES.search(str(err)) if isinstance(err, ValueError) else None
    if found and jax.device_count() < 8 and hasattr(outcome, "force_exception"):
        outcome.force_exception(
            pytest.skip.Exception(
                f"mesh {found.group(2)} needs more devices than the {found.group(1)} "
                f"of this {jax.default_backend()} run",
                _use_item_location=True,
            )
        )
