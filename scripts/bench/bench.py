"""Benchmarks: what ContextPaw costs and what it saves, side by side in one run.

    PYTHONPATH=tests .venv/bin/python scripts/bench/bench.py [--out bench-results] [--quick] [--skip-real] [--docs]
        [--reuse docs/bench.json --only SECTION ...]

Sections (each in the JSON, the markdown table and, where it helps, a PNG):
1. overhead: the same requests direct to a fake llama-server, through bare mitmdump (the floor for
   any addon) and through mitmdump with ContextPaw; small and 1 MB bodies that fit, and streams
   (time to first byte, chunk rate). Paths take turns in rounds, so machine noise hits all three.
2. compaction: time and peak memory to compact 1k-200k token chats and raw prompts (the sweep of
   scripts/bench/bench_compact.py) with each counter: estimate, calibrated, the GGUF tokenizer, and
   llama-server's own counts (first call uncached vs cached).
3. window_use: final tokens / budget across the same sweep, by each counter's own count; and
   real_window_use: what would be sent, counted by llama-server, over the budget.
   window_use_through: real-token window use through ContextPaw (scripts/bench/measure_window_use.py).
4. agent_loop: prefix-cache reuse per turn on a real llama-server (scripts/bench/bench_agent_loop.py).
5. recall: the k/N lines of demo_needle.py, demo_400.py and measure_summary.py's table.
6. loop_health: c=8 throughput and proxy CPU per request, the worst latency idle and during one
   160k-token compaction, RSS (and by import step), ContextPaw's time per hook, a process handoff's cost.
7. scaling: the engine at 1,200 to 9,600 messages.
The goals of this round, each beside its floor, head the markdown (and, with --docs, the README).
Real-backend parts need llama-server and the SmolLM2 model; they are skipped, saying why, when
either is missing or with --skip-real. --docs copies the markdown and plots into docs/, and the JSON
to docs/bench.json; a whole run takes hours on 2 cores, so `--reuse docs/bench.json --only ...`
measures only the sections named (overhead, compaction, agent_loop, prefix, window_use_through,
recall, loop_health, scaling) and takes the rest from that run, whose date the report names.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import bench_agent_loop
import bench_compact
import httpx
import measure_window_use
import mitmproxy.version
from rich.console import Console
from rich.progress import Progress

from contextpaw.calls.server_counts import BackendCounter, LlamaCppCounting
from contextpaw.core.conversation import Conversation
from contextpaw.core.tokens import Counter, EstimateCounter, TokenizerCounter
from contextpaw.fitting.calibration import CalibratedCounter
from contextpaw.fitting.engine import fit_chat

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import (
    ADDON,
    Backend,
    free_port,
    locate_llama_server,
    locate_smollm2,
    start_llama_server,
    start_module,
    start_process,
)
from support.common import LOOPBACK
from support.measure import cpu_seconds, memory_mib, worst_latency_while

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
PATHS = ("direct", "mitmdump", "ContextPaw", "ContextPaw, no relay")
"""The last one runs with contextpaw_relay=false: what the relay (answers for failing backends) costs."""
STREAMING = "mitmdump, streaming"
"""Bare mitmdump with stream_large_bodies=1: it buffers nothing, the floor for a stream's first byte."""
STREAM_PATHS = (*PATHS, STREAMING)
BIG_CTX = 1_000_000
"""The fake's and the proxy's window for the overhead runs: a 1 MB body fits, nothing is compacted."""
CALIBRATION_FACTOR = 1.1
"""A typical learned factor; the calibrated counter costs the same whatever its value."""
README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"
"""Where --docs writes the goals table into the README."""
WINDOW_GOAL = 0.95
CEILING_SLACK = 0.02
"""A turn within this share of the prompt of its ceiling is at it (the last few tokens of a prompt are
evaluated again whatever is cached: llama-server re-evaluates the last token)."""
OVERHEAD_GOAL = 0.10
console = Console(stderr=True)


# -- 1. proxy overhead -------------------------------------------------------------------------


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


def stream_timing(client: httpx.Client, url: str, body: bytes) -> dict[str, float]:
    """Time to first byte, whole stream, and SSE events per second between first and last byte."""
    started = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    with client.stream("POST", url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}) as reply:
        for chunk in reply.iter_raw():
            arrivals.append((time.perf_counter(), chunk.count(b"data: ")))
    events = sum(n for _, n in arrivals)
    span = arrivals[-1][0] - arrivals[0][0]
    return {"ttfb": arrivals[0][0] - started, "total": arrivals[-1][0] - started, "rate": (events - 1) / span if span > 0 else None}


def median_or_none(values: list[float | None]) -> float | None:
    """None when no stream arrived in more than one piece (bare mitmdump buffers whole responses)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def counting_cost(proxy: str, requests: int) -> dict[str, Any]:
    """What ContextPaw spent asking llama-server to count (/tokenize, input_tokens), from its health."""
    health = httpx.get(proxy + "/contextpaw/health", timeout=30, trust_env=False).json()
    spent = health["counter"]["backend"]
    return spent | {"requests": requests, "ms_per_request": spent["seconds"] * 1000 / max(1, requests)}


def percentiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"n": len(values), "p50_ms": cuts[49] * 1000, "p99_ms": cuts[98] * 1000, "req_per_s": len(values) / sum(values)}


def overhead(work: Path, quick: bool, progress: Progress) -> dict[str, Any]:
    """Rounds of (small, 1 MB, stream) batches; within a round the three paths take turns."""
    rounds, small_n, big_n, stream_n = (2, 20, 2, 4) if quick else (4, 100, 5, 15)
    big_size = 100_000 if quick else 1_000_000
    filler = filler_text(big_size)
    fake_args = ["--n-ctx", str(BIG_CTX)]
    task = progress.add_task("proxy overhead", total=rounds * (len(PATHS) * (small_n + big_n) + len(STREAM_PATHS) * stream_n))
    with contextlib.ExitStack() as stack:
        fast = stack.enter_context(start_module("support.fake_llamacpp", fake_args, "/health", work / "fast.log"))
        slow = stack.enter_context(
            start_module("support.fake_llamacpp", [*fake_args, "--chunk-delay", "0.01"], "/health", work / "slow.log")
        )
        upstreams = [fast.url, slow.url]
        bare, bare_urls = mitmdump(upstreams, work, "bare", addon=False, options=[])
        stack.enter_context(bare)
        paw_options = [f"contextpaw_default_ctx={BIG_CTX}", "contextpaw_calibrate=false", *(f"contextpaw_llamacpp={u}" for u in upstreams)]
        paw, paw_urls = mitmdump(upstreams, work, "contextpaw", addon=True, options=paw_options)
        stack.enter_context(paw)
        unrelayed, unrelayed_urls = mitmdump(
            upstreams, work, "contextpaw-no-relay", addon=True, options=[*paw_options, "contextpaw_relay=false"]
        )
        stack.enter_context(unrelayed)
        streaming, streaming_urls = mitmdump(upstreams, work, "bare-streaming", addon=False, options=["stream_large_bodies=1"])
        stack.enter_context(streaming)
        urls = {
            "direct": upstreams,
            "mitmdump": bare_urls,
            "ContextPaw": paw_urls,
            "ContextPaw, no relay": unrelayed_urls,
            STREAMING: streaming_urls,
        }
        clients = {p: stack.enter_context(httpx.Client(timeout=120, trust_env=False)) for p in STREAM_PATHS}
        samples: dict[str, dict[str, list]] = {case: {p: [] for p in STREAM_PATHS} for case in ("small", "big", "stream")}
        for p in STREAM_PATHS:  # warm up: connections, window discovery, template measurement
            for i in range(3):
                latency(clients[p], urls[p][0], chat_bytes(-i))
                stream_timing(clients[p], urls[p][1], chat_bytes(-i, stream=True))
        serial = iter(range(10**9))
        for _ in range(rounds):
            for p in STREAM_PATHS:
                client, (fast_url, slow_url) = clients[p], urls[p]
                if p in PATHS:
                    for _ in range(small_n):
                        samples["small"][p].append(latency(client, fast_url, chat_bytes(next(serial))))
                    for _ in range(big_n):
                        samples["big"][p].append(latency(client, fast_url, chat_bytes(next(serial), filler)))
                    progress.advance(task, small_n + big_n)
                for _ in range(stream_n):
                    samples["stream"][p].append(stream_timing(client, slow_url, chat_bytes(next(serial), stream=True)))
                progress.advance(task, stream_n)
        spent = counting_cost(paw_urls[0], sum(len(samples[c]["ContextPaw"]) for c in samples))
    result: dict[str, Any] = {
        "big_body_bytes": len(chat_bytes(0, filler)),
        "rounds": rounds,
        "stream_chunk_delay_s": 0.01,
        "contextpaw_counting": spent,
    }
    for case in ("small", "big"):
        result[case] = {p: percentiles(samples[case][p]) for p in PATHS}
    result["stream"] = {
        p: {
            "ttfb": percentiles([s["ttfb"] for s in samples["stream"][p]]),
            "total": percentiles([s["total"] for s in samples["stream"][p]]),
            "events_per_s": median_or_none([s["rate"] for s in samples["stream"][p]]),
        }
        for p in STREAM_PATHS
    }
    result["verdict"] = {
        case: {
            "p50_vs_mitmdump": result[case]["ContextPaw"]["p50_ms"] / result[case]["mitmdump"]["p50_ms"] - 1,
            "req_per_s_vs_mitmdump": result[case]["ContextPaw"]["req_per_s"] / result[case]["mitmdump"]["req_per_s"] - 1,
            "relay_p50_ms": result[case]["ContextPaw"]["p50_ms"] - result[case]["ContextPaw, no relay"]["p50_ms"],
        }
        for case in ("small", "big")
    } | {
        "stream_ttfb_p50_vs_direct_ms": result["stream"]["ContextPaw"]["ttfb"]["p50_ms"] - result["stream"]["direct"]["ttfb"]["p50_ms"],
        "streaming_floor_ttfb_p50_vs_direct_ms": result["stream"][STREAMING]["ttfb"]["p50_ms"]
        - result["stream"]["direct"]["ttfb"]["p50_ms"],
    }
    return result


# -- 6. concurrency, stalls and memory ----------------------------------------------------------------

SCALING_ROUNDS = 7
"""Interleaved runs of each size in the engine's scaling row."""
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
    return {"requests": requests, "by_hook": hooks, "total_us": sum(h["mean_us"] * h["n"] for h in hooks.values()) / requests}


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


# -- 7. the engine at 1,200 to 10,000 messages -------------------------------------------------------


def scaling(quick: bool, progress: Progress) -> dict[str, Any]:
    """160k tokens in more and more messages, compacted into 32k with the estimate: time per size,
    and its growth per doubling (the goal: at most 2.2x). The collector is off while a run is timed,
    as `timeit` does: a full pass over this process's heap (the whole benchmark's results) lands on
    whichever size happens to trigger it, and that is not the engine's growth. Each size's time is
    its fastest of `SCALING_ROUNDS` interleaved runs (`timeit`'s advice: the slower ones measure the
    machine's other work); the median is kept beside it."""
    import gc

    from contextpaw.core.compact import compact_chat

    sizes = (1200, 2400, 4800) if quick else (1200, 2400, 4800, 9600)
    rounds = 3 if quick else SCALING_ROUNDS
    task = progress.add_task("engine scaling", total=len(sizes) * rounds)
    conversations = {n: Conversation.from_wire(bench_compact.agent_conversation(160_000, EstimateCounter(), messages=n)) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):  # the sizes take turns, so a busy moment of the machine hits one run of each, not one size
        for n in sizes:
            gc.collect()
            gc.disable()
            try:
                started = time.perf_counter()
                compact_chat(conversations[n], 32_000, EstimateCounter(), keep_recent=4, previous=None)
                times[n].append(time.perf_counter() - started)
            finally:
                gc.enable()
            progress.advance(task)
    rows = [{"messages": n, "ms": min(times[n]) * 1000, "median_ms": statistics.median(times[n]) * 1000} for n in sizes]
    for before, after in zip(rows, rows[1:]):
        after["per_doubling"] = after["ms"] / before["ms"] / (after["messages"] / before["messages"] / 2)
    return {"tokens": 160_000, "budget": 32_000, "rounds": rounds, "rows": rows}


# -- 2./3. compaction cost and window use -----------------------------------------------------------


def texts_of(messages: list[dict]) -> list[str]:
    """What the proxy asks llama-server to count for a chat (wire.Chat.texts) and its raw-prompt form."""
    conversation = Conversation.from_wire(messages)
    texts = [t for m in conversation.messages for t in (m.text, m.content_text)]
    return [*texts, "\n".join(m["content"] or "" for m in messages)]


async def backend_counts(url: str, sizes: list[int], tick: Callable[[], None]) -> tuple[BackendCounter, list[dict]]:
    """llama-server's counts for every text of the sweep, timed per size: a fresh cache, then again."""
    estimate, known, timings = EstimateCounter(), {}, []
    async with aiohttp.ClientSession(trust_env=False) as session:
        per_message = 0
        for size in sizes:
            texts = texts_of(bench_compact.agent_conversation(size, estimate))
            counting = LlamaCppCounting(session, timeout=120, cache_size=len(texts) + 16)
            seconds = []
            for _ in range(2):
                started = time.perf_counter()
                counted = await counting.counter(url, texts, estimate, chat=True, has_system=True)
                seconds.append(time.perf_counter() - started)
                if counted is None:
                    raise RuntimeError(f"llama-server at {url} did not count")
            counter = counted[0]
            known |= counter.known
            per_message = counter.message_overhead - 1
            timings.append({"size": size, "texts": len(set(texts)), "uncached_ms": seconds[0] * 1000, "cached_ms": seconds[1] * 1000})
            tick()
    return BackendCounter(known, estimate, per_message), timings


def compaction(quick: bool, gguf: Path | None, llama_url: str | None, progress: Progress) -> dict[str, Any]:
    """The bench_compact sweep once per counter that can be had here."""
    sizes = [1000, 5000] if quick else [1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000, 160_000, 200_000]
    repeat = 1 if quick else 3
    counters: dict[str, Counter] = {"estimate": EstimateCounter(), "calibrated": CalibratedCounter(EstimateCounter(), CALIBRATION_FACTOR)}
    result: dict[str, Any] = {"sizes": sizes, "repeat": repeat, "counters": {}, "skipped": {}}
    if gguf is not None:
        started = time.perf_counter()
        counters["tokenizer"] = TokenizerCounter.from_file(str(gguf))
        result["tokenizer_load_s"] = time.perf_counter() - started
    else:
        result["skipped"]["tokenizer"] = "no SmolLM2 GGUF"
    task = progress.add_task("compaction sweep", total=len(sizes) * (len(counters) + 2 * (llama_url is not None)))
    if llama_url is not None:
        counters["backend"], result["backend_counting"] = asyncio.run(backend_counts(llama_url, sizes, lambda: progress.advance(task)))
    else:
        result["skipped"]["backend"] = "no llama-server"
    for name, counter in counters.items():
        rows = []
        for size in sizes:
            rows += bench_compact.run([size], repeat, counter)
            progress.advance(task)
        result["counters"][name] = rows
    result["headline"] = bench_compact.headline(EstimateCounter(), repeat)
    return result


REAL_USE_SIZES = (5_000, 10_000, 20_000, 50_000)


async def real_window_use(url: str, sizes: tuple[int, ...] = REAL_USE_SIZES) -> dict[str, Any]:
    """Window use in real tokens: agent chats compacted into a quarter of their real size with the
    estimate, raw and calibrated (on five other chats, by llama-server's own counts, as the proxy
    learns), and with llama-server's per-text counts (what ContextPaw uses in front of it), then
    what would be sent counted by the server. Real tokens / budget: under 95% wastes
    the window, over 100% would overflow it."""
    from contextpaw.core.compact import compact_chat
    from contextpaw.fitting.calibration import Calibration

    estimate, calibration = EstimateCounter(), Calibration()
    rows = []
    async with aiohttp.ClientSession(trust_env=False) as session:
        counting = LlamaCppCounting(session)
        for seed in range(5):
            msgs = bench_compact.agent_conversation(3_000, estimate, seed=100 + seed)
            truth = await counting.total(url, {"messages": msgs})
            estimated = sum(estimate.message(m) for m in Conversation.from_wire(msgs).messages)
            calibration.observe("bench", estimated, truth, whole=True)
        counters = {"estimate": estimate, "calibrated": calibration.counter("bench", estimate)}
        for size in sizes:
            msgs = bench_compact.agent_conversation(size, estimate)
            conv = Conversation.from_wire(msgs)
            whole = await counting.total(url, {"messages": msgs})
            if whole is None:
                raise RuntimeError(f"{url} did not count a {size}-token chat")
            budget = max(1000, whole // 4)  # in real tokens, the same for every counter
            texts = [t for m in conv.messages for t in (m.text, m.content_text)]
            backend = await counting.counter(url, texts, estimate, chat=True, has_system=conv.messages[0].role == "system")
            if backend is None:
                raise RuntimeError(f"{url} did not tokenize a {size}-token chat")
            for name, (counter, fixed) in ({k: (c, 0) for k, c in counters.items()} | {"backend": backend}).items():
                result = compact_chat(conv, budget, counter, keep_recent=4, fixed_tokens=fixed)
                real = await counting.total(url, {"messages": list(result.messages or msgs)})
                if real is None:
                    raise RuntimeError(f"{url} did not count a {size}-token chat")
                rows.append({"counter": name, "tokens": whole, "budget": budget, "real_tokens": real, "use": real / budget})
    return {"factor": calibration.factor("bench"), "rows": rows}


def window_use(comp: dict[str, Any]) -> dict[str, Any]:
    """Final/budget per counter and kind, over the cases that needed compacting (the rest fit as they are)."""
    out = {}
    for name, rows in comp["counters"].items():
        for kind in ("chat", "prompt"):
            uses = [r["use"] for r in rows if r["kind"] == kind and r["tokens"] > r["budget"]] or [1.0]
            out[f"{name}/{kind}"] = {"min": min(uses), "mean": statistics.fmean(uses), "max": max(uses)}
    return {"goal": WINDOW_GOAL, "by_counter": out, "below_goal": sorted(k for k, v in out.items() if v["min"] < WINDOW_GOAL)}


# -- 5. recall -----------------------------------------------------------------------------------

RECALL_LINE = re.compile(r"^(.+): recalled (\d+)/(\d+)$", re.M)


def recall(quick: bool, trials: int, progress: Progress) -> dict[str, Any]:
    """Run the demos as their own processes (each starts its own servers) and keep their k/N."""
    trials = "1" if quick else str(trials)
    runs = {"demo_needle": ["demo/demo_needle.py", "--trials", trials], "demo_400": ["demo/demo_400.py", "--trials", trials]}
    if (SCRIPTS / "measure" / "measure_summary.py").exists():
        runs["measure_summary"] = ["measure/measure_summary.py", "--trials", trials]
    task = progress.add_task("recall demos", total=len(runs))
    out = {}
    for name, argv in runs.items():
        try:
            done = subprocess.run(
                [sys.executable, str(SCRIPTS / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=900, cwd=REPO
            )
            output, code = done.stdout, done.returncode
        except subprocess.TimeoutExpired as e:
            output = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
            code = None
        out[name] = {
            "exit": code,
            "recalled": {m[1]: [int(m[2]), int(m[3])] for m in RECALL_LINE.finditer(output)},
            "table": [line for line in output.splitlines() if line.startswith("|")] if name == "measure_summary" else [],
        }
        progress.advance(task)
    return out


# -- report ----------------------------------------------------------------------------------------


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


def plots(result: dict[str, Any], img: Path) -> list[str]:
    """Small PNGs for the sections that have data; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    made = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(img / name, dpi=72)
        plt.close(fig)
        made.append(name)

    if "small" in (over := result["overhead"]):
        fig, ax = plt.subplots(figsize=(6, 3))
        cases = [("small", over["small"]), ("1 MB", over["big"]), ("stream TTFB", {p: over["stream"][p]["ttfb"] for p in PATHS})]
        for j, p in enumerate(PATHS):
            width = 0.8 / len(PATHS)
            ax.bar([i + (j - (len(PATHS) - 1) / 2) * width for i in range(len(cases))], [c[p]["p50_ms"] for _, c in cases], width, label=p)
        ax.set_xticks(range(len(cases)), [c for c, _ in cases])
        ax.set_yscale("log")
        ax.set_ylabel("p50 latency, ms")
        ax.legend(fontsize=8)
        save(fig, "bench-overhead.png")
    if comp := result["compaction"].get("counters"):
        for name, key, label, scale in (
            ("bench-compaction.png", "ms", "time, ms", "log"),
            ("bench-window-use.png", "use", "final / budget", "linear"),
        ):
            fig, ax = plt.subplots(figsize=(6, 3.2))
            for counter, rows in comp.items():
                for kind, style in (("chat", "-"), ("prompt", "--")):
                    pts = [(r["tokens"], r[key]) for r in rows if r["kind"] == kind]
                    ax.plot(*zip(*pts), style, marker=".", label=f"{counter} {kind}")
            ax.set_xscale("log")
            ax.set_yscale(scale)
            ax.set_xlabel("conversation tokens")
            ax.set_ylabel(label)
            if key == "use":
                ax.axhline(WINDOW_GOAL, color="grey", lw=0.8)
            ax.legend(fontsize=7, ncol=2)
            save(fig, name)
    if turns := result["agent_loop"].get("turns"):
        fig, ax = plt.subplots(figsize=(6, 3))
        labels = {
            "contextpaw": "ContextPaw (sticky plan)",
            "baseline": "from scratch each turn",
            "uncut": "uncut, window holds all (ceiling)",
        }
        for path, label in labels.items():
            if path in turns[0]:
                ax.plot([r["turn"] for r in turns], [r[path]["cached"] for r in turns], marker=".", label=label)
        ax.axhline(bench_agent_loop.CACHE_GOAL, color="grey", lw=0.8)
        ax.set_xlabel("turn")
        ax.set_ylabel("prompt served from cache")
        ax.legend(fontsize=8)
        save(fig, "bench-agent-loop.png")
    for loop in result.get("agent_loops") or []:  # per window: reuse per turn against the ceiling
        if table := loop.get("table"):
            name = f"agent-loop-{table['window']}.png"
            bench_agent_loop.plot(loop, img / name)
            made.append(name)
    return made


def goals(result: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """Issue 29's table from one run: (measure, floor, ContextPaw, goal, met), each beside its floor
    (bare mitmdump, direct, or the uncut ceiling) as measured in the same run; a goal not met says
    the measured reason."""
    rows: list[tuple[str, str, str, str, str]] = []

    def met(ok: bool | None) -> str:
        return "-" if ok is None else ("met" if ok else "not met")

    over = result.get("overhead", {})
    if "small" in over:
        bare, paw, plain = (over["small"][p] for p in ("mitmdump", "ContextPaw", "ContextPaw, no relay"))
        ratio = paw["req_per_s"] / bare["req_per_s"]
        plain_ratio = plain["req_per_s"] / bare["req_per_s"]
        relay = f"the relay's hop {paw['p50_ms'] - plain['p50_ms']:+.2f} ms p50; without it {plain_ratio:.2f}x"
        rows.append(
            (
                "small fitting POST, c=1",
                f"{bare['req_per_s']:.0f} req/s, p50 {bare['p50_ms']:.2f} ms",
                f"{paw['req_per_s']:.0f} req/s ({ratio:.2f}x), p50 {paw['p50_ms']:.2f} ms",
                "≥ 0.9x",
                "met" if ratio >= 0.9 else f"not met: {relay}",
            )
        )
        rows.append(
            (
                "the relay's share (c=1, no relay vs relay)",
                f"no relay: {plain['req_per_s']:.0f} req/s ({plain_ratio:.2f}x), p50 {plain['p50_ms']:.2f} ms",
                f"relay: {paw['p50_ms'] - plain['p50_ms']:+.2f} ms p50",
                "reported",
                "-",
            )
        )
        floor = over["verdict"].get("streaming_floor_ttfb_p50_vs_direct_ms")
        ours = over["verdict"]["stream_ttfb_p50_vs_direct_ms"]
        rows.append(
            (
                "first streamed record over direct, p50",
                "-" if floor is None else f"{floor:+.2f} ms (mitmdump streaming)",
                f"{ours:+.2f} ms",
                "≤ floor + 1 ms",
                "-"
                if floor is None
                else "met"
                if ours <= floor + 1
                else f"not met: {ours - floor:+.2f} ms over the floor, through the relay",
            )
        )
    if health := result.get("loop_health"):
        bare, paw = health["mitmdump"], health["ContextPaw"]
        ratio = paw["c8_req_per_s"] / bare["c8_req_per_s"]
        plain = health.get("ContextPaw, no relay")
        why = (
            f"the relay's hop; without it {plain['c8_req_per_s'] / bare['c8_req_per_s']:.2f}x"
            if plain
            else relay
            if "small" in over
            else "see the CPU row"
        )
        rows.append(
            (
                "small fitting POST, c=8",
                f"{bare['c8_req_per_s']:.0f} req/s",
                f"{paw['c8_req_per_s']:.0f} req/s ({ratio:.2f}x)",
                "≥ 0.9x",
                "met" if ratio >= 0.9 else f"not met: {why}",
            )
        )
        if "cpu_ms_per_request" in paw:
            cost = paw["cpu_ms_per_request"] / bare["cpu_ms_per_request"]
            hooks = health.get("hooks") or {}
            own = f"; ContextPaw's hooks {hooks['total_us'] / 1000:.2f} ms of it" if hooks else ""
            relay = (
                f"; the relay's hop {paw['cpu_ms_per_request'] - plain['cpu_ms_per_request']:.2f} ms of it (no relay: "
                f"{plain['cpu_ms_per_request'] / bare['cpu_ms_per_request']:.2f}x)"
                if plain
                else ""
            )
            rows.append(
                (
                    "proxy CPU per request at c=8",
                    f"{bare['cpu_ms_per_request']:.2f} ms",
                    f"{paw['cpu_ms_per_request']:.2f} ms ({cost:.2f}x{own})",
                    "≤ 1.11x (that is 0.9x throughput)",
                    "met"
                    if cost <= 1 / 0.9
                    else f"not met: {paw['cpu_ms_per_request'] - bare['cpu_ms_per_request']:.2f} ms more"
                    + (f", {hooks['total_us'] / 1000:.2f} ms of it in our hooks" if hooks else "")
                    + relay,
                )
            )
        rows.append(
            (
                f"worst small-request latency during one {health['compaction_tokens'] // 1000}k/{health['compaction_messages']} compaction",
                f"{bare['worst_during_big_request_ms']:.1f} ms",
                f"{paw['worst_during_big_request_ms']:.1f} ms",
                "≤ 10 ms, and within 1.5x of bare",
                stall_verdict(paw["worst_during_big_request_ms"], bare["worst_during_big_request_ms"]),
            )
        )
        rows.append(
            (
                "worst small-request latency while idle",
                f"{bare['worst_idle_ms']:.1f} ms",
                f"{paw['worst_idle_ms']:.1f} ms",
                "no cause of ours",
                met(paw["worst_idle_ms"] <= max(10.0, 1.5 * bare["worst_idle_ms"])),
            )
        )
        steps = health.get("rss_by_import") or []
        where = ", ".join(f"{b['step'].lstrip('+ ')} {b['rss_mib'] - a['rss_mib']:+.1f}" for a, b in zip(steps, steps[1:]))
        rows.append(
            (
                "RSS after the run",
                f"{bare['rss_mib']:.0f} MiB",
                f"{paw['rss_mib']:.0f} MiB" + (f" (imports alone, MiB: {where})" if where else ""),
                "say where it goes",
                "-",
            )
        )
    if scale := result.get("scaling"):
        grown = [r["per_doubling"] for r in scale["rows"] if "per_doubling" in r]
        sizes = " / ".join(f"{r['messages']:,}" for r in scale["rows"])
        rows.append(
            (
                f"engine, {scale['tokens'] // 1000}k tokens at {sizes} messages",
                "-",
                " / ".join(f"{r['ms']:.0f}" for r in scale["rows"]) + " ms; per doubling " + ", ".join(f"{g:.2f}x" for g in grown),
                "≤ 2.2x per doubling",
                met(all(g <= 2.2 for g in grown)),
            )
        )
    for loop in result.get("agent_loops") or [result.get("agent_loop", {})]:
        if table := loop.get("table"):
            gaps = [
                r
                for r in loop["turns"]
                if "failed" not in r["contextpaw"]
                and "ceiling" in r
                and table["first_compacted_turn"] is not None
                and r["turn"] >= table["first_compacted_turn"]
                and r["contextpaw"]["cached"] < r["ceiling"] - CEILING_SLACK
            ]
            rows.append(
                (
                    f"agent loop on real llama-server ({table['turns']} turns, -c {table['window']}), prompt from cache",
                    f"ceiling (all but what each turn adds): {pct(table['ceiling_mean'])} mean, {pct(table['ceiling_worst'])} worst",
                    f"{pct(table['reuse_mean'])} mean, {pct(table['reuse_worst'])} worst; {table['recut_turns']} re-cut turns at "
                    f"{pct(table['recut_reuse_mean'])} against {pct(table['recut_ceiling_mean'])}",
                    "every turn at its ceiling",
                    "met" if not gaps else f"not met: {len(gaps)} turns below; {recut_reasons(gaps)}",
                )
            )
    if prefix := result.get("prefix"):
        for w in prefix["windows"]:
            unnoted = sum(1 for c in w["recuts"] if c["before_last_marker"] and not c["earlier_cut_noted"])
            noted = sum(1 for c in w["recuts"] if c["before_last_marker"] and c["earlier_cut_noted"])
            rows.append(
                (
                    f"prefix through the last marker, turn to turn (engine, {prefix['turns']} turns, {w['window'] // 1024}k)",
                    f"ceiling {pct(w['ceiling_mean'])} mean",
                    f"reuse {pct(w['reuse_mean'])} mean, {w['recut_turns']} re-cuts, "
                    f"{noted} before the last marker (the budget forced it, noted)",
                    "identical unless the budget forces a cut (noted)",
                    "met" if unnoted == 0 else f"not met: {unnoted} unnoted",
                )
            )
    use = result.get("window_use_through", {}).get("summary") or {}
    for path, label in (
        ("llama-server", "llama-server's counts"),
        ("ollama /api/chat", "calibrated shape count, Ollama /api/chat"),
        ("ollama /v1", "calibrated estimate, Ollama /v1 (no truncate: false)"),
        ("ollama /v1, model file read", "the model's tokenizer from the GGUF Ollama names, Ollama /v1"),
    ):
        if (u := use.get(path)) and u["measured"]:
            rows.append(
                (
                    f"real-token window use, {label} (the server's count of what was sent / budget)",
                    "-",
                    f"{u['min']:.1%} to {u['max']:.1%}, mean {u['mean']:.1%} over {u['measured']} chats",
                    f"≥ {u['goal']:.0%}, never over 100%",
                    "met"
                    if u["met"]
                    else f"not met: {u['below_goal']} below, {u['over_100']} over 100%"
                    + "".join(f"; {why}" for why in u.get("shortfalls", [])),
                )
            )
    return rows


def recut_reasons(gaps: list[dict[str, Any]]) -> str:
    """Why the turns below their ceiling fell short, counted: a re-cut after the last marker (what
    follows the changed message is evaluated again), one the budget forced before it (the report
    notes it), one before it not noted; and the worst turn."""
    details = [t.get("recut_detail") or {} for t in gaps]
    after = sum(1 for d in details if d and not d.get("before_last_marker") and not d.get("earlier_cut_noted"))
    forced = sum(1 for d in details if d.get("earlier_cut_noted"))
    unnoted = sum(1 for d in details if d and d.get("before_last_marker") and not d.get("earlier_cut_noted"))
    worst = min(gaps, key=lambda t: t["contextpaw"]["cached"])
    return (
        f"{after} re-cut after the last marker (what follows the change is evaluated again), {forced} forced "
        f"before it by the budget (noted), {unnoted} before it unnoted, {len(gaps) - after - forced - unnoted} other; "
        f"worst turn {worst['turn']}: {pct(worst['contextpaw']['cached'])} of {pct(worst['ceiling'])}"
    )


def stall_verdict(ours_ms: float, bare_ms: float) -> str:
    """The stall goal (at most 10 ms, and within 1.5x of bare mitmdump), with the reason when missed."""
    within = ours_ms <= 1.5 * bare_ms
    if within and ours_ms <= 10:
        return "met"
    if within:
        return f"met within 1.5x of bare; not ≤ 10 ms: bare mitmdump itself stalls {bare_ms:.1f} ms relaying the same body"
    return "not met"


def goals_table(result: dict[str, Any]) -> list[str]:
    lines = ["| measure | floor, same run | ContextPaw | goal | |", "|---|---|---|---|---|"]
    return lines + [f"| {' | '.join(row)} |" for row in goals(result)]


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def reused_note(result: dict[str, Any]) -> str:
    """Which sections came from an earlier run (--reuse), and its date; nothing for a whole run."""
    reused = result.get("reused")
    return f"; {', '.join(reused['sections'])} from the run of {reused['date']}" if reused and reused["sections"] else ""


def markdown(result: dict[str, Any], images: list[str]) -> str:
    """The README fragment: one table per section, with the goals and the plots."""
    m = result["machine"]
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `scripts/bench/bench.py{' --quick' if result['quick'] else ''}` on {m['date']}: "
        f"{m['cpus']} CPUs (load {m['load_average'][0]:.1f} at start, shared machine), Python {m['python']}, "
        f"mitmproxy {m['mitmproxy']}{reused_note(result)}. Absolute numbers are this machine's; compare within a table.",
        "",
        "## Goals, side by side",
        "",
        *goals_table(result),
        "",
    ]

    def image(name: str) -> None:
        if name in images:
            lines.extend([f"![{name}](img/{name})", ""])

    def skipped(section: dict[str, Any]) -> bool:
        if "skipped" in section and isinstance(section["skipped"], str):
            lines.extend([f"Skipped: {section['skipped']}.", ""])
            return True
        return False

    over = result["overhead"]
    lines += ["## 1. Proxy overhead", ""]
    if not skipped(over):
        lines += [
            f"Fake llama-server on loopback, one keep-alive client, sequential; {over['rounds']} rounds in which the "
            f"paths take turns. Big body: {over['big_body_bytes'] / 1e6:.2f} MB that fits (nothing compacted). "
            f"Streams: {over['stream_chunk_delay_s'] * 1000:.0f} ms between tokens.",
            "",
            "| case | path | n | req/s | p50 ms | p99 ms |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for case, label in (("small", "small body"), ("big", "1 MB body")):
            for p in PATHS:
                s = over[case][p]
                lines.append(f"| {label} | {p} | {s['n']} | {s['req_per_s']:.0f} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} |")
        lines += ["", "| stream | n | TTFB p50 ms | TTFB p99 ms | whole p50 ms | events/s |", "|---|---:|---:|---:|---:|---:|"]
        for p in (q for q in STREAM_PATHS if q in over["stream"]):
            s = over["stream"][p]
            lines.append(
                f"| {p} | {s['ttfb']['n']} | {s['ttfb']['p50_ms']:.2f} | {s['ttfb']['p99_ms']:.2f} | "
                f"{s['total']['p50_ms']:.1f} | {'buffered' if s['events_per_s'] is None else f'{s["events_per_s"]:.0f}'} |"
            )
        v = over["verdict"]
        lines += [
            "",
            f"ContextPaw vs bare mitmdump (goal: within {OVERHEAD_GOAL:.0%}): small p50 {v['small']['p50_vs_mitmdump']:+.0%}, "
            f"req/s {v['small']['req_per_s_vs_mitmdump']:+.0%}; 1 MB p50 {v['big']['p50_vs_mitmdump']:+.0%}, "
            f"req/s {v['big']['req_per_s_vs_mitmdump']:+.0%}. Stream TTFB p50 vs direct: "
            f"{v['stream_ttfb_p50_vs_direct_ms']:+.2f} ms. Bare mitmdump buffers a response unless a hook streams "
            "it, so its TTFB is the whole stream.",
            "",
            f"The relay (on by default; it answers a backend that resets or hangs in the caller's API) costs "
            f"{v['small']['relay_p50_ms']:+.2f} ms p50 on a small body and {v['big']['relay_p50_ms']:+.2f} ms on "
            "1 MB (ContextPaw vs ContextPaw, no relay).",
            "",
            f"Of ContextPaw's time, asking llama-server to count (`/tokenize` for new texts, "
            f"`/v1/chat/completions/input_tokens` to check every chat): {over['contextpaw_counting']['calls']} calls, "
            f"{over['contextpaw_counting']['ms_per_request']:.2f} ms per request on average.",
            "",
        ]
        image("bench-overhead.png")

    comp = result["compaction"]
    lines += ["## 2. Compaction cost", ""]
    if not skipped(comp):
        h = comp["headline"]
        lines += [
            f"Each conversation compacted into a quarter of its size (at least 1k); median of {comp['repeat']} runs, "
            f"peak traced memory of one. Headline: {h['tokens']:,} tokens in {h['messages']} messages into 32k: "
            f"{h['ms']:.0f} ms, {h['peak_mib']:.1f} MiB.",
            "",
            "| counter | kind | tokens | budget | final | use | ms | peak MiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, rows in comp["counters"].items():
            for r in rows:
                lines.append(
                    f"| {name} | {r['kind']} | {r['tokens']:,} | {r['budget']:,} | {r['final']:,} | {r['use']:.1%} | "
                    f"{r['ms']:.1f} | {r['peak_mib']:.1f} |"
                )
        if "tokenizer_load_s" in comp:
            lines += ["", f"Loading the SmolLM2 tokenizer from its GGUF: {comp['tokenizer_load_s']:.2f} s (once per process)."]
        if counts := comp.get("backend_counting"):
            lines += [
                "",
                "Fetching llama-server's counts (`/tokenize` per text, template measured once):",
                "",
                "| tokens | distinct texts | first call ms | cached ms |",
                "|---:|---:|---:|---:|",
            ]
            lines += [f"| {c['size']:,} | {c['texts']} | {c['uncached_ms']:.0f} | {c['cached_ms']:.1f} |" for c in counts]
        for name, why in comp["skipped"].items():
            lines.append(f"\nCounter {name} skipped: {why}.")
        lines.append("")
        image("bench-compaction.png")

    use = result["window_use"]
    lines += ["## 3. Window use", ""]
    if not skipped(use):
        lines += [
            f"Final tokens / budget over the sweep's cases that overflowed, goal at least {use['goal']:.0%}.",
            "",
            "| counter/kind | min | mean | max |",
            "|---|---:|---:|---:|",
        ]
        lines += [f"| {k} | {v['min']:.1%} | {v['mean']:.1%} | {v['max']:.1%} |" for k, v in use["by_counter"].items()]
        lines += ["", f"Below the goal: {', '.join(use['below_goal']) or 'none'}.", ""]
        if real := result.get("real_window_use", {}).get("rows"):
            lines += [
                "In real tokens: agent chats compacted into a quarter of their size with the estimate, raw and "
                f"calibrated on five other chats by llama-server's counts (factor {result['real_window_use']['factor']:.2f}), "
                "and with llama-server's per-text counts, "
                "then what was sent counted by llama-server (over 100% would overflow the window):",
                "",
                "| counter | chat tokens | budget | real tokens sent | use |",
                "|---|---:|---:|---:|---:|",
                *(f"| {r['counter']} | {r['tokens']:,} | {r['budget']:,} | {r['real_tokens']:,} | {r['use']:.1%} |" for r in real),
                "",
            ]
        image("bench-window-use.png")
    if (through := result.get("window_use_through", {})).get("rows"):
        lines += [
            "### Real tokens through ContextPaw",
            "",
            "`scripts/bench/measure_window_use.py`: agent chats four times the window sent through ContextPaw to a real "
            "llama-server, and to the Ollama simulator over it (the calibrated estimate); the server's count of what "
            "it was sent over the budget.",
            "",
            measure_window_use.table(through),
            "",
        ]
    if rows := result.get("agent_sessions", {}).get("rows"):
        columns = list(rows[0])
        lines += [
            "### Agent sessions: what the model sees",
            "",
            "`scripts/bench/agent_sessions.py`: Claude Code, Codex, opencode and Qwen Code each read twelve 20-40 KB files, one a "
            "turn, with their own tools, on a scripted model with a 32,768-token window that cuts in silence like "
            "Ollama or refuses like llama-server; direct and through ContextPaw, with and without the model's "
            "tokenizer. Re-eval is the share of each prompt the server evaluates again; least, the share the turn's "
            "new messages take (what any cut must evaluate, set beside the sessions that die direct).",
            "",
            "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns),
            *("| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows),
            "",
        ]
    for loop in result.get("agent_loops", []):
        if table := loop.get("table"):
            lines += [
                f"### Agent loop at -c {table['window']}: reuse per turn against its ceiling",
                "",
                f"{table['turns']} turns; first cut at turn {table['first_compacted_turn']}; after it, reuse "
                f"{pct(table['reuse_mean'])} mean ({pct(table['reuse_worst'])} worst) against a ceiling of "
                f"{pct(table['ceiling_mean'])} ({pct(table['ceiling_worst'])} worst); {table['recut_turns']} re-cut turns.",
                "",
                *(
                    f"- turn {c['turn']}: {pct(c['reuse'])} of {pct(c['ceiling'])}"
                    + (f"; message {c['first_difference']} first differs: {c['why']}" if c.get("why") else "")
                    for c in table["recuts"]
                ),
                "",
                f"![agent loop -c {table['window']}](img/agent-loop-{table['window']}.png)",
                "",
            ]

    loop = result["agent_loop"]
    lines += ["## 4. Prefix-cache reuse in an agent loop", ""]
    if not skipped(loop):
        lines += [
            f"{len(loop['turns'])} turns, SmolLM2-135M on llama-server -c {loop['n_ctx']} -np 1, max_tokens "
            f"{bench_agent_loop.MAX_TOKENS}; per turn `timings.cache_n / (cache_n + prompt_n)`. Baseline: `compact_chat` "
            "without the previous plan, same counter and budget, sent straight to an identical server. Uncut: "
            f"the same turns to a server with -c {loop.get('uncut_ctx', '-')}, nothing cut: what each turn adds "
            "is evaluated on every path, so this is the ceiling. Figures over the turns after ContextPaw's "
            f"first compaction; goals: mean ≥ {loop['goal']:.0%}, no turn under {loop.get('turn_floor', 0.75):.0%}.",
            "",
            f"| path | first compacted turn | turns after | mean cached | min cached | turns ≥ {loop['goal']:.0%} | "
            f"turns < {loop.get('turn_floor', 0.75):.0%} | tokens evaluated | tokens from cache |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for path, s in loop["summary"].items():
            if path == "ceiling":
                after = loop["summary"]["contextpaw"]["turns_after"]
                lines.append(
                    f"| ceiling in this window (ContextPaw's prompt less what the turn adds) | - | {after} | "
                    f"{pct(s['mean_cached'])} | {pct(s['min_cached'])} | {s['turns_at_goal']}/{after} | "
                    f"{s['turns_under_floor']}/{after} | - | - |"
                )
                continue
            lines.append(
                f"| {path} | {s['first_compacted_turn'] or '-'} | {s['turns_after']} | {pct(s['mean_cached'])} | "
                f"{pct(s['min_cached'])} | {s['turns_at_goal']}/{s['turns_after']} | "
                f"{s.get('turns_under_floor', '-')}/{s['turns_after']} | {s['evaluated_tokens']:,} | "
                f"{s['cached_tokens']:,} |"
            )
        paths = [p for p in bench_agent_loop.PATHS if p in loop["turns"][0]]
        lines += [
            "",
            "| turn | budget | " + " | ".join(f"{p} cache_n / prompt_n" for p in paths) + " |",
            "|---:|---:|" + "---:|" * len(paths),
        ]
        for r in loop["turns"]:
            cells = " | ".join(f"{r[p]['cache_n']} / {r[p]['prompt_n']} ({r[p]['cached']:.0%})" for p in paths)
            lines.append(f"| {r['turn']}{'*' if r['contextpaw']['compacted'] else ''} | {r['budget']} | {cells} |")
        lines += ["", "\\* compacted by ContextPaw.", ""]
        image("bench-agent-loop.png")

    rec = result["recall"]
    lines += ["## 5. Recall", ""]
    if not skipped(rec):
        lines += ["| script | path | recalled | exit |", "|---|---|---:|---:|"]
        for name, r in rec.items():
            for path, (k, n) in r["recalled"].items() or [("-", ("-", "-"))]:
                lines.append(f"| {name} | {path} | {k}/{n} | {r['exit']} |")
        for name, r in rec.items():
            if r["table"]:
                lines += ["", f"{name}:", "", *r["table"]]
        lines.append("")
    if health := result.get("loop_health"):
        lines += [
            "## 6. Concurrency, stalls and memory",
            "",
            f"One fake llama-server (window {COMPACTION_CTX:,}); {health['clients']} clients sending small fitting "
            f"chats for {health['seconds']:g} s; a small request every 10 ms while idle and while one "
            f"{health['compaction_tokens']:,}-token, {health['compaction_messages']}-message chat goes through "
            "(compacted by ContextPaw, relayed by bare mitmdump).",
            "",
            "| path | c=8 req/s | worst idle ms | worst during the big request ms | RSS MiB |",
            "|---|---:|---:|---:|---:|",
        ]
        for name in ("mitmdump", "ContextPaw"):
            h = health[name]
            lines.append(
                f"| {name} | {h['c8_req_per_s']:.0f} | {h['worst_idle_ms']:.1f} | {h['worst_during_big_request_ms']:.1f} | {h['rss_mib']:.0f} |"
            )
        lines += ["", f"c=8 ContextPaw vs bare mitmdump: {health['verdict']['c8_vs_mitmdump']:.2f}x (goal 0.9x).", ""]
        lines += [
            "| path | proxy CPU per request at c=8, ms |",
            "|---|---:|",
            *(
                f"| {name} | {health[name].get('cpu_ms_per_request', float('nan')):.2f} |"
                for name in ("mitmdump", "ContextPaw", "ContextPaw, no relay")
                if name in health
            ),
            "",
        ]
        if hooks := health.get("hooks"):
            lines += [
                f"ContextPaw's own time in its hooks, {hooks['requests']} small fitting requests "
                f"(scripts/bench/hook_timing.py): {hooks['total_us']:.0f} µs per request.",
                "",
                "| hook | calls | mean µs |",
                "|---|---:|---:|",
                *(f"| {name} | {h['n']} | {h['mean_us']:.1f} |" for name, h in hooks["by_hook"].items()),
                "",
            ]
        if steps := health.get("rss_by_import"):
            lines += [
                "RSS of a fresh interpreter after each step of imports (before any request):",
                "",
                "| imports | RSS MiB |",
                "|---|---:|",
                *(f"| {r['step']} | {r['rss_mib']:.1f} |" for r in steps),
                "",
            ]
        if handoff := health.get("process_handoff"):
            lines += [
                f"A process for the big compaction instead of the worker thread: pickling the parsed request there and "
                f"back costs {handoff['pickle_request_ms']:.1f} ms and the fitted result {handoff['pickle_result_ms']:.1f} ms, "
                f"against {handoff['parse_ms']:.1f} ms to parse and {handoff['fit_ms']:.1f} ms to fit "
                f"({handoff['body_bytes'] / 1e6:.2f} MB body).",
                "",
            ]
    if scale := result.get("scaling"):
        lines += [
            "## 7. The engine at 1,200 to 10,000 messages",
            "",
            f"{scale['tokens']:,} tokens compacted into {scale['budget']:,} with the estimate; each size's fastest of "
            f"{scale.get('rounds', SCALING_ROUNDS)} runs, the sizes taking turns (the median beside it).",
            "",
            "| messages | ms | median ms | growth per doubling |",
            "|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['messages']:,} | {r['ms']:.0f} | {r.get('median_ms', r['ms']):.0f} | "
            + (f"{r['per_doubling']:.2f}x |" if "per_doubling" in r else "|")
            for r in scale["rows"]
        ]
        lines.append("")
    return "\n".join(lines)


@contextlib.contextmanager
def counting_server(binary: Path | None, model: Path | None, work: Path) -> Iterator[str | None]:
    """A real llama-server to count with, when there is one to start."""
    if binary is None or model is None:
        yield None
        return
    with start_llama_server(binary, model, 2048, work / "llama-count.log") as server:
        yield server.url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-results", help="folder for bench.json, bench.md and img/*.png")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and counts, for a smoke run")
    ap.add_argument("--skip-real", action="store_true", help="skip what needs llama-server (backend counter, loop, recall)")
    ap.add_argument(
        "--agent-loop",
        type=Path,
        nargs="+",
        help="reuse these scripts/bench/bench_agent_loop.py --out JSONs (one per window) instead of running it at 2048 and 8192",
    )
    ap.add_argument("--prefix", type=Path, help="reuse this scripts/bench/bench_prefix.py --out JSON instead of running it")
    ap.add_argument(
        "--agent-sessions", type=Path, help="reuse this scripts/bench/agent_sessions.py --out JSON instead of running the matrix"
    )
    ap.add_argument(
        "--window-use",
        type=Path,
        help="reuse this scripts/bench/measure_window_use.py --out JSON (real-token window use through ContextPaw) instead of running it",
    )
    ap.add_argument("--recall-trials", type=int, default=3, help="--trials for each recall demo (1 with --quick)")
    ap.add_argument("--docs", action="store_true", help="copy the markdown to docs/benchmarks.md and the plots to docs/img/")
    ap.add_argument("--from-json", type=Path, help="write the report of an earlier run's bench.json, measuring nothing")
    ap.add_argument(
        "--reuse",
        type=Path,
        help="an earlier run's bench.json (--docs keeps one in docs/bench.json): the "
        "sections --only does not name are taken from it, and the report says so",
    )
    ap.add_argument(
        "--only", nargs="+", choices=MEASURED, metavar="SECTION", help=f"with --reuse, the sections to measure again: {', '.join(MEASURED)}"
    )
    args = ap.parse_args(argv)
    if args.from_json:
        return report(json.loads(args.from_json.read_text()), args.from_json.parent, args.docs)
    earlier = json.loads(args.reuse.read_text()) if args.reuse else None
    if earlier is None and args.only:
        ap.error("--only needs --reuse: the sections it does not name come from there")
    binary, model = locate_llama_server(), locate_smollm2()
    skip_real = "--skip-real" if args.skip_real else (binary.reason or model.reason or None)
    result: dict[str, Any] = {"machine": machine(binary.path), "quick": args.quick}
    wanted = set(args.only or MEASURED)
    if earlier is not None:
        kept = [name for name in MEASURED if name not in wanted]
        result |= {key: earlier[key] for name in kept for key in MEASURED[name] if key in earlier}
        result["reused"] = {"from": str(args.reuse), "date": earlier["machine"]["date"], "sections": kept}
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="contextpaw-bench-") as tmp, Progress(console=console) as progress:
        work = Path(tmp)
        measure(result, wanted, work, args, binary, model, skip_real, progress)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    return report(result, out, args.docs)


MEASURED = {
    "overhead": ("overhead",),
    "compaction": ("compaction", "real_window_use", "window_use"),
    "agent_loop": ("agent_loops", "agent_loop"),
    "prefix": ("prefix",),
    "window_use_through": ("window_use_through",),
    "recall": ("recall",),
    "loop_health": ("loop_health",),
    "scaling": ("scaling",),
    "agent_sessions": ("agent_sessions",),
}
"""The sections one run measures, by name (as --only takes them), with the keys each writes."""


def measure(result: dict[str, Any], wanted: set[str], work: Path, args: argparse.Namespace, binary: Any, model: Any,
            skip_real: str | None, progress: Progress) -> None:  # fmt: skip
    """Measure the `wanted` sections into `result`, in the order a whole run takes them."""
    if "overhead" in wanted:
        result["overhead"] = overhead(work, args.quick, progress)
    if "compaction" in wanted:
        with counting_server(None if skip_real else binary.path, model.path, work) as llama_url:
            result["compaction"] = compaction(args.quick, model.path, llama_url, progress)
            result["real_window_use"] = (
                asyncio.run(real_window_use(llama_url, REAL_USE_SIZES[:2] if args.quick else REAL_USE_SIZES))
                if llama_url
                else {"skipped": skip_real or "no llama-server"}
            )
        result["window_use"] = window_use(result["compaction"])
    if "agent_loop" in wanted:
        result["agent_loops"] = agent_loops(work, args, binary, model, skip_real, progress)
        result["agent_loop"] = result["agent_loops"][0]
    if "prefix" in wanted:
        result["prefix"] = (
            json.loads(args.prefix.read_text())
            if args.prefix
            else script_json("bench/bench_prefix.py", work / "prefix.json", ["--turns", "40", "--windows", "8192"] if args.quick else [])
        )
    if "window_use_through" in wanted:
        result["window_use_through"] = (
            json.loads(args.window_use.read_text()) if args.window_use else {"skipped": skip_real} if skip_real
            else script_json("bench/measure_window_use.py", work / "window_use.json", ["--quick"] if args.quick else []))  # fmt: skip
    if "recall" in wanted:
        result["recall"] = {"skipped": skip_real} if skip_real else recall(args.quick, args.recall_trials, progress)
    if "loop_health" in wanted:
        result["loop_health"] = loop_health(work, args.quick, progress)
    if "scaling" in wanted:
        result["scaling"] = scaling(args.quick, progress)
    if "agent_sessions" in wanted:
        result["agent_sessions"] = agent_sessions(work, args, skip_real)


def agent_sessions(work: Path, args: argparse.Namespace, skip_real: str | None) -> dict[str, Any]:
    """The real agent CLIs through file-reading sessions on a scripted model that cuts like Ollama
    or refuses like llama-server, direct and through ContextPaw (scripts/bench/agent_sessions.py, issue
    38), or the JSON --agent-sessions names."""
    if args.agent_sessions:
        runs = json.loads(args.agent_sessions.read_text())
    elif skip_real:
        return {"skipped": skip_real}
    else:
        out = work / "agent_sessions.json"
        script_json("bench/agent_sessions.py", out, ["--files", "4"] if args.quick else [])
        if not out.exists():
            return {"skipped": "scripts/bench/agent_sessions.py wrote nothing"}
        runs = json.loads(out.read_text())
    return {"rows": [run["row"] for run in runs]}


def agent_loops(work: Path, args: argparse.Namespace, binary: Any, model: Any, skip_real: str | None,
                progress: Progress) -> list[dict[str, Any]]:  # fmt: skip
    """The agent loop at -c 2048 and 8192 (512 with --quick), or the JSONs --agent-loop names."""
    if args.agent_loop:
        return [json.loads(p.read_text()) | {"reused_from": str(p)} for p in args.agent_loop]
    if skip_real:
        return [{"skipped": skip_real}]
    loops = []
    for n_ctx in (512,) if args.quick else (2048, 8192):
        turns = 4 if args.quick else 30
        task = progress.add_task(f"agent loop -c {n_ctx}", total=turns)
        loops.append(bench_agent_loop.run(binary.path, model.path, work, turns, n_ctx, lambda task=task: progress.advance(task)))
    return loops


def script_json(script: str, out: Path, args: list[str]) -> dict[str, Any]:
    """Run one of the measuring scripts beside this one, and read the JSON it writes."""
    run = subprocess.run([sys.executable, str(SCRIPTS / script), *args, "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    if not out.exists():
        return {"skipped": f"{script} exited {run.returncode}: {run.stderr.strip()[-300:]}"}
    return json.loads(out.read_text())


def report(result: dict[str, Any], out: Path, docs: bool) -> int:
    """Plots and markdown for a result; with `docs`, into docs/benchmarks.md and docs/img/ (the
    README's short table links there)."""
    images = plots(result, out / "img")
    text = markdown(result, images)
    (out / "bench.md").write_text(text)
    console.print("\n".join(goals_table(result)))
    if docs:
        (REPO / "docs" / "img").mkdir(parents=True, exist_ok=True)
        (REPO / "docs" / "benchmarks.md").write_text(text)
        (REPO / "docs" / "bench.json").write_text(json.dumps(result, indent=2))  # what a later --reuse starts from
        readme = REPO / "README.md"
        before, start, rest = readme.read_text().partition(README_START)
        _, end, after = rest.partition(README_END)
        if start and end:
            m = result["machine"]
            made = f"From `scripts/bench/bench.py --docs` on {m['date']} ({m['cpus']} CPUs, Python {m['python']}, mitmproxy {m['mitmproxy']}){reused_note(result)}:"
            readme.write_text(before + start + "\n" + made + "\n\n" + "\n".join(goals_table(result)) + "\n" + end + after)
        for name in images:
            shutil.copy(out / "img" / name, REPO / "docs" / "img" / name)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
