"""8. Others under pressure, beside bare mitmdump in the same run (issue 44): what a small-request client
waits while N overflowing Ollama /api/chat requests of 1-8 MB arrive at once (its worst and p99, the
burst's wall time, the proxy's peak RSS and CPU), and while one 300 MB buffered answer passes.

The small client goes through a second listener of the same proxy to a backend of its own, so what it
waits for is the proxy, not a backend the burst keeps busy. The burst and the big answer are sent from
a process of their own: sending and reading hundreds of MB in this one would hold the interpreter the
small client's thread times itself with. The paths take turns (bare, ContextPaw, then the other way).
The fake Ollama reads at most 1 MiB of a body (aiohttp's limit) and answers a bigger one 413: on the
bare path the backend does next to nothing, so the floor is mitmdump's relaying alone.
"""

from __future__ import annotations

import asyncio
import collections
import json
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import aiohttp
import httpx
from rich.progress import Progress

from sections.common import Pinger
from sections.stage import NAMES, Stage, turns

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import Backend
from support.measure import PeakMemory, cpu_seconds, memory_mib

MB = 1 << 20
BURST_CTX = 8192
"""Each burst request's `options.num_ctx`: every one of them overflows it many times over."""
ROUTE = "/v1/chat/completions"


def burst_bodies(n: int, low_mb: float, high_mb: float, seed: int = 44) -> list[bytes]:
    """`n` agent chats from `low_mb` to `high_mb` (evenly spread, in a seeded order), each message its
    own (a request and message number before a 4 KB block of words: the last few fit the window, so
    each is compacted, not refused), for Ollama's /api/chat."""
    rng = random.Random(seed)
    sizes = [int((low_mb + (high_mb - low_mb) * k / max(n - 1, 1)) * MB) for k in range(n)]
    rng.shuffle(sizes)
    block = " ".join(f"w{rng.randint(0, 99_999)}" for _ in range(600))
    bodies = []
    for i, size in enumerate(sizes):
        messages = [{"role": "system", "content": "You are a coding agent. Read the files and answer."}]
        while sum(len(m["content"]) for m in messages) < size:
            j = len(messages)
            messages.append({"role": ("user", "assistant")[j % 2], "content": f"request {i} message {j}: {block}"})
        messages.append({"role": "user", "content": f"Request {i}: what next?"})
        body = {"model": "fake", "messages": messages, "stream": False, "options": {"num_ctx": BURST_CTX, "num_predict": 8}}
        bodies.append(json.dumps(body).encode())
    return bodies


async def send_all(url: str, bodies: list[bytes]) -> dict[str, Any]:
    """Every body POSTed at once; the wall time until the last answer, and the statuses."""

    said: dict[str, str] = {}

    async def one(session: aiohttp.ClientSession, body: bytes) -> tuple[str, float]:
        started = time.perf_counter()
        try:
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as reply:
                answer = await reply.read()
                if reply.status >= 500:  # what a failure said, once per status
                    said.setdefault(str(reply.status), answer[:300].decode(errors="replace"))
                return str(reply.status), time.perf_counter() - started
        except (aiohttp.ClientError, TimeoutError) as e:
            said.setdefault(type(e).__name__, str(e)[:300])
            return type(e).__name__, time.perf_counter() - started

    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(trust_env=False, timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        started = time.perf_counter()
        answers = await asyncio.gather(*(one(session, body) for body in bodies))
        wall = time.perf_counter() - started
    statuses = dict(collections.Counter(s for s, _ in answers))
    return {"wall_s": wall, "statuses": statuses, "slowest_s": max(t for _, t in answers), "failures_said": said}


def burst_child(conn: Connection, url: str, n: int, low_mb: float, high_mb: float) -> None:
    """In a process of its own: make the bodies, say their size, wait for the word, send them all."""
    bodies = burst_bodies(n, low_mb, high_mb)
    conn.send(sum(map(len, bodies)))
    conn.recv()
    conn.send(asyncio.run(send_all(url + "/api/chat", bodies)))


def answer_child(conn: Connection, url: str) -> None:
    """In a process of its own: ask for the big buffered answer and read it whole."""
    conn.send(0)
    conn.recv()
    started = time.perf_counter()
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    reply = httpx.post(url + ROUTE, json=chat, headers={"X-Attack": "big-answer"}, timeout=900, trust_env=False)
    conn.send({"wall_s": time.perf_counter() - started, "statuses": {str(reply.status_code): 1}, "answer_bytes": len(reply.content)})


def beside_small_client(target: Callable[..., None], args: tuple[Any, ...], proxy: Backend, ping_url: str) -> dict[str, Any]:
    """Run `target` (burst_child or answer_child) in a spawned process, with the small client timing
    itself from just before the word to go until just after the last answer; the proxy's peak RSS and
    CPU seconds meanwhile."""
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    child = spawn.Process(target=target, args=(theirs, *args))
    child.start()
    try:
        sent = ours.recv()
        pid = proxy.process.pid
        before_rss, before_cpu = memory_mib(pid), cpu_seconds(pid)
        with PeakMemory(pid) as memory, Pinger(ping_url) as pinger:
            ours.send("go")
            told = ours.recv()
        cpu = cpu_seconds(pid) - before_cpu
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    return told | pinger.summary() | {"body_bytes": sent, "rss_before_mib": before_rss, "peak_rss_mib": memory.peak_mib, "proxy_cpu_s": cpu}


def summarized(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One path's runs: the median of each figure (the runs kept beside it)."""
    keys = ("worst_ms", "p99_ms", "wall_s", "peak_rss_mib", "proxy_cpu_s")
    return {key: statistics.median(r[key] for r in runs) for key in keys} | {"runs": runs}


def burst(stage: Stage, quick: bool, n: int | None, progress: Progress) -> dict[str, Any]:
    """N overflowing /api/chat requests of 1-8 MB at once (4 of 1.1-1.6 MB with --quick) beside the
    small client, bare mitmdump and ContextPaw taking turns."""
    n = n or (4 if quick else 64)
    low, high = (1.1, 1.6) if quick else (1.0, 8.0)
    rounds = 1 if quick else 2
    task = progress.add_task("burst beside a small client", total=rounds * len(NAMES))
    result: dict[str, Any] = {"requests": n, "low_mb": low, "high_mb": high, "num_ctx": BURST_CTX, "rounds": rounds}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in NAMES}
    before = paw_stats(stage)
    for name in turns(rounds):
        ping_url, burst_url = stage.url(name, "llamacpp"), stage.url(name, "ollama")
        runs[name].append(beside_small_client(burst_child, (burst_url, n, low, high), stage.process(name), ping_url))
        progress.advance(task)
    after = paw_stats(stage)
    result["contextpaw_stats"] = {k: after[k] - before[k] for k in ("requests", "compacted", "refused", "errors", "too_large")}
    result["body_mb"] = runs["ContextPaw"][0]["body_bytes"] / MB
    return result | {name: summarized(runs[name]) for name in NAMES}


def paw_stats(stage: Stage) -> dict[str, int]:
    """ContextPaw's counts so far (/contextpaw/health)."""
    health = httpx.get(stage.url("ContextPaw", "llamacpp") + "/contextpaw/health", timeout=30, trust_env=False).json()
    return {k: v or 0 for k, v in health["stats"].items() if isinstance(v, int | float)}


def big_answer(stage: Stage, quick: bool, progress: Progress) -> dict[str, Any]:
    """One buffered (not streamed) JSON answer of 300 MB (20 with --quick) beside the small client,
    bare mitmdump and ContextPaw taking turns; the backend is scripts/measure/measure_hardening.py's
    (its N4 row)."""
    rounds = 1 if quick else 2
    task = progress.add_task("big answer beside a small client", total=rounds * len(NAMES))
    result: dict[str, Any] = {"answer_mb": stage.answer_mb, "rounds": rounds}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in NAMES}
    for name in turns(rounds):
        ping_url, big_url = stage.url(name, "llamacpp"), stage.url(name, "hardening")
        runs[name].append(beside_small_client(answer_child, (big_url,), stage.process(name), ping_url))
        progress.advance(task)
    return result | {name: summarized(runs[name]) for name in NAMES}


def ratio_verdict(ours: float, bare: float, why: str) -> str:
    return "met" if ours <= 1.5 * bare else f"not met: {ours / bare:.1f}x; {why}"


def goals(result: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """The goals-table rows of the burst and the big answer: the small client's worst (and, for the
    burst, p99) latency at most 1.5x bare mitmdump's; the reason where not, by the proxy's CPU meanwhile."""
    rows = []
    if b := result.get("burst"):
        bare, paw = b["mitmdump"], b["ContextPaw"]
        cells = [
            f"worst {r['worst_ms']:,.0f} ms, p99 {r['p99_ms']:,.0f} ms; burst wall {r['wall_s']:.1f} s, peak RSS {r['peak_rss_mib']:,.0f} MiB"
            for r in (bare, paw)
        ]
        why = (
            f"the proxy's CPU during the burst {paw['proxy_cpu_s']:.1f} s against {bare['proxy_cpu_s']:.1f} s "
            f"(parsing and fitting {b['requests']} bodies, {b['body_mb']:.0f} MB, on the interpreter that relays the small client's); "
            f"p99 {paw['p99_ms'] / bare['p99_ms']:.1f}x"
        )
        ok = paw["worst_ms"] <= 1.5 * bare["worst_ms"] and paw["p99_ms"] <= 1.5 * bare["p99_ms"]
        rows.append(
            (
                f"others' worst and p99 latency while {b['requests']} overflowing /api/chat requests of "
                f"{b['low_mb']:g}-{b['high_mb']:g} MB arrive at once",
                *cells,
                "≤ 1.5x bare",
                "met" if ok else f"not met: worst {paw['worst_ms'] / bare['worst_ms']:.1f}x; {why}",
            )
        )
    if a := result.get("big_answer"):
        bare, paw = a["mitmdump"], a["ContextPaw"]
        why = f"the proxy's CPU while it passed {paw['proxy_cpu_s']:.1f} s against {bare['proxy_cpu_s']:.1f} s"
        rows.append(
            (
                f"others' worst latency while one {a['answer_mb']:.0f} MB buffered answer passes",
                f"{bare['worst_ms']:,.0f} ms",
                f"{paw['worst_ms']:,.0f} ms",
                "≤ 1.5x bare",
                ratio_verdict(paw["worst_ms"], bare["worst_ms"], why),
            )
        )
    return rows


def markdown(result: dict[str, Any]) -> list[str]:
    lines = ["## 8. Others under pressure", ""]
    header = ["| path | worst ms | p99 ms | wall s | peak RSS MiB | proxy CPU s | statuses |", "|---|---:|---:|---:|---:|---:|---|"]

    def row(name: str, s: dict[str, Any]) -> str:
        statuses = "; ".join(", ".join(f"{k}: {v}" for k, v in r["statuses"].items()) for r in s["runs"])
        return (
            f"| {name} | {s['worst_ms']:,.0f} | {s['p99_ms']:,.0f} | {s['wall_s']:.1f} | {s['peak_rss_mib']:,.0f} | "
            f"{s['proxy_cpu_s']:.1f} | {statuses} |"
        )

    if b := result.get("burst"):
        lines += [
            f"{b['requests']} overflowing Ollama /api/chat requests of {b['low_mb']:g}-{b['high_mb']:g} MB ({b['body_mb']:.0f} MB "
            f"in all, `num_ctx` {b['num_ctx']:,}) sent at once, while a small client sends a fitting chat every 10 ms "
            "through another listener of the same proxy to a backend of its own; medians of "
            f"{b['rounds']} rounds in which the paths take turns. The fake Ollama answers a body over 1 MiB 413 "
            "unread, so bare mitmdump's backend does next to nothing.",
            "",
            *header,
            *(row(name, b[name]) for name in NAMES),
            "",
            f"ContextPaw's counts over the {b['rounds']} rounds (the small client's requests too): "
            f"{', '.join(f'{k} {v}' for k, v in (b.get('contextpaw_stats') or {}).items())}.",
            *(
                f"{name}'s failed answers said: " + "; ".join(f"{status}: {text!r}" for status, text in said.items()) + "."
                for name in NAMES
                if (said := {k: v for r in b[name]["runs"] for k, v in r.get("failures_said", {}).items()})
            ),
            "",
        ]
    if a := result.get("big_answer"):
        lines += [
            f"One buffered (not streamed) JSON answer of {a['answer_mb']:.0f} MB from scripts/measure/measure_hardening.py's "
            "backend, read by a process of its own, beside the same small client.",
            "",
            *header,
            *(row(name, a[name]) for name in NAMES),
            "",
        ]
    return lines
