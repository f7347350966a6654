"""The archive the proxy holds: one `EvictedStore` whose kind the options choose
(`contextpaw_archive`: `sqlite`, the default, under the state directory; `memory`; or
`redis://host:port/db`, shared by several instances), reopened when they change."""

from __future__ import annotations

import builtins
from pathlib import Path

from contextpaw.ops.archive_sqlite import ARCHIVE_FILE, SqliteStore
from contextpaw.ops.evicted import EvictedStore, MemoryStore


def open_store(spec: str, state_dir: Path, *, max_items: int, max_bytes: int, max_age_s: float) -> EvictedStore:
    """The store `spec` names (see the module's note)."""
    if spec == "memory":
        return MemoryStore(max_items=max_items, max_bytes=max_bytes, max_age_s=max_age_s)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from contextpaw.ops.archive_redis import RedisStore  # redis-py, imported only when asked for

        return RedisStore(spec, max_items=max_items, max_bytes=max_bytes, max_age_s=max_age_s)
    if spec in ("", "sqlite"):
        return SqliteStore(state_dir / ARCHIVE_FILE, max_items=max_items, max_bytes=max_bytes, max_age_s=max_age_s)
    raise ValueError(f"not an archive: {spec!r} (sqlite, memory or redis://host:port/db)")


class Archive(EvictedStore):
    """The store the options name; in memory until they are read."""

    def __init__(self, *, max_items: int, max_bytes: int, max_age_s: float) -> None:
        super().__init__(max_items=max_items, max_bytes=max_bytes, max_age_s=max_age_s)
        self.store: EvictedStore = MemoryStore(max_items=max_items, max_bytes=max_bytes, max_age_s=max_age_s)
        self.opened: tuple[str, Path] | None = None

    def open(self, spec: str, state_dir: Path) -> None:
        """Use the store `spec` names (unchanged if it is the one in use); the last one is closed."""
        if self.opened == (spec, state_dir):
            return
        store = open_store(spec, state_dir, max_items=self.max_items, max_bytes=self.max_bytes, max_age_s=self.max_age_s)
        self.store, old = store, self.store
        self.opened = (spec, state_dir)
        old.close()

    def bound(self, *, max_items: int, max_bytes: int, max_age_s: float) -> None:
        super().bound(max_items=max_items, max_bytes=max_bytes, max_age_s=max_age_s)
        self.store.bound(max_items=max_items, max_bytes=max_bytes, max_age_s=max_age_s)

    @property
    def blocking_reads(self) -> bool:  # type: ignore[override]
        return self.store.blocking_reads

    def __len__(self) -> int:
        return len(self.store)

    @property
    def bytes(self) -> int:
        return self.store.bytes

    def put(self, marker_id: str, data: builtins.bytes, session: str = "") -> None:
        self.store.put(marker_id, data, session)

    def get(self, marker_id: str) -> builtins.bytes | None:
        return self.store.get(marker_id)

    def search(self, query: str, limit: int, session: str | None = None) -> list[tuple[str, str]]:
        return self.store.search(query, limit, session)

    def shared_secret(self, local: builtins.bytes) -> builtins.bytes:
        return self.store.shared_secret(local)

    @property
    def keeps_plans(self) -> bool:  # type: ignore[override]
        return self.store.keeps_plans

    @property
    def shared(self) -> bool:  # type: ignore[override]
        return self.store.shared

    def put_plan(self, key: str, data: builtins.bytes) -> None:
        self.store.put_plan(key, data)

    def get_plan(self, key: str) -> builtins.bytes | None:
        return self.store.get_plan(key)

    def put_digest(self, key: str, text: str, keep: int) -> None:
        self.store.put_digest(key, text, keep)

    def get_digests(self, limit: int) -> list[tuple[str, str]]:
        return self.store.get_digests(limit)

    def flush(self, timeout: float = 10.0) -> bool:
        return self.store.flush(timeout)

    def close(self) -> None:
        self.store.close()
