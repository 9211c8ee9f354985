"""Runs notebooks/quickstart.ipynb top to bottom in a fresh kernel; a cell that raises fails.

The kernel is this interpreter's ipykernel (jupyter_client swaps the `python` of the
`python3` kernel spec for `sys.executable`), so the notebook sees the same lora_jax.
Also checks the notebook is committed without outputs.
"""

import os
import pathlib
import sys
import time

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def _load():
    nbformat = pytest.importorskip("nbformat", reason="nbformat is in the `test` extra")
    return nbformat, nbformat.read(NOTEBOOK, as_version=4)


def test_notebook_is_stripped():
    _, nb = _load()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the notebook has no code cells"
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.outputs or c.execution_count is not None)
    ]
    assert not dirty, f"cells {dirty} hold outputs; strip them before committing"


def test_notebook_runs(monkeypatch):
    nbformat, nb = _load()
    nbclient = pytest.importorskip("nbclient", reason="nbclient is in the `test` extra")
    pytest.importorskip("ipykernel", reason="ipykernel is in the `test` extra")
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    if spec.argv[0] not in ("python", "python3", sys.executable):
        pytest.skip(f"the python3 kernel spec runs {spec.argv[0]}, not this interpreter")
    # The kernel inherits the environment: no display; of XLA_FLAGS only the suite's
    # fast-compile flag (33 -> 25 s), the notebook sets its own 8-device flag.
    monkeypatch.setenv("MPLBACKEND", "Agg")
    fast = [f for f in os.environ.get("XLA_FLAGS", "").split() if "optimization_level" in f]
    monkeypatch.setenv("XLA_FLAGS", " ".join(fast))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    client = nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    elapsed = time.perf_counter() - t0
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "same as unsharded: True" in text
    assert "max |LoRA - merged| logits" in text
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    print(f"notebook ran in {elapsed:.1f} s, {len(images)} figure(s), cwd {os.getcwd()}")
