"""Slow clients are bounded (the probe's N14): a connection that does not send a whole request
within `contextpaw_request_read_timeout` is closed, however often it sends a byte, while a normal
request and an answer that streams for longer than the deadline go through.

Against a real mitmdump, since the close goes through mitmproxy's connection handler; its
tcp_timeout (an idle timeout) is an hour, so only the deadline can close these connections.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from mitmproxy import connection, exceptions
from mitmproxy.test import taddons, tflow

from contextpaw.proxy.deadlines import RequestDeadlines
from support.backends import Backend, start_proxy
from support.common import LOOPBACK, running

DEADLINE_S = 2
STREAM_CHUNKS, STREAM_EVERY_S = 8, 0.5
"""The answer streams for 4 s, twice the deadline."""


def upstream() -> web.Application:
    async def quick(request: web.Request) -> web.Response:
        return web.Response(text=f"read {len(await request.read())} bytes")

    async def slow_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        for n in range(STREAM_CHUNKS):
            await response.write(b'{"n": %d}\n' % n)
            await asyncio.sleep(STREAM_EVERY_S)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/quick", quick)
    app.router.add_get("/stream", slow_stream)
    return app


@pytest.fixture(scope="module")
def proxy(workdir: Path) -> Iterator[Backend]:
    with running(upstream()) as url:
        options = [f"contextpaw_request_read_timeout={DEADLINE_S}", f"contextpaw_state_dir={workdir / 'slow-state'}",
                   "flow_detail=0"]  # fmt: skip
        with start_proxy(url, workdir / "slow-conf", workdir / "slow-clients.log", options=options) as backend:
            yield backend


def connect(proxy: Backend) -> socket.socket:
    port = int(proxy.url.rsplit(":", 1)[1])
    return socket.create_connection((LOOPBACK, port), timeout=5)


def dribble_until_closed(sock: socket.socket, head: bytes, give_up_s: float) -> float | None:
    """Send `head`, then one byte a second; the seconds until the proxy closed the connection, or
    None if it was still open after `give_up_s`."""
    started = time.monotonic()
    sock.sendall(head)
    while time.monotonic() - started < give_up_s:
        try:
            readable, _, _ = select.select([sock], [], [], 1.0)
            if readable and sock.recv(4096) == b"":
                return time.monotonic() - started
            sock.sendall(b"a")
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - started
    return None


def read_answer(sock: socket.socket) -> bytes:
    """One answer with a Content-Length, read whole."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def test_a_client_that_dribbles_its_headers_is_closed_at_the_deadline(proxy: Backend) -> None:
    with connect(proxy) as sock:
        took = dribble_until_closed(sock, b"GET /quick HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ", DEADLINE_S + 5)
    assert took is not None, "the connection was still open"
    assert DEADLINE_S - 0.5 <= took <= DEADLINE_S + 2


def test_a_client_that_dribbles_its_body_is_closed_at_the_deadline(proxy: Backend) -> None:
    with connect(proxy) as sock:
        took = dribble_until_closed(sock, b"POST /quick HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n", DEADLINE_S + 5)
    assert took is not None, "the connection was still open"
    assert DEADLINE_S - 0.5 <= took <= DEADLINE_S + 2


def test_a_kept_alive_connection_gets_a_new_deadline_for_its_next_request_and_no_more(proxy: Backend) -> None:
    with connect(proxy) as sock:
        time.sleep(DEADLINE_S / 2)
        sock.sendall(b"GET /quick HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_answer(sock).startswith(b"HTTP/1.1 200")
        time.sleep(DEADLINE_S * 0.75)  # more than the first request's deadline left, less than a fresh one
        sock.sendall(b"GET /quick HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_answer(sock).startswith(b"HTTP/1.1 200")
        took = dribble_until_closed(sock, b"GET /quick HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ", DEADLINE_S + 5)
    assert took is not None, "the connection was still open"
    assert took <= DEADLINE_S + 2


def test_a_normal_request_is_answered(proxy: Backend) -> None:
    with connect(proxy) as sock:
        sock.sendall(b"POST /quick HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\nhello")
        assert read_answer(sock).endswith(b"read 5 bytes")


def test_an_answer_that_streams_for_longer_than_the_deadline_arrives_whole(proxy: Backend) -> None:
    with connect(proxy) as sock:
        sock.settimeout(STREAM_EVERY_S * STREAM_CHUNKS + 5)
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        started, data = time.monotonic(), b""
        while not data.endswith(b"0\r\n\r\n"):  # the chunked answer's last chunk
            piece = sock.recv(4096)
            assert piece, f"closed after {time.monotonic() - started:.1f} s with {data[-200:]!r}"
            data += piece
    assert time.monotonic() - started > DEADLINE_S
    assert all(b'{"n": %d}' % n in data for n in range(STREAM_CHUNKS))


def test_a_deadline_under_a_second_is_refused() -> None:
    deadlines = RequestDeadlines()
    with taddons.context(deadlines) as tctx:
        tctx.configure(deadlines, contextpaw_request_read_timeout=30)
        assert deadlines.timeout_s == 30
        with pytest.raises(exceptions.OptionsError, match="contextpaw_request_read_timeout"):
            tctx.configure(deadlines, contextpaw_request_read_timeout=0)


class Proxyserver:
    """Stands in for mitmproxy's proxyserver addon: its connection handlers, which record a close."""

    def __init__(self) -> None:
        self.connections: dict[str, Proxyserver] = {}
        self.transports: dict[connection.Client, object] = {}
        self.closed: list[connection.Client] = []

    def close_connection(self, client: connection.Client) -> None:
        self.closed.append(client)


async def test_a_stall_of_the_proxy_itself_is_not_counted_against_the_client() -> None:
    deadlines, server = RequestDeadlines(), Proxyserver()
    with taddons.context(deadlines, server) as tctx:
        tctx.configure(deadlines, contextpaw_request_read_timeout=1)
        flow = tflow.tflow()
        server.connections[flow.client_conn.id], server.transports[flow.client_conn] = server, object()
        deadlines.client_connected(flow.client_conn)
        time.sleep(1.5)  # the loop is blocked past the deadline; the client's request waits unread
        await asyncio.sleep(0.01)  # the late deadline fires first (its timer is due before this one)
        deadlines.requestheaders(flow)  # then the request the client sent in time is read
        deadlines.request(flow)
        await asyncio.sleep(2)
        assert server.closed == []
        deadlines.response(flow)  # a fresh deadline for the next request, and this one is met
        await asyncio.sleep(1.2)
        assert server.closed == [flow.client_conn]


async def test_requests_on_a_kept_alive_connection_start_no_new_clock_and_its_deadline_still_holds(monkeypatch) -> None:
    """The clock started when the connection came is left to run while requests come and go on it
    (none makes or cancels a timer); when it runs out it finds the request owed now, and that one's
    own deadline still closes the connection."""
    deadlines, server = RequestDeadlines(), Proxyserver()
    loop = asyncio.get_running_loop()
    started: list[float] = []
    call_later = loop.call_later

    def counted(delay: float, callback, *args):  # type: ignore[no-untyped-def]
        if callback == deadlines._expire:
            started.append(delay)
        return call_later(delay, callback, *args)

    monkeypatch.setattr(loop, "call_later", counted)
    with taddons.context(deadlines, server) as tctx:
        tctx.configure(deadlines, contextpaw_request_read_timeout=1)
        client = tflow.tflow().client_conn
        server.connections[client.id], server.transports[client] = server, object()
        deadlines.client_connected(client)
        for _ in range(50):
            flow = tflow.tflow()
            flow.client_conn = client
            deadlines.requestheaders(flow)
            deadlines.request(flow)
            deadlines.response(flow)
        assert len(started) == 1, "one clock, from the connection's start"
        await asyncio.sleep(0.6)
        flow = tflow.tflow()
        flow.client_conn = client
        for hook in (deadlines.requestheaders, deadlines.request, deadlines.response):
            hook(flow)  # a request comes and is answered now: the next one is owed from here
        await asyncio.sleep(0.6)
        assert server.closed == [] and len(started) == 2, "the first clock ran out and found a later debt"
        await asyncio.sleep(0.6)
        assert server.closed == [client]
