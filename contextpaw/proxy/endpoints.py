"""The shell of ContextPaw's own endpoints and of the Host check: `/contextpaw/*` is answered here
(by `admin.Admin`) and never forwarded, and a backend route keeps the backends' own Host defence."""

from __future__ import annotations

import asyncio
import functools
import math
import re
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import ctx, http
from mitmproxy.net.http import url
from mitmproxy.proxy import mode_specs

from contextpaw import wire
from contextpaw.calls.session import HttpServices
from contextpaw.core import logs
from contextpaw.fitting.fitter import Fitter
from contextpaw.fitting.sizing import ANCHOR_MARGIN
from contextpaw.ops import admin, keys
from contextpaw.ops.evicted import EvictedStore
from contextpaw.ops.metrics import FailureLedger
from contextpaw.proxy.backends import Backends
from contextpaw.proxy.replies import ADMIN_MARK, REFUSED_MARK, flag, refused_comment, reply
from contextpaw.proxy.web import widen_comments
from contextpaw.wire.streams import report_bytes

CLIENT_HOST = "contextpaw.client_host"
"""The Host header the client sent (reverse mode replaces it with the backend's)."""
HOST_SHAPE = re.compile(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
"""A Host that may be written into a marker's command: a name or an address, and a port."""


def client_host(flow: http.HTTPFlow) -> str | None:
    """The Host the client named (reverse mode: kept aside before mitmproxy rewrote it)."""
    return flow.metadata.get(CLIENT_HOST, flow.request.host_header)


def proxy_url(flow: http.HTTPFlow) -> str:
    """Where the client reached the proxy, as it named it (`http://host:port`), for the command a
    marker gives: the Host it sent in reverse mode, else the address it connected to."""
    scheme = "https" if flow.client_conn.tls_established else "http"
    host = client_host(flow) if isinstance(flow.client_conn.proxy_mode, mode_specs.ReverseMode) else None
    if host and HOST_SHAPE.fullmatch(host):
        return f"{scheme}://{host}"
    sockname = flow.client_conn.sockname
    if sockname and sockname[1]:
        address = sockname[0]
        return f"{scheme}://{f'[{address}]' if ':' in address else address}:{sockname[1]}"
    return ""


logger = logs.get(__name__)


def _target(backend_url: str) -> str:
    """A backend's "host:port", as the failure ledger keys it."""
    parts = urlsplit(backend_url)
    return f"{parts.hostname or ''}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def how_to_start(kind: str | None, backend_url: str) -> str:
    """What to run so that a backend answers at its URL."""
    parts = urlsplit(backend_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    if kind == "ollama":
        return f"start it with `OLLAMA_HOST={host}:{port} ollama serve` (requests to it are answered 502 until then)"
    if kind == "llamacpp":
        return f"start it with `llama-server -m MODEL.gguf --host {host} --port {port}` (requests to it are answered 502 until then)"
    return f"start the server that should listen at {backend_url} (requests to it are answered 502 until then)"


class AdminEndpoints:
    """`/contextpaw/*` (health, metrics, evicted content, the GPU runtime): answered here, never
    forwarded; loopback only unless a token is set."""

    def __init__(
        self,
        backends: Backends,
        fitter: Fitter,
        services: HttpServices,
        ledger: FailureLedger,
        store: EvictedStore,
        runtime: Callable[[], Awaitable[dict[str, Any]]],
    ) -> None:
        self.backends = backends
        self.fitter = fitter
        self.services = services
        self.ledger = ledger
        self.admin = admin.Admin(ledger.stats, store, self._health, runtime, self._window)
        self.rewrites_host = False
        self.hostname = socket.gethostname()
        """This machine's name, a Host a local client may name (read once, not per request)."""
        self.local_token: str | None = None
        """The local tools' token (`ops.keys`, in the state dir), read when the state dir is set."""
        self.started_probe: asyncio.Task[None] | None = None
        """The probe of the backends at start (kept, so that it is not collected while it runs)."""

    def configure(self, updated: set[str]) -> None:
        if {"contextpaw_state_dir", "confdir"} & updated and "contextpaw_state_dir" in ctx.options:
            state_dir = Path(ctx.options.contextpaw_state_dir or ctx.options.confdir).expanduser()
            try:
                self.local_token = keys.local_token(state_dir)
            except OSError as e:
                logger.warning("no local token in %s (%s): local tools need the admin token", state_dir, e)
                self.local_token = None

    def load(self, loader: Any) -> None:
        loader.add_option(
            "contextpaw_admin_token",
            str | None,
            None,
            "Token (header X-ContextPaw-Token) that lets non-loopback clients use /contextpaw/*.",
        )

    def running(self) -> None:
        """Warn of listeners off the loopback; and see the Host each client sent, which reverse mode
        replaces before any hook: mitmproxy is told to keep it, and `requestheaders` rewrites it as
        mitmproxy would have, for every flow but the admin check. With `-n` (no server, as when
        reading a flow file) nothing listens, and nothing is said."""
        listening = "server" not in ctx.options or ctx.options.server
        for spec in ctx.options.mode if listening else ():
            host = mode_specs.ProxyMode.parse(spec).listen_host(ctx.options.listen_host)
            if not admin.loopback_address(host) and host != "localhost":
                logger.warning(
                    "listening on %s (%s), not on the loopback: other machines can reach the backends through it",
                    host or "every interface",
                    spec,
                )
        if "keep_host_header" in ctx.options and not ctx.options.keep_host_header:  # a proxy's option (not in taddons)
            self.rewrites_host = True
            ctx.options.update(keep_host_header=True)
        widen_comments(ctx.master)  # mitmweb's comment column, where each flow's route, cut or fix is said
        try:
            self.started_probe = asyncio.get_running_loop().create_task(self._say_who_is_down())
        except RuntimeError:  # no event loop (an addon test): nothing to probe with
            pass

    async def _say_who_is_down(self) -> None:
        """Once at start, in a task of its own (clients are served meanwhile): each configured
        backend is asked whether it answers (a connection, `PROBE_TIMEOUT_S` at most), and one that
        does not is named with how to start it."""
        rows = await self._backends()
        for row in rows:
            if not row["answers"]:
                logger.warning("%s backend %s does not answer: %s", row["kind"] or "the", row["url"], how_to_start(row["kind"], row["url"]))
        answering = {row["url"] for row in rows if row["answers"]}
        for backend in self.backends.configured_backends():
            found = await self.backends.kind_found(backend.url) if backend.url in answering else None
            if found is not None and found != backend.kind:
                logger.warning(
                    "the %s backend %s is a %s: its window is read the %s way and found wrong; give it as --%s %s",
                    backend.kind,
                    backend.url,
                    found,
                    backend.kind,
                    found,
                    backend.url,
                )

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if self.rewrites_host and isinstance(flow.client_conn.proxy_mode, mode_specs.ReverseMode):
            flow.metadata[CLIENT_HOST] = flow.request.host_header
            flow.request.host_header = url.hostport(flow.request.scheme, flow.request.host, flow.request.port)

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        if not admin.is_admin(flow.request.path):
            self._check_host(flow)
            return
        if not self.backends.serves(flow):
            return
        peer = flow.client_conn.peername[0] if flow.client_conn.peername else ""
        token = flow.request.headers.get("X-ContextPaw-Token")
        host = client_host(flow)
        # the state dir's local token (what `contextpaw mcp` reads) is this machine's: good on the loopback only;
        # the operator's admin token is for clients elsewhere
        local = self.local_token if admin.loopback_address(peer) else None
        trusted = admin.token_matches(token, ctx.options.contextpaw_admin_token)
        # the local token is a capability too: it searches its own session, and reads back by a marker's capability
        session = wire.session_of(flow.request.headers.get(wire.SESSION_HEADER)) if admin.token_matches(token, local) else None
        own = tuple(f"{scheme}://{host}".lower() for scheme in ("http", "https")) if host else ()
        if admin.cross_site(flow.request.headers.get("Origin"), flow.request.headers.get("Sec-Fetch-Site"), own):
            answer = admin.json_reply(403, {"error": "ContextPaw endpoints do not answer requests made for another site"})
        elif trusted or session is not None or admin.authorized(peer, host, None, None):
            try:
                backend = functools.partial(self.backends.backend_of, flow)
                answer = await self.admin.answer(
                    flow.request.method, flow.request.path, backend, trusted=trusted, session=session, secret=self.fitter.secret
                )
            except Exception as e:  # answered here all the same: /contextpaw/* never reaches a backend
                logger.exception("ContextPaw failed to answer %s", flow.request.path)
                answer = admin.json_reply(500, {"error": f"ContextPaw failed to answer: {type(e).__name__}"})
        else:
            answer = admin.json_reply(
                403, {"error": "ContextPaw endpoints are for loopback clients naming a loopback host, or token holders"}
            )
        reply(flow, answer.status, answer.body, answer.content_type)
        flag(flow, ADMIN_MARK, f"answered {answer.status} by ContextPaw itself, never forwarded")

    def _check_host(self, flow: http.HTTPFlow) -> None:
        """Keep the backends' own DNS-rebinding defence up: reverse mode gives the backend its own
        Host, so Ollama's check would see a loopback name for every request. A loopback client
        that named a Host Ollama would refuse (a page whose name resolves to 127.0.0.1) is answered
        403 here, in its API's convention, as Ollama would have answered it."""
        host = flow.metadata.get(CLIENT_HOST)
        client = flow.client_conn.peername[0] if flow.client_conn.peername else ""
        if CLIENT_HOST not in flow.metadata or not admin.loopback_address(client) or admin.local_host(host, self.hostname):
            return
        reason = f"ContextPaw: the Host {host!r} does not name this machine; a page on another site cannot reach the backends"
        reply(flow, 403, report_bytes(wire.proxy_error(None, flow.request.path, reason, 403)))
        fix = "call it by localhost, 127.0.0.1 or this machine's name"
        flag(flow, REFUSED_MARK, refused_comment(flow.request.path, fix, f"Host {host!r} is not this machine"))
        logger.warning("%s %s: answered 403: the Host %r does not name this machine", flow.request.method, flow.request.path, host)

    async def _window(self, backend: wire.Backend, model: str) -> dict[str, Any]:
        """The window requests for `model` without one of their own are fitted to (the backend's,
        else `contextpaw_default_ctx`), how they are counted, and the window to tell an agent: on
        Ollama without the model's tokenizer a turn goes out unchanged only while its count, with
        the count's error margin, fits, so an agent told the whole window would compact itself
        after ContextPaw had already cut."""
        budgeter = self.fitter.budgeter
        found = await budgeter.source.window(backend, model)
        window = found or budgeter.default_ctx
        exact = await self.fitter.counters.exact_for(backend, model)
        served = {
            "window": window,
            "source": "backend" if found else "contextpaw_default_ctx",
            "counted": "exactly" if exact else "by estimate",
        }
        if exact or backend.kind != wire.Kind.OLLAMA:
            return {**served, "agent_window": window}
        told = math.floor(budgeter.for_window(window, wire.Params(model, False)).admits / ANCHOR_MARGIN)
        note = (
            f"no tokenizer for {model}: a turn is counted at its conversation's rate with {ANCHOR_MARGIN - 1:.0%} for "
            f"the count's error, so an agent told {told} compacts itself before ContextPaw would cut"
        )
        return {**served, "agent_window": told, "note": note}

    async def _backends(self) -> list[dict[str, Any]]:
        """The backends as `Backends.health` finds them, each with its last failure cleared if it
        answers now (or recorded if it does not and none was), and when it last failed and answered."""
        rows = await self.backends.health()
        for row in rows:
            target = _target(row["url"])
            self.ledger.probed(target, row["answers"])
            row.update(last_error=self.ledger.last_error.get(target), **self.ledger.times(target))
        return rows

    async def _health(self) -> dict[str, Any]:
        return {
            "policy": self.fitter.settings.policy,
            "backends": await self._backends(),
            "counter": {
                "order": ["tokenizer option", "backend (llama-server)", "tokenizer (Ollama's GGUF)", "calibrated"],
                "tokenizers": {path: bool(c) for path, c in self.services.tokenizers.items()},
                "backend": self.services.counting.stats(),
                "ollama_asked": self.services.asking.stats(),
            },
            "calibration": self.fitter.calibration.to_json(),
            "summarizer": self.fitter.summarizer.stats() if self.fitter.summarizer else None,
            "conversations": len(self.fitter.plans),
        }
