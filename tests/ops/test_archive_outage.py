"""A marker promises its content reads back: while the archive's disk or server is away, what it is
given stays readable from memory, bounded, and reaches the store once the store is back (issue 56:
before, a Redis outage lost 84 of 84 references, a full disk 560 of 560)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from contextpaw.ops import evicted
from contextpaw.ops.archive_redis import RedisStore
from contextpaw.ops.evicted import encode
from support.redis_server import redis_server


def test_a_redis_outage_holds_what_the_archive_is_given_and_writes_it_when_redis_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(evicted, "RETRY_S", 0.1)
    first = tmp_path / "first"
    first.mkdir()
    with redis_server(first) as url:
        store = RedisStore(url, max_items=1000, max_bytes=10_000_000, max_age_s=3600)
        store.put("cp-before", encode("written before the outage"))
        assert store.flush()
    try:  # the server is gone
        contents = {f"cp-{i}": encode(f"evicted during the outage {i}") for i in range(84)}
        for marker_id, data in contents.items():
            store.put(marker_id, data)
        assert store.flush(timeout=30)
        assert "cannot be written" in caplog.text
        assert all(store.get(marker_id) == data for marker_id, data in contents.items()), "read back while Redis is away"
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        again = tmp_path / "again"
        again.mkdir()
        with redis_server(again, port=port):
            client = redis.Redis.from_url(url)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and client.get(store.prefix + "data:cp-83") is None:
                time.sleep(0.1)
            assert all(client.get(store.prefix + "data:" + marker_id) == data for marker_id, data in contents.items())
            assert "written again" in caplog.text
            client.close()
    finally:
        store.close()


def test_what_a_store_holds_while_it_cannot_write_is_the_newest_within_its_bound() -> None:
    puts = [("a", b"x" * 40), ("b", b"x" * 40), ("c", b"x" * 40)]
    assert evicted.newest_within(puts, lambda put: len(put[1]), 100) == ([("b", b"x" * 40), ("c", b"x" * 40)], [("a", b"x" * 40)])
    assert evicted.newest_within(puts, lambda put: len(put[1]), 120) == (puts, [])
