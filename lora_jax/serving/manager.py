"""Adapter managers: a host-side cache of loaded adapters and the device slots they use.

Semantics follow vLLM's `LoRAModelManager` / `LRUCacheLoRAModelManager` (and the worker
managers' `set_active_adapters`):

* `add_adapter` puts an adapter in the CPU cache (`max_cpu_loras`); it does not activate.
* `activate_adapter` writes it into the first free device slot (`max_loras`). The LRU
  manager evicts the least recently used unpinned active adapter when the slots are
  full; the plain manager raises `ValueError`. Every add/activate of a known adapter
  only touches it (returns False).
* `pin_adapter` (LRU) keeps an adapter in both caches and activates it; when all slots
  are pinned, activating another raises `RuntimeError`.

A slot write validates the adapter for every layer first (host side), then writes every
layer's slot in one jitted, donated update; on a bad adapter nothing changes. A worker
step (`set_active_adapters`) loads and checks every requested adapter, and that they fit,
before it evicts, touches or writes anything. A slot that `merge_adapter` folded into the
kernels is never written (nor chosen, free or as a victim) until `unmerge_adapter`. Slot
choices are deterministic, so every process of a multi-host run makes the same ones.

Ids: `load_adapters` numbers adapters past every id the manager has held, so an id that a
removal or an eviction freed is never given to another adapter (a client still asking for
the old one would get the new one's weights). A `LoRARequest` whose id is registered must
name that adapter (`ValueError` otherwise), as an adapter object must.

Training beside serving (`lora_jax.serving.training`): `reserve_slot(s)` keeps the
manager out of slot s (never activated into, written or counted free) until
`release_slot(s)`; `init_lora_slot` refuses a slot in which a live manager of the model
holds an adapter.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from lora_jax.config import LoRAConfig
from lora_jax.layers import LoRAContext, find_lora_context
from lora_jax.serving.lru import LRUCache
from lora_jax.serving.merge import layer_merged_slot
from lora_jax.serving.peft import WEIGHTS_NAME, LoRAAdapter, load_peft_adapter
from lora_jax.serving.slot_writes import layer_variables, write_slot_updates
from lora_jax.serving.wrap import layer_packed_modules, lora_layers


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
        _check_id(self.lora_int_id, f"LoRARequest {self.lora_name!r}: lora_int_id")


def _check_id(aid, what: str) -> None:
    """An adapter id is an int >= 1 (vLLM: 0 and below mean "no adapter")."""
    if isinstance(aid, bool) or not isinstance(aid, int | np.integer) or aid < 1:
        raise ValueError(f"{what} must be an int >= 1 (0 / None mean no adapter), got {aid!r}")


# Every live manager, for `init_lora_slot` to find a model's. Weak: a manager nothing
# else holds drops out, and the registry keeps neither managers nor models alive.
_MANAGERS: weakref.WeakSet[LoRAModelManager] = weakref.WeakSet()


def managers_of(model: nnx.Module) -> list[LoRAModelManager]:
    """The live managers that serve ``model``'s LoRA layers (any of them: a manager of the
    whole model counts for its backbone too).

    Example:
        >>> [m.lora_index_to_id for m in managers_of(model)]  # doctest: +SKIP
        [[1, None, 2]]
    """
    layers = {id(layer) for layer in lora_layers(model).values()}
    return [m for m in list(_MANAGERS) if any(id(x) in layers for x in m.modules.values())]


class LoRAModelManager:
    """Adapters of a wrapped model: a CPU registry (`max_cpu_loras`) and device slots.

    This plain manager never evicts: adding beyond `capacity` or activating with every
    slot taken raises. Use `LRUCacheLoRAModelManager` for serving. A slot trained
    meanwhile (`init_lora_slot`) is reserved first (`reserve_slot`), so that no
    activation writes over it.

    Example:
        >>> wrap_model(model, cfg)  # doctest: +SKIP
        >>> mgr = LoRAModelManager(model, cfg)  # doctest: +SKIP
        >>> mgr.add_adapter(adapter), mgr.activate_adapter(adapter.id)  # doctest: +SKIP
        (True, True)
        >>> mgr.token_mapping([adapter.id, None], tokens_per_request=[3, 2])  # doctest: +SKIP
        array([ 0,  0,  0, -1, -1], dtype=int32)
        >>> mgr.reserve_slot(1)  # train in slot 1; the manager keeps out of it  # doctest: +SKIP
        True
    """

    def __init__(self, model: nnx.Module, lora_config: LoRAConfig | None = None):
        self.model = model
        self.modules = lora_layers(model)
        if not self.modules:
            raise ValueError(
                "LoRAModelManager: the model has no LoRA layers; call wrap_model first"
            )
        if lora_config is None:
            lora_config = next(iter(self.modules.values())).lora_config
        self.lora_config = lora_config
        for name, layer in self.modules.items():
            cfg = layer.lora_config
            if (cfg.max_loras, cfg.max_lora_rank) != (
                lora_config.max_loras,
                lora_config.max_lora_rank,
            ):
                raise ValueError(
                    f"LoRAModelManager: layer {name!r} was built with max_loras={cfg.max_loras}, "
                    f"max_lora_rank={cfg.max_lora_rank}; the manager's config has "
                    f"{lora_config.max_loras}, {lora_config.max_lora_rank}"
                )
        self.context: LoRAContext | None = find_lora_context(model)
        self.lora_index_to_id: list[int | None] = [None] * self.lora_slots
        self._reserved: set[int] = set()  # slots kept for training (reserve_slot)
        self._id_mark = 0  # the largest id ever registered: load_adapters numbers past it
        self._registered_adapters = self._make_registry()
        self._active_adapters = self._make_active()
        _MANAGERS.add(self)

    # -- caches (overridden by the LRU manager) -------------------------------------------
    def _make_registry(self):
        return {}

    def _make_active(self):
        return {}

    def _register(self, adapter: LoRAAdapter, *, checked: bool = False) -> None:
        """``checked``: the caller has validated ``adapter`` for every layer already."""
        if len(self._registered_adapters) >= self.capacity:
            raise RuntimeError(f"No free adapter slots: the CPU cache holds {self.capacity}")
        self._registered_adapters[adapter.id] = adapter
        self._id_mark = max(self._id_mark, int(adapter.id))

    # -- sizes ----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """CPU cache size (`max_cpu_loras`)."""
        return self.lora_config.max_cpu_loras

    @property
    def lora_slots(self) -> int:
        """Device slots (`max_loras`)."""
        return self.lora_config.max_loras

    def __len__(self) -> int:
        return len(self._registered_adapters)

    @property
    def supported_lora_modules(self) -> list[str]:
        """Checkpoint leaf names the model's LoRA layers accept (packed members expanded)."""
        names = {p for n, layer in self.modules.items() for p in layer_packed_modules(n, layer)}
        return sorted(names)

    # -- queries --------------------------------------------------------------------------
    def list_adapters(self) -> dict[int, LoRAAdapter]:
        return dict(_items(self._registered_adapters))

    def get_adapter(self, adapter_id: int) -> LoRAAdapter | None:
        reg = self._registered_adapters
        return reg.get(adapter_id) if adapter_id in reg else None

    def slot_of(self, adapter_id: int) -> int | None:
        """The device slot of an active adapter, else None."""
        try:
            return self.lora_index_to_id.index(adapter_id)
        except ValueError:
            return None

    def token_mapping(
        self,
        request_adapter_ids: Sequence[int | LoRARequest | LoRAAdapter | None],
        tokens_per_request: Sequence[int] | int | None = None,
    ) -> np.ndarray:
        """Slot per request (or per token with `tokens_per_request`), int32; `None`, 0 or
        negative ids mean "no adapter" (-1). Every other id must be active; a `LoRARequest`
        or `LoRAAdapter` stands for its id, as in `set_active_adapters`, and must name the
        adapter registered under it (`ValueError` otherwise).

        Example:
            >>> mgr.token_mapping([3, None, 3])  # doctest: +SKIP
            array([ 1, -1,  1], dtype=int32)
        """
        slots, checked = [], set()  # requests found to name the registered adapter
        for i, req in enumerate(request_adapter_ids):
            aid = req
            if isinstance(req, LoRAAdapter | LoRARequest):  # by id, as set_active_adapters
                aid = req.id if isinstance(req, LoRAAdapter) else req.lora_int_id
                _check_id(aid, f"token_mapping: request {i}'s adapter id")
                # compared once a call: an adapter object by identity (its weights are
                # compared), a request by value (its path is resolved)
                key = id(req) if isinstance(req, LoRAAdapter) else req
                if aid in self._registered_adapters and key not in checked:
                    if isinstance(req, LoRAAdapter):
                        self._check_same(req, "token_mapping")
                    else:
                        self._check_request(req, "token_mapping")
                    checked.add(key)
            elif isinstance(req, bool | np.bool_) or not isinstance(req, int | np.integer | None):
                # a scalar by value, anything else by type: its repr may be a whole array
                scalar = isinstance(req, bool | np.bool_ | float | np.floating | str)
                got = repr(req) if scalar else f"a {type(req).__name__}"
                raise ValueError(
                    f"token_mapping: request {i}'s adapter id must be an int or None (or a "
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
                    f"token_mapping: request {i} uses adapter {aid!r}, which is {state}; "
                    f"active: {[x for x in self.lora_index_to_id if x is not None]}{hint}"
                )
            slots.append(slot)
        out = np.asarray(slots, np.int32)
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

    # -- lifecycle ------------------------------------------------------------------------
    def add_adapter(self, adapter: LoRAAdapter) -> bool:
        """Registers `adapter` in the CPU cache; False (and a touch) when already there (the
        same object, or one of the same name and source). Another adapter under a taken id
        is a `ValueError`: its requests would get the registered one's weights."""
        if not isinstance(adapter, LoRAAdapter):
            raise ValueError(f"add_adapter: expected a LoRAAdapter, got {type(adapter).__name__}")
        _check_id(adapter.id, f"add_adapter: adapter {adapter.name!r}'s id")
        if adapter.id in self._registered_adapters:
            self._check_same(adapter, "add_adapter")
            self._touch_registered(adapter.id)
            return False
        self._check_modules(adapter)
        self._register(adapter)
        return True

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

    def add_adapters(
        self, adapters: Iterable[LoRAAdapter], *, activate: bool = False, progress: bool = True
    ) -> list[bool]:
        """`add_adapter` (and optionally `activate_adapter`) for many, with a progress bar.

        All or nothing: every adapter is checked first (ids, modules, and for every layer
        each one to activate, or every one when registering them evicts others), then they
        are added.
        """
        adapters = list(adapters)
        checked, plans = self._check_adds(adapters, activate, "add_adapters")
        added = []
        for adapter in _progress(adapters, "adding adapters", progress):
            new = adapter.id not in self._registered_adapters
            if new:
                self._register(adapter, checked=adapter.id in checked)
            else:
                self._touch_registered(adapter.id)
            added.append(new)
            if activate:
                self._activate(adapter.id, plans.get(adapter.id))
        return added

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

    def load_adapters(
        self,
        paths: Mapping[str, str | os.PathLike] | Sequence[str | os.PathLike],
        *,
        first_id: int | None = None,
        activate: bool = False,
        progress: bool = True,
    ) -> list[LoRAAdapter]:
        """Loads PEFT directories (ids `first_id`, `first_id + 1`, ...) and adds them. An
        id already registered is a `ValueError` before anything is added. By default the
        ids start past the largest id this manager has ever held, so an id freed by
        `remove_adapter` or an eviction never names another adapter (its old requests
        would get the new one's weights); an explicit `first_id` may reuse a freed id.

        Example:
            >>> mgr.load_adapters({"sql": "ad/sql", "chat": "ad/chat"})  # doctest: +SKIP
        """
        items = list(paths.items()) if isinstance(paths, Mapping) else [(None, p) for p in paths]
        if first_id is None:
            first_id = self._id_mark + 1
        taken = [
            i for i in range(first_id, first_id + len(items)) if i in self._registered_adapters
        ]
        if taken:
            raise ValueError(
                f"load_adapters: ids {taken} (from first_id={first_id}) are already registered; "
                "pass another first_id, or leave it out to continue after the largest id"
            )
        loaded = []
        for i, (name, path) in enumerate(_progress(items, "loading adapters", progress)):
            adapter = load_peft_adapter(
                path, self.model, self.lora_config, adapter_id=first_id + i, name=name
            )
            loaded.append(adapter)
        self.add_adapters(loaded, activate=activate, progress=False)
        return loaded

    def _check_room(self, adapters: Sequence[LoRAAdapter], activate: bool, what: str) -> None:
        """Raises before anything changes when ``adapters`` (and, with ``activate``, their
        slots) do not fit: this manager never evicts."""
        new = {a.id for a in adapters if a.id not in self._registered_adapters}
        room = self.capacity - len(self._registered_adapters)
        if len(new) > room:
            raise RuntimeError(
                f"{what}: {len(new)} new adapters do not fit the CPU cache (max_cpu_loras="
                f"{self.capacity}, {room} free); nothing was added"
            )
        if activate:
            needed = len({a.id for a in adapters if a.id not in self._active_adapters})
            free = len(self._free_slots())
            if needed > free:
                raise RuntimeError(
                    f"{what}: {needed} adapters to activate but {free} device slots are free"
                    f"{self._unusable_note()}; nothing was added"
                )

    def activate_adapter(self, adapter_id: int) -> bool:
        """Writes a registered adapter into the first free slot; False if already active.

        The adapter is validated for every layer before any slot (or eviction) changes.
        """
        return self._activate(adapter_id, None)

    def _activate(self, adapter_id: int, plan) -> bool:
        """`activate_adapter`, with the adapter's `_plan_slot` result when the caller has
        already validated it (the prepared arrays do not depend on the slot)."""
        if adapter_id in self._active_adapters:
            self._touch_active(adapter_id)
            return False
        if adapter_id not in self._registered_adapters:
            raise ValueError(f"activate_adapter: adapter {adapter_id!r} is not registered")
        slot, victim = self._choose_slot()
        adapter = _peek(self._registered_adapters, adapter_id)  # touched once written
        if plan is None:
            plan = self._plan_slot(slot, adapter)
        if victim is not None:
            self.deactivate_adapter(victim)
        self._commit(slot, plan)
        self._touch_registered(adapter_id)
        self._active_put(adapter_id)
        self.lora_index_to_id[slot] = adapter_id
        return True

    def _merged_slots(self) -> set[int]:
        """Slots `merge_adapter` folded into the kernels: never written until unmerged."""
        return {s for s in (layer_merged_slot(la) for la in self.modules.values()) if s is not None}

    def _free_slots(self) -> list[int]:
        skip = self._merged_slots() | self._reserved
        return [i for i, x in enumerate(self.lora_index_to_id) if x is None and i not in skip]

    def _unusable_note(self) -> str:
        """The slots no adapter may take now, for an error saying the slots are full."""
        notes = []
        merged = sorted(self._merged_slots())
        if merged:
            notes.append(f"slots {merged} are merged: unmerge_adapter to reuse them")
        if self._reserved:
            notes.append(
                f"slots {sorted(self._reserved)} are reserved for training: release_slot "
                "to reuse them"
            )
        return f" ({'; '.join(notes)})" if notes else ""

    def _choose_slot(self) -> tuple[int, int | None]:
        """(slot to write, active adapter to evict first or None)."""
        free = self._free_slots()
        if not free:
            raise ValueError(f"No free lora slots{self._unusable_note()}")
        return free[0], None

    # -- slots kept for training ----------------------------------------------------------
    @property
    def reserved_slots(self) -> list[int]:
        """Slots `reserve_slot` keeps for training, sorted."""
        return sorted(self._reserved)

    def reserve_slot(self, slot: int) -> bool:
        """Keeps the manager out of ``slot`` (never activated into, written, or counted
        free) until `release_slot`, so that an adapter can be trained there
        (`init_lora_slot`, `train_only_slots`) while the other slots serve. A slot holding
        an adapter is refused (`ValueError` naming it): deactivate it first. False when
        ``slot`` is reserved already.

        Example:
            >>> slot = mgr.lora_index_to_id.index(None)  # doctest: +SKIP
            >>> mgr.reserve_slot(slot)  # doctest: +SKIP
            True
            >>> init_lora_slot(model, slot, 8)  # then train, export, release  # doctest: +SKIP
        """
        slot = self._check_slot(slot, "reserve_slot")
        if slot in self._reserved:
            return False
        held = self.lora_index_to_id[slot]
        if held is not None:
            free = [i for i in self._free_slots() if i != slot]
            raise ValueError(
                f"reserve_slot: slot {slot} holds adapter {held}; deactivate_adapter({held}) "
                f"first, or reserve another slot (free: {free})"
            )
        self._check_not_merged(slot)
        self._reserved.add(slot)
        return True

    def release_slot(self, slot: int) -> bool:
        """Gives a reserved slot back to the manager, which may then write over it (its
        weights stay until then); False when ``slot`` was not reserved."""
        slot = self._check_slot(slot, "release_slot")
        if slot not in self._reserved:
            return False
        self._reserved.discard(slot)
        return True

    def _check_slot(self, slot, what: str) -> int:
        if isinstance(slot, bool | np.bool_) or not isinstance(slot, int | np.integer):
            raise ValueError(f"{what}: slot must be an int, got {slot!r}")
        if not 0 <= int(slot) < self.lora_slots:
            raise ValueError(f"{what}: slot {slot!r} outside [0, {self.lora_slots})")
        return int(slot)

    def _check_not_in_merged_slot(self, adapter_id: int) -> None:
        slot = self.slot_of(adapter_id)
        if slot is not None and slot in self._merged_slots():
            raise ValueError(
                f"adapter {adapter_id} is in slot {slot}, which merge_adapter folded into the "
                "model's kernels: unmerge_adapter before deactivating or removing it"
            )

    def deactivate_adapter(self, adapter_id: int) -> bool:
        """Frees the adapter's slot (its weights stay until overwritten); False if inactive.
        An adapter in a merged slot stays until `unmerge_adapter` (ValueError)."""
        if adapter_id not in self._active_adapters:
            return False
        self._check_not_in_merged_slot(adapter_id)
        self._active_adapters.pop(adapter_id)
        self._free_slot(adapter_id)
        return True

    def remove_adapter(self, adapter_id: int) -> bool:
        """Deactivates and unregisters; False when unknown. Removes pinned ones too."""
        self.deactivate_adapter(adapter_id)
        if adapter_id not in self._registered_adapters:
            return False
        self._registered_adapters.pop(adapter_id)
        return True

    def remove_all_adapters(self) -> None:
        """Removes every adapter; one in a merged slot (`ValueError`) stops the call before
        any is removed."""
        for aid in _keys(self._registered_adapters):
            self._check_not_in_merged_slot(aid)
        for aid in _keys(self._registered_adapters):
            self.remove_adapter(aid)

    def pin_adapter(self, adapter_id: int) -> bool:
        raise NotImplementedError("pinning needs LRUCacheLoRAModelManager")

    def set_active_adapters(self, requests: Iterable[int | LoRAAdapter | LoRARequest | None]):
        """Worker-style: make exactly the requested adapters usable in the next step.

        The plain manager removes every adapter that is not requested, then adds and
        activates the rest. More distinct requests than slots raise `RuntimeError`.
        """
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

    # -- slot writes ----------------------------------------------------------------------
    def write_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Writes `adapter` (None = zeros) into `slot` of every LoRA layer, all or nothing.

        Every layer validates first; then layers with `prepare_lora`/`slot_updates` are
        written in one jitted, donated update. Layers offering only `set_lora` are
        written one by one and rolled back if any of them refuses.

        Example:
            >>> mgr.deactivate_adapter(mgr.lora_index_to_id[0])  # doctest: +SKIP
            >>> mgr.write_slot(0, None)  # zero the freed slot 0 everywhere  # doctest: +SKIP
        """
        slot = self._check_slot(slot, "write_slot")
        self._check_not_merged(slot)
        held = self.lora_index_to_id[slot]
        if held is not None:
            raise ValueError(
                f"write_slot: slot {slot} holds active adapter {held}, whose requests it would "
                "serve with other weights; deactivate_adapter first (or activate_adapter)"
            )
        if slot in self._reserved:
            raise ValueError(
                f"write_slot: slot {slot} is reserved for training (reserve_slot); "
                "release_slot first"
            )
        self._commit(slot, self._plan_slot(slot, adapter))

    def _plan_slot(self, slot: int, adapter: LoRAAdapter | None):
        """Validates `adapter` for every layer; returns (batched updates, per-layer writes)."""
        if adapter is not None:
            self._check_modules(adapter)
        updates, legacy = [], []
        for name, layer in self.modules.items():
            m = adapter.get_lora(name) if adapter is not None else None
            if hasattr(layer, "prepare_lora") and hasattr(layer, "slot_updates"):
                if m is None:
                    updates += layer.slot_updates(None)
                    continue
                try:
                    prepared = layer.prepare_lora(slot, *m.set_lora_args())
                except ValueError as e:
                    raise ValueError(f"adapter {adapter.name!r} ({adapter.source}): {e}") from e
                updates += layer.slot_updates(prepared)
            else:
                legacy.append((layer, m))
        return updates, legacy, adapter

    def _commit(self, slot: int, plan) -> None:
        updates, legacy, adapter = plan
        snapshot = [(v, v.get_value()) for layer, _ in legacy for v in layer_variables(layer)]
        try:
            for layer, m in legacy:
                if m is None:
                    layer.reset_lora(slot)
                else:
                    layer.set_lora(slot, *m.set_lora_args())
        except ValueError as e:
            for var, value in snapshot:
                var.set_value(value)
            name = adapter.name if adapter is not None else None
            raise ValueError(f"adapter {name!r}: {e}") from e
        write_slot_updates(slot, updates)

    # -- helpers --------------------------------------------------------------------------
    def _check_not_merged(self, slot: int) -> None:
        """A slot that `merge_adapter` folded into the kernels keeps its adapter until
        `unmerge_adapter`: rewriting it would leave kernels and slots disagreeing."""
        for layer in self.modules.values():
            if layer_merged_slot(layer) == slot:
                raise ValueError(
                    f"slot {slot} is merged into the model's kernels (merge_adapter); "
                    "unmerge_adapter before writing it"
                )

    def _check_modules(self, adapter: LoRAAdapter) -> None:
        unknown = [m for m in adapter.modules if m not in self.modules]
        if unknown:
            raise ValueError(
                f"adapter {adapter.name!r} ({adapter.source}) has modules {unknown[:4]} that are "
                f"not LoRA layers of this model"
            )

    def _touch_registered(self, adapter_id) -> None:
        pass

    def _active_put(self, adapter_id) -> None:
        self._active_adapters[adapter_id] = None

    def _touch_active(self, adapter_id) -> None:
        pass

    def _free_slot(self, adapter_id) -> None:
        slot = self.slot_of(adapter_id)
        if slot is not None:
            self.lora_index_to_id[slot] = None

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

    def _load(self, req) -> LoRAAdapter:
        if isinstance(req, LoRAAdapter):
            return req
        if isinstance(req, LoRARequest) and req.lora_path:
            return load_peft_adapter(
                req.lora_path,
                self.model,
                self.lora_config,
                adapter_id=req.lora_int_id,
                name=req.lora_name,
            )
        raise ValueError(
            f"adapter {req!r} is not registered and cannot be loaded (pass a LoRAAdapter or a "
            "LoRARequest with lora_path)"
        )


def _same_adapter(a: LoRAAdapter, b: LoRAAdapter) -> bool:
    """Equal name, source and weights (the same adapter loaded twice)."""
    if (a.name, a.source, sorted(a.modules)) != (b.name, b.source, sorted(b.modules)):
        return False
    for name, ma in a.modules.items():
        mb = b.modules[name]
        for xs, ys in ((ma.lora_a, mb.lora_a), (ma.lora_b, mb.lora_b)):
            if len(xs) != len(ys):
                return False
            for x, y in zip(xs, ys):
                if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
                    return False
    return True


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


def _peek(cache, key):
    """`cache[key]` without making it the most recently used."""
    return cache.cache[key] if isinstance(cache, LRUCache) else cache[key]


def _items(cache):
    return cache.cache.items() if isinstance(cache, LRUCache) else cache.items()


def _keys(cache):
    return list(cache.cache) if isinstance(cache, LRUCache) else list(cache)


def _progress(items: list, desc: str, enabled: bool):
    if not enabled or len(items) < 2:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="adapter")


def __getattr__(name: str):
    # `LRUCacheLoRAModelManager` lives in lru_manager.py (it subclasses the manager
    # above); it is reached from here too, where vLLM users look for it.
    if name == "LRUCacheLoRAModelManager":
        from lora_jax.serving.lru_manager import LRUCacheLoRAModelManager

        return LRUCacheLoRAModelManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
