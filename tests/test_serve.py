"""The main job (`lora_jax.serve`): the embedded default end to end, its CLI, and --tp."""

import json
import os
import re

import jax
import numpy as np
import pytest

from lora_jax import serve


@pytest.fixture(scope="module")
def default_results():
    return serve.run([])


def test_default_serves_a_mixed_batch(default_results):
    results = default_results
    assert [r.adapter for r in results] == [*serve.DEFAULT_ADAPTERS, None]
    assert [r.prompt for r in results] == list(serve.DEFAULT_PROMPTS)
    for r in results:
        assert len(r.tokens) == 12 and all(0 <= t < 256 for t in r.tokens)
        assert r.text == serve.ByteTokenizer().decode(r.tokens)


def test_adapters_change_generation_and_tp_matches(default_results):
    # One prompt for every request: the adapted rows must differ from the base row.
    args = ["--prompt", "Hello, how are", "--max-new-tokens", "6"]
    one = serve.run(args)
    base = one[-1].tokens
    assert sum(r.tokens != base for r in one[:-1]) >= 2
    # The default run is the same batch with other prompts: row 1 (chat) matches its prefix.
    assert one[1].tokens == default_results[1].tokens[:6]
    if jax.default_backend() != "cpu" and jax.device_count() < 2:  # CPUs make 2 host devices
        pytest.skip(f"--tp 2 needs 2 devices; this run sees {jax.device_count()}")
    # Same request on a 2-way tensor-parallel mesh: the same greedy tokens.
    assert [r.tokens for r in serve.run([*args, "--tp", "2"])] == [r.tokens for r in one]


def test_sampling_is_seeded():
    args = ["--temperature", "1.0", "--top-p", "0.9", "--max-new-tokens", "5", "--prompt", "x"]
    a, b = serve.run([*args, "--seed", "1"]), serve.run([*args, "--seed", "1"])
    assert [r.tokens for r in a] == [r.tokens for r in b]
    c = serve.run([*args, "--seed", "2"])
    assert [r.tokens for r in a] != [r.tokens for r in c]


def test_main_prints_each_request(capsys):
    assert serve.main(["--max-new-tokens", "3", "--prompt", "hi"]) == 0
    out = capsys.readouterr().out
    for name in [*serve.DEFAULT_ADAPTERS, "<base>"]:
        assert f"adapter={name}" in out
    assert out.count("tokens: [") == 4


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--adapter", "x=/nowhere"])  # --adapter needs --model
    with pytest.raises(SystemExit):
        serve.parse_args(["--model", "m", "--adapter", "nodir"])
    with pytest.raises(SystemExit):
        serve.parse_args(["--top-p", "0"])
    model_dir, adapters = serve.write_default(str(tmp_path))
    bad = tmp_path / "sql" / "adapter_model.safetensors"
    bad.write_bytes(bad.read_bytes()[:100])
    argv = ["--model", model_dir, "--adapter", f"sql={adapters['sql']}", "--max-new-tokens", "2"]
    assert serve.main(argv) == 2
    assert "adapter_model.safetensors" in capsys.readouterr().err
    # a mistyped model path is named, never resolved against the working directory
    assert serve.main(["--model", str(tmp_path / "nowhere"), "--max-new-tokens", "2"]) == 2
    assert "nowhere: no such checkpoint directory" in capsys.readouterr().err


def test_a_model_dirs_eos_ids_stop_its_requests(tmp_path):
    """With --model, the eos ids of the model's generation_config.json (else config.json)
    stop each request, as HF generate does; the embedded default has none."""
    import json

    model_dir, adapters = serve.write_default(str(tmp_path))
    argv = ["--model", model_dir, "--max-new-tokens", "6", "--prompt", "Hello"]
    argv += [f"--adapter={name}={d}" for name, d in adapters.items()]
    free = serve.run(argv)
    base = free[-1].tokens
    unused = next(t for t in range(256) if all(t not in r.tokens for r in free))
    with open(f"{model_dir}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": [unused, base[2]]}, f)
    stopped = serve.run(argv)
    for got, full in zip(stopped, (r.tokens for r in free)):
        stop = full.index(base[2]) if base[2] in full else None
        assert got.tokens == (full if stop is None else full[: stop + 1])
    assert stopped[-1].tokens == base[:3]
    # --model naming a file in the checkpoint: its directory's eos ids (they were lost)
    as_file = serve.run([*argv[:1], f"{model_dir}/config.json", *argv[2:]])
    assert [r.tokens for r in as_file] == [r.tokens for r in stopped]
    with pytest.raises(SystemExit):
        serve.parse_args(["--model", "m", "--adapter", "x=a", "--adapter", "x=b"])


def test_every_prompt_is_served_and_the_default_model_ignores_the_seed():
    """Prompts beyond the adapters' requests get requests without an adapter (none is
    dropped); --seed seeds sampling only, not the embedded model's weights."""
    prompts = ["a", "b", "c", "d", "e", "f"]
    args = [x for p in prompts for x in ("--prompt", p)] + ["--max-new-tokens", "3"]
    results = serve.run(args)
    assert [r.prompt for r in results] == prompts
    assert [r.adapter for r in results] == [*serve.DEFAULT_ADAPTERS, None, None, None]
    other = serve.run([*args, "--seed", "5"])  # greedy: the same model, the same tokens
    assert [r.tokens for r in other] == [r.tokens for r in results]


def test_byte_tokenizer_shows_ids_past_a_byte():
    assert serve.ByteTokenizer().decode([104, 300, 105, 256]) == "h<300>i<256>"


def test_cli_refuses_bad_numbers_and_unreadable_models(tmp_path, capsys, monkeypatch):
    import sys

    for argv in (["--max-lora-rank", "0"], ["--seed", "1.5"]):
        with pytest.raises(SystemExit):
            serve.parse_args(argv)
    assert "--max-lora-rank 0: must be >= 1" in capsys.readouterr().err
    model_dir, _ = serve.write_default(str(tmp_path))
    weights = tmp_path / "model" / "model.safetensors"
    full = weights.read_bytes()
    for cut in (1000, len(full) // 2):
        weights.write_bytes(full[:cut])
        assert serve.main(["--model", model_dir, "--max-new-tokens", "2"]) == 2
        assert "model.safetensors: " in capsys.readouterr().err
    weights.write_bytes(full)
    config = tmp_path / "model" / "config.json"
    text = config.read_text()
    config.write_text(text[:-5])
    assert serve.main(["--model", model_dir, "--max-new-tokens", "2"]) == 2
    assert "config.json: cannot read it as JSON" in capsys.readouterr().err
    config.write_text(text)
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    assert serve.main(["--model", model_dir, "--max-new-tokens", "2"]) == 2
    assert "needs transformers" in capsys.readouterr().err


def test_cli_refuses_non_finite_temperatures(capsys):
    """nan / inf are refused at parse time naming the flag (not after the model loaded,
    naming a Python field)."""
    for t in ("nan", "inf"):
        with pytest.raises(SystemExit):
            serve.parse_args(["--temperature", t])
        assert f"--temperature must be a finite number >= 0, got {t}" in capsys.readouterr().err


def test_cli_names_a_bad_generation_config(tmp_path, capsys):
    """A generation_config.json that is not JSON, or whose eos_token_id is no token id:
    an error naming the file (and the value)."""
    model_dir, _ = serve.write_default(str(tmp_path))
    gen = tmp_path / "model" / "generation_config.json"
    argv = ["--model", model_dir, "--max-new-tokens", "2"]
    gen.write_text('{"eos_token_id": ')
    assert serve.main(argv) == 2
    assert "generation_config.json: cannot read it as JSON" in capsys.readouterr().err
    for eos in ('["</s>"]', "1.5", "true", "[[1, 2]]"):
        gen.write_text(f'{{"eos_token_id": {eos}}}')
        assert serve.main(argv) == 2
        err = capsys.readouterr().err
        assert "generation_config.json: eos_token_id must be an int token id" in err
        assert repr(json.loads(eos)) in err


def test_cli_unsupported_model_type_lists_every_served_type(tmp_path, capsys):
    """The error names every model_type the CLI serves, MoE ones included (it listed only
    the dense decoder's)."""
    from lora_jax.models.config import SUPPORTED_MODEL_TYPES
    from lora_jax.models.moe_decoder import MOE_MODEL_TYPES

    (tmp_path / "config.json").write_text('{"model_type": "gemma", "vocab_size": 300}')
    assert serve.main(["--model", str(tmp_path), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "config.json: model_type='gemma' is not supported" in err
    for mt in (*SUPPORTED_MODEL_TYPES, *MOE_MODEL_TYPES):
        assert repr(mt) in err


def test_cli_serves_an_moe_checkpoint(tmp_path):
    """A Mixtral directory goes to the MoE loader: the CLI's tokens are `generate`'s on
    `load_hf_moe_model`'s model."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from lora_jax.models.moe_decoder import load_hf_moe_model
    from lora_jax.serving.generate import generate

    cfg = transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, eos_token_id=None,
        bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path)
    got = serve.run(["--model", str(tmp_path), "--prompt", "Hi", "--max-new-tokens", "4"])
    want = generate(load_hf_moe_model(str(tmp_path)), [list(b"Hi")], max_new_tokens=4)
    assert [r.tokens for r in got] == [tuple(want.tokens[0])]


def test_help_lists_the_ranks_max_lora_rank_takes(capsys):
    """--max-lora-rank's help named no allowed rank; the error did."""
    from lora_jax.config import SUPPORTED_MAX_LORA_RANKS
    from lora_jax.serve import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ", ".join(map(str, SUPPORTED_MAX_LORA_RANKS)) in text


def _write_mixtral(directory, seed=0) -> str:
    """A tiny random Mixtral checkpoint in transformers 5's layout (fused experts), numpy."""
    import numpy as np

    from lora_jax.serving.peft import write_safetensors

    D, n, E, V, hd = 32, 16, 4, 256, 16
    config = dict(
        model_type="mixtral", vocab_size=V, hidden_size=D, intermediate_size=n,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=hd,
        num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.normal(size=shape) / shape[-1] ** 0.5).astype(np.float32)  # noqa: E731
    p = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": w(V, D) * D**0.5,
        "model.norm.weight": np.ones(D, np.float32),
        "lm_head.weight": w(V, D),
        p + "input_layernorm.weight": np.ones(D, np.float32),
        p + "post_attention_layernorm.weight": np.ones(D, np.float32),
        p + "self_attn.q_proj.weight": w(2 * hd, D),
        p + "self_attn.k_proj.weight": w(hd, D),
        p + "self_attn.v_proj.weight": w(hd, D),
        p + "self_attn.o_proj.weight": w(D, 2 * hd),
        p + "mlp.gate.weight": w(E, D),
        p + "mlp.experts.gate_up_proj": w(E, 2 * n, D),
        p + "mlp.experts.down_proj": w(E, D, n),
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
    return str(directory)


def test_auto_max_lora_rank_fits_per_expert_gate_and_up_fused_into_w13(tmp_path, capsys):
    """A transformers-4 per-expert adapter (r=8 on w1/w2/w3, expert 0's w3 at 16 by
    rank_pattern) on Mixtral: the CLI's default wrap fuses gate and up into one w13 LoRA of
    rank 8 + 16, so the automatic --max-lora-rank is 32, not the config's largest rank (16,
    which the loader refuses); it serves what an explicit --max-lora-rank 32 serves."""
    import numpy as np

    from lora_jax.serving.peft import write_safetensors

    base = _write_mixtral(tmp_path / "mixtral")
    D, n, E = 32, 16, 4
    pattern = {"experts.0.w3": 16}
    rng = np.random.default_rng(1)
    tensors = {}
    for j in range(E):
        for name, (n_in, n_out) in (("w1", (D, n)), ("w3", (D, n)), ("w2", (n, D))):
            r = 16 if (j, name) == (0, "w3") else 8
            key = f"base_model.model.model.layers.0.block_sparse_moe.experts.{j}.{name}"
            tensors[f"{key}.lora_A.weight"] = (rng.normal(size=(r, n_in)) * 0.3).astype("f4")
            tensors[f"{key}.lora_B.weight"] = (rng.normal(size=(n_out, r)) * 0.3).astype("f4")
    adapter = tmp_path / "per_expert"
    adapter.mkdir()
    write_safetensors(adapter / "adapter_model.safetensors", tensors)
    config = dict(peft_type="LORA", r=8, lora_alpha=16, target_modules=["w1", "w2", "w3"])
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": pattern}))
    argv = ["--model", base, "--adapter", f"pe={adapter}", "--prompt", "Hi", "--max-new-tokens"]
    argv += ["6"]
    auto = serve.run(argv)
    assert [r.tokens for r in auto] == [
        r.tokens for r in serve.run([*argv, "--max-lora-rank", "32"])
    ]
    assert auto[0].tokens != auto[1].tokens  # the adapter is served
    assert serve.main([*argv, "--max-lora-rank", "16"]) == 2
    assert "fuse into one w13 LoRA of rank 24" in capsys.readouterr().err


def test_an_adapter_past_the_largest_rank_is_named(tmp_path, capsys):
    """The error names the adapter and the largest rank allowed."""
    from lora_jax.config import SUPPORTED_MAX_LORA_RANKS

    model_dir, adapters = serve.write_default(str(tmp_path))
    config = tmp_path / "sql" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "r": 600}))
    argv = ["--model", model_dir, "--max-new-tokens", "2"]
    argv += [f"--adapter={name}={d}" for name, d in adapters.items()]
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--adapter sql={adapters['sql']}: needs max_lora_rank >= 600" in err
    assert f"the largest supported, {SUPPORTED_MAX_LORA_RANKS[-1]}" in err


def test_model_named_as_a_file_in_the_working_directory(tmp_path, monkeypatch):
    """`--model config.json` (or `model.safetensors`) from inside the checkpoint serves
    that checkpoint (the directory of a bare file name was "": "no such checkpoint")."""
    model_dir, _ = serve.write_default(str(tmp_path))
    argv = ["--prompt", "Hello", "--max-new-tokens", "3"]
    want = [r.tokens for r in serve.run(["--model", model_dir, *argv])]
    monkeypatch.chdir(model_dir)
    for name in ("config.json", "model.safetensors"):
        assert [r.tokens for r in serve.run(["--model", name, *argv])] == want


def test_a_tokenizer_is_checked_before_the_weights_load(tmp_path, capsys, monkeypatch):
    """The model's tokenizer is built before its weights load: with both unusable, the
    tokenizer's error comes first (not after a long load)."""
    import sys

    model_dir, _ = serve.write_default(str(tmp_path))
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    assert serve.main(["--model", model_dir, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs transformers" in err and "model.safetensors" not in err


@pytest.mark.parametrize("damage", ["not a tokenizer", "truncated"])
def test_a_damaged_tokenizer_is_named(tmp_path, capsys, damage):
    """A tokenizer.json transformers cannot load: a CLI error naming the file (a raw
    KeyError traceback, or a JSON error naming no file, before)."""
    pytest.importorskip("transformers")
    model_dir, _ = serve.write_default(str(tmp_path))
    text = '{"not": "a tokenizer"}' if damage == "not a tokenizer" else '{"version": "1.0", "tr'
    (tmp_path / "model" / "tokenizer.json").write_text(text)
    assert serve.main(["--model", model_dir, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{model_dir}/tokenizer.json: transformers cannot load the tokenizer" in err


@pytest.mark.oracle
@pytest.mark.parametrize("generation_config", ["no eos", "null eos", "own eos", "no file"])
def test_eos_ids_are_the_ones_hf_generate_stops_at(tmp_path, generation_config):
    """config.json names an eos id that greedy decoding reaches: HF generate stops at it
    only without a generation_config.json; with one, that file's eos_token_id alone
    counts (none there: no eos). The CLI stops where HF generate stops."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # away from HF's near-zero init: clear argmax margins
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path)
    prompt = list(b"short")

    def hf_tokens():
        m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        with torch.no_grad():
            out = m.eval().generate(
                input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                max_new_tokens=6, do_sample=False,
            )  # fmt: skip
        return tuple(out[0, len(prompt) :].tolist())

    free = hf_tokens()
    config_path, gen_path = tmp_path / "config.json", tmp_path / "generation_config.json"
    config_path.write_text(
        json.dumps({**json.loads(config_path.read_text()), "eos_token_id": free[2]})
    )
    gen = json.loads(gen_path.read_text())
    assert "eos_token_id" not in gen
    if generation_config == "no file":
        gen_path.unlink()
    elif generation_config != "no eos":
        gen["eos_token_id"] = None if generation_config == "null eos" else free[1]
        gen_path.write_text(json.dumps(gen))
    want = hf_tokens()
    assert (want == free) == (generation_config in ("no eos", "null eos"))
    got = serve.run(["--model", str(tmp_path), "--prompt", "short", "--max-new-tokens", "6"])
    assert [r.tokens for r in got] == [want]


def test_a_kv_cache_too_big_for_the_device_is_a_cli_error(capsys):
    """A --max-new-tokens whose KV cache no device holds: a CLI error naming the flag and
    the cache size (a raw RESOURCE_EXHAUSTED traceback, before)."""
    assert serve.main(["--max-new-tokens", str(10**12), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"--max-new-tokens {10**12}: 4 requests of up to 2 prompt + {10**12} new tokens" in err
    c = serve.DEFAULT_MODEL  # f32 k and v per layer, kv head and position
    per_position = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 4
    gib = 4 * (2 + 10**12) * per_position / 2**30
    assert f"need a KV cache of at least {gib:.3g} GiB" in err
    # checked before the call (session 51: on a GPU, generate failed first, with an
    # OverflowError on the 2**40 positions)
    assert re.search(r"more than the (devices'|host's) memory \([\d.]+ GiB\)", err)


def test_a_kv_cache_the_allocator_refuses_is_a_cli_error(capsys, monkeypatch):
    """Where the memory is not known ahead, the allocator's RESOURCE_EXHAUSTED becomes the
    same CLI error (a 1.9 TB cache: fits int32 positions, fails at once)."""
    monkeypatch.setattr(serve, "_memory_bytes", lambda model: (None, ""))
    assert serve.main(["--max-new-tokens", str(10**9), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"{10**9} new tokens need a KV cache of at least" in err
    assert "more than the device could allocate (RESOURCE_EXHAUSTED" in err


def test_an_activated_lora_adapter_acts_from_its_invocation(tmp_path):
    """The main job maps an aLoRA adapter (`alora_invocation_tokens`) by its invocation in
    each prompt: a prompt without it is served by the base model, one with it is not (and
    not as the same weights served from the first token)."""
    model_dir = serve.write_default_model(str(tmp_path / "model"))
    spec = dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    plain = serve.write_default_adapter(str(tmp_path / "plain"), spec, seed=3)
    alora = serve.write_default_adapter(str(tmp_path / "alora"), spec, seed=3)
    config_file = os.path.join(alora, "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "alora_invocation_tokens": list(b"##")}, f)

    def run(adapter, prompt):
        argv = ["--model", model_dir, "--max-new-tokens", "6", "--prompt", prompt]
        return [r.tokens for r in serve.run([*argv, f"--adapter=a={adapter}"])]

    invoked, base = run(alora, "Tell me ## a story")
    assert invoked != base and invoked != run(plain, "Tell me ## a story")[0]
    missing, base = run(alora, "Tell me a story")
    assert missing == base


def test_an_adapter_with_trainable_tokens_is_served_with_its_rows(tmp_path):
    """The main job sizes `max_lora_trainable_tokens` from its adapters' configs: an
    adapter whose bytes ' ' and 'e' have their own embedding rows generates otherwise
    than the same LoRA without them."""
    from lora_jax.serving.peft import read_safetensors, write_safetensors

    model_dir = serve.write_default_model(str(tmp_path / "model"))
    with open(os.path.join(model_dir, "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    spec = dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    plain = serve.write_default_adapter(str(tmp_path / "plain"), spec, seed=3)
    tok = serve.write_default_adapter(str(tmp_path / "tok"), spec, seed=3)
    ids = list(b" e")
    with open(os.path.join(tok, "adapter_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(tok, "adapter_config.json"), "w") as f:
        json.dump({**config, "trainable_token_indices": ids}, f)
    weights = os.path.join(tok, "adapter_model.safetensors")
    key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
    rows = np.random.default_rng(0).normal(0, 2.0, (len(ids), hidden)).astype(np.float32)
    write_safetensors(weights, {**read_safetensors(weights), key: rows})

    def run(adapter):
        argv = ["--model", model_dir, "--max-new-tokens", "6", "--prompt", "Tell me a story"]
        return [r.tokens for r in serve.run([*argv, f"--adapter=a={adapter}"])]

    with_rows, base = run(tok)
    assert with_rows != run(plain)[0] and with_rows != base


def test_a_dora_adapter_is_served_with_enable_dora(tmp_path):
    """The main job turns `enable_dora` on when an adapter's config says `use_dora`: a DoRA
    adapter (magnitudes at half its layers' norms) generates otherwise than its LoRA alone."""
    from lora_jax.serving.peft import read_safetensors, write_safetensors

    model_dir = serve.write_default_model(str(tmp_path / "model"))
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    outs = {"q_proj": c["num_attention_heads"] * head, "v_proj": c["num_key_value_heads"] * head}
    spec = dict(r=16, lora_alpha=32, target_modules=sorted(outs))
    plain = serve.write_default_adapter(str(tmp_path / "plain"), spec, seed=3)
    dora = serve.write_default_adapter(str(tmp_path / "dora"), spec, seed=3)
    with open(os.path.join(dora, "adapter_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dora, "adapter_config.json"), "w") as f:
        json.dump({**config, "use_dora": True}, f)
    weights = os.path.join(dora, "adapter_model.safetensors")
    tensors = read_safetensors(weights)
    for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
        module = key[: -len(".lora_A.weight")]
        n = outs[module.rpartition(".")[2]]
        tensors[f"{module}.lora_magnitude_vector"] = np.full((n,), 0.5, np.float32)
    write_safetensors(weights, tensors)

    def run(adapter):
        argv = ["--model", model_dir, "--max-new-tokens", "6", "--prompt", "Tell me a story"]
        return [r.tokens for r in serve.run([*argv, f"--adapter=a={adapter}"])]

    assert run(dora)[0] != run(plain)[0]
