"""mitmproxy test flows for the addon tests: requests to the proxy's ports, answers, chats."""

from __future__ import annotations

import json

from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import mode_specs
from mitmproxy.test import tflow, tutils

from contextpaw.proxy.backends import BACKEND_HEADER

OLLAMA = "http://127.0.0.1:11435"


LLAMACPP = "http://127.0.0.1:8091"


CLOSED_PORT = 9  # discard: nothing listens on loopback there


REVERSE = "reverse:http://127.0.0.1:11435@127.0.0.1:0"


def post(path: str, body: object, port: int = 11435, raw: bytes | None = None) -> http.HTTPFlow:
    flow = tflow.tflow(
        req=tutils.treq(
            host="127.0.0.1",
            port=port,
            path=path.encode(),
            method=b"POST",
            headers=http.Headers(content_type="application/json", authorization="Bearer k"),
            content=b"",
        )
    )
    flow.request.content = raw if raw is not None else json.dumps(body).encode()
    flow.server_conn.state = ConnectionState.OPEN  # an upstream connection is open: no reachability probe
    return flow


def get(path: str, port: int = 11435, peer: str = "127.0.0.1") -> http.HTTPFlow:
    headers = http.Headers(host=f"127.0.0.1:{port}")  # as every HTTP/1.1 client sends it
    flow = tflow.tflow(req=tutils.treq(host="127.0.0.1", port=port, path=path.encode(), method=b"GET", headers=headers, content=b""))
    flow.client_conn.peername = (peer, 5555)
    flow.server_conn.state = ConnectionState.OPEN
    return flow


def to_ollama(path: str, body: object, raw: bytes | None = None) -> http.HTTPFlow:
    """A POST that names its backend (X-ContextPaw-Backend), so the compactor finds it without a
    configured backends addon."""
    flow = post(path, body, raw=raw)
    flow.request.headers[BACKEND_HEADER] = "ollama"
    return flow


def reverse(flow: http.HTTPFlow) -> http.HTTPFlow:
    """`flow` as a reverse-mode listener in front of Ollama receives it."""
    flow.client_conn.proxy_mode = mode_specs.ProxyMode.parse(REVERSE)
    return flow


def long_chat(turns: int = 12, num_ctx: int = 2048) -> dict:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Summarise the logs."}]
    for i in range(turns):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": f"part {i} " + "log line " * 300})
    return {"model": "m", "messages": messages, "stream": False, "options": {"num_ctx": num_ctx}}


def ok_json(body: dict) -> http.Response:
    return http.Response.make(200, json.dumps(body), {"Content-Type": "application/json; charset=utf-8"})


def streamed(content_type: str, **headers: str) -> http.Response:
    response = http.Response.make(200, b"", http.Headers(content_type=content_type, **headers))
    response.content = None
    return response
