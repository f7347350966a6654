"""Who can read the archive: the marker's capability or a token; unknown and forbidden ids look the
same; the secret and the local token are private and survive a restart."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from contextpaw.core import refs
from contextpaw.core.refs import Refs
from contextpaw.ops import admin, keys
from contextpaw.ops.archive_sqlite import ARCHIVE_FILE, SqliteStore
from contextpaw.ops.evicted import EvictedStore, MemoryStore, encode
from contextpaw.ops.metrics import Stats

SECRET = b"k" * 32
CONTENT = [{"role": "tool", "content": "DB_PASSWORD=hunter2-4711"}]


async def nothing(*args: Any) -> dict[str, Any]:
    return {}


def endpoints(store: EvictedStore) -> admin.Admin:
    return admin.Admin(Stats(store), store, nothing, nothing, nothing)


def kept(store: EvictedStore, content: Any = CONTENT, secret: bytes = SECRET) -> str:
    ref = Refs(secret).ref(content)
    store.put(refs.store_id(ref), encode(content))
    return ref


async def read(a: admin.Admin, ref: str, trusted: bool = False, secret: bytes = SECRET) -> tuple[int, bytes]:
    reply = await a.answer("GET", f"/contextpaw/evicted/{ref}", trusted=trusted, secret=secret)
    return reply.status, reply.body


async def test_content_is_read_back_with_its_capability_and_with_a_token_only() -> None:
    store = MemoryStore(max_items=10, max_bytes=1 << 20, max_age_s=60)
    a, ref = endpoints(store), kept(store)
    status, body = await read(a, ref)
    assert status == 200 and json.loads(body) == {"id": ref, "content": CONTENT}
    assert (await read(a, refs.store_id(ref)))[0] == 404  # the bare id: no proof of the marker
    assert (await read(a, ref, secret=b"x" * 32))[0] == 404  # another proxy's secret
    assert (await read(a, refs.store_id(ref), trusted=True))[0] == 200  # the admin or local token


async def test_unknown_and_forbidden_ids_get_the_same_answer() -> None:
    store = MemoryStore(max_items=10, max_bytes=1 << 20, max_age_s=60)
    a, ref = endpoints(store), kept(store)
    marker_id = refs.store_id(ref)
    unknown = Refs(SECRET).ref("never evicted")
    answers = {await read(a, r) for r in (unknown, marker_id, marker_id + ".0123456789abcdef", "cp-nothing", "../../etc")}
    assert len(answers) == 1 and answers.pop()[0] == 404


async def test_forbidden_and_unknown_ids_take_the_same_path_through_the_archive() -> None:
    """Both ask the archive (a forbidden id is not answered sooner), so their times are one class."""
    asked: list[str] = []

    class Counting(MemoryStore):
        def get(self, marker_id: str) -> bytes | None:
            asked.append(marker_id)
            return super().get(marker_id)

    store = Counting(max_items=10, max_bytes=1 << 20, max_age_s=60)
    a, ref = endpoints(store), kept(store)
    await read(a, refs.store_id(ref) + ".0123456789abcdef")
    await read(a, Refs(SECRET).ref("never evicted"))
    assert len(asked) == 2 and asked[0] == refs.store_id(ref)

    def timed(r: str) -> float:  # the best of five runs: the machine's load is not the endpoint's
        runs = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(500):
                a.evicted(r, False, SECRET)
            runs.append(time.perf_counter() - started)
        return min(runs)

    forbidden, unknown = timed(refs.store_id(ref) + ".0123456789abcdef"), timed(Refs(SECRET).ref("never evicted"))
    assert 0.5 < forbidden / unknown < 2


async def test_the_online_pin_attack_gets_nothing_without_the_capability() -> None:
    """The issue's online attack: every PIN's id asked for. Without the secret no ask names the
    real id, and with the real id but no capability the answer is the unknown id's."""
    store = MemoryStore(max_items=10, max_bytes=1 << 20, max_age_s=60)
    a, ref = endpoints(store), kept(store)
    hits = 0
    for pin in range(0, 10_000, 7):
        guess = Refs(b"").ref([{"role": "tool", "content": f"DB_PASSWORD=hunter2-{pin:04d}"}])
        hits += (await read(a, guess))[0] == 200
    assert hits == 0 and (await read(a, ref))[0] == 200


async def test_search_needs_a_token_and_answers_readable_references() -> None:
    store = MemoryStore(max_items=10, max_bytes=1 << 20, max_age_s=60)
    a, ref = endpoints(store), kept(store)
    kept(store, [{"role": "tool", "content": "unrelated build log"}])
    refused = await a.answer("GET", "/contextpaw/search?q=hunter2", secret=SECRET)
    assert refused.status == 403
    found = await a.answer("GET", "/contextpaw/search?q=DB_PASSWORD&limit=5", trusted=True, secret=SECRET)
    results = json.loads(found.body)["results"]
    assert [r["ref"] for r in results] == [ref] and "hunter2" in results[0]["snippet"]
    assert (await read(a, results[0]["ref"]))[0] == 200
    assert (await a.answer("GET", "/contextpaw/search?q=x&limit=many", trusted=True, secret=SECRET)).status == 400


@pytest.mark.parametrize(
    ("origin", "fetch_site", "refused"),
    [
        (None, None, False),  # curl, an SDK, the MCP server
        ("http://127.0.0.1:11435", "same-origin", False),  # the proxy's own page
        (None, "none", False),  # typed into the address bar
        ("https://evil.example", None, True),
        ("null", None, True),  # a sandboxed frame, a file: page
        (None, "cross-site", True),
        (None, "same-site", True),
        ("http://127.0.0.1:11435", "cross-site", True),
    ],
)
def test_requests_a_browser_makes_for_another_site_are_refused(origin: str | None, fetch_site: str | None, refused: bool) -> None:
    own = ("http://127.0.0.1:11435", "https://127.0.0.1:11435")
    assert admin.cross_site(origin, fetch_site, own) is refused


def test_the_secret_and_the_token_are_made_once_private_and_kept(tmp_path: Path) -> None:
    state = tmp_path / "state"
    secret, token = keys.secret(state), keys.local_token(state)
    assert len(secret) == 32 and len(token) >= 40
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for name in (keys.SECRET_FILE, keys.TOKEN_FILE):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600
    assert keys.secret(state) == secret and keys.local_token(state) == token  # the next start reuses them
    assert keys.secret(tmp_path / "other") != secret


def test_a_secret_that_is_a_link_or_the_wrong_size_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_bytes(b"x" * 32)
    (tmp_path / keys.SECRET_FILE).symlink_to(tmp_path / "elsewhere")
    assert keys.secret(tmp_path) != b"x" * 32 and not (tmp_path / keys.SECRET_FILE).is_symlink()
    (tmp_path / keys.TOKEN_FILE).write_text("short")
    assert keys.local_token(tmp_path) != "short"


async def test_a_restart_keeps_references_readable(tmp_path: Path) -> None:
    first = SqliteStore(tmp_path / ARCHIVE_FILE, max_items=10, max_bytes=1 << 20, max_age_s=60)
    ref = kept(first, secret=keys.secret(tmp_path))
    first.close()
    again = SqliteStore(tmp_path / ARCHIVE_FILE, max_items=10, max_bytes=1 << 20, max_age_s=60)
    try:
        status, body = await read(endpoints(again), ref, secret=keys.secret(tmp_path))
        assert status == 200 and json.loads(body)["content"] == CONTENT
    finally:
        again.close()
