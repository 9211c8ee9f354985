"""The compiled programs do vLLM's communication, read off the optimized HLO."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from layer_cases import KIND_BY_NAME, KINDS, MAX_RANK, build, make_mesh

import lora_jax as lj

T = 16
_COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?)\s+(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
    r"(?:-start)?\("
)
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def collectives(layer, tokens=T):
    """[(op, numel)] of every collective in the compiled forward of `layer`."""
    graphdef, state = nnx.split(layer)

    def f(state, x, idx):
        model = nnx.merge(graphdef, state)
        lj.set_lora_mapping(model, idx)
        return model(x)

    x = jnp.zeros((tokens, layer.base_layer.in_features))
    hlo = jax.jit(f).lower(state, x, jnp.zeros(tokens, jnp.int32)).compile().as_text()
    found = []
    for m in _COLLECTIVE.finditer(hlo):
        numel = 0
        for _, dims in _SHAPE.findall(m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            numel += n
        found.append((m.group(2), numel))
    return found


def _layer(name, dp=1, tp=4):
    layer, *_ = build(KIND_BY_NAME[name], lj.ShardingRules(make_mesh(dp, tp)), adapters={0: 16})
    return layer


COLUMN = [k.name for k in KINDS if not k.row and not k.lora_cls.fully_sharded]
COLUMN_SHARDED = [k.name for k in KINDS if not k.row and k.lora_cls.fully_sharded]


@pytest.mark.parametrize("name", COLUMN)
def test_column_lora_adds_no_collective(name):
    assert collectives(_layer(name)) == []


def test_row_lora_joins_the_one_base_all_reduce():
    layer = _layer("row")
    out = layer.base_layer.out_features
    assert collectives(layer) == [("all-reduce", T * out)]
    # dp x tp: tokens split over dp, still one all-reduce over the local tokens.
    assert collectives(_layer("row", dp=2, tp=4)) == [("all-reduce", T // 2 * out)]


@pytest.mark.parametrize("name", COLUMN_SHARDED)
def test_sharded_column_lora_gathers_only_rank_sized_buffers(name):
    layer = _layer(name)
    assert collectives(layer) == [("all-gather", layer.n_slices * T * MAX_RANK)]


def test_sharded_row_lora_collectives_are_rank_sized():
    layer = _layer("row_sharded")
    out = layer.base_layer.out_features
    found = sorted(collectives(layer))
    # The base's one all-reduce also carries the LoRA out-slices; the only LoRA
    # collective is the (T, rank) all-reduce of the shrink.
    assert found == sorted([("all-reduce", T * MAX_RANK), ("all-reduce", T * out)])
