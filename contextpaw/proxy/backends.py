"""The `Backends` addon: which backend (Ollama or llama-server) a flow goes to, whether it answers,
and how big a model request may be."""

from __future__ import annotations

import asyncio
import collections
import functools
import ipaddress
import re
import secrets
import weakref
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import connection, ctx, exceptions, http
from mitmproxy.proxy import mode_specs
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from contextpaw import wire
from contextpaw.calls.session import PROBE_TIMEOUT_S, Session
from contextpaw.core import logs
from contextpaw.fitting.services import InFlight
from contextpaw.ops.metrics import FailureLedger
from contextpaw.proxy.replies import REFUSED_MARK, flag, refused_comment, reply
from contextpaw.relay.exchange import OWN_PREFIX
from contextpaw.relay.loopback import Relay
from contextpaw.settings import BACKEND_OPTIONS, MAX_BODY_MB, BackendSettings, declare
from contextpaw.wire import bodies
from contextpaw.wire.streams import report_bytes

logger = logs.get(__name__)

BACKEND_HEADER = "X-ContextPaw-Backend"
HOP_HEADER = "X-ContextPaw-Hop"
"""What ContextPaw adds to each request it sends a backend: its instance's mark. A request that
arrives carrying this instance's own mark went round to ContextPaw itself, and is answered 508."""
HEALTH_PROBE_WAIT_S = 0.5


@functools.lru_cache(maxsize=1024)
def endpoint(host: str, port: int) -> tuple[str, int]:
    """A server's address as a key: every loopback name (`localhost`, `127.0.0.1`, `[::1]`) is one
    server, so a regular-mode client that says `localhost` reaches the backend configured as 127.0.0.1."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost":
        return ("loopback", port)
    try:
        return ("loopback", port) if ipaddress.ip_address(name).is_loopback else (name, port)
    except ValueError:
        return (name, port)


def located(target: str, backend: wire.Backend) -> bool:
    """Whether `backend` listens at `target`, a "host:port" as the failure ledger names it."""
    host, _, port = target.rpartition(":")
    return port.isdigit() and endpoint(host, int(port)) == endpoint(backend.host, backend.port)


def _destination(flow: http.HTTPFlow) -> tuple[str, int]:
    return endpoint(flow.request.host, flow.request.port)


def _is_reverse(flow: http.HTTPFlow) -> bool:
    return isinstance(flow.client_conn.proxy_mode, mode_specs.ReverseMode)


def model_request(flow: http.HTTPFlow) -> bool:
    """A request to a route either API handles (chat, generate, completions)."""
    return any(wire.route_for(kind, flow.request.method, flow.request.path) for kind in wire.Kind)


UNDECODED = "contextpaw.undecoded"
"""Flow metadata: why a compressed model request was forwarded as it came (said in X-ContextPaw-Error)."""


def _encoding(flow: http.HTTPFlow) -> str:
    return flow.request.headers.get("content-encoding", "").strip().lower()


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def scheme_conflict(configured: dict[tuple[str, int], wire.Backend], reverse_targets: dict[tuple[str, int], str]) -> str | None:
    """A reverse mode that speaks another scheme to a configured backend than its option says
    (a reverse spec without a scheme means https to mitmproxy): every request would fail."""
    for address, url in reverse_targets.items():
        backend = configured.get(address)
        if backend is not None and urlsplit(url).scheme != urlsplit(backend.url).scheme:
            return (
                f"--mode reverse:{url} (a reverse spec without a scheme is https) reaches the backend "
                f"contextpaw_{backend.kind} names {backend.url}; write --mode reverse:{backend.url}"
            )
    return None


EVERY_INTERFACE = ("", "0.0.0.0", "::")


def _local(host: str) -> bool:
    """A host that reaches this machine's own listeners: a loopback name, or the unspecified address
    (a connection to 0.0.0.0 or :: lands on the local host)."""
    return endpoint(host, 0)[0] == "loopback" or host.strip("[]") in EVERY_INTERFACE


def own_address(host: str, port: int, listens: Sequence[tuple[str, int]]) -> tuple[str, int] | None:
    """The listen address (host, port) among `listens` that a backend at host:port is: the same port,
    and the same host, a loopback alias of a loopback listener, or any local name when it listens on
    every interface."""
    for listen_host, listen_port in listens:
        if port != listen_port:
            continue
        if listen_host.strip("[]") in EVERY_INTERFACE:
            if _local(host):
                return listen_host, listen_port
        elif endpoint(host, port) == endpoint(listen_host, port) or (_local(host) and _local(listen_host)):
            return listen_host, listen_port
    return None


def listen_addresses(specs: Sequence[str], default_host: str, default_port: int | None) -> list[tuple[str, int]]:
    """Where each mode of mitmproxy's `mode` option listens (host "" is every interface)."""
    found = []
    for spec in specs:
        mode = mode_specs.ProxyMode.parse(spec)
        port = mode.listen_port(default_port)
        if port is not None:
            found.append((mode.listen_host(default_host), port))
    return found


def self_loop(targets: Sequence[tuple[str, str]], listens: Sequence[tuple[str, int]]) -> str | None:
    """A backend (what names it, its URL) that is ContextPaw's own listen address: every request
    would go round to itself. Said with the fix."""
    for name, url in targets:
        host, port = _host_port(url)
        if (address := own_address(host, port, listens)) is None:
            continue
        listen = f"{address[0] or 'every interface'}:{address[1]}"
        return (
            f"{name} {url} is ContextPaw's own listen address ({listen}): every request would be sent back to "
            "ContextPaw itself. Move the backend to another port (Ollama: OLLAMA_HOST=127.0.0.1:11435 ollama serve, "
            "then --ollama http://127.0.0.1:11435; llama-server: --port 8091) and point ContextPaw there, or have "
            "ContextPaw listen elsewhere (--port, or @PORT in --mode)"
        )
    return None


def relayable(target: bytes) -> bool:
    """Whether HTTP/1.1 allows this request target (visible ASCII only), so the relay can send it on."""
    return bool(target) and all(0x21 <= byte <= 0x7E for byte in target)


def _direct(server: connection.Server) -> tuple[str, int, bool] | None:
    """A direct (not proxied) server connection's address and TLS: what mitmproxy matches to reuse it."""
    if server.address is None or server.via is not None:
        return None
    host, port = server.address[:2]
    return host, port, server.tls


def _address(data: ServerConnectionHookData) -> str:
    host, port = data.server.address or ("?", 0)
    return f"{host}:{port}"


class Backends:
    """A destination is a backend when it is configured (`contextpaw_ollama`, `contextpaw_llamacpp`),
    when the client names the kind (`X-ContextPaw-Backend`), or when it is a reverse-mode target
    that identifies itself on a probe (once). Each flow's backend is found once, when its headers
    arrive, and looked up after that.

    mitmproxy answers a refused upstream with an HTML page that no hook can replace, so a flow
    without an open upstream connection is checked first and answered with a 502 in the caller's
    own JSON convention. A model request with a body over `contextpaw_max_body_mb` gets a 413 in
    that convention (other routes, such as Ollama's blob uploads, are not limited here;
    mitmproxy's `body_size_limit` and `stream_large_bodies` bound what it holds in memory, before
    any hook).
    """

    def __init__(self, ledger: FailureLedger, session: Session) -> None:
        self.ledger = ledger
        self.session = session
        self.settings = BackendSettings((), MAX_BODY_MB << 20, True)
        self.configured: dict[tuple[str, int], wire.Backend] = {}
        self.probed: dict[tuple[str, int], wire.Backend] = {}
        self.reverse_targets: dict[tuple[str, int], str] = {}
        """Reverse-mode targets (address -> URL), listed by /contextpaw/health before any traffic."""
        self.relay: Relay | None = None
        """The relay that carries model requests (`Upstream`'s); it answers while it listens."""
        self._found: weakref.WeakKeyDictionary[http.HTTPFlow, wire.Backend | None] = weakref.WeakKeyDictionary()
        self._probes = InFlight()
        self.mark = secrets.token_hex(8)
        """This instance's mark in `HOP_HEADER`."""
        self._marked: weakref.WeakKeyDictionary[http.HTTPFlow, list[str]] = weakref.WeakKeyDictionary()
        """Flows sent on with the mark -> the marks they came with (put back when the answer comes)."""
        self._held: dict[str, collections.Counter[tuple[str, int, bool]]] = {}
        """Client connection -> the direct backend connections mitmproxy holds open for it, by
        address and TLS as mitmproxy matches one to reuse: its next request goes out on one."""

    def load(self, loader: Any) -> None:
        declare(loader, BACKEND_OPTIONS)

    def configure(self, updated: set[str]) -> None:
        if "mode" in updated:
            self.reverse_targets = {}
            for spec in ctx.options.mode:
                mode = mode_specs.ProxyMode.parse(spec)
                if isinstance(mode, mode_specs.ReverseMode) and mode.scheme in ("http", "https"):
                    host, port = mode.address
                    self.reverse_targets[endpoint(host, port)] = f"{mode.scheme}://{f'[{host}]' if ':' in host else host}:{port}"
        if BACKEND_OPTIONS.keys() & updated:
            try:
                self.settings = BackendSettings.parse(ctx.options)
            except ValueError as e:
                raise exceptions.OptionsError(str(e)) from None
            self.configured = {endpoint(b.host, b.port): b for b in self.settings.configured}
        if conflict := scheme_conflict(self.configured, self.reverse_targets):
            raise exceptions.OptionsError(conflict)
        if {"mode", "listen_host", "listen_port"} & updated or BACKEND_OPTIONS.keys() & updated:
            listens = listen_addresses(ctx.options.mode, ctx.options.listen_host, ctx.options.listen_port)
            targets = [(f"contextpaw_{b.kind}", b.url) for b in self.settings.configured]
            targets += [("--mode reverse:", url) for url in self.reverse_targets.values()]
            if loop := self_loop(targets, listens):
                raise exceptions.OptionsError(loop)

    def running(self) -> None:
        """Ask the reverse-mode targets what they are at once, so health knows them before traffic."""
        for address, url in self._unknown().items():
            self._probe(address, url)

    def server_connect_error(self, data: ServerConnectionHookData) -> None:
        self.ledger.connect_failed(_address(data), data.server.error or "connect failed")

    def server_connected(self, data: ServerConnectionHookData) -> None:
        self.ledger.connected(_address(data))
        if (spec := _direct(data.server)) is not None:
            self._held.setdefault(data.client.id, collections.Counter())[spec] += 1

    def server_disconnected(self, data: ServerConnectionHookData) -> None:
        held = self._held.get(data.client.id)
        if held is not None and (spec := _direct(data.server)) is not None:
            held[spec] -= 1
            if held[spec] <= 0:
                del held[spec]

    def client_disconnected(self, client: connection.Client) -> None:
        self._held.pop(client.id, None)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Find the flow's backend once (a probe, for a reverse-mode target not seen before; never for
        a request that went round to ContextPaw itself); unfold its obs-folded headers."""
        unfold(flow.request.headers)
        if self.looped(flow):
            self._found[flow] = self.configured.get(_destination(flow)) or self.probed.get(_destination(flow))
        elif self.serves(flow):
            self._found[flow] = await self._identify(flow)

    def looped(self, flow: http.HTTPFlow) -> bool:
        """Whether the request carries this instance's own mark: ContextPaw sent it, to itself."""
        marks = ",".join(flow.request.headers.get_all(HOP_HEADER)).split(",")
        return self.mark in (m.strip() for m in marks)

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        if self.looped(flow):
            reason = (
                f"ContextPaw: this request came back to ContextPaw from itself: its backend {flow.request.host}:"
                f"{flow.request.port} is ContextPaw's own address; move the backend to another port "
                "(Ollama: OLLAMA_HOST=127.0.0.1:11435) and point ContextPaw there"
            )
            await self._refuse(
                flow,
                508,
                reason,
                "unreachable",
                (
                    "move the backend to its own port (Ollama: OLLAMA_HOST=127.0.0.1:11435), point ContextPaw there",
                    "it came back from ContextPaw itself",
                ),
            )
            return
        if not self.serves(flow):
            return
        relayed = self.relayed(flow)
        await self._checked(flow, relayed)
        if not flow.response and not relayed:
            self._mark(flow)

    def _mark(self, flow: http.HTTPFlow) -> None:
        """Add this instance's mark to what mitmproxy sends on to the backend (kept out of saved
        flows: taken off again when the answer comes). What the relay carries, it marks itself."""
        marks = [m for m in flow.request.headers.get_all(HOP_HEADER) if m]
        flow.request.headers[HOP_HEADER] = ", ".join([*marks, self.mark])
        self._marked[flow] = marks

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """The mark comes off; and a backend's own `X-ContextPaw-*` headers do not reach the client
        as this instance's (the relay drops them as the backend's answer comes: `exchange.OWN_PREFIX`)."""
        if self._unmark(flow) and flow.response is not None:
            for name in [n for n in flow.response.headers if n.lower().startswith(OWN_PREFIX.decode())]:
                del flow.response.headers[name]

    def error(self, flow: http.HTTPFlow) -> None:
        self._unmark(flow)

    def _unmark(self, flow: http.HTTPFlow) -> bool:
        """Take this instance's mark off; whether it had sent the flow on (marked) itself."""
        if (marks := self._marked.pop(flow, None)) is None:
            return False
        if marks:
            flow.request.headers[HOP_HEADER] = ", ".join(marks)
        else:
            flow.request.headers.pop(HOP_HEADER, None)
        return True

    async def _checked(self, flow: http.HTTPFlow, relayed: bool) -> None:
        size, limit = len(flow.request.raw_content or b""), self.settings.max_body_bytes
        model = relayed or model_request(flow)
        if size > limit and model:
            reason = f"ContextPaw: the request body ({size:,} bytes) is over the limit of {limit:,} bytes (contextpaw_max_body_mb)"
            await self._refuse(flow, 413, reason, "too_large", ("raise contextpaw_max_body_mb", f"body {size:,} B > {limit:,} B limit"))
        elif model and (encoding := _encoding(flow)) not in ("", "identity", *bodies.ENCODINGS):
            reason = f"ContextPaw: the request body's Content-Encoding {encoding!r} is not one it can read; send {', '.join(bodies.ENCODINGS)} or none"
            await self._refuse(
                flow, 415, reason, "bad_request", (f"send {', '.join(bodies.ENCODINGS)} or none", f"Content-Encoding {encoding!r} unread")
            )
        elif model and not await self._inflated(flow, limit):
            reason = f"ContextPaw: the request body inflates to more than the limit of {limit:,} bytes (contextpaw_max_body_mb)"
            await self._refuse(flow, 413, reason, "too_large", ("raise contextpaw_max_body_mb", f"body inflates past {limit:,} B"))
        elif relayed and not relayable(flow.request.data.path):
            reason = f"ContextPaw: the request target {flow.request.data.path!r} holds bytes HTTP does not allow; percent-encode them"
            await self._refuse(flow, 400, reason, "bad_request", ("percent-encode the path", "it has bytes HTTP forbids"))
        elif relayed:
            return  # the relay answers for a backend that does not answer
        elif not self._held_open(flow) and not await self.answers(flow.request.host, flow.request.port):
            reason = f"ContextPaw: the backend at {flow.request.host}:{flow.request.port} does not answer"
            where = f"{flow.request.host}:{flow.request.port}"
            await self._refuse(flow, 502, reason, "unreachable", (f"start the backend at {where}", "nothing answers there"))

    @staticmethod
    async def _inflated(flow: http.HTTPFlow, limit: int) -> bool:
        """Decode a compressed model request off the event loop, stopping at `limit` (False: over
        it). It goes on decoded: a body that is not what its encoding says goes on byte for byte,
        with its Content-Encoding, and the answer says why (`UNDECODED`)."""
        encoding = _encoding(flow)
        if encoding not in bodies.ENCODINGS:
            return True
        try:
            body = await asyncio.to_thread(bodies.inflate, flow.request.raw_content or b"", encoding, limit)
        except bodies.TooLarge:
            return False
        except ValueError as e:
            logger.info("%s: %s; forwarded as it came", flow.request.path, e)
            flow.metadata[UNDECODED] = f"{e}; forwarded as it came, not fitted"
            return True
        del flow.request.headers["content-encoding"]
        flow.request.content = body
        return True

    async def _refuse(self, flow: http.HTTPFlow, status: int, reason: str, count: str, said: tuple[str, str]) -> None:
        """Answer `status` with `reason`; the comment says `said`: (the fix, why), after the route."""
        backend = await self.backend_of(flow)
        kind = backend.kind if backend is not None else None
        reply(flow, status, report_bytes(wire.proxy_error(kind, flow.request.path, reason, status)))
        route = wire.route_for(kind, flow.request.method, flow.request.path) if kind is not None else None
        flag(flow, REFUSED_MARK, refused_comment(route.name if route is not None else flow.request.path, *said))
        self.ledger.stats.add(count, where=self.ledger.stats.where(kind, route.name if route is not None else None))
        logger.warning("%s %s: answered %d: %s", flow.request.method, flow.request.url, status, reason.removeprefix("ContextPaw: "))

    def _held_open(self, flow: http.HTTPFlow) -> bool:
        """Whether mitmproxy sends this flow on a backend connection that is open now (its own, or
        one it keeps for the client's next request): then no probe is needed, and a backend that
        fails from here on is answered as mitmproxy answers it. Trusted for a loopback backend only
        (a server that stops closes its connections there, while a remote host can vanish without a
        close), and never for an HTTP/2 client (mitmproxy opens a connection per stream for it)."""
        if flow.server_conn.connected:
            return True
        if flow.client_conn.alpn == b"h2" or flow.server_conn.via is not None or _destination(flow)[0] != "loopback":
            return False
        held = self._held.get(flow.client_conn.id)
        return held is not None and held[(flow.request.host, flow.request.port, flow.request.scheme == "https")] > 0

    def relayed(self, flow: http.HTTPFlow) -> bool:
        """Whether the relay carries this flow: a model request over plain HTTP to a backend of known
        kind, not already sent via an upstream proxy (`contextpaw_relay` on)."""
        address = _destination(flow)
        known = address in self.configured or address in self.probed
        return (
            self.relay is not None
            and self.relay.address is not None
            and self.settings.relay
            and flow.request.scheme == "http"
            and flow.server_conn.via is None
            and (known or BACKEND_HEADER in flow.request.headers)
            and model_request(flow)
        )

    def kind_at(self, target: str) -> wire.Kind | None:
        """The kind of the backend at "host:port", where it is configured or was identified."""
        host, _, port = target.rpartition(":")
        address = endpoint(host, int(port)) if port.isdigit() else None
        backend = self.configured.get(address) or self.probed.get(address) if address else None
        return backend.kind if backend else None

    def serves(self, flow: http.HTTPFlow) -> bool:
        """Whether this flow goes to a backend rather than anywhere else a regular proxy reaches."""
        return _is_reverse(flow) or _destination(flow) in self.configured or BACKEND_HEADER in flow.request.headers

    async def backend_of(self, flow: http.HTTPFlow) -> wire.Backend | None:
        """The flow's backend, as found when its headers arrived (found now for a flow that skipped
        that hook, such as one made in a test or replayed)."""
        if flow not in self._found:
            self._found[flow] = await self._identify(flow) if self.serves(flow) else None
        return self._found[flow]

    async def _identify(self, flow: http.HTTPFlow) -> wire.Backend | None:
        address = _destination(flow)
        if address in self.configured:
            return self.configured[address]
        url = f"{flow.request.scheme}://{flow.request.host}:{flow.request.port}"
        named = flow.request.headers.get(BACKEND_HEADER, "").lower()
        if named in set(wire.Kind):
            return wire.Backend.parse(wire.Kind(named), url)
        if not _is_reverse(flow):
            return None
        return await self._probe(address, url)

    async def _identified(self, address: tuple[str, int], url: str) -> wire.Backend | None:
        """The backend at a reverse-mode target, asked once what it is (None while it does not say)."""
        if address not in self.probed:
            kind = await self.kind_found(url)
            if kind is None:
                return None
            self.probed[address] = wire.Backend.parse(kind, url)
            logger.info("%s identified as %s", url, kind)
        return self.probed[address]

    async def kind_found(self, url: str) -> wire.Kind | None:
        """What the server at `url` says it is (Ollama's "Ollama is running", llama-server's
        `/props`), None where it says neither."""
        root, props = await asyncio.gather(self.session.text(url + "/"), self.session.text(url + "/props"))
        return wire.identify(root[1] if root and root[0] == 200 else None, props and props[0])

    def configured_backends(self) -> list[wire.Backend]:
        """The backends the options name with their kind (`--ollama`, `--llamacpp`)."""
        return list(self.configured.values())

    async def answers(self, host: str, port: int) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT_S)
        except (OSError, TimeoutError):
            return False
        writer.close()
        return True

    def _unknown(self) -> dict[tuple[str, int], str]:
        """Reverse-mode targets whose kind is not known yet."""
        known = self.configured.keys() | self.probed.keys()
        return {a: url for a, url in self.reverse_targets.items() if a not in known}

    def _probe(self, address: tuple[str, int], url: str) -> asyncio.Task[wire.Backend | None]:
        """The one identification in flight for a target (a new one once the last has ended)."""
        return self._probes.task(address, functools.partial(self._identified, address, url))

    async def health(self) -> list[dict[str, Any]]:
        """Every configured backend and reverse-mode target, and whether each answers now. A target of
        unknown kind is asked what it is, for a moment at most (a hanging one must not hang health):
        a dead one is listed, kind null, before any traffic."""
        probes = [self._probe(a, url) for a, url in self._unknown().items()]
        if probes:
            await asyncio.wait(probes, timeout=HEALTH_PROBE_WAIT_S)
        rows: list[tuple[str | None, str]] = [(b.kind, b.url) for b in {**self.probed, **self.configured}.values()]
        rows += [(None, url) for url in self._unknown().values()]
        places = [_host_port(url) for _, url in rows]
        answers = await asyncio.gather(*(self.answers(host, port) for host, port in places))
        return [
            {"kind": kind, "url": url, "answers": up, "last_error": self.ledger.last_error.get(f"{host}:{port}")}
            for (kind, url), (host, port), up in zip(rows, places, answers, strict=True)
        ]


FOLD = re.compile(rb"\r?\n[ \t]+")
"""An obs-fold: a header value continued on the next line after spaces (deprecated; RFC 9112 5.2)."""


def unfold(headers: http.Headers) -> None:
    """Each obs-folded header value as one line, its folds a space each, as a proxy must forward it:
    mitmproxy keeps the fold, and the relay's HTTP library refuses it (a 502 where bare mitmdump
    forwards it)."""
    fields = headers.fields
    if any(b"\n" in value for _, value in fields):
        headers.fields = tuple((name, FOLD.sub(b" ", value)) for name, value in fields)
