"""Evicted content, kept for `GET /contextpaw/evicted/<id>`.

An agent told that something was removed can fetch it again. The store is bounded by count, bytes
and age, because prompts can be large and the proxy runs for weeks.
"""

from __future__ import annotations

import builtins
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from contextpaw import wire


def encode(content: Any) -> bytes:
    """What the store keeps and `/contextpaw/evicted/<id>` answers: the content as JSON, valid
    UTF-8 whatever it held (a lone surrogate, a JavaScript string cut inside an emoji, goes back
    as the JSON escape it came in as), its numbers as the client wrote them (`1e400` is not
    written `Infinity`, nor `1.50` as `1.5`)."""
    return wire.dumps(content).encode("utf-8", "backslashreplace")


class EvictedStore:
    """Evicted content by marker id, oldest dropped first when a bound is reached."""

    def __init__(self, *, max_items: int, max_bytes: int, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, marker_id: str, data: builtins.bytes) -> None:
        """Keep `data` (content made with `encode`, off the event loop for a big eviction) under
        `marker_id`; the same id again refreshes its age."""
        self._drop(marker_id)
        if len(data) > self.max_bytes:
            return
        self._items[marker_id] = (self._clock(), data)
        self._bytes += len(data)
        self._expire()
        while len(self._items) > self.max_items or self._bytes > self.max_bytes:
            self._drop(next(iter(self._items)))

    def get(self, marker_id: str) -> builtins.bytes | None:
        """The content as JSON bytes, or None when it was never kept or has been dropped."""
        self._expire()
        item = self._items.get(marker_id)
        return item[1] if item else None

    def _expire(self) -> None:
        deadline = self._clock() - self.max_age_s
        while self._items and next(iter(self._items.values()))[0] < deadline:
            self._drop(next(iter(self._items)))

    def _drop(self, marker_id: str) -> None:
        item = self._items.pop(marker_id, None)
        if item:
            self._bytes -= len(item[1])
