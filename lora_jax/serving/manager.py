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

One manager per model: making a second one (of the model or of part of it) retires the
first, whose later calls that write slots or map requests refuse (both would write the
same slots). A manager whose model was unwrapped or wrapped again
since it was made refuses every call that writes slots or maps requests.

Ids: `load_adapters` numbers adapters past every id the manager has held, so an id that a
removal or an eviction freed is never given to another adapter (a client still asking for
the old one would get the new one's weights). A `LoRARequest` whose id is registered must
name that adapter (`ValueError` otherwise), as an adapter object must.

Training beside serving (`lora_jax.serving.training`): `reserve_slot(s)` keeps the
manager out of slot s (never activated into, written or counted free) until
`release_slot(s)`; `init_lora_slot` refuses a slot in which a live manager of the model
holds an adapter.

The manager is split by concern: `manager_request` (`LoRARequest`, adapter identity),
`manager_slots` (activation, reserved slots, slot writes), `manager_loading`
(`add_adapters`, `load_adapters`), `manager_worker` (`set_active_adapters`,
`token_mapping`), `manager_checks` (is an adapter or request the one registered under its
id; the checks of a whole call) and `manager_caches`; this module holds the class and its
registry. Every name stays importable from here (the `X as X` imports re-export
those this module no longer uses).
"""

from __future__ import annotations

import weakref

from flax import nnx

from lora_jax.config import LoRAConfig
from lora_jax.layers import LoRAContext, find_lora_context
from lora_jax.serving.lru import LRUCache as LRUCache
from lora_jax.serving.manager_caches import _items, _keys
from lora_jax.serving.manager_caches import _peek as _peek
from lora_jax.serving.manager_checks import _ChecksMixin
from lora_jax.serving.manager_loading import _LoadingMixin
from lora_jax.serving.manager_loading import _progress as _progress
from lora_jax.serving.manager_request import LoRARequest as LoRARequest
from lora_jax.serving.manager_request import _check_id
from lora_jax.serving.manager_request import _label as _label
from lora_jax.serving.manager_request import _names_another as _names_another
from lora_jax.serving.manager_request import _same_adapter as _same_adapter
from lora_jax.serving.manager_request import _source_dir as _source_dir
from lora_jax.serving.manager_slots import _SlotsMixin
from lora_jax.serving.manager_worker import _WorkerMixin
from lora_jax.serving.merge import layer_merged_slot as layer_merged_slot
from lora_jax.serving.peft import WEIGHTS_NAME as WEIGHTS_NAME
from lora_jax.serving.peft import LoRAAdapter
from lora_jax.serving.peft import load_peft_adapter as load_peft_adapter
from lora_jax.serving.slot_writes import layer_variables as layer_variables
from lora_jax.serving.slot_writes import write_slot_updates as write_slot_updates
from lora_jax.serving.wrap import graph_edits, layer_packed_modules, lora_layers

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


class LoRAModelManager(_SlotsMixin, _LoadingMixin, _WorkerMixin, _ChecksMixin):
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
        # One manager per model: each counts every slot it did not fill as free, so two
        # would write the same slots and serve each other's adapters. The newest wins (a
        # notebook cell run again makes a new manager while the old one is still bound):
        # the older ones refuse every later call that writes slots or maps requests.
        for other in managers_of(model):
            other._superseded_by = weakref.ref(self)
            _MANAGERS.discard(other)
        self._superseded_by = None
        self._graph_edits = graph_edits()  # the model's layers are checked when this moves
        self.context: LoRAContext | None = find_lora_context(model)
        self.lora_index_to_id: list[int | None] = [None] * self.lora_slots
        self._reserved: set[int] = set()  # slots kept for training (reserve_slot)
        self._id_mark = 0  # the largest id ever registered: load_adapters numbers past it
        self._registered_adapters = self._make_registry()
        self._active_adapters = self._make_active()
        _MANAGERS.add(self)

    def _check_model(self, what: str) -> None:
        """The model's LoRA layers must still be the ones this manager writes: after
        `unwrap_model` (or `wrap_model` again) its slots serve nothing, and its requests
        would get the base model."""
        if self._superseded_by is not None:
            raise ValueError(
                f"{what}: a newer manager of this model was made after this "
                f"{type(self).__name__}, and it writes the same device slots; use the newer "
                "one (one manager per model)"
            )
        edits = graph_edits()
        if edits == self._graph_edits:
            return
        now = lora_layers(self.model)
        if now.keys() == self.modules.keys() and all(now[k] is x for k, x in self.modules.items()):
            self._graph_edits = edits  # another model's layers were swapped
            return
        raise ValueError(
            f"{what}: the model was unwrapped (unwrap_model) or wrapped again (wrap_model) "
            f"since this {type(self).__name__} was made, and its LoRA layers are no longer "
            "the ones the manager writes; make a new manager for the model (and add the "
            "adapters again)"
        )

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

    def adapter_in_slot(self, slot: int) -> LoRAAdapter | None:
        """The adapter active in device slot `slot` (its LRU place untouched), else None."""
        aid = self.lora_index_to_id[slot] if 0 <= slot < len(self.lora_index_to_id) else None
        return None if aid is None else _peek(self._registered_adapters, aid)

    def get_adapter(self, adapter_id: int) -> LoRAAdapter | None:
        _check_id(adapter_id, "get_adapter: adapter_id")
        reg = self._registered_adapters
        return reg.get(adapter_id) if adapter_id in reg else None

    def slot_of(self, adapter_id: int) -> int | None:
        """The device slot of an active adapter, else None."""
        _check_id(adapter_id, "slot_of: adapter_id")
        try:
            return self.lora_index_to_id.index(adapter_id)
        except ValueError:
            return None

    # -- lifecycle ------------------------------------------------------------------------
    def add_adapter(self, adapter: LoRAAdapter) -> bool:
        """Registers `adapter` in the CPU cache; False (and a touch) when already there (the
        same object, or one of the same name and source). Another adapter under a taken id
        is a `ValueError`: its requests would get the registered one's weights."""
        if not isinstance(adapter, LoRAAdapter):
            raise ValueError(f"add_adapter: expected a LoRAAdapter, got {type(adapter).__name__}")
        _check_id(adapter.id, f"add_adapter: adapter {adapter.name!r}'s id")
        self._check_model("add_adapter")
        if adapter.id in self._registered_adapters:
            self._check_same(adapter, "add_adapter")
            self._touch_registered(adapter.id)
            return False
        self._check_modules(adapter)
        self._register(adapter)
        return True

    def remove_adapter(self, adapter_id: int) -> bool:
        """Deactivates and unregisters; False when unknown. Removes pinned ones too."""
        _check_id(adapter_id, "remove_adapter: adapter_id")
        adapter_id = int(adapter_id)
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

    def _touch_registered(self, adapter_id) -> None:
        pass


def __getattr__(name: str):
    # `LRUCacheLoRAModelManager` lives in lru_manager.py (it subclasses the manager
    # above); it is reached from here too, where vLLM users look for it.
    if name == "LRUCacheLoRAModelManager":
        from lora_jax.serving.lru_manager import LRUCacheLoRAModelManager

        return LRUCacheLoRAModelManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
