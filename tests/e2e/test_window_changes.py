"""A backend restarted with another window, seen through a real mitmdump: the request that finds it
gone (refused, or its connection reset) makes ContextPaw forget the window it had learned there, so
the next request is sized by what the server says now, not by the old window for seconds more."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from support.backends import Backend, free_port, start_proxy
from support.common import running
from support.fake_llamacpp import LlamaSettings, fake_llamacpp_app


def chat(words: int) -> dict[str, Any]:
    """A task, then notes enough to overflow 1,024 tokens but not 8,192, then the question."""
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Read my notes."}]
    for i in range(10):
        messages += [
            {"role": "user", "content": f"Note {i}: " + "alpha beta gamma " * (words // 30)},
            {"role": "assistant", "content": "Noted."},
        ]
    return {"model": "fake-model", "messages": messages + [{"role": "user", "content": "Which notes?"}], "max_tokens": 8}


@contextmanager
def llama_server(port: int, n_ctx: int) -> Iterator[str]:
    with running(fake_llamacpp_app(LlamaSettings(n_ctx=n_ctx)), port=port) as url:
        yield url


def compacted(proxy: Backend) -> bool:
    response = httpx.post(proxy.url + "/v1/chat/completions", json=chat(2000), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["contextpaw"]["compacted"]


def test_a_backend_restarted_with_a_larger_window_is_asked_again_after_refusing_a_connection(workdir: Path) -> None:
    """llama-server from -c 1024 to -c 8192: while it is down a request is answered 502; the next
    one, within the seconds a window is trusted, is sent whole to the new window."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    options = [f"contextpaw_state_dir={workdir / 'window-restart'}"]
    with start_proxy(url, workdir / "conf", workdir / "window-restart.log", options=options) as proxy:
        with llama_server(port, 1024):
            assert compacted(proxy), "cut to the 1,024-token window"
        gone = httpx.post(proxy.url + "/v1/chat/completions", json=chat(2000), timeout=30)
        assert gone.status_code == 502
        with llama_server(port, 8192):
            assert not compacted(proxy), "sized by the window the restarted server has"
