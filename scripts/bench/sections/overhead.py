"""1. Proxy overhead: the same requests direct, through bare mitmdump and through ContextPaw."""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from rich.progress import Progress

from sections.common import chat_bytes, filler_text, latency, mitmdump, percentiles

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import start_module

PATHS = ("direct", "mitmdump", "ContextPaw", "ContextPaw, no relay")
"""The last one runs with contextpaw_relay=false: what the relay (answers for failing backends) costs."""
STREAMING = "mitmdump, streaming"
"""Bare mitmdump with stream_large_bodies=1: it buffers nothing, the floor for a stream's first byte."""
STREAM_PATHS = (*PATHS, STREAMING)
BIG_CTX = 1_000_000
"""The fake's and the proxy's window for the overhead runs: a 1 MB body fits, nothing is compacted."""
OVERHEAD_GOAL = 0.10


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
