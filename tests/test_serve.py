"""The main job (`lora_jax.serve`): the embedded default end to end, its CLI, and --tp."""

import json

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
    # Same request on a 2-way tensor-parallel mesh: the same greedy tokens.
    assert [r.tokens for r in serve.run([*args, "--tp", "2"])] == [r.tokens for r in one]
    # The default run is the same batch with other prompts: row 1 (chat) matches its prefix.
    assert one[1].tokens == default_results[1].tokens[:6]


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
