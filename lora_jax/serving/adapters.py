"""Host-side adapters: what the PEFT loader builds and the adapter managers hold."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class ModuleLoRA:
    """One LoRA layer's share of an adapter, per packed member (`None` = absent).

    `lora_a[i]` is `[r_i, in]`, `lora_b[i]` is `[out_i, r_i]` with the scaling folded in.

    Example:
        >>> m = ModuleLoRA("x.o_proj", (np.ones((4, 16)),), (np.ones((8, 4)),))
        >>> m.rank, [a.shape for a in m.set_lora_args()]
        (4, [(4, 16), (8, 4)])
    """

    module_name: str
    lora_a: tuple[np.ndarray | None, ...]
    lora_b: tuple[np.ndarray | None, ...]
    magnitude: tuple[np.ndarray | None, ...] | None = None
    """DoRA (PEFT `use_dora`): per member its `lora_magnitude_vector [out_i]`, else None."""

    @property
    def rank(self) -> int:
        return max(a.shape[-2] for a in self.lora_a if a is not None)  # [(E,) r, in]

    def set_lora_args(self) -> tuple[Any, Any]:
        """`(lora_a, lora_b)` as a layer's `set_lora` takes them."""
        if len(self.lora_a) == 1:
            return self.lora_a[0], self.lora_b[0]
        return list(self.lora_a), list(self.lora_b)


@dataclasses.dataclass(frozen=True, eq=False)
class TrainableTokens:
    """A vocab layer's trainable tokens (PEFT `trainable_token_indices`): the adapter's own
    rows `[n, D]` (absolute, not deltas) for token ids `token_ids` (n of them).

    Example:
        >>> t = TrainableTokens("model.embed_tokens", (3, 7), np.zeros((2, 16)))
        >>> t.rows.shape
        (2, 16)
    """

    module_name: str
    token_ids: tuple[int, ...]
    rows: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A loaded adapter: id, name and its per-LoRA-layer weights (host numpy, f32).

    Example:
        >>> adapter = load_peft_adapter("adapters/sql", model, cfg, adapter_id=1)  # doctest: +SKIP
        >>> adapter.get_lora("model.layers.0.self_attn.qkv_proj").lora_a[0].shape  # doctest: +SKIP
        (8, 64)
    """

    id: int
    name: str
    rank: int
    modules: Mapping[str, ModuleLoRA]
    source: str = ""
    invocation_tokens: tuple[int, ...] | None = None
    """An activated LoRA's (aLoRA's) invocation sequence, else None: its requests use it
    only from the sequence's last occurrence in the prompt on (`lora_jax.serving.alora`)."""
    trainable_tokens: Mapping[str, TrainableTokens] = dataclasses.field(default_factory=dict)
    """Per vocab LoRA layer (the embedding; an untied lm_head), the adapter's own rows of
    some token ids (PEFT `trainable_token_indices`); a tied lm_head reads the embedding's."""

    def get_lora(self, module: str) -> ModuleLoRA | None:
        return self.modules.get(module)
