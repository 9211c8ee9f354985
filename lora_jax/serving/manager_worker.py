"""`LoRAModelManager`'s worker step (vLLM's `set_active_adapters`: make exactly the
requested adapters usable, loading and checking all of them before anything changes) and
the slot of each request or token of a batch (`token_mapping`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from lora_jax.serving.alora import invocation_start
from lora_jax.serving.manager_caches import _keys, _peek
from lora_jax.serving.manager_request import LoRARequest, _check_id
from lora_jax.serving.peft import LoRAAdapter


class _WorkerMixin:
    """The per-step requests of `LoRAModelManager` (lora_jax.serving.manager); it dedups
    and checks them with the manager's `_distinct`, `_check_same` and `_check_request`."""

    def token_mapping(
        self,
        request_adapter_ids: Sequence[int | LoRARequest | LoRAAdapter | None],
        tokens_per_request: Sequence[int] | int | None = None,
    ) -> np.ndarray:
        """Slot per request (or per token with `tokens_per_request`), int32; `None`, 0 or
        negative ids mean "no adapter" (-1). Every other id must be active; a `LoRARequest`
        or `LoRAAdapter` stands for its id, as in `set_active_adapters`, and must name the
        adapter registered under it (`ValueError` otherwise).

        An activated LoRA (`LoRAAdapter.invocation_tokens`) acts only from its invocation in
        each prompt on: its requests are refused here (a slot alone would serve it from the
        first token) and mapped by `adapter_starts`.

        Example:
            >>> mgr.token_mapping([3, None, 3])  # doctest: +SKIP
            array([ 1, -1,  1], dtype=int32)
        """
        out = self._request_slots(request_adapter_ids, "token_mapping")
        for i, slot in enumerate(out):
            adapter = self.adapter_in_slot(int(slot)) if slot >= 0 else None
            if adapter is not None and adapter.invocation_tokens is not None:
                raise ValueError(
                    f"token_mapping: request {i} uses adapter {adapter.id} ({adapter.name!r}), "
                    "an activated LoRA (alora_invocation_tokens), which acts only from its "
                    "invocation in the prompt on; map such requests with adapter_starts("
                    "request_adapter_ids, prompts) and pass its starts to generate"
                )
        if tokens_per_request is None:
            return out
        counts = np.asarray(tokens_per_request)
        if counts.ndim > 1 or (counts.ndim == 1 and counts.shape != out.shape):
            raise ValueError(
                f"token_mapping: tokens_per_request has shape {counts.shape}; expected one count "
                f"per request ({len(out)}) or one for all"
            )
        if counts.size and (not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any()):
            raise ValueError(
                f"token_mapping: tokens_per_request must be counts >= 0, got {tokens_per_request!r}"
            )
        counts = np.broadcast_to(counts.astype(np.int64), out.shape)
        return np.repeat(out, counts).astype(np.int32)

    def _request_slots(self, request_adapter_ids, what: str) -> np.ndarray:
        """Each request's slot (int32; -1 for no adapter), every request checked."""
        self._check_model(what)
        slots, checked = [], set()  # requests found to name the registered adapter
        for i, req in enumerate(request_adapter_ids):
            aid = req
            if isinstance(req, LoRAAdapter | LoRARequest):  # by id, as set_active_adapters
                aid = req.id if isinstance(req, LoRAAdapter) else req.lora_int_id
                _check_id(aid, f"{what}: request {i}'s adapter id")
                # compared once a call: an adapter object by identity (its weights are
                # compared), a request by value (its path is resolved)
                key = id(req) if isinstance(req, LoRAAdapter) else req
                if aid in self._registered_adapters and key not in checked:
                    if isinstance(req, LoRAAdapter):
                        self._check_same(req, what)
                    else:
                        self._check_request(req, what)
                    checked.add(key)
            elif isinstance(req, bool | np.bool_) or not isinstance(req, int | np.integer | None):
                # a scalar by value, anything else by type: its repr may be a whole array
                scalar = isinstance(req, bool | np.bool_ | float | np.floating | str)
                got = repr(req) if scalar else f"a {type(req).__name__}"
                raise ValueError(
                    f"{what}: request {i}'s adapter id must be an int or None (or a "
                    f"LoRARequest / LoRAAdapter), got {got}"
                )
            if aid is None or aid <= 0:
                slots.append(-1)
                continue
            slot = self.slot_of(aid)
            if slot is None:
                state = (
                    "registered but not active" if aid in self._registered_adapters else "unknown"
                )
                hint = (
                    "; activate it first (activate_adapter / set_active_adapters)"
                    if aid in self._registered_adapters
                    else ""
                )
                raise ValueError(
                    f"{what}: request {i} uses adapter {aid!r}, which is {state}; "
                    f"active: {[x for x in self.lora_index_to_id if x is not None]}{hint}"
                )
            slots.append(slot)
        return np.asarray(slots, np.int32)

    def adapter_starts(
        self,
        request_adapter_ids: Sequence[int | LoRARequest | LoRAAdapter | None],
        prompts: Sequence[Sequence[int]],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Slot and adapter start per request (int32 each), for `generate(model, prompts,
        slots, adapter_starts=starts)`: an activated LoRA (`LoRAAdapter.invocation_tokens`)
        acts from the last occurrence of its invocation sequence in the prompt on, and a
        request whose prompt lacks it gets slot -1 (the base model throughout, as PEFT
        serves it); every other request starts at 0 (`lora_jax.serving.alora`).

        Example:
            >>> slots, starts = mgr.adapter_starts([7, None], [[1, 5, 9, 2], [3]])  # doctest: +SKIP
            >>> starts.tolist()  # adapter 7 is invoked by [5, 9]  # doctest: +SKIP
            [1, 0]
        """
        slots = self._request_slots(request_adapter_ids, "adapter_starts")
        if len(prompts) != len(slots):
            raise ValueError(
                f"adapter_starts: {len(slots)} requests but {len(prompts)} prompts; give one "
                "prompt per request"
            )
        starts = np.zeros(len(slots), np.int32)
        for i, (slot, prompt) in enumerate(zip(slots, prompts)):
            p = np.asarray(prompt)
            if p.ndim != 1 or (p.size and not np.issubdtype(p.dtype, np.integer)):
                raise ValueError(f"adapter_starts: prompt {i} must be a sequence of token ids")
            if slot < 0:
                continue
            adapter = _peek(self._registered_adapters, self.lora_index_to_id[slot])
            if adapter.invocation_tokens is None:
                continue
            start = invocation_start(p, adapter.invocation_tokens)
            if start is None:
                slots[i] = -1
            else:
                starts[i] = start
        return slots, starts

    def set_active_adapters(self, requests: Iterable[int | LoRAAdapter | LoRARequest | None]):
        """Worker-style: make exactly the requested adapters usable in the next step.

        The plain manager removes every adapter that is not requested, then adds and
        activates the rest. More distinct requests than slots raise `RuntimeError`.
        """
        self._check_model("set_active_adapters")
        reqs = self._distinct(requests)
        new, plans = self._validate_requests(reqs)
        staying = [a for a in self.lora_index_to_id if a is not None and a in reqs]
        merged = self._merged_slots() - {self.slot_of(a) for a in staying}
        usable = self.lora_slots - len(merged) - len(self._reserved)
        for aid in list(_keys(self._registered_adapters)):
            if aid not in reqs:
                self._check_not_in_merged_slot(aid)  # it would be removed
        if len(reqs) > usable:
            raise RuntimeError(
                f"set_active_adapters: {len(reqs)} requested adapters do not fit the {usable} "
                f"device slots that are neither merged nor reserved (merged: "
                f"{sorted(self._merged_slots())}, reserved: {sorted(self._reserved)})"
            )
        for aid in list(_keys(self._registered_adapters)):
            if aid not in reqs:
                self.remove_adapter(aid)
        for aid in reqs:
            if aid not in self._registered_adapters:
                self.add_adapter(new[aid])
            self._activate(aid, plans.get(aid))

    def _validate_requests(self, reqs: Mapping[int, Any]) -> tuple[dict[int, LoRAAdapter], dict]:
        """Loads the requested adapters that are not registered and checks every one that
        is not active against every layer, before anything changes: a bad request costs
        no other adapter its place. Returns the newly loaded ones by id, and every checked
        one's slot plan by id (activation writes it without validating again)."""
        new, plans = {}, {}
        for aid, req in reqs.items():
            if isinstance(req, LoRAAdapter) and aid in self._registered_adapters:
                self._check_same(req, "set_active_adapters")
            if isinstance(req, LoRARequest) and aid in self._registered_adapters:
                self._check_request(req, "set_active_adapters")
            if aid in self._active_adapters:
                continue
            if aid in self._registered_adapters:
                adapter = _peek(self._registered_adapters, aid)
            else:
                adapter = new[aid] = self._load(req)
                if adapter.id != aid:
                    raise ValueError(
                        f"set_active_adapters: request {aid} loaded an adapter with id {adapter.id}"
                    )
            plans[aid] = self._plan_slot(0, adapter)
        return new, plans
