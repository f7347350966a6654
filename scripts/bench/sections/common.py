"""What the sections share: the mitmdumps they start, the requests they time, the machine they ran on."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
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
