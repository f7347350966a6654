"""Nothing a store does stalls the proxy's event loop: a hung Redis (a real `redis-server`, stopped
with SIGSTOP) costs a metrics scrape its archive figures, not every client 20 s; and an evicted read
waits on SQLite's lock in a thread of its own, not on the loop."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from contextpaw.ops import admin
from contextpaw.ops.metrics import Stats
from support.redis_server import PIDS, redis_server


@pytest.fixture
def hung_redis(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as url:
        try:
            yield url
        finally:
            os.kill(PIDS[url], signal.SIGCONT)  # a stopped server cannot be stopped


async def worst_stall(work: asyncio.Future | asyncio.Task, tick: float = 0.02) -> float:
    """The longest the event loop went without running a 20 ms ticker while `work` ran."""
    worst, last = 0.0, time.monotonic()
    while not work.done():
        await asyncio.sleep(tick)
        now = time.monotonic()
        worst, last = max(worst, now - last - tick), now
    return worst


async def test_a_hung_redis_costs_a_scrape_its_archive_figures_not_the_event_loop(hung_redis: str) -> None:
    from contextpaw.ops.archive_redis import RedisStore

    async def nothing() -> dict:
        return {"backends": []}

    store = RedisStore(hung_redis, max_items=100, max_bytes=1 << 20, max_age_s=60)
    store.put("cp-1", [{"role": "user", "content": "kept"}])
    endpoints = admin.Admin(Stats(store), store, nothing, nothing, None)  # type: ignore[arg-type]
    os.kill(PIDS[hung_redis], signal.SIGSTOP)
    started = time.monotonic()
    scrape = asyncio.ensure_future(endpoints.answer("GET", "/contextpaw/metrics", None))
    stall = await worst_stall(scrape)
    reply = scrape.result()
    os.kill(PIDS[hung_redis], signal.SIGCONT)  # the thread still asking it gets its answer, and the test ends
    assert reply.status == 200 and b"contextpaw_evicted_store_up 0.0" in reply.body
    assert time.monotonic() - started < admin.STORE_WAIT_S + 1.5 and stall < 0.25, stall


async def test_an_evicted_read_that_waits_on_the_archive_waits_in_a_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite's reader waits while a long search holds the lock (5.2 s for a small chat, measured):
    the wait is the read's, in its thread, and the loop keeps serving others."""
    from contextpaw.ops.evicted import MemoryStore

    async def nothing() -> dict:
        return {"backends": []}

    store = MemoryStore(max_items=10, max_bytes=1 << 20, max_age_s=60)
    held = store.get

    def locked(ref: str):  # type: ignore[no-untyped-def]
        time.sleep(0.5)
        return held(ref)

    monkeypatch.setattr(store, "get", locked)
    endpoints = admin.Admin(Stats(store), store, nothing, nothing, None)  # type: ignore[arg-type]
    read = asyncio.ensure_future(endpoints.answer("GET", "/contextpaw/evicted/cp-0", None, trusted=True, secret=b"s" * 32))
    stall = await worst_stall(read)
    assert read.result().status == 404 and stall < 0.2, stall


async def test_garbage_under_the_archives_keys_costs_a_scrape_its_figures_not_a_500(tmp_path: Path) -> None:
    """`/contextpaw/metrics` answered 500 until the keys were cleaned."""
    import redis

    from contextpaw.ops.archive_redis import PREFIX, RedisStore

    async def nothing() -> dict:
        return {"backends": []}

    with redis_server(tmp_path) as url:
        store = RedisStore(url, max_items=100, max_bytes=1 << 20, max_age_s=60)
        raw = redis.Redis.from_url(url)
        raw.set(PREFIX + "bytes", b"not a number")
        raw.set(PREFIX + "order", b"not a sorted set")
        reply = await admin.Admin(Stats(store), store, nothing, nothing, None).answer("GET", "/contextpaw/metrics", None)  # type: ignore[arg-type]
    assert reply.status == 200 and b"contextpaw_evicted_store_up 0.0" in reply.body
