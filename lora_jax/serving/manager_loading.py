"""`LoRAModelManager`'s adapters by the batch: `add_adapters` and `load_adapters` (PEFT
directories), which check every adapter, and that they fit, before they add any; and the
loading of a worker step's request that is not registered."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

from lora_jax.serving.manager_request import LoRARequest, _check_id
from lora_jax.serving.peft import LoRAAdapter, load_peft_adapter


class _LoadingMixin:
    """The batch loading of `LoRAModelManager` (lora_jax.serving.manager); the checks it
    makes per adapter (`_check_adds`) are the manager's own."""

    def add_adapters(
        self, adapters: Iterable[LoRAAdapter], *, activate: bool = False, progress: bool = True
    ) -> list[bool]:
        """`add_adapter` (and optionally `activate_adapter`) for many, with a progress bar.

        All or nothing: every adapter is checked first (ids, modules, and for every layer
        each one to activate, or every one when registering them evicts others), then they
        are added.
        """
        self._check_model("add_adapters")
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
        # one path is iterable too (a str per character): refuse it rather than guess
        if isinstance(paths, str | bytes | os.PathLike):
            raise ValueError(
                f"load_adapters: paths must be a list of adapter directories or a mapping "
                f"{{name: directory}}, got the single path {paths!r}; pass [{paths!r}]"
            )
        self._check_model("load_adapters")
        if first_id is None:
            first_id = self._id_mark + 1
        else:
            _check_id(first_id, "load_adapters: first_id", "None: after the largest id held")
        items = list(paths.items()) if isinstance(paths, Mapping) else [(None, p) for p in paths]
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


def _progress(items: list, desc: str, enabled: bool):
    if not enabled or len(items) < 2:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="adapter")
