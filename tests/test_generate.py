"""Generation: greedy vs a cache-free argmax loop, multi-adapter batches vs single requests
and vs adapters merged into dense weights, no recompiles inside a bucket, sampling, mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax
from lora_jax.models import DecoderConfig, DecoderForCausalLM
from lora_jax.serving.generate import (
    TRACE_COUNTS,
    Generator,
    bucket,
    decode_hint,
    generate,
)
from lora_jax.serving.sampling import SamplingParams, row_keys, sample_tokens, top_p_filter
from lora_jax.serving.wrap import unwrap_model, wrap_model
from lora_jax.sharding import ShardingRules

CFG = DecoderConfig.tiny(qkv_bias=True)
LORA_CFG = lora_jax.LoRAConfig(max_loras=3, max_lora_rank=8)
PROMPTS = [
    [5, 17, 3, 99, 4, 8, 1],
    [250, 2],
    [7, 7, 7, 30, 31],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    [42],
]
SLOTS = [0, 1, -1, 2, 1]
NEW = 6
B8 = dict(min_batch_bucket=8)  # one batch bucket for every call: identical programs


def _model(rules=None):
    return DecoderForCausalLM(CFG, rules=rules, rngs=nnx.Rngs(0))


@nnx.jit
def _fwd(model, ids, pos):
    return model(ids, pos)[0]


def _greedy_reference(model, prompt, n, eos=None):
    """Argmax loop over full forwards (no cache, no padding, no jit of the loop)."""
    seq = list(prompt)
    for _ in range(n):
        ids = jnp.array([seq], jnp.int32)
        logits = _fwd(model, ids, jnp.arange(len(seq))[None])  # [1, S, V]
        seq.append(int(jnp.argmax(logits[0, -1])))
        if eos is not None and seq[-1] == eos:
            break
    return seq[len(prompt) :]


# -- adapters ---------------------------------------------------------------------------------
def _adapters(seed, rank=8):
    """Per layer, per module: list of (A [r, in], B [out, r]) slices (scale folded in)."""
    rng = np.random.default_rng(seed)
    c = CFG
    q, kv, inter = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    )
    mods = {
        "qkv_proj": (c.hidden_size, [q, kv, kv]),
        "o_proj": (q, [c.hidden_size]),
        "gate_up_proj": (c.hidden_size, [inter, inter]),
        "down_proj": (inter, [c.hidden_size]),
    }
    out = []
    for _ in range(c.num_hidden_layers):
        layer = {}
        for name, (n_in, outs) in mods.items():
            layer[name] = [
                (
                    rng.normal(0, 1 / np.sqrt(n_in), (rank, n_in)).astype(np.float32),
                    rng.normal(0, 0.6 / np.sqrt(rank), (n_out, rank)).astype(np.float32),
                )
                for n_out in outs
            ]
        out.append(layer)
    return out


def _modules(layer):
    return {
        "qkv_proj": (layer.self_attn, "qkv_proj"),
        "o_proj": (layer.self_attn, "o_proj"),
        "gate_up_proj": (layer.mlp, "gate_up_proj"),
        "down_proj": (layer.mlp, "down_proj"),
    }


def _wrap(model):
    """LoRA-wraps the 4 packed/row projections of every layer by hand, one shared context."""
    ctx = lora_jax.LoRAContext(None)
    classes = {
        "qkv_proj": lora_jax.MergedQKVParallelLinearWithLoRA,
        "o_proj": lora_jax.RowParallelLinearWithLoRA,
        "gate_up_proj": lora_jax.MergedColumnParallelLinearWithLoRA,
        "down_proj": lora_jax.RowParallelLinearWithLoRA,
    }
    for layer in model.model.layers:
        for name, (parent, attr) in _modules(layer).items():
            setattr(parent, attr, classes[name](getattr(parent, attr), LORA_CFG, ctx))
    return model


def _set(model, slot, adapter):
    for layer, weights in zip(model.model.layers, adapter):
        for name, (parent, attr) in _modules(layer).items():
            a, b = zip(*weights[name])
            getattr(parent, attr).set_lora(slot, list(a), list(b))


def _merged(adapter):
    """The base model with `adapter` added into its (unsharded) kernels: the dense oracle."""
    model = _model()
    for layer, weights in zip(model.model.layers, adapter):
        for name, (parent, attr) in _modules(layer).items():
            lin = getattr(parent, attr)
            cuts = np.cumsum(lin.output_sizes)[:-1]
            kernels = np.split(np.asarray(lin.kernel[...]), cuts, axis=1)  # logical [in, n_s]
            lin.load_kernel([k + a.T @ b.T for k, (a, b) in zip(kernels, weights[name])])
    return model


ADAPTERS = [_adapters(seed) for seed in (1, 2, 3)]


@pytest.fixture(scope="module")
def lora_model():
    model = _wrap(_model())
    for slot, adapter in enumerate(ADAPTERS):
        _set(model, slot, adapter)
    return model


@pytest.fixture(scope="module")
def base_model():
    return _model()


@pytest.fixture(scope="module")
def mixed(lora_model):
    return generate(lora_model, PROMPTS, SLOTS, max_new_tokens=NEW, **B8)


# -- base model -------------------------------------------------------------------------------
def test_greedy_matches_cache_free_reference(base_model):
    out = generate(base_model, PROMPTS[:3], max_new_tokens=NEW)
    assert (out.batch_bucket, out.prompt_bucket, out.new_tokens_bucket) == (4, 16, 8)
    for prompt, toks in zip(PROMPTS[:3], out.tokens):
        assert toks == _greedy_reference(base_model, prompt, NEW)
    assert out.finish_reasons == ["length"] * 3


def test_eos_stops_each_request(base_model):
    free = generate(base_model, PROMPTS, max_new_tokens=NEW, **B8).tokens
    eos = free[0][2]
    out = generate(base_model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos, **B8)
    for toks, full, reason in zip(out.tokens, free, out.finish_reasons):
        expect = full[: full.index(eos) + 1] if eos in full else full
        assert toks == expect
        assert reason == ("eos" if eos in full else "length")
    assert out.tokens[0] == free[0][:3]


def test_any_of_several_eos_ids_stops_a_request(base_model):
    """A list of eos ids (HF configs such as Llama 3's): each request stops at the first
    of them it generates."""
    free = generate(base_model, PROMPTS, max_new_tokens=NEW, **B8).tokens
    eos = [free[0][3], free[1][1]]
    out = generate(base_model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos, **B8)
    for toks, full, reason in zip(out.tokens, free, out.finish_reasons):
        stop = min((full.index(e) for e in eos if e in full), default=None)
        assert toks == (full if stop is None else full[: stop + 1])
        assert reason == ("length" if stop is None else "eos")
    assert len(out.tokens[1]) <= 2
    with pytest.raises(ValueError, match="eos_token_id"):
        generate(base_model, PROMPTS, max_new_tokens=NEW, eos_token_id=[[1]], **B8)


def test_positions_past_int32_are_refused_by_name(base_model):
    """The cache's positions are int32: 2**31 new tokens is refused naming max_new_tokens
    and the buckets (session 51: an OverflowError from inside attention on a GPU)."""
    with pytest.raises(ValueError, match=r"max_new_tokens 2147483648 need \d+ cache positions"):
        generate(base_model, PROMPTS[:1], max_new_tokens=2**31)


# -- multi-adapter ----------------------------------------------------------------------------
def test_prefill_and_decode_say_which_they_are(lora_model, mixed, monkeypatch):
    """The prefill step's mapping says is_prefill=True and the decode loop's False (vLLM's
    `LoRAMapping.is_prefill`: a decode step's shrink skips the prompt-tile kernel), the
    prefill's rows of 32 tokens say their prompt tiles hold every mapped token, and the
    tokens are what the mixed batch generated."""
    import lora_jax.serving.generate_steps as steps

    seen = []
    real = steps.set_lora_mapping

    def spy(model, tokens, seqs, *, is_prefill=None, prompt_tiles=None, whole_tiles=None,
            tokens_per_slot=None):  # fmt: skip
        seen.append((tokens.shape[0], is_prefill, prompt_tiles, whole_tiles, tokens_per_slot))
        return real(
            model, tokens, seqs, is_prefill=is_prefill, prompt_tiles=prompt_tiles,
            whole_tiles=whole_tiles, tokens_per_slot=tokens_per_slot,
        )  # fmt: skip

    monkeypatch.setattr(steps, "set_lora_mapping", spy)
    # Buckets no other test uses, so both steps trace (and call the spy) here.
    out = generate(
        lora_model, PROMPTS[:2], SLOTS[:2], max_new_tokens=3, min_batch_bucket=2,
        min_prompt_bucket=32,
    )  # fmt: skip
    # rows of 32 tokens fill the prompt tiles (PROMPT_ROWS_MIN_TOKENS), not whole 64- or
    # 128-row tiles; decode has none, and on a GPU the host's tokens per slot (one each)
    hint = 1 if jax.default_backend() == "gpu" else None
    assert seen == [(2 * 32, True, "all", None, None), (2, False, None, None, hint)]
    for i in range(2):
        assert out.tokens[i] == mixed.tokens[i][:3]
    seen.clear()
    generate(lora_model, PROMPTS[:1], SLOTS[:1], max_new_tokens=1, min_prompt_bucket=128)
    # rows of 128 tokens are whole tiles of one slot (PROMPT_TILE_TOKENS)
    assert seen[0][1:] == (True, "all", "all", None)


def test_mixed_batch_equals_single_requests(lora_model, mixed):
    for prompt, slot, toks in zip(PROMPTS, SLOTS, mixed.tokens):
        alone = generate(lora_model, [prompt], [slot], max_new_tokens=NEW, **B8)
        assert alone.tokens[0] == toks


def test_mixed_batch_equals_merged_dense_models(base_model, mixed):
    base = generate(base_model, PROMPTS, max_new_tokens=NEW, **B8).tokens
    merged = [_merged(a) for a in ADAPTERS]
    for i, (prompt, slot, toks) in enumerate(zip(PROMPTS, SLOTS, mixed.tokens)):
        if slot < 0:
            assert toks == base[i]
        else:
            ref = generate(merged[slot], [prompt], max_new_tokens=NEW, **B8).tokens[0]
            assert toks == ref
            assert toks != base[i], "the adapter should change this request's tokens"


def test_a_merged_model_serves_its_merged_adapter_only_as_the_base():
    """After `merge_adapter(model, s)` the kernels carry adapter s: a request for a LoRA
    slot would add an adapter on top, so `generate` and a `Generator` refuse it (nothing
    generated); slots -1 give exactly the once-applied adapter's tokens."""
    from lora_jax.serving.merge import merge_adapter, unmerge_adapter

    model = _wrap(_model())
    for slot, adapter in enumerate(ADAPTERS):
        _set(model, slot, adapter)
    gen = Generator(model)
    want = generate(model, PROMPTS[:2], [1, 1], max_new_tokens=NEW, **B8).tokens
    merge_adapter(model, 1)
    for run in (lambda *a, **k: generate(model, *a, **k), gen):
        with pytest.raises(ValueError, match="slot 1 is merged"):
            run(PROMPTS[:2], [1, -1], max_new_tokens=NEW, **B8)
        assert run(PROMPTS[:2], [-1, -1], max_new_tokens=NEW, **B8).tokens == want
    unmerge_adapter(model)
    assert gen(PROMPTS[:2], [1, 1], max_new_tokens=NEW, **B8).tokens == want
    # Merging another slot reuses the compiled merge and generate's merged programs.
    before = TRACE_COUNTS.copy()
    want0 = generate(model, PROMPTS[:2], [0, 0], max_new_tokens=NEW, **B8).tokens
    merge_adapter(model, 0)
    from lora_jax.serving import merge

    assert merge._MERGE_JITS[model][1]._cache_size() == 1  # slots 1 and 0: one program
    assert generate(model, PROMPTS[:2], [-1, -1], max_new_tokens=NEW, **B8).tokens == want0
    unmerge_adapter(model)
    assert TRACE_COUNTS == before, (before, TRACE_COUNTS)


def test_a_new_ops_backend_setting_is_followed(lora_model, mixed, monkeypatch):
    """`ops.set_default_backend` is read when the steps are traced: generate and a
    Generator key their programs on `ops.dispatch_state()`, so a change is followed (one
    new program each) and setting it back reuses the old ones."""
    gen = Generator(lora_model)
    gen(PROMPTS, SLOTS, max_new_tokens=NEW, **B8)
    seen = []
    real = lora_jax.ops.resolve_backend
    monkeypatch.setattr(
        lora_jax.ops, "resolve_backend", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]
    )
    before = TRACE_COUNTS.copy()
    try:
        lora_jax.ops.set_default_backend("xla")
        for run in (lambda *a, **k: generate(lora_model, *a, **k), gen):
            assert run(PROMPTS, SLOTS, max_new_tokens=NEW, **B8).tokens == mixed.tokens
    finally:
        lora_jax.ops.set_default_backend(None)
    assert TRACE_COUNTS["prefill"] == before["prefill"] + 2 and seen and set(seen) == {"xla"}
    after = TRACE_COUNTS.copy()
    generate(lora_model, PROMPTS, SLOTS, max_new_tokens=NEW, **B8)
    gen(PROMPTS, SLOTS, max_new_tokens=NEW, **B8)
    assert TRACE_COUNTS == after


def test_decode_hint_only_on_gpu():
    """The decode steps' tokens-per-slot hint is found on a GPU only, from the host's slots
    (pad rows and unmapped requests are -1); off a GPU, and without LoRA layers, None."""
    slots = np.array([0, 1, 1, -1], np.int32)
    assert decode_hint(None, slots) is None
    if jax.default_backend() == "gpu":
        assert decode_hint(4, slots) == 2 and decode_hint(4, np.array([0, 1, -1])) == 1
    else:
        assert decode_hint(4, slots) is None


def test_no_recompile_within_buckets(lora_model, mixed):
    # Warm every program used below once: mixed compiled the 8 x 16 x 8 bucket; on a GPU
    # the decode loop has a program per tokens-per-slot hint (`decode_hint`), and these
    # two mixes of adapters may have other hints than mixed's.
    other_prompts = [[9] * 12, [3, 1], [200, 201, 202]]
    generate(lora_model, other_prompts, [2, 2, 0], max_new_tokens=5, **B8)
    generate(lora_model, other_prompts[:2], [-1, 1], max_new_tokens=8, **B8)
    before = TRACE_COUNTS.copy()
    a = generate(lora_model, other_prompts, [2, 2, 0], max_new_tokens=5, **B8)
    b = generate(lora_model, other_prompts[:2], [-1, 1], max_new_tokens=8, **B8)
    # A brand-new adapter written into slot 2 changes slot-2 outputs, without a recompile.
    _set(lora_model, 2, _adapters(7))
    try:
        c = generate(lora_model, other_prompts, [2, 2, 0], max_new_tokens=5, **B8)
    finally:
        _set(lora_model, 2, ADAPTERS[2])
    assert TRACE_COUNTS == before, (before, TRACE_COUNTS)
    assert c.tokens[:2] != a.tokens[:2] and c.tokens[2] == a.tokens[2]
    assert len(b.tokens[1]) == 8
    # A new bucket compiles once, then is cached (both calls: one adapter, one request).
    generate(lora_model, [[1] * 17], [0], max_new_tokens=2, **B8)
    generate(lora_model, [[2] * 20], [1], max_new_tokens=2, **B8)
    assert TRACE_COUNTS["prefill"] == before["prefill"] + 1
    assert TRACE_COUNTS["decode"] == before["decode"] + 1


def test_generator_matches_generate_and_sees_adapter_writes(lora_model, mixed):
    """A `Generator` walks the graph once; it still reads each call's current weights (a
    new adapter written after it was made) and compiles once per bucket."""
    before = TRACE_COUNTS.copy()
    gen = Generator(lora_model)
    assert gen(PROMPTS, SLOTS, max_new_tokens=NEW, **B8).tokens == mixed.tokens
    other = [[9] * 12, [3, 1], [200, 201, 202]]
    a = gen(other, [2, 2, 0], max_new_tokens=5, **B8)
    _set(lora_model, 2, _adapters(7))
    try:
        c = gen(other, [2, 2, 0], max_new_tokens=5, **B8)
        want = generate(lora_model, other, [2, 2, 0], max_new_tokens=5, **B8)
    finally:
        _set(lora_model, 2, ADAPTERS[2])
    assert c.tokens == want.tokens
    assert c.tokens[:2] != a.tokens[:2] and c.tokens[2] == a.tokens[2]
    assert gen(other, [2, 2, 0], max_new_tokens=5, **B8).tokens == a.tokens
    # One bucket (8 x 16 x 8): the generator's own two programs, traced once each.
    assert TRACE_COUNTS["prefill"] == before["prefill"] + 1
    assert TRACE_COUNTS["decode"] == before["decode"] + 1


def test_generator_follows_wrap_and_unwrap(base_model):
    """`wrap_model` / `unwrap_model` change the graph: a generator made before walks it
    again, and its bad-slot check follows (no LoRA -> only -1)."""
    model = _model()
    gen = Generator(model)
    base = gen(PROMPTS[:2], max_new_tokens=4, **B8).tokens
    with pytest.raises(ValueError, match="no LoRA layers"):
        gen(PROMPTS[:2], [0, -1], max_new_tokens=4, **B8)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    wrap_model(model, LORA_CFG, target_modules=targets)
    _set(model, 0, ADAPTERS[0])
    out = gen(PROMPTS[:2], [0, -1], max_new_tokens=4, **B8).tokens
    assert out == generate(model, PROMPTS[:2], [0, -1], max_new_tokens=4, **B8).tokens
    assert out[0] != base[0] and out[1] == base[1]
    unwrap_model(model)
    assert gen(PROMPTS[:2], max_new_tokens=4, **B8).tokens == base


def test_no_recompile_for_a_callers_mapping_eos_counts_or_other_models(lora_model, mixed):
    """What the caller leaves in the model's LoRA context (an eager `set_lora_mapping`),
    the number of eos ids (padded to a bucket of 4), and wrapping another model never
    recompile `generate` or a `Generator` (the mapping is left where it was)."""
    gen = Generator(lora_model)
    gen(PROMPTS, SLOTS, max_new_tokens=NEW, **B8)
    eos_counts = ([5], [5, 6], [5, 6, 7, 8])
    for eos in eos_counts[:1]:
        generate(lora_model, PROMPTS, SLOTS, max_new_tokens=NEW, eos_token_id=eos, **B8)
        gen(PROMPTS, SLOTS, max_new_tokens=NEW, eos_token_id=eos, **B8)
    before = TRACE_COUNTS.copy()
    ctx = lora_jax.find_lora_context(lora_model)
    try:
        for idx in (np.array([0, 0, 1, 1], np.int32), jnp.array([0, 1, -1, -1, 2], jnp.int32)):
            lora_jax.set_lora_mapping(lora_model, idx)
            mapping = ctx.get_value()
            assert generate(lora_model, PROMPTS, SLOTS, max_new_tokens=NEW, **B8).tokens == (
                mixed.tokens
            )
            assert gen(PROMPTS, SLOTS, max_new_tokens=NEW, **B8).tokens == mixed.tokens
            left = ctx.get_value()  # the caller's mapping is left in place
            assert left is not None and left.num_tokens == mapping.num_tokens
            np.testing.assert_array_equal(left.token_lora_indices, mapping.token_lora_indices)
    finally:
        ctx.set_value(None)
    for eos in eos_counts[1:]:
        generate(lora_model, PROMPTS, SLOTS, max_new_tokens=NEW, eos_token_id=eos, **B8)
        gen(PROMPTS, SLOTS, max_new_tokens=NEW, eos_token_id=eos, **B8)
    other = _model()
    wrap_model(other, LORA_CFG, target_modules=["q_proj"])
    gen(PROMPTS, SLOTS, max_new_tokens=NEW, **B8)
    unwrap_model(other)
    gen(PROMPTS, SLOTS, max_new_tokens=NEW, **B8)
    assert TRACE_COUNTS == before, (before, TRACE_COUNTS)


@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 2), (1, 4)])  # (1, 4): kv heads replicated
def test_sharded_lora_generation_matches_unsharded(mixed, mesh_shape):
    if mesh_shape[0] * mesh_shape[1] > jax.device_count():
        pytest.skip(f"mesh {mesh_shape} needs more than the {jax.device_count()} visible devices")
    rules = ShardingRules(jax.make_mesh(mesh_shape, ("dp", "tp")))
    model = _wrap(_model(rules))
    for slot, adapter in enumerate(ADAPTERS):
        _set(model, slot, adapter)
    out = generate(model, PROMPTS, SLOTS, max_new_tokens=NEW, **B8)
    assert out.tokens == mixed.tokens
    if mesh_shape == (1, 2):  # the Generator's flat values keep their shardings
        assert Generator(model)(PROMPTS, SLOTS, max_new_tokens=NEW, **B8).tokens == mixed.tokens


def test_generation_inside_set_mesh_matches_outside_and_unsharded(mixed):
    """Inside `jax.set_mesh` of an Explicit-axis mesh (jax.make_mesh's default) the prefill's
    token→slot repeat of the batch-sharded slots crashed ("pass sharding to `jnp.repeat`
    via `out_sharding`"); generate and a Generator now give the tokens of the same call
    outside the context and of the unsharded model."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[:4])
    model = _wrap(_model(ShardingRules(mesh)))
    for slot, adapter in enumerate(ADAPTERS):
        _set(model, slot, adapter)
    outside = generate(model, PROMPTS, SLOTS, max_new_tokens=NEW, **B8).tokens
    with jax.set_mesh(mesh):
        inside = generate(model, PROMPTS, SLOTS, max_new_tokens=NEW, **B8).tokens
        gen = Generator(model)(PROMPTS, SLOTS, max_new_tokens=NEW, **B8).tokens
    assert inside == outside == gen == mixed.tokens


# -- sampling ---------------------------------------------------------------------------------
def test_sampled_generation_is_seeded_and_top_p_tiny_is_greedy(base_model):
    greedy = generate(base_model, PROMPTS, max_new_tokens=NEW, **B8).tokens
    params = lambda seed, p: SamplingParams(temperature=1.5, top_p=p, seed=seed)  # noqa: E731
    s1 = generate(base_model, PROMPTS, max_new_tokens=NEW, sampling=params(1, 0.95), **B8)
    s1b = generate(base_model, PROMPTS, max_new_tokens=NEW, sampling=params(1, 0.95), **B8)
    s2 = generate(base_model, PROMPTS, max_new_tokens=NEW, sampling=params(2, 0.95), **B8)
    assert s1.tokens == s1b.tokens
    assert s1.tokens != s2.tokens
    assert s1.tokens != greedy
    for p in (1e-6, 1e-40):  # 1e-40: below f32's smallest normal (the nucleus was empty)
        tiny = generate(base_model, PROMPTS, max_new_tokens=NEW, sampling=params(3, p), **B8)
        assert tiny.tokens == greedy, p


def test_every_int_seed_is_its_own_stream(base_model):
    """jax.random.key keeps 32 bits: -1 and 2**32 - 1 (and 2**32 + 5 and 5) were one
    stream; now every int is its own, a 32-bit one keeps its old key, and numpy ints and
    floats are taken as the numbers they are (bools are not numbers here)."""
    from lora_jax.serving.sampling import seed_key

    seeds = [0, 5, 2**32 - 1, -1, 2**32 + 5, -(2**32) + 5, 2**31, -(2**31), 2**70 + 3, -(2**70)]
    keys = {tuple(jax.random.key_data(seed_key(s)).tolist()) for s in seeds}
    assert len(keys) == len(seeds)
    assert (jax.random.key_data(seed_key(7)) == jax.random.key_data(jax.random.key(7))).all()
    run = lambda seed: (
        generate(  # noqa: E731
            base_model,
            PROMPTS,
            max_new_tokens=NEW,
            sampling=SamplingParams(temperature=1.0, seed=seed),
        ).tokens
    )
    assert run(-1) != run(2**32 - 1)
    assert run(np.int64(3)) == run(3)
    for bad in (True, np.bool_(False), 1.5, "3"):
        with pytest.raises(ValueError, match="seed must be an int"):
            SamplingParams(temperature=1.0, seed=bad)
    p = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), seed=np.uint32(3))
    assert (type(p.temperature), type(p.top_p), type(p.seed)) == (float, float, int)
    with pytest.raises(ValueError, match="top_p must be a number"):
        SamplingParams(temperature=1.0, top_p=True)


def test_adapter_slots_must_be_ints_or_none(lora_model):
    """`None` means no adapter (as `token_mapping` gives); a float or bool slot was served
    as the slot it truncated to, a None crashed in int()."""
    model = lora_model
    with_none = generate(model, PROMPTS[:2], [0, None], max_new_tokens=2).tokens
    assert with_none == generate(model, PROMPTS[:2], [0, -1], max_new_tokens=2).tokens
    as_array = generate(model, PROMPTS[:2], jnp.array([0, -1]), max_new_tokens=2).tokens
    assert as_array == with_none
    for bad in (0.9, True, "0"):
        with pytest.raises(ValueError, match="adapter slot of request 0 must be an int"):
            generate(model, PROMPTS[:2], [bad, -1], max_new_tokens=2)


def test_generator_follows_the_decode_compiler_options(lora_model, mixed, monkeypatch):
    """`decode_compiler_options()` is read at each call, as `generate` does: a new value
    gets its own decode program, with the same tokens."""
    from lora_jax.serving import generate as gen_mod

    gen = Generator(lora_model)
    assert gen(PROMPTS, SLOTS, max_new_tokens=NEW, **B8).tokens == mixed.tokens
    monkeypatch.setattr(
        gen_mod, "decode_compiler_options", lambda: {"xla_embed_ir_in_executable": True}
    )
    assert gen(PROMPTS, SLOTS, max_new_tokens=NEW, **B8).tokens == mixed.tokens
    assert len(gen._decodes) == 2


def test_tiny_temperatures_sample_the_argmax():
    """Temperatures so small that logits / T overflows f32 still pick the largest logit
    (below SAMPLING_EPS the mode is greedy; above, the row's maximum is subtracted first),
    in both sampling modes; a moderate one still samples."""
    from lora_jax.serving.sampling import SAMPLING_EPS, sample_tokens

    logits = jnp.array([[1.0, 3.0, 2.0, -1.0, 2.5], [0.0, -2.0, 4.0, 3.9, 1.0]])
    keys = row_keys(jax.random.key(0), jnp.arange(2), 0)
    assert SamplingParams(temperature=1e-39).mode == "greedy"
    assert SamplingParams(temperature=SAMPLING_EPS).mode == "sample"
    for t in (1e-39, 1e-20, SAMPLING_EPS):
        for mode in ("sample", "top_p"):
            got = sample_tokens(logits, keys, jnp.float32(t), jnp.float32(0.9), mode=mode)
            assert got.tolist() == [1, 2], (t, mode)
    draws = {
        int(sample_tokens(logits, row_keys(jax.random.key(s), jnp.arange(2), 0), 5.0, 1.0,
                          mode="sample")[0])
        for s in range(20)
    }  # fmt: skip
    assert len(draws) > 1


def test_top_p_filter_matches_numpy():
    logits = jax.random.normal(jax.random.key(0), (6, 50)) * 3
    for p in (0.1, 0.5, 0.9, 1.0):
        got = np.asarray(top_p_filter(logits, jnp.float32(p)))
        for row, g in zip(np.asarray(logits, np.float64), got):
            order = np.argsort(-row)
            probs = np.exp(row[order] - row.max())
            probs /= probs.sum()
            before = np.cumsum(probs) - probs  # mass of the more likely tokens
            if np.any(np.abs(before - p) < 1e-5) and p < 1:
                continue  # f32 rounding may legitimately go either way at the edge
            kept = set(order[before < p].tolist())
            assert set(np.flatnonzero(np.isfinite(g)).tolist()) == kept, p


def test_top_p_keeps_the_most_likely_token_however_small():
    """A top_p below f32's smallest normal (~1.2e-38) rounds or is flushed to 0: no token was
    `< top_p` and the empty nucleus sampled token 0 for every row. The nucleus is the
    smallest prefix of the sorted probabilities with mass >= top_p, never fewer than one
    token (HF's min_tokens_to_keep=1, vLLM's `top_p_mask[:, -1] = False`)."""
    logits = jax.random.normal(jax.random.key(1), (8, 40)) * 2
    rows = np.asarray(logits, np.float64)

    def nucleus(row, p):  # numpy oracle
        order = np.argsort(-row)
        probs = np.exp(row[order] - row.max())
        probs /= probs.sum()
        n = max(1, int(np.searchsorted(np.cumsum(probs), p)) + 1)  # mass >= p, at least one
        return set(order[: min(n, row.size)].tolist()), np.cumsum(probs)

    for p in (1e-40, 1e-50, 0.5, 0.99):
        got = np.asarray(top_p_filter(logits, jnp.float32(p)))
        for row, g in zip(rows, got):
            kept, mass = nucleus(row, p)
            if p > 1e-30 and np.any(np.abs(mass - p) < 1e-5):
                continue  # f32 rounding may legitimately go either way at the edge
            assert set(np.flatnonzero(np.isfinite(g)).tolist()) == kept, p
    keys = row_keys(jax.random.key(0), jnp.arange(8), 0)
    argmax = rows.argmax(-1).tolist()
    for p in (1e-40, 1e-50, 0.0):
        got = sample_tokens(logits, keys, 1.0, jnp.float32(p), mode="top_p").tolist()
        assert got == argmax, p


def test_sampling_follows_the_softmax():
    logits = jnp.log(jnp.array([0.6, 0.3, 0.1, 0.0]))[None].repeat(4000, 0)
    keys = row_keys(jax.random.key(0), jnp.arange(4000), 0)
    toks = np.asarray(sample_tokens(logits, keys, 1.0, 1.0, mode="sample"))
    freq = np.bincount(toks, minlength=4) / toks.size
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1, 0.0], atol=0.03)
    nucleus = np.asarray(sample_tokens(logits, keys, 1.0, 0.8, mode="top_p"))
    assert set(np.unique(nucleus)) == {0, 1}
    np.testing.assert_array_equal(
        sample_tokens(logits[:3], keys[:3], 0.0, 1.0, mode="greedy"), [0, 0, 0]
    )


# -- input checks -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompts=[]), "empty"),
        (dict(prompts=[[1], []]), "prompt 1"),
        (dict(prompts=[[1, 256]]), "outside"),
        (dict(adapter_slots=[0]), "no LoRA layers"),
        (dict(adapter_slots=[-1, -1]), "adapter_slots"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(eos_token_id=999), "eos_token_id"),
        # numpy took True in [True, 2, 3] as token 1; the buckets went through int()
        (dict(prompts=[[1, 2], [True, 2, 3]]), r"prompt 1 .*\(ints, not bools\)"),
        (dict(prompts=[(2, np.True_)]), r"prompt 0 .*\(ints, not bools\)"),
        (dict(min_batch_bucket=2.9), "min_batch_bucket must be an int >= 1, got 2.9"),
        (dict(min_batch_bucket=True), "min_batch_bucket must be an int >= 1, got True"),
        (dict(min_prompt_bucket="x"), "min_prompt_bucket must be an int >= 1, got 'x'"),
        (dict(min_prompt_bucket=0), "min_prompt_bucket must be an int >= 1, got 0"),
        # an integer / bool KV cache truncated keys and values: other tokens, no error
        (dict(cache_dtype=jnp.int8), "cache_dtype must be a floating dtype.*int8"),
        (dict(cache_dtype=jnp.bool_), "cache_dtype must be a floating dtype.*bool"),
        (dict(cache_dtype="int32"), "cache_dtype must be a floating dtype.*int32"),
        (dict(cache_dtype="no-such-dtype"), "cache_dtype must be a floating dtype"),
        (dict(sampling=0.7), "sampling must be None, a SamplingParams or a dict"),
        (dict(sampling="greedy"), "sampling must be None, a SamplingParams or a dict"),
        (dict(sampling={"top_k": 5}), r"sampling has unknown fields \['top_k'\]"),
    ],
)
def test_bad_inputs(base_model, kwargs, match):
    args = dict(prompts=[[1, 2]], adapter_slots=None, max_new_tokens=2) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(base_model, args.pop("prompts"), args.pop("adapter_slots"), **args)


def test_bad_lora_slot_and_sampling_params(lora_model):
    with pytest.raises(ValueError, match=r"\[-1, 3\)"):
        generate(lora_model, [[1]], [3], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    for bad in (float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="finite number"):
            SamplingParams(temperature=bad)


def test_sampling_params_are_checked_as_the_floats_they_become():
    """An int past float's range raised a bare OverflowError that named no parameter, and a
    top_p that rounds to 0.0 was taken (stored as 0.0, which top_p=0.0 is refused as)."""
    from fractions import Fraction

    for bad in (10**400, -(10**400)):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            SamplingParams(temperature=bad)
        with pytest.raises(ValueError, match="top_p must be a number in"):
            SamplingParams(temperature=1.0, top_p=bad)
    with pytest.raises(ValueError, match="top_p must be a number in"):
        SamplingParams(temperature=1.0, top_p=Fraction(1, 10**400))
    ok = SamplingParams(temperature=Fraction(1, 2), top_p=Fraction(9, 10), seed=10**400)
    assert (ok.temperature, ok.top_p, ok.seed) == (0.5, 0.9, 10**400)


def test_float_cache_dtypes_and_sampling_dicts_are_taken(base_model):
    """The forms of `cache_dtype` and `sampling` that are allowed give what their plain
    equivalents give."""
    ref = generate(base_model, PROMPTS, max_new_tokens=NEW, cache_dtype=jnp.float32)
    for dt in (np.dtype(np.float32), "float32"):
        assert generate(base_model, PROMPTS, max_new_tokens=NEW, cache_dtype=dt) == ref
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    want = generate(base_model, PROMPTS, max_new_tokens=NEW, sampling=sp)
    as_dict = dict(temperature=0.8, top_p=0.9, seed=3)
    assert generate(base_model, PROMPTS, max_new_tokens=NEW, sampling=as_dict) == want


def test_bucket():
    assert [bucket(n) for n in (1, 2, 3, 8, 9)] == [1, 2, 4, 8, 16]
    assert bucket(3, minimum=16) == 16


# -- HF oracle --------------------------------------------------------------------------------
@pytest.mark.oracle
def test_greedy_generation_matches_hf_generate(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from lora_jax.models import load_hf_model

    hf_cfg = transformers.Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.15)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    hf.generation_config.eos_token_id = None
    model = load_hf_model(str(tmp_path))
    prompts = [[3, 14, 15, 92, 65], [2, 71]]
    ours = generate(model, prompts, max_new_tokens=NEW)
    for prompt, toks in zip(prompts, ours.tokens):
        with torch.no_grad():
            res = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
        ref = res.sequences[0, len(prompt) :].tolist()
        # Compare up to the first step whose top-2 logits are too close to call.
        n = NEW
        for t, s in enumerate(res.scores):
            top2 = torch.topk(s[0], 2).values
            if float(top2[0] - top2[1]) < 1e-3:
                n = t
                break
        assert n >= 2, "degenerate test model: near-tie in the first steps"
        assert toks[:n] == ref[:n]
