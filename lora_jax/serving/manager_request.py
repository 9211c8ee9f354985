"""`LoRARequest` (vLLM's) and the checks that tell whether two adapters, or a request and
an adapter, are the same one: the adapter manager (`lora_jax.serving.manager`) refuses
another adapter under a registered id, whose requests would get the registered one's
weights."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from lora_jax.serving.peft import WEIGHTS_NAME, LoRAAdapter


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A request for an adapter by id, loadable from a PEFT directory (vLLM's LoRARequest).

    Example:
        >>> LoRARequest("sql", 1, "/adapters/sql").lora_int_id
        1
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        # The loader names an unnamed adapter after its directory, so an empty name would
        # match the adapter it loads on the first step only and be refused on every later one.
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest: lora_name must be a non-empty str (the adapter's name), "
                f"got {self.lora_name!r}"
            )
        _check_id(self.lora_int_id, f"LoRARequest {self.lora_name!r}: lora_int_id")


def _check_id(aid, what: str, note: str = "0 / None mean no adapter") -> None:
    """An adapter id is an int >= 1 (vLLM: 0 and below mean "no adapter")."""
    if isinstance(aid, bool) or not isinstance(aid, int | np.integer) or aid < 1:
        raise ValueError(f"{what} must be an int >= 1 ({note}), got {aid!r}")


def _same_adapter(a: LoRAAdapter, b: LoRAAdapter) -> bool:
    """Equal name, source and weights (the same adapter loaded twice)."""
    if (a.name, a.source, sorted(a.modules), a.invocation_tokens) != (
        b.name,
        b.source,
        sorted(b.modules),
        b.invocation_tokens,
    ):
        return False
    for name, ma in a.modules.items():
        mb = b.modules[name]
        if (ma.magnitude is None) != (mb.magnitude is None):
            return False
        for xs, ys in (
            (ma.lora_a, mb.lora_a),
            (ma.lora_b, mb.lora_b),
            (ma.magnitude or (), mb.magnitude or ()),
        ):
            if len(xs) != len(ys):
                return False
            for x, y in zip(xs, ys):
                if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
                    return False
    ta, tb = a.trainable_tokens, b.trainable_tokens
    return sorted(ta) == sorted(tb) and all(
        ta[n].token_ids == tb[n].token_ids and np.array_equal(ta[n].rows, tb[n].rows) for n in ta
    )


def _source_dir(adapter: LoRAAdapter) -> str | None:
    """The directory `load_peft_adapter` read ``adapter`` from, else None (made from
    tensors)."""
    head, tail = os.path.split(adapter.source)
    return head if head and tail == WEIGHTS_NAME else None


def _names_another(req: LoRARequest, other: LoRAAdapter | LoRARequest) -> bool:
    """Whether ``req`` names another adapter than ``other``: another name, or another
    directory (by real path) where both give one."""
    if isinstance(other, LoRARequest):
        name, where = other.lora_name, other.lora_path or None
    else:
        name, where = other.name, _source_dir(other)
    if req.lora_name != name:
        return True
    if not req.lora_path or where is None:
        return False
    return os.path.realpath(os.fspath(req.lora_path)) != os.path.realpath(os.fspath(where))


def _label(req: LoRAAdapter | LoRARequest) -> str:
    if isinstance(req, LoRAAdapter):
        return repr(req.name)
    return f"{req.lora_name!r} ({req.lora_path})" if req.lora_path else repr(req.lora_name)
