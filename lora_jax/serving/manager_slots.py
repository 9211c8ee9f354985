"""`LoRAModelManager`'s device slots: activating an adapter into a slot (and deactivating
it), the slots kept for training (`reserve_slot`), and the all-or-nothing slot writes. A slot
that `merge_adapter` folded into the kernels is never written, chosen or counted free until
`unmerge_adapter`."""

from __future__ import annotations

import numpy as np

from lora_jax.layers.dora import check_layer_dora
from lora_jax.serving.manager_caches import _peek
from lora_jax.serving.manager_request import _check_id
from lora_jax.serving.merge import layer_merged_slot
from lora_jax.serving.peft import LoRAAdapter
from lora_jax.serving.slot_writes import layer_variables, write_slot_updates


class _SlotsMixin:
    """The device-slot methods of `LoRAModelManager` (lora_jax.serving.manager), which
    holds the state they work on: `modules`, `lora_index_to_id`, `_reserved` and the two
    caches."""

    # -- activation -----------------------------------------------------------------------
    def activate_adapter(self, adapter_id: int) -> bool:
        """Writes a registered adapter into the first free slot; False if already active.

        The adapter is validated for every layer before any slot (or eviction) changes.
        """
        _check_id(adapter_id, "activate_adapter: adapter_id")
        self._check_model("activate_adapter")
        return self._activate(int(adapter_id), None)

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

    def deactivate_adapter(self, adapter_id: int) -> bool:
        """Frees the adapter's slot (its weights stay until overwritten); False if inactive.
        An adapter in a merged slot stays until `unmerge_adapter` (ValueError)."""
        _check_id(adapter_id, "deactivate_adapter: adapter_id")
        adapter_id = int(adapter_id)
        if adapter_id not in self._active_adapters:
            return False
        self._check_not_in_merged_slot(adapter_id)
        self._active_adapters.pop(adapter_id)
        self._free_slot(adapter_id)
        return True

    def _check_not_in_merged_slot(self, adapter_id: int) -> None:
        slot = self.slot_of(adapter_id)
        if slot is not None and slot in self._merged_slots():
            raise ValueError(
                f"adapter {adapter_id} is in slot {slot}, which merge_adapter folded into the "
                "model's kernels: unmerge_adapter before deactivating or removing it"
            )

    def _active_put(self, adapter_id) -> None:
        self._active_adapters[adapter_id] = None

    def _touch_active(self, adapter_id) -> None:
        pass

    def _free_slot(self, adapter_id) -> None:
        slot = self.slot_of(adapter_id)
        if slot is not None:
            self.lora_index_to_id[slot] = None

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
        self._check_model("write_slot")
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
            if hasattr(layer, "token_updates"):  # trainable tokens: the embedding, lm_head
                tokens = adapter.trainable_tokens.get(name) if adapter is not None else None
                try:
                    prepared = (
                        None
                        if tokens is None
                        else layer.prepare_tokens(slot, tokens.token_ids, tokens.rows)
                    )
                except ValueError as e:
                    raise ValueError(f"adapter {adapter.name!r} ({adapter.source}): {e}") from e
                updates += layer.token_updates(prepared)
            if hasattr(layer, "prepare_lora") and hasattr(layer, "slot_updates"):
                if m is None:
                    updates += layer.slot_updates(None)
                    continue
                try:
                    prepared = layer.prepare_lora(slot, *m.set_lora_args())
                    if m.magnitude is not None:
                        check_layer_dora(layer, m.magnitude)
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
        if adapter is not None:  # DoRA: its scale needs the slot's weights, written above
            dora = [
                u
                for name, layer in self.modules.items()
                if (m := adapter.get_lora(name)) is not None and m.magnitude is not None
                for u in layer.dora_updates(slot, m.magnitude)
            ]
            write_slot_updates(slot, dora)

    def _check_not_merged(self, slot: int) -> None:
        """A slot that `merge_adapter` folded into the kernels keeps its adapter until
        `unmerge_adapter`: rewriting it would leave kernels and slots disagreeing."""
        for layer in self.modules.values():
            if layer_merged_slot(layer) == slot:
                raise ValueError(
                    f"slot {slot} is merged into the model's kernels (merge_adapter); "
                    "unmerge_adapter before writing it"
                )
