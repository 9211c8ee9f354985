"""Activated LoRA (aLoRA, PEFT's `alora_invocation_tokens`): the invocation start against a
brute-force search, the config and the loader's refusals, the manager's slots and starts,
and `generate` / `Generator` with them against a cache-free per-token reference. HF
peft serving the same adapters is the oracle in tests/test_oracle_hf.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax as lj
from lora_jax.models import DecoderConfig, DecoderForCausalLM
from lora_jax.serving.alora import invocation_start, token_slots
from lora_jax.serving.generate import Generator, generate
from lora_jax.serving.manager import LRUCacheLoRAModelManager
from lora_jax.serving.peft import PEFTConfig, adapter_from_tensors
from lora_jax.serving.wrap import wrap_model
from lora_jax.sharding import ShardingRules

CFG = DecoderConfig.tiny()
LORA_CFG = lj.LoRAConfig(max_loras=3, max_lora_rank=8)
INVOKE = (5, 9)
NEW = 5
PAD = 32  # the reference's fixed row length: one program for every step
PROMPTS = [[1, 5, 9, 2, 5, 9, 3], [5, 9, 4, 4], [1, 2, 3], [7, 5, 9, 1], [8, 8], [3, 5, 9]]
IDS = [1, 1, 1, 2, None, 1]  # adapter 1 is the aLoRA, 2 a plain LoRA


def _brute(prompt, tokens):
    """The last i with prompt[i:i+n] == tokens, every window compared in Python."""
    n, best = len(tokens), None
    for i in range(len(prompt) - n + 1):
        if list(prompt[i : i + n]) == list(tokens):
            best = i
    return best


def test_invocation_start_is_the_last_occurrence():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 3, rng.integers(1, 4)).tolist()
        prompt = rng.integers(0, 3, rng.integers(0, 12)).tolist()
        assert invocation_start(prompt, tokens) == _brute(prompt, tokens), (prompt, tokens)
    assert invocation_start([1, 1, 1], [1, 1]) == 1  # overlapping occurrences: the last
    assert invocation_start([5], list(INVOKE)) is None  # longer than the prompt


def test_token_slots_lay_requests_end_to_end():
    slots, starts, counts = [2, 0, -1, 1], [3, 0, 1, 5], [4, 2, 3, 5]
    want = []
    for s, st, n in zip(slots, starts, counts):
        want += [s if t >= st else -1 for t in range(n)]
    assert token_slots(slots, starts, counts).tolist() == want
    assert token_slots(slots, starts, counts).dtype == np.int32
    with pytest.raises(ValueError, match="4 slots but 3 starts"):
        token_slots(slots, starts[:3], counts)


@pytest.mark.parametrize("bad", ["5 9", [5, "9"], [5, True], [-1], {"a": 1}, 5])
def test_bad_invocation_tokens_are_refused(bad):
    match = r"alora_invocation_tokens=.* must be a list of token ids"
    with pytest.raises(ValueError, match=match):
        PEFTConfig.from_dict({"r": 8, "lora_alpha": 16, "alora_invocation_tokens": bad})
    with pytest.raises(ValueError, match=match):
        PEFTConfig(r=8, lora_alpha=16, alora_invocation_tokens=bad)


def test_invocation_tokens_are_kept_and_an_empty_list_is_plain_lora():
    d = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    assert PEFTConfig.from_dict({**d, "alora_invocation_tokens": [5, 9]}).alora_invocation_tokens
    assert PEFTConfig.from_dict(
        {**d, "alora_invocation_tokens": [5, 9]}
    ).alora_invocation_tokens == (
        5,
        9,
    )
    assert (
        PEFTConfig.from_dict({**d, "alora_invocation_tokens": []}).alora_invocation_tokens is None
    )
    assert PEFTConfig.from_dict(d).alora_invocation_tokens is None


# -- a served tiny model -----------------------------------------------------------------------
def _pair(out, rng, key, n_in, n_out, rank=8, a="lora_A.weight", b="lora_B.weight"):
    out[f"base_model.model.{key}.{a}"] = rng.normal(0, 1 / np.sqrt(n_in), (rank, n_in))
    out[f"base_model.model.{key}.{b}"] = rng.normal(0, 2 / np.sqrt(rank), (n_out, rank))


def _tensors(seed, modules=("q_proj", "v_proj", "down_proj")):
    """PEFT-keyed random LoRA tensors for `DecoderConfig.tiny()`'s layers (rank 8)."""
    c = CFG
    D, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"q_proj": (D, q), "v_proj": (D, kv), "o_proj": (q, D), "down_proj": (F, D)}
    rng = np.random.default_rng(seed)
    out = {}
    for m in modules:
        if m == "embed_tokens":
            _pair(out, rng, "model.embed_tokens", V, D, a="lora_embedding_A", b="lora_embedding_B")
        elif m == "lm_head":
            _pair(out, rng, "lm_head", D, V)
        else:
            parent = "mlp" if m == "down_proj" else "self_attn"
            for i in range(c.num_hidden_layers):
                _pair(out, rng, f"model.layers.{i}.{parent}.{m}", *shapes[m])
    return {k: v.astype(np.float32) for k, v in out.items()}


def _config(invoke=INVOKE, modules=("q_proj", "v_proj", "down_proj"), **kw):
    return PEFTConfig(
        r=8, lora_alpha=16, target_modules=modules, alora_invocation_tokens=invoke, **kw
    )


def _serve(rules=None):
    model = DecoderForCausalLM(CFG, rules=rules, rngs=nnx.Rngs(0))
    wrap_model(model, LORA_CFG)
    mgr = LRUCacheLoRAModelManager(model, LORA_CFG)
    for aid, invoke in ((1, INVOKE), (2, None)):
        adapter = adapter_from_tensors(
            _tensors(aid), _config(invoke), model, LORA_CFG, adapter_id=aid, name=f"a{aid}"
        )
        mgr.add_adapter(adapter)
        mgr.activate_adapter(aid)
    return model, mgr


@pytest.fixture(scope="module")
def served():
    return _serve()


@nnx.jit
def _forward(model, ids, slots):
    with lj.lora_mapping(model, slots):
        pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        return model(ids, pos)[0]


def _reference(model, prompts, slots, starts, n):
    """Greedy tokens from full forwards over right-padded rows (causal: padding never
    reaches an earlier position), each token mapped by its position and the request's
    start; no cache, no generate."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        ids = np.zeros((len(seqs), PAD), np.int32)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
        per_token = token_slots(slots, starts, PAD)
        logits = np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(per_token)))
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


def test_the_manager_gives_slots_and_starts(served):
    model, mgr = served
    slots, starts = mgr.adapter_starts(IDS, PROMPTS)
    s1, s2 = mgr.slot_of(1), mgr.slot_of(2)
    # request 2's prompt lacks the invocation: the base model throughout, as PEFT serves it;
    # the plain adapter starts at 0 though its prompt holds the sequence
    assert slots.tolist() == [s1, s1, -1, s2, -1, s1]
    assert starts.tolist() == [4, 0, 0, 0, 0, 1]
    assert slots.dtype == starts.dtype == np.int32
    with pytest.raises(ValueError, match="6 requests but 2 prompts"):
        mgr.adapter_starts(IDS, PROMPTS[:2])
    with pytest.raises(ValueError, match="prompt 1 must be a sequence of token ids"):
        mgr.adapter_starts([1, 1], [[5, 9], [[5, 9]]])
    # the same id with another invocation sequence is another adapter
    other = dataclasses.replace(mgr.list_adapters()[1], invocation_tokens=(7,))
    with pytest.raises(ValueError, match="adapter_starts: id 1 is already adapter"):
        mgr.adapter_starts([other], [[1]])
    # a slot alone would serve an aLoRA from the first token: token_mapping refuses it
    with pytest.raises(ValueError, match=r"request 1 uses adapter 1 \('a1'\), an activated"):
        mgr.token_mapping([2, 1])
    assert mgr.token_mapping([2, None]).tolist() == [s2, -1]


def test_tokens_before_the_start_are_exactly_the_base_model_s(served):
    model, mgr = served
    prompts = [[1, 5, 9, 2, 5, 9, 3, 4], [2, 3, 5, 9, 1, 6, 7, 8]]
    slots, starts = mgr.adapter_starts([1, 1], prompts)
    assert starts.tolist() == [4, 2]
    ids = jnp.asarray(prompts, jnp.int32)
    got = np.asarray(_forward(model, ids, jnp.asarray(token_slots(slots, starts, 8))))
    base = np.asarray(_forward(model, ids, jnp.full((16,), -1, jnp.int32)))
    plain = np.asarray(_forward(model, ids, jnp.asarray(np.repeat(slots, 8))))
    for row, st in enumerate(starts):
        np.testing.assert_array_equal(got[row, :st], base[row, :st])
        # from the start on the adapter acts, on a prefix the base model computed
        assert np.abs(got[row, st:] - base[row, st:]).max() > 1e-2
        assert np.abs(got[row, st:] - plain[row, st:]).max() > 1e-4


def test_generate_with_starts_matches_the_per_token_reference(served):
    model, mgr = served
    slots, starts = mgr.adapter_starts(IDS, PROMPTS)
    out = generate(model, PROMPTS, slots, adapter_starts=starts, max_new_tokens=NEW)
    assert out.tokens == _reference(model, PROMPTS, slots, starts, NEW)
    gen = Generator(model)
    assert gen(PROMPTS, slots, adapter_starts=starts, max_new_tokens=NEW).tokens == out.tokens
    # starts of 0 are plain LoRA: the same program and tokens as no starts at all
    zeros = generate(model, PROMPTS, slots, adapter_starts=[0] * 6, max_new_tokens=NEW)
    plain = generate(model, PROMPTS, slots, max_new_tokens=NEW)
    assert zeros.tokens == plain.tokens == _reference(model, PROMPTS, slots, [0] * 6, NEW)
    # the starts matter: the aLoRA rows invoked mid-prompt generate otherwise (the oracle
    # can fail)
    assert out.tokens[0] != plain.tokens[0] and out.tokens[5] != plain.tokens[5]


def test_an_activated_prefill_leaves_the_kernels_to_find_the_tiles(served, monkeypatch):
    """Rows that change slot mid-prompt are not whole tiles of one slot: the activated
    prefill says nothing of its tiles (the kernels find them on the device)."""
    import lora_jax.serving.generate_steps as steps

    model, mgr = served
    seen = []
    real = steps.set_lora_mapping

    def spy(model, tokens, seqs, **hints):
        seen.append((hints["is_prefill"], hints["prompt_tiles"], hints["whole_tiles"]))
        return real(model, tokens, seqs, **hints)

    monkeypatch.setattr(steps, "set_lora_mapping", spy)
    slots, starts = mgr.adapter_starts(IDS[:2], PROMPTS[:2])
    kw = dict(max_new_tokens=1, min_prompt_bucket=128, min_batch_bucket=4)
    out = generate(model, PROMPTS[:2], slots, adapter_starts=starts, **kw)
    assert seen == [(True, None, None)]
    assert out.tokens == _reference(model, PROMPTS[:2], slots, starts, 1)
    seen.clear()
    generate(model, PROMPTS[:2], slots, **kw)
    assert seen == [(True, "all", "all")]


@pytest.mark.parametrize(
    "starts,match",
    [
        ([0, 0], r"6 prompts but 2 adapter_starts"),
        ([0, 0, 3, 0, 0, 0], r"adapter_starts\[2\]=3 must be an int in \[0, 3\)"),
        ([0, -1, 0, 0, 0, 0], r"adapter_starts\[1\]=-1"),
        ([True, 0, 0, 0, 0, 0], r"adapter_starts\[0\]=True"),
        ([0.0, 0, 0, 0, 0, 0], r"adapter_starts\[0\]=0.0"),
    ],
)
def test_generate_refuses_bad_starts(served, starts, match):
    model, mgr = served
    slots, _ = mgr.adapter_starts(IDS, PROMPTS)
    with pytest.raises(ValueError, match=match):
        generate(model, PROMPTS, slots, adapter_starts=starts, max_new_tokens=2)


@pytest.mark.parametrize(
    "modules,kw,match",
    [
        (("q_proj", "embed_tokens"), {}, r"'model.embed_tokens'.*linear projections only"),
        (("q_proj", "lm_head"), {}, r"'lm_head'.*linear projections only"),
        (None, dict(target_parameters=("down_proj.weight",)), "with target_parameters"),
    ],
)
def test_an_activated_lora_on_what_peft_does_not_mask_is_refused(served, modules, kw, match):
    model, mgr = served
    tensors = _tensors(3, modules=modules or ("down_proj",))
    cfg = _config(modules=modules, **kw)
    with pytest.raises(ValueError, match=match):
        adapter_from_tensors(tensors, cfg, model, LORA_CFG, adapter_id=3)
    # the same adapter as a plain LoRA loads
    plain = adapter_from_tensors(tensors, _config(None, modules, **kw), model, LORA_CFG)
    assert plain.invocation_tokens is None and plain.modules


def test_starts_on_a_mesh_generate_the_unsharded_tokens(served):
    """Starts are batch-sharded like the slots; on a dp x tp mesh, outside and inside
    `jax.set_mesh` of its Explicit axes, generation equals the unsharded model's."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (tests/conftest.py simulates 8 on CPU)")
    model, mgr = served
    slots, starts = mgr.adapter_starts(IDS, PROMPTS)
    want = generate(model, PROMPTS, slots, adapter_starts=starts, max_new_tokens=NEW).tokens
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[:4])
    sharded, smgr = _serve(ShardingRules(mesh))
    s_slots, s_starts = smgr.adapter_starts(IDS, PROMPTS)
    assert s_slots.tolist() == slots.tolist() and s_starts.tolist() == starts.tolist()
    kw = dict(adapter_starts=s_starts, max_new_tokens=NEW)
    assert generate(sharded, PROMPTS, s_slots, **kw).tokens == want
    with jax.set_mesh(mesh):
        assert Generator(sharded)(PROMPTS, s_slots, **kw).tokens == want


@pytest.mark.slow  # ~12 s in Pallas's interpreter on a CPU
def test_activated_prefills_through_the_kernels_match_xla_s(served, monkeypatch):
    """Prompt buckets of 128 tokens run the Pallas kernels (on a GPU; elsewhere Pallas's
    interpreter), and an activated prefill's rows change slot inside a tile of one row (no
    tile hints): the tokens equal XLA's ops'."""
    import lora_jax.ops

    if jax.default_backend() != "gpu":
        monkeypatch.setattr(lora_jax.ops, "PALLAS_INTERPRET", True)
    model, mgr = served
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 200, n).tolist() for n in (100, 128, 60, 90)]
    for p, at in zip(prompts, (70, 3, 40, 51)):
        p[at : at + 2] = INVOKE
    slots, starts = mgr.adapter_starts([1, 1, 2, 1], prompts)
    assert starts.tolist() == [70, 3, 0, 51]
    runs = {}
    try:
        for backend in ("pallas", "xla"):
            lora_jax.ops.set_default_backend(backend)
            runs[backend] = generate(
                model, prompts, slots, adapter_starts=starts, max_new_tokens=4
            ).tokens
    finally:
        lora_jax.ops.set_default_backend(None)
    assert runs["pallas"] == runs["xla"]


def test_an_activated_lora_is_not_merged():
    """Merged into the base weights an aLoRA would act on every token: refused (PEFT does
    not merge one either), changing nothing; a plain adapter beside it merges."""
    from lora_jax.serving.merge import merge_adapter, merged_slot, unmerge_adapter

    model, mgr = _serve()
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    with pytest.raises(ValueError, match=r"adapter 1 \('a1'\), an activated LoRA"):
        merge_adapter(model, mgr.slot_of(1))
    assert merged_slot(model) is None
    jax.tree.map(np.testing.assert_array_equal, before, nnx.state(model, nnx.Param))
    assert merge_adapter(model, mgr.slot_of(2)) > 0
    assert unmerge_adapter(model)


def test_a_saved_or_copied_activated_slot_stays_activated(served, tmp_path):
    """`save_peft_adapter` writes the slot's `alora_invocation_tokens` (the manager knows
    which adapter the slot holds) and `adapter_from_slot` copies them: loaded back, the
    adapter has the same sequence and weights."""
    import json

    from lora_jax.serving.export import adapter_from_slot, save_peft_adapter
    from lora_jax.serving.peft import load_peft_adapter

    model, mgr = served
    path = save_peft_adapter(model, mgr.slot_of(1), tmp_path / "alora")
    config = json.loads((tmp_path / "alora" / "adapter_config.json").read_text())
    assert config["alora_invocation_tokens"] == list(INVOKE)
    back = load_peft_adapter(path, model, LORA_CFG, adapter_id=9)
    held = mgr.list_adapters()[1]
    assert (
        back.invocation_tokens
        == INVOKE
        == adapter_from_slot(model, mgr.slot_of(1)).invocation_tokens
    )
    for name, m in held.modules.items():
        got = back.modules[name]
        for x, y in zip(m.lora_a + m.lora_b, got.lora_a + got.lora_b):
            assert (x is None) == (y is None), name
            if x is not None:
                np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)
    save_peft_adapter(model, mgr.slot_of(2), tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "adapter_config.json").read_text())
    assert "alora_invocation_tokens" not in config
