"""A small LRU cache with pinning, for the adapter managers' two caches (vLLM's
`LRUCache` of `vllm.utils`: the registry of loaded adapters and the active device slots).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Any


class LRUCache:
    """Ordered dict with pinning; `on_remove(key, value)` runs for every removal.

    Example:
        >>> gone = []
        >>> c = LRUCache(2, lambda k, v: gone.append(k))
        >>> c.put("a", 1); c.put("b", 2); c.touch("a"); c.put("c", 3)
        >>> gone, list(c.cache)
        (['b'], ['a', 'c'])
    """

    def __init__(
        self,
        capacity: int,
        on_remove: Callable[[Hashable, Any], None],
        keep: Callable[[Hashable], bool] | None = None,
    ):
        self.capacity = capacity
        self.on_remove = on_remove
        self.keep = keep  # keys `remove_oldest` must pass over, as if pinned
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.pinned: set = set()

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __len__(self) -> int:
        return len(self.cache)

    def touch(self, key) -> None:
        if key in self.cache:
            self.cache.move_to_end(key)

    def get(self, key):
        self.touch(key)
        return self.cache.get(key)

    def put(self, key, value) -> None:
        if key not in self.cache:
            while len(self.cache) >= self.capacity:
                self.remove_oldest()
        self.cache[key] = value
        self.cache.move_to_end(key)

    def pop(self, key, default=None):
        if key not in self.cache:
            return default
        value = self.cache.pop(key)
        self.pinned.discard(key)
        self.on_remove(key, value)
        return value

    def pin(self, key) -> None:
        if key not in self.cache:
            raise ValueError(f"cannot pin {key!r}: not in the cache")
        self.pinned.add(key)

    def remove_oldest(self) -> None:
        for key in self.cache:
            if key not in self.pinned and not (self.keep is not None and self.keep(key)):
                self.pop(key)
                return
        kept = " or kept" if self.keep is not None else ""
        raise RuntimeError(f"All items are pinned{kept}, cannot remove oldest from the cache.")
