"""The loopback relay, over real sockets: a raw backend that misbehaves on demand, a raw tunnel client.

Every backend here is a few lines of asyncio on 127.0.0.1 that records the bytes it received; the
client opens the tunnel as mitmproxy does (CONNECT with the relay's secret) and speaks HTTP/1.1 in it,
parsing the answers with h11. Timeouts are short, and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

import h11
import pytest

from contextpaw.relay.exchange import ERROR_HEADER as ERROR_NAME
from contextpaw.relay.exchange import Failure, Timeouts
from contextpaw.relay.loopback import FLOW_HEADER, WRITE_SIZE, Relay

ERROR_HEADER = ERROR_NAME.encode()

LOOPBACK = "127.0.0.1"
WAIT = 3.0  # the bound on any single wait in these tests; a healthy run never comes near it
FAST = Timeouts(connect=1.0, headers=0.3, idle=0.3)
SLOW = Timeouts(connect=1.0, headers=5.0, idle=5.0)  # for tests where a timeout must NOT be what ends things

OPENAI_PATH = "/v1/chat/completions"
OLLAMA_PATH = "/api/chat"
LLAMACPP_PATH = "/completion"


# -- the relay ------------------------------------------------------------------------------------


class Running:
    """A started relay and the failures it reported."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.failures: list[Failure] = []
        self.relay = Relay(self.failures.append, timeouts)

    @property
    def address(self) -> tuple[str, int]:
        assert self.relay.address is not None
        return self.relay.address


@pytest.fixture
async def start_relay() -> AsyncIterator[Callable[[Timeouts], Awaitable[Running]]]:
    started: list[Running] = []

    async def start(timeouts: Timeouts = FAST) -> Running:
        running = Running(timeouts)
        await running.relay.start()
        started.append(running)
        return running

    yield start
    for running in started:
        running.relay.close()


@pytest.fixture
async def relay(start_relay) -> Running:
    return await start_relay(FAST)


# -- a raw backend --------------------------------------------------------------------------------


class BackendConn:
    """One connection the backend accepted: what it received, and its streams to misbehave with."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.received = bytearray()
        self.eof_at: float | None = None
        self.eof = asyncio.Event()

    async def read_request(self) -> bytes:
        """One whole request (head and Content-Length body), as the exact bytes that arrived."""
        start = len(self.received)
        while b"\r\n\r\n" not in self.received[start:]:
            await self._read_more()
        head_end = self.received.index(b"\r\n\r\n", start) + 4
        length = 0
        for line in bytes(self.received[start:head_end]).split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(self.received) < head_end + length:
            await self._read_more()
        return bytes(self.received[start : head_end + length])

    async def wait_for_eof(self) -> float:
        """Read until the relay closes its side; the moment it did."""
        while self.eof_at is None:
            await self._read_more(allow_eof=True)
        return self.eof_at

    async def _read_more(self, allow_eof: bool = False) -> None:
        data = await asyncio.wait_for(self.reader.read(65536), WAIT)
        if not data:
            self.eof_at = time.monotonic()
            self.eof.set()
            if not allow_eof:
                raise ConnectionError("the relay closed the backend connection")
        self.received += data

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def reset(self) -> None:
        """Close with an RST instead of a FIN."""
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


Handler = Callable[[BackendConn], Awaitable[None]]


class Backend:
    """A backend on 127.0.0.1 that runs `handler` for each connection and keeps every connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.conns: list[BackendConn] = []
        self.errors: list[BaseException] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> Backend:
        self._server = await asyncio.start_server(self._serve, LOOPBACK, 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = BackendConn(reader, writer)
        self.conns.append(conn)
        try:
            await self.handler(conn)
        except (ConnectionError, TimeoutError, asyncio.CancelledError) as e:
            self.errors.append(e)
        finally:
            self._tasks.discard(task)
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.sleep(0)


@pytest.fixture
async def backends() -> AsyncIterator[Callable[[Handler], Awaitable[Backend]]]:
    started: list[Backend] = []

    async def start(handler: Handler) -> Backend:
        backend = await Backend(handler).start()
        started.append(backend)
        return backend

    yield start
    for backend in started:
        await backend.close()


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def buffered(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode() + extra + b"\r\n" + body


def stream_head(content_type: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


SSE = b"text/event-stream"
NDJSON = b"application/x-ndjson"
EVENT_1 = b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'
EVENT_2 = b'data: {"choices":[{"delta":{"content":"lo"}}]}\n\n'
LINE_1 = b'{"message":{"content":"Hel"},"done":false}\n'
LINE_2 = b'{"message":{"content":"lo"},"done":false}\n'


# -- a raw tunnel client --------------------------------------------------------------------------


async def raw_connect(relay: Running, head: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*relay.address), WAIT)
    writer.write(head)
    await writer.drain()
    return reader, writer


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), WAIT)


class Tunnel:
    """A tunnel through the relay, opened as mitmproxy opens it, with h11 on the client side."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, relay: Running, port: int) -> Tunnel:
        connect = f"CONNECT {LOOPBACK}:{port} HTTP/1.1\r\nHost: {LOOPBACK}:{port}\r\n"
        connect += f"Proxy-Authorization: {relay.relay.authorization}\r\n\r\n"
        reader, writer = await raw_connect(relay, connect.encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert head.startswith(b"HTTP/1.1 200 "), head
        return cls(reader, writer)

    async def send(self, method: str, target: str, headers: list[tuple[str, str]] | None = None, body: bytes = b"") -> bytes:
        """Send one request; the exact bytes sent."""
        headers = [("Host", "backend.test")] + (headers or [])
        if body or method == "POST":
            headers.append(("Content-Length", str(len(body))))
        data = self.h11.send(h11.Request(method=method, target=target, headers=headers))
        data += self.h11.send(h11.Data(data=body)) + self.h11.send(h11.EndOfMessage())
        self.writer.write(data)
        await self.writer.drain()
        return data

    async def next_event(self, timeout: float = WAIT) -> Any:
        while (event := self.h11.next_event()) is h11.NEED_DATA:
            self.h11.receive_data(await asyncio.wait_for(self.reader.read(65536), timeout))
        return event

    async def response(self) -> tuple[h11.Response, bytes, list[bytes]]:
        """The whole answer: its head, its body and the body's pieces as they were parsed."""
        response = await self.next_event()
        assert isinstance(response, h11.Response), response
        pieces: list[bytes] = []
        while not isinstance(event := await self.next_event(), h11.EndOfMessage):
            assert isinstance(event, h11.Data), event
            pieces.append(event.data)
        return response, b"".join(pieces), pieces

    async def exchange(self, *args: Any, **kwargs: Any) -> tuple[h11.Response, bytes]:
        await self.send(*args, **kwargs)
        response, body, _ = await self.response()
        return response, body

    async def closed(self) -> bool:
        """Whether the relay ends the tunnel (EOF, with nothing more sent) within the bound."""
        try:
            return await asyncio.wait_for(self.reader.read(1), WAIT) == b""
        except TimeoutError:
            return False

    def close(self) -> None:
        self.writer.close()


def header(response: h11.Response, name: bytes) -> bytes | None:
    return dict(response.headers).get(name.lower())


@pytest.fixture
async def tunnels() -> AsyncIterator[Callable[[Running, int], Awaitable[Tunnel]]]:
    opened: list[Tunnel] = []

    async def open_tunnel(relay: Running, port: int) -> Tunnel:
        tunnel = await Tunnel.open(relay, port)
        opened.append(tunnel)
        return tunnel

    yield open_tunnel
    for tunnel in opened:
        tunnel.close()
    if opened:
        await asyncio.sleep(0.01)  # the relay sees the ends before it is closed, so it cancels no tunnel


def assert_shape(path: str, body: Any, status: int, code: str | None = None) -> str:
    """The error body in the convention of the API `path` belongs to; its message."""
    if path.startswith("/v1/"):
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "api_error" and body["error"]["param"] is None
        assert body["error"]["code"] == (code or ("backend_timeout" if status == 504 else "backend_unreachable"))
        return body["error"]["message"]
    if path.startswith("/api/"):
        assert set(body) == {"error"} and isinstance(body["error"], str)
        return body["error"]
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "type"}
    assert body["error"]["code"] == status and body["error"]["type"] == "unavailable_error"
    return body["error"]["message"]


def assert_error_answer(response: h11.Response, body: bytes, path: str, status: int) -> str:
    assert response.status_code == status
    assert response.reason == HTTPStatus(status).phrase.encode(), "a status line with its reason (it was empty)"
    assert header(response, b"content-type") == b"application/json; charset=utf-8"
    assert header(response, b"content-length") == str(len(body)).encode()
    reason = header(response, ERROR_HEADER)
    assert reason is not None and reason.startswith(b"ContextPaw: ")
    message = assert_shape(path, json.loads(body), status)
    assert message == reason.decode()
    return message


# -- 1. the handshake -----------------------------------------------------------------------------


async def test_a_connect_without_the_secret_is_refused_with_407(relay: Running) -> None:
    reader, writer = await raw_connect(relay, f"CONNECT {LOOPBACK}:80 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    try:
        answer = await read_to_eof(reader)  # returns only once the relay closed the connection
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 407 ")
    assert answer.endswith(b"\r\n\r\n") and b"Content-Length: 0" in answer


async def test_a_connect_with_a_wrong_secret_is_refused_with_407(relay: Running) -> None:
    wrong = relay.relay.authorization[:-1] + ("A" if relay.relay.authorization[-1] != "A" else "B")
    head = f"CONNECT {LOOPBACK}:80 HTTP/1.1\r\nProxy-Authorization: {wrong}\r\n\r\n".encode()
    reader, writer = await raw_connect(relay, head)
    try:
        answer = await read_to_eof(reader)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 407 ")


async def test_a_first_line_that_is_not_connect_is_refused_with_407_even_with_the_secret(relay: Running, backends) -> None:
    backend = await backends(lambda conn: conn.read_request())
    head = f"GET http://{LOOPBACK}:{backend.port}/ HTTP/1.1\r\nProxy-Authorization: {relay.relay.authorization}\r\n\r\n"
    reader, writer = await raw_connect(relay, head.encode())
    try:
        answer = await read_to_eof(reader)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 407 ")
    assert backend.conns == []


async def test_a_connect_with_the_secret_opens_the_tunnel(relay: Running, tunnels) -> None:
    tunnel = await tunnels(relay, closed_port())  # no connection to the target until a request comes
    assert tunnel.h11.our_state is h11.IDLE


# -- 2. and 3. forwarding -------------------------------------------------------------------------


async def test_a_request_reaches_the_backend_byte_for_byte_and_its_answer_reaches_the_client(relay: Running, backends, tunnels) -> None:
    received: list[bytes] = []
    answer_body = b'{"id":"x","choices":[{"message":{"content":"hi"}}]}'

    async def handler(conn: BackendConn) -> None:
        received.append(await conn.read_request())
        await conn.send(buffered(answer_body, "201 Created", b"X-Backend-Thing: Yes\r\nSet-Cookie: a=b\r\n"))

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "h\u00e9llo"}]}).encode()
    sent = await tunnel.send(
        "POST",
        OPENAI_PATH + "?x=1&y=%20",
        [("Authorization", "Bearer sk-Secret.Token"), ("X-Mixed-CASE", "Value With  Spaces"), ("Content-Type", "application/json")],
        body,
    )
    response, got, _ = await tunnel.response()

    assert received == [sent]
    assert b"\r\nX-Mixed-CASE: Value With  Spaces\r\n" in received[0]
    assert b"\r\nAuthorization: Bearer sk-Secret.Token\r\n" in received[0]
    assert received[0].startswith(b"POST /v1/chat/completions?x=1&y=%20 HTTP/1.1\r\n")
    assert response.status_code == 201 and response.reason == b"Created"
    assert header(response, b"x-backend-thing") == b"Yes"
    assert header(response, b"set-cookie") == b"a=b"
    assert header(response, b"content-type") == b"application/json"
    assert header(response, b"content-length") == str(len(answer_body)).encode()
    assert header(response, ERROR_HEADER) is None
    assert got == answer_body
    assert relay.failures == []


OVERFLOW = json.dumps({"error": {"code": 400, "type": "exceed_context_size_error"}}).encode()
"""llama-server's 400 for a prompt over its window."""


def overflow_then_ok(received: list[bytes]) -> Handler:
    """A backend that answers a request with the overflow 400 and its retry with `{"ok":true}`,
    keeping both requests as they arrived in `received`."""

    async def handler(conn: BackendConn) -> None:
        received.append(await conn.read_request())
        await conn.send(buffered(OVERFLOW, "400 Bad Request"))
        received.append(await conn.read_request())
        await conn.send(buffered(b'{"ok":true}'))

    return handler


async def test_the_flow_key_never_reaches_the_backend_and_a_rescue_is_asked_by_it(relay: Running, backends, tunnels) -> None:
    """The addon gives a request its flow's key; the backend's overflow goes to that flow's rescue,
    whose retry is sent instead, and the backend sees neither the key nor the first answer's fate."""
    received: list[bytes] = []
    handler = overflow_then_ok(received)
    asked: list[tuple[str, int, bytes]] = []

    def rescuer(key: str) -> Callable[[int, bytes], Awaitable[bytes | None]] | None:
        async def decide(status: int, answer: bytes) -> bytes | None:
            asked.append((key, status, answer))
            return b'{"smaller":1}' if len(asked) == 1 else None

        return decide if key == "flow-1" else None

    relay.relay.rescue = rescuer
    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("POST", OPENAI_PATH, [("Content-Type", "application/json"), (FLOW_HEADER, "flow-1")], b'{"big":1}')
    response, got, _ = await tunnel.response()
    assert response.status_code == 200 and got == b'{"ok":true}'
    assert asked == [("flow-1", 400, OVERFLOW)]
    assert received[1].endswith(b'{"smaller":1}') and all(FLOW_HEADER.lower().encode() not in r.lower() for r in received)


async def test_every_request_the_relay_sends_carries_its_mark_the_retry_too(relay: Running, backends, tunnels) -> None:
    """The instance's loop mark is the relay's to add, on the way out: a flow it carries is never
    marked (and unmarked again) for it."""
    received: list[bytes] = []
    handler = overflow_then_ok(received)

    async def decide(status: int, answer: bytes) -> bytes | None:
        return b'{"smaller":1}'

    relay.relay.mark = (b"X-ContextPaw-Hop", b"0123abcd")
    relay.relay.rescue = lambda key: decide
    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("POST", OPENAI_PATH, [("Content-Type", "application/json"), (FLOW_HEADER, "flow-1")], b'{"big":1}')
    response, got, _ = await tunnel.response()
    assert response.status_code == 200 and got == b'{"ok":true}'
    assert len(received) == 2 and all(b"\r\nX-ContextPaw-Hop: 0123abcd\r\n" in r for r in received)


async def test_a_request_without_a_flow_key_gets_the_backends_overflow_as_it_came(relay: Running, backends, tunnels) -> None:
    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        await conn.send(buffered(OVERFLOW, "400 Bad Request"))

    relay.relay.rescue = lambda key: pytest.fail("asked about a flow nobody named")
    tunnel = await tunnels(relay, (await backends(handler)).port)
    await tunnel.send("POST", OPENAI_PATH, [("Content-Type", "application/json")], b'{"big":1}')
    response, got, _ = await tunnel.response()
    assert response.status_code == 400 and got == OVERFLOW


async def test_a_chunked_backend_answer_is_relayed_with_its_whole_body(relay: Running, backends, tunnels) -> None:
    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        await conn.send(head + chunk(b'{"a":') + chunk(b"1}") + b"0\r\n\r\n")

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    response, body = await tunnel.exchange("GET", "/props")
    assert response.status_code == 200 and body == b'{"a":1}'
    assert header(response, b"content-length") == b"7" and header(response, b"transfer-encoding") is None


async def test_a_big_buffered_answer_reaches_the_client_whole_in_writes_of_about_a_mib(
    relay: Running, backends, tunnels, monkeypatch
) -> None:
    """One write of the whole answer copies it three times in one step of the event loop: with
    300 MB every other client waited seconds (the N4 row of measure_hardening.py)."""
    answer = json.dumps({"text": "x" * (5 * WRITE_SIZE)}).encode()
    writes: list[int] = []
    write = asyncio.StreamWriter.write
    monkeypatch.setattr(asyncio.StreamWriter, "write", lambda self, data: (writes.append(len(data)), write(self, data))[1])

    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        whole = buffered(answer)
        for start in range(0, len(whole), 1 << 16):
            await conn.send(whole[start : start + (1 << 16)])

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    response, body = await tunnel.exchange("GET", "/api/show")
    assert response.status_code == 200 and body == answer
    assert header(response, b"content-length") == str(len(answer)).encode()
    assert max(writes) <= WRITE_SIZE + (1 << 16) + 1024 < len(answer)


async def test_the_answer_header_names_keep_their_case(relay: Running, backends, tunnels) -> None:
    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        await conn.send(buffered(b"{}", extra=b"X-Backend-Thing: Yes\r\n"))

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("GET", "/props")
    response = await tunnel.next_event()
    assert (b"X-Backend-Thing", b"Yes") in response.headers.raw_items()


async def test_two_requests_in_one_tunnel_share_one_kept_alive_backend_connection(relay: Running, backends, tunnels) -> None:
    async def handler(conn: BackendConn) -> None:
        for _ in range(2):
            request = await conn.read_request()
            await conn.send(buffered(b'{"n":"' + request.split(b" ")[1] + b'"}'))
        await conn.wait_for_eof()

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    first, first_body = await tunnel.exchange("GET", "/one")
    tunnel.h11.start_next_cycle()
    second, second_body = await tunnel.exchange("GET", "/two")

    assert (first.status_code, first_body) == (200, b'{"n":"/one"}')
    assert (second.status_code, second_body) == (200, b'{"n":"/two"}')
    assert len(backend.conns) == 1
    assert relay.failures == []


async def test_a_kept_connection_the_backend_closed_is_not_reused(relay: Running, backends, tunnels) -> None:
    """A backend may close an idle keep-alive connection: the next request goes on a new one."""

    async def handler(conn: BackendConn) -> None:
        request = await conn.read_request()
        await conn.send(buffered(b'{"n":"' + request.split(b" ")[1] + b'"}'))
        conn.writer.close()

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    first, _ = await tunnel.exchange("GET", "/one")
    await asyncio.sleep(0.05)
    tunnel.h11.start_next_cycle()
    second, second_body = await tunnel.exchange("GET", "/two")

    assert first.status_code == 200 and (second.status_code, second_body) == (200, b'{"n":"/two"}')
    assert len(backend.conns) == 2 and relay.failures == []


async def test_a_request_the_backend_took_and_dropped_is_answered_502_never_sent_twice(relay: Running, backends, tunnels) -> None:
    """The backend reads the request on a kept connection, then the connection dies (a crash while it
    worked on it): resending could run a crashing prompt twice, so the client gets a 502."""

    async def handler(conn: BackendConn) -> None:
        request = await conn.read_request()
        await conn.send(buffered(b'{"n":"' + request.split(b" ")[1] + b'"}'))
        await conn.read_request()
        conn.writer.close()

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.exchange("POST", OPENAI_PATH, [("Content-Type", "application/json")], b"{}")
    tunnel.h11.start_next_cycle()
    second, body = await tunnel.exchange("POST", OPENAI_PATH, [("Content-Type", "application/json")], b'{"n":2}')

    assert_error_answer(second, body, OPENAI_PATH, 502)
    assert len(backend.conns) == 1 and bytes(backend.conns[0].received).count(b'{"n":2}') == 1


async def test_a_kept_connection_idle_too_long_is_not_reused(relay: Running, backends, tunnels, monkeypatch) -> None:
    import contextpaw.relay.loopback

    monkeypatch.setattr(contextpaw.relay.exchange, "KEEP_ALIVE_S", 0.05)

    async def handler(conn: BackendConn) -> None:
        request = await conn.read_request()
        await conn.send(buffered(b'{"n":"' + request.split(b" ")[1] + b'"}'))
        await conn.wait_for_eof()

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.exchange("GET", "/one")
    await asyncio.sleep(0.2)
    tunnel.h11.start_next_cycle()
    second, _ = await tunnel.exchange("GET", "/two")
    assert second.status_code == 200 and len(backend.conns) == 2
    await asyncio.wait_for(backend.conns[0].eof.wait(), WAIT)  # the stale one was closed, not leaked


async def test_a_second_request_written_before_the_first_answer_is_forwarded_after_it(relay: Running, backends, tunnels) -> None:
    """Pipelined requests (mitmproxy does not pipeline, but the relay reads them without loss)."""
    first_arrived = asyncio.Event()

    async def handler(conn: BackendConn) -> None:
        request = await conn.read_request()
        if b"/one" in request.split(b"\r\n")[0]:
            first_arrived.set()
            await asyncio.sleep(0.1)  # the second request reaches the relay while this one is in flight
        await conn.send(buffered(b'{"n":"' + request.split(b" ")[1] + b'"}', extra=b"Connection: close\r\n"))  # a new one next

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    first_sent = await tunnel.send("GET", "/one")
    await asyncio.wait_for(first_arrived.wait(), WAIT)
    # h11 forbids a second request before the first answer, so it is written by hand.
    second_sent = b"GET /two HTTP/1.1\r\nHost: backend.test\r\n\r\n"
    tunnel.writer.write(second_sent)
    await tunnel.writer.drain()
    first, first_body, _ = await tunnel.response()
    tunnel.h11.start_next_cycle()
    tunnel.h11.send(h11.Request(method="GET", target="/two", headers=[("Host", "backend.test")]))
    tunnel.h11.send(h11.EndOfMessage())
    second, second_body, _ = await tunnel.response()

    assert first_body == b'{"n":"/one"}' and second_body == b'{"n":"/two"}'
    assert [bytes(c.received) for c in backend.conns] == [first_sent, second_sent]


# -- 4. and 5. failures before the answer's headers -----------------------------------------------


@pytest.mark.parametrize("path", [OPENAI_PATH, OLLAMA_PATH, LLAMACPP_PATH])
async def test_a_backend_that_refuses_the_connection_gets_a_json_502_in_the_callers_convention(relay: Running, tunnels, path: str) -> None:
    port = closed_port()
    tunnel = await tunnels(relay, port)
    response, body = await tunnel.exchange("POST", path, [("Content-Type", "application/json")], b"{}")

    message = assert_error_answer(response, body, path, 502)
    assert f"{LOOPBACK}:{port}" in message and "does not answer" in message
    assert relay.failures == [
        Failure("POST", path, f"{LOOPBACK}:{port}", relay.failures[0].reason, timed_out=False, streamed=False, connected=False)
    ]
    assert message == "ContextPaw: " + relay.failures[0].reason


async def test_the_tunnel_stays_open_after_an_error_answer(relay: Running, tunnels) -> None:
    tunnel = await tunnels(relay, closed_port())
    response, _ = await tunnel.exchange("GET", OPENAI_PATH)
    assert response.status_code == 502
    assert not await asyncio.wait_for(_closed_soon(tunnel), WAIT)


async def _closed_soon(tunnel: Tunnel) -> bool:
    try:
        return await asyncio.wait_for(tunnel.reader.read(1), 0.2) == b""
    except TimeoutError:
        return False


async def _close_after_reading(conn: BackendConn) -> None:
    await conn.read_request()


async def _close_without_reading(conn: BackendConn) -> None:
    pass


async def _reset_after_reading(conn: BackendConn) -> None:
    await conn.read_request()
    conn.reset()


async def _half_an_answer_head(conn: BackendConn) -> None:
    await conn.read_request()
    await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: appl")


@pytest.mark.parametrize(
    "handler",
    [_close_after_reading, _close_without_reading, _reset_after_reading, _half_an_answer_head],
    ids=["closes", "closes-unread", "resets", "closes-mid-head"],
)
async def test_a_backend_that_goes_away_before_its_headers_gets_a_502(relay: Running, backends, tunnels, handler: Handler) -> None:
    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    started = time.monotonic()
    response, body = await tunnel.exchange("POST", OPENAI_PATH, [("Content-Type", "application/json")], b'{"x":1}')

    assert time.monotonic() - started < FAST.headers  # at once, not after a timeout
    assert_error_answer(response, body, OPENAI_PATH, 502)
    assert len(relay.failures) == 1
    failure = relay.failures[0]
    assert (failure.timed_out, failure.streamed, failure.target) == (False, False, f"{LOOPBACK}:{backend.port}")


async def _close_mid_body(conn: BackendConn) -> None:
    await conn.read_request()
    await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")


async def _close_mid_stream(conn: BackendConn) -> None:
    await conn.read_request()
    await conn.send(stream_head(SSE) + chunk(EVENT_1))


@pytest.mark.parametrize(
    ("handler", "where"),
    [
        (_close_after_reading, "before its answer's headers"),
        (_close_mid_body, "in the middle of its answer"),
        (_close_mid_stream, "in the middle of its stream"),
    ],
    ids=["before-headers", "mid-body", "mid-stream"],
)
async def test_a_backend_that_closes_mid_answer_is_reported_as_having_closed(
    relay: Running, backends, tunnels, handler: Handler, where: str
) -> None:
    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.exchange("GET", OPENAI_PATH)
    assert [f.reason for f in relay.failures] == [f"the backend at {LOOPBACK}:{backend.port} closed the connection {where}"]


async def test_a_backend_that_stops_reading_the_request_gets_a_504_after_the_header_timeout(relay: Running, backends, tunnels) -> None:
    async def handler(conn: BackendConn) -> None:
        conn.writer.transport.pause_reading()  # reads nothing more, and closes nothing
        await asyncio.sleep(WAIT)  # cancelled when the test ends

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    body = b"x" * (16 * 1024 * 1024)  # more than the socket buffers hold on both sides
    response, answer = await tunnel.exchange("POST", OPENAI_PATH, [("Content-Type", "application/json")], body)
    assert relay.failures and "stopped reading the request" in relay.failures[0].reason  # the drain did stall
    assert response.status_code == 504
    assert [f.timed_out for f in relay.failures] == [True]


@pytest.mark.parametrize("path", [OPENAI_PATH, OLLAMA_PATH, LLAMACPP_PATH])
async def test_a_backend_that_sends_nothing_gets_a_504_after_the_header_timeout(relay: Running, backends, tunnels, path: str) -> None:
    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        await conn.wait_for_eof()  # thinks forever, until the relay gives up

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    started = time.monotonic()
    response, body = await tunnel.exchange("POST", path, [("Content-Type", "application/json")], b"{}")
    elapsed = time.monotonic() - started

    assert FAST.headers * 0.9 <= elapsed < FAST.headers + 1.0
    message = assert_error_answer(response, body, path, 504)
    assert "sent no answer" in message
    assert [(f.timed_out, f.streamed) for f in relay.failures] == [(True, False)]
    await asyncio.wait_for(backend.conns[0].eof.wait(), WAIT)  # and the relay let go of the backend


async def test_a_backend_that_sends_a_broken_head_gets_a_502(relay: Running, backends, tunnels) -> None:
    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        await conn.send(b"SPLAT not http at all\r\n\r\n")
        await conn.wait_for_eof()

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    response, body = await tunnel.exchange("GET", OLLAMA_PATH)
    message = assert_error_answer(response, body, OLLAMA_PATH, 502)
    assert "broken HTTP" in message
    assert [f.timed_out for f in relay.failures] == [False]


# -- 6. buffered answers that break off -----------------------------------------------------------


async def test_a_buffered_answer_that_breaks_off_mid_body_gets_a_502_not_a_truncated_body(relay: Running, backends, tunnels) -> None:
    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
        await conn.send(b'{"choices":[{"mes')

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    response, body = await tunnel.exchange("POST", OPENAI_PATH, [("Content-Type", "application/json")], b"{}")

    assert b"choices" not in body
    assert_error_answer(response, body, OPENAI_PATH, 502)
    assert [(f.timed_out, f.streamed) for f in relay.failures] == [(False, False)]


async def test_a_buffered_answer_that_stalls_mid_body_gets_a_504(relay: Running, backends, tunnels) -> None:
    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        await conn.wait_for_eof()

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    response, body = await tunnel.exchange("POST", LLAMACPP_PATH, [("Content-Type", "application/json")], b"{}")

    message = assert_error_answer(response, body, LLAMACPP_PATH, 504)
    assert "stalled in its answer" in message
    assert [(f.timed_out, f.streamed) for f in relay.failures] == [(True, False)]


# -- 7. and 8. streams ------------------------------------------------------------------------------


def stream_handler(content_type: bytes, records: list[bytes], then: str) -> Handler:
    """A streaming backend that sends `records` as chunks and then stalls, breaks off or ends."""

    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        await conn.send(stream_head(content_type))
        for record in records:
            await conn.send(chunk(record))
        if then == "stall":
            await conn.wait_for_eof()
        elif then == "end":
            await conn.send(b"0\r\n\r\n")
            await conn.wait_for_eof()
        # "break": return, and the backend closes mid-stream

    return handler


@pytest.mark.parametrize(("then", "status"), [("stall", 504), ("break", 502)])
async def test_an_sse_stream_that_stalls_or_breaks_gets_an_error_event_then_a_clean_end(
    relay: Running, backends, tunnels, then: str, status: int
) -> None:
    backend = await backends(stream_handler(SSE, [EVENT_1, EVENT_2], then))
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("POST", OPENAI_PATH, [("Content-Type", "application/json")], b'{"stream":true}')
    response, body, _ = await tunnel.response()  # a clean end: h11 saw the chunked terminator

    assert response.status_code == 200
    assert header(response, b"content-type") == SSE
    assert header(response, b"transfer-encoding") == b"chunked"
    assert header(response, ERROR_HEADER) is None  # too late for a header: the error is in the stream
    assert body.startswith(EVENT_1 + EVENT_2)
    record = body[len(EVENT_1 + EVENT_2) :]
    assert record.startswith(b"data: ") and record.endswith(b"\n\n") and record.count(b"\n\n") == 1
    message = assert_shape(OPENAI_PATH, json.loads(record[len(b"data: ") :]), status)
    assert message.startswith("ContextPaw: ") and f"{LOOPBACK}:{backend.port}" in message
    if then == "stall":
        assert "stalled in its stream" in message
    assert [(f.timed_out, f.streamed) for f in relay.failures] == [(then == "stall", True)]


async def test_an_ndjson_stream_that_stalls_gets_an_error_line_then_a_clean_end(relay: Running, backends, tunnels) -> None:
    backend = await backends(stream_handler(NDJSON, [LINE_1, LINE_2], "stall"))
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("POST", OLLAMA_PATH, [("Content-Type", "application/json")], b'{"stream":true}')
    response, body, _ = await tunnel.response()

    assert response.status_code == 200 and header(response, b"content-type") == NDJSON
    assert body.startswith(LINE_1 + LINE_2)
    line = body[len(LINE_1 + LINE_2) :]
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    error = json.loads(line)
    assert set(error) == {"error"} and isinstance(error["error"], str) and "stalled" in error["error"]
    assert len(relay.failures) == 1
    failure = relay.failures[0]
    assert (failure.method, failure.path, failure.timed_out, failure.streamed) == ("POST", OLLAMA_PATH, True, True)


async def test_a_stream_that_ends_normally_is_relayed_unchanged(relay: Running, backends, tunnels) -> None:
    backend = await backends(stream_handler(SSE, [EVENT_1, EVENT_2, b"data: [DONE]\n\n"], "end"))
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("POST", OPENAI_PATH, body=b"{}")
    response, body, _ = await tunnel.response()
    assert response.status_code == 200 and body == EVENT_1 + EVENT_2 + b"data: [DONE]\n\n"
    assert relay.failures == []


async def test_a_stream_with_a_content_length_is_relayed_chunked(relay: Running, backends, tunnels) -> None:
    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(EVENT_1)
        await conn.send(head + EVENT_1)
        await conn.wait_for_eof()

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("GET", OPENAI_PATH)
    response, body, _ = await tunnel.response()
    assert body == EVENT_1 and header(response, b"transfer-encoding") == b"chunked"
    assert header(response, b"content-length") is None
    assert relay.failures == []


async def test_stream_chunks_are_relayed_as_they_come(relay: Running, backends, tunnels) -> None:
    client_saw_first = asyncio.Event()

    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        await conn.send(stream_head(SSE) + chunk(EVENT_1))
        await asyncio.wait_for(client_saw_first.wait(), WAIT)
        await conn.send(chunk(EVENT_2) + b"0\r\n\r\n")
        await conn.wait_for_eof()

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("POST", OPENAI_PATH, body=b"{}")
    response = await tunnel.next_event()
    assert isinstance(response, h11.Response) and response.status_code == 200
    first = await tunnel.next_event(timeout=FAST.idle * 2)  # well before the relay's idle timeout would fire
    assert isinstance(first, h11.Data) and first.data == EVENT_1
    client_saw_first.set()
    rest = bytearray()
    while not isinstance(event := await tunnel.next_event(), h11.EndOfMessage):
        rest += event.data
    assert rest == EVENT_2
    assert relay.failures == []


async def test_stream_records_that_arrive_in_one_read_go_on_in_one_chunk(relay: Running, backends, tunnels) -> None:
    done = b"data: [DONE]\n\n"

    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        await conn.send(stream_head(SSE) + chunk(EVENT_1) + chunk(EVENT_2) + chunk(done) + b"0\r\n\r\n")
        await conn.wait_for_eof()

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("POST", OPENAI_PATH, body=b"{}")
    response, body, pieces = await tunnel.response()
    assert response.status_code == 200 and body == EVENT_1 + EVENT_2 + done
    assert pieces == [EVENT_1 + EVENT_2 + done]  # one chunk, one write: not three
    assert relay.failures == []


async def test_records_read_together_with_a_broken_chunk_go_on_before_the_error_event(relay: Running, backends, tunnels) -> None:
    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        await conn.send(stream_head(SSE) + chunk(EVENT_1) + chunk(EVENT_2) + b"zz\r\n")  # not a chunk size
        await conn.wait_for_eof()

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("POST", OPENAI_PATH, body=b"{}")
    response, body, _ = await tunnel.response()
    assert response.status_code == 200
    assert body.startswith(EVENT_1 + EVENT_2)  # what came before the break is not lost with it
    message = assert_shape(OPENAI_PATH, json.loads(body[len(EVENT_1 + EVENT_2) + len(b"data: ") :]), 502)
    assert "broken HTTP" in message
    assert [(f.timed_out, f.streamed) for f in relay.failures] == [(False, True)]


# -- 9. the client goes away -----------------------------------------------------------------------


async def test_a_client_that_closes_the_tunnel_before_the_headers_frees_the_backend_connection_at_once(
    start_relay, backends, tunnels
) -> None:
    relay = await start_relay(SLOW)
    forwarded = asyncio.Event()
    eof: list[float] = []

    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        forwarded.set()
        eof.append(await conn.wait_for_eof())  # still thinking when the client leaves

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("POST", OPENAI_PATH, body=b"{}")
    await asyncio.wait_for(forwarded.wait(), WAIT)
    closed_at = time.monotonic()
    tunnel.close()
    await asyncio.wait_for(_until(lambda: bool(eof)), WAIT)

    assert eof[0] - closed_at < 1.0 < SLOW.headers
    assert relay.failures == []  # the client left; the backend did not fail


async def test_a_client_that_closes_the_tunnel_mid_stream_frees_the_backend_connection_at_once(start_relay, backends, tunnels) -> None:
    relay = await start_relay(SLOW)
    eof: list[float] = []

    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        await conn.send(stream_head(SSE) + chunk(EVENT_1))
        eof.append(await conn.wait_for_eof())

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("POST", OPENAI_PATH, body=b"{}")
    assert isinstance(await tunnel.next_event(), h11.Response)
    assert isinstance(await tunnel.next_event(), h11.Data)
    closed_at = time.monotonic()
    tunnel.close()
    await asyncio.wait_for(_until(lambda: bool(eof)), WAIT)

    assert eof[0] - closed_at < 1.0 < SLOW.idle
    assert relay.failures == []


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


# -- 10. Connection: close ------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True], ids=["buffered", "stream"])
async def test_a_backend_that_closes_after_its_answer_ends_its_connection_not_the_tunnel(
    relay: Running, backends, tunnels, streamed: bool
) -> None:
    """`Connection: close` is about the backend's connection (hop by hop): the answer reaches the
    client without it, the tunnel stays open, and the next request goes on a new backend connection."""

    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        if streamed:
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            await conn.send(head + chunk(EVENT_1) + b"0\r\n\r\n")
        else:
            await conn.send(buffered(b'{"ok":true}', extra=b"Connection: close\r\n"))

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    response, body = await tunnel.exchange("GET", OPENAI_PATH)

    assert response.status_code == 200 and body == (EVENT_1 if streamed else b'{"ok":true}')
    assert header(response, b"connection") is None
    tunnel.h11.start_next_cycle()
    again, _ = await tunnel.exchange("GET", OPENAI_PATH)
    assert again.status_code == 200 and len(backend.conns) == 2
    assert relay.failures == []


# -- closing the relay ----------------------------------------------------------------------------


async def test_closing_the_relay_ends_its_idle_tunnels(relay: Running, tunnels) -> None:
    tunnel = await tunnels(relay, closed_port())
    relay.relay.close()
    assert relay.relay.address is None
    assert await tunnel.closed()


async def test_closing_the_relay_lets_an_answer_in_flight_finish_then_ends_its_tunnel(relay: Running, backends, tunnels) -> None:
    """A reloaded script closes its relay: a stream being relayed still reaches its end."""
    started = asyncio.Event()

    async def handler(conn: BackendConn) -> None:
        await conn.read_request()
        await conn.send(stream_head(SSE) + chunk(EVENT_1))
        started.set()
        await asyncio.sleep(0.2)
        await conn.send(chunk(EVENT_2) + b"0\r\n\r\n")

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    await tunnel.send("POST", OPENAI_PATH, [("Content-Type", "application/json")], b"{}")
    await asyncio.wait_for(started.wait(), WAIT)
    relay.relay.close()
    response, body, _ = await tunnel.response()
    assert response.status_code == 200 and body == EVENT_1 + EVENT_2
    assert await tunnel.closed() and relay.failures == []


# -- requests h11 is strict about ------------------------------------------------------------------


def _echo_path(conn_request: bytes) -> bytes:
    return buffered(b'{"n":"' + conn_request.split(b" ")[1] + b'"}')


async def test_an_http_1_0_request_without_host_is_forwarded_with_the_targets_host(relay: Running, backends, tunnels) -> None:
    async def handler(conn: BackendConn) -> None:
        await conn.send(_echo_path(await conn.read_request()))

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    tunnel.writer.write(b"POST /completion HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}")
    answer = await asyncio.wait_for(tunnel.reader.read(65536), WAIT)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"n":"/completion"}')
    assert f"Host: {LOOPBACK}:{backend.port}".encode() in bytes(backend.conns[0].received)


async def test_a_request_the_relay_cannot_read_gets_a_json_400_not_a_dropped_tunnel(relay: Running, tunnels) -> None:
    tunnel = await tunnels(relay, closed_port())
    tunnel.writer.write("POST /v1/chat/completions?q=é HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
    answer = await asyncio.wait_for(tunnel.reader.read(65536), WAIT)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and "cannot be relayed" in json.loads(body)["error"]["message"]


async def test_a_request_head_bigger_than_h11s_default_limit_is_forwarded(relay: Running, backends, tunnels) -> None:
    async def handler(conn: BackendConn) -> None:
        await conn.send(_echo_path(await conn.read_request()))

    backend = await backends(handler)
    tunnel = await tunnels(relay, backend.port)
    response, body = await tunnel.exchange("GET", "/props", [("Cookie", "c=" + "x" * 100_000)])
    assert response.status_code == 200 and body == b'{"n":"/props"}'
