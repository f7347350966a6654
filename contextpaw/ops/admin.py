"""ContextPaw's own endpoints under `/contextpaw/`, answered by the proxy and never forwarded.

- `GET /contextpaw/health`: version, policy, backends and whether they answer (with when each last
  failed and last answered), and the counts; 503 while a backend does not answer.
- `GET /contextpaw/metrics`: the same counts per backend, route and model, histograms of compactions
  and whether each backend answers, in Prometheus text format.
- `GET /contextpaw/runtime`: which runtime owns the GPU (`contextpaw_arbitrate`).
- `GET /contextpaw/window?model=NAME`: the window the backend behind this port serves that model,
  as ContextPaw fits requests to it (what `contextpaw launch` tells an agent).
- `GET /contextpaw/evicted/<ref>`: content removed under a marker, verbatim, for an agent to re-read.
  `<ref>` is the marker's own `cp-<id>.<cap>`: the capability proves that the reader saw the marker.
  A token holder (`X-ContextPaw-Token`: the admin token, or the local token in the state dir) may
  read any id. Unknown ids and forbidden ones are answered the same 404, after the same lookup.
- `GET /contextpaw/search?q=TEXT&limit=N`: kept content whose text holds every word, as references
  and snippets; token holders only.

They reveal prompt content, so only loopback clients that name a loopback host may call them, or
holders of a token; a request a browser sends for another site (`Origin` not the proxy's own,
`Sec-Fetch-Site` neither `same-origin` nor `none`) is refused, whoever sends it.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from contextpaw import wire
from contextpaw.core import logs, parts, refs
from contextpaw.ops.evicted import EvictedStore
from contextpaw.ops.metrics import Stats, package_version

logger = logs.get(__name__)

PREFIX = "/contextpaw/"
STORE_WAIT_S = 2.0
"""How long a metrics scrape waits for the archive's figures (Prometheus's own timeout is 10 s)."""
JSON = "application/json"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    content_type: str = JSON


def json_reply(status: int, obj: Any) -> Reply:
    return Reply(status, json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace"))


NOT_KEPT = {"error": "not kept: unknown, expired, over the archive's bounds, or asked for without its marker's capability"}
"""The one answer to an id that cannot be read, whatever the reason: it says nothing of which."""
SEARCH_LIMIT = 50
SAME_SITE = ("same-origin", "none")
"""`Sec-Fetch-Site` values of requests no other site made (the proxy's own page, the user's own typing)."""


def is_admin(path: str) -> bool:
    return path.startswith(PREFIX)


def cross_site(origin: str | None, fetch_site: str | None, own_origins: tuple[str, ...]) -> bool:
    """Whether a browser sent this request for another site: an `Origin` that is not the proxy's
    own (as the client named it), or a `Sec-Fetch-Site` other than same-origin and none. Tools
    (curl, SDKs, the MCP server) send neither."""
    if origin is not None and origin.rstrip("/").lower() not in own_origins:
        return True
    return fetch_site is not None and fetch_site.strip().lower() not in SAME_SITE


def token_matches(presented: str | None, *tokens: str | None) -> bool:
    """Whether `presented` is one of `tokens` (each compared in constant time)."""
    if presented is None:
        return False
    given = presented.encode("utf-8", "surrogateescape")
    return any(bool(token) and hmac.compare_digest(given, token.encode()) for token in tokens if token)


def authorized(client_host: str, host: str | None, presented: str | None, token: str | None) -> bool:
    """The token holder (compared in constant time), or a loopback client that named a loopback
    host: a web page whose name resolves to 127.0.0.1 (DNS rebinding) is a loopback client, but its
    browser sends the page's own name as the Host."""
    if token and presented is not None and hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), token.encode()):
        return True
    return loopback_address(client_host) and loopback_host(host)


@functools.lru_cache(maxsize=256)
def loopback_address(text: str) -> bool:
    """Whether a client address is this machine's (asked for every request, of a few addresses:
    remembered, since parsing one costs more than the rest of the check)."""
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def loopback_host(host: str | None) -> bool:
    """A Host header naming this machine: `localhost`, `127.0.0.0/8` or `[::1]`, with any port."""
    if not host:
        return False
    name = host.rsplit("]", 1)[0] + "]" if host.startswith("[") else host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.rstrip(".").lower()
    return name == "localhost" or name.endswith(".localhost") or loopback_address(name)


LOCAL_SUFFIXES = (".localhost", ".local", ".internal")


@functools.lru_cache(maxsize=256)
def local_host(host: str | None, hostname: str) -> bool:
    """A Host header a local client may name for a backend: what Ollama's own check lets through
    on a loopback listener (a loopback name, an IP address, this machine's `hostname`, or a name
    under `.localhost`, `.local`, `.internal`). A DNS-rebinding page's own name is none of these."""
    if not host:
        return True  # HTTP/1.0 without a Host names nothing to rebind
    name = host.rsplit("]", 1)[0].lstrip("[") if host.startswith("[") else host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.rstrip(".").lower()
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return loopback_host(host) or name == hostname.lower() or name.endswith(LOCAL_SUFFIXES)


Window = Callable[[wire.Backend, str], Awaitable[dict[str, Any]]]
"""The window a model is served at a backend, where that number came from, how its requests are
counted, and the window an agent is told (`agent_window`)."""


class Admin:
    def __init__(
        self,
        stats: Stats,
        store: EvictedStore,
        health: Callable[[], Awaitable[dict[str, Any]]],
        runtime: Callable[[], Awaitable[dict[str, Any]]],
        window: Window,
    ) -> None:
        self.stats = stats
        self.store = store
        self.health = health
        self.runtime = runtime
        self.window = window

    async def answer(
        self,
        method: str,
        path: str,
        backend: Callable[[], Awaitable[wire.Backend | None]] | None = None,
        *,
        trusted: bool = False,
        session: str | None = None,
        secret: bytes = b"",
    ) -> Reply:
        """`backend` finds the one behind the port asked, for the endpoint that speaks of one;
        `trusted`: the caller holds the operator's token, and may read any id and search all;
        `session`: the caller holds the machine's local token (`contextpaw mcp`), and searches what
        that session evicted, reading back by capability like anyone who saw the marker; `secret`
        makes and checks the capabilities."""
        if method not in ("GET", "HEAD"):
            return json_reply(405, {"error": f"{method} is not allowed on {path}"})
        name = path.split("?", 1)[0].removeprefix(PREFIX)
        if name == "window":
            return await self.served_window(path, await backend() if backend else None)
        if name == "health":
            health = await self.health()
            down = any(not b["answers"] for b in health.get("backends", []))  # 503: a backend does not answer
            return json_reply(503 if down else 200, {"version": package_version(), **health, "stats": self.stats.counts})
        if name == "runtime":
            return json_reply(200, await self.runtime())
        if name == "metrics":  # each backend is asked whether it answers, as /health asks
            self.stats.answering = [(b["kind"], b["url"], b["answers"]) for b in (await self.health())["backends"]]
            self.stats.kept = await self._kept_figures()
            return Reply(200, generate_latest(self.stats.registry), CONTENT_TYPE_LATEST)
        if name.startswith("evicted/"):
            # off the loop always: a shared archive answers over the network, a hole of megabytes is
            # parsed for its parts, and SQLite waits on its lock while a long search holds it
            part = _part(path)
            return await asyncio.to_thread(self.evicted, name.removeprefix("evicted/"), trusted, secret, part)
        if name == "search":
            return await self.search(path, None if trusted else session, trusted or session is not None, secret)
        return json_reply(404, {"error": f"no such ContextPaw endpoint: {path}"})

    async def _kept_figures(self) -> tuple[int, int] | None:
        """(items, bytes) the archive keeps, asked in a thread within `STORE_WAIT_S` (None: it did
        not answer in time, and the scrape goes on without them): a hung Redis froze every client
        for 20 s at each scrape when the collector asked it on the event loop."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(lambda: (len(self.store), self.store.bytes)), STORE_WAIT_S)
        except Exception as e:  # a timeout, or the store's own failure (Redis down, garbage under its keys)
            logger.warning("the evicted archive's figures were not read for /contextpaw/metrics (%s)", type(e).__name__)
            return None

    def evicted(self, ref: str, trusted: bool, secret: bytes, part: int | str | None = None) -> Reply:
        """What `ref` stands for, to whoever saw its marker or holds a token: as JSON, or with
        `?part=N` as text in parts (`contextpaw.core.parts`; what a shell tool prints, each part
        under an agent's own limit). The archive is asked whether or not the capability holds, so
        that a forbidden id takes as long as an unknown one."""
        pieces = refs.split(ref)
        content = self.store.get(pieces[0] if pieces else "cp-")
        allowed = pieces is not None and (trusted or refs.readable(secret, ref) is not None)
        if content is None or not allowed:
            return json_reply(404, NOT_KEPT)
        if part is None:
            return Reply(200, b'{"id":' + json.dumps(ref).encode() + b',"content":' + content + b"}")
        if isinstance(part, str):
            return json_reply(400, {"error": f"part must be a number from 1, not {part[:40]!r}"})
        try:
            text = parts.paged(parts.rendered(json.loads(content)), ref, part, _asking)
        except parts.NoSuchPart as e:
            return json_reply(400, {"error": str(e)})
        return Reply(200, text.encode(), "text/plain; charset=utf-8")

    async def search(self, path: str, session: str | None, allowed: bool, secret: bytes) -> Reply:
        """`?q=TEXT&limit=N`: references (with their capabilities) and snippets, of one `session`
        (None: all); token holders only."""
        if not allowed:
            return json_reply(403, {"error": "searching the archive needs X-ContextPaw-Token (the admin token or the local one)"})
        query = parse_qs(urlsplit(path).query)
        text = (query.get("q") or [""])[0]
        try:
            limit = min(max(int((query.get("limit") or ["10"])[0]), 1), SEARCH_LIMIT)
        except ValueError:
            return json_reply(400, {"error": f"limit must be a number from 1 to {SEARCH_LIMIT}"})
        found = await asyncio.to_thread(self.store.search, text, limit, session)
        results = [{"ref": f"{marker_id}.{refs.capability(secret, marker_id)}", "snippet": snippet} for marker_id, snippet in found]
        return json_reply(200, {"results": results})

    async def served_window(self, path: str, backend: wire.Backend | None) -> Reply:
        """The window for `?model=`: llama-server serves one model and needs no name; Ollama's
        window is per model."""
        model = (parse_qs(urlsplit(path).query).get("model") or [""])[0]
        if backend is None:
            return json_reply(404, {"error": "this listener fronts no backend: ask the port that fronts it"})
        if not model and backend.kind == wire.Kind.OLLAMA:
            return json_reply(400, {"error": "name the model: /contextpaw/window?model=NAME (Ollama's window is per model)"})
        served = await self.window(backend, model)
        return json_reply(200, {"model": model, "backend": {"kind": backend.kind, "url": backend.url}, **served})


def _part(path: str) -> int | str | None:
    """`?part=N` of an evicted reference's path: the number, the text where it is not one (or is
    more digits than any part has: Python refuses to read an int of 5,000), None where none is asked."""
    asked = parse_qs(urlsplit(path).query).get("part")
    if not asked:
        return None
    number = asked[0].lstrip("0") or "0"
    return int(number) if number.isascii() and number.isdigit() and len(number) <= PART_DIGITS else asked[0]


PART_DIGITS = 9
"""The most digits a part number is read with: a hole's parts are counted in thousands at most."""


def _asking(part: int) -> str:
    return f"run the same command with part={part}"
