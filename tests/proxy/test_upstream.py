"""The upstream leg of handled requests, composed (`make_addons`) over a raw backend on 127.0.0.1:
a request that asks for a buffered answer is sent from the request hook, on a kept connection, and
its answer (or its failure, in the caller's API) set on the flow; one that may stream is left to the
relay's tunnel. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import h11
import pytest
from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.test import taddons

from contextpaw.proxy.backends import HOP_HEADER
from contextpaw.proxy.compose import make_addons
from contextpaw.proxy.upstream import WATCH_S
from contextpaw.relay.exchange import ERROR_HEADER
from contextpaw.relay.loopback import FLOW_HEADER
from support.common import context_overflow_error
from support.flows import CLOSED_PORT, post
from support.inprocess import Proxy

WAIT = 3.0
CHAT = "/v1/chat/completions"
ANSWER = {"choices": [{"message": {"role": "assistant", "content": "fine"}}], "usage": {"prompt_tokens": 12}}


class Backend:
    """A backend that answers each model request with the next of `answers` (a status, a body and a
    content type; None: never answer), and keeps what it received; the proxy's own questions
    (`/props`, `/api/show`) get a 404."""

    def __init__(self, answers: list[tuple[int, bytes, str] | None]) -> None:
        self.answers = answers
        self.bodies: list[bytes] = []
        self.heads: list[list[tuple[bytes, bytes]]] = []
        """The headers of each model request, as they arrived."""
        self.connections = 0
        """Connections that carried a model request (the proxy's own questions aside)."""
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        body, target, carried = b"", b"", False
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    target = event.target
                    if target in (CHAT.encode(), b"/api/chat"):
                        self.heads.append(list(event.headers.raw_items()))
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    answer = (404, b"{}", "application/json")
                    if target in (CHAT.encode(), b"/api/chat"):
                        self.connections += conn.their_state is h11.DONE and not carried
                        carried = True
                        self.bodies.append(body)
                        answer = self.answers.pop(0)
                    body = b""
                    if answer is None:
                        await reader.read()  # until the proxy gives up on it
                        return
                    status, content, content_type = answer
                    head = [("Content-Type", content_type), ("Content-Length", str(len(content)))]
                    writer.write(conn.send(h11.Response(status_code=status, headers=head)) + conn.send(h11.Data(data=content)))
                    writer.write(conn.send(h11.EndOfMessage()) or b"")
                    await writer.drain()
                    conn.start_next_cycle()
        finally:
            self.closed.set()
            writer.close()


@pytest.fixture
async def start_backend() -> AsyncIterator[Callable[[list[tuple[int, bytes, str] | None]], Awaitable[Backend]]]:
    started: list[Backend] = []

    async def start(answers: list[tuple[int, bytes, str] | None]) -> Backend:
        backend = Backend(answers)
        backend.server = await asyncio.start_server(backend.serve, "127.0.0.1", 0)
        started.append(backend)
        return backend

    yield start
    for backend in started:
        assert backend.server is not None
        backend.server.close()


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        proxy = Proxy(tctx, addons)
        proxy.upstream.relay.address = ("127.0.0.1", CLOSED_PORT)  # as if it listened: model requests are carried
        yield proxy
        proxy.upstream.done()
        await proxy.close()


def to(backend: Backend, body: dict[str, Any]) -> http.HTTPFlow:
    flow = post(CHAT, body, port=backend.port)
    flow.live = True
    return flow


def chat(stream: bool | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    if stream is not None:
        body["stream"] = stream
    return body


def json_answer(body: dict[str, Any], status: int = 200) -> tuple[int, bytes, str]:
    return status, json.dumps(body).encode(), "application/json"


async def test_a_request_for_a_buffered_answer_is_answered_from_the_request_hook_with_no_tunnel(proxy: Proxy, start_backend) -> None:
    """The relay's loopback hop is paid only where it buys something: mitmproxy's request goes to
    the backend as it was read, and the answer is set on the flow."""
    backend = await start_backend([json_answer(ANSWER)])
    proxy.tctx.configure(proxy.backends, contextpaw_llamacpp=[f"http://127.0.0.1:{backend.port}"])
    for body in (chat(stream=False), chat(stream=None)):  # said, or OpenAI's default
        backend.answers.append(json_answer(ANSWER))
        flow = to(backend, body)
        sent = flow.request.raw_content
        await proxy.send(flow)
        assert flow.response is not None and flow.server_conn.via is None, "no tunnel to the relay"
        assert flow.response.status_code == 200 and json.loads(flow.response.content or b"") == ANSWER
        assert flow.response.headers["content-length"] == str(len(flow.response.raw_content or b""))
        assert backend.bodies[-1] == sent
        response = await proxy.answer(flow)
        assert json.loads(response.content or b"")["contextpaw"]["compacted"] is False, "reported like any answer"


async def test_a_request_sent_from_the_hook_carries_the_loop_mark_and_the_flow_keeps_the_clients_headers(
    proxy: Proxy, start_backend
) -> None:
    """A request that comes back round to this instance is refused by its mark: the exchange adds it
    on the way out, and the flow (mitmweb, saved flows) shows the headers the client sent."""
    backend = await start_backend([json_answer(ANSWER)])
    proxy.tctx.configure(proxy.backends, contextpaw_llamacpp=[f"http://127.0.0.1:{backend.port}"])
    flow = to(backend, chat(stream=False))
    client_headers = list(flow.request.headers.fields)
    await proxy.send(flow)
    assert flow.response is not None and flow.response.status_code == 200
    marks = [v for k, v in backend.heads[0] if k.lower() == HOP_HEADER.lower().encode()]
    assert marks == [proxy.backends.mark.encode()]
    assert list(flow.request.headers.fields) == client_headers
    await proxy.answer(flow)
    assert HOP_HEADER not in flow.request.headers


async def test_a_request_that_may_stream_goes_through_the_relays_tunnel(proxy: Proxy, start_backend) -> None:
    backend = await start_backend([])
    proxy.tctx.configure(proxy.backends, contextpaw_llamacpp=[f"http://127.0.0.1:{backend.port}"])
    flow = to(backend, chat(stream=True))
    await proxy.send(flow)
    assert flow.response is None and flow.server_conn.via == ("http", ("127.0.0.1", CLOSED_PORT))
    assert backend.connections == 0


async def test_buffered_requests_one_after_another_share_one_kept_backend_connection(proxy: Proxy, start_backend) -> None:
    backend = await start_backend([json_answer(ANSWER) for _ in range(3)])
    proxy.tctx.configure(proxy.backends, contextpaw_llamacpp=[f"http://127.0.0.1:{backend.port}"])
    for _ in range(3):
        flow = to(backend, chat(stream=False))
        await proxy.send(flow)
        assert flow.response is not None and flow.response.status_code == 200
    assert backend.connections == 1 and len(backend.bodies) == 3


async def test_a_dead_backend_gets_a_json_502_in_the_callers_api_from_the_request_hook(proxy: Proxy) -> None:
    proxy.tctx.configure(proxy.backends, contextpaw_llamacpp=[f"http://127.0.0.1:{CLOSED_PORT}"])
    flow = post(CHAT, chat(stream=False), port=CLOSED_PORT)
    flow.live = True
    await proxy.send(flow)
    assert flow.response is not None and flow.response.status_code == 502
    error = json.loads(flow.response.content or b"")["error"]
    assert error["code"] == "backend_unreachable" and error["message"] == flow.response.headers[ERROR_HEADER]


async def test_an_overflow_400_is_rescued_in_the_request_hook_and_the_answer_says_recovered(proxy: Proxy, start_backend) -> None:
    overflow = (400, json.dumps(context_overflow_error(3000, 2048)).encode(), "application/json")
    backend = await start_backend([overflow, json_answer(ANSWER)])
    proxy.tctx.configure(proxy.backends, contextpaw_llamacpp=[f"http://127.0.0.1:{backend.port}"])
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 120} for i in range(13)]
    flow = to(backend, {"model": "m", "messages": turns, "stream": False})
    flow.request.headers[FLOW_HEADER] = "forged by the client"
    await proxy.send(flow)
    assert flow.response is not None and flow.response.status_code == 200, flow.response.content
    assert len(backend.bodies) == 2 and len(backend.bodies[1]) < len(backend.bodies[0]), "the retry is the compacted body"
    assert FLOW_HEADER.lower().encode() not in b"".join(backend.bodies).lower(), "no flow key reaches the backend"
    assert FLOW_HEADER not in flow.request.headers and proxy.upstream.carried.get(flow.id) is None, (
        "the decision is given to the exchange: the flow carries no key, and nothing is kept to look it up"
    )
    response = await proxy.answer(flow)
    assert response.headers["X-ContextPaw-Recovered"] == "upstream-400"


async def test_a_client_that_goes_away_while_its_buffered_answer_is_awaited_frees_the_backend(proxy: Proxy, start_backend) -> None:
    """mitmproxy holds the client's events while a hook runs: its connection's state says it left.
    The backend's connection is closed, the flow killed, and no backend failure counted."""
    backend = await start_backend([None])
    proxy.tctx.configure(proxy.backends, contextpaw_llamacpp=[f"http://127.0.0.1:{backend.port}"])
    flow = to(backend, chat(stream=False))
    flow.client_conn.state = ConnectionState.OPEN
    sending = asyncio.ensure_future(proxy.send(flow))
    while not backend.bodies:
        await asyncio.sleep(0.01)
    flow.client_conn.state = ConnectionState.CAN_WRITE  # its end arrived: it reads no more
    await asyncio.wait_for(backend.closed.wait(), WATCH_S + WAIT)
    await asyncio.wait_for(sending, WAIT)
    assert flow.response is None and flow.error is not None and flow.error.msg == flow.error.KILLED_MESSAGE
    await proxy.hook("error", flow)
    assert proxy.compactor.ledger.stats.counts["upstream_errors"] == 0


async def test_a_stream_the_backend_sends_to_a_buffered_request_reaches_the_client_whole_with_its_report(
    proxy: Proxy, start_backend
) -> None:
    """A server that streams where it was asked not to: the records are read whole, framed by their
    length, and the final one carries the report."""
    records = b'{"message":{"content":"Hel"},"done":false}\n{"message":{"content":"lo"},"done":true,"prompt_eval_count":9}\n'
    backend = await start_backend([(200, records, "application/x-ndjson")])
    proxy.tctx.configure(proxy.backends, contextpaw_ollama=[f"http://127.0.0.1:{backend.port}"])
    flow = post("/api/chat", chat(stream=False), port=backend.port)
    flow.live = True
    await proxy.send(flow)
    assert flow.response is not None and flow.response.raw_content == records
    response = await proxy.answer(flow)
    assert response.stream is False
    first, last = (response.content or b"").splitlines()
    assert json.loads(first) == {"message": {"content": "Hel"}, "done": False}
    assert "contextpaw" in json.loads(last) and response.headers["content-length"] == str(len(response.raw_content or b""))
