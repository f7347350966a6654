"""The `contextpaw` command pointed at itself: "I forgot to move Ollama off 11434".

Pointed at its own address, it stops at start with the fix. Reached back through a port forward
(which no start-up check can see), each request goes round once and is answered 508 in the caller's
API shape, at once, instead of forever."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.backends import free_port, start_process

LOOPBACK = "127.0.0.1"
COMMAND = [sys.executable, "-m", "contextpaw.command.cli"]


def test_a_backend_at_its_own_address_stops_it_at_start_with_the_fix(workdir: Path) -> None:
    port = free_port()
    argv = [*COMMAND, "--ollama", f"http://localhost:{port}", "--port", str(port), "--confdir", str(workdir / "conf")]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    said = done.stdout + done.stderr
    assert done.returncode != 0 and time.monotonic() - started < 30
    assert "ContextPaw's own listen address" in said and "OLLAMA_HOST=127.0.0.1:11435" in said, said
    assert "Traceback" not in said


class Forward:
    """A TCP port forward to `target`, counting the requests that pass (by their request line)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.server = socket.create_server((LOOPBACK, 0))
        self.port = self.server.getsockname()[1]
        self.requests = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection((LOOPBACK, self.target))
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        try:
            while data := source.recv(65536):
                if counted:
                    with self.lock:
                        self.requests += data.count(b"POST /api/chat ")
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture
def round_the_forward(workdir: Path) -> Iterator[tuple[str, Forward]]:
    port = free_port()
    forward = Forward(port)
    argv = [
        *COMMAND, "--ollama", f"http://{LOOPBACK}:{forward.port}", "--port", str(port), "--confdir", str(workdir / "conf"),
        "--set", f"contextpaw_state_dir={workdir / 'self-loop-state'}", "--set", "contextpaw_calibrate=false",
    ]  # fmt: skip
    url = f"http://{LOOPBACK}:{port}"
    with start_process(argv, url, "/contextpaw/health", workdir / "self-loop.log", 60):
        yield url, forward
    forward.server.close()


def test_a_request_that_comes_back_round_is_answered_508_at_once_and_sent_once(round_the_forward: tuple[str, Forward]) -> None:
    url, forward = round_the_forward
    body = {"model": "m", "stream": False, "messages": [{"role": "user", "content": "hello"}]}
    request = urllib.request.Request(url + "/api/chat", json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as answered:
        urllib.request.urlopen(request, timeout=30)
    took = time.monotonic() - started
    assert answered.value.code == 508 and took < 10
    error = json.loads(answered.value.read())["error"]  # Ollama's shape: {"error": "..."}
    assert "came back to ContextPaw from itself" in error and "OLLAMA_HOST=127.0.0.1:11435" in error
    time.sleep(1)  # nothing goes on after the answer
    assert forward.requests == 1
