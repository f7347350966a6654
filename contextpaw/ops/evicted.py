"""Evicted content, kept for `GET /contextpaw/evicted/<ref>` and `/contextpaw/search`.

An agent told that something was removed can fetch it again. A store is bounded by count, bytes
and age, because prompts can be large and the proxy runs for weeks. `EvictedStore` is what every
store answers; `MemoryStore` (here) keeps content in this process only, `archive_sqlite.SqliteStore`
on disk across restarts, `archive_redis.RedisStore` in a Redis server that several instances share;
`archive.Archive` is the one the proxy holds, and opens the store the options name.
"""

from __future__ import annotations

import abc
import builtins
import queue
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from contextpaw import wire
from contextpaw.core import logs

logger = logs.get(__name__)

SNIPPET_CHARS = 160
"""Characters of context a search result shows around what matched."""


SEARCH_WAIT_S = 5.0
"""How long a search waits for the writes before it (they take milliseconds; a stuck disk is not waited out)."""
BATCH = 256
"""Writes a store's writer thread makes in one go at most."""
RETRY_S = 5.0
"""How often a writer tries again what a failed write left in memory (a full disk, a Redis away)."""


def next_batch(writes: queue.SimpleQueue[Any], holding: bool) -> list[Any]:
    """What a writer thread takes next from its queue: the first item it waits for (at most
    `RETRY_S` while it `holding` a failed write's content: [] then, time to try it again), and the
    writes queued behind it, up to `BATCH`."""
    try:
        batch = [writes.get(timeout=RETRY_S if holding else None)]
    except queue.Empty:
        return []
    while len(batch) < BATCH and isinstance(batch[-1], tuple):
        try:
            batch.append(writes.get_nowait())
        except queue.Empty:
            break
    return batch


def newest_within[Item](puts: Sequence[Item], size: Callable[[Item], int], most: int) -> tuple[list[Item], list[Item]]:
    """(the newest `puts` whose sizes fit `most` bytes together, the older ones that do not): what a
    store holds in memory while it cannot write, bounded as the archive itself is."""
    total = 0
    for at in range(len(puts) - 1, -1, -1):
        total += size(puts[at])
        if total > most:
            return list(puts[at + 1 :]), list(puts[: at + 1])
    return list(puts), []


class Held[P]:
    """What a store's writer thread could not write (a full disk, a server away), held for its next
    try: the newest within the archive's bytes (`size` of each), each readable meanwhile from the
    store's own pending copy. `where` names the store in the log. One for SQLite and Redis alike."""

    def __init__(self, where: str, size: Callable[[P], int]) -> None:
        self.where, self.size = where, size
        self.puts: list[P] = []

    def write(self, write: Callable[[list[P]], None], puts: list[P], most: int, failures: tuple[type[Exception], ...]) -> list[P]:
        """`write` what is held, then `puts`; where that fails, hold them all, the newest within
        `most` bytes. Returns what is lost past it (the store forgets its pending copy of those)."""
        todo = [*self.puts, *puts]
        try:
            write(todo)
        except failures as e:
            if not self.puts:
                logger.warning(
                    "the archive %s cannot be written (%s): what it is given is held in memory (at most %d bytes) and written once it can be",
                    self.where,
                    e,
                    most,
                )
            self.puts, lost = newest_within(todo, self.size, most)
            if lost:
                logger.warning("the archive %s: %d held entries over its bound of %d bytes are lost", self.where, len(lost), most)
            return lost
        if self.puts:
            logger.warning("the archive %s is written again: %d held entries are there", self.where, len(self.puts))
        self.puts = []
        return []

    def closed(self) -> None:
        """Said when the store closes with entries still held: they are lost."""
        if self.puts:
            logger.warning("the archive %s closed with %d entries it could not write: lost", self.where, len(self.puts))


def encode(content: Any) -> bytes:
    """What the store keeps and `/contextpaw/evicted/<id>` answers: the content as compact JSON,
    valid UTF-8 whatever it held (a lone surrogate, a JavaScript string cut inside an emoji, goes
    back as the JSON escape it came in as), its numbers as the client wrote them (`1e400` is not
    written `Infinity`, nor `1.50` as `1.5`).

    orjson writes it in a fortieth of the time `json` takes (a hole of 4 MB: 0.4 ms, not 16), and
    the same bytes: content is what `wire.load` read, where a float orjson would spell otherwise is
    a `Number`. What orjson refuses, a `Number` or a lone surrogate, goes the slow way."""
    try:
        return orjson.dumps(content)
    except TypeError:
        return wire.dumps(content, separators=(",", ":")).encode("utf-8", "backslashreplace")


def searchable(data: builtins.bytes) -> str:
    """The text of kept content, as a search reads it: every string inside the JSON, one a line
    (a lone surrogate replaced, so that any database takes it). Read by orjson, in a third of the
    time `json` holds the interpreter's lock for (the writer thread reads megabytes a hole); what
    it refuses (a lone surrogate's escape) by `json`."""
    try:
        content = wire.read_json(data)
    except ValueError:
        return data.decode("utf-8", "replace")
    texts: list[str] = []
    stack = [content]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            stack.extend(reversed(item))
    return "\n".join(texts).encode("utf-8", "replace").decode("utf-8")


class EvictedStore(abc.ABC):
    """Evicted content by marker id, oldest dropped first when a bound is reached.

    `put` never waits on a disk or a network: it returns at once, and `get` of that id answers it
    from then on. `get` of one id is fast enough for the event loop; `search` may not be (run it
    in a thread)."""

    blocking_reads = False
    """Whether `get` may wait on a network (the endpoint then reads in a thread)."""

    def __init__(self, *, max_items: int, max_bytes: int, max_age_s: float) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s

    def bound(self, *, max_items: int, max_bytes: int, max_age_s: float) -> None:
        """New bounds, applied from the next `put` on."""
        self.max_items, self.max_bytes, self.max_age_s = max_items, max_bytes, max_age_s

    @abc.abstractmethod
    def __len__(self) -> int:
        """Contents kept."""

    @property
    @abc.abstractmethod
    def bytes(self) -> int:
        """Bytes of content kept."""

    @abc.abstractmethod
    def put(self, marker_id: str, data: builtins.bytes, session: str = "") -> None:
        """Keep `data` (content made with `encode`, off the event loop for a big eviction) under
        `marker_id`, for the session whose request it was evicted from (`wire.SESSION_HEADER`; ""
        where the request named none); the same id again refreshes its age."""

    @abc.abstractmethod
    def get(self, marker_id: str) -> builtins.bytes | None:
        """The content as JSON bytes, or None when it was never kept or has been dropped."""

    @abc.abstractmethod
    def search(self, query: str, limit: int, session: str | None = None) -> list[tuple[str, str]]:
        """(id, snippet) of at most `limit` kept contents whose text holds every word of `query`,
        of one `session` (None: of all), what was `put` before the call included (a store that
        writes later waits for it here)."""

    keeps_plans = False
    """Whether conversation plans are kept here too: for the next start (SQLite), or for the other
    instances (a store several instances share)."""
    shared = False
    """Whether other instances write here too (Redis): a plan one of them wrote may be newer than
    this instance's own last one."""

    def put_plan(self, key: str, data: builtins.bytes) -> None:
        """Keep a conversation's plan (JSON) under its keyed conversation key; never waits."""

    def get_plan(self, key: str) -> builtins.bytes | None:
        """A conversation's plan kept before (by this instance before a restart, or by another), or
        None; may wait on a disk or a network (read it in a thread)."""
        return None

    def put_digest(self, key: str, text: str, keep: int) -> None:
        """Keep a summarizer call's answer under its call key, at most `keep` of them, the oldest
        dropped first; never waits. A store that keeps none (memory, Redis) forgets it."""

    def get_digests(self, limit: int) -> list[tuple[str, str]]:
        """The newest `limit` digests kept, as (call key, answer), oldest first (read at start)."""
        return []

    def shared_secret(self, local: builtins.bytes) -> builtins.bytes:
        """The secret references are keyed with: this instance's own (`local`), unless the store is
        shared, where every instance must key alike for a reference to read back through any of them."""
        return local

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every `put` so far is written (tests, measurements, shutdown); whether it was."""
        return True

    def close(self) -> None:
        """Write what is pending and let go of files and connections."""


def snippet(text: str, words: list[str]) -> str:
    """Some text around the first word of `words` found in `text`, on one line."""
    lower = text.lower()
    at = min((i for i in (lower.find(w.lower()) for w in words) if i >= 0), default=0)
    start = max(at - SNIPPET_CHARS // 2, 0)
    piece = text[start : start + SNIPPET_CHARS]
    return ("…" if start else "") + " ".join(piece.split()) + ("…" if start + SNIPPET_CHARS < len(text) else "")


class MemoryStore(EvictedStore):
    """In this process only (`contextpaw_archive=memory`, and tests): gone at restart."""

    def __init__(self, *, max_items: int, max_bytes: int, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(max_items=max_items, max_bytes=max_bytes, max_age_s=max_age_s)
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, bytes, str]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, marker_id: str, data: builtins.bytes, session: str = "") -> None:
        self._drop(marker_id)
        if len(data) > self.max_bytes:
            return
        self._items[marker_id] = (self._clock(), data, session)
        self._bytes += len(data)
        self._expire()
        while len(self._items) > self.max_items or self._bytes > self.max_bytes:
            self._drop(next(iter(self._items)))

    def get(self, marker_id: str) -> builtins.bytes | None:
        self._expire()
        item = self._items.get(marker_id)
        return item[1] if item else None

    def search(self, query: str, limit: int, session: str | None = None) -> list[tuple[str, str]]:
        self._expire()
        words = query.lower().split()
        found: list[tuple[str, str]] = []
        for marker_id, (_, data, own) in reversed(self._items.items()):
            if len(found) >= limit or not words:
                break
            if session is not None and own != session:
                continue
            text = searchable(data)
            if all(w in text.lower() for w in words):
                found.append((marker_id, snippet(text, words)))
        return found

    def _expire(self) -> None:
        deadline = self._clock() - self.max_age_s
        while self._items and next(iter(self._items.values()))[0] < deadline:
            self._drop(next(iter(self._items)))

    def _drop(self, marker_id: str) -> None:
        item = self._items.pop(marker_id, None)
        if item:
            self._bytes -= len(item[1])
