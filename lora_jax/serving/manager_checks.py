"""`LoRAModelManager`'s checks that an adapter or request is the one registered under its
id (`_check_same`, `_check_request`), that an adapter's modules are the model's LoRA layers
(`_check_modules`), and the checks of a whole call before it changes anything: the adapters
of `add_adapters` (`_check_adds`) and the requests of a worker step (`_distinct`).

Every comparison of two adapters is this module's `_same_adapter` (tests count them: a
step's host cost)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lora_jax.serving.manager_caches import _peek
from lora_jax.serving.manager_request import (
    LoRARequest,
    _check_id,
    _label,
    _names_another,
    _same_adapter,
)
from lora_jax.serving.peft import LoRAAdapter


class _ChecksMixin:
    """The adapter and request checks of `LoRAModelManager` (lora_jax.serving.manager)."""

    # -- checks: is it the adapter registered under its id? -------------------------------
    def _check_same(self, adapter: LoRAAdapter, what: str) -> None:
        """The registered adapter under ``adapter.id`` must be ``adapter`` (or the same one
        loaded again: equal name, source and weights, vLLM's "already there"): another one
        would get the registered one's weights."""
        held = _peek(self._registered_adapters, adapter.id)
        if held is adapter or _same_adapter(held, adapter):
            return
        raise ValueError(
            f"{what}: id {adapter.id} is already adapter {held.name!r} ({held.source}); "
            f"{adapter.name!r} ({adapter.source}) is another adapter and needs an id of its own "
            "(load_peft_adapter(adapter_id=...), or the manager's load_adapters)"
        )

    def _check_request(self, req: LoRARequest, what: str) -> None:
        """A `LoRARequest` for a registered id must name the adapter held under it: the
        same `lora_name` and, when the request gives a `lora_path` and the adapter was
        loaded from a directory, the same directory (by real path: another spelling of it
        matches). An adapter made from tensors has no directory: its name decides."""
        held = _peek(self._registered_adapters, req.lora_int_id)
        if not _names_another(req, held):
            return
        raise ValueError(
            f"{what}: id {req.lora_int_id} is already adapter {held.name!r} ({held.source}); "
            f"request {req.lora_name!r} ({req.lora_path or 'no path'}) names another adapter, "
            "which needs an id of its own (a new lora_int_id; the manager's load_adapters "
            "never reuses an id)"
        )

    def _check_modules(self, adapter: LoRAAdapter) -> None:
        unknown = [
            m for m in (*adapter.modules, *adapter.trainable_tokens) if m not in self.modules
        ]
        if unknown:
            raise ValueError(
                f"adapter {adapter.name!r} ({adapter.source}) has modules {unknown[:4]} that are "
                f"not LoRA layers of this model"
            )

    def _check_adds(
        self, adapters: Sequence[LoRAAdapter], activate: bool, what: str
    ) -> tuple[set[int], dict]:
        """Every check `add_adapter` (and `activate_adapter`) makes, for all ``adapters``
        before any is added. Returns the ids validated for every layer, and the slot plans
        of those to activate by id (dropped when more than the slots: held at once they
        could take much memory, and activation then prepares them again)."""
        seen: dict[int, LoRAAdapter] = {}
        for adapter in adapters:
            if not isinstance(adapter, LoRAAdapter):
                raise ValueError(f"{what}: expected LoRAAdapters, got a {type(adapter).__name__}")
            _check_id(adapter.id, f"{what}: adapter {adapter.name!r}'s id")
            prev = seen.setdefault(adapter.id, adapter)
            if prev is not adapter and not _same_adapter(prev, adapter):
                raise ValueError(
                    f"{what}: adapters {prev.name!r} and {adapter.name!r} both have id "
                    f"{adapter.id}; each adapter needs an id of its own"
                )
            if adapter.id in self._registered_adapters:
                self._check_same(adapter, what)
            else:
                self._check_modules(adapter)
        self._check_room(adapters, activate, what)
        reg = self._registered_adapters
        # Registering evicts (only the LRU manager gets here): then any adapter of the call
        # may be evicted and registered again, each with an eviction, so all are checked.
        evicts = sum(aid not in reg for aid in seen) > self.capacity - len(reg)
        writes = [aid for aid in seen if activate and aid not in self._active_adapters]
        keep = len(writes) <= self.lora_slots
        checked, plans = set(), {}
        for aid, adapter in seen.items():
            if evicts or aid in writes:
                held = _peek(reg, aid) if aid in reg else adapter
                plan = self._plan_slot(0, held)
                checked.add(aid)
                if keep and aid in writes:
                    plans[aid] = plan
        return checked, plans

    def _distinct(self, requests) -> dict[int, Any]:
        reqs: dict[int, Any] = {}
        same: set[tuple[int, int]] = set()
        for req in requests:
            if req is None:
                continue
            if isinstance(req, LoRAAdapter | LoRARequest):
                aid = req.id if isinstance(req, LoRAAdapter) else req.lora_int_id
                label = req.name if isinstance(req, LoRAAdapter) else req.lora_name
                _check_id(aid, f"set_active_adapters: request {label!r}'s id")
            elif isinstance(req, bool) or not isinstance(req, int | np.integer):
                raise ValueError(
                    f"set_active_adapters: request {req!r} is not an adapter id (an int), a "
                    "LoRARequest, a LoRAAdapter or None"
                )
            elif req <= 0:  # a bare id of 0 or below: no adapter, as in vLLM
                continue
            else:
                aid = req
            prev = reqs.setdefault(int(aid), req)
            if isinstance(prev, int | np.integer) and not isinstance(req, int | np.integer):
                # the request or adapter stands for the id: it is checked against the
                # registered adapter, and loads when none is
                prev = reqs[int(aid)] = req
            pair = (id(prev), id(req))
            if prev is req or pair in same:
                continue
            if isinstance(prev, LoRAAdapter) and isinstance(req, LoRAAdapter):
                another = not _same_adapter(prev, req)
            elif isinstance(prev, LoRARequest) and not isinstance(req, int | np.integer):
                another = _names_another(prev, req)
            elif isinstance(req, LoRARequest) and not isinstance(prev, int | np.integer):
                another = _names_another(req, prev)
            else:  # a bare id names whichever adapter has it
                another = False
            if another:
                raise ValueError(
                    f"set_active_adapters: adapters {_label(prev)} and {_label(req)} are both "
                    f"requested under id {aid}; each adapter needs an id of its own"
                )
            same.add(pair)  # compared once per pair of objects in a call
        if len(reqs) > self.lora_slots:
            raise RuntimeError(
                f"Number of requested adapters ({len(reqs)}) is greater than the number of "
                f"device slots ({self.lora_slots})"
            )
        return reqs
