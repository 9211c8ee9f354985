"""`LRUCacheLoRAModelManager`: the adapter manager whose CPU cache and device slots evict
the least recently used unpinned adapter instead of raising (vLLM's
`LRUCacheLoRAModelManager`). The slot and cache logic it shares is `LoRAModelManager`'s
(`lora_jax.serving.manager`, which re-exports this class)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

from lora_jax.serving.lru import LRUCache
from lora_jax.serving.manager import LoRAModelManager, LoRARequest
from lora_jax.serving.manager_request import _check_id
from lora_jax.serving.peft import LoRAAdapter


class LRUCacheLoRAModelManager(LoRAModelManager):
    """`LoRAModelManager` whose CPU cache and device slots evict least recently used
    (unpinned) adapters instead of raising. Neither a merged slot's adapter nor a slot
    reserved for training (`reserve_slot`) is ever evicted or written.

    Example:
        >>> cfg = LoRAConfig(max_loras=2, max_cpu_loras=4)
        >>> mgr = LRUCacheLoRAModelManager(model, cfg)  # doctest: +SKIP
        >>> mgr.set_active_adapters([a1, a2, a1])  # doctest: +SKIP
        >>> mgr.lora_index_to_id  # doctest: +SKIP
        [1, 2]
    """

    # The caches call back through a weak reference: a manager nothing else holds is
    # freed at once (no cycle), so it no longer keeps `init_lora_slot` out of its slots.
    def _make_registry(self):
        me = weakref.ref(self)
        # an adapter in a merged slot is never the one evicted to make room
        return LRUCache(
            self.capacity,
            lambda key, _: me().deactivate_adapter(key),
            keep=lambda key: me().slot_of(key) in me()._merged_slots(),
        )

    def _make_active(self):
        me = weakref.ref(self)
        return LRUCache(self.lora_slots, lambda key, _: me()._free_slot(key))

    def _register(self, adapter: LoRAAdapter, *, checked: bool = False) -> None:
        if len(self._registered_adapters) >= self.capacity:
            self._check_cpu_room("add_adapter")
            if not checked:
                # Registering evicts the least recently used adapter: make sure this one
                # can be written at all first, so that a bad adapter costs no other adapter.
                self._plan_slot(0, adapter)
        self._registered_adapters.put(adapter.id, adapter)
        self._id_mark = max(self._id_mark, int(adapter.id))

    def _check_cpu_room(self, what: str) -> None:
        """Raises when no CPU cache entry may be evicted: each holds a pinned adapter or
        one in a merged slot (the cache's own error named only pinning)."""
        reg = self._registered_adapters
        if any(k not in reg.pinned and not reg.keep(k) for k in reg.cache):
            return
        pinned = sorted(reg.pinned)
        merged = sorted(k for k in reg.cache if k not in reg.pinned)
        raise RuntimeError(
            f"{what}: every CPU cache entry (max_cpu_loras={self.capacity}) holds a pinned "
            f"adapter {pinned} or one in a merged slot {merged}, and none may be evicted; "
            "unmerge_adapter to free a merged one, remove_adapter to drop a pinned one; "
            "nothing changed"
        )

    def _touch_registered(self, adapter_id) -> None:
        self._registered_adapters.touch(adapter_id)

    def _active_put(self, adapter_id) -> None:
        self._active_adapters.put(adapter_id, None)

    def _touch_active(self, adapter_id) -> None:
        self._active_adapters.touch(adapter_id)

    def _choose_slot(self) -> tuple[int, int | None]:
        free = self._free_slots()
        if free:
            return free[0], None
        victims = self._victims()
        if not victims:
            if self._merged_slots() or self._reserved:
                raise RuntimeError(
                    f"No slot to evict: the others are pinned{self._unusable_note()}"
                )
            raise RuntimeError("All items are pinned, cannot remove oldest from the cache.")
        return self.slot_of(victims[0]), victims[0]

    def _check_room(self, adapters: Sequence[LoRAAdapter], activate: bool, what: str) -> None:
        """Raises before anything changes when pinned or merged adapters leave no room:
        otherwise the least recently used make room (the call's own ones included)."""
        ids = {a.id for a in adapters}
        reg = self._registered_adapters
        merged = {self.lora_index_to_id[s] for s in self._merged_slots()} - {None}
        stuck = {k for k in reg.cache if k not in ids and (k in reg.pinned or k in merged)}
        new = {i for i in ids if i not in reg}
        if new and self.capacity - len(stuck) < 1:
            raise RuntimeError(
                f"{what}: every CPU cache entry (max_cpu_loras={self.capacity}) holds a pinned "
                "or merged adapter; nothing was added"
            )
        if activate and any(i not in self._active_adapters for i in ids):
            if not self._free_slots() and not self._victims(keep=()):
                raise RuntimeError(
                    f"{what}: every device slot holds a pinned or merged adapter or is "
                    f"reserved{self._unusable_note()}; nothing was added"
                )

    def _victims(self, keep=()) -> list[int]:
        """Active adapters that may be evicted, least recently used first: not pinned, not
        in a merged slot, not in `keep`."""
        active, merged = self._active_adapters, self._merged_slots()
        return [
            k
            for k in active.cache
            if k not in active.pinned and k not in keep and self.slot_of(k) not in merged
        ]

    def deactivate_adapter(self, adapter_id: int) -> bool:
        _check_id(adapter_id, "deactivate_adapter: adapter_id")
        adapter_id = int(adapter_id)
        if adapter_id not in self._active_adapters:
            return False
        self._check_not_in_merged_slot(adapter_id)
        self._active_adapters.pop(adapter_id)  # frees the slot through on_remove
        return True

    def remove_adapter(self, adapter_id: int) -> bool:
        _check_id(adapter_id, "remove_adapter: adapter_id")
        adapter_id = int(adapter_id)
        self.deactivate_adapter(adapter_id)
        return self._registered_adapters.pop(adapter_id) is not None

    def remove_oldest_adapter(self) -> bool:
        """Drops the least recently used unpinned adapter; False when none is registered,
        `RuntimeError` when all are pinned or in merged slots."""
        if len(self._registered_adapters) == 0:
            return False
        self._check_cpu_room("remove_oldest_adapter")
        self._registered_adapters.remove_oldest()
        return True

    def pin_adapter(self, adapter_id: int) -> bool:
        """Keeps an adapter in the CPU cache and in a device slot (activating it)."""
        _check_id(adapter_id, "pin_adapter: adapter_id")
        adapter_id = int(adapter_id)
        if adapter_id not in self._registered_adapters:
            raise ValueError(f"Pinning failed. LoRA {adapter_id} is not registered.")
        if adapter_id not in self._active_adapters:
            self.activate_adapter(adapter_id)
        self._registered_adapters.pin(adapter_id)
        self._active_adapters.pin(adapter_id)
        return True

    def set_active_adapters(self, requests: Iterable[int | LoRAAdapter | LoRARequest | None]):
        """Worker-style: load (evicting the LRU when the CPU cache is full) and activate
        every requested adapter; other adapters stay cached. Evictions only ever take
        adapters that are neither requested nor pinned: when the requests and the pinned
        adapters do not fit the slots (or the CPU cache) together, `RuntimeError` and
        nothing changes."""
        self._check_model("set_active_adapters")
        reqs = self._distinct(requests)
        # one walk of the layers, not one per registered adapter (only an active
        # adapter sits in a slot)
        merged = {self.lora_index_to_id[s] for s in self._merged_slots()} - {None}
        slots = self.lora_slots - len(self._reserved)
        kept = f" not reserved for training (reserved: {self.reserved_slots})"
        for cache, room, what in (
            (self._active_adapters, slots, "device slots" + (kept if self._reserved else "")),
            (self._registered_adapters, self.capacity, "CPU cache entries (max_cpu_loras)"),
        ):
            pinned = sorted(k for k in cache.pinned | merged if k not in reqs)
            if len(reqs) + len(pinned) > room:
                raise RuntimeError(
                    f"set_active_adapters: {len(reqs)} requested adapters and {len(pinned)} "
                    f"other pinned or merged ones {pinned} do not fit the {room} {what}"
                )
        new, plans = self._validate_requests(reqs)
        needed = sum(1 for aid in reqs if aid not in self._active_adapters)
        room = len(self._free_slots()) + len(self._victims(keep=reqs))
        if needed > room:
            merged = sorted(self._merged_slots())
            raise RuntimeError(
                f"set_active_adapters: {needed} adapters to activate but only {room} device "
                "slots are free or held by unpinned, unrequested adapters (merged: "
                f"{merged}, reserved: {self.reserved_slots})"
            )
        # The requested adapters already here become the most recently used, so that
        # making room for the others evicts only adapters this step does not use.
        for aid in reqs:
            self._registered_adapters.touch(aid)
            self._active_adapters.touch(aid)
        for aid in reqs:
            if aid not in self._registered_adapters:
                if len(self._registered_adapters) + 1 > self.capacity:
                    self.remove_oldest_adapter()
                self.add_adapter(new[aid])
            self._activate(aid, plans.get(aid))
