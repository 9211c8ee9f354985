"""benchmarks/vllm_ops.py (vLLM's Triton ops on ops.py's cells) times what ops.py times:
the same cells, the same token -> slot mappings call by call, the same roofline bytes; and
its side-by-side table does the right arithmetic. Needs torch (the script is torch-only),
not the local vLLM copy nor Triton."""

import dataclasses
import os
import sys
import types

import numpy as np
import pytest

pytest.importorskip("torch", reason="benchmarks/vllm_ops.py is a torch script: no torch here")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import ops  # noqa: E402
import vllm_ops  # noqa: E402


@pytest.mark.parametrize("layout", ["shuffled", "runs"])
@pytest.mark.parametrize("tokens,adapters", [(1, 1), (16, 8), (40, 3), (64, 64)])
def test_mappings_are_ops_mappings(layout, tokens, adapters, monkeypatch):
    """Call i of a cell maps every token to the slot ops.py's call i maps it to."""
    monkeypatch.setattr(ops, "LAYOUT", layout)  # ops.build reads the global main() sets
    # The draws are ops.build's own; only the work lists (compiled per shape) are skipped.
    monkeypatch.setattr(ops, "metadata", lambda idx, max_loras: {"token_lora_indices": idx})
    c = ops.Case("shrink", tokens, 64, 16, adapters)
    _, _, metas = ops.build(c, calls=3)
    got = vllm_ops.mappings(vllm_ops.Case(*dataclasses.astuple(c)), 3, layout)
    assert len(got) == len(metas)
    for m, idx in zip(metas, got):
        np.testing.assert_array_equal(np.asarray(m["token_lora_indices"]), idx)


def test_cells_bytes_and_bounds_are_ops():
    """The default grid, the roofline bytes, the L2 rotation and the error bounds match."""
    grid = dict(
        ops=["shrink", "expand"],
        tokens=[1, 16, 64, 256, 1024, 4096, 16384],
        hiddens=[4096, 8192],
        ranks=[16, 64, 128],
        adapters=[1, 8, 64],
    )
    want = ops.cases(types.SimpleNamespace(**grid))
    got = vllm_ops.cases(*grid.values())
    assert [dataclasses.astuple(c) for c in got] == [dataclasses.astuple(c) for c in want]
    for c in want:
        assert vllm_ops.ideal_bytes(vllm_ops.Case(*dataclasses.astuple(c))) == ops.ideal_bytes(c)
    for nbytes in (2, 16 * 4096 * 2, 16384 * 4096 * 2):
        assert vllm_ops.rotation(nbytes, 32) == ops.rotation(nbytes, 32)
    assert vllm_ops.ERR_BOUND == ops.ERR_BOUND
    assert (vllm_ops.HBM_GBPS, vllm_ops.MAX_LORAS) == (ops.HBM_GBPS, ops.MAX_LORAS)


def test_busy_time_is_the_union_of_kernel_intervals():
    """Against a brute-force mask: overlaps count once, gaps not at all."""
    rng = np.random.default_rng(0)
    starts = np.sort(rng.integers(0, 2000, 40))
    ends = starts + rng.integers(1, 120, 40)
    spans = [(float(a), float(b), f"k{i % 3}") for i, (a, b) in enumerate(zip(starts, ends))]
    busy, by_name = vllm_ops.union_us(spans)
    mask = np.zeros(int(ends.max()) + 1, bool)
    for a, b in zip(starts, ends):
        mask[a:b] = True
    assert busy == pytest.approx(mask.sum())
    assert sum(by_name.values()) == pytest.approx(float((ends - starts).sum()))


def test_against_table_math():
    """vllm / ours per cell (> 1: ours is faster); cells either side lacks get no ratio."""
    cell = dict(op="shrink", tokens=16, hidden=4096, rank=16)
    ours = [
        dict(cell, adapters=1, impls={"ours": {"us": 10.0}, "gather": {"us": 50.0}}),
        dict(cell, adapters=8, impls={"ours": {"skipped": "compile > 160 s"}}),
        dict(cell, adapters=64, impls={"ours": {"us": 4.0}}),
        dict(cell, adapters=16, impls={"ours": {"us": 3.0}}),
    ]
    theirs = [
        dict(cell, adapters=1, impls={"vllm": {"us": 25.0}}),
        dict(cell, adapters=8, impls={"vllm": {"us": 30.0}}),
        dict(cell, adapters=64, impls={"vllm": {"us": 2.0}}),
        dict(cell, adapters=16, impls={"vllm": {"skipped": "run: OutOfMemoryError"}}),
        dict(cell, adapters=2, impls={"vllm": {"us": 7.0}}),  # not in ours
    ]
    vs = vllm_ops.compare(ours, theirs)
    assert [r["adapters"] for r in vs] == [1, 8, 64, 16, 2]
    assert [r["ours_us"] for r in vs] == [10.0, None, 4.0, 3.0, None]
    assert [r["vllm_us"] for r in vs] == [25.0, 30.0, 2.0, None, 7.0]
    assert [r["vllm_over_ours"] for r in vs] == [2.5, None, 0.5, None, None]
    text = vllm_ops.versus_table(vs)
    assert "| shrink | 16 | 4096 | 16 | 1 | 10.0 | 25.0 | 2.50 |" in text
    assert "| shrink | 16 | 4096 | 16 | 8 | – | 30.0 | – |" in text
    assert "ours faster in 1/2 cells; geomean vllm / ours 1.12" in text  # sqrt(2.5 * 0.5)


def test_missing_vllm_copy_names_the_option(tmp_path):
    with pytest.raises(SystemExit, match="--vllm-src"):
        vllm_ops.main(["--vllm-src", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o.json")])


def test_no_gpu_skips_cleanly(tmp_path, capsys, monkeypatch):
    """Without a CUDA GPU (and without --interpret) the script notes the skip and returns
    before importing the vLLM copy (here an empty stand-in) or Triton."""
    ops_dir = tmp_path / "vllm" / "lora" / "ops" / "triton_ops"
    ops_dir.mkdir(parents=True)
    (ops_dir / "lora_shrink_op.py").write_text("raise ImportError('must not be imported')\n")
    monkeypatch.setattr(vllm_ops.torch.cuda, "is_available", lambda: False)
    vllm_ops.main(["--vllm-src", str(tmp_path), "--out", str(tmp_path / "o.json")])
    assert "skipped: no CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "o.json").exists()
