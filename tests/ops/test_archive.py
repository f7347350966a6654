"""Every evicted store through one suite: the in-memory one, the SQLite archive and the Redis one
(against a real redis-server of the test's own) keep, bound, expire and search the same way."""

from __future__ import annotations

import json
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from contextpaw.ops.archive import Archive
from contextpaw.ops.archive_sqlite import ARCHIVE_FILE, SqliteStore
from contextpaw.ops.evicted import EvictedStore, MemoryStore, encode
from support.redis_server import redis_server


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


Opener = Callable[..., EvictedStore]
"""(clock, **bounds) -> a store over the same place each call (a restart)."""

KINDS = ["memory", "sqlite", "redis"]
REDIS_SCALE = 0.1
"""Redis ages content by its own clock: its age tests run at a tenth of the time, really waited."""


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(params=KINDS)
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    opened: list[EvictedStore] = []
    url = request.getfixturevalue("redis_url") if request.param == "redis" else ""
    if url:
        from contextpaw.ops.archive_redis import RedisStore

        RedisStore(url, max_items=1, max_bytes=1, max_age_s=1).clear()

    def open_store(clock: Clock, **bounds: float) -> EvictedStore:
        limits = {"max_items": 100, "max_bytes": 1 << 20, "max_age_s": 60} | bounds
        store: EvictedStore
        if request.param == "memory":
            store = MemoryStore(**limits, clock=clock)  # type: ignore[arg-type]
        elif request.param == "sqlite":
            store = SqliteStore(tmp_path / "state" / ARCHIVE_FILE, **limits, clock=clock)  # type: ignore[arg-type]
        else:
            from contextpaw.ops.archive_redis import RedisStore

            store = RedisStore(url, **limits)  # type: ignore[arg-type]
        opened.append(store)
        return store

    open_store.kind = request.param  # type: ignore[attr-defined]
    open_store.scale = REDIS_SCALE if request.param == "redis" else 1.0  # type: ignore[attr-defined]
    yield open_store
    for store in opened:
        store.close()


def advance(opener: Opener, clock: Clock, seconds: float) -> None:
    """Time passes: on the test's clock, or really (Redis keeps its own)."""
    if opener.kind == "redis":  # type: ignore[attr-defined]
        time.sleep(seconds)
    clock.now += seconds


def test_content_comes_back_verbatim_and_unknown_ids_are_none(opener: Opener) -> None:
    s = opener(Clock())
    content = [{"role": "tool", "content": 'ünïcode \n\t and "quotes" \udc80'}]
    s.put("cp-1", encode(content))
    assert s.get("cp-1") == encode(content)
    assert s.flush() and s.get("cp-1") == encode(content)
    assert json.loads(s.get("cp-1") or b"")[0]["content"].startswith("ünïcode")
    assert s.get("cp-unknown") is None


def test_count_bound_drops_the_oldest(opener: Opener) -> None:
    s = opener(Clock(), max_items=2)
    for i in range(3):
        s.put(f"cp-{i}", encode("x"))
    s.flush()
    assert (s.get("cp-0"), len(s)) == (None, 2)
    assert s.get("cp-1") is not None and s.get("cp-2") is not None


def test_byte_bound_drops_the_oldest_and_refuses_what_never_fits(opener: Opener) -> None:
    s = opener(Clock(), max_bytes=20)
    s.put("cp-a", encode("a" * 10))
    s.put("cp-b", encode("b" * 10))
    s.flush()
    assert s.get("cp-a") is None and s.get("cp-b") is not None
    s.put("cp-huge", encode("c" * 100))
    s.flush()
    assert s.get("cp-huge") is None and s.bytes == 12


def test_age_bound_expires_and_a_repeat_refreshes(opener: Opener) -> None:
    clock, scale = Clock(), opener.scale  # type: ignore[attr-defined]
    s = opener(clock, max_age_s=10 * scale)
    s.put("cp-old", encode("x"))
    s.put("cp-kept", encode("y"))
    s.flush()
    advance(opener, clock, 8 * scale)
    s.put("cp-kept", encode("y"))
    s.flush()
    advance(opener, clock, 3 * scale)
    assert s.get("cp-old") is None and s.get("cp-kept") is not None
    assert [ref for ref, _ in s.search("y", 5)] == ["cp-kept"]


def test_search_finds_every_word_and_shows_where(opener: Opener) -> None:
    s = opener(Clock())
    s.put("cp-env", encode([{"role": "tool", "content": "DB_HOST=db.internal\nDB_PASSWORD=hunter2"}]))
    s.put("cp-log", encode([{"role": "tool", "content": "GET /health 200\nGET /metrics 500 UnicodeEncodeError"}]))
    s.flush()
    found = s.search("metrics UnicodeEncodeError", 10)
    assert [ref for ref, _ in found] == ["cp-log"] and "UnicodeEncodeError" in found[0][1]
    assert s.search("nothing-like-this", 10) == [] and s.search("  ", 10) == []
    assert s.search('" OR * NEAR(', 10) == []  # what a user types is never the database's syntax
    assert len(s.search("GET", 1)) == 1


def test_a_restart_keeps_what_the_archive_held(opener: Opener) -> None:
    clock = Clock()
    first = opener(clock)
    first.put("cp-1", encode("kept across restarts"))
    first.close()
    again = opener(clock)
    durable = opener.kind != "memory"  # type: ignore[attr-defined]
    assert (again.get("cp-1") == encode("kept across restarts")) is durable
    assert bool(again.search("restarts", 5)) is durable and (len(again) == 1) is durable


def test_the_archive_is_private_to_its_user(tmp_path: Path) -> None:
    state = tmp_path / "new" / "state"
    s = SqliteStore(state / ARCHIVE_FILE, max_items=10, max_bytes=1 << 20, max_age_s=60)
    s.put("cp-1", encode("secret"))
    s.flush()
    try:
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        files = [p for p in state.iterdir() if p.name.startswith(ARCHIVE_FILE)]
        assert {p.name for p in files} >= {ARCHIVE_FILE, ARCHIVE_FILE + "-wal"}
        assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: 0o600 for p in files}
    finally:
        s.close()


def slowed_writes(monkeypatch: pytest.MonkeyPatch, disk: Callable[[], object]) -> None:
    """Every write of the SQLite archive's writer thread waits on `disk` first (a slow or stuck disk)."""
    write = SqliteStore._write

    def slow_write(self: SqliteStore, *args: object) -> None:
        disk()
        write(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(SqliteStore, "_write", slow_write)


def test_put_returns_while_the_disk_is_stuck_and_get_answers_meanwhile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that takes seconds per write holds up the writer thread, never the caller."""
    stuck = threading.Event()
    slowed_writes(monkeypatch, lambda: stuck.wait(30))
    s = SqliteStore(tmp_path / ARCHIVE_FILE, max_items=10, max_bytes=1 << 20, max_age_s=60)
    try:
        started = time.perf_counter()
        for i in range(50):
            s.put(f"cp-{i}", encode(f"content {i}"))
        assert time.perf_counter() - started < 0.5
        assert s.get("cp-49") == encode("content 49") and not s.flush(timeout=0.2)
        stuck.set()
        assert s.flush() and s.get("cp-49") == encode("content 49") and len(s) == 10
    finally:
        stuck.set()
        s.close()


def test_a_search_right_after_an_eviction_finds_what_was_evicted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent searches for what the marker it just read names: the write behind the put is
    waited for, however slow the disk."""
    slowed_writes(monkeypatch, lambda: time.sleep(0.3))
    s = SqliteStore(tmp_path / ARCHIVE_FILE, max_items=10, max_bytes=1 << 20, max_age_s=60)
    try:
        s.put("cp-fresh", encode([{"role": "tool", "content": "a log line from the build"}]))
        assert [ref for ref, _ in s.search("log line", 3)] == ["cp-fresh"]
    finally:
        s.close()


def test_the_archive_opens_what_the_options_name(tmp_path: Path) -> None:
    archive = Archive(max_items=10, max_bytes=1 << 20, max_age_s=60)
    assert isinstance(archive.store, MemoryStore)
    archive.open("sqlite", tmp_path)
    archive.bound(max_items=1, max_bytes=1 << 20, max_age_s=60)
    archive.put("cp-1", encode("one"))
    archive.put("cp-2", encode("two"))
    archive.flush()
    assert isinstance(archive.store, SqliteStore) and (tmp_path / ARCHIVE_FILE).exists()
    assert archive.get("cp-1") is None and archive.get("cp-2") == encode("two") and len(archive) == 1
    archive.open("memory", tmp_path)
    assert isinstance(archive.store, MemoryStore) and archive.get("cp-2") is None
    with pytest.raises(ValueError, match="not an archive"):
        archive.open("postgres://x", tmp_path)
    archive.close()


# -- plans and digests beside the evicted content ------------------------------------------------


def test_a_plan_put_before_a_restart_is_got_after_it(opener: Opener) -> None:
    clock = Clock()
    first = opener(clock)
    first.put_plan("conv-1", b'{"evicted": ["u1"]}')
    first.flush()  # Redis reads what its writer wrote; SQLite answers its pending copy anyway
    kept = opener.kind != "memory"  # type: ignore[attr-defined]
    assert first.keeps_plans is kept and (first.get_plan("conv-1") == b'{"evicted": ["u1"]}') is kept
    first.close()
    again = opener(clock)
    assert (again.get_plan("conv-1") == b'{"evicted": ["u1"]}') is kept and again.get_plan("conv-2") is None


def test_plans_are_bounded_by_count_and_age(tmp_path: Path) -> None:
    clock = Clock()
    s = SqliteStore(tmp_path / ARCHIVE_FILE, max_items=2, max_bytes=1 << 20, max_age_s=60, clock=clock)
    for n in range(3):
        s.put_plan(f"conv-{n}", b"{}")
        clock.now += 1
    s.put_plan("conv-1", b'{"again": true}')  # a new turn of it: the newest now
    s.close()
    clock.now += 30
    s = SqliteStore(tmp_path / ARCHIVE_FILE, max_items=2, max_bytes=1 << 20, max_age_s=60, clock=clock)
    try:
        assert [s.get_plan(f"conv-{n}") for n in range(3)] == [None, b'{"again": true}', b"{}"]
        clock.now = 1_062.5  # conv-2 was put at 1002, and again conv-1 at 1003
        assert [s.get_plan(f"conv-{n}") for n in range(3)] == [None, b'{"again": true}', None]
    finally:
        s.close()


def test_digests_survive_a_restart_newest_kept_within_the_bounds(tmp_path: Path) -> None:
    clock = Clock()
    s = SqliteStore(tmp_path / ARCHIVE_FILE, max_items=100, max_bytes=1 << 20, max_age_s=60, clock=clock)
    for n in range(3):
        s.put_digest(f"call-{n}", f"digest {n}", 2)
        clock.now += 1
    s.put_digest("call-1", "digest 1", 2)  # used again: the newest
    s.close()
    s = SqliteStore(tmp_path / ARCHIVE_FILE, max_items=100, max_bytes=1 << 20, max_age_s=60, clock=clock)
    try:
        assert s.get_digests(10) == [("call-2", "digest 2"), ("call-1", "digest 1")]
        assert s.get_digests(1) == [("call-1", "digest 1")]
        clock.now += 61
        assert s.get_digests(10) == []
    finally:
        s.close()


def test_stores_that_keep_no_digests_give_none_back(opener: Opener) -> None:
    store = opener(Clock())
    store.put_digest("call-1", "digest", 10)
    store.flush()
    assert store.get_digests(10) == ([("call-1", "digest")] if opener.kind == "sqlite" else [])  # type: ignore[attr-defined]


def test_a_full_disk_holds_what_the_archive_is_given_and_writes_it_once_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite itself refuses the writes (`max_page_count`: SQLITE_FULL, as a full disk answers).
    Before, each failed batch was dropped: 560 of 560 references unreadable with a 200 and a
    marker. Now what the archive is given reads back meanwhile and reaches the disk once it can."""
    import sqlite3

    from contextpaw.ops import evicted

    connections: list[sqlite3.Connection] = []
    connect = SqliteStore._connect

    def kept_handle(self: SqliteStore) -> sqlite3.Connection:
        db = connect(self)
        connections.append(db)
        return db

    monkeypatch.setattr(SqliteStore, "_connect", kept_handle)
    monkeypatch.setattr(evicted, "RETRY_S", 0.05)
    path = tmp_path / ARCHIVE_FILE
    s = SqliteStore(path, max_items=1000, max_bytes=10_000_000, max_age_s=3600)
    try:
        assert s.flush()
        writer = connections[-1]
        pages = writer.execute("PRAGMA page_count").fetchone()[0]
        writer.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full
        for i in range(60):
            s.put(f"cp-{i}", encode(f"content {i} " + "x" * 10_000))
        assert s.flush()
        on_disk = sqlite3.connect(path).execute("SELECT count(*) FROM items").fetchone()[0]
        assert on_disk == 0 and "cannot be written" in caplog.text
        assert all(s.get(f"cp-{i}") == encode(f"content {i} " + "x" * 10_000) for i in range(60)), "read back while the disk is full"
        writer.execute("PRAGMA max_page_count = 1073741823")  # room again
        deadline = time.monotonic() + 10
        while sqlite3.connect(path).execute("SELECT count(*) FROM items").fetchone()[0] < 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sqlite3.connect(path).execute("SELECT count(*) FROM items").fetchone()[0] == 60
        assert "written again" in caplog.text
    finally:
        s.close()
    again = SqliteStore(path, max_items=1000, max_bytes=10_000_000, max_age_s=3600)
    try:
        assert again.get("cp-59") == encode("content 59 " + "x" * 10_000)
    finally:
        again.close()


def test_what_a_full_disk_leaves_in_memory_is_bounded_by_the_archives_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sqlite3

    connections: list[sqlite3.Connection] = []
    connect = SqliteStore._connect
    monkeypatch.setattr(SqliteStore, "_connect", lambda self: connections.append(db := connect(self)) or db)
    s = SqliteStore(tmp_path / ARCHIVE_FILE, max_items=1000, max_bytes=50_000, max_age_s=3600)
    try:
        assert s.flush()
        connections[-1].execute(f"PRAGMA max_page_count = {connections[-1].execute('PRAGMA page_count').fetchone()[0]}")
        for i in range(20):
            s.put(f"cp-{i}", encode("y" * 10_000))
            assert s.flush()
        held = [i for i in range(20) if s.get(f"cp-{i}") is not None]
        assert held == list(range(16, 20)), "the newest that fit 50,000 bytes"
    finally:
        s.close()


def test_a_damaged_page_costs_its_own_contents_not_the_archive(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One page of the file overwritten: before, the whole archive fell back to memory and 112 of
    112 older references became unreadable. Now the file is moved aside and what still reads is
    kept."""
    import sqlite3

    path = tmp_path / ARCHIVE_FILE
    s = SqliteStore(path, max_items=1000, max_bytes=10_000_000, max_age_s=3600)
    for i in range(150):
        s.put(f"cp-{i}", encode(f"content {i} " + "z" * 1500))
    s.close()
    db = sqlite3.connect(path)
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    (page,) = db.execute(
        "SELECT pageno FROM dbstat WHERE name = 'items' AND pagetype = 'leaf' ORDER BY pageno LIMIT 1 OFFSET 20"
    ).fetchone()
    db.close()
    with open(path, "r+b") as file:
        file.seek((page - 1) * page_size)
        file.write(b"\xde\xad" * (page_size // 2))
    again = SqliteStore(path, max_items=1000, max_bytes=10_000_000, max_age_s=3600)
    try:
        readable = [i for i in range(150) if again.get(f"cp-{i}") == encode(f"content {i} " + "z" * 1500)]
        assert 140 <= len(readable) < 150, f"{len(readable)} of 150 read back"
        assert "is damaged" in caplog.text and list(tmp_path.glob(f"{ARCHIVE_FILE}.damaged-*"))
        again.put("cp-new", encode("after the salvage"))
        assert again.flush() and again.get("cp-new") == encode("after the salvage")
    finally:
        again.close()


def test_an_archive_this_user_cannot_write_is_read_and_new_content_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read-only state dir: before, an intact archive there was ignored for an empty one in memory."""
    import errno

    from contextpaw.ops import archive_sqlite

    path = tmp_path / ARCHIVE_FILE
    s = SqliteStore(path, max_items=1000, max_bytes=10_000_000, max_age_s=3600)
    s.put("cp-old", encode("kept before"))
    s.close()

    def refused(_: Path) -> None:  # what a read-only mount answers (root passes a mere chmod)
        raise PermissionError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(archive_sqlite, "private_file", refused)
    ro = SqliteStore(path, max_items=1000, max_bytes=10_000_000, max_age_s=3600)
    try:
        assert ro.read_only and "cannot be written" in caplog.text
        assert ro.get("cp-old") == encode("kept before")
        ro.put("cp-new", encode("held in memory"))
        assert ro.flush() and ro.get("cp-new") == encode("held in memory")
    finally:
        ro.close()
    monkeypatch.undo()
    after = SqliteStore(path, max_items=1000, max_bytes=10_000_000, max_age_s=3600)
    try:
        assert after.get("cp-old") == encode("kept before") and after.get("cp-new") is None, "nothing was written there"
    finally:
        after.close()
