"""One request through the relay: sent to the backend, and its answer relayed, or its failure
answered in the caller's API (see `contextpaw.relay.loopback` for what each failure gets). A backend's
overflow goes through the rescue loop (`contextpaw.relay.rescue`) with the decision the exchange was
given for the request's flow.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal, Protocol, cast

import h11

from contextpaw import wire
from contextpaw.core import logs
from contextpaw.relay.rescue import RESCUABLE, Decide, rescued
from contextpaw.wire import bodies
from contextpaw.wire.streams import STREAM_TYPES, record_bytes

logger = logs.get(__name__)

READ_SIZE = 64 * 1024
ERROR_HEADER = "X-ContextPaw-Upstream-Error"
JSON_TYPE = bodies.JSON_TYPE.encode()
CONNECTION_HEADERS = frozenset(name.encode() for name in bodies.CONNECTION_HEADERS)
"""Headers of the backend connection, not of the answer: the tunnel frames and keeps its own."""
MAX_HEAD_EVENT = 1 << 20
"""The largest request or answer head h11 accepts (its own default, 16 KiB, is below mitmproxy's)."""
KEEP_ALIVE_S = 2.0
"""A backend connection idle for longer is not reused: servers close idle ones after 5 s or more."""


@dataclass(frozen=True)
class Timeouts:
    connect: float
    headers: float
    """From the request's last byte to the answer's headers: a long prompt or a long buffered
    answer takes this long on a slow machine."""
    idle: float
    """Between two reads of the answer's body."""


@dataclass(frozen=True)
class Failure:
    """A backend that failed one request, and how."""

    method: str
    path: str
    target: str
    reason: str
    timed_out: bool
    streamed: bool
    """The answer's headers had reached the client: it got an error record, not an error status."""
    connected: bool = True
    """False when no connection to the backend could be opened."""


@dataclass(frozen=True)
class Head:
    """A request's head as the backend gets it: what mitmproxy read, or what the relay's h11 read
    in the tunnel (the header names as they came)."""

    method: bytes
    target: bytes
    headers: Sequence[tuple[bytes, bytes]]


@dataclass
class Link:
    """A backend connection kept between two exchanges: of one tunnel, or in `Idle`."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float


MOST_IDLE = 8
"""Idle connections kept for each backend in `Idle`: as many as a few clients at once need."""


class Idle:
    """Backend connections kept between exchanges that have no tunnel to keep one in (flows
    answered in mitmproxy's request hook): a few for each backend, the freshest taken first."""

    def __init__(self) -> None:
        self._links: dict[tuple[str, int], list[Link]] = {}

    def take(self, target: tuple[str, int]) -> Link | None:
        links = self._links.get(target)
        return links.pop() if links else None

    def keep(self, target: tuple[str, int], link: Link | None) -> None:
        """Keep `link` for the next exchange; the stalest go when there are too many, or too old."""
        if link is None:
            return
        links = self._links.setdefault(target, [])
        links.append(link)
        now = time.monotonic()
        while links and (len(links) > MOST_IDLE or now - links[0].idle_since > KEEP_ALIVE_S):
            links.pop(0).writer.close()

    def close(self) -> None:
        for links in self._links.values():
            for link in links:
                link.writer.close()
        self._links.clear()


class BackendFailed(Exception):
    def __init__(self, reason: str, timed_out: bool = False, connected: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out
        self.connected = connected


class ClientGone(Exception):
    """mitmproxy closed the tunnel: the client went away, so the backend's answer is not wanted."""


def _close(work: Awaitable[Any]) -> None:
    """A coroutine that will not be awaited is closed (no "never awaited" warning)."""
    if asyncio.iscoroutine(work):
        work.close()


OWN_PREFIX = b"x-contextpaw-"
"""ContextPaw's headers: a backend's own of that name are not passed on, or the client would read
them as this ContextPaw's (a report it did not make, an error it did not have)."""


def answer_headers(response: h11.Response, length: int | None = None) -> list[tuple[bytes, bytes]]:
    """The answer's own headers, as they came, without its connection's (the sink frames and keeps
    its own); with the body's `length` when the answer is passed on whole."""
    headers = [(k, v) for k, v in response.headers.raw_items() if k.lower() not in CONNECTION_HEADERS]
    if length is not None:
        headers.append((b"Content-Length", str(length).encode()))
    return headers


def json_answer(status: int, body: dict[str, Any], *headers: tuple[bytes, bytes]) -> list[h11.Event]:
    """A whole JSON answer of the relay's own, as h11 events."""
    return _whole_answer(status, json.dumps(body).encode(), *headers)


def _whole_answer(status: int, data: bytes, *headers: tuple[bytes, bytes]) -> list[h11.Event]:
    head = [(b"Content-Type", JSON_TYPE), (b"Content-Length", str(len(data)).encode()), *headers]
    reason = HTTPStatus(status).phrase.encode() if status in HTTPStatus._value2member_map_ else b""  # "502 Bad Gateway", not "502 "
    return [h11.Response(status_code=status, headers=head, reason=reason), h11.Data(data=data), h11.EndOfMessage()]


class Terms(Protocol):
    """What an exchange reads of its relay (`contextpaw.relay.loopback.Relay`), read anew each time
    it is needed: the options may change while an answer streams."""

    timeouts: Timeouts
    mark: tuple[bytes, bytes] | None
    """A header every request it sends carries (the instance's loop mark), not put on the flow."""

    def on_failure(self, failure: Failure) -> None: ...


class Sink(Protocol):
    """Where an exchange's answer goes, and how it hears that its client went away: the relay's
    tunnel (`contextpaw.relay.loopback`), or a flow answered in mitmproxy's request hook
    (`contextpaw.proxy.upstream`)."""

    async def send(self, *events: h11.Event) -> None:
        """Pass the answer's next events on."""

    async def send_whole(self, response: h11.Response, pieces: list[bytes]) -> None:
        """Pass on a whole answer read from the backend: its head as the backend sent it (the
        connection's own headers and framing are the sink's to make) and its body in pieces."""

    def watch(self, gone: Callable[[], None]) -> None:
        """Call `gone` once the client has gone away."""

    async def unwatch(self) -> None:
        """Stop watching: the exchange is over."""


class Exchange:
    """One request to the backend: forward it, and relay the answer or answer the failure; `decide`
    is the rescue's decision for the request's flow (None: an overflow is passed on)."""

    def __init__(
        self, relay: Terms, target: tuple[str, int], request: Head, body: bytes, spare: Link | None, sink: Sink, decide: Decide | None
    ) -> None:
        self.relay = relay
        self.decide = decide
        self.target = target
        self.request = request
        self.body = body
        self.sink = sink
        self.path = request.target.decode("latin-1")
        self.up = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_EVENT)
        self.up_reader: asyncio.StreamReader | None = None
        self.up_writer: asyncio.StreamWriter | None = None
        self.spare = spare
        """A backend connection kept from the last exchange; this one's, when it ends whole."""
        self.up_closed = False
        self.headers_sent = False
        self.framing: Literal["ndjson", "sse"] | None = None
        self.task: asyncio.Task[None] | None = None
        self.waiting = False
        """In a wait on the backend: the only place a client that goes away interrupts."""
        self.client_gone = False

    async def run(self) -> None:
        self.task = asyncio.current_task()
        self.sink.watch(self._client_left)
        try:
            await self._forward()
        except BackendFailed as e:
            await self._answer_failure(e)
        except (ClientGone, OSError):
            raise
        except Exception as e:  # a bug of ours, or a request h11 cannot send: answered, never dropped
            logger.exception("the relay could not forward %s", self.path)
            await self._answer_failure(BackendFailed(f"the relay could not forward the request ({type(e).__name__}: {e})"))
        finally:
            self._release()
            await self.sink.unwatch()

    def _release(self) -> None:
        """Keep the backend connection for the next exchange (`spare`) if it is whole, else close it."""
        if self.up_writer is None or self.up_reader is None:
            return
        if self.up.our_state is h11.DONE and self.up.their_state is h11.DONE and not self.up_closed:
            self.spare = Link(self.up_reader, self.up_writer, time.monotonic())
        else:
            self.up_writer.close()
        self.up_reader = self.up_writer = None

    async def _forward(self) -> None:
        response = await self._ask(self.body)
        if self._streams(response):
            return await self._relay_stream(response)
        pieces: list[bytes] | None = await self._read_body()
        decide = self._decision() if response.status_code in RESCUABLE else None
        if decide is not None:

            async def send(retry: bytes) -> tuple[int, bytes | None]:
                nonlocal response, pieces
                response = await self._ask(retry)
                pieces = None if self._streams(response) else await self._read_body()
                return response.status_code, None if pieces is None else b"".join(pieces)

            assert pieces is not None, "the first answer is not a stream: it was read whole"
            refusal = await rescued(response.status_code, b"".join(pieces), decide, send)
            if refusal is not None:  # nothing that must be kept fits: the addon's own answer
                return await self._answer(*_whole_answer(refusal.status, refusal.body))
            if pieces is None:
                return await self._relay_stream(response)
        assert pieces is not None
        await self.sink.send_whole(response, pieces)

    async def _ask(self, body: bytes) -> h11.Response:
        """Send the request with `body` to the backend; the head of its answer.

        A connection kept from the tunnel's last exchange is used while it is fresh (well inside the
        servers' idle timeouts) and not closed by the backend. A request is never sent twice: the
        backend may have started on it."""
        self._release()
        kept, self.spare = self.spare, None
        if kept is not None:
            await asyncio.sleep(0)  # let a close that has arrived be seen
            if time.monotonic() - kept.idle_since > KEEP_ALIVE_S or kept.reader.at_eof() or kept.writer.is_closing():
                kept.writer.close()
                kept = None
        return await self._request(kept, body)

    async def _request(self, kept: Link | None, body: bytes) -> h11.Response:
        """Send the request on `kept` or a new connection; the head of the answer (1xx skipped)."""
        timeouts = self.relay.timeouts
        self.up, self.up_closed = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_EVENT), False
        if kept is not None:
            reader, writer = kept.reader, kept.writer
        else:
            try:
                reader, writer = await self._race(asyncio.open_connection(*self.target), timeouts.connect)
            except (OSError, TimeoutError) as e:
                raise BackendFailed(f"the backend at {self._target()} does not answer ({type(e).__name__})", connected=False) from None
        self.up_reader, self.up_writer = reader, writer
        resized = body is not self.body
        headers = [(k, str(len(body)).encode() if resized and k.lower() == b"content-length" else v) for k, v in self.request.headers]
        if not any(k.lower() == b"host" for k, _ in headers):  # an HTTP/1.0 request may have none
            headers.insert(0, (b"Host", self._target().encode()))
        if self.relay.mark is not None:
            headers.append(self.relay.mark)
        head = h11.Request(method=self.request.method, target=self.request.target, headers=headers)
        writer.write(self.up.send(head) + self.up.send(h11.Data(data=body)) + self.up.send(h11.EndOfMessage()))
        try:
            await self._race(writer.drain(), timeouts.headers)
        except TimeoutError:
            raise BackendFailed(
                f"the backend at {self._target()} stopped reading the request for {timeouts.headers:g} s", timed_out=True
            ) from None
        except OSError:
            raise BackendFailed(f"the backend at {self._target()} closed the connection while receiving the request") from None
        response = await self._next_event(timeouts.headers, "before its answer's headers", "sent no answer")
        while isinstance(response, h11.InformationalResponse):
            response = await self._next_event(timeouts.headers, "before its answer's headers", "sent no answer")
        assert isinstance(response, h11.Response)
        if not any(k.lower().startswith(OWN_PREFIX) for k, _ in response.headers.raw_items()):
            return response
        theirs = [(k, v) for k, v in response.headers.raw_items() if not k.lower().startswith(OWN_PREFIX)]
        return h11.Response(status_code=response.status_code, headers=theirs, reason=response.reason, http_version=response.http_version)

    def _streams(self, response: h11.Response) -> bool:
        content_type = dict(response.headers).get(b"content-type", b"").decode("latin-1")
        if not content_type.startswith(STREAM_TYPES):
            return False
        self.framing = "ndjson" if "ndjson" in content_type else "sse"
        return True

    async def _read_body(self) -> list[bytes]:
        """A whole answer is read before its headers go on: if it breaks off, the client gets an
        error status. Kept in the pieces it came in, never joined unless the rescue reads it, and
        never copied: h11 hands each piece out as its own copy of what it read."""
        pieces = []
        while not isinstance(
            event := await self._next_event(self.relay.timeouts.idle, "in the middle of its answer", "stalled in its answer"),
            h11.EndOfMessage,
        ):
            if isinstance(event, h11.Data) and event.data:
                pieces.append(event.data)
        return pieces

    def _decision(self) -> Decide | None:
        """The addon's rescue decision for this request's flow, or None; a failure of ours in it
        passes the backend's answer on."""
        decide = self.decide
        if decide is None:
            return None

        async def guarded(status: int, answer: bytes) -> Any:
            try:
                return await decide(status, answer)
            except Exception:
                logger.exception("the rescue of %s failed; the backend's answer is passed on", self.path)
                return None

        return guarded

    async def _relay_stream(self, response: h11.Response) -> None:
        """Records pass on as they come; the framing is chunked, so an error record can still be added.
        What one read of the backend brought goes on in one chunk and one write: a server that writes
        each record by itself sends a turn's records in a few reads when the proxy is busy, and a
        write and a chunk each would double the work (the proxy reads every chunk again)."""
        await self._answer(h11.Response(status_code=response.status_code, headers=answer_headers(response), reason=response.reason))
        self.headers_sent = True
        broke = "in the middle of its stream"
        while True:
            events, failed = [await self._next_event(self.relay.timeouts.idle, broke, "stalled in its stream")], None
            try:
                while not isinstance(events[-1], h11.EndOfMessage) and (ready := self._ready_event(broke)) is not None:
                    events.append(ready)
            except BackendFailed as e:  # what came before the break still goes on, then the error record
                failed = e
            data = b"".join(event.data for event in events if isinstance(event, h11.Data))  # joined once, not copied first
            ended = isinstance(events[-1], h11.EndOfMessage)
            await self._answer(*([h11.Data(data=data)] if data else []), *([h11.EndOfMessage()] if ended else []))
            if failed is not None:
                raise failed
            if ended:
                return

    # -- reading the backend, while watching the client ---------------------------------------------

    def _ready_event(self, broke: str) -> h11.Event | None:
        """The backend's next event if what was read holds it, else None (more must be read)."""
        try:
            event = self.up.next_event()
        except h11.RemoteProtocolError as e:
            if self.up_closed:  # h11 calls an end in the middle of a message a protocol error
                raise BackendFailed(f"the backend at {self._target()} closed the connection {broke}") from None
            raise BackendFailed(f"the backend at {self._target()} answered with broken HTTP ({e})") from None
        if event is h11.NEED_DATA:
            return None
        if isinstance(event, h11.ConnectionClosed):
            raise BackendFailed(f"the backend at {self._target()} closed the connection {broke}")
        return cast(h11.Event, event)  # PAUSED comes only after a whole answer: none is read past its end

    async def _next_event(self, timeout: float, broke: str, silent: str) -> h11.Event:
        assert self.up_reader is not None
        while True:
            if (event := self._ready_event(broke)) is not None:
                return event
            try:
                data = await self._race(self.up_reader.read(READ_SIZE), timeout)
            except TimeoutError:
                raise BackendFailed(f"the backend at {self._target()} {silent} for {timeout:g} s", timed_out=True) from None
            except OSError as e:
                raise BackendFailed(f"the backend at {self._target()} reset the connection {broke} ({type(e).__name__})") from None
            self.up_closed = not data
            self.up.receive_data(data)

    async def _race[T](self, work: Awaitable[T], timeout: float) -> T:
        """Await backend work within `timeout`, giving up at once if the client goes away (the
        sink's watch on the client cancels this wait; no task per wait)."""
        if self.client_gone:
            _close(work)
            raise ClientGone()
        self.waiting = True
        try:
            async with asyncio.timeout(timeout):
                return await work
        except asyncio.CancelledError:
            assert self.task is not None
            if self.client_gone and self.task.uncancel() == 0:
                raise ClientGone() from None
            raise
        finally:
            self.waiting = False

    def _client_left(self) -> None:
        """The client went away: a wait on the backend is interrupted, now or at the next one."""
        self.client_gone = True
        if self.waiting and self.task is not None:
            self.task.cancel()

    # -- answering --------------------------------------------------------------------------------

    async def _answer(self, *events: h11.Event) -> None:
        await self.sink.send(*events)

    async def _answer_failure(self, failure: BackendFailed) -> None:
        reason = f"ContextPaw: {failure.reason}"
        method = self.request.method.decode("latin-1")
        self.relay.on_failure(
            Failure(method, self.path, self._target(), failure.reason, failure.timed_out, self.headers_sent, failure.connected)
        )
        status = 504 if failure.timed_out else 502
        body = wire.proxy_error(None, self.path, reason, status)
        if self.headers_sent:
            assert self.framing is not None
            await self._answer(h11.Data(data=record_bytes(self.framing, body)), h11.EndOfMessage())
            return
        await self._answer(*json_answer(status, body, (ERROR_HEADER.encode(), reason.encode("ascii", "replace"))))

    def _target(self) -> str:
        return f"{self.target[0]}:{self.target[1]}"
