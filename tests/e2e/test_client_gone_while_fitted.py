"""A client that leaves right after sending a big overflowing body is not served in its absence:
its request is neither sent to the backend nor counted (issue 56: 4 of 4 such requests were sent
and counted; bare mitmdump sends none)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from support.backends import start_proxy


class Recording(BaseHTTPRequestHandler):
    """A llama-server of 4,096 tokens that records the model requests it gets."""

    posts: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"default_generation_settings": {"n_ctx": 4096}} if self.path.startswith("/props") else {"status": "ok"})
        self._send(200, body.encode())

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path == "/v1/chat/completions":
            Recording.posts.append(self.path)
            self._send(200, json.dumps({"choices": [{"message": {"role": "assistant", "content": "ok"}}]}).encode())
        else:
            self._send(404, b'{"error": "no"}')

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_client_gone_before_its_big_request_is_fitted_is_not_served(tmp_path: Path, workdir: Path) -> None:
    backend = ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{backend.server_address[1]}"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read the logs."}]
    messages += [{"role": "assistant" if i % 2 else "user", "content": f"part {i} " + "log line " * 20_000} for i in range(48)]
    body = json.dumps({"model": "m", "messages": messages}).encode()
    assert len(body) > 8_000_000
    try:
        with start_proxy(
            url, tmp_path / "conf", workdir / "client-gone.log", options=[f"contextpaw_state_dir={tmp_path / 'state'}"]
        ) as proxy:
            port = int(proxy.url.rsplit(":", 1)[1])
            for _ in range(2):
                with socket.create_connection(("127.0.0.1", port)) as conn:
                    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
                # gone, right after the last byte
            time.sleep(8)
            with urllib.request.urlopen(proxy.url + "/contextpaw/health", timeout=30) as answer:
                stats = json.loads(answer.read())["stats"]
    finally:
        backend.shutdown()
        backend.server_close()
    assert Recording.posts == [], "sent on for a client that had gone"
    assert stats.get("compacted", 0) == 0, stats
