"""Shared fixtures for the reliability suite: an in-process addon harness (taddons), a scriptable
fault backend, the fake backends, and mitmdump processes in front of them; plus the case counter
that the session prints at the end (`cases tried: ...`).

Everything listens on 127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.test import taddons, tflow, tutils

from contextpaw.proxy.compose import make_addons
from support.backends import ADDON, Backend, dead_port, free_port, start_process
from support.cases import CASES
from support.common import FAKE_N_CTX, LOOPBACK, context_overflow_error, running, sse
from support.inprocess import Proxy as InProcess

N_CTX = FAKE_N_CTX
"""The fakes' window and the proxies' default window."""
RELAY_TIMEOUT = 2
"""The fault proxy's header and idle timeouts: how long a silent backend may hang a request."""
PROXY_TCP_TIMEOUT = 4
"""The fault proxy's tcp_timeout, above the relay's: what ends a hanging flow the relay does not carry."""

OLLAMA = "http://127.0.0.1:11435"
LLAMACPP = "http://127.0.0.1:8091"

# -- cases tried, printed at the end of the session (tests/conftest.py) ---------------------------


@pytest.fixture(scope="session")
def cases() -> collections.Counter[str]:
    """Count each input a test tried (`cases["bad_input.taddons"] += 1`); printed at session end."""
    return CASES


# -- the addons in a test master ------------------------------------------------------------------


class Harness(InProcess):
    """The addons in a taddons master, with the counts the reliability checks read."""

    @property
    def stats(self) -> dict[str, int]:
        return self.compactor.fitter.stats.counts


def configured(harness: Harness) -> Harness:
    harness.tctx.configure(harness.backends, contextpaw_ollama=[OLLAMA], contextpaw_llamacpp=[LLAMACPP])
    return harness


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        yield configured(Harness(tctx, addons))


class SyncHarness:
    """A harness on an event loop of its own, for synchronous (hypothesis) tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        addons = make_addons()

        async def enter() -> taddons.context:
            tctx = taddons.context(*addons)
            tctx.__enter__()
            return tctx

        self.tctx = self.loop.run_until_complete(enter())
        self.harness = configured(Harness(self.tctx, addons))

    def send(self, flow: http.HTTPFlow) -> None:
        self.loop.run_until_complete(self.harness.send(flow))

    def answer(self, flow: http.HTTPFlow, response: http.Response) -> http.Response:
        return self.loop.run_until_complete(self.harness.answer(flow, response))

    def close(self) -> None:
        self.tctx.__exit__(None, None, None)
        self.loop.close()


@dataclass(frozen=True)
class Kit:
    """Helpers for the test modules (conftest is not importable by name)."""

    flow_for: Any
    sync_harness: Any
    fetch: Any
    health: Any
    rss_kib: Any
    wait_until: Any
    n_ctx: int = N_CTX


@pytest.fixture(scope="session")
def kit() -> Kit:
    return Kit(flow_for, SyncHarness, fetch, health, rss_kib, wait_until)


def flow_for(
    path: str,
    raw: bytes,
    *,
    port: int = 11435,
    method: str = "POST",
    headers: dict[str, str] | None = None,
    peer: str = "127.0.0.1",
) -> http.HTTPFlow:
    """A flow to a configured backend whose upstream connection is open (no reachability probe)."""
    hdrs = http.Headers(host="127.0.0.1:11434", content_type="application/json", authorization="Bearer k")
    for k, v in (headers or {}).items():
        hdrs[k] = v
    flow = tflow.tflow(req=tutils.treq(host="127.0.0.1", port=port, path=path.encode(), method=method.encode(), headers=hdrs, content=b""))
    flow.request.raw_content = raw  # as the client sent it, encoded or not
    flow.client_conn.peername = (peer, 50000)
    flow.server_conn.state = ConnectionState.OPEN
    return flow


# -- a scriptable fault backend ---------------------------------------------------------------------


FAULT_HEADER = "X-Fault"
ID_HEADER = "X-Req-Id"


@dataclass
class Seen:
    fault: str
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FaultServer:
    """An llama-server look-alike (it serves `/props`) that misbehaves as each request's `X-Fault` says.

    Faults: `ok` (JSON echo), `stream` (SSE), `reset-before`, `reset-mid-stream`, `reset-mid-body`,
    `hang-before`, `hang-mid-stream`, `non-json`, `truncated-json`, `500`, `overflow-400` (always,
    retry included). Every request is recorded in `seen`.
    """

    url: str = ""
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    counting_hangs: bool = False
    """Whether /tokenize, /apply-template and input_tokens hang (otherwise they count words)."""

    def hits(self, req_id: str) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if s.headers.get(ID_HEADER) == req_id]


def _reset(request: web.Request) -> None:
    """Close the connection with a TCP RST."""
    transport = request.transport
    assert transport is not None
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    transport.abort()


def _chat_answer(text: str, echo: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fault",
        "object": "chat.completion",
        "model": "fault",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        "echo": echo,
    }


def fault_app(server: FaultServer) -> web.Application:
    async def props(request: web.Request) -> web.Response:
        return web.json_response({"default_generation_settings": {"n_ctx": N_CTX}, "total_slots": 1})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def counting(request: web.Request) -> web.Response:
        """llama-server's counting endpoints, a token a word; or hanging, as the test says."""
        if server.counting_hangs:
            await asyncio.sleep(3600)
        body = await request.json()
        if request.path == "/apply-template":
            return web.json_response({"prompt": "\n".join(f"{m['role']}: {m['content']}" for m in body["messages"])})
        if request.path == "/tokenize":
            return web.json_response({"tokens": list(range(len(body["content"].split())))})
        words = sum(len(str(m.get("content", "")).split()) + 2 for m in body["messages"])
        return web.json_response({"input_tokens": words})

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        fault = request.headers.get(FAULT_HEADER, "ok")
        with server.lock:
            server.seen.append(Seen(fault, request.method, request.path_qs, dict(request.headers), body))
        echo = {"authorization": request.headers.get("Authorization"), "bytes": len(body)}
        if fault == "ok":
            return web.json_response(_chat_answer("fine", echo))
        if fault in ("reset-before",):
            _reset(request)
            return web.Response()
        if fault == "hang-before":
            await asyncio.sleep(3600)
        if fault == "non-json":
            return web.Response(text="<html>Internal oops</html>", content_type="application/json")
        if fault == "truncated-json":
            return web.Response(text='{"choices":[{"message":{"content":"tru', content_type="application/json")
        if fault == "500":
            error = {"error": {"code": 500, "message": "backend exploded", "type": "server_error"}}
            return web.json_response(error, status=500)
        if fault == "overflow-400":
            n_prompt = int(request.headers.get("X-Fault-Prompt-Tokens", "5000"))
            return web.json_response(context_overflow_error(n_prompt, N_CTX), status=400)
        if fault == "reset-mid-body":
            response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "1000"})
            await response.prepare(request)
            await response.write(b'{"choices":[')
            await asyncio.sleep(0.05)
            _reset(request)
            return response
        # streams
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "to"}, "finish_reason": None}]}
        await response.write(sse(chunk))
        await response.write(sse(chunk))
        if fault == "reset-mid-stream":
            await asyncio.sleep(0.05)
            _reset(request)
            return response
        if fault == "hang-mid-stream":
            await asyncio.sleep(3600)
        await response.write(sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/props", props)
    app.router.add_get("/health", health)
    for path in ("/tokenize", "/apply-template", "/v1/chat/completions/input_tokens"):
        app.router.add_post(path, counting)
    app.router.add_route("POST", "/{tail:.*}", handle)
    return app


@pytest.fixture(scope="session")
def fault_server() -> Iterator[FaultServer]:
    server = FaultServer()
    with running(fault_app(server)) as url:
        server.url = url
        yield server


@pytest.fixture(scope="session")
def silent() -> Iterator[str]:
    """A loopback listener that accepts connections and never sends a byte."""
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(64)
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, name="silent-backend", daemon=True)
    thread.start()
    try:
        yield f"http://{LOOPBACK}:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(2)
        for conn in accepted:
            conn.close()
        listener.close()


# -- processes ------------------------------------------------------------------------------------


@dataclass
class Proxy:
    process: Backend
    urls: dict[str, str]
    """name -> the proxy's address for that upstream."""

    def __getitem__(self, name: str) -> str:
        return self.urls[name]

    @property
    def pid(self) -> int:
        return self.process.process.pid


def mitmdump_argv(upstreams: dict[str, str], ports: dict[str, int], extra: Sequence[str]) -> list[str]:
    argv = [sys.executable, "-c", "from mitmproxy.tools.main import mitmdump; mitmdump()", "-s", str(ADDON)]
    for name, upstream in upstreams.items():
        argv += ["--mode", f"reverse:{upstream}@{LOOPBACK}:{ports[name]}"]
    return [*argv, *extra]


def start_mitmdump(workdir: Path, log_name: str, upstreams: dict[str, str], *extra: str) -> Proxy:
    """mitmdump with the addon, a reverse mode per upstream, as the README documents it."""
    ports = {name: free_port() for name in upstreams}
    options = [
        "--set", f"confdir={workdir / 'conf'}", "--set", "connection_strategy=lazy",
        "--set", f"contextpaw_state_dir={workdir / log_name}-state",
        "--set", f"contextpaw_default_ctx={N_CTX}", "--set", "contextpaw_output_reserve=128", *extra,
    ]  # fmt: skip
    urls = {name: f"http://{LOOPBACK}:{port}" for name, port in ports.items()}
    first = next(iter(urls.values()))
    process = start_process(mitmdump_argv(upstreams, ports, options), first, "/contextpaw/health", workdir / f"{log_name}.log", 30)
    return Proxy(process, urls)


@pytest.fixture(scope="session")
def roomy_proxy(workdir: Path, ollama: Backend) -> Iterator[Proxy]:
    """mitmdump in front of the fake Ollama with mitmproxy's own tcp_timeout: a huge body takes a while
    to upload and parse on a loaded machine, and must not meet the fault proxy's short one. Its body
    limit is raised above the 32 MB default, for a body that is big on purpose."""
    running_proxy = start_mitmdump(
        workdir, "roomy", {"ollama": ollama.url}, "--set", "flow_detail=0", "--set", "contextpaw_max_body_mb=256"
    )
    with running_proxy.process:
        yield running_proxy


@pytest.fixture(scope="session")
def proxy(workdir: Path, ollama: Backend, llamacpp: Backend, fault_server: FaultServer, silent: str) -> Iterator[Proxy]:
    """One mitmdump: the fakes, the fault backend (configured as llama-server) and a dead port
    (configured as Ollama, so the relay answers for it; mitmproxy's probe answers for other routes).

    Its timeouts are short, so a hanging backend is given up on within a few seconds.
    """
    dead = f"http://{LOOPBACK}:{dead_port()}"
    upstreams = {"ollama": ollama.url, "llamacpp": llamacpp.url, "fault": fault_server.url, "dead": dead, "silent": silent}
    running_proxy = start_mitmdump(
        workdir, "proxy", upstreams,
        "--set", f"contextpaw_llamacpp={fault_server.url}", "--set", f"contextpaw_ollama={dead}",
        "--set", f"tcp_timeout={PROXY_TCP_TIMEOUT}",
        "--set", f"contextpaw_header_timeout={RELAY_TIMEOUT}", "--set", f"contextpaw_idle_timeout={RELAY_TIMEOUT}",
        "--set", "termlog_verbosity=info", "--set", "flow_detail=0",
    )  # fmt: skip
    with running_proxy.process:
        yield running_proxy


@pytest.fixture(scope="session")
def summarizer_silent(workdir: Path, llamacpp: Backend, silent: str) -> Iterator[Proxy]:
    """mitmdump that summarizes evictions with a summarizer that accepts and never answers."""
    running_proxy = start_mitmdump(
        workdir, "summarizer-silent", {"llamacpp": llamacpp.url},
        "--set", "contextpaw_summarize=true", "--set", f"contextpaw_summarizer_url={silent}",
        "--set", "contextpaw_summarizer_timeout=1", "--set", "termlog_verbosity=info", "--set", "flow_detail=0",
    )  # fmt: skip
    with running_proxy.process:
        yield running_proxy


def fetch(
    url: str, data: bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 15
) -> tuple[int, dict[str, str], bytes]:
    """A plain request; status, headers and body even on HTTP errors; status 0 when the connection failed."""
    request = urllib.request.Request(url, data=data, headers=headers or {}, method="POST" if data is not None else "GET")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}, b""


def health(base: str) -> dict[str, Any]:
    status, _, body = fetch(f"{base}/contextpaw/health", timeout=10)
    assert status in (200, 503), body  # 503: a backend does not answer
    return json.loads(body)


def rss_kib(pid: int) -> int:
    """Resident set size of a process and its children (mitmdump runs as `python -c`)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def wait_until(predicate: Any, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())
