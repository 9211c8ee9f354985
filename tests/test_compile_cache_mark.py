"""The ``no_compile_cache`` mark (tests/conftest.py): under jax 0.10.2 (whose cache
crashed CI's workers) a marked test compiles without the tests' persistent compilation
cache; an unmarked test writes to it (the control), and so does a marked one on newer jax.
Also the ``--params-per-test`` option's choice of cases."""

import os

import jax
import jax.numpy as jnp
import pytest


def _entries(prefix: str) -> list[str]:
    """Cache entries of programs whose jit name starts with ``prefix`` (jax names an entry
    ``jit_<function>-<hash>-cache``)."""
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not cache:
        pytest.skip("the tests' compilation cache is off in this run (GPU, or turned off)")
    if not os.path.isdir(cache):
        return []
    return [f for f in os.listdir(cache) if f.startswith(f"jit_{prefix}")]


def _compile(fn):
    """Compiles ``fn`` at a shape no other test uses (a fresh program, written if allowed)."""
    jax.block_until_ready(jax.jit(fn)(jnp.arange(11.0, dtype=jnp.float32)))


def _cache_mark_probe_written(x):
    return x * 3.25 + 1.5


def _cache_mark_probe_kept_out(x):
    return x * 4.25 - 0.5


def test_an_unmarked_test_writes_its_programs():
    for name in _entries("_cache_mark_probe_written"):  # an earlier run's: a hit writes none
        os.remove(os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], name))
    _compile(_cache_mark_probe_written)
    assert _entries("_cache_mark_probe_written")
    assert jax.config.jax_enable_compilation_cache


@pytest.mark.no_compile_cache
def test_a_marked_test_compiles_without_the_cache_on_jax_0_10():
    for name in _entries("_cache_mark_probe_kept_out"):  # an earlier run's
        os.remove(os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], name))
    _compile(_cache_mark_probe_kept_out)
    old_jax = jax.__version_info__ < (0, 11)
    assert bool(_entries("_cache_mark_probe_kept_out")) is not old_jax
    assert jax.config.jax_enable_compilation_cache is not old_jax


@pytest.mark.parametrize(
    ("n", "k", "kept"),
    [
        (5, 1, [0]),
        (5, 2, [0, 4]),
        (5, 3, [0, 2, 4]),
        (4, 3, [0, 2, 3]),
        (3, 5, [0, 1, 2]),
        (1, 2, [0]),
    ],
)
def test_params_per_test_keeps_cases_spread_over_the_list(n, k, kept):
    from tests.conftest import _spread

    assert list(_spread(n, k)) == kept


def test_params_per_test_runs_each_test_function_s_spread_cases(tmp_path):
    """A throwaway test file collected under the option: each parametrized function keeps
    its first and last case, a class's methods are grouped apart, a plain test stays."""
    import subprocess
    import sys

    (tmp_path / "test_probe.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('i', range(5))\n"
        "def test_a(i): pass\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "@pytest.mark.parametrize('j', 'xy')\n"
        "def test_b(i, j): pass\n"
        "def test_c(): pass\n"
        "class TestK:\n"
        "    @pytest.mark.parametrize('i', range(4))\n"
        "    def test_a(self, i): pass\n"
    )
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_addoption, pytest_collection_modifyitems  # noqa\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        "--collect-only",
        "--params-per-test",
        "2",
        "--rootdir",
        str(tmp_path),
        str(tmp_path),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    ids = sorted(line.split("::", 1)[1] for line in out.stdout.splitlines() if "::" in line)
    assert ids == sorted(
        [
            "test_a[0]",
            "test_a[4]",
            "test_b[x-0]",
            "test_b[y-2]",
            "test_c",
            "TestK::test_a[0]",
            "TestK::test_a[3]",
        ]
    ), out.stdout + out.stderr
    assert "7/16 tests collected (9 deselected)" in out.stdout, out.stdout
