"""PEFT trainable tokens (`trainable_token_indices`) against HF peft on CPU: a LoRA adapter
whose chosen token ids carry their own embedding (and lm_head) rows, served in a mixed
batch beside a plain adapter and the base, tied and untied, and saved back for peft."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from hf_tiny import V, peft_rows, peft_sgd_steps, tiny_llama_dir  # noqa: E402

import lora_jax as lj  # noqa: E402
from lora_jax.models import load_hf_model  # noqa: E402
from lora_jax.serving.export import save_peft_adapter  # noqa: E402
from lora_jax.serving.manager import LRUCacheLoRAModelManager  # noqa: E402
from lora_jax.serving.merge import merge_adapter, unmerge_adapter  # noqa: E402
from lora_jax.serving.wrap import wrap_model  # noqa: E402

pytestmark = pytest.mark.oracle

TOKENS = [5, 17, 90]
TOL = dict(rtol=2e-4, atol=2e-4)
SPECS = {  # the adapter's trainable tokens: PEFT's list form, or the dict naming lm_head
    "list": TOKENS,
    "dict": {"embed_tokens": TOKENS, "lm_head": [17, 3]},
}


def _adapters(base_dir, tmp_path, spec):
    """Dir of an adapter with LoRA on q/v and trainable tokens, and of a plain one."""
    dirs = {}
    for name, extra in (("tok", dict(trainable_token_indices=spec)), ("plain", {})):
        hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **extra)
        pm = peft.get_peft_model(hf, cfg)
        g = torch.Generator().manual_seed(len(name))
        with torch.no_grad():  # random LoRA factors, and token rows far from the base's
            for pname, p in pm.named_parameters():
                if "lora_" in pname or "trainable_tokens_delta" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        dirs[name] = str(tmp_path / name)
        pm.save_pretrained(dirs[name], safe_serialization=True)
    return dirs


def _hf_model(base_dir, dirs, name):
    """The HF model with adapter `name` alone (`"__base__"`: none)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return hf if name == "__base__" else peft.PeftModel.from_pretrained(hf, dirs[name])


def _served(tmp_path, tied, spec):
    """The base, its two adapters, and our model serving both: (base dir, adapter dirs,
    model, manager, {adapter name: id})."""
    base_dir = tiny_llama_dir(tmp_path, tied)
    dirs = _adapters(base_dir, tmp_path, spec)
    model = load_hf_model(base_dir)
    cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, max_lora_trainable_tokens=4)
    wrap_model(model, cfg)
    mgr = LRUCacheLoRAModelManager(model, cfg)
    loaded = {a.name: a.id for a in mgr.load_adapters(dirs, activate=True, progress=False)}
    return base_dir, dirs, model, mgr, loaded


@nnx.jit
def _forward(model, ids, slots):
    with lj.lora_mapping(model, slots):
        pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        return model(ids, pos)[0]


def _ours(model, mgr, ids, adapter_ids):
    slots = mgr.token_mapping(adapter_ids, tokens_per_request=ids.shape[1])
    return np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(slots)))


def _ids():
    ids = np.random.default_rng(0).integers(0, V, (4, 6)).astype(np.int32)
    ids[:, 1], ids[:, 3] = 5, 90  # every row reads trainable tokens
    return ids


@pytest.mark.parametrize(
    "tied,spec", [(False, "list"), (True, "list"), (False, "dict")], ids=["untied", "tied", "dict"]
)
def test_trainable_tokens_match_peft_in_a_mixed_batch(tmp_path, tied, spec):
    """Rows with the trainable-tokens adapter embed its ids to its rows (and, tied or
    named, take its lm_head columns of them); other rows are the plain adapter's or the
    base's, as PEFT's mixed-batch forward gives them. Merged, the slot gives its rows with
    no mapping; saved, it reads back in PEFT."""
    base_dir, dirs, model, mgr, loaded = _served(tmp_path, tied, SPECS[spec])
    names = ["tok", "plain", "__base__", "tok"]
    ids = _ids()
    want = peft_rows(base_dir, dirs, ids, names)
    got = _ours(model, mgr, ids, [loaded.get(n) for n in names])
    np.testing.assert_allclose(got, want, **TOL)
    # the token rows matter: PEFT without them (LoRA only) gives other logits
    without = peft_rows(base_dir, dirs, ids, ["plain"] * 4)
    assert np.abs(want[0] - without[0]).max() > 1e-1
    slot = mgr.lora_index_to_id.index(loaded["tok"])
    merge_adapter(model, slot)  # no mapping after it: every row is the tok adapter's
    merged = np.asarray(nnx.jit(lambda m, i: m(i, jnp.broadcast_to(jnp.arange(6), i.shape))[0])(
        model, jnp.asarray(ids)))  # fmt: skip
    np.testing.assert_allclose(merged[[0, 3]], want[[0, 3]], **TOL)
    unmerge_adapter(model)

    save_peft_adapter(model, slot, tmp_path / "saved")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    back = peft.PeftModel.from_pretrained(hf, str(tmp_path / "saved")).eval()
    with torch.no_grad():
        again = back(input_ids=torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    np.testing.assert_allclose(again[[0, 3]], want[[0, 3]], **TOL)


def test_greedy_generation_with_trainable_tokens_matches_peft(tmp_path):
    """Decode: each step embeds the generated token (its adapter's row when it is one of
    its ids) and takes per-sequence logits through the tied lm_head's replaced columns;
    PEFT's greedy `generate` per adapter is the oracle."""
    from lora_jax.serving.generate import generate

    base_dir, dirs, model, mgr, loaded = _served(tmp_path, True, TOKENS)
    names = ["tok", "__base__", "tok", "plain"]
    prompts = _ids()
    want = []
    for i, name in enumerate(names):
        m = _hf_model(base_dir, dirs, name)
        with torch.no_grad():
            out = m.eval().generate(
                input_ids=torch.tensor(prompts[i : i + 1], dtype=torch.long),
                attention_mask=torch.ones((1, prompts.shape[1]), dtype=torch.long),
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=0,
            )
        want.append(out[0, prompts.shape[1] :].tolist())
    slots = mgr.token_mapping([loaded.get(n) for n in names])
    got = generate(model, prompts.tolist(), slots.tolist(), max_new_tokens=6)
    assert got.tokens == want
    assert any(t in TOKENS for t in want[0] + want[2])  # the adapter's tokens are generated


def test_adapters_with_trainable_tokens_are_refused_without_room(tmp_path):
    """max_lora_trainable_tokens=0 (the default) or too few: the load names the field, and
    the slots hold what they held."""
    base_dir = tiny_llama_dir(tmp_path, False)
    dirs = _adapters(base_dir, tmp_path, TOKENS)
    for room in (0, 2):
        model = load_hf_model(base_dir)
        cfg = lj.LoRAConfig(max_loras=2, max_lora_rank=8, max_lora_trainable_tokens=room)
        wrap_model(model, cfg)
        mgr = LRUCacheLoRAModelManager(model, cfg)
        (plain,) = mgr.load_adapters({"plain": dirs["plain"]}, activate=True, progress=False)
        before = _ours(model, mgr, _ids(), [plain.id, None, None, plain.id])
        with pytest.raises(ValueError, match="max_lora_trainable_tokens"):
            mgr.load_adapters({"tok": dirs["tok"]}, activate=True, progress=False)
        after = _ours(model, mgr, _ids(), [plain.id, None, None, plain.id])
        np.testing.assert_array_equal(after, before)


@pytest.mark.parametrize(
    "tied,spec", [(False, "dict"), (True, "list")], ids=["untied_dict", "tied_list"]
)
def test_trainable_tokens_train_here_as_peft_trains_them(tmp_path, tied, spec):
    """init_lora_slot with trainable_token_indices starts the slot as the base model (the
    rows are the base's); two SGD steps here and in PEFT (from the same saved start, on
    the same loss) give the same LoRA factors and token rows. Tied, the lm_head trains
    the embedding's rows with it, as PEFT ties them. Other slots' rows stay as they were."""
    import jax
    import optax
    import safetensors.numpy

    from lora_jax.serving.peft import WEIGHTS_NAME
    from lora_jax.serving.training import init_lora_slot, train_only_slots

    base_dir, dirs, model, mgr, loaded = _served(tmp_path, tied, SPECS[spec])
    other = mgr.lora_index_to_id.index(loaded["tok"])
    mgr.deactivate_adapter(loaded["plain"])
    slot = 1 - other
    kept = [la.read_tokens(other) for la in _token_layers(model, other)]
    init_lora_slot(model, slot, 4, target_modules=["q_proj", "v_proj"],
                   trainable_token_indices=SPECS[spec])  # fmt: skip
    ids = _ids()
    slots = jnp.full(ids.size, slot, jnp.int32)
    base = peft_rows(base_dir, dirs, ids, ["__base__"] * len(ids))
    np.testing.assert_allclose(np.asarray(_forward(model, jnp.asarray(ids), slots)), base, **TOL)
    start = save_peft_adapter(model, slot, tmp_path / "start")
    lr = 0.5

    def loss_fn(m):
        with lj.lora_mapping(m, slots):
            logits = m(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(6), ids.shape))[0]
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], -1))

    opt = nnx.Optimizer(model, optax.chain(optax.sgd(lr), train_only_slots([slot])),
                        wrt=nnx.LoRAParam)  # fmt: skip

    @nnx.jit
    def step(model, opt):
        g = nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, g)

    for _ in range(2):
        step(model, opt)
    ours = save_peft_adapter(model, slot, tmp_path / "ours")
    peft_sgd_steps(base_dir, start, ids, lr, 2, tmp_path / "theirs")
    got, want = (
        safetensors.numpy.load_file(f"{d}/{WEIGHTS_NAME}") for d in (ours, tmp_path / "theirs")
    )
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
    first = safetensors.numpy.load_file(f"{start}/{WEIGHTS_NAME}")
    moved = [k for k in want if "trainable_tokens" in k]
    assert moved and all(np.abs(want[k] - first[k]).max() > 1e-3 for k in moved)
    assert any(k is not None for k in kept)
    for la, (ids_before, rows) in zip(_token_layers(model, other), kept):
        ids_now, rows_now = la.read_tokens(other)
        assert ids_now == ids_before
        np.testing.assert_array_equal(rows_now, rows)


def _token_layers(model, slot):
    from lora_jax.serving.wrap import lora_layers

    layers = lora_layers(model).values()
    return [la for la in layers if getattr(la, "read_tokens", None) and la.read_tokens(slot)]
