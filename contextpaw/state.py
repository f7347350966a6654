"""State that outlives a request: bounded in memory, and written atomically when it is kept on disk."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import glob
import json
import os
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any


class LRU(OrderedDict):
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


class InFlight:
    """One task per key while it runs: whoever asks meanwhile shares it, so concurrent first
    requests cost one lookup. `ended(key, task)` is told when a task ends, before it is forgotten."""

    def __init__(self, ended: Callable[[Any, asyncio.Task[Any]], None] | None = None) -> None:
        self.ended = ended
        self._tasks: dict[Any, asyncio.Task[Any]] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, key: object) -> bool:
        return key in self._tasks

    def task(self, key: Any, start: Callable[[], Awaitable[Any]]) -> asyncio.Task[Any]:
        """The task under way for `key`, started now if there is none."""
        task = self._tasks.get(key)
        if task is None:
            task = self._tasks[key] = asyncio.ensure_future(start())
            task.add_done_callback(functools.partial(self._end, key))
        return task

    async def shared(self, key: Any, start: Callable[[], Awaitable[Any]]) -> Any:
        """The task's result; a caller that goes away leaves the task to the others."""
        return await asyncio.shield(self.task(key, start))

    def _end(self, key: Any, task: asyncio.Task[Any]) -> None:
        del self._tasks[key]
        if self.ended is not None:
            self.ended(key, task)


def remove_leftovers(path: Path) -> int:
    """Remove the temporary files that writes of `path` killed half-way left behind (a crash
    between `mkstemp` and `replace`); how many went. Called once, when the file is taken up."""
    removed = 0
    for leftover in path.parent.glob(f"{glob.escape(path.name)}*.tmp"):
        with contextlib.suppress(OSError):
            leftover.unlink()
            removed += 1
    return removed


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text`: a crash leaves the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class KeptCalibration:
    """The calibration's JSON file: read when the state dir is set, written off the event loop at
    most every `every_s` seconds (and once more at exit)."""

    def __init__(self, path: Path, every_s: float = 10.0) -> None:
        self.path = path
        self.every_s = every_s
        self._saved_at = 0.0
        remove_leftovers(path)

    def restore(self, calibration: Any) -> bool | None:
        """Load into `calibration`; None when there is no file, False when it is damaged."""
        try:
            with open(self.path, encoding="utf-8") as f:
                return bool(calibration.restore(json.load(f)))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return False

    def save(self, calibration: Any, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._saved_at < self.every_s:
            return
        self._saved_at = now
        text = json.dumps(calibration.state())
        asyncio.get_running_loop().run_in_executor(None, write_atomically, self.path, text)
