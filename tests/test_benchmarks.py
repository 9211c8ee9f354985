"""The benchmark scripts run on CPU (tiny model) and report what they claim to."""

import json
import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import profile_decode  # noqa: E402
import tp  # noqa: E402


@pytest.mark.slow  # ~1 min; tests/test_sharding_hlo.py checks the collectives in every run
def test_tp_small_lora_adds_no_collective_bytes(tmp_path, capsys):
    """At tp = 2 plain LoRA's collectives equal the base model's (column LoRA stays
    sharded, row LoRA joins the base all-reduce); fully sharded adds some; tp = 1 none."""
    if jax.device_count() < 2:
        pytest.skip(f"tp = 2 needs 2 devices; this run sees {jax.device_count()}")
    out = tmp_path / "tp.json"
    tp.main(["--small", "--tp", "1,2", "--batches", "4", "--prefill", "1x8", "--out", str(out)])
    import json

    rows = json.loads(out.read_text())["rows"]
    coll = {(r["tp"], r["variant"], r["kind"]): r["collective_bytes"] for r in rows}
    for kind in ("decode", "prefill"):
        assert coll[(1, "base", kind)] == {} and coll[(1, "lora", kind)] == {}
        assert coll[(2, "lora", kind)] == coll[(2, "base", kind)] != {}
        sharded = sum(coll[(2, "lora_fully_sharded", kind)].values())
        assert sharded > sum(coll[(2, "base", kind)].values())
    assert all(r["step_ms"] > 0 for r in rows)
    assert "x base" in capsys.readouterr().out


def test_tp_prefill_hints_are_what_the_host_finds():
    """tp.py's hinted prefill passes what `make_lora_mapping` would find from numpy
    indices (`generate`'s prefill passes the same): prompts of 128 tokens are whole
    tiles, a shuffled step has none."""
    import numpy as np

    import lora_jax as lj

    prompts = np.repeat(tp.token_slots(4, 4), 128)
    shuffled = np.random.default_rng(0).permutation(prompts)
    for idx, want in ((prompts, "all"), (shuffled, "none")):
        found = lj.make_lora_mapping(idx, 8, is_prefill=True, host_hints=True)
        hints = tp.prefill_hints(idx)
        assert hints == dict(prompt_tiles=found.prompt_tiles, whole_tiles=found.whole_tiles)
        assert hints["whole_tiles"] == want


def test_profile_summary_matches_brute_force():
    """Busy time is the union of kernel intervals: check against a per-ns mask."""
    rng = np.random.default_rng(0)
    starts = np.sort(rng.integers(0, 2000, 40))
    durs = rng.integers(1, 120, 40)
    names = [f"k{i % 5}" for i in range(40)]
    events = list(zip(names, starts.tolist(), durs.tolist()))
    got = profile_decode.summarize(events, calls=2, steps=5)
    mask = np.zeros(int((starts + durs).max()) + 1, bool)
    for s, d in zip(starts, durs):
        mask[s : s + d] = True
    per = 2 * 5 * 1e3
    assert got["busy_us"] == pytest.approx(mask.sum() / per)
    assert got["span_us"] == pytest.approx(((starts + durs).max() - starts.min()) / per)
    for k in set(names):
        want = sum(d for n, d in zip(names, durs) if n == k) / per
        assert got["kernels"][k] == pytest.approx(want)
    assert got["launches"] == pytest.approx(40 / 10)
    # Idle: the mask's holes; the longest (calls - 1 = 1) is between calls, each other is
    # charged to the kernel that starts where it ends.
    holes, t, last = [], int(starts.min()), int((starts + durs).max())
    while t < last:
        if mask[t]:
            t += 1
            continue
        e = t
        while not mask[e]:
            e += 1
        holes.append((e - t, e))
        t = e
    holes.sort(reverse=True)
    assert got["idle_us"] == pytest.approx(sum(h for h, _ in holes) / per)
    assert got["between_calls_us"] == pytest.approx(holes[0][0] / per)
    want_before = {}
    for h, end in holes[1:]:
        name = next(n for n, st in zip(names, starts) if st == end)
        want_before[name] = want_before.get(name, 0) + h / per
    assert got["idle_before"] == pytest.approx(want_before)


@pytest.mark.slow  # ~20 s; the benchmark tool, checked on the oldest jax only
def test_ops_accuracy_check_catches_a_wrong_kernel(tmp_path, monkeypatch):
    """benchmarks/ops.py checks our kernels against the jnp oracle (in token chunks, the
    last one partial) for every cell, and flags a kernel that is 1 % off."""
    import json

    import ops

    monkeypatch.setattr(ops, "REF_CHUNK_BYTES", 16 * 64 * 4 * 7)  # 7 tokens per chunk
    argv = ["--interpret", "--timer", "trace", "--tokens", "40", "--hiddens", "64"]
    argv += ["--ranks", "16", "--adapters", "8", "--impls", "ours", "--out", str(tmp_path)]
    ops.main(argv)
    rows = json.loads((tmp_path / "ops.json").read_text())
    assert [r["op"] for r in rows] == ["shrink", "expand"]
    for r in rows:
        assert r["err_ok"] and r["max_rel_err"] <= ops.ERR_BOUND[r["op"]]
        assert r["impls"]["ours"]["us"] > 0

    real = ops.lora_shrink
    monkeypatch.setattr(ops, "lora_shrink", lambda *a, **k: real(*a, **k) * 1.01)
    ops.main(argv[:-1] + [str(tmp_path)] + ["--ops", "shrink"])
    (row,) = json.loads((tmp_path / "ops.json").read_text())
    assert not row["err_ok"] and row["max_rel_err"] == pytest.approx(0.01, rel=1e-3)


@pytest.mark.slow  # a benchmark script's check: once, in the 3.11 run
def test_ops_runs_layout_is_one_run_per_adapter(tmp_path, monkeypatch):
    """--layout runs: each adapter's tokens form one run (prompts); the cells still check."""
    import json

    import ops

    monkeypatch.setattr(ops, "LAYOUT", "shuffled")  # main() sets it; restored after
    argv = ["--interpret", "--tokens", "40", "--hiddens", "64", "--ranks", "16"]
    argv += ["--adapters", "4", "--impls", "ours", "--layout", "runs", "--out", str(tmp_path)]
    ops.main(argv)
    assert all(r["err_ok"] for r in json.loads((tmp_path / "ops.json").read_text()))
    _, _, metas = ops.build(ops.Case("shrink", 40, 64, 16, 4), calls=2)
    for m in metas:
        idx = np.asarray(m["token_lora_indices"])
        assert (np.diff(idx) != 0).sum() == 3  # 4 runs


@pytest.mark.parametrize("op", ["shrink", "expand"])
def test_ops_impls_agree_and_calls_share_nothing(op, monkeypatch):
    """Every impl that benchmarks/ops.py times computes the same calls (ours, the work
    lists built per call, gather, one-hot, ragged_dot, the library's XLA backend with its
    one-hot rule either way); every call has its own x / h, and
    the expand's rotated y buffers each take exactly their calls' updates."""
    import cells
    import jax.numpy as jnp
    import ops

    monkeypatch.setattr(ops, "INTERPRET", True)
    c = ops.Case(op, 24, 64, 16, 5)
    calls = 6
    assert ops.rotation(24 * 64 * 2, calls) == calls  # small y: one buffer per call
    monkeypatch.setattr(cells, "L2_BYTES", 1)  # a tiny L2: rotate y over the minimum, 4
    inputs, w, metas = ops.build(c, calls)
    assert len(w) == calls and all(v.shape[0] == ops.MAX_LORAS for v in w)
    if op == "expand":
        assert len(inputs[1]) == 4
    firsts = inputs if op == "shrink" else inputs[0]
    assert len(firsts) == calls and len({float(jnp.sum(v)) for v in firsts}) == calls
    wt = [jnp.swapaxes(v, 1, 2) for v in w]
    outs = {
        "ours": ops.ours(c, None)(inputs, w, metas),
        "inline": ops.ours(c, None, ready_work_lists=False)(inputs, w, metas),
        "gather": ops.gather_einsum(c)(inputs, w, metas),
        "onehot": ops.one_hot_einsum(c)(inputs, w, metas),
        "ragged": ops.ragged(c)(inputs, wt, metas),
    }
    from lora_jax import ops as lops

    rule, use_one_hot, seen = lops.ONE_HOT_TOKENS_PER_SLOT, lops._use_one_hot, []

    def spy(num_tokens, num_slots):  # the rule each call of the backend ran under
        seen.append(lops.ONE_HOT_TOKENS_PER_SLOT)
        return use_one_hot(num_tokens, num_slots)

    monkeypatch.setattr(lops, "_use_one_hot", spy)
    for name, forced in ops.XLA_RULES.items():  # the library's XLA backend, rule as named
        seen.clear()
        outs[name] = ops.library_xla(c, name)(inputs, w, metas)
        assert seen == [rule if forced is None else forced] * calls, name
        assert lops.ONE_HOT_TOKENS_PER_SLOT == rule  # put back after the calls
    if op == "expand":  # the y buffers after all calls, vs the updates applied in numpy
        hs, ys = inputs
        want = [np.asarray(y, np.float32) for y in ys]
        for i, m in enumerate(metas):
            idx = np.asarray(m["token_lora_indices"])
            b = np.asarray(w[i % len(w)], np.float32)[idx]  # [T, N, R]
            h = np.asarray(hs[i][0].astype(jnp.bfloat16), np.float32)
            want[i % len(ys)] += np.einsum("tr,tnr->tn", h, b)
        for name, (_, got) in outs.items():
            for g, y in zip(got, want):
                np.testing.assert_allclose(
                    np.asarray(g, np.float32), y, rtol=0.05, atol=0.1, err_msg=name
                )
        return
    for name, got in outs.items():
        for i, m in enumerate(metas):
            idx = np.asarray(m["token_lora_indices"])
            a = np.asarray(w[i % len(w)], np.float32)[idx]  # [T, R, H]
            want = np.einsum("th,trh->tr", np.asarray(inputs[i], np.float32), a)
            g = np.asarray(got[i][0] if got[i].ndim == 3 else got[i])
            np.testing.assert_allclose(g, want, rtol=1e-2, atol=1e-2, err_msg=name)


@pytest.mark.parametrize("op", ["shrink", "expand"])
def test_ops_stream_floor_moves_every_activation_byte(op):
    """The `stream` floor reads all of x (shrink) or h and y (expand) and writes outputs
    of the op's shape: each value checked against numpy, so no byte is skipped."""
    import jax
    import ops

    c = ops.Case(op, 24, 64, 16, 5)
    calls = 6
    inputs, w, metas = ops.build(c, calls)
    got = jax.jit(ops.stream(c))(inputs, w, metas)
    if op == "shrink":
        for x, g in zip(inputs, got):
            want = np.asarray(x, np.float32).reshape(24, 16, 4).sum(-1)
            assert g.shape == (24, 16)
            np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-5)
        return
    hs, ys = inputs
    want = [np.asarray(y, np.float32) for y in ys]
    for i, h in enumerate(hs):  # call i updates y buffer i % len(ys)
        want[i % len(ys)] = want[i % len(ys)] + np.asarray(h[0]).sum(-1, keepdims=True)
        want[i % len(ys)] = want[i % len(ys)].astype(ys[0].dtype).astype(np.float32)
    for g, y in zip(got[1], want):
        np.testing.assert_allclose(np.asarray(g, np.float32), y, rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_tp_small_runs_on_4_and_8_devices(tmp_path):
    """tp.py runs for any device count (DESIGN §5): at tp = 4 and 8 plain LoRA adds no
    collective bytes and fully sharded LoRA adds some."""
    import json

    if len(__import__("jax").devices()) < 8:
        pytest.skip("needs 8 (CPU) devices")
    out = tmp_path / "tp.json"
    tp.main(["--small", "--tp", "4,8", "--batches", "4", "--prefill", "", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    coll = {(r["tp"], r["variant"]): sum(r["collective_bytes"].values()) for r in rows}
    for n in (4, 8):
        assert coll[(n, "lora")] == coll[(n, "base")] > 0
        assert coll[(n, "lora_fully_sharded")] > coll[(n, "base")]


def test_mosaic_probe_layouts_are_what_they_say():
    """The probe's token layouts (its timing needs a Hopper GPU): one adapter; prompts of
    256-2048 tokens from 8 adapters, in order; N adapters in equal runs; 64 adapters
    shuffled, each equally often."""
    import mosaic_probe

    rng = np.random.default_rng(0)
    assert (mosaic_probe.layout("one", 300, rng) == 7).all()
    runs = mosaic_probe.layout("runs8", 8192, rng)
    assert len(runs) == 8192 and len(set(runs.tolist())) <= 8
    cuts = np.flatnonzero(np.diff(runs)) + 1
    lengths = np.diff(np.concatenate([[0], cuts, [len(runs)]]))
    assert lengths[:-1].min() >= 256  # a run may continue into the next prompt, never shorter
    shuffled = mosaic_probe.layout("shuffled64", 4096, rng)
    assert (np.bincount(shuffled, minlength=64) == 64).all()
    assert (np.diff(shuffled) != 0).mean() > 0.9  # no long runs
    even = mosaic_probe.layout("even8", 1024, rng)  # ops.py --layout runs: equal runs
    assert len(set(even.tolist())) == 8
    assert (even.reshape(8, 128) == even[::128, None]).all()
    with pytest.raises(ValueError, match="one, runs8, evenN or shuffled64"):
        mosaic_probe.layout("sorted", 16, rng)


def test_mapping_benchmark_times_each_token_count(tmp_path):
    """benchmarks/mapping.py: one row per token count, both timings, in the JSON."""
    import json

    import mapping

    out = tmp_path / "mapping.json"
    mapping.main(["--tokens", "16,40", "--calls", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [16, 40]
    assert all(r["eager_ms"] > 0 and r["dispatch_ms"] > 0 for r in rows)


def test_eager_mesh_benchmark_reuses_its_programs(tmp_path):
    """benchmarks/eager_mesh.py: each eager call checked against the jitted step inside the
    script; with the cache, calls after the first compile no new program."""
    import eager_mesh

    out = tmp_path / "eager.json"
    eager_mesh.main(["--tp", "2", "--layers", "1", "--calls", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    cached = [r for r in rows if r["cache"]]
    assert [r["call"] for r in cached] == [0, 1]
    assert cached[0]["programs"] > 0
    assert {r["programs"] for r in cached} == {cached[0]["programs"]}
    assert all(r["programs"] == cached[0]["programs"] for r in rows if not r["cache"])


@pytest.mark.slow  # ~15 s of interpret-mode kernels
@pytest.mark.parametrize(
    "op, variants", [("shrink", ["default", "acq_rel"]), ("expand", ["default", "no_y"])]
)
def test_kernel_probe_checks_the_default_and_times_each_variant(
    tmp_path, monkeypatch, op, variants
):
    """benchmarks/shrink_probe.py: the default kernel matches the jnp oracle, every asked
    variant is timed, and the patched kernel module is restored afterwards."""
    import json
    import os
    import sys

    import shrink_probe

    from lora_jax.kernels.shrink_expand import pallas_triton, pallas_triton_shrink

    before = (pallas_triton.expand_tile, pallas_triton_shrink._add_to)
    monkeypatch.delenv("LORA_JAX_RELAXED_ATOMICS", raising=False)
    out = tmp_path / "probe.json"
    argv = ["shrink_probe.py", "--op", op, "--cells", "40x256x16x4", "--interpret"]
    argv += ["--variants", ",".join(variants), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    shrink_probe.main()
    (row,) = json.loads(out.read_text())
    assert (row["op"], row["tokens"], row["hidden"], row["rank"]) == (op, 40, 256, 16)
    assert row["max_rel_err"] < {"shrink": 1e-4, "expand": 8e-3}[op]
    assert set(row["us"]) == set(variants) and all(v > 0 for v in row["us"].values())
    assert "LORA_JAX_RELAXED_ATOMICS" not in os.environ
    assert (pallas_triton.expand_tile, pallas_triton_shrink._add_to) == before


@pytest.mark.slow  # ~14 s of interpret-mode kernels; a probe's check, once (the 3.11 run)
def test_decode_probe_checks_every_kernel_variant(tmp_path, monkeypatch):
    """benchmarks/decode_probe.py: every Pallas shrink and expand variant is checked
    against the XLA op of the same projection and timed."""
    import json

    import decode_probe

    from lora_jax import ops as lora_ops

    monkeypatch.setattr(decode_probe, "PROJECTIONS", {"qkv": (64, (64, 32, 32))})
    monkeypatch.setattr(lora_ops, "PALLAS_INTERPRET", False)  # the probe sets it
    out = tmp_path / "probe.json"
    decode_probe.main(
        ["--projections", "qkv", "--tokens", "16", "--adapters", "4", "--calls", "1",
         "--reps", "1", "--interpret", "--expand-tiles", "16:32:1:4:1:0,pt:32",
         "--shrink-tiles", "pt:16:32", "--out", str(out)]
    )  # fmt: skip
    monkeypatch.setattr(decode_probe, "INTERPRET", False)
    (row,) = json.loads(out.read_text())["rows"]
    checked = {k: v for k, v in row["err"].items()}
    assert set(checked) == {
        "xla+pallas", "xla+pallas[16:32:1:4:1:0]", "xla+pallas[pt:32]",
        "shrink:pallas", "shrink:pallas[pt:16:32]",
    }  # fmt: skip
    assert all(isinstance(v, float) and v < 1e-2 for v in checked.values()), checked
    assert all(v > 0 for v in row["us"].values())


def test_ncu_summary_reads_a_raw_csv(tmp_path, capsys):
    """ncu_cells.py --summarize: the program's own output lines are dropped, the units row
    skipped, each kernel's metrics scaled, the top stall reasons kept."""
    import ncu_cells

    cols = [
        "ID",
        "Kernel Name",
        "gpu__time_duration.sum",
        "dram__bytes.sum.per_second",
        "launch__shared_mem_per_block",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    ]
    rows = [
        cols,
        ["", "", "nsecond", "byte/second", "byte", "", "", "%"],
        ["0", "lora_shrink_atomic", "19,488", "2.39e12", "50176", "3.5", "8.0", "27.4"],
    ]
    path = tmp_path / "raw.csv"
    lines = ["jax 0.11.2, NVIDIA H200"] + [",".join(f'"{v}"' for v in r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    (got,) = ncu_cells.summarize([str(path)])
    assert got["kernel"] == "lora_shrink_atomic"
    assert got["µs"] == pytest.approx(19.488)
    assert got["DRAM GB/s"] == pytest.approx(2390.0)
    assert got["smem KiB"] == pytest.approx(49.0)
    assert got["top stalls"] == "long_scoreboard 8.0, barrier 3.5"
    assert got["L2 hit %"] is None  # not in this file
    assert got["tensor pipe %"] == pytest.approx(27.4)
    ncu_cells.print_table([got])
    assert "| lora_shrink_atomic | 19.5 |" in capsys.readouterr().out


def test_rect_probes_match_the_product():
    """stream_floor_triton's one-adapter probes (interpret mode): the shrink's hidden split
    adds its partials into the zeroed output, the expand updates y over its tiles."""
    import jax
    import stream_floor_triton as sft

    key = jax.random.key(0)
    x, a = (
        jax.random.normal(jax.random.fold_in(key, i), s)
        for i, s in enumerate([(64, 512), (32, 512)])
    )
    got = sft.shrink_rect(x, a, tiles=(32, 64, 4, 2, 4), interpret=True)
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(a).T, rtol=1e-4, atol=1e-3)
    y, h, b = (
        jax.random.normal(jax.random.fold_in(key, 10 + i), s)
        for i, s in enumerate([(64, 256), (64, 32), (256, 32)])
    )
    got = sft.expand_rect(y, h, b, tiles=(32, 64, 4), interpret=True)
    np.testing.assert_allclose(got, y + np.asarray(h) @ np.asarray(b).T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="expand_rect"):
        sft.expand_rect(y[:48], h[:48], b, tiles=(32, 64, 4), interpret=True)
    assert sft.parse_tiles("rect", "dflt") == "dflt"
    assert sft.parse_tiles("rect:64:128:4", None) == (64, 128, 4)


@pytest.mark.slow  # a benchmark script's check: once, in the 3.11 run
def test_ops_rect_probe_is_checked(tmp_path, monkeypatch):
    """ops.py --impls rect[:tiles]: n = 1 cells only, each op takes the names whose tiles
    are its own, and a probe 1 % off is reported as wrong, not timed."""
    import json

    import ops
    import stream_floor_triton as sft

    cell = dict(hidden=512, rank=16, tokens=64)
    one, eight = (ops.Case(op="shrink", adapters=n, **cell) for n in (1, 8))
    names = ["ours", "rect", "rect:32:64:4:2:2", "rect:32:64:4"]
    assert ops.rect_names(one, names) == ["rect", "rect:32:64:4:2:2"]
    assert ops.rect_names(ops.Case(op="expand", adapters=1, **cell), names) == [
        "rect",
        "rect:32:64:4",
    ]
    assert ops.rect_names(eight, names) == []

    argv = ["--interpret", "--timer", "wall", "--tokens", "64", "--hiddens", "512", "--ranks", "16"]
    argv += ["--adapters", "1", "--impls", ",".join(names[:1] + names[2:]), "--out", str(tmp_path)]
    ops.main(argv)
    rows = {r["op"]: r for r in json.loads((tmp_path / "ops.json").read_text())}
    assert rows["shrink"]["impls"]["rect:32:64:4:2:2"]["max_rel_err"] < 1e-4
    assert rows["expand"]["impls"]["rect:32:64:4"]["max_rel_err"] < ops.ERR_BOUND["expand"]
    assert "rect:32:64:4" not in rows["shrink"]["impls"]

    real = sft.shrink_rect
    monkeypatch.setattr(sft, "shrink_rect", lambda *a, **k: real(*a, **k) * 1.01)
    ops.main(argv[:-1] + [str(tmp_path)] + ["--ops", "shrink"])
    (row,) = json.loads((tmp_path / "ops.json").read_text())
    assert row["impls"]["rect:32:64:4:2:2"]["skipped"].startswith("wrong")


def test_stream_floor_kernels_lower_for_cuda():
    """benchmarks/stream_floor.py's Mosaic variants lower for CUDA (its timing needs a
    Hopper GPU), with a padded row stride and interleaved splits."""
    import functools

    import jax
    import jax.numpy as jnp

    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    import stream_floor

    x = jax.ShapeDtypeStruct((512, 1024 + 64), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16)
    for variant, order in zip(stream_floor.VARIANTS, "bib"):
        f = functools.partial(
            stream_floor.tile_kernel,
            variant=variant,
            block_m=128,
            block_k=64,
            stages=4,
            split=2,
            order=order,
        )
        text = jax.jit(f).trace(x, a).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, variant


def test_cluster_shrink_probe_lowers_for_cuda():
    """benchmarks/cluster_shrink.py's probe kernel lowers for CUDA with and without its
    2-CTA cluster (its numbers need a Hopper GPU: cluster_probe.py checks them against
    x @ A.T there); only the cluster form asks for cluster block ids."""
    import jax

    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    import cluster_shrink

    for cluster, wgs in ((2, 1), (1, 1), (2, 2)):
        text = cluster_shrink.lower_for_cuda(
            tokens=512, hidden=512, rank=64, cluster=cluster, wgs=wgs, split=2
        )
        assert "mosaic_gpu" in text
        assert ("cluster_block_id" in text) == (cluster > 1), (cluster, wgs)
    with pytest.raises(ValueError, match="multiple of cluster"):
        cluster_shrink.lower_for_cuda(tokens=384, hidden=512, rank=64, cluster=2)


def test_triton_stream_probes_lower_for_cuda():
    """stream_floor_triton's Triton variants (session 35's elementwise x stream and the
    atomic rectangle dots among them) lower for CUDA, one Triton kernel each; their
    numbers are checked on the GPU (stream_floor.py checks the dots against x @ A.T)."""
    import functools

    import jax
    import jax.numpy as jnp

    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    import stream_floor_triton as sft
    import triton_ptx

    x = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((16, 1024), jnp.bfloat16)
    for variant in sft.VARIANTS + sft.ATOMIC_VARIANTS:
        fn = sft.tile_kernel_atomic if variant in sft.ATOMIC_VARIANTS else sft.tile_kernel
        f = functools.partial(
            fn, variant=variant, block_m=32, block_k=128, warps=4, stages=3, split=2
        )
        with triton_ptx.abstract_h200():
            text = jax.jit(f).trace(x, a).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 1, variant


def test_triton_ptx_keeps_each_kernels_ir(tmp_path):
    """benchmarks/triton_ptx.py keeps the Triton IR of the library's kernels for a shape,
    with the launch's warps and stages (PTX only where PyPI's triton is installed)."""
    import jax

    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    import os

    import triton_ptx

    from lora_jax.kernels.shrink_expand import pallas_triton

    before = os.environ.get("LORA_JAX_TRITON_SMEM_BUDGET"), pallas_triton.opt_in_smem_budget()
    triton_ptx.main(["--op", "shrink", "--tokens", "256", "--hidden", "512", "--rank", "16",
                     "--adapters", "4", "--out", str(tmp_path)])  # fmt: skip
    # its H200 budget was for its own tiles: the process keeps the one it had
    after = os.environ.get("LORA_JAX_TRITON_SMEM_BUDGET"), pallas_triton.opt_in_smem_budget()
    assert after == before
    (ttir,) = tmp_path.glob("*.ttir")
    assert "lora_shrink" in ttir.name
    assert "tt.dot" in ttir.read_text() and "tt.func" in ttir.read_text()


@pytest.mark.slow  # ~10 s; the default itself: tests/kernels/test_expand_mosaic_gpu.py
def test_ops_mosaic_expand_probe_and_variants(tmp_path, monkeypatch):
    """`ops.py --impls mexp:…` runs only where its tiles hold every token, parses its
    tiles, and the expand's variants (`ours_triton`, `ours_split`) run or name why not."""
    import json

    import ops

    cell = dict(op="expand", hidden=512, rank=16)
    one = ops.Case(adapters=1, tokens=4096, **cell)
    eight = ops.Case(adapters=8, tokens=1024, **cell)  # 128 tokens an adapter
    names = ["ours", "mexp", "mexp:128:128:2", "mexp:64:128:4:smem:copy"]
    assert ops.mexp_names(one, names) == names[1:]
    assert ops.mexp_names(ops.Case(adapters=1, tokens=4096, **dict(cell, op="shrink")), names) == []
    assert ops.mexp_names(eight, names) == []  # shuffled: no tile of one slot
    monkeypatch.setattr(ops, "LAYOUT", "runs")
    assert ops.mexp_names(eight, names) == names[1:]
    assert ops.mexp_names(ops.Case(adapters=8, tokens=512, **cell), names) == ["mexp", names[3]]
    tiles = ops.mexp_tiles(names[3])
    assert (tiles.block_m, tiles.block_n, tiles.stages) == (64, 128, 4)
    assert (tiles.h_in, tiles.variant) == ("smem", "copy")

    metas = [ops.metadata(idx, ops.MAX_LORAS) for idx in ops.mappings(eight, 2, "runs")]
    assert ops.host_whole_tiles(metas) == "all"
    metas = [ops.metadata(idx, ops.MAX_LORAS) for idx in ops.mappings(eight, 2, "shuffled")]
    assert ops.host_whole_tiles(metas) == "none"

    monkeypatch.setattr(ops, "LAYOUT", "shuffled")
    argv = ["--interpret", "--timer", "wall", "--ops", "expand", "--tokens", "64"]
    argv += ["--hiddens", "512", "--ranks", "16", "--adapters", "1", "--out", str(tmp_path)]
    ops.main(argv + ["--impls", "ours,ours_triton,ours_split"])
    (row,) = json.loads((tmp_path / "ops.json").read_text())
    assert row["whole_tiles"] == "all" and row["err_ok"]
    assert "us" in row["impls"]["ours_triton"]
    assert "mosaic=True" in row["impls"]["ours_split"]["skipped"]  # 64 tokens: too few


@pytest.mark.slow  # ~10 s; a probe's kernel, checked once (the 3.11 run)
def test_row_reduce_expand_probe_lowers_for_cuda():
    """benchmarks/row_reduce_expand.py (the TMA reduce-add expand probe) lowers for CUDA
    over a step's work list with two slices, and refuses shapes it cannot take by name."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    if not hasattr(jax.jit(lambda v: v), "trace"):
        pytest.skip(f"jax {jax.__version__} has no jit(f).trace(...).lower(lowering_platforms=)")
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    import row_reduce_expand as rr

    from lora_jax.kernels.shrink_expand.work_list import build_work_list

    t, r, slots = 512, 32, 8
    idx = np.random.default_rng(0).integers(0, 3, t)
    order = np.argsort(idx, kind="stable").astype(np.int32)
    counts = np.bincount(idx, minlength=slots).astype(np.int32)
    starts = (np.cumsum(counts) - counts).astype(np.int32)
    wl = build_work_list(jnp.asarray(counts), jnp.asarray(starts), jnp.asarray(order), block_m=64)
    y = jax.ShapeDtypeStruct((t, 768), jnp.bfloat16)
    h = jax.ShapeDtypeStruct((2, t, r), jnp.float32)
    bs = (
        jax.ShapeDtypeStruct((slots, 512, r), jnp.bfloat16),
        jax.ShapeDtypeStruct((slots, 256, r), jnp.bfloat16),
    )
    for store in ("auto", "rows"):
        tiles = rr.RowTiles(store=store)

        def f(y, h, b0, b1, wl, tiles=tiles):
            return rr.expand(y, h, (b0, b1), wl, None, offsets=(0, 512), tiles=tiles)

        args = (y, h, *bs, jax.ShapeDtypeStruct(wl.shape, jnp.int32))
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, store
    with pytest.raises(ValueError, match=r"slice 0 \(columns \[0, 448\)\) .* block_n=128"):
        rr.expand(
            jnp.zeros((t, 768), jnp.bfloat16),
            jnp.zeros((2, t, r), jnp.float32),
            (jnp.zeros((slots, 448, r), jnp.bfloat16), jnp.zeros((slots, 320, r), jnp.bfloat16)),
            wl,
            None,
            offsets=(0, 448),
            tiles=rr.RowTiles(),
        )
    with pytest.raises(ValueError, match="block_n=96"):
        rr.RowTiles(block_n=96)


def test_host_overhead_runs_and_checks_generator_against_generate(tmp_path):
    """benchmarks/host_overhead.py: both paths give the same tokens (it exits otherwise),
    one row per (layers, model)."""
    import json

    import host_overhead

    out = tmp_path / "host.json"
    host_overhead.main(["--layers", "2", "--reps", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layers"], r["model"]) for r in rows] == [(2, "base"), (2, "lora")]
    assert rows[1]["variables"] > rows[0]["variables"]


def test_rank64_long_prompt_defaults_are_the_measured_candidates(monkeypatch):
    """The rank-64 long-prompt shrink defaults (session 30) are exactly the tile sets that
    benchmarks/RESULTS.md measured as ops.py's PREFILL_SWEEP candidates: [59] at 4096
    tokens, [55] at 8192, [53] at 16384 (on a GPU that lets a kernel opt in to 200 KiB);
    so are rank 128's at 8192 tokens (session 31), 4096 and 16384 (session 32)."""
    import ops

    from lora_jax.kernels import BlockSizes
    from lora_jax.kernels.shrink_expand import pallas_triton

    monkeypatch.setenv("LORA_JAX_TRITON_SMEM_BUDGET", str(200 * 1024))
    pallas_triton.opt_in_smem_budget.cache_clear()
    try:
        for tokens, cand in ((4096, 59), (8192, 55), (16384, 53)):
            for hidden in (4096, 8192):
                got = BlockSizes.get_default("shrink", num_tokens=tokens, hidden=hidden, rank=64)
                assert got == ops.PREFILL_SWEEP["shrink"][cand], (tokens, hidden, got)
        # rank 128: [84] at 4096 tokens (session 32: the whole rank on 64-token blocks),
        # [63] at 8192 (session 31: rank blocks side by side), [80] at 16384 (session 32:
        # the whole rank in 128 x 128 tiles)
        for tokens, cand in ((4096, 84), (8192, 63), (16384, 80)):
            got = BlockSizes.get_default("shrink", num_tokens=tokens, hidden=4096, rank=128)
            assert got == ops.PREFILL_SWEEP["shrink"][cand], (tokens, got)
    finally:
        monkeypatch.delenv("LORA_JAX_TRITON_SMEM_BUDGET")
        pallas_triton.opt_in_smem_budget.cache_clear()


def test_train_step_programs_match_the_nnx_gradient():
    """train_step.py's split-state grad equals `nnx.value_and_grad` on the model itself,
    and its Adam steps (over every slot, masked; over slot 0's rows) move slot 0 only."""
    import jax
    import jax.numpy as jnp
    import train_step
    from flax import nnx

    import lora_jax as lj
    from lora_jax.models import DecoderConfig, DecoderForCausalLM
    from lora_jax.serving.training import init_lora_slot
    from lora_jax.serving.wrap import wrap_model

    model = DecoderForCausalLM(DecoderConfig.tiny(num_hidden_layers=1), rngs=nnx.Rngs(0))
    wrap_model(model, lj.LoRAConfig(max_loras=2, max_lora_rank=8))
    init_lora_slot(model, 0, 8, seed=1)
    lora = nnx.state(model, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(lora))))
    nnx.update(model, jax.tree.map(lambda v: v + jax.random.normal(next(keys), v.shape), lora))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 8)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), ids.shape)
    lj.set_lora_mapping(model, jnp.asarray([0] * 8 + [-1] * 8, jnp.int32))

    progs = train_step.programs(model, ids, pos)
    loss, grads = progs["grad"][0](*progs["grad"][1])
    want_loss, want = nnx.value_and_grad(
        train_step.loss_of, argnums=nnx.DiffState(0, nnx.LoRAParam)
    )(model, ids, pos)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    # f32, two programs summing in their own orders. q's and k's grads come through the
    # softmax's backward (a difference of near-equal terms) ~100 x smaller than the other
    # stacks', so their error is set against the largest stack's size: 2.3e-4 of their own
    # size, 1e-7 absolute like the rest (jax 0.12.1); 1e-6 of the largest stack elsewhere.
    got, ref = jax.tree.leaves(grads), jax.tree.leaves(nnx.state(want, nnx.LoRAParam))
    size = max(float(np.abs(r[0]).max()) for r in ref)
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g[0], r[0], rtol=1e-4, atol=1e-5 * size)
    assert any(float(jnp.abs(g[0]).max()) > 0 for g in jax.tree.leaves(grads))
    new, _, _ = progs["step"][0](*progs["step"][1])
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(progs["step"][1][0])):
        np.testing.assert_array_equal(a[1:], b[1:])
    # step1 (`train_slots`: Adam on slot 0's rows only) takes the same step
    new1, state1, _ = progs["step1"][0](*progs["step1"][1])
    for a, b in zip(jax.tree.leaves(new1), jax.tree.leaves(new)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert all(m.shape[0] == 1 for m in jax.tree.leaves(state1) if m.ndim == 3)


def test_train_step_base_grad_is_the_first_norm_s_gradient(tmp_path):
    """train_step.py's base/grad floor: the gradient w.r.t. layer 0's input RMSNorm weight
    only (every projection's weight left out), as `nnx.value_and_grad` gives it; on a CPU
    the profile finds no GPU kernels and says so with an empty entry."""
    import jax
    import jax.numpy as jnp
    import train_step
    from flax import nnx

    from lora_jax.models import DecoderConfig, DecoderForCausalLM

    model = DecoderForCausalLM(DecoderConfig.tiny(num_hidden_layers=2), rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 8)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), ids.shape)
    fn, args = train_step.base_grad_program(model, ids, pos)
    loss, grads = fn(*args)
    leaves = nnx.to_flat_state(grads)
    assert [tuple(p) for p, _ in leaves] == [("model", "layers", 0, "input_layernorm", "weight")]
    every_norm = nnx.All(nnx.Param, nnx.PathContains("input_layernorm"))
    want_loss, want = nnx.value_and_grad(
        lambda m: train_step.loss_of(m, ids, pos), argnums=nnx.DiffState(0, every_norm)
    )(model)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    got = np.asarray(jax.tree.leaves(grads)[0])
    want_0 = np.asarray(want["model"]["layers"][0]["input_layernorm"]["weight"][...])
    np.testing.assert_allclose(got, want_0, rtol=1e-4, atol=1e-7)
    assert np.abs(got).max() > 0
    assert train_step.kernel_profile(fn, args, 1, str(tmp_path / "prof")) == {}

    # as gpu_pending.sh runs it: `python -P` leaves benchmarks/ off sys.path (session 51:
    # the profile's `import profile_decode` failed there)
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "train_step.py")
    out = tmp_path / "t.json"
    cmd = [sys.executable, "-P", script, "--small", "--ranks", "", "--profile",
           str(tmp_path / "p"), "--out", str(out)]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    import json

    whats = [r["what"] for r in json.loads(out.read_text())["rows"]]
    assert whats == ["fwd", "grad", "grad_profile"]


def test_train_step_small_runs_the_chosen_variants_and_checks_their_grads(tmp_path):
    """train_step.py on the CPU with ``--backends``: only the chosen variants (and xla, the
    reference) run, the block-diagonal hinted backward (``xla_1slot_bd``) among them, and
    each grad is checked against xla's (in its own process, as gpu_pending.sh runs it)."""
    import json
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "train_step.py")
    out = tmp_path / "t.json"
    cmd = [sys.executable, "-P", script, "--small", "--ranks", "8", "--programs", "grad",
           "--backends", "xla_1slot_bd", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    timed = [(r["backend"], r["what"]) for r in rows if "ms" in r and r["rank"] == 8]
    assert timed == [("xla", "grad"), ("xla_1slot_bd", "grad")]
    (err,) = [r["err"] for r in rows if r["what"] == "grad_err_vs_xla"]
    assert err < 1e-4


def test_grad_ops_small_times_every_variant_and_checks_them(tmp_path):
    """grad_ops.py on the CPU: the stacks' gradient op (interpret mode), the single-slot
    dense matmul and the one-hot einsum for a dA and a dB cell, each within f32 rounding
    of the one-hot form, in a table and JSON."""
    import grad_ops

    out = tmp_path / "g.json"
    grad_ops.main(["--small", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["what"], r["impl"]) for r in rows} == {
        ("dA", "kernel"), ("dA", "dense"), ("dA", "onehot"), ("dB", "kernel"), ("dB", "onehot"),
    }  # fmt: skip
    assert all(r["rel_err"] < 1e-5 and r["us"] > 0 for r in rows)
    assert grad_ops.ideal_bytes(4096, 64, 4096, 8) == 4096 * 4160 * 2 + 8 * 64 * 4096 * 4
