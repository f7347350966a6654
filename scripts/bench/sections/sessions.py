"""10. Many sessions, nothing overflowing, beside bare mitmdump in the same run (issue 44): 50
conversations of 20 turns at once (scripts/bench/load_test.py's conversations: half on the fake
Ollama's /api/chat, half on the fake llama-server, every other one streamed), sent only through the
proxy; requests per second, the proxy's CPU per request, and whether every answer carried its own
conversation's secret. The paths take turns, three rounds (one with --quick), through the proxies
of stage.py."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import aiohttp
import load_test
from rich.progress import Progress

from sections.stage import NAMES, Stage, turns

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.measure import cpu_seconds


async def converse_all(urls: dict[str, str], conversations: int, turns_each: int) -> dict[str, Any]:
    """Every conversation at once, each turn after the last one's answer; wall time and what failed."""
    args = argparse.Namespace(overflow_every=0, stream_every=2, turns=turns_each)
    talks = [load_test.Conversation(n, args) for n in range(conversations)]
    failed: list[str] = []

    async def converse(c: load_test.Conversation, session: aiohttp.ClientSession) -> int:
        done = 0
        for turn in range(turns_each):
            path, body = c.next_request(turn)
            try:
                status, data, _ = await load_test.post(session, urls[c.kind] + path, body, 120)
                text, _ = load_test.parse_answer(path, c.streaming, data) if status == 200 else ("", None)
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
                failed.append(f"c{c.n} turn {turn}: {type(e).__name__}")
                continue
            if status != 200 or c.token not in text:
                failed.append(f"c{c.n} turn {turn}: status {status}, answer {text[:60]!r}")
                continue
            c.messages.append({"role": "assistant", "content": text})
            done += 1
        return done

    async with aiohttp.ClientSession(trust_env=False, connector=aiohttp.TCPConnector(limit=0)) as session:
        started = time.perf_counter()
        answered = sum(await asyncio.gather(*(converse(c, session) for c in talks)))
        wall = time.perf_counter() - started
    return {"answered": answered, "wall_s": wall, "req_per_s": answered / wall, "failed": len(failed), "failed_examples": failed[:5]}


def sessions(stage: Stage, quick: bool, progress: Progress) -> dict[str, Any]:
    conversations, turns_each, rounds = (6, 4, 1) if quick else (50, 20, 3)
    task = progress.add_task("sessions, nothing overflowing", total=rounds * len(NAMES))
    result: dict[str, Any] = {"conversations": conversations, "turns": turns_each, "rounds": rounds}
    urls = {name: {kind: stage.url(name, kind) for kind in ("llamacpp", "ollama")} for name in NAMES}
    for name in NAMES:  # warm up: connections, and ContextPaw's look at each backend's window
        asyncio.run(converse_all(urls[name], 2, 2))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in NAMES}
    for name in turns(rounds):
        pid = stage.process(name).process.pid
        before = cpu_seconds(pid)
        run = asyncio.run(converse_all(urls[name], conversations, turns_each))
        run["cpu_ms_per_request"] = (cpu_seconds(pid) - before) * 1000 / max(run["answered"], 1)
        runs[name].append(run)
        progress.advance(task)
    for name in NAMES:
        result[name] = {
            "req_per_s": statistics.median(r["req_per_s"] for r in runs[name]),
            "cpu_ms_per_request": statistics.median(r["cpu_ms_per_request"] for r in runs[name]),
            "failed": sum(r["failed"] for r in runs[name]),
            "runs": runs[name],
        }
    return result


def goals(s: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """The goals-table row: ContextPaw's requests per second at least 0.9x bare mitmdump's."""
    bare, paw = s["mitmdump"], s["ContextPaw"]
    ratio = paw["req_per_s"] / bare["req_per_s"]
    why = (
        f"not met: the proxy's CPU a request {paw['cpu_ms_per_request']:.2f} ms against {bare['cpu_ms_per_request']:.2f} ms "
        f"({paw['cpu_ms_per_request'] / bare['cpu_ms_per_request']:.2f}x; the client and the fakes share the 2 cores)"
    )
    failed = f"; {paw['failed']} answers failed or lacked their secret" if paw["failed"] or bare["failed"] else ""
    return [
        (
            f"{s['conversations']} sessions x {s['turns']} turns, nothing overflowing",
            f"{bare['req_per_s']:.0f} req/s",
            f"{paw['req_per_s']:.0f} req/s ({ratio:.2f}x)",
            "≥ 0.9x",
            ("met" if ratio >= 0.9 else why) + failed,
        )
    ]


def markdown(s: dict[str, Any]) -> list[str]:
    return [
        "## 10. Many sessions, nothing overflowing",
        "",
        f"{s['conversations']} conversations of {s['turns']} turns at once through the proxy (scripts/bench/load_test.py's: "
        "half Ollama /api/chat, half llama-server, every other one streamed); "
        f"{s['rounds']} rounds in which the paths take turns, medians.",
        "",
        "| path | req/s | proxy CPU ms a request | failed | req/s per round |",
        "|---|---:|---:|---:|---|",
        *(
            f"| {name} | {s[name]['req_per_s']:.0f} | {s[name]['cpu_ms_per_request']:.2f} | {s[name]['failed']} | "
            + ", ".join(f"{r['req_per_s']:.0f}" for r in s[name]["runs"])
            + " |"
            for name in NAMES
        ),
        "",
    ]
