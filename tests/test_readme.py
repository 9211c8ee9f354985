"""The README's Python examples run as written (blocks fenced with ```python)."""

import pathlib
import re

import jax
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SETUP = (
    'pip install -e ".[test]" && python examples/serve.py',
    'pip install -e ".[test,oracle]" "torch==2.13.0" && python -m pytest -q -n 2',
)


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _block(needle: str) -> str:
    found = [b for b in _python_blocks() if needle in b]
    assert len(found) == 1, f"expected one README python block with {needle!r}"
    return found[0]


def test_readme_keeps_the_setup_commands():
    # CI and a hook run these two lines; they must stay verbatim.
    text = README.read_text()
    for cmd in SETUP:
        assert cmd in text


def test_readme_example_serves_a_mixed_batch(capsys):
    ns: dict = {}
    exec(compile(_block("LRUCacheLoRAModelManager"), "README.md:example", "exec"), ns)
    tokens = ns["out"].tokens
    assert len(tokens) == 3 and all(len(t) == 5 for t in tokens)
    assert list(ns["slots"]) == [0, 1, -1]
    assert str(tokens) in capsys.readouterr().out
    # Request 0 used an adapter: the same prompt without it gives other tokens (the
    # random adapters are large), and the base request equals a no-adapter run.
    generate, model = ns["generate"], ns["model"]
    base = generate(model, [[72, 105], [1, 2, 3], [7]], [-1, -1, -1], max_new_tokens=5).tokens
    assert base[2] == tokens[2]
    assert base[0] != tokens[0] or base[1] != tokens[1]


def test_readme_alora_example_runs_after_the_quick_start(capsys):
    ns: dict = {}
    exec(compile(_block("LRUCacheLoRAModelManager"), "README.md:example", "exec"), ns)
    exec(compile(_block("alora_invocation_tokens=[5, 9]"), "README.md:alora", "exec"), ns)
    slots, starts, out = ns["slots"], ns["starts"], ns["out"]
    assert starts.tolist() == [1, 0, 0] and slots.tolist()[1:] == [-1, -1] and slots[0] >= 0
    base = ns["generate"](ns["model"], ns["prompts"], [-1] * 3, max_new_tokens=5).tokens
    # the prompt that lacks the invocation runs the base model; the invoked one does not
    assert out.tokens[1] == base[1] and out.tokens[0] != base[0]


def test_readme_mesh_example_runs():
    if len(jax.devices()) < 8:
        pytest.skip("the mesh example needs 8 devices (tests/conftest.py simulates 8 on CPU)")
    ns: dict = {}
    exec(compile(_block("jax.make_mesh"), "README.md:mesh", "exec"), ns)
    assert dict(ns["mesh"].shape) == {"dp": 2, "tp": 4}
    assert [len(t) for t in ns["out"].tokens] == [4, 4]


def test_readme_plain_flax_example_runs():
    ns: dict = {}
    exec(compile(_block("class Block(nnx.Module)"), "README.md:flax", "exec"), ns)
    block, y = ns["block"], ns["y"]
    lj = ns["lj"]
    assert type(block.q_proj) is lj.FlaxLinearWithLoRA
    lj.set_lora_mapping(block, ns["jnp"].array([-1, -1], "int32"))
    base = block(ns["jnp"].ones((2, 16)))
    assert (y[1] == base[1]).all() and not (y[0] == base[0]).all()


def test_readme_trains_a_slot_and_saves_it(tmp_path):
    from lora_jax.serving.peft import load_peft_adapter

    src = _block("def train_step(").replace("/tmp/lora_jax_tuned", str(tmp_path / "tuned"))
    ns: dict = {}
    exec(compile(src, "README.md:training", "exec"), ns)
    losses = ns["losses"]
    assert losses[-1] < losses[0] - 1e-3, losses
    cfg = ns["lj"].LoRAConfig(max_loras=2, max_lora_rank=8)
    adapter = load_peft_adapter(tmp_path / "tuned", ns["model"], cfg)
    assert sorted(adapter.modules) == [
        f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)
    ]  # q and v of each layer's packed qkv


def test_readme_trains_a_dora_slot_and_saves_it(tmp_path):
    """The DoRA block, after the training block it continues: the loss falls, and the
    saved adapter is a DoRA adapter with every targeted module's magnitudes."""
    import json

    from lora_jax.serving.peft import load_peft_adapter

    ns: dict = {}
    for needle, path in (
        ("def train_step(", "lora_jax_tuned"),
        ("def dora_step(", "lora_jax_dora"),
    ):
        src = _block(needle).replace(f"/tmp/{path}", str(tmp_path / path))
        exec(compile(src, f"README.md:{needle}", "exec"), ns)
    losses = ns["dora_losses"]
    assert losses[-1] < losses[0] - 1e-3, losses
    saved = tmp_path / "lora_jax_dora"
    assert json.loads((saved / "adapter_config.json").read_text())["use_dora"] is True
    cfg = ns["lj"].LoRAConfig(max_loras=2, max_lora_rank=8, enable_dora=True)
    adapter = load_peft_adapter(saved, ns["dora"], cfg)
    for i in range(2):
        q, k, v = adapter.modules[f"model.layers.{i}.self_attn.qkv_proj"].magnitude
        assert q is not None and k is None and v is not None
