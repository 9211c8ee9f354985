"""DoRA adapters (PEFT `use_dora`) against HF peft on CPU: each served beside a plain LoRA
adapter and the base in one batch, row by row as PEFT computes them."""

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import jax.numpy as jnp  # noqa: E402
import safetensors.numpy  # noqa: E402
from flax import nnx  # noqa: E402
from hf_tiny import V, peft_rows, peft_sgd_steps, tiny_llama_dir  # noqa: E402
from layer_cases import make_mesh  # noqa: E402

import lora_jax as lj  # noqa: E402
from lora_jax.models import load_hf_model  # noqa: E402
from lora_jax.serving.export import save_peft_adapter  # noqa: E402
from lora_jax.serving.manager import LRUCacheLoRAModelManager  # noqa: E402
from lora_jax.serving.merge import merge_adapter, unmerge_adapter  # noqa: E402
from lora_jax.serving.peft import WEIGHTS_NAME  # noqa: E402
from lora_jax.serving.wrap import lora_layers, wrap_model  # noqa: E402

pytestmark = pytest.mark.oracle

TOL = dict(rtol=2e-4, atol=2e-4)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapter(base_dir, out, seed, **spec):
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pm = peft.get_peft_model(hf, peft.LoraConfig(lora_dropout=0.0, **spec))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random factors; magnitudes away from the norms they start at
        for name, p in pm.named_parameters():
            if any(k in name for k in ("lora_A", "lora_B", "lora_embedding_")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "lora_magnitude_vector" in name:
                p.mul_(torch.rand(p.shape, generator=g) + 0.5)
    pm.save_pretrained(out, safe_serialization=True)
    return out


def _peft_merged_logits(base_dir, src, ids):
    """PEFT's merge_and_unload of the adapter in `src`: its logits for `ids`."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(hf, src).merge_and_unload().eval()
    with torch.no_grad():
        return merged(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()


def _served(base_dir, name, src, mesh):
    """The base model wrapped with DoRA on, `src` loaded and active as `name`: `(model,
    manager, adapter, slot)`."""
    rules = None if mesh is None else lj.ShardingRules(make_mesh(*mesh))
    model = load_hf_model(base_dir, rules=rules)
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, enable_dora=True)
    wrap_model(model, cfg)
    mgr = LRUCacheLoRAModelManager(model, cfg)
    (adapter,) = mgr.load_adapters({name: src}, activate=True, progress=False)
    return model, mgr, adapter, mgr.lora_index_to_id.index(adapter.id)


@nnx.jit
def _forward(model, ids, slots):
    with lj.lora_mapping(model, slots):
        pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        return model(ids, pos)[0]


@pytest.mark.parametrize("mesh", [None, (2, 2)], ids=["one_device", "dp2tp2"])
def test_dora_adapters_match_peft_in_a_mixed_batch(tmp_path, mesh):
    """Two DoRA adapters (one on every projection, one rsLoRA on a few with a rank
    pattern) and a plain one, in one batch with the base: each row as PEFT gives it;
    on a dp = 2 x tp = 2 mesh too. Merge and export refuse such a slot."""
    base_dir = tiny_llama_dir(tmp_path)
    dirs = {
        "dora": _adapter(base_dir, str(tmp_path / "d"), 1, r=4, lora_alpha=8,
                         target_modules=TARGETS, use_dora=True),
        "dora_rs": _adapter(base_dir, str(tmp_path / "r"), 2, r=8, lora_alpha=4,
                            target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True,
                            use_rslora=True, rank_pattern={"v_proj": 2}),
        "plain": _adapter(base_dir, str(tmp_path / "p"), 3, r=4, lora_alpha=8,
                          target_modules=TARGETS),
    }  # fmt: skip
    rules = None if mesh is None else lj.ShardingRules(make_mesh(*mesh))
    model = load_hf_model(base_dir, rules=rules)
    cfg = lj.LoRAConfig(max_loras=3, max_lora_rank=8, enable_dora=True)
    wrap_model(model, cfg)
    mgr = LRUCacheLoRAModelManager(model, cfg)
    loaded = {a.name: a.id for a in mgr.load_adapters(dirs, activate=True, progress=False)}
    names = ["dora", "plain", "__base__", "dora_rs", "dora"]
    ids = np.random.default_rng(0).integers(0, V, (len(names), 6)).astype(np.int32)
    want = peft_rows(base_dir, dirs, ids, names)
    slots = mgr.token_mapping([loaded.get(n) for n in names], tokens_per_request=6)
    got = np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(slots)))
    np.testing.assert_allclose(got, want, **TOL)
    # DoRA matters: the same slots as plain LoRA (every scale 1) give other logits
    for layer in lora_layers(model).values():
        if getattr(layer, "dora_norm", None) is not None:
            for s in range(cfg.max_loras):
                layer._zero_dora(s)
    plain = np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(slots)))
    assert np.abs(plain[[0, 3]] - want[[0, 3]]).max() > 1e-2
    np.testing.assert_allclose(plain[[1, 2]], want[[1, 2]], **TOL)


def test_a_dora_adapter_is_refused_without_enable_dora(tmp_path):
    base_dir = tiny_llama_dir(tmp_path)
    d = _adapter(base_dir, str(tmp_path / "d"), 1, r=4, lora_alpha=8, target_modules=["q_proj"],
                 use_dora=True)  # fmt: skip
    model = load_hf_model(base_dir)
    cfg = lj.LoRAConfig(max_loras=1, max_lora_rank=8)
    wrap_model(model, cfg)
    mgr = LRUCacheLoRAModelManager(model, cfg)
    with pytest.raises(ValueError, match=r"DoRA adapter .*LoRAConfig\(enable_dora=True\)"):
        mgr.load_adapters({"d": d}, activate=True, progress=False)


@pytest.mark.parametrize("mesh", [None, (1, 2)], ids=["one_device", "tp2"])
def test_a_dora_slot_merges_and_saves_as_peft_does(tmp_path, mesh):
    """merge_adapter of a DoRA slot (an rsLoRA one with a rank pattern) gives PEFT's logits
    with no mapping, as PEFT's merge_and_unload does; save_peft_adapter writes magnitudes
    that PEFT loads to the same logits, equal to the file's own."""
    base_dir = tiny_llama_dir(tmp_path)
    src = _adapter(base_dir, str(tmp_path / "r"), 2, r=8, lora_alpha=4, use_dora=True,
                   target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                   use_rslora=True, rank_pattern={"v_proj": 2})  # fmt: skip
    ids = np.random.default_rng(0).integers(0, V, (2, 6)).astype(np.int32)
    want = peft_rows(base_dir, {"d": src}, ids, ["d", "d"])
    hf_merged = _peft_merged_logits(base_dir, src, ids)
    np.testing.assert_allclose(hf_merged, want, **TOL)  # PEFT's merge: its own forward
    model, _, _, slot = _served(base_dir, "d", src, mesh)
    merge_adapter(model, slot)
    pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), ids.shape)
    got = np.asarray(nnx.jit(lambda m, i, p: m(i, p)[0])(model, jnp.asarray(ids), pos))
    np.testing.assert_allclose(got, want, **TOL)
    unmerge_adapter(model)
    saved = save_peft_adapter(model, slot, tmp_path / "saved")
    assert peft.LoraConfig.from_pretrained(saved).use_dora
    np.testing.assert_allclose(peft_rows(base_dir, {"d": saved}, ids, ["d", "d"]), want, **TOL)
    ours, theirs = (safetensors.numpy.load_file(f"{d}/{WEIGHTS_NAME}") for d in (saved, src))
    mags = sorted(k for k in theirs if "lora_magnitude_vector" in k)
    assert sorted(k for k in ours if "lora_magnitude_vector" in k) == mags and len(mags) == 8
    for k in mags:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh", [None, (1, 4)], ids=["one_device", "tp4"])
def test_a_dora_adapter_trains_here_as_peft_trains_it(tmp_path, mesh):
    """init_lora_slot(use_dora=True) starts the slot as the base model with PEFT's
    magnitudes (PEFT's own fresh DoRA adapter's, `||W||`); two SGD steps here (the norms
    refreshed after each update) and in PEFT, from the same saved start on the same loss,
    give the same factors and magnitudes; on tp = 4 too (each kv head held twice, the
    token embedding's and the lm_head's vocab split in four)."""
    import jax
    import optax

    from lora_jax.serving.training import (
        init_lora_slot,
        refresh_dora_norms,
        tie_kv_replicas,
        train_only_slots,
    )

    base_dir = tiny_llama_dir(tmp_path)
    rules = None if mesh is None else lj.ShardingRules(make_mesh(*mesh))
    model = load_hf_model(base_dir, rules=rules)
    wrap_model(model, lj.LoRAConfig(max_loras=2, max_lora_rank=8, enable_dora=True))
    slot = 1
    targets = [*TARGETS, "embed_tokens", "lm_head"]  # their norms: over the vocab, over D
    init_lora_slot(model, slot, 4, target_modules=targets, use_dora=True)
    ids = np.random.default_rng(0).integers(0, V, (2, 6)).astype(np.int32)
    slots = jnp.full(ids.size, slot, jnp.int32)
    base = peft_rows(base_dir, {}, ids, ["__base__"] * len(ids))
    np.testing.assert_allclose(np.asarray(_forward(model, jnp.asarray(ids), slots)), base, **TOL)
    start = save_peft_adapter(model, slot, tmp_path / "start")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    fresh = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=targets, use_dora=True))
    theirs = {k: v.detach().numpy() for k, v in peft.get_peft_model_state_dict(fresh).items()}
    mine = safetensors.numpy.load_file(f"{start}/{WEIGHTS_NAME}")
    mags = sorted(k for k in theirs if "lora_magnitude_vector" in k)
    assert sorted(k for k in mine if "lora_magnitude_vector" in k) == mags and len(mags) == 16
    for k in mags:
        np.testing.assert_allclose(mine[k], theirs[k], rtol=1e-5, err_msg=k)  # PEFT's start
    lr = 0.5

    def loss_fn(m):
        with lj.lora_mapping(m, slots):
            logits = m(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(6), ids.shape))[0]
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], -1))

    tx = optax.chain(tie_kv_replicas(model), optax.sgd(lr), train_only_slots([slot]))
    with jax.set_mesh(rules.mesh) if rules else contextlib.nullcontext():
        opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, opt):
        opt.update(model, nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model))
        refresh_dora_norms(model, slot)

    for _ in range(2):
        step(model, opt)
    ours = save_peft_adapter(model, slot, tmp_path / "ours")
    peft_sgd_steps(base_dir, start, ids, lr, 2, tmp_path / "theirs")
    got, want, first = (
        safetensors.numpy.load_file(f"{d}/{WEIGHTS_NAME}")
        for d in (ours, tmp_path / "theirs", start)
    )
    # PEFT also saves the embedding's base table when the embedding is targeted
    want = {k: v for k, v in want.items() if not k.endswith(".base_layer.weight")}
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
    mags = [k for k in want if "lora_magnitude_vector" in k]
    assert len(mags) == 16 and all(np.abs(want[k] - first[k]).max() > 1e-4 for k in mags)
    # served, the trained slot gives PEFT's logits
    want_rows = peft_rows(base_dir, {"t": str(tmp_path / "theirs")}, ids, ["t", "t"])
    got_rows = np.asarray(_forward(model, jnp.asarray(ids), slots))
    np.testing.assert_allclose(got_rows, want_rows, **TOL)


@pytest.mark.parametrize("mesh", [None, (1, 2)], ids=["one_device", "tp2"])
def test_dora_on_the_embedding_and_lm_head_serves_merges_and_saves_as_peft(tmp_path, mesh):
    """A DoRA adapter on the token embedding (PEFT's DoraEmbeddingLayer: a gain per
    embedding unit, the norm over the vocab), the lm_head (a gain per vocab row, the norm
    over the hidden dim) and two projections, beside the base in one batch: each row as
    PEFT gives it, on a vocab-split tp = 2 mesh too; merged, PEFT's merge_and_unload
    logits; saved, the file's own magnitudes and PEFT's logits."""
    base_dir = tiny_llama_dir(tmp_path)
    src = _adapter(base_dir, str(tmp_path / "e"), 4, r=4, lora_alpha=8, use_dora=True,
                   target_modules=["embed_tokens", "q_proj", "down_proj", "lm_head"])  # fmt: skip
    ids = np.random.default_rng(1).integers(0, V, (3, 6)).astype(np.int32)
    names = ["e", "__base__", "e"]
    want = peft_rows(base_dir, {"e": src}, ids, names)
    hf_merged = _peft_merged_logits(base_dir, src, ids[[0]])
    np.testing.assert_allclose(hf_merged, want[[0]], **TOL)  # PEFT's merge: its own forward
    model, mgr, adapter, slot = _served(base_dir, "e", src, mesh)
    slots = mgr.token_mapping([adapter.id, None, adapter.id], tokens_per_request=6)
    got = np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(slots)))
    np.testing.assert_allclose(got, want, **TOL)
    emb = lora_layers(model)["model.embed_tokens"]
    plain = np.asarray(emb.dora_norm[...])[slot] > 0
    assert plain.all()  # every embedding unit of the slot is DoRA
    merge_adapter(model, slot)
    pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), ids.shape)
    merged_here = np.asarray(nnx.jit(lambda m, i, p: m(i, p)[0])(model, jnp.asarray(ids), pos))
    np.testing.assert_allclose(merged_here[[0, 2]], want[[0, 2]], **TOL)
    unmerge_adapter(model)
    saved = save_peft_adapter(model, slot, tmp_path / "saved")
    assert peft.LoraConfig.from_pretrained(saved).use_dora
    np.testing.assert_allclose(peft_rows(base_dir, {"e": saved}, ids, names), want, **TOL)
    ours, theirs = (safetensors.numpy.load_file(f"{d}/{WEIGHTS_NAME}") for d in (saved, src))
    mags = sorted(k for k in theirs if "lora_magnitude_vector" in k)
    assert sorted(k for k in ours if "lora_magnitude_vector" in k) == mags and len(mags) == 6
    assert any("embed_tokens" in k for k in mags) and any("lm_head" in k for k in mags)
    for k in mags:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6)


def test_dora_on_a_tied_model_s_embedding_and_lm_head_matches_peft(tmp_path):
    """Tied embeddings: DoRA on the lm_head (its norms from the shared table) and on the
    embedding, beside the base in one batch, as PEFT gives each row."""
    base_dir = tiny_llama_dir(tmp_path, tied=True)
    src = _adapter(base_dir, str(tmp_path / "t"), 5, r=4, lora_alpha=8, use_dora=True,
                   target_modules=["lm_head", "embed_tokens", "q_proj"])  # fmt: skip
    ids = np.random.default_rng(1).integers(0, V, (2, 6)).astype(np.int32)
    want = peft_rows(base_dir, {"t": src}, ids, ["t", "__base__"])
    model, mgr, adapter, _ = _served(base_dir, "t", src, None)
    assert type(model.lm_head).__name__ == "TiedLMHeadWithLoRA"
    slots = mgr.token_mapping([adapter.id, None], tokens_per_request=6)
    got = np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(slots)))
    np.testing.assert_allclose(got, want, **TOL)
