"""A Redis server of the test's own, on a free loopback port, from Debian's `redis-server`
(`.ci/run` installs it). Absent, the tests that need it are skipped with the reason, except
under CI=1, where they fail: CI must test the shared archive against the real server."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.common import free_port

BINARY = "redis-server"
PIDS: dict[str, int] = {}
"""Each running server's process id, by its URL (a test that hangs it sends SIGSTOP)."""


def require_redis() -> str:
    found = shutil.which(BINARY)
    if found is None:
        reason = "redis-server is not installed (apt-get install redis-server; .ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


@contextlib.contextmanager
def redis_server(workdir: Path, port: int | None = None) -> Iterator[str]:
    """A fresh server without persistence on a free loopback port (or `port`: one started again
    where another was); its `redis://` URL."""
    binary = require_redis()
    port = port or free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)]
    log = open(workdir / f"redis-{port}.log", "wb")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {(workdir / f'redis-{port}.log').read_text()[-500:]}")
            time.sleep(0.02)
        url = f"redis://127.0.0.1:{port}/0"
        PIDS[url] = process.pid
        yield url
    finally:
        PIDS.pop(f"redis://127.0.0.1:{port}/0", None)
        process.terminate()
        process.wait(timeout=10)
        log.close()
