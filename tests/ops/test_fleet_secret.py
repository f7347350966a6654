"""A fleet of instances shares one secret through Redis. A Redis restarted empty (no persistence:
here FLUSHALL on a real `redis-server`) loses it: the running instance sets it again with its next
write, so an instance that starts after joins it; and where another instance set a new one first,
the split is said, not left silent."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from contextpaw.ops.archive_redis import RedisStore
from support.redis_server import redis_server


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as found:
        yield found


def store(url: str) -> RedisStore:
    return RedisStore(url, max_items=100, max_bytes=1 << 20, max_age_s=60)


def test_a_redis_restarted_empty_gets_the_fleets_secret_back_from_the_running_instance(url: str, caplog: pytest.LogCaptureFixture) -> None:
    first = store(url)
    secret = first.shared_secret(b"a" * 32)
    redis.Redis.from_url(url).flushall()  # restarted empty
    first.put("cp-1", b'[{"role": "user", "content": "kept"}]')
    first.flush()
    assert any("had lost the fleet's secret" in r.getMessage() for r in caplog.records)
    assert store(url).shared_secret(b"b" * 32) == secret, "the next instance joins the running one"


def test_a_fleet_split_by_a_lost_secret_is_said(url: str, caplog: pytest.LogCaptureFixture) -> None:
    first = store(url)
    first.shared_secret(b"a" * 32)
    redis.Redis.from_url(url).flushall()
    assert store(url).shared_secret(b"b" * 32) == b"b" * 32, "a new instance set its own before the running one wrote"
    with caplog.at_level(logging.ERROR):
        first.put("cp-1", b"[]")
        first.flush()
        first.put("cp-2", b"[]")
        first.flush()
    split = [r for r in caplog.records if "the fleet is split" in r.getMessage()]
    assert len(split) == 1, "said once"
