"""ContextPaw's own endpoints under `/contextpaw/`, answered by the proxy and never forwarded.

- `GET /contextpaw/health`: version, policy, backends and whether they answer, and the counts.
- `GET /contextpaw/metrics`: the same counts per backend, route and model, histograms of compactions
  and whether each backend answers, in Prometheus text format.
- `GET /contextpaw/runtime`: which runtime owns the GPU (`contextpaw_arbitrate`).
- `GET /contextpaw/window?model=NAME`: the window the backend behind this port serves that model,
  as ContextPaw fits requests to it (what `contextpaw launch` tells an agent).
- `GET /contextpaw/evicted/<id>`: content removed under a marker, verbatim, for an agent to re-read.

They reveal prompt content, so only loopback clients that name a loopback host may call them, or
holders of the access token.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from contextpaw import wire
from contextpaw.ops.evicted import EvictedStore
from contextpaw.ops.metrics import Stats

PREFIX = "/contextpaw/"
JSON = "application/json"


def package_version() -> str:
    try:
        return version("contextpaw")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    content_type: str = JSON


def json_reply(status: int, obj: Any) -> Reply:
    return Reply(status, json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace"))


def is_admin(path: str) -> bool:
    return path.startswith(PREFIX)


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

    async def answer(self, method: str, path: str, backend: Callable[[], Awaitable[wire.Backend | None]] | None = None) -> Reply:
        """`backend` finds the one behind the port asked, for the endpoint that speaks of one."""
        if method not in ("GET", "HEAD"):
            return json_reply(405, {"error": f"{method} is not allowed on {path}"})
        name = path.split("?", 1)[0].removeprefix(PREFIX)
        if name == "window":
            return await self.served_window(path, await backend() if backend else None)
        if name == "health":
            return json_reply(200, {"version": package_version(), **await self.health(), "stats": self.stats.counts})
        if name == "runtime":
            return json_reply(200, await self.runtime())
        if name == "metrics":  # each backend is asked whether it answers, as /health asks
            self.stats.answering = [(b["kind"], b["url"], b["answers"]) for b in (await self.health())["backends"]]
            return Reply(200, generate_latest(self.stats.registry), CONTENT_TYPE_LATEST)
        if name.startswith("evicted/"):
            marker_id = name.removeprefix("evicted/")
            content = self.store.get(marker_id)
            if content is None:
                return json_reply(404, {"error": f"{marker_id} is not kept (unknown, expired, or over the store's bounds)"})
            return Reply(200, b'{"id":' + json.dumps(marker_id).encode() + b',"content":' + content + b"}")
        return json_reply(404, {"error": f"no such ContextPaw endpoint: {path}"})

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
