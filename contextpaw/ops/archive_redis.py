"""The archive shared by a fleet: evicted content in a Redis (or Valkey) server that several
ContextPaw instances behind one balancer point at (`contextpaw_archive=redis://host:port/db`), so a
reference a marker carries reads back through whichever instance serves the next request, and
after the one that evicted it is gone.

The bounds are kept by the server itself, in one Lua script per write (atomic, whoever writes):
each content is a key with the age bound as its TTL, a sorted set orders the ids by the server's
clock, a hash holds their sizes and a counter their total; the oldest are dropped while the count
or byte bound is passed. As with SQLite, `put` hands the content to one writer thread and returns;
`get` answers pending content from the queue's copy, and otherwise asks the server, a network round
trip: the endpoint runs it in a thread (`blocking_reads`). While the server is away, what the writer
could not write stays in that copy (the newest within the byte bound), tried again every
`evicted.RETRY_S`: a marker's reference reads back meanwhile and reaches the server once it is back. Conversation plans are kept here too
(`plan:<conversation key>`, JSON, with the age bound as TTL): the instance that serves a
conversation's next turn finds its cuts there when it has none of its own. Search has no index on a plain Redis: it
reads the newest contents and matches their text, which is enough for an operator's or an agent's
occasional question.
"""

from __future__ import annotations

import builtins
import queue
import threading
from collections.abc import Callable
from typing import Any

import redis

from contextpaw.core import logs
from contextpaw.ops.evicted import SEARCH_WAIT_S, EvictedStore, Held, next_batch, searchable, snippet

logger = logs.get(__name__)

PREFIX = "contextpaw:archive:"
SEARCHED = 2_000
"""The newest contents a search reads at most."""

PUT = """
local prefix, id, data = ARGV[1], ARGV[2], ARGV[3]
local max_items, max_bytes, max_age = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local order, sizes, total = prefix .. 'order', prefix .. 'sizes', prefix .. 'bytes'
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function drop(victim)
  local size = redis.call('HGET', sizes, victim)
  if size then redis.call('DECRBY', total, size) end
  redis.call('HDEL', sizes, victim)
  redis.call('ZREM', order, victim)
  redis.call('DEL', prefix .. 'data:' .. victim)
end
drop(id)
if #data <= max_bytes then
  redis.call('SET', prefix .. 'data:' .. id, data, 'PX', math.floor(max_age * 1000))
  redis.call('ZADD', order, now, id)
  redis.call('HSET', sizes, id, #data)
  redis.call('INCRBY', total, #data)
end
for _, old in ipairs(redis.call('ZRANGEBYSCORE', order, '-inf', now - max_age)) do drop(old) end
while redis.call('ZCARD', order) > max_items or tonumber(redis.call('GET', total) or '0') > max_bytes do
  local oldest = redis.call('ZRANGE', order, 0, 0)[1]
  if not oldest then break end
  drop(oldest)
end
return redis.call('ZCARD', order)
"""


class RedisStore(EvictedStore):
    """Evicted content in a Redis server (see the module's note)."""

    blocking_reads = True
    keeps_plans = True
    shared = True

    def __init__(self, url: str, *, max_items: int, max_bytes: int, max_age_s: float, prefix: str = PREFIX) -> None:
        super().__init__(max_items=max_items, max_bytes=max_bytes, max_age_s=max_age_s)
        self.url = url
        self.prefix = prefix
        self._client: Any = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        self._client.ping()  # a wrong address is said at start, not at the first eviction
        self._put = self._client.register_script(PUT)
        self._pending: dict[str, builtins.bytes] = {}
        self._pending_lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[str, builtins.bytes, str] | threading.Event | None] = queue.SimpleQueue()
        self._held: Held[tuple[str, builtins.bytes, str]] = Held(f"at {url}", lambda put: len(put[1]))
        """Contents a failed write left (in `_pending` too) until a write takes them."""
        self._secret: builtins.bytes | None = None
        """The fleet's secret this instance keys with (`shared_secret`), checked on every write."""
        self._split = False
        self._writer = threading.Thread(target=self._write_loop, name="contextpaw-archive-redis", daemon=True)
        self._writer.start()

    def _key(self, what: str) -> str:
        return self.prefix + what

    def __len__(self) -> int:
        try:
            return int(self._client.zcard(self._key("order")))
        except redis.RedisError:
            return len(self._pending)

    @property
    def bytes(self) -> int:
        try:
            return int(self._client.get(self._key("bytes")) or 0)
        except redis.RedisError:
            return 0

    def shared_secret(self, local: builtins.bytes) -> builtins.bytes:
        """The fleet's secret: the first instance's, kept in the server (`SET NX`), so that every
        instance keys references and conversations alike. Whoever can read this Redis can read the
        archive anyway."""
        key = self._key("secret")
        self._client.set(key, local, nx=True)
        self._secret = bytes(self._client.get(key) or local)
        return self._secret

    def _secret_kept(self, pipe: Any) -> Callable[[list[Any]], None]:
        """Ask, in the writes' own round trip, that the fleet's secret is still the one this
        instance uses (set again where Redis lost it: restarted empty, or flushed); the check of the
        pipeline's first two answers. A Redis that lost it would let the next instance set a new one,
        and the fleet split in silence: references made on one unreadable through the others."""
        secret = self._secret
        if secret is None:
            return lambda results: None
        key = self._key("secret")
        pipe.set(key, secret, nx=True)
        pipe.get(key)

        def check(results: list[Any]) -> None:
            reset, held = results[0], results[1]
            if reset:
                logger.warning(
                    "Redis at %s had lost the fleet's secret (restarted empty, or flushed): this instance set it "
                    "again, so instances that start now join this one",
                    self.url,
                )
            if held is not None and bytes(held) != secret and not self._split:
                self._split = True
                logger.error(
                    "the fleet is split: Redis at %s holds another secret than this instance's (another instance set "
                    "it after Redis lost this one's); references made here are unreadable through the others, and "
                    "theirs here: restart this instance to join them",
                    self.url,
                )

        return check

    def put_plan(self, key: str, data: builtins.bytes) -> None:
        self._queue.put(("plan:" + key, data, ""))

    def get_plan(self, key: str) -> builtins.bytes | None:
        try:
            data = self._client.get(self._key("plan:" + key))
        except redis.RedisError as e:
            logger.warning("the shared plans at %s cannot be read: %s", self.url, e)
            return None
        return bytes(data) if data is not None else None

    def put(self, marker_id: str, data: builtins.bytes, session: str = "") -> None:
        with self._pending_lock:
            self._pending[marker_id] = data
        self._queue.put((marker_id, data, session))

    def get(self, marker_id: str) -> builtins.bytes | None:
        with self._pending_lock:
            pending = self._pending.get(marker_id)
        if pending is not None:
            return pending if len(pending) <= self.max_bytes else None
        try:
            data = self._client.get(self._key("data:" + marker_id))
        except redis.RedisError as e:
            logger.warning("the archive at %s cannot be read: %s", self.url, e)
            return None
        return bytes(data) if data is not None else None

    def search(self, query: str, limit: int, session: str | None = None) -> list[tuple[str, str]]:
        words = query.lower().split()
        if not words or limit < 1:
            return []
        self.flush(SEARCH_WAIT_S)  # the content just evicted is what an agent looks for first
        ids = [i.decode() for i in self._client.zrevrange(self._key("order"), 0, SEARCHED - 1)]
        found: list[tuple[str, str]] = []
        for start in range(0, len(ids), 100):
            chunk = ids[start : start + 100]
            datas = self._client.mget([self._key("data:" + i) for i in chunk])
            owners = self._client.mget([self._key("session:" + i) for i in chunk]) if session is not None else [None] * len(chunk)
            for marker_id, data, owner in zip(chunk, datas, owners, strict=True):
                if data is None or (session is not None and (owner or b"").decode() != session):
                    continue
                text = searchable(data)
                if all(w in text.lower() for w in words):
                    found.append((marker_id, snippet(text, words)))
                    if len(found) >= limit:
                        return found
        return found

    def flush(self, timeout: float = 10.0) -> bool:
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=30)
        self._client.close()

    def clear(self) -> None:
        """Forget everything this store's prefix holds (tests and measurements)."""
        keys = list(self._client.scan_iter(match=self.prefix + "*", count=1000))
        for start in range(0, len(keys), 1000):
            self._client.delete(*keys[start : start + 1000])

    def _write_loop(self) -> None:
        while True:
            batch = next_batch(self._queue, bool(self._held.puts))
            puts = [item for item in batch if isinstance(item, tuple)]
            if puts or self._held.puts:
                self._forget_pending(self._held.write(self._send, puts, self.max_bytes, (redis.RedisError,)))
            for item in batch:
                if isinstance(item, threading.Event):
                    item.set()
            if batch and batch[-1] is None:
                self._held.closed()
                return

    def _send(self, puts: list[tuple[str, builtins.bytes, str]]) -> None:
        """One pipeline for `puts`; what it wrote is no longer read from the pending copy."""
        pipe = self._client.pipeline(transaction=False)
        check = self._secret_kept(pipe)
        for marker_id, data, session in puts:
            if marker_id.startswith("plan:"):  # a conversation's plan: the age bound is its TTL
                pipe.set(self._key(marker_id), data, px=int(self.max_age_s * 1000))
                continue
            bounds = (self.max_items, self.max_bytes, self.max_age_s)
            self._put(args=(self.prefix, marker_id, data, *bounds), client=pipe)
            if session:  # whose it is, for a search scoped to one session; as long-lived as the content
                pipe.set(self._key("session:" + marker_id), session, px=int(self.max_age_s * 1000))
        check(pipe.execute())
        self._forget_pending(puts)

    def _forget_pending(self, puts: list[tuple[str, builtins.bytes, str]]) -> None:
        with self._pending_lock:
            for marker_id, data, _ in puts:
                if self._pending.get(marker_id) is data:
                    del self._pending[marker_id]
