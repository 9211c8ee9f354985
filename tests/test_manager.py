"""Adapter managers: vLLM's manager / LRU / worker sequences, one-jit slot writes, failures."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from layer_cases import logical_output
from serving_toy import ToyLM, peft_tensors

import lora_jax as lj
from lora_jax.serving import slot_writes
from lora_jax.serving.manager import (
    LoRAModelManager,
    LoRARequest,
    LRUCacheLoRAModelManager,
    managers_of,
)
from lora_jax.serving.peft import LoRAAdapter, ModuleLoRA, PEFTConfig, adapter_from_tensors
from lora_jax.serving.wrap import lora_layers, wrap_model

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _setup(max_loras=2, max_cpu_loras=3, lru=True, rules=None, n_layers=1):
    model = ToyLM(n_layers=n_layers, rules=rules)
    cfg = lj.LoRAConfig(max_loras=max_loras, max_lora_rank=8, max_cpu_loras=max_cpu_loras)
    wrap_model(model, cfg, packed_modules_mapping=PACKED)
    cls = LRUCacheLoRAModelManager if lru else LoRAModelManager
    return model, cls(model, cfg)


_ADAPTERS = {}


def _adapter(model, aid, targets=("q_proj", "v_proj", "down_proj"), rank=4, n_layers=1):
    tensors = peft_tensors(targets, rank, n_layers=n_layers, seed=aid)
    cfg = model.model.layers[0].self_attn.qkv_proj.lora_config
    return adapter_from_tensors(
        tensors, PEFTConfig(r=rank, lora_alpha=2 * rank), model, cfg, adapter_id=aid, name=f"a{aid}"
    )


def _adapters(model, n=8):
    return {i: _adapter(model, i, rank=(4, 8, 2)[i % 3]) for i in range(1, n + 1)}


def _slots(mgr):
    return list(mgr.lora_index_to_id)


# -- vLLM sequences ----------------------------------------------------------------------------
def test_lora_model_manager_sequence():
    model, mgr = _setup(lru=False)
    ad = _adapters(model, 3)
    assert _slots(mgr) == [None, None]
    assert mgr.add_adapter(ad[1]) and mgr.activate_adapter(1)
    assert _slots(mgr) == [1, None]
    assert not mgr.add_adapter(ad[1]) and not mgr.activate_adapter(1)
    assert mgr.add_adapter(ad[2]) and mgr.activate_adapter(2)
    assert _slots(mgr) == [1, 2]
    assert not mgr.add_adapter(ad[2]) and not mgr.activate_adapter(2)
    assert mgr.add_adapter(ad[3]) and _slots(mgr) == [1, 2]
    with pytest.raises(ValueError, match="No free lora slots"):
        mgr.activate_adapter(3)
    assert _slots(mgr) == [1, 2]
    assert mgr.remove_adapter(2) and _slots(mgr) == [1, None]
    assert not mgr.remove_adapter(2)
    assert mgr.remove_adapter(1) and not mgr.remove_adapter(1)
    assert mgr.add_adapter(ad[1]) and _slots(mgr) == [None, None]  # adding does not activate
    mgr.add_adapter(ad[2])
    assert mgr.activate_adapter(3) and _slots(mgr) == [3, None]  # the first free slot
    assert mgr.activate_adapter(2) and _slots(mgr) == [3, 2]
    assert mgr.supported_lora_modules == sorted([*ALL, "proj"])
    with pytest.raises(RuntimeError, match="No free adapter slots"):
        mgr.add_adapter(_adapter(model, 4))


def test_lru_cache_model_manager_sequence():
    model, mgr = _setup()
    ad = _adapters(model, 3)
    assert mgr.add_adapter(ad[1]) and mgr.activate_adapter(1)
    assert mgr.add_adapter(ad[2]) and mgr.activate_adapter(2)
    assert _slots(mgr) == [1, 2]
    assert mgr.add_adapter(ad[3]) and mgr.activate_adapter(3)
    assert _slots(mgr) == [3, 2]  # the LRU active adapter (1) was evicted
    assert mgr.remove_adapter(2) and _slots(mgr) == [3, None]
    assert not mgr.remove_adapter(2)
    assert mgr.remove_adapter(1) and not mgr.remove_adapter(1)  # 1 was still cached
    assert mgr.add_adapter(ad[1]) and mgr.activate_adapter(1)
    assert _slots(mgr) == [3, 1]
    mgr.add_adapter(ad[2])
    assert mgr.deactivate_adapter(3) and _slots(mgr) == [None, 1]
    assert mgr.activate_adapter(2) and _slots(mgr) == [2, 1]
    assert mgr.activate_adapter(3) and _slots(mgr) == [2, 3]
    assert mgr.pin_adapter(2) and _slots(mgr) == [2, 3]
    assert mgr.activate_adapter(1) and _slots(mgr) == [2, 1]  # unpinned 3 evicted
    assert mgr.deactivate_adapter(2) and _slots(mgr) == [None, 1]  # pinned can deactivate
    assert mgr.activate_adapter(3) and _slots(mgr) == [3, 1]
    assert mgr.pin_adapter(3) and mgr.pin_adapter(1)
    with pytest.raises(RuntimeError):
        mgr.pin_adapter(2)
    assert _slots(mgr) == [3, 1]
    with pytest.raises(RuntimeError):
        mgr.activate_adapter(2)
    assert _slots(mgr) == [3, 1]
    mgr.deactivate_adapter(3)
    assert mgr.pin_adapter(2) and _slots(mgr) == [2, 1]  # pinning activates
    assert mgr.remove_adapter(3)
    with pytest.raises(ValueError, match="not registered"):
        mgr.pin_adapter(3)


def test_lru_lora_model_manager_sequence():
    model, mgr = _setup(max_loras=2, max_cpu_loras=2)
    ad = _adapters(model, 4)
    for i in (1, 2):
        assert mgr.add_adapter(ad[i]) and mgr.activate_adapter(i)
    assert set(mgr.list_adapters()) == {1, 2} and _slots(mgr) == [1, 2]
    assert mgr.add_adapter(ad[3]) and mgr.add_adapter(ad[4])  # CPU cache evicts 1, 2
    assert mgr.activate_adapter(3) and mgr.activate_adapter(4)
    assert set(mgr.list_adapters()) == {3, 4} and _slots(mgr) == [3, 4]
    assert not mgr.add_adapter(ad[3]) and not mgr.activate_adapter(3)  # touches 3
    assert mgr.add_adapter(ad[2]) and mgr.activate_adapter(2)
    assert set(mgr.list_adapters()) == {3, 2} and _slots(mgr) == [3, 2]
    assert mgr.remove_adapter(3) and not mgr.remove_adapter(3)
    assert set(mgr.list_adapters()) == {2} and _slots(mgr) == [None, 2]
    for i in (3, 4):
        mgr.add_adapter(ad[i])
        mgr.activate_adapter(i)
    assert _slots(mgr) == [3, 4]
    assert mgr.remove_oldest_adapter() and set(mgr.list_adapters()) == {4}
    assert _slots(mgr) == [None, 4]
    assert mgr.remove_oldest_adapter() and mgr.list_adapters() == {}
    assert not mgr.remove_oldest_adapter()
    for i in (3, 4):
        mgr.add_adapter(ad[i])
        mgr.activate_adapter(i)
    with pytest.raises(ValueError):
        mgr.pin_adapter(1)
    assert mgr.pin_adapter(3)
    assert mgr.remove_adapter(3) and not mgr.remove_adapter(3)  # explicit removal wins
    assert set(mgr.list_adapters()) == {4}
    mgr.add_adapter(ad[1])
    assert mgr.pin_adapter(1) and _slots(mgr) == [1, 4]
    mgr.add_adapter(ad[2])
    mgr.activate_adapter(2)
    assert set(mgr.list_adapters()) == {1, 2} and _slots(mgr) == [1, 2]
    assert mgr.remove_oldest_adapter() and set(mgr.list_adapters()) == {1}
    assert _slots(mgr) == [1, None]
    with pytest.raises(RuntimeError, match="pinned"):
        mgr.remove_oldest_adapter()


def test_lru_cache_worker_sequence():
    model, mgr = _setup(max_loras=4, max_cpu_loras=4)
    ad = _adapters(model, 8)
    req = lambda *ids: mgr.set_active_adapters([ad[i] for i in ids])  # noqa: E731
    req(1, 2)
    assert set(mgr.list_adapters()) == {1, 2} and _slots(mgr) == [1, 2, None, None]
    req(1, 3, 4)
    assert set(mgr.list_adapters()) == {1, 2, 3, 4} and _slots(mgr) == [1, 2, 3, 4]
    req(1, 2, 5)
    assert set(mgr.list_adapters()) == {1, 2, 4, 5} and _slots(mgr) == [1, 2, 5, 4]
    req(1, 1, 1)
    assert set(mgr.list_adapters()) == {1, 2, 4, 5} and _slots(mgr) == [1, 2, 5, 4]
    req(6, 7, 8)
    assert set(mgr.list_adapters()) == {1, 6, 7, 8} and _slots(mgr) == [1, 7, 8, 6]
    with pytest.raises(RuntimeError, match="greater than"):
        req(1, 2, 3, 4, 5)
    # Ints work for cached adapters; unknown ints cannot be loaded.
    mgr.set_active_adapters([1, None, 0])
    with pytest.raises(ValueError, match="cannot be loaded"):
        mgr.set_active_adapters([2])


def test_worker_sequence_removes_unrequested():
    model, mgr = _setup(max_loras=3, max_cpu_loras=3, lru=False)
    ad = _adapters(model, 8)
    req = lambda *ids: mgr.set_active_adapters([ad[i] for i in ids])  # noqa: E731
    req(1, 2)
    assert _slots(mgr) == [1, 2, None]
    req(1, 3, 4)
    assert set(mgr.list_adapters()) == {1, 3, 4} and _slots(mgr) == [1, 3, 4]
    req(1, 2, 5)
    assert set(mgr.list_adapters()) == {1, 2, 5} and _slots(mgr) == [1, 2, 5]
    req(1, 1, 1)
    assert set(mgr.list_adapters()) == {1} and _slots(mgr) == [1, None, None]
    req(6, 7, 8)
    assert set(mgr.list_adapters()) == {6, 7, 8} and set(_slots(mgr)) == {6, 7, 8}
    with pytest.raises(RuntimeError):
        req(1, 2, 3, 4, 5)


def test_packed_loras():
    model, _ = _setup()
    a = _adapter(model, 1, targets=("gate_proj", "up_proj"), rank=8)
    name = "model.layers.0.mlp.gate_up_proj"
    assert a.get_lora("model.layers.0.mlp.gate_proj") is None
    tensors = peft_tensors(("gate_proj", "up_proj"), 8, n_layers=1, seed=1)
    key = "base_model.model.model.layers.0.mlp.{}.lora_{}.weight"
    for i, m in enumerate(("gate_proj", "up_proj")):
        np.testing.assert_array_equal(a.get_lora(name).lora_a[i], tensors[key.format(m, "A")])
        np.testing.assert_allclose(a.get_lora(name).lora_b[i], 2 * tensors[key.format(m, "B")])
    only_up = _adapter(model, 2, targets=("up_proj",), rank=8)
    assert only_up.get_lora(name).lora_a[0] is None and only_up.get_lora(name).lora_b[0] is None
    assert only_up.get_lora(name).lora_a[1].shape == (8, 32)
    assert type(lora_layers(model)[name]).__name__ == "MergedColumnParallelLinearWithLoRA"


# -- slot writes -------------------------------------------------------------------------------
def _lora_arrays(model):
    state = nnx.state(model, nnx.LoRAParam, lj.LoRASlotRanks)
    return jax.tree.map(np.asarray, state)


@nnx.jit
def _outputs(model, x, idx):
    with lj.lora_mapping(model, idx):
        return model(x)


@nnx.jit
def _run_layers(model, xs, idx):
    with lj.lora_mapping(model, idx):
        return {name: layer(xs[name]) for name, layer in lora_layers(model).items()}


def _layer_outputs(model, idx):
    """Every LoRA layer on its own input (sharded layers' outputs are physical: compare
    like with like)."""
    rng = np.random.default_rng(1)
    xs = {
        name: jnp.asarray(
            rng.normal(size=(idx.shape[0], layer.base_layer.in_features)), jnp.float32
        )
        for name, layer in lora_layers(model).items()
    }
    return jax.tree.map(np.asarray, _run_layers(model, xs, idx))


X = jnp.asarray(np.random.default_rng(0).normal(size=(6, 32)), jnp.float32)


def test_one_jitted_write_per_activation(monkeypatch):
    model, mgr = _setup(n_layers=2)
    calls = []
    real = slot_writes._write_slots
    monkeypatch.setattr(slot_writes, "_write_slots", lambda *a: calls.append(len(a[0])) or real(*a))
    mgr.add_adapter(_adapter(model, 1, n_layers=2))
    mgr.activate_adapter(1)
    n_vars = sum(2 * layer.n_slices + 1 for layer in lora_layers(model).values())
    assert calls == [n_vars]  # every layer's stacks (and ranks) in one call


def test_adapters_on_other_modules_reuse_the_compiled_write():
    """Adapters that leave out different layers (zeros written there) hand the jitted
    write the same argument types: one compile for the model, not one per combination
    of target modules (a 32-layer write compiles for about a second)."""
    model, mgr = _setup(max_loras=2, n_layers=2)
    combos = [("q_proj",), ("gate_proj", "up_proj"), ("down_proj", "o_proj"), ("v_proj",)]
    sizes = []
    for aid, targets in enumerate(combos, start=1):
        mgr.add_adapter(_adapter(model, aid, targets=targets, n_layers=2))
        mgr.activate_adapter(aid)
        sizes.append(slot_writes._write_slots._cache_size())
    assert sizes[1:] == sizes[:1] * 3, sizes  # only the first adapter may have compiled


def test_written_slot_matches_set_lora_and_is_padded():
    model, mgr = _setup()
    a = _adapter(model, 1, targets=ALL, rank=4)
    mgr.add_adapter(a)
    mgr.activate_adapter(1)
    mgr.add_adapter(_adapter(model, 2, targets=ALL, rank=8))
    mgr.activate_adapter(2)  # slot 1
    ref_model, _ = _setup()
    for name, layer in lora_layers(ref_model).items():
        m = a.get_lora(name)
        if m is not None:
            layer.set_lora(0, *m.set_lora_args())
    got, want = _lora_arrays(model), _lora_arrays(ref_model)
    for path, value in jax.tree_util.tree_leaves_with_path(got):
        ref = dict(jax.tree_util.tree_leaves_with_path(want))[path]
        if "slot_ranks" in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(value[:, 0], ref[:, 0])
            continue
        np.testing.assert_array_equal(value[0], ref[0])
        # rank 4 in max rank 8: zero padding (A rows / B columns 4..8)
        pad = value[0][4:] if "lora_a" in jax.tree_util.keystr(path) else value[0][:, 4:]
        assert not pad.any()


def test_activation_and_eviction_never_change_other_requests():
    model, mgr = _setup(max_loras=3, max_cpu_loras=4)
    ad = {i: _adapter(model, i, targets=ALL, rank=(8, 4, 2, 8)[i - 1]) for i in range(1, 5)}
    mgr.set_active_adapters([ad[1], ad[2]])
    ids = [1, 2, None, 1, 2, None]
    idx = jnp.asarray(mgr.token_mapping(ids))
    before = np.asarray(_outputs(model, X, idx))
    mgr.set_active_adapters([ad[3]])  # fills the free slot
    mgr.deactivate_adapter(3)
    mgr.set_active_adapters([ad[4]])  # reuses slot 2
    mgr.set_active_adapters([ad[3]])  # evicts the LRU among active (1)
    assert _slots(mgr) == [3, 2, 4]
    mgr.set_active_adapters([ad[1]])  # evicts 2 → slot 1
    for i in (1, 2):  # a request for adapter i gets the same output wherever it lives
        mgr.set_active_adapters([ad[i]])
        new_ids = [aid if aid == i else None for aid in ids]
        got = np.asarray(_outputs(model, X, jnp.asarray(mgr.token_mapping(new_ids))))
        rows = [t for t, aid in enumerate(ids) if aid in (i, None)]
        np.testing.assert_allclose(got[rows], before[rows], rtol=1e-6, atol=1e-6)
    # Other active slots do not move when one slot is rewritten.
    mgr.set_active_adapters([ad[1], ad[2], ad[4]])
    idx = jnp.asarray(mgr.token_mapping([1, 2, 4, None]))
    ref = np.asarray(_outputs(model, X[:4], idx))
    slot4 = mgr.slot_of(4)
    mgr.deactivate_adapter(4)
    mgr.set_active_adapters([ad[3]])
    assert mgr.slot_of(3) == slot4
    got = np.asarray(_outputs(model, X[:4], jnp.asarray(mgr.token_mapping([1, 2, 3, None]))))
    np.testing.assert_array_equal(got[[0, 1, 3]], ref[[0, 1, 3]])
    assert np.abs(got[2] - ref[2]).max() > 1e-3


def test_bad_adapter_leaves_every_slot_as_it_was():
    model, mgr = _setup(max_loras=2, max_cpu_loras=4)
    ad = _adapters(model, 2)
    mgr.set_active_adapters([ad[1], ad[2]])
    before = _lora_arrays(model)
    good = _adapter(model, 3, targets=ALL, rank=4)
    name = "model.layers.0.mlp.down_proj"
    m = good.get_lora(name)
    bad_b = np.zeros((m.lora_b[0].shape[0] + 1, 4), np.float32)  # wrong out size
    modules = {**good.modules, name: dataclasses.replace(m, lora_b=(bad_b,))}
    bad = dataclasses.replace(good, modules=modules)
    mgr.add_adapter(bad)
    with pytest.raises(ValueError, match="down_proj"):
        mgr.activate_adapter(3)  # would evict 1 — but validation runs first
    assert _slots(mgr) == [1, 2]
    jax.tree.map(np.testing.assert_array_equal, before, _lora_arrays(model))
    too_big = dataclasses.replace(
        good, id=4, modules={name: dataclasses.replace(m, lora_a=(np.zeros((16, 48)),))}
    )
    mgr.add_adapter(too_big)
    with pytest.raises(ValueError):
        mgr.activate_adapter(4)
    assert _slots(mgr) == [1, 2]
    jax.tree.map(np.testing.assert_array_equal, before, _lora_arrays(model))
    foreign = dataclasses.replace(good, id=5, modules={"model.nope": m})
    with pytest.raises(ValueError, match="not LoRA layers"):
        mgr.add_adapter(foreign)


def test_token_mapping():
    model, mgr = _setup()
    mgr.set_active_adapters([_adapter(model, 7)])
    assert mgr.token_mapping([7, None, 0, -1]).tolist() == [0, -1, -1, -1]
    assert mgr.token_mapping([7, None], tokens_per_request=[2, 3]).tolist() == [0, 0, -1, -1, -1]
    assert mgr.token_mapping([None, 7], 2).dtype == np.int32
    with pytest.raises(ValueError, match="unknown"):
        mgr.token_mapping([9])
    mgr.add_adapter(_adapter(model, 8))
    with pytest.raises(ValueError, match="not active.*activate it first"):
        mgr.token_mapping([8])


def test_sharded_slot_write_keeps_sharding_and_matches_unsharded():
    mesh = jax.make_mesh((1, 4), ("dp", "tp"))
    model, mgr = _setup(rules=lj.ShardingRules(mesh))
    ref_model, ref_mgr = _setup()
    a = _adapter(model, 1, targets=ALL, rank=8)
    b = _adapter(model, 2, targets=["q_proj"], rank=4)  # zero writes into sharded stacks
    shardings = jax.tree.map(lambda v: v.sharding, nnx.state(model, nnx.LoRAParam))
    for m in (mgr, ref_mgr):
        m.set_active_adapters([a, b])
    after = jax.tree.map(lambda v: v.sharding, nnx.state(model, nnx.LoRAParam))
    jax.tree.map(
        lambda s, t: s.is_equivalent_to(t, 3) or pytest.fail(f"{s} != {t}"), shardings, after
    )
    idx = jnp.asarray(mgr.token_mapping([1, None, 2, 1, None, 2]))
    got, want = _layer_outputs(model, idx), _layer_outputs(ref_model, idx)
    layers = lora_layers(model)
    for name in want:
        logical = logical_output(layers[name], got[name])  # per-shard packing, kv replicas
        np.testing.assert_allclose(logical, want[name], rtol=1e-5, atol=1e-5)


def test_load_adapters_progress_bar(tmp_path, capsys):
    import json

    from lora_jax.serving.peft import write_safetensors

    model, mgr = _setup(max_loras=2, max_cpu_loras=3)
    paths = {}
    for i in range(3):
        d = tmp_path / f"ad{i}"
        d.mkdir()
        (d / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
        )
        write_safetensors(
            d / "adapter_model.safetensors", peft_tensors(["q_proj"], 4, n_layers=1, seed=i)
        )
        paths[f"ad{i}"] = d
    loaded = mgr.load_adapters(paths, first_id=10)
    assert [a.id for a in loaded] == [10, 11, 12] and [a.name for a in loaded] == list(paths)
    assert set(mgr.list_adapters()) == {10, 11, 12}
    assert "loading adapters" in capsys.readouterr().err
    # Worker-style requests load from their path when the adapter is not cached.
    mgr.set_active_adapters([10, LoRARequest("from_path", 20, str(paths["ad1"]))])
    assert set(mgr.list_adapters()) == {10, 12, 20}  # 11 was least recently used
    assert mgr.slot_of(20) is not None and mgr.slot_of(10) is not None
    assert mgr.get_adapter(20).name == "from_path"


def test_load_adapters_twice_never_drops_one(tmp_path):
    """Two `load_adapters` calls without first_id: the second continues after the largest
    registered id, so both adapters are registered and each id serves its own weights;
    an explicit first_id that collides is refused before anything is added."""
    import json

    from lora_jax.serving.peft import write_safetensors

    model, mgr = _setup(max_loras=2, max_cpu_loras=3)
    dirs = {}
    for name, seed in (("sql", 1), ("chat", 2)):
        d = tmp_path / name
        d.mkdir()
        cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        tensors = peft_tensors(["q_proj"], 4, n_layers=1, seed=seed)
        write_safetensors(d / "adapter_model.safetensors", tensors)
        dirs[name] = d
    (sql,) = mgr.load_adapters({"sql": dirs["sql"]}, activate=True, progress=False)
    (chat,) = mgr.load_adapters({"chat": dirs["chat"]}, activate=True, progress=False)
    assert sql.id != chat.id
    assert {k: v.name for k, v in mgr.list_adapters().items()} == {sql.id: "sql", chat.id: "chat"}
    assert mgr.get_adapter(chat.id) is chat and mgr.slot_of(chat.id) is not None
    before = dict(mgr.list_adapters())
    with pytest.raises(ValueError, match=rf"ids \[{chat.id}\].*already registered"):
        mgr.load_adapters({"again": dirs["sql"]}, first_id=chat.id, progress=False)
    assert mgr.list_adapters() == before


def test_lru_set_active_never_evicts_what_it_activates():
    """The LRU worker step activates every requested adapter, evicting only adapters it
    does not request; requests that cannot fit beside the pinned adapters raise
    `RuntimeError` and change nothing (vLLM's worker would drop one silently)."""
    model, mgr = _setup(max_loras=2, max_cpu_loras=3)
    ad = _adapters(model, 4)
    mgr.add_adapter(ad[1])
    mgr.add_adapter(ad[4])
    mgr.activate_adapter(4)
    mgr.pin_adapter(1)  # 1 holds a slot for good; 4 is active and unpinned
    with pytest.raises(RuntimeError, match="2 requested adapters and 1 other pinned"):
        mgr.set_active_adapters([ad[2], ad[3]])
    assert sorted(mgr.list_adapters()) == [1, 4] and sorted(_slots(mgr)) == [1, 4]
    mgr.set_active_adapters([ad[1], ad[2]])  # the pinned one is requested: fits
    assert sorted(_slots(mgr)) == [1, 2]
    # 2 slots, 3 CPU entries: activating 3 and 4 must not evict 3 to make room for 4
    model, mgr = _setup(max_loras=2, max_cpu_loras=3)
    ad = _adapters(model, 4)
    for i in (1, 2, 3):
        mgr.add_adapter(ad[i])
    mgr.activate_adapter(3)
    mgr.activate_adapter(1)  # slots: 3 (older), 1
    mgr.set_active_adapters([ad[3], ad[4]])
    assert sorted(_slots(mgr)) == [3, 4]
    assert 3 in mgr.list_adapters() and 4 in mgr.list_adapters()
    slots = mgr.token_mapping([3, 4])
    assert sorted(slots.tolist()) == [0, 1]
    # a pinned CPU entry counts against the CPU cache too
    model, mgr = _setup(max_loras=2, max_cpu_loras=2)
    ad = _adapters(model, 3)
    mgr.add_adapter(ad[1])
    mgr.pin_adapter(1)
    mgr.deactivate_adapter(1)
    mgr.add_adapter(ad[2])
    with pytest.raises(RuntimeError, match="CPU cache"):
        mgr.set_active_adapters([ad[2], ad[3]])
    assert sorted(mgr.list_adapters()) == [1, 2]


def test_lru_add_of_a_bad_adapter_evicts_nothing():
    """A full LRU cache and an adapter whose shapes no layer takes: `add_adapter` raises
    before evicting anyone, so every registered adapter and slot stays as it was."""
    from lora_jax.serving.peft import LoRAAdapter, ModuleLoRA

    model, mgr = _setup(max_loras=2, max_cpu_loras=2)
    ad = _adapters(model, 2)
    for i in (1, 2):
        mgr.add_adapter(ad[i])
        mgr.activate_adapter(i)
    name = next(iter(ad[1].modules))
    good = ad[1].modules[name]
    bad_b = tuple(None if b is None else b[:, :-1] for b in good.lora_b)  # rank mismatch
    bad = LoRAAdapter(
        id=9, name="bad", rank=4, modules={name: ModuleLoRA(name, good.lora_a, bad_b)}
    )
    before = (sorted(mgr.list_adapters()), _slots(mgr))
    with pytest.raises(ValueError, match="adapter 'bad'"):
        mgr.add_adapter(bad)
    assert (sorted(mgr.list_adapters()), _slots(mgr)) == before


def _too_big(model, aid):
    """A well-formed adapter of rank 16 > max_lora_rank 8: every layer refuses it."""
    good = _adapter(model, aid)
    big = lambda x, axis: (
        None
        if x is None
        else np.ones(  # noqa: E731
            (16, x.shape[1]) if axis == 0 else (x.shape[0], 16), np.float32
        )
    )
    modules = {
        k: ModuleLoRA(k, tuple(big(a, 0) for a in m.lora_a), tuple(big(b, 1) for b in m.lora_b))
        for k, m in good.modules.items()
    }
    return LoRAAdapter(id=aid, name=f"big{aid}", rank=16, modules=modules)


def _state(mgr):
    return (
        list(mgr._registered_adapters.cache),  # CPU LRU order
        list(mgr._active_adapters.cache),  # device LRU order
        list(mgr.lora_index_to_id),
    )


@pytest.mark.parametrize("lru", [True, False], ids=["lru", "plain"])
def test_a_failed_worker_step_changes_nothing(lru):
    """`set_active_adapters` with a request that cannot be served (unknown id, a rank
    too large) raises before any load, eviction, touch or write: the adapters serving
    before still serve, in the same slots and LRU order (vLLM's worker loads first)."""
    model, mgr = _setup(max_loras=2, max_cpu_loras=2, lru=lru)
    ad = _adapters(model, 3)
    mgr.set_active_adapters([ad[1], ad[2]])
    arrays = _lora_arrays(model)
    before = _state(mgr) if lru else (sorted(mgr.list_adapters()), list(mgr.lora_index_to_id))
    for bad in ([_too_big(model, 4)], [ad[3], 99], [ad[3], _too_big(model, 4)]):
        with pytest.raises(ValueError, match="max_lora_rank|not registered"):
            mgr.set_active_adapters(bad)
        after = _state(mgr) if lru else (sorted(mgr.list_adapters()), list(mgr.lora_index_to_id))
        assert after == before, bad
        jax.tree.map(np.testing.assert_array_equal, arrays, _lora_arrays(model))
    mgr.set_active_adapters([ad[3], ad[1]])  # a good step still works
    assert sorted(x for x in mgr.lora_index_to_id) == [1, 3]


def test_a_failed_activation_leaves_the_lru_order():
    """A registered adapter that no layer accepts: activating it fails without making it
    the most recently used, so the next add still evicts the least recently used one."""
    model, mgr = _setup(max_loras=2, max_cpu_loras=2)
    mgr.add_adapter(_too_big(model, 1))  # the cache is not full: registered unchecked
    mgr.add_adapter(_adapter(model, 2))
    before = _state(mgr)
    with pytest.raises(ValueError, match="max_lora_rank"):
        mgr.activate_adapter(1)
    with pytest.raises(ValueError, match="max_lora_rank"):
        mgr.pin_adapter(1)
    assert _state(mgr) == before
    mgr.add_adapter(_adapter(model, 3))
    assert sorted(mgr.list_adapters()) == [2, 3]  # 1 was the least recently used


def test_a_merged_slot_is_not_rewritten_until_unmerged():
    """While `merge_adapter` has folded slot s into the kernels, the manager never writes
    s: an eviction takes another slot's adapter, a free s is not used, `write_slot(s)`
    and a worker step that needs s are refused with nothing changed; after
    `unmerge_adapter`, s is written as usual."""
    from lora_jax.serving.merge import merge_adapter, unmerge_adapter

    model, mgr = _setup(max_loras=2, max_cpu_loras=3)
    ad = _adapters(model, 3)
    for i in (1, 2):
        mgr.add_adapter(ad[i])
        mgr.activate_adapter(i)
    merged = mgr.slot_of(1)  # adapter 1 is the least recently used
    merge_adapter(model, merged)
    mgr.add_adapter(ad[3])
    assert mgr.activate_adapter(3)  # evicts 2, not 1 (its slot is merged)
    assert _slots(mgr)[merged] == 1 and _slots(mgr)[1 - merged] == 3
    before = (_slots(mgr), sorted(mgr.list_adapters()))
    with pytest.raises(ValueError, match=f"slot {merged} is merged"):
        mgr.write_slot(merged, None)
    with pytest.raises(RuntimeError, match="merged"):
        mgr.set_active_adapters([2, 3])  # 2 would need the merged slot
    assert (_slots(mgr), sorted(mgr.list_adapters())) == before
    # the merged adapter stays registered and in its slot until unmerged
    for drop in (mgr.deactivate_adapter, mgr.remove_adapter):
        with pytest.raises(ValueError, match=f"slot {merged}, which merge_adapter folded"):
            drop(1)
    assert (_slots(mgr), sorted(mgr.list_adapters())) == before
    assert list(mgr._registered_adapters.cache)[0] == 1  # the least recently used...
    mgr.add_adapter(_adapter(model, 4))  # ... but a full CPU cache never evicts it
    assert sorted(mgr.list_adapters()) == [1, 3, 4]
    assert _slots(mgr)[merged] == 1 and _slots(mgr)[1 - merged] == 3
    unmerge_adapter(model)
    mgr.deactivate_adapter(1)  # unmerged: free to go
    mgr.activate_adapter(4)
    assert _slots(mgr)[merged] == 4


@pytest.mark.parametrize("lru", [False, True])
def test_a_worker_step_prepares_each_new_adapter_once(monkeypatch, lru):
    """`set_active_adapters` validates every new adapter before anything changes, and the
    activation writes those prepared arrays: each layer prepares a new adapter once (it
    was twice), and the slots hold what `set_lora` would write."""
    model, mgr = _setup(lru=lru)
    ad = _adapters(model, 2)
    calls = []
    real = lj.BaseLayerWithLoRA.prepare_lora

    def counting(self, index, a, b):
        calls.append(self.name)
        return real(self, index, a, b)

    monkeypatch.setattr(lj.BaseLayerWithLoRA, "prepare_lora", counting)
    mgr.set_active_adapters([ad[1], ad[2]])
    layers = lora_layers(model)
    want = [n for aid in (1, 2) for n in layers if ad[aid].get_lora(n) is not None]
    assert want and sorted(calls) == sorted(want)
    calls.clear()
    mgr.set_active_adapters([ad[1], ad[2]])  # both active: nothing prepared
    assert calls == []
    monkeypatch.setattr(lj.BaseLayerWithLoRA, "prepare_lora", real)
    for aid in (1, 2):
        slot = mgr.slot_of(aid)
        for name, layer in layers.items():
            m = ad[aid].get_lora(name)
            if m is None:
                continue
            ref = real(layer, slot, *m.set_lora_args())
            for var, want in zip(layer.lora_a, ref.a):
                np.testing.assert_array_equal(np.asarray(var[...][slot], np.float32), want)


def test_adapter_ids_below_one_and_colliding_ids_are_refused():
    """vLLM's `LoRARequest` refuses ids <= 0; an adapter object with such an id was served
    by the base model without a word. Two different adapters under one id (the loader's
    counter and the manager's ids both start at 1) sent one's requests to the other."""
    model, mgr = _setup()
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("sql", 0, "/nowhere")
    zero = dataclasses.replace(_adapter(model, 1), id=0)
    with pytest.raises(ValueError, match="id must be an int >= 1"):
        mgr.add_adapter(zero)
    with pytest.raises(ValueError, match="id must be an int >= 1"):
        mgr.set_active_adapters([zero])
    with pytest.raises(ValueError, match="'sql' is not an adapter id"):
        mgr.set_active_adapters(["sql"])
    with pytest.raises(ValueError, match=r"^set_active_adapters: request 'a1'.s id must be"):
        mgr.set_active_adapters([zero])  # named, not printed whole (weights and all)
    for bad in (True, 1.0):
        with pytest.raises(ValueError, match="adapter id must be an int or None"):
            mgr.token_mapping([bad])
        with pytest.raises(ValueError, match="write_slot: slot must be an int"):
            mgr.write_slot(bad, None)
    mgr.set_active_adapters([0, None])  # bare ids <= 0 and None: no adapter
    a1 = _adapter(model, 1)
    assert mgr.add_adapter(a1) and not mgr.add_adapter(a1)  # the same object: a touch
    again = dataclasses.replace(_adapter(model, 1))  # the same adapter, loaded again
    assert not mgr.add_adapter(again)
    other = dataclasses.replace(_adapter(model, 2), id=1, name="other")
    with pytest.raises(ValueError, match="id 1 is already adapter 'a1'.*'other'"):
        mgr.add_adapter(other)
    same_name = dataclasses.replace(_adapter(model, 2), id=1, name="a1")  # other weights
    with pytest.raises(ValueError, match="is another adapter"):
        mgr.add_adapter(same_name)
    with pytest.raises(ValueError, match="id 1 is already adapter 'a1'"):
        mgr.set_active_adapters([other])  # the worker step checks it too
    with pytest.raises(ValueError, match="'a1' and 'other' are both requested under id 1"):
        mgr.set_active_adapters([a1, other])
    mgr.set_active_adapters([a1])
    with pytest.raises(ValueError, match="id 1 is already adapter 'a1'"):
        mgr.set_active_adapters([other])  # active now: still refused
    assert mgr.get_adapter(1) is a1
    np.testing.assert_array_equal(mgr.token_mapping([], tokens_per_request=[]), [])


def test_write_slot_refuses_a_slot_holding_an_active_adapter():
    model, mgr = _setup()
    a1, a2 = _adapter(model, 1), _adapter(model, 2)
    mgr.set_active_adapters([a1])
    before = _slot_state(model, mgr.slot_of(1))
    with pytest.raises(ValueError, match="holds active adapter 1"):
        mgr.write_slot(mgr.slot_of(1), a2)
    after = _slot_state(model, mgr.slot_of(1))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    mgr.deactivate_adapter(1)
    mgr.write_slot(0, None)  # a free slot: fine


@pytest.mark.parametrize("activate", [False, True])
def test_plain_manager_adding_more_than_fits_changes_nothing(activate):
    """The plain manager never evicts: adapters (or their slots) past its room raise before
    any is added (it added some, then raised)."""
    model, mgr = _setup(lru=False, max_loras=2, max_cpu_loras=3)
    ads = [_adapter(model, i) for i in (1, 2, 3)] if activate else _adapters(model, 4).values()
    with pytest.raises(RuntimeError, match="nothing was added"):
        mgr.add_adapters(list(ads), activate=activate, progress=False)
    assert len(mgr) == 0 and _slots(mgr) == [None, None]


def _slot_state(model, slot):
    return [np.asarray(v[...][slot]) for la in lora_layers(model).values() for v in la.lora_a]


def test_token_mapping_refuses_counts_that_do_not_fit_the_requests():
    model, mgr = _setup()
    mgr.set_active_adapters([_adapter(model, 1)])
    np.testing.assert_array_equal(mgr.token_mapping([1, None], [2, 1]), [0, 0, -1])
    np.testing.assert_array_equal(mgr.token_mapping([1, None], 2), [0, 0, -1, -1])
    with pytest.raises(ValueError, match=r"shape \(3,\); expected one count per request \(2\)"):
        mgr.token_mapping([1, None], [1, 2, 3])
    with pytest.raises(ValueError, match="counts >= 0"):
        mgr.token_mapping([1, None], [1, -1])
    with pytest.raises(ValueError, match="counts >= 0"):
        mgr.token_mapping([1, None], [1.5, 1])


@pytest.mark.parametrize("explicit", [False, True])
def test_a_slot_write_keeps_the_stacks_sharding_objects(explicit):
    """On Auto axes the write's outputs came back as equivalent shardings spelled otherwise
    (`P(None, None, None)` as `P()`), and a forward compiled before the first adapter
    compiled again after it (jit keys on the spelling); now the very same shardings stay."""
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(kind, kind))
    model, mgr = _setup(rules=lj.ShardingRules(mesh))
    before = jax.tree.map(lambda v: v.sharding, nnx.state(model, nnx.LoRAParam, lj.LoRASlotRanks))
    traces = []
    graphdef = nnx.graphdef(model)
    layer = model.model.layers[0].self_attn.qkv_proj

    @jax.jit
    def fwd(state, x, idx):
        traces.append(1)
        m = nnx.merge(graphdef, state)
        lj.set_lora_mapping(m, idx)
        return m.model.layers[0].self_attn.qkv_proj(x)

    x = jnp.ones((8, layer.base_layer.in_features), jnp.float32)
    idx = jnp.zeros((8,), jnp.int32)
    fwd(nnx.state(model), x, idx)
    mgr.set_active_adapters([_adapter(model, 1, targets=ALL)])
    after = jax.tree.map(lambda v: v.sharding, nnx.state(model, nnx.LoRAParam, lj.LoRASlotRanks))
    assert jax.tree.leaves(before) == jax.tree.leaves(after)
    fwd(nnx.state(model), x, idx)
    assert len(traces) == 1


def test_write_slot_updates_refuses_an_index_outside_the_slots():
    model, _ = _setup()
    layer = next(iter(lora_layers(model).values()))
    before = [np.asarray(v[...]) for v in layer.lora_a]
    for bad in (-1, 2, True, 1.0):
        with pytest.raises(ValueError, match="must be an int in \\[0, 2\\)"):
            slot_writes.write_slot_updates(bad, layer.slot_updates(None))
    for v, old in zip(layer.lora_a, before):
        np.testing.assert_array_equal(np.asarray(v[...]), old)


@pytest.mark.parametrize("lru", [False, True], ids=["plain", "lru"])
def test_remove_all_adapters_with_a_merged_slot_changes_nothing(lru):
    """An adapter in a merged slot cannot be removed: `remove_all_adapters` removed the
    adapters registered before it, then raised; it now raises before removing any."""
    from lora_jax.serving.merge import merge_adapter, unmerge_adapter

    model, mgr = _setup(max_loras=3, max_cpu_loras=3, lru=lru)
    for i, a in _adapters(model, 3).items():
        mgr.add_adapter(a)
        mgr.activate_adapter(i)
    merge_adapter(model, mgr.slot_of(2))
    before, arrays = (sorted(mgr.list_adapters()), _slots(mgr)), _lora_arrays(model)
    with pytest.raises(ValueError, match="merge_adapter folded"):
        mgr.remove_all_adapters()
    assert (sorted(mgr.list_adapters()), _slots(mgr)) == before
    jax.tree.map(np.testing.assert_array_equal, arrays, _lora_arrays(model))
    unmerge_adapter(model)
    mgr.remove_all_adapters()
    assert len(mgr) == 0 and _slots(mgr) == [None] * 3


@pytest.mark.parametrize("lru", [False, True], ids=["plain", "lru"])
def test_add_adapters_is_all_or_nothing(lru):
    """`add_adapters` with a bad adapter after good ones (a rank no layer takes, an id
    taken twice, not an adapter) added and activated the good ones, then raised; now
    every adapter is checked first and nothing is registered, activated or written."""
    model, mgr = _setup(max_loras=3, max_cpu_loras=3, lru=lru)
    ad = _adapters(model, 3)
    mgr.add_adapter(ad[1])
    mgr.activate_adapter(1)
    state = lambda: (sorted(mgr.list_adapters()), _slots(mgr))  # noqa: E731
    before, arrays = state(), _lora_arrays(model)
    other = dataclasses.replace(ad[3], id=2, name="other")
    for bad, match in (
        ([ad[2], _too_big(model, 4)], "max_lora_rank"),
        ([ad[2], other], "'a2' and 'other' both have id 2"),
        ([ad[2], "a3"], "expected LoRAAdapters, got a str"),
    ):
        with pytest.raises(ValueError, match=match):
            mgr.add_adapters(bad, activate=True, progress=False)
        assert state() == before, bad
        jax.tree.map(np.testing.assert_array_equal, arrays, _lora_arrays(model))
    assert mgr.add_adapters([ad[2], ad[1]], activate=True, progress=False) == [True, False]
    assert _slots(mgr) == [1, 2, None]
    # the slots hold what activating them one by one writes
    _, ref = _setup(max_loras=3, max_cpu_loras=3, lru=lru)
    for i in (1, 2):
        ref.add_adapter(ad[i])
        ref.activate_adapter(i)
    jax.tree.map(np.testing.assert_array_equal, _lora_arrays(ref.model), _lora_arrays(model))
    if lru:  # a full CPU cache: registering ad[3] evicted adapter 1 before ad[4] failed
        mgr.add_adapter(ad[3])
        before = _state(mgr)
        with pytest.raises(ValueError, match="max_lora_rank"):
            mgr.add_adapters([_adapter(model, 5), _too_big(model, 4)], progress=False)
        assert _state(mgr) == before


def test_token_mapping_takes_requests_and_adapters_by_id():
    """`token_mapping` takes what `set_active_adapters` takes: a `LoRARequest` or a
    `LoRAAdapter` maps by its id (it was "unknown", with the whole adapter printed); any
    other type is refused by type name, never with a raw `TypeError` or an array dump."""
    model, mgr = _setup()
    a7, a8 = _adapter(model, 7), _adapter(model, 8)
    mgr.set_active_adapters([a8, a7])
    by_id = mgr.token_mapping([7, None, 8, 7])
    requests = [LoRARequest("a7", 7), None, a8, a7]
    np.testing.assert_array_equal(mgr.token_mapping(requests), by_id)
    np.testing.assert_array_equal(
        mgr.token_mapping(requests, [2, 1, 0, 3]), np.repeat(by_id, [2, 1, 0, 3])
    )
    with pytest.raises(ValueError, match="adapter 9, which is unknown; active: ") as e:
        mgr.token_mapping([LoRARequest("a9", 9)])
    assert len(str(e.value)) < 200
    other = dataclasses.replace(_adapter(model, 2), id=7, name="other")
    with pytest.raises(ValueError, match="id 7 is already adapter 'a7'"):
        mgr.token_mapping([other])  # its requests would get a7's weights
    for bad, got in (([1], "a list"), (np.ones(1000), "a ndarray"), ({7: 1}, "a dict")):
        with pytest.raises(ValueError, match=f"must be an int or None .*, got {got}$") as e:
            mgr.token_mapping([7, bad])
        assert len(str(e.value)) < 200


def test_host_cost_of_a_step_does_not_grow_with_the_cpu_cache(monkeypatch):
    """A worker step walked every LoRA layer once per registered adapter (finding the
    merged slots), and `token_mapping` compared a copy's weights once per request: the
    walks and comparisons are counted, not timed."""

    model, mgr = _setup(max_loras=2, max_cpu_loras=16)
    adapters = _adapters(model, n=16)
    mgr.add_adapters(list(adapters.values()))
    walks = []
    real = LRUCacheLoRAModelManager._merged_slots
    monkeypatch.setattr(
        LRUCacheLoRAModelManager, "_merged_slots", lambda self: walks.append(1) or real(self)
    )
    mgr.set_active_adapters([1, 2])
    mgr.set_active_adapters([LoRARequest("a1", 1, ""), 2])
    assert len(walks) <= 8, len(walks)  # was 16 + ... per step
    compares = []
    from lora_jax.serving import manager_checks  # where a step compares two adapters

    real_same = manager_checks._same_adapter
    monkeypatch.setattr(
        manager_checks, "_same_adapter", lambda a, b: compares.append(1) or real_same(a, b)
    )
    copy = dataclasses.replace(adapters[1])  # an equal copy of a registered adapter
    slots = mgr.token_mapping([copy] * 32 + [2])
    assert slots.tolist() == [mgr.slot_of(1)] * 32 + [mgr.slot_of(2)]
    assert len(compares) == 1
    mgr.set_active_adapters([copy, dataclasses.replace(adapters[1]), 2])
    assert len(compares) <= 4


def _peft_dirs(tmp_path, names):
    import json

    from lora_jax.serving.peft import write_safetensors

    dirs = {}
    for seed, name in enumerate(names, 1):
        d = tmp_path / name
        d.mkdir()
        cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        write_safetensors(
            d / "adapter_model.safetensors", peft_tensors(["q_proj"], 4, n_layers=1, seed=seed)
        )
        dirs[name] = d
    return dirs


@pytest.mark.parametrize("lru", [False, True], ids=["plain", "lru"])
def test_a_request_is_never_served_another_adapter_under_its_id(tmp_path, lru):
    """`load_adapters` gave a removed adapter's id to the next one, and a `LoRARequest`
    for the old one was then served the new one's weights (an adapter object was refused).
    Default ids now never repeat; a request naming another adapter than the one under its
    id (name, or directory by real path) is refused; another spelling of the directory,
    no path, or an adapter made from tensors (no directory: its name decides) match."""
    from lora_jax.serving.peft import load_peft_adapter

    dirs = _peft_dirs(tmp_path, ["sql", "chat"])
    model, mgr = _setup(max_loras=2, max_cpu_loras=3, lru=lru)
    (sql,) = mgr.load_adapters({"sql": dirs["sql"]}, progress=False)
    mgr.remove_adapter(sql.id)
    (chat,) = mgr.load_adapters({"chat": dirs["chat"]}, progress=False)
    assert chat.id != sql.id
    # a client still asking for sql gets sql: reloaded from its path, under its own id
    req = LoRARequest("sql", sql.id, str(dirs["sql"]))
    mgr.set_active_adapters([req, chat.id])
    idx = jnp.asarray(mgr.token_mapping([req] * 3))
    ref_model, ref = _setup(max_loras=2, max_cpu_loras=2, lru=lru)
    sql_ref = load_peft_adapter(dirs["sql"], ref_model, ref.lora_config, adapter_id=1)
    ref.set_active_adapters([sql_ref])
    want = _layer_outputs(ref_model, jnp.full(3, ref.slot_of(1), jnp.int32))
    jax.tree.map(np.testing.assert_array_equal, _layer_outputs(model, idx), want)

    # an explicit first_id may reuse a freed id: the requests for the old adapter are refused
    mgr.remove_adapter(sql.id)
    (again,) = mgr.load_adapters({"chat2": dirs["chat"]}, first_id=sql.id, progress=False)
    tensors = _adapter(model, 5)  # no directory
    mgr.add_adapter(tensors)
    before = (sorted(mgr.list_adapters()), _slots(mgr))
    arrays = _lora_arrays(model)
    for bad, held in (
        (req, "'chat2'"),  # another name
        (LoRARequest("chat2", sql.id, str(dirs["sql"])), "'chat2'"),  # another directory
        (LoRARequest("b5", 5, str(dirs["sql"])), "'a5'"),
    ):
        for call in (mgr.set_active_adapters, mgr.token_mapping):
            with pytest.raises(ValueError, match=f"id {bad.lora_int_id} is already adapter {held}"):
                call([bad])
        assert (sorted(mgr.list_adapters()), _slots(mgr)) == before
        jax.tree.map(np.testing.assert_array_equal, arrays, _lora_arrays(model))
    with pytest.raises(ValueError, match=f"id {sql.id} is already adapter 'chat2'"):
        mgr.set_active_adapters([sql.id, req])  # the bare id does not hide the request
    with pytest.raises(ValueError, match=r"'chat2' \(.*\) and 'sql' \(.*\) are both requested"):
        mgr.set_active_adapters([LoRARequest("chat2", sql.id, str(dirs["chat"])), req])
    same = [
        LoRARequest("chat2", sql.id, str(tmp_path / "sql" / ".." / "chat")),
        LoRARequest("chat2", sql.id),
        LoRARequest("a5", 5, "/not/where/it/came/from"),
    ]
    mgr.set_active_adapters(same)
    assert mgr.token_mapping(same).tolist() == [mgr.slot_of(sql.id)] * 2 + [mgr.slot_of(5)]
    assert mgr.get_adapter(sql.id) is again


@pytest.mark.parametrize("lru", [False, True], ids=["plain", "lru"])
def test_a_request_without_a_name_is_refused(tmp_path, lru):
    """A `LoRARequest` named "" or None loaded (the loader named the adapter after its
    directory) and served its first step, then was refused on every later step: its name
    was not the adapter's. vLLM's lora_name is a str; one that is empty or not a str is
    refused where the request is made; a named one serves step after step."""
    for bad in ("", None, 7, b"sql"):
        with pytest.raises(ValueError, match=rf"lora_name must be a non-empty str.*{bad!r}$"):
            LoRARequest(bad, 1, "/adapters/sql")
    dirs = _peft_dirs(tmp_path, ["sql"])
    model, mgr = _setup(lru=lru)
    req = LoRARequest("sql", 1, str(dirs["sql"]))
    for _ in range(2):
        mgr.set_active_adapters([req])
        assert mgr.token_mapping([req]).tolist() == [mgr.slot_of(1)]
    assert mgr.get_adapter(1).name == req.lora_name


def test_load_adapters_refuses_one_path_and_a_bad_first_id(tmp_path):
    """One path (a str was loaded character by character, a Path was a bare TypeError)
    and a first_id that is not an int >= 1 ('1' and 1.5 were bare TypeErrors, True was
    taken as 1) are refused before anything is loaded; the path in a list loads."""
    from lora_jax.serving.peft import load_peft_adapter

    dirs = _peft_dirs(tmp_path, ["sql"])
    model, mgr = _setup(lru=False)
    arrays = _lora_arrays(model)
    for path in (str(dirs["sql"]), dirs["sql"]):
        with pytest.raises(ValueError, match=r"paths must be a list .* mapping .* single path"):
            mgr.load_adapters(path, progress=False)
    for bad in ("1", 1.5, True, 0):
        with pytest.raises(ValueError, match=rf"first_id must be an int >= 1 .*got {bad!r}$"):
            mgr.load_adapters([dirs["sql"]], first_id=bad, progress=False)
    assert mgr.list_adapters() == {} and mgr._id_mark == 0
    jax.tree.map(np.testing.assert_array_equal, arrays, _lora_arrays(model))
    (sql,) = mgr.load_adapters([dirs["sql"]], progress=False)
    ref = load_peft_adapter(dirs["sql"], model, mgr.lora_config, adapter_id=1)
    assert (sql.id, sql.name) == (ref.id, ref.name) and list(mgr.list_adapters()) == [1]


@pytest.mark.parametrize("pin", [False, True], ids=["merged", "pinned"])
def test_a_cpu_cache_full_of_merged_or_pinned_adapters_says_so(pin):
    """`add_adapter` and `remove_oldest_adapter` with the CPU cache full of a merged
    adapter said "All items are pinned" (none was); they now name the merged or pinned
    adapters and what frees them, and change nothing."""
    from lora_jax.serving.merge import merge_adapter, unmerge_adapter

    model, mgr = _setup(max_loras=1, max_cpu_loras=1)
    a1, a2 = _adapter(model, 1), _adapter(model, 2)
    mgr.set_active_adapters([a1])
    if pin:
        mgr.pin_adapter(1)
    else:
        merge_adapter(model, mgr.slot_of(1))
    before, arrays = _state(mgr), _lora_arrays(model)
    what = r"pinned adapter \[1\] or one in a merged slot \[\]" if pin else r"\[\] or .* \[1\]"
    for name, call in (
        ("add_adapter", lambda: mgr.add_adapter(a2)),
        ("remove_oldest_adapter", mgr.remove_oldest_adapter),
    ):
        with pytest.raises(RuntimeError, match=f"^{name}: every CPU cache entry .*{what}.*"):
            call()
        assert _state(mgr) == before
        jax.tree.map(np.testing.assert_array_equal, arrays, _lora_arrays(model))
    with pytest.raises(RuntimeError, match="unmerge_adapter to free a merged one, remove_adapter"):
        mgr.add_adapter(a2)
    if pin:
        mgr.remove_adapter(1)
    else:
        unmerge_adapter(model)
    assert mgr.add_adapter(a2) and sorted(mgr.list_adapters()) == [2]


@pytest.mark.parametrize("lru", [False, True], ids=["plain", "lru"])
def test_a_reserved_slot_is_never_written(lru):
    """A slot kept for training (`reserve_slot`) is never activated into, evicted or
    written, and counts as taken in the errors; a slot holding an adapter cannot be
    reserved; `release_slot` gives it back."""
    from lora_jax.serving.training import init_lora_slot

    model, mgr = _setup(max_loras=3, max_cpu_loras=4, lru=lru)
    ad = _adapters(model, 4)
    mgr.add_adapter(ad[1])
    mgr.activate_adapter(1)
    with pytest.raises(ValueError, match=r"slot 0 holds adapter 1; deactivate_adapter\(1\)"):
        mgr.reserve_slot(0)
    assert mgr.reserve_slot(1) and not mgr.reserve_slot(1) and mgr.reserved_slots == [1]
    init_lora_slot(model, 1, 4, seed=3)  # as if trained: B != 0
    for layer in lora_layers(model).values():
        for v in layer.lora_b:
            v.set_value(v[...].at[1].set(0.05))
    trained = _slot_state(model, 1), [np.asarray(v[...][1]) for v in _lora_b(model)]
    mgr.add_adapter(ad[2])
    mgr.activate_adapter(2)
    assert _slots(mgr) == [1, None, 2]
    mgr.add_adapter(ad[3])
    if lru:
        mgr.activate_adapter(3)  # evicts 1, the least recently used, never slot 1
        assert _slots(mgr) == [3, None, 2]
        with pytest.raises(RuntimeError, match=r"not reserved for training \(reserved: \[1\]\)"):
            mgr.set_active_adapters([2, 3, 4])
    else:
        with pytest.raises(ValueError, match=r"slots \[1\] are reserved for training"):
            mgr.activate_adapter(3)
        with pytest.raises(RuntimeError, match=r"2 device slots .*reserved: \[1\]"):
            mgr.set_active_adapters([1, 2, 3])
    with pytest.raises(ValueError, match="slot 1 is reserved for training"):
        mgr.write_slot(1, ad[4])
    now = _slot_state(model, 1), [np.asarray(v[...][1]) for v in _lora_b(model)]
    jax.tree.map(np.testing.assert_array_equal, now, trained)
    assert mgr.release_slot(1) and not mgr.release_slot(1) and mgr.reserved_slots == []
    aid = 4 if lru else 3  # the plain manager has slot 1 free; the LRU evicted 1 for 3
    mgr.add_adapter(ad[aid])
    assert mgr.activate_adapter(aid) and _slots(mgr)[1] == aid


def _lora_b(model):
    return [v for la in lora_layers(model).values() for v in la.lora_b]


@pytest.mark.parametrize("lru", [True, False], ids=["lru", "plain"])
def test_a_second_manager_of_a_model_retires_the_first(lru):
    """Two managers of one model would both write slot 0 (each counts it free), and the
    first one's requests would get the second one's adapter: a new manager (of the model
    or of its backbone; a notebook cell run again) retires the older one, whose calls
    then refuse, changing nothing."""
    model, mgr = _setup(lru=lru)
    cfg = mgr.lora_config
    ad = _adapters(model, 3)
    mgr.set_active_adapters([ad[1]])
    for target in (model.model, model):
        other = (LRUCacheLoRAModelManager if lru else LoRAModelManager)(target, cfg)
        assert managers_of(model) == [other]
        want = _lora_arrays(model)
        for name, args in (
            ("token_mapping", ([1],)),
            ("set_active_adapters", ([ad[2]],)),
            ("activate_adapter", (1,)),
            ("write_slot", (1, ad[2])),
        ):
            with pytest.raises(ValueError, match="a newer manager of this model"):
                getattr(mgr, name)(*args)
        jax.tree.map(np.testing.assert_array_equal, _lora_arrays(model), want)
        mgr = other
    mgr.set_active_adapters([ad[2]])  # the newest serves, from a clean slot table
    assert _slots(mgr) == [2, None]
    np.testing.assert_array_equal(mgr.token_mapping([2]), [0])


@pytest.mark.parametrize("lru", [True, False], ids=["lru", "plain"])
def test_a_manager_refuses_its_model_once_unwrapped(lru):
    """After `unwrap_model` (and `wrap_model` again) the manager's layers are gone from
    the model: writing slots or mapping requests through it would serve the base model,
    so every such call refuses; another model's wrap changes nothing for it."""
    from lora_jax.serving.wrap import unwrap_model

    model, mgr = _setup(lru=lru)
    ad = _adapters(model, 3)
    mgr.set_active_adapters([ad[1]])
    _setup()  # another model wrapped: this manager's layers are still the model's
    np.testing.assert_array_equal(mgr.token_mapping([1]), [0])
    calls = {
        "activate_adapter": lambda: mgr.activate_adapter(1),
        "token_mapping": lambda: mgr.token_mapping([1]),
        "set_active_adapters": lambda: mgr.set_active_adapters([ad[2]]),
        "add_adapter": lambda: mgr.add_adapter(ad[3]),
        "add_adapters": lambda: mgr.add_adapters([ad[3]], activate=True, progress=False),
        "write_slot": lambda: mgr.write_slot(1, ad[2]),
    }
    for rewrap in (False, True):
        if rewrap:
            wrap_model(model, mgr.lora_config, packed_modules_mapping=PACKED)
        else:
            unwrap_model(model)
        for what, call in calls.items():
            with pytest.raises(ValueError, match=rf"{what}: the model was unwrapped.*new manager"):
                call()
        assert _slots(mgr) == [1, None] and sorted(mgr.list_adapters()) == [1]
    fresh = LRUCacheLoRAModelManager(model, mgr.lora_config)  # the stale one is no owner
    fresh.set_active_adapters([ad[1]])
    np.testing.assert_array_equal(fresh.token_mapping([1]), [0])


@pytest.mark.parametrize("lru", [True, False], ids=["lru", "plain"])
def test_manager_id_methods_refuse_ids_that_are_not_ints(lru):
    """An adapter id is an int >= 1 (as `token_mapping` and `add_adapter` say): a bool or
    a float equal to an id, or a jax array, is refused with nothing changed; a numpy
    integer is the int, stored as one."""
    model, mgr = _setup(lru=lru)
    mgr.add_adapter(_adapter(model, 1))
    methods = ["activate_adapter", "deactivate_adapter", "remove_adapter", "slot_of"]
    methods += ["get_adapter"] + (["pin_adapter"] if lru else [])
    for bad in (True, 1.0, jnp.int32(1), 0):
        for name in methods:
            with pytest.raises(ValueError, match=rf"{name}: adapter_id must be an int >= 1"):
                getattr(mgr, name)(bad)
            assert _slots(mgr) == [None, None] and sorted(mgr.list_adapters()) == [1]
    assert mgr.activate_adapter(np.int64(1)) and mgr.slot_of(np.int32(1)) == 0
    assert [type(x) for x in _slots(mgr)] == [int, type(None)]
    assert mgr.get_adapter(np.int64(1)) is mgr.get_adapter(1)
    assert mgr.remove_adapter(np.int64(1)) and len(mgr) == 0 and _slots(mgr) == [None, None]
