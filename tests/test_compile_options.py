"""Decode steps compiled with `decode_compiler_options`: which options, on which backend, that
this XLA knows them, that `generate` and `Generator` compile their decode loops with them
(and only those), and on a GPU that a concurrently scheduled decode step computes what
the default order computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lora_jax
from lora_jax import compile_options
from lora_jax.compile_options import CONCURRENT_OPTIONS, decode_compiler_options
from lora_jax.models import DecoderConfig, DecoderForCausalLM
from lora_jax.models.kv_cache import KVCache
from lora_jax.serving import generate as gen_mod
from lora_jax.serving.wrap import wrap_model

CFG = DecoderConfig.tiny()
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_options_follow_the_backend_and_the_environment(monkeypatch):
    monkeypatch.delenv(compile_options.CONCURRENT_DECODE_ENV, raising=False)
    on_gpu = jax.default_backend() == "gpu"
    assert decode_compiler_options() == (CONCURRENT_OPTIONS if on_gpu else {})
    monkeypatch.setattr(compile_options.jax, "default_backend", lambda: "gpu")
    assert decode_compiler_options() == CONCURRENT_OPTIONS
    monkeypatch.setenv(compile_options.CONCURRENT_DECODE_ENV, "0")
    assert decode_compiler_options() == {}
    for off in ("false", " OFF", "no"):
        monkeypatch.setenv(compile_options.CONCURRENT_DECODE_ENV, off)
        assert decode_compiler_options() == {}
    for on in ("1", "True", "yes", ""):
        monkeypatch.setenv(compile_options.CONCURRENT_DECODE_ENV, on)
        assert decode_compiler_options() == CONCURRENT_OPTIONS
    monkeypatch.setenv(compile_options.CONCURRENT_DECODE_ENV, "maybe")
    with pytest.raises(ValueError, match="LORA_JAX_CONCURRENT_DECODE='maybe': use 0"):
        decode_compiler_options()
    monkeypatch.setenv(compile_options.CONCURRENT_DECODE_ENV, "1")
    monkeypatch.setattr(compile_options.jax, "default_backend", lambda: "cpu")
    assert decode_compiler_options() == {}


def test_this_xla_knows_the_option():
    """XLA parses the option on every backend: a value it does not know is refused, so a
    renamed option or value fails here rather than in a user's decode step."""
    f = lambda x: jnp.sin(x) * 2  # noqa: E731
    x = jnp.arange(8.0)
    got = jax.jit(f, compiler_options=CONCURRENT_OPTIONS)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(f)(x)))
    (key,) = CONCURRENT_OPTIONS
    with pytest.raises(Exception, match="not a valid enum value"):
        jax.jit(f, compiler_options={key: "NO_SUCH_MODE"})(x)


@pytest.fixture(scope="module")
def model():
    return DecoderForCausalLM(CFG, rngs=nnx.Rngs(0))


def test_generate_compiles_only_its_decode_loop_with_them(model, monkeypatch):
    """With options XLA refuses, a one-token generation (prefill only) still runs and a
    two-token one (prefill + decode loop) fails, in `generate` and in a `Generator`."""
    (key,) = CONCURRENT_OPTIONS
    monkeypatch.setattr(gen_mod, "decode_compiler_options", lambda: {key: "NO_SUCH_MODE"})
    prompts = [[1, 2, 3], [4]]
    generator = gen_mod.Generator(model)  # its steps are made here, with the options
    for run in (lambda p, **kw: gen_mod.generate(model, p, **kw), generator):
        assert len(run(prompts, max_new_tokens=1).tokens) == 2
        with pytest.raises(Exception, match="not a valid enum value"):
            run(prompts, max_new_tokens=2)


def _decode_logits(model, batch, options):
    """Logits of 4 greedy decode steps over a random LoRA mapping, in one jit compiled with
    ``options``."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(batch)
    idx = jnp.asarray(rng.integers(-1, 4, batch), jnp.int32)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, batch), jnp.int32)
    cache = KVCache.init(CFG, batch, 8, dtype=jnp.float32)

    def steps(state, cache, ids, idx):
        m = nnx.merge(graphdef, state)
        lora_jax.set_lora_mapping(m, idx)
        out = []
        for t in range(4):
            logits, cache = m(ids[:, None], jnp.full((batch, 1), t, jnp.int32), cache)
            out.append(logits[:, -1])
            ids = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        return jnp.stack(out)

    return np.asarray(jax.jit(steps, compiler_options=options or None)(state, cache, ids, idx))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [8, 256])  # the XLA ops below 128 tokens, the kernels above
def test_concurrent_decode_computes_what_the_default_order_does(batch):
    model = DecoderForCausalLM(CFG, rngs=nnx.Rngs(0))
    wrap_model(model, lora_jax.LoRAConfig(max_loras=4, max_lora_rank=16), target_modules=TARGETS)
    rng = np.random.default_rng(0)
    base = _decode_logits(model, batch, {})  # every slot empty: the base model
    adapters = nnx.state(model, nnx.LoRAParam)  # every slot random, at the full rank
    nnx.update(model, jax.tree.map(lambda w: rng.normal(0, 0.2, w.shape).astype(w.dtype), adapters))
    for _, var in nnx.iter_graph(model):
        if isinstance(var, lora_jax.LoRASlotRanks):  # the ranks travel with the stacks
            var.set_value(jnp.full(var.shape, 16, jnp.int32))
    serial = _decode_logits(model, batch, {})
    assert np.abs(serial - base).max() > 1e-2  # the adapters matter
    concurrent = _decode_logits(model, batch, CONCURRENT_OPTIONS)
    if batch < lora_jax.ops.PALLAS_MIN_TOKENS:  # no atomics: the same sums, bit for bit
        np.testing.assert_array_equal(concurrent, serial)
    else:  # the kernels' split-K atomics may add in another order
        np.testing.assert_allclose(concurrent, serial, rtol=1e-4, atol=1e-4)
