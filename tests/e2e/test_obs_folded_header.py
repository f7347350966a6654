"""A header folded over two lines (obs-fold: deprecated, still sent by old clients) is forwarded
unfolded, as a proxy must (RFC 9112 5.2) and bare mitmdump does; through ContextPaw it was a 502,
the relay's HTTP library refusing the fold (issue 56)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from support.backends import Backend, start_proxy


def send(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


@pytest.mark.parametrize("stream", [False, True])
def test_an_obs_folded_header_is_forwarded_unfolded(tmp_path: Path, workdir: Path, llamacpp: Backend, stream: bool) -> None:
    body = json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"X-Folded: first\r\n  second\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)  # fmt: skip
    with start_proxy(llamacpp.url, tmp_path / "conf", workdir / f"obs-fold-{stream}.log",
                     options=[f"contextpaw_state_dir={tmp_path / 'state'}"]) as proxy:  # fmt: skip
        answer = send(int(proxy.url.rsplit(":", 1)[1]), request)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:400]
