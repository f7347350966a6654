"""6. Concurrency, stalls and memory: c=8 throughput, proxy CPU per request, the worst latency during one
160k-token compaction, RSS and where it goes."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_compact
import httpx
from rich.progress import Progress

from contextpaw.core.tokens import EstimateCounter
from contextpaw.fitting.engine import fit_chat
from sections.common import REPO, SCRIPTS, chat_bytes, latency, mitmdump

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import start_module
from support.measure import cpu_seconds, memory_mib, worst_latency_while

COMPACTION_CTX = 32_768
"""The window of the stall run: the 160k-token chat overflows it and is compacted."""


def concurrent_rate(url: str, seconds: float, clients: int = 8) -> float:
    """Small fitting POSTs from `clients` threads for `seconds`: answers per second."""
    import threading

    stop, counts = time.perf_counter() + seconds, [0] * clients

    def run(n: int) -> None:
        with httpx.Client(timeout=60, trust_env=False) as client:
            while time.perf_counter() < stop:
                latency(client, url, chat_bytes(n * 10**6 + counts[n]))
                counts[n] += 1

    threads = [threading.Thread(target=run, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / seconds


def loop_health(work: Path, quick: bool, progress: Progress) -> dict[str, Any]:
    """c=8 throughput, the worst latency idle and during one 160k-token / 600-message compaction,
    and RSS, for bare mitmdump and ContextPaw over the same fake llama-server."""
    seconds = 2.0 if quick else 6.0
    task = progress.add_task("concurrency and stalls", total=6)
    big = bench_compact.agent_conversation(160_000, EstimateCounter(), messages=600)
    big_body = json.dumps({"model": "fake-model", "messages": big, "max_tokens": 8}).encode()
    result: dict[str, Any] = {"clients": 8, "seconds": seconds, "compaction_messages": 600, "compaction_tokens": 160_000}
    with contextlib.ExitStack() as stack:
        fast = stack.enter_context(start_module("support.fake_llamacpp", ["--n-ctx", str(COMPACTION_CTX)], "/health", work / "loop.log"))
        bare, (bare_url,) = mitmdump([fast.url], work, "loop-bare", addon=False, options=[])
        stack.enter_context(bare)
        paw_options = [f"contextpaw_llamacpp={fast.url}", "contextpaw_calibrate=false"]
        paw, (paw_url,) = mitmdump([fast.url], work, "loop-paw", addon=True, options=paw_options)
        stack.enter_context(paw)
        unrelayed, (unrelayed_url,) = mitmdump(
            [fast.url], work, "loop-no-relay", addon=True, options=[*paw_options, "contextpaw_relay=false"]
        )
        stack.enter_context(unrelayed)
        paths = (("mitmdump", bare_url, bare), ("ContextPaw", paw_url, paw), ("ContextPaw, no relay", unrelayed_url, unrelayed))
        for _, url, _ in paths:  # warm up
            with httpx.Client(timeout=60, trust_env=False) as client:
                for i in range(20):
                    latency(client, url, chat_bytes(-i))
        rates: dict[str, list[float]] = {name: [] for name, _, _ in paths}
        cpu: dict[str, list[float]] = {name: [] for name, _, _ in paths}
        for _ in range(3):  # c=8 in rounds in which the paths take turns, so machine noise hits each
            for name, url, process in paths:
                before = cpu_seconds(process.process.pid)
                rates[name].append(concurrent_rate(url, seconds / 3))
                done = max(rates[name][-1] * seconds / 3, 1)  # a loaded machine may finish none in a quick round
                cpu[name].append((cpu_seconds(process.process.pid) - before) * 1000 / done)
        result["ContextPaw, no relay"] = {
            "c8_req_per_s": statistics.median(rates["ContextPaw, no relay"]),
            "cpu_ms_per_request": statistics.median(cpu["ContextPaw, no relay"]),
        }
        progress.advance(task, 2)
        for name, url, process in (("mitmdump", bare_url, bare), ("ContextPaw", paw_url, paw)):
            rate = statistics.median(rates[name])

            def small(client: httpx.Client, url: str = url) -> None:
                latency(client, url, chat_bytes(-1))

            idle = worst_latency_while(small, None, seconds)
            progress.advance(task)

            def compact_once(url: str = url) -> None:
                with httpx.Client(timeout=300, trust_env=False) as client:
                    client.post(url + "/v1/chat/completions", content=big_body, headers={"Content-Type": "application/json"})

            during = worst_latency_while(small, compact_once)
            progress.advance(task)
            result[name] = {
                "c8_req_per_s": rate,
                "worst_idle_ms": idle,
                "worst_during_big_request_ms": during,
                "rss_mib": memory_mib(process.process.pid),
                "cpu_ms_per_request": statistics.median(cpu[name]),
            }
        result["hooks"] = hook_times(fast.url, work, 100 if quick else 1000)
    result["verdict"] = {"c8_vs_mitmdump": result["ContextPaw"]["c8_req_per_s"] / result["mitmdump"]["c8_req_per_s"]}
    result["process_handoff"] = handoff_cost(big_body)
    result["rss_by_import"] = rss_by_import()
    return result


IMPORT_STEPS = (
    ("mitmproxy", ["mitmproxy.tools.dump"]),
    ("+ aiohttp", ["aiohttp"]),
    ("+ tokenizers", ["tokenizers"]),
    ("+ the rest of ContextPaw", ["contextpaw.proxy.compose"]),
)


def rss_by_import() -> list[dict[str, Any]]:
    """Where ContextPaw's extra memory goes before any request: RSS of a fresh interpreter after each
    step of imports (mitmproxy alone first, then what ContextPaw adds)."""
    rows, modules = [], []
    for label, adds in IMPORT_STEPS:
        modules += adds
        code = (
            "import importlib\n"
            + "".join(f"importlib.import_module({m!r})\n" for m in modules)
            + "print([int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')][0])"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
        rows.append({"step": label, "rss_mib": int(done.stdout.strip()) / 1024})
    return rows


EXCHANGE_HOOK = "Upstream.request"
"""Where a buffered request is sent to the backend and its answer read: the work of mitmproxy's own
upstream leg, done by ContextPaw instead; counted apart from the hooks' own."""


def hook_times(upstream: str, work: Path, requests: int) -> dict[str, Any]:
    """ContextPaw's own time in each hook for small fitting requests (scripts/bench/hook_timing.py), so the
    overhead can be told apart: our code, mitmproxy's dispatch of it, and the relay."""
    out = work / "hook-times.json"
    timed, (url,) = mitmdump(
        [upstream],
        work,
        "hook-timing",
        addon=SCRIPTS / "bench" / "hook_timing.py",
        options=[f"contextpaw_llamacpp={upstream}", "contextpaw_calibrate=false"],
        env={**os.environ, "CONTEXTPAW_HOOK_TIMES": str(out)},
    )
    with timed, httpx.Client(timeout=60, trust_env=False) as client:
        for i in range(requests):
            latency(client, url, chat_bytes(10**8 + i))
        timed.stop()
    hooks = json.loads(out.read_text())
    exchange = hooks.get(EXCHANGE_HOOK, {"mean_us": 0.0, "n": 0})
    return {
        "requests": requests,
        "by_hook": hooks,
        "total_us": sum(h["mean_us"] * h["n"] for name, h in hooks.items() if name != EXCHANGE_HOOK) / requests,
        "exchange_us": exchange["mean_us"] * exchange["n"] / requests,
    }


def handoff_cost(body: bytes) -> dict[str, float]:
    """What moving the big compaction to another process would cost the event loop at least: the
    parsed request and the fitted result pickled one way and read back the other (median of 5), beside
    the work itself (parse and fit, which a worker thread does now)."""
    import pickle

    from contextpaw.wire.openai import CHAT

    def timed(fn: Callable[[], Any]) -> float:
        return bench_compact.median_seconds(fn, 5)[0] * 1000

    parsed = CHAT.read(body)
    fitted = fit_chat(parsed, COMPACTION_CTX - 1024, EstimateCounter(), keep_recent=4, previous=None)
    return {
        "parse_ms": timed(lambda: CHAT.read(body)),
        "fit_ms": timed(lambda: fit_chat(parsed, COMPACTION_CTX - 1024, EstimateCounter(), keep_recent=4, previous=None)),
        "pickle_request_ms": timed(lambda: pickle.loads(pickle.dumps(parsed, protocol=pickle.HIGHEST_PROTOCOL))),
        "pickle_result_ms": timed(lambda: pickle.loads(pickle.dumps(fitted, protocol=pickle.HIGHEST_PROTOCOL))),
        "body_bytes": len(body),
    }
