"""The archive on disk: evicted content in SQLite (the standard library's `sqlite3`, WAL mode) under
the state directory, private to the user (a 0700 directory, 0600 files), bounded by count, bytes
and age in SQL, searchable through an FTS5 table over its text, and there again after a restart.
Two more tables share the database and its writer: `plans`, each conversation's plan (what was cut
last turn, by the keyed conversation key, as JSON), so that a conversation keeps its cuts, and the
server its cached prefix, across a restart; and `digests`, the summarizer's call cache (by call
key). Both are bounded by count and by the archive's age bound.

Writes go through one writer thread and its queue: `put` hands the content over and returns, so a
slow or full disk never holds up the event loop; until the writer has committed it, `get` answers
the content from the queue's own copy. A write that fails (a full disk) keeps its content there,
bounded by the archive's bytes (the oldest go first, said in the log), and is tried again every
`evicted.RETRY_S` and with the next write: a marker's reference reads back while the disk is away, and the
content reaches the disk once it is back.

An archive in a directory or file this user cannot write (a read-only mount) is opened read-only:
what it holds reads back, and what it is given is held as above. A damaged file (a bad page) is
moved aside and what of it still reads is copied into a new archive (`salvage`): a damaged page
costs its own contents, not the archive's. Reads of one id are made on the caller's thread, on a
connection of their own: in WAL mode a reader never waits for the writer (it reads the last
commit), and a primary-key lookup costs tens of microseconds, less than handing it to a thread
would. `search` reads the FTS index, which can take longer: the endpoint runs it in a thread.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from contextpaw.core import logs
from contextpaw.ops.evicted import SEARCH_WAIT_S, EvictedStore, Held, next_batch, searchable

logger = logs.get(__name__)

ARCHIVE_FILE = "contextpaw-archive.sqlite3"


SCHEMA = """
CREATE TABLE IF NOT EXISTS items (seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, at REAL NOT NULL,
                                  size INTEGER NOT NULL, data BLOB NOT NULL, session TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS items_at ON items (at);
CREATE VIRTUAL TABLE IF NOT EXISTS texts USING fts5 (text);
CREATE TRIGGER IF NOT EXISTS items_gone AFTER DELETE ON items BEGIN DELETE FROM texts WHERE rowid = old.seq; END;
CREATE TABLE IF NOT EXISTS plans (seq INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE, at REAL NOT NULL, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS digests (seq INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE, at REAL NOT NULL, text TEXT NOT NULL);
"""

SIDE_TABLES = ("plans", "digests")
"""The tables kept beside the evicted content, each bounded by count and age (`_write_side`)."""

TRIM = """DELETE FROM items WHERE seq IN (
    SELECT seq FROM (SELECT seq, SUM(size) OVER newest AS total, ROW_NUMBER() OVER newest AS n
                     FROM items WINDOW newest AS (ORDER BY seq DESC))
    WHERE total > ? OR n > ?)"""
"""Drop the oldest until the newest fit both the count and the byte bound."""


Put = tuple[str, str, float, "builtins.bytes | str", int, str]
"""What the writer is handed: (table, key, when, data, the count its table keeps (0: the items'
bounds), the session an item was evicted from)."""


def private_dir(path: Path) -> None:
    """Make `path` (and its parents) for this user only, if missing: 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def private_file(path: Path) -> None:
    """Make `path` an empty file for this user only (0600) if missing, and make it 0600 if not."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def fts_query(query: str) -> str:
    """Each word of `query` as an FTS5 string, all of them required: what a user types is never
    read as FTS5's own syntax (`AND`, `*`, quotes, column filters)."""
    return " ".join('"' + word.replace('"', '""') + '"' for word in query.split())


def salvage(path: Path) -> tuple[int, Path]:
    """Move a damaged archive (and its journal) aside and copy each content of it that still reads,
    one row at a time, into a new archive at `path`: (contents saved, where the damaged file went)."""
    aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            Path(f"{path}{suffix}").rename(f"{aside}{suffix}")
    private_file(path)
    new = sqlite3.connect(path, isolation_level=None)
    saved = 0
    try:
        new.executescript(SCHEMA)
        old = sqlite3.connect(f"{aside.resolve().as_uri()}?mode=ro", uri=True)
        try:
            new.execute("BEGIN")
            session = "session" if "session" in {row[1] for row in old.execute("PRAGMA table_info(items)")} else "''"
            for seq in _seqs(old):
                try:
                    row = old.execute(f"SELECT id, at, size, data, {session} FROM items WHERE seq = ?", (seq,)).fetchone()
                except sqlite3.DatabaseError:
                    continue
                if row is not None:
                    new.execute("INSERT OR IGNORE INTO items (seq, id, at, size, data, session) VALUES (?, ?, ?, ?, ?, ?)", (seq, *row))
                    new.execute("INSERT INTO texts (rowid, text) VALUES (?, ?)", (seq, searchable(bytes(row[3]))))
                    saved += 1
            new.execute("COMMIT")
        finally:
            old.close()
    except sqlite3.Error as e:  # what could not be saved is in the file moved aside
        logger.warning("salvaging %s stopped (%s) after %d contents", aside, e, saved)
        with contextlib.suppress(sqlite3.Error):
            new.execute("COMMIT")
    finally:
        new.close()
    return saved, aside


def _seqs(old: sqlite3.Connection) -> range:
    """The row numbers a damaged archive may hold: up to its highest, or, where even that does not
    read, as far as rows are found (a thousand missing in a row end the search)."""
    try:
        top = old.execute("SELECT max(seq) FROM items").fetchone()[0] or 0
    except sqlite3.DatabaseError:
        top, misses, seq = 0, 0, 0
        while misses < 1000:
            seq += 1
            try:
                found = old.execute("SELECT 1 FROM items WHERE seq = ?", (seq,)).fetchone()
            except sqlite3.DatabaseError:
                found = None
            top, misses = (seq, 0) if found else (top, misses + 1)
    return range(1, top + 1)


class SqliteStore(EvictedStore):
    """Evicted content in `path`, an SQLite database in WAL mode (see the module's note)."""

    def __init__(self, path: Path, *, max_items: int, max_bytes: int, max_age_s: float, clock: Callable[[], float] = time.time) -> None:
        super().__init__(max_items=max_items, max_bytes=max_bytes, max_age_s=max_age_s)
        self.path = path
        self._clock = clock
        self.read_only = False
        """The archive is read where it lies and written nowhere (its directory or file is not ours to write)."""
        try:
            private_dir(path.parent)
            private_file(path)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or not path.is_file():
                raise
            self.read_only = True
            logger.warning("the archive %s cannot be written (%s): what it holds is read, and new content is kept in memory", path, e)
        try:
            self._read, self._count, self._bytes = self._open()
        except sqlite3.DatabaseError as e:
            if self.read_only:
                raise
            saved, aside = salvage(path)
            logger.warning(
                "the archive %s is damaged (%s): moved to %s, and the %d contents that still read are kept", path, e, aside, saved
            )
            self._read, self._count, self._bytes = self._open()
        self._read_lock = threading.Lock()
        self._pending: dict[str, tuple[float, builtins.bytes]] = {}
        """Puts handed to the writer and not yet committed, by id: read from here meanwhile."""
        self._plans: dict[str, tuple[float, builtins.bytes]] = {}
        """Plans handed to the writer and not yet committed, by conversation key."""
        self._pending_lock = threading.Lock()
        self._queue: queue.SimpleQueue[Put | threading.Event | None] = queue.SimpleQueue()
        self._held: Held[Put] = Held(str(path), lambda put: len(put[3]) if put[0] == "items" else 0)
        """Puts a failed write left (in `_pending` too) until a write takes them."""
        self._writer = threading.Thread(target=self._write_loop, name="contextpaw-archive", daemon=True)
        self._writer.start()

    def _open(self) -> tuple[sqlite3.Connection, int, int]:
        """The readers' connection, checked whole (`quick_check`: a damaged page raises here, not on
        the read that meets it), and the contents' count and bytes."""
        db = self._connect()
        try:
            if not self.read_only:
                db.executescript(SCHEMA)
                if "session" not in {row[1] for row in db.execute("PRAGMA table_info(items)")}:  # an archive of 0.3
                    db.execute("ALTER TABLE items ADD COLUMN session TEXT NOT NULL DEFAULT ''")
            verdict = db.execute("PRAGMA quick_check").fetchone()[0]
            if verdict != "ok":
                raise sqlite3.DatabaseError(verdict)
            count, size = db.execute("SELECT count(*), coalesce(sum(size), 0) FROM items").fetchone()
        except BaseException:
            db.close()
            raise
        return db, count, size

    def _connect(self) -> sqlite3.Connection:
        if self.read_only:  # no journal to write beside it: read as it lies
            return sqlite3.connect(
                f"{self.path.resolve().as_uri()}?mode=ro&immutable=1", uri=True, check_same_thread=False, isolation_level=None
            )
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def __len__(self) -> int:
        return self._count + len(self._pending)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, marker_id: str, data: builtins.bytes, session: str = "") -> None:
        at = self._clock()
        with self._pending_lock:
            self._pending[marker_id] = (at, data)
        self._queue.put(("items", marker_id, at, data, 0, session))

    keeps_plans = True

    def put_plan(self, key: str, data: builtins.bytes) -> None:
        at = self._clock()
        with self._pending_lock:
            self._plans[key] = (at, data)
        self._queue.put(("plans", key, at, data, self.max_items, ""))

    def get_plan(self, key: str) -> builtins.bytes | None:
        oldest = self._clock() - self.max_age_s
        with self._pending_lock:
            pending = self._plans.get(key)
        if pending is not None:
            return pending[1] if pending[0] >= oldest else None
        with self._read_lock:
            row = self._read.execute("SELECT data FROM plans WHERE key = ? AND at >= ?", (key, oldest)).fetchone()
        return bytes(row[0]) if row else None

    def put_digest(self, key: str, text: str, keep: int) -> None:
        self._queue.put(("digests", key, self._clock(), text, keep, ""))

    def get_digests(self, limit: int) -> list[tuple[str, str]]:
        sql = "SELECT key, text FROM (SELECT seq, key, text FROM digests WHERE at >= ? ORDER BY seq DESC LIMIT ?) ORDER BY seq"
        with self._read_lock:
            return self._read.execute(sql, (self._clock() - self.max_age_s, limit)).fetchall()

    def get(self, marker_id: str) -> builtins.bytes | None:
        oldest = self._clock() - self.max_age_s
        with self._pending_lock:
            pending = self._pending.get(marker_id)
        if pending is not None:
            return pending[1] if pending[0] >= oldest and len(pending[1]) <= self.max_bytes else None
        with self._read_lock:
            row = self._read.execute("SELECT data FROM items WHERE id = ? AND at >= ?", (marker_id, oldest)).fetchone()
        return bytes(row[0]) if row else None

    def search(self, query: str, limit: int, session: str | None = None) -> list[tuple[str, str]]:
        if not query.split() or limit < 1:
            return []
        self.flush(SEARCH_WAIT_S)  # the content just evicted is what an agent looks for first
        sql = (
            "SELECT items.id, snippet(texts, 0, '', '', '…', 24) FROM texts JOIN items ON items.seq = texts.rowid"
            " WHERE texts MATCH ? AND items.at >= ? AND (? IS NULL OR items.session = ?) ORDER BY rank LIMIT ?"
        )
        with self._read_lock:
            rows = self._read.execute(sql, (fts_query(query), self._clock() - self.max_age_s, session, session, limit)).fetchall()
        return [(marker_id, " ".join(text.split())) for marker_id, text in rows]

    def flush(self, timeout: float = 10.0) -> bool:
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=30)
        with self._read_lock:
            self._read.close()

    # -- the writer thread ----------------------------------------------------------------------

    def _write_loop(self) -> None:
        db = self._connect()
        try:
            while True:
                batch = next_batch(self._queue, bool(self._held.puts))
                puts = [item for item in batch if isinstance(item, tuple)]
                if puts or self._held.puts:
                    self._forget_pending(self._held.write(functools.partial(self._write, db), puts, self.max_bytes, (sqlite3.Error,)))
                for item in batch:
                    if isinstance(item, threading.Event):
                        item.set()
                if batch and batch[-1] is None:
                    self._held.closed()
                    return
        finally:
            db.close()

    def _write(self, db: sqlite3.Connection, puts: list[Put]) -> None:
        """One transaction for a batch of puts; the count and the bytes are kept up to date as it
        goes (a scan of the whole table only when a bound is passed)."""
        count, size = self._count, self._bytes
        db.execute("BEGIN IMMEDIATE")
        try:
            self._write_side(db, puts)
            for table, marker_id, at, data, _, session in puts:
                if table != "items":
                    continue
                assert isinstance(data, builtins.bytes)
                old = db.execute("SELECT size FROM items WHERE id = ?", (marker_id,)).fetchone()
                if old is not None:
                    db.execute("DELETE FROM items WHERE id = ?", (marker_id,))
                    count, size = count - 1, size - old[0]
                if len(data) > self.max_bytes:
                    continue
                seq = db.execute(
                    "INSERT INTO items (id, at, size, data, session) VALUES (?, ?, ?, ?, ?)", (marker_id, at, len(data), data, session)
                ).lastrowid
                db.execute("INSERT INTO texts (rowid, text) VALUES (?, ?)", (seq, searchable(data)))
                count, size = count + 1, size + len(data)
            oldest = self._clock() - self.max_age_s
            expired, expired_size = db.execute("SELECT count(*), coalesce(sum(size), 0) FROM items WHERE at < ?", (oldest,)).fetchone()
            if expired:
                db.execute("DELETE FROM items WHERE at < ?", (oldest,))
                count, size = count - expired, size - expired_size
            if count > self.max_items or size > self.max_bytes:
                db.execute(TRIM, (self.max_bytes, self.max_items))
                count, size = db.execute("SELECT count(*), coalesce(sum(size), 0) FROM items").fetchone()
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        self._count, self._bytes = count, size
        self._forget_pending(puts)

    def _write_side(self, db: sqlite3.Connection, puts: list[Put]) -> None:
        """The plans and digests of a batch: each replaces the one of its key, then the oldest go
        past the age bound and past the count the put named (a plan: the archive's item bound)."""
        oldest = self._clock() - self.max_age_s
        for table in SIDE_TABLES:
            mine = [put for put in puts if put[0] == table]
            if not mine:
                continue
            column = "data" if table == "plans" else "text"
            for _, key, at, data, _, _ in mine:
                db.execute(f"DELETE FROM {table} WHERE key = ?", (key,))
                db.execute(f"INSERT INTO {table} (key, at, {column}) VALUES (?, ?, ?)", (key, at, data))
            keep = mine[-1][4]
            db.execute(f"DELETE FROM {table} WHERE at < ?", (oldest,))
            db.execute(f"DELETE FROM {table} WHERE seq <= (SELECT seq FROM {table} ORDER BY seq DESC LIMIT 1 OFFSET ?)", (keep,))

    def _forget_pending(self, puts: list[Put]) -> None:
        with self._pending_lock:
            for table, key, at, data, _, _ in puts:
                pending = self._pending if table == "items" else self._plans if table == "plans" else None
                if pending is not None and pending.get(key) == (at, data):
                    del pending[key]
