"""The upstream leg of handled requests, owned by ContextPaw: a loopback relay.

mitmproxy answers a backend that resets before its headers with an HTML page of its own and waits
on one that hangs until `tcp_timeout`; no hook can change either. So handled flows are sent through
this relay as through an upstream proxy (`server_conn.via`): mitmproxy opens a CONNECT tunnel to it
and speaks plain HTTP/1.1 inside; the relay speaks HTTP/1.1 to the backend (h11 on both legs, so
headers and bodies pass as they are) and answers every failure of the backend in the caller's API:

- no connection, or closed or reset before the answer's headers: a JSON 502;
- no headers within the header timeout: a JSON 504;
- a buffered answer that breaks off or stalls: a JSON 502 or 504 (its headers were not sent yet);
- a stream that breaks off or stalls past the idle timeout: an error record in the stream's own
  framing (what Ollama and OpenAI clients raise from), then a clean end.

Each failure is reported to `on_failure` (the addon counts and logs it) and its answer carries
`X-ContextPaw-Upstream-Error`. A request the addon may rescue carries the key of its flow
(`X-ContextPaw-Flow`, never sent on to the backend); a 400 (or 500) to it goes through the rescue
loop (`contextpaw.relay.rescue`) with the addon's decision for that flow: a compacted body is sent
instead (and asked about again if it fails the same way), and its answer, streamed if it streams,
goes back instead of the error. The relay changes no flow; what the rescue did is in the flow's
state, where the addon reads it. The relay listens on 127.0.0.1 only and opens tunnels only for a
CONNECT that carries its secret (mitmproxy adds it in the `http_connect_upstream` hook), so it is
not an open proxy for other local users. A tunnel keeps its backend connection between requests for
a moment, and never sends a request twice.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
from collections.abc import Callable

import h11

from contextpaw import wire
from contextpaw.core import logs
from contextpaw.relay.exchange import (
    MAX_HEAD_EVENT,
    READ_SIZE,
    ClientGone,
    Exchange,
    Failure,
    Head,
    Link,
    Timeouts,
    answer_headers,
    json_answer,
)
from contextpaw.relay.rescue import Decide

logger = logs.get(__name__)

LOOPBACK = "127.0.0.1"
HANDSHAKE_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 64 * 1024
FLOW_HEADER = "X-ContextPaw-Flow"
"""The key of the flow a carried request belongs to, for its rescue; the tunnel takes it off, so the
backend never sees it."""
FLOW_KEY = FLOW_HEADER.lower().encode()
WRITE_SIZE = 1 << 20
"""A read answer goes on to the client in writes of about this size: one write of 300 MB copies it
three times over (the join, h11, the transport) in one step of the event loop, and every other
client waits for it."""

Rescuer = Callable[[str], Decide | None]
"""A flow's key -> the rescue's decision for that flow, or None when it is not one to rescue."""


class Relay:
    """The loopback relay server; `address` and `authorization` are what mitmproxy needs."""

    def __init__(
        self,
        on_failure: Callable[[Failure], None],
        timeouts: Timeouts,
        rescue: Rescuer | None = None,
        mark: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.on_failure = on_failure
        self.timeouts = timeouts
        self.rescue = rescue
        self.mark = mark
        """A header added to every request sent to a backend: the instance's loop mark (`proxy.backends`)."""
        self.authorization = f"ContextPaw {secrets.token_urlsafe(24)}"
        self.address: tuple[str, int] | None = None
        self._server: asyncio.Server | None = None
        self._tunnels: set[asyncio.Task[None]] = set()
        self._busy: set[asyncio.Task[None]] = set()
        """Tunnels in the middle of an exchange."""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._tunnel, LOOPBACK, 0, limit=MAX_HEAD_BYTES)
        self.address = self._server.sockets[0].getsockname()[:2]

    def close(self) -> None:
        """Stop listening; idle tunnels end now, busy ones after the answer they are relaying (a
        reloaded script does not cut its clients off)."""
        if self._server is not None:
            self._server.close()
            for task in self._tunnels - self._busy:
                task.cancel()
            self._server = None
            self.address = None

    # -- the tunnel -----------------------------------------------------------------------------

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tunnels.add(task)
        try:
            target = await asyncio.wait_for(self._handshake(reader, writer), HANDSHAKE_TIMEOUT_S)
            if target is not None:
                await self._serve(target, reader, writer)
        except (OSError, TimeoutError, ValueError, ClientGone, h11.ProtocolError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the tunnel ends; a request in it was answered or its client is gone
        except asyncio.CancelledError:
            pass  # the relay closes: the tunnel ends with it
        except Exception:  # a bug of ours must end one tunnel, not the relay
            logger.exception("the relay's tunnel failed")
        finally:
            self._tunnels.discard(task)
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, int] | None:
        """Read `CONNECT host:port`; open the tunnel only for the holder of the secret."""
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        request_line, *lines = head.split("\r\n")
        method, authority, _ = request_line.split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
        given = headers.get("proxy-authorization", "")
        if method != "CONNECT" or not hmac.compare_digest(given.encode(), self.authorization.encode()):
            writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
            return None
        host, _, port = authority.rpartition(":")
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        return host.strip("[]"), int(port)

    async def _serve(self, target: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        down = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_EVENT)
        spare: Link | None = None
        try:
            while True:
                try:
                    received = await _read_request(down, reader)
                except h11.RemoteProtocolError as e:
                    await _refuse_unreadable(down, writer, e)
                    return
                if received is None:
                    return
                request, body = received
                head, decide = self._carried(request)
                exchange = Exchange(self, target, head, body, spare, Tunnel(down, reader, writer), decide)
                task = asyncio.current_task()
                assert task is not None
                self._busy.add(task)
                try:
                    await exchange.run()
                finally:
                    spare = exchange.spare
                    self._busy.discard(task)
                if self.address is None or down.our_state is not h11.DONE or down.their_state is not h11.DONE:
                    return  # closed meanwhile, or the tunnel cannot go on
                down.start_next_cycle()
        finally:
            if spare is not None:
                spare.writer.close()

    def _carried(self, request: h11.Request) -> tuple[Head, Decide | None]:
        """The request's head as the backend gets it, without its flow's key, and the rescue's
        decision for that flow."""
        headers, key = [], None
        for name, value in request.headers.raw_items():
            if name.lower() == FLOW_KEY:
                key = value.decode("latin-1")
            else:
                headers.append((name, value))
        decide = self.rescue(key) if self.rescue is not None and key is not None else None
        return Head(request.method, request.target, headers), decide


class Tunnel:
    """An exchange's answer goes back down the tunnel mitmproxy opened (the `Sink` of the relay)."""

    def __init__(self, down: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.down = down
        self.reader = reader
        self.writer = writer
        self._watch: asyncio.Future[bytes] | None = None
        self._gone: Callable[[], None] | None = None

    async def send(self, *events: h11.Event) -> None:
        """The events' bytes in one write, joined once: h11 passes the pieces through, where its
        `send` would join each event's framing and data first."""
        chunks: list[bytes] = []
        for event in events:
            chunks += self.down.send_with_data_passthrough(event) or ()
        self.writer.write(b"".join(chunks))
        await self.writer.drain()

    async def send_whole(self, response: h11.Response, pieces: list[bytes]) -> None:
        """Framed by its length, a batch of pieces of WRITE_SIZE at a time, each drained before the next."""
        headers = answer_headers(response, sum(map(len, pieces)))
        events: list[h11.Event] = [h11.Response(status_code=response.status_code, headers=headers, reason=response.reason)]
        size = 0
        for piece in pieces:
            events.append(h11.Data(data=piece))
            size += len(piece)
            if size >= WRITE_SIZE:
                await self.send(*events)
                events, size = [], 0
        await self.send(*events, h11.EndOfMessage())

    def watch(self, gone: Callable[[], None]) -> None:
        self._gone = gone
        self._watch = asyncio.ensure_future(self.reader.read(READ_SIZE))
        self._watch.add_done_callback(self._client_moved)

    def _client_moved(self, watch: asyncio.Future[bytes]) -> None:
        """The watch on the client ended: a pipelined request goes to h11 for the next cycle; the
        client's end (or a reset) means it is gone."""
        if watch is not self._watch:
            return  # stopped by `unwatch`, which keeps what it read
        self._watch = None
        leftover = b"" if watch.cancelled() or watch.exception() else watch.result()
        if leftover:
            self.down.receive_data(leftover)
        elif self._gone is not None:
            self._gone()

    async def unwatch(self) -> None:
        """End the watch on the client; what it read (a next request, or the end) goes to h11."""
        watch, self._watch = self._watch, None
        if watch is None:
            return
        watch.cancel()
        try:
            self.down.receive_data(await watch)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # the tunnel itself is being cancelled
                raise
        except OSError:
            pass


async def _read_request(down: h11.Connection, reader: asyncio.StreamReader) -> tuple[h11.Request, bytes] | None:
    """The next whole request mitmproxy sends in the tunnel (it has the body in memory already)."""
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = down.next_event()
        if event is h11.NEED_DATA:
            down.receive_data(await reader.read(READ_SIZE))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            return request, bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def _refuse_unreadable(down: h11.Connection, writer: asyncio.StreamWriter, error: h11.RemoteProtocolError) -> None:
    """A request h11 cannot read (mitmproxy passes on what it could): a JSON error, not a dropped tunnel."""
    logger.warning("the relay cannot read a request: %s", error)
    if down.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # h11 lets a server answer a request it refused
        return
    status = error.error_status_hint
    reason = f"ContextPaw: the request cannot be relayed ({error})"
    for event in json_answer(status, wire.proxy_error(None, "/", reason, status), (b"Connection", b"close")):
        writer.write(down.send(event) or b"")
    await writer.drain()
