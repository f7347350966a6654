"""A backend that answers with headers named as ContextPaw's (`X-ContextPaw-*`): through a real
mitmdump, the client never reads them as ContextPaw's, on a model route (carried by the relay) or
any other (sent on by mitmproxy itself)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from aiohttp import web

from support.backends import free_port, start_proxy
from support.common import running
from support.fake_llamacpp import fake_llamacpp_app

FORGED = {"X-ContextPaw-Compacted": "true", "X-ContextPaw-Evicted-Tokens": "99999", "X-ContextPaw-Forged": "yes"}


@web.middleware
async def forging(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    response = await handler(request)
    response.headers.update(FORGED)
    return response


def test_a_backends_own_contextpaw_headers_never_reach_the_client(workdir: Path) -> None:
    app = fake_llamacpp_app()
    app.middlewares.append(forging)
    port = free_port()
    with running(app, port=port) as backend:
        options = [f"contextpaw_state_dir={workdir / 'forged-headers'}"]
        with start_proxy(backend, workdir / "conf", workdir / "forged-headers.log", options=options) as proxy:
            chat = httpx.post(
                proxy.url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=30
            )
            other = httpx.get(proxy.url + "/props", timeout=30)
            direct = httpx.get(backend + "/props", timeout=30)
    assert direct.headers["X-ContextPaw-Forged"] == "yes", "the backend does send them"
    for answer in (chat, other):
        assert answer.status_code == 200
        assert "X-ContextPaw-Forged" not in answer.headers and answer.headers.get("X-ContextPaw-Evicted-Tokens") != "99999"
    assert "X-ContextPaw-Compacted" not in other.headers
    assert chat.headers["X-ContextPaw-Compacted"] == "false", "ContextPaw's own says what it did: nothing"
