"""Bounded caches: every cache here drops its least recently used entries first, by count and by size."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class LRU(OrderedDict[Any, Any]):
    """A bounded mapping that drops the least recently used entry first: every cache here is bounded."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def get(self, key: Any, default: Any = None) -> Any:
        """The value, now the most recently used; `default` when there is none."""
        if key not in self:
            return default
        self.move_to_end(key)
        return self[key]

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class SizedLRU(LRU):
    """An LRU bounded by the bytes its entries hold too (`size(key, value)` tells them), not only
    by count: one entry can be large (a 20,000-message conversation's plan, a 32 KB model name)."""

    def __init__(self, limit: int, max_bytes: int, size: Callable[[Any, Any], int]) -> None:
        super().__init__(limit)
        self.max_bytes = max_bytes
        self.size = size
        self.bytes = 0
        self._sizes: dict[Any, int] = {}

    def put(self, key: Any, value: Any) -> None:
        self.bytes += (size := self.size(key, value)) - self._sizes.get(key, 0)
        self._sizes[key] = size
        self[key] = value
        self.move_to_end(key)
        while len(self) > 1 and (len(self) > self.limit or self.bytes > self.max_bytes):
            old, _ = self.popitem(last=False)
            self.bytes -= self._sizes.pop(old)

    def discard(self, key: Any) -> None:
        """Forget `key`, if it is held."""
        if key in self:
            del self[key]
            self.bytes -= self._sizes.pop(key)
