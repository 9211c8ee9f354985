"""Hugging Face checkpoints (`config.json` + safetensors) → `DecoderForCausalLM`.

Reads a single `model.safetensors` or a sharded checkpoint described by
`model.safetensors.index.json`. HF linears are torch `[out, in]`; they are transposed to
Flax's `[in, out]` and q/k/v (gate/up) are packed through the layers' own `load_kernel`,
which also lays out kv-head replicas and per-shard packing for the mesh. The model is
first built abstractly (`nnx.eval_shape`), so no random weights are materialized.

Every tensor the model needs must be present with the right shape, and every tensor in
the checkpoint must be used (except rotary caches, and `lm_head.weight` when tied);
otherwise a `ValueError` names the tensor and the file.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_jax.models.attention import RMSNorm
from lora_jax.models.config import DecoderConfig
from lora_jax.models.decoder import DecoderForCausalLM
from lora_jax.sharding import ShardingRules

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class SafetensorsCheckpoint:
    """Lazy, by-name reader over one or several safetensors files.

    Example:
        >>> ckpt = SafetensorsCheckpoint("/path/to/model_dir")  # doctest: +SKIP
        >>> ckpt.get("model.norm.weight", (4096,)).dtype  # doctest: +SKIP
    """

    def __init__(self, directory: str):
        from safetensors import safe_open

        self.directory = directory
        index_path = os.path.join(directory, INDEX_FILE)
        single_path = os.path.join(directory, SINGLE_FILE)
        if os.path.exists(index_path):
            index = _read_json(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index_path}: no 'weight_map' dict")
            bad = [
                f
                for f in weight_map.values()
                if not isinstance(f, str) or os.path.basename(f) != f or f in ("", ".", "..")
            ]
            if bad:
                raise ValueError(
                    f"{index_path}: shard names must be file names in the checkpoint "
                    f"directory, got {bad[:3]}"
                )
            files = sorted(set(weight_map.values()))
            for fname in files:
                if not os.path.exists(os.path.join(directory, fname)):
                    raise ValueError(f"{index_path} names shard {fname!r}, which is missing")
            self.weight_map = dict(weight_map)
        elif os.path.exists(single_path):
            files = [SINGLE_FILE]
            self.weight_map = None
        else:
            raise ValueError(
                f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints "
                "are supported)"
            )
        # The "flax" reader: safetensors' numpy reader cannot return bfloat16, the dtype
        # of most HF checkpoints. Tensors are read onto the host CPU device.
        self._handles = {}
        for f in files:
            path = os.path.join(directory, f)
            try:
                self._handles[f] = safe_open(path, framework="flax")
            except Exception as e:  # safetensors' own error type: a bad header or size
                raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
        if self.weight_map is None:
            self.weight_map = dict.fromkeys(self._handles[SINGLE_FILE].keys(), SINGLE_FILE)
        else:
            # keys() builds a fresh list per call: one set per shard keeps the check linear
            held = {f: set(h.keys()) for f, h in self._handles.items()}
            for name, fname in self.weight_map.items():
                if name not in held[fname]:
                    raise ValueError(
                        f"{INDEX_FILE} maps tensor {name!r} to {fname!r}, which lacks it"
                    )
        self.used: set[str] = set()

    def names(self) -> Iterable[str]:
        return self.weight_map.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor `name` as numpy, checked against `shape`."""
        if name not in self.weight_map:
            raise ValueError(f"{self.directory}: tensor {name!r} (shape {shape}) is missing")
        fname = self.weight_map[name]
        with jax.default_device(jax.devices("cpu")[0]):
            path = os.path.join(self.directory, fname)
            try:
                if self._handles[fname].get_slice(name).get_dtype() in _WIDE_DTYPES:
                    # jax without x64 would narrow these: read them as numpy, exactly
                    from safetensors import safe_open

                    with safe_open(path, framework="numpy") as f:
                        arr = f.get_tensor(name)
                else:
                    arr = np.asarray(self._handles[fname].get_tensor(name))
            except Exception as e:  # truncated data past the header
                raise ValueError(f"{path}: cannot read tensor {name!r} ({e})") from e
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(
                f"{os.path.join(self.directory, fname)}: tensor {name!r} has shape "
                f"{tuple(arr.shape)}, expected {tuple(shape)}"
            )
        self.used.add(name)
        return arr


_WIDE_DTYPES = ("F64", "I64", "U64")


def read_config_json(path_or_dir: str) -> tuple[str, dict]:
    """`(directory, config.json as a dict)` of a checkpoint directory (or a file in it)."""
    if not os.path.exists(path_or_dir):
        raise ValueError(f"{path_or_dir}: no such checkpoint directory or file")
    directory = path_or_dir if os.path.isdir(path_or_dir) else os.path.dirname(path_or_dir)
    directory = directory or "."  # "config.json" in the working directory: dirname is ""
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{directory}: no config.json")
    config = _read_json(cfg_path)
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object")
    return directory, config


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON: {e}") from e


def read_hf_config(path_or_dir: str) -> tuple[str, DecoderConfig]:
    """`(directory, DecoderConfig)` from a checkpoint directory (or a file inside it)."""
    directory, config = read_config_json(path_or_dir)
    return directory, DecoderConfig.from_hf(config)


def load_hf_model(
    path_or_dir: str,
    *,
    rules: ShardingRules | None = None,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
) -> DecoderForCausalLM:
    """Builds a `DecoderForCausalLM` with the weights of an HF safetensors checkpoint.

    Example:
        >>> model = load_hf_model("/ckpt/Llama-3.2-1B", rules=ShardingRules(mesh))  # doctest: +SKIP
    """
    directory, config = read_hf_config(path_or_dir)
    rules = rules if rules is not None else ShardingRules()
    ckpt = SafetensorsCheckpoint(directory)
    model = nnx.eval_shape(
        lambda: DecoderForCausalLM(
            config, rules=rules, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)
        )
    )
    load_hf_weights(model, ckpt)
    return model


def hf_linear(ckpt: SafetensorsCheckpoint, name: str, n_out: int, n_in: int):
    """A torch `[out, in]` weight as a Flax kernel `[in, out]`."""
    return ckpt.get(name, (n_out, n_in)).T


def load_dense_mlp(mlp, m: str, c, ckpt: SafetensorsCheckpoint) -> None:
    """SwiGLU MLP at prefix `m` ("model.layers.{i}.mlp.") into packed gate_up + down."""
    D, inter = c.hidden_size, c.intermediate_size
    gu = [hf_linear(ckpt, f"{m}{s}_proj.weight", inter, D) for s in ("gate", "up")]
    gu_bias = (
        [ckpt.get(f"{m}{s}_proj.bias", (inter,)) for s in ("gate", "up")] if c.mlp_bias else None
    )
    mlp.gate_up_proj.load_kernel(gu, gu_bias)
    d_bias = [ckpt.get(m + "down_proj.bias", (D,))] if c.mlp_bias else None
    mlp.down_proj.load_kernel([hf_linear(ckpt, m + "down_proj.weight", D, inter)], d_bias)


def load_hf_weights(model: DecoderForCausalLM, ckpt: SafetensorsCheckpoint, load_mlp=None) -> None:
    """Writes every weight of `model` from `ckpt` (HF names); checks for leftovers.

    `load_mlp(mlp, prefix, config, ckpt)` loads one layer's MLP (default: the dense
    SwiGLU); the MoE decoder passes its own for sparse layers.
    """
    c = model.config
    D, hd = c.hidden_size, c.head_dim
    nq, nkv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    linear = functools.partial(hf_linear, ckpt)  # (name, n_out, n_in) -> [in, out]

    def norm(mod: RMSNorm, name: str):
        w = jnp.asarray(ckpt.get(name, (mod.dim,)), mod.param_dtype)
        mod.weight.set_value(mod.rules.place(w, None))

    model.model.embed_tokens.load_table(ckpt.get("model.embed_tokens.weight", (c.vocab_size, D)))
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        norm(layer.input_layernorm, p + "input_layernorm.weight")
        norm(layer.post_attention_layernorm, p + "post_attention_layernorm.weight")
        a = p + "self_attn."
        sizes = {"q": nq, "k": nkv, "v": nkv}
        kernels = [linear(f"{a}{s}_proj.weight", sizes[s], D) for s in "qkv"]
        biases = [ckpt.get(f"{a}{s}_proj.bias", (sizes[s],)) for s in "qkv"] if c.qkv_bias else None
        layer.self_attn.qkv_proj.load_kernel(kernels, biases)
        o_bias = [ckpt.get(a + "o_proj.bias", (D,))] if c.o_bias else None
        layer.self_attn.o_proj.load_kernel([linear(a + "o_proj.weight", D, nq)], o_bias)
        if c.qk_norm:
            norm(layer.self_attn.q_norm, a + "q_norm.weight")
            norm(layer.self_attn.k_norm, a + "k_norm.weight")
        (load_mlp or load_dense_mlp)(layer.mlp, p + "mlp.", c, ckpt)
    norm(model.model.norm, "model.norm.weight")
    if model.lm_head is not None:
        model.lm_head.load_table(ckpt.get("lm_head.weight", (c.vocab_size, D)))
    elif "lm_head.weight" in ckpt:
        ckpt.used.add("lm_head.weight")  # tied: HF ignores a saved copy too
    unused = sorted(
        n for n in ckpt.names() if n not in ckpt.used and not n.endswith(_IGNORED_SUFFIXES)
    )
    if unused:
        more = f" (and {len(unused) - 5} more)" if len(unused) > 5 else ""
        raise ValueError(
            f"{ckpt.directory}: tensors not used by {c.model_type} model: {unused[:5]}{more}"
        )
    abstract = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
        if isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if abstract:  # pragma: no cover - a model attribute this loader does not know about
        raise ValueError(f"weights left unloaded: {abstract[:5]}")
