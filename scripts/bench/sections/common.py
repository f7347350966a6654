"""What the sections share: the mitmdumps they start, the requests they time, the machine they ran on."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import mitmproxy.version
from rich.console import Console

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import ADDON, Backend, free_port, start_process
from support.common import LOOPBACK

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = REPO / "scripts"
console = Console(stderr=True)


def mitmdump(
    upstreams: list[str], work: Path, name: str, *, addon: bool | Path, options: list[str], env: dict[str, str] | None = None
) -> tuple[Backend, list[str]]:
    """One mitmdump, reverse proxy in front of each upstream, with or without the ContextPaw script
    (`addon`: True for contextpaw_addon.py, or the path of another script).

    Ready once the first upstream's /health answers through it (bare mitmdump has no endpoint of its own).
    """
    ports = [free_port() for _ in upstreams]
    argv = [sys.executable, "-c", "from mitmproxy.tools.main import mitmdump; mitmdump()", "-q"]
    argv += ["-s", str(ADDON if addon is True else addon)] if addon else []
    for upstream, port in zip(upstreams, ports, strict=True):
        argv += ["--mode", f"reverse:{upstream}@{LOOPBACK}:{port}"]
    for option in ["connection_strategy=lazy", f"confdir={work / name}", "tcp_timeout=3600", *options]:
        argv += ["--set", option]
    urls = [f"http://{LOOPBACK}:{port}" for port in ports]
    return start_process(argv, urls[0], "/health", work / f"{name}.log", 60, env=env), urls


def chat_bytes(i: int, filler: str = "", stream: bool = False) -> bytes:
    """A chat that differs from the last one in its final message, as an agent's next turn does."""
    messages = [{"role": "system", "content": "You are terse."}]
    if filler:
        messages += [{"role": "user", "content": filler}, {"role": "assistant", "content": "Noted."}]
    messages.append({"role": "user", "content": f"Request {i}: say hi."})
    return json.dumps({"model": "fake-model", "messages": messages, "max_tokens": 8, "stream": stream}).encode()


def filler_text(size: int) -> str:
    words = (f"w{n % 7919}" for n in range(size))
    return " ".join(words)[:size]


def latency(client: httpx.Client, url: str, body: bytes) -> float:
    started = time.perf_counter()
    reply = client.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    elapsed = time.perf_counter() - started
    if reply.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {reply.status_code}: {reply.text[:200]}")
    return elapsed


def percentiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"n": len(values), "p50_ms": cuts[49] * 1000, "p99_ms": cuts[98] * 1000, "req_per_s": len(values) / sum(values)}


def script_json(script: str, out: Path, args: list[str]) -> dict[str, Any]:
    """Run one of the measuring scripts beside this one, and read the JSON it writes."""
    run = subprocess.run([sys.executable, str(SCRIPTS / script), *args, "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    if not out.exists():
        return {"skipped": f"{script} exited {run.returncode}: {run.stderr.strip()[-300:]}"}
    return json.loads(out.read_text())


def machine(llama: Path | None) -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mitmproxy": mitmproxy.version.VERSION,
        "llama_server": str(llama) if llama else None,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


class Pinger:
    """A small fitting chat to `url` every `every` seconds from its own thread while the `with` block
    runs (from 0.2 s before its work to 0.1 s after): every latency, for the worst and the p99."""

    def __init__(self, url: str, every: float = 0.01) -> None:
        self.url, self.every, self.seconds, self.failed = url, every, [], 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=120, trust_env=False) as client:
            n = 0
            while not self._done.is_set():
                started = time.perf_counter()
                try:
                    latency(client, self.url, chat_bytes(-(10**7) - n))
                except (httpx.HTTPError, RuntimeError):
                    self.failed += 1
                self.seconds.append(time.perf_counter() - started)
                n += 1
                time.sleep(self.every)

    def __enter__(self) -> Pinger:
        self._thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.1)
        self._done.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        """Worst and p99 latency in ms, how many were sent and how many failed."""
        ordered = sorted(self.seconds) or [0.0]
        p99 = statistics.quantiles(ordered, n=100, method="inclusive")[98] if len(ordered) > 1 else ordered[0]
        return {
            "worst_ms": ordered[-1] * 1000,
            "p99_ms": p99 * 1000,
            "n": len(self.seconds),
            "failed": self.failed,
        }


def started(stack: contextlib.ExitStack, *starts: Callable[[], Any]) -> list[Any]:
    """Start several processes at once (each start waits for its process to answer), each handed to
    `stack` to stop; the first failure is raised once every start has ended."""
    with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    out, failure = [], None
    for future in futures:
        try:
            value = future.result()
        except Exception as e:  # the others are still stopped by the stack
            failure = failure or e
            continue
        backend = value[0] if isinstance(value, tuple) else value
        stack.enter_context(backend)
        out.append(value)
    if failure is not None:
        raise failure
    return out


def side_by_side(stack: contextlib.ExitStack, upstreams: list[str], work: Path, prefix: str,
                 options: list[str], bare_options: list[str] | None = None) -> dict[str, tuple[Backend, list[str]]]:  # fmt: skip
    """Bare mitmdump and mitmdump with ContextPaw (`options`) in front of the same `upstreams`, started
    at once: name -> (process, its listeners' URLs, one per upstream)."""
    bare, paw = started(
        stack,
        lambda: mitmdump(upstreams, work, f"{prefix}-bare", addon=False, options=bare_options or []),
        lambda: mitmdump(upstreams, work, f"{prefix}-contextpaw", addon=True, options=options),
    )
    return {"mitmdump": bare, "ContextPaw": paw}
