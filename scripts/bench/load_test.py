"""Many agent sessions at once through one mitmdump with ContextPaw, against the fake backends.

    PYTHONPATH=tests .venv/bin/python scripts/bench/load_test.py [--conversations 50] [--turns 20] [--json bench-results/load.json]

Each conversation plants a unique `SECRET=<token>` in its system prompt (and, when it overflows, in
every padding note) and asks for it each turn; the fake model answers with the secret it saw. Every
response must carry its own request's report and its own token, never another's; the evicted content
behind the markers must hold only its own token. Every request is sent to the fake directly and then
through the proxy, so the added latency is measured per request in the same run. Meanwhile a heartbeat
GETs /contextpaw/health every 20 ms (the worst gap between answers is the event-loop stall) and the
mitmdump RSS is sampled. Everything is on 127.0.0.1 and bounded by --deadline seconds.
Exit status: 0 when nothing was lost and there was no cross-talk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[2]

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import ADDON, Backend, free_port, start_module, start_process  # noqa: E402
from support.common import LOOPBACK  # noqa: E402
from support.measure import memory_mib  # noqa: E402

N_CTX = 2048
TOKEN = re.compile(r"c\d+-[0-9a-f]{8}")


@dataclass
class Stats:
    sent: int = 0
    ok: int = 0
    lost: list[str] = field(default_factory=list)
    cross_talk: list[str] = field(default_factory=list)
    compacted: int = 0
    streamed: int = 0
    markers_checked: int = 0
    direct_s: list[float] = field(default_factory=list)
    proxied_s: list[float] = field(default_factory=list)
    added_s: list[float] = field(default_factory=list)
    added_overflowing_s: list[float] = field(default_factory=list)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Conversation:
    def __init__(self, n: int, args: argparse.Namespace) -> None:
        self.n = n
        self.token = f"c{n}-{secrets.token_hex(4)}"
        self.overflowing = args.overflow_every > 0 and n % args.overflow_every == 0
        self.streaming = args.stream_every > 0 and n % args.stream_every == 0
        self.kind = "llamacpp" if n % 2 else "ollama"
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"SECRET={self.token}. You are agent {n}. Answer briefly."},
            {"role": "user", "content": f"Conversation {n} starts."},
        ]
        self.markers: list[str] = []

    def next_request(self, turn: int) -> tuple[str, dict[str, Any]]:
        note = f"Turn {turn} of conversation {n_of(self)}."
        if self.overflowing:
            note += f" Tool output for {self.token}: " + " ".join(f"row{turn}.{i} ok" for i in range(400))
        self.messages.append({"role": "user", "content": note + " What is the SECRET?"})
        if self.kind == "ollama":
            body = {"model": "fake", "messages": self.messages, "stream": self.streaming,
                    "options": {"num_ctx": N_CTX, "num_predict": 16}}  # fmt: skip
            return "/api/chat", body
        body = {"model": "fake", "messages": self.messages, "stream": self.streaming, "max_tokens": 16}
        return "/v1/chat/completions", body


def n_of(conversation: Conversation) -> int:
    return conversation.n


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float) -> tuple[int, bytes, float]:
    started = time.perf_counter()
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        data = await response.read()
        return response.status, data, time.perf_counter() - started


def parse_answer(path: str, streaming: bool, data: bytes) -> tuple[str, dict[str, Any] | None]:
    """The answer's text and the report it carries."""
    text, report = "", None
    if not streaming:
        body = json.loads(data)
        text = body["message"]["content"] if path == "/api/chat" else body["choices"][0]["message"]["content"]
        return text, body.get("contextpaw")
    if path == "/api/chat":
        for line in data.splitlines():
            if line.strip():
                record = json.loads(line)
                text += record.get("message", {}).get("content", "")
                report = record.get("contextpaw", report)
        return text, report
    for event in data.split(b"\n\n"):
        payload = event.strip().removeprefix(b"data: ")
        if not payload or payload == b"[DONE]":
            continue
        record = json.loads(payload)
        for choice in record.get("choices") or []:
            text += (choice.get("delta") or {}).get("content") or ""
        report = record.get("contextpaw", report)
    return text, report


async def converse(
    c: Conversation,
    args: argparse.Namespace,
    urls: dict[str, dict[str, str]],
    session: aiohttp.ClientSession,
    stats: Stats,
    deadline: float,
) -> None:
    for turn in range(args.turns):
        if time.monotonic() > deadline:
            stats.lost.append(f"c{c.n} turn {turn}: deadline")
            continue
        path, body = c.next_request(turn)
        stats.sent += 1
        try:
            _, _, direct = await post(session, urls["direct"][c.kind] + path, body, args.request_timeout)
            status, data, proxied = await post(session, urls["proxy"][c.kind] + path, body, args.request_timeout)
        except (aiohttp.ClientError, TimeoutError) as e:
            stats.lost.append(f"c{c.n} turn {turn}: {type(e).__name__}: {e}")
            continue
        if status != 200:
            stats.lost.append(f"c{c.n} turn {turn}: status {status}: {data[:200]!r}")
            continue
        try:
            text, report = parse_answer(path, c.streaming, data)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            stats.lost.append(f"c{c.n} turn {turn}: unparseable answer ({e}): {data[:200]!r}")
            continue
        if report is None:
            stats.lost.append(f"c{c.n} turn {turn}: no report in the answer")
            continue
        others = {t for t in TOKEN.findall(text) if t != c.token}
        if c.token not in text or others:
            stats.cross_talk.append(f"c{c.n} turn {turn}: answer {text!r}, own token {c.token}")
        stats.ok += 1
        stats.compacted += bool(report.get("compacted"))
        stats.streamed += c.streaming
        c.markers += [r["marker_id"] for r in report.get("removals", []) if r.get("marker_id")]
        stats.direct_s.append(direct)
        stats.proxied_s.append(proxied)
        (stats.added_overflowing_s if report.get("compacted") else stats.added_s).append(proxied - direct)
        c.messages.append({"role": "assistant", "content": text})
    for marker in c.markers[-2:]:
        async with session.get(urls["proxy"][c.kind] + f"/contextpaw/evicted/{marker}") as response:
            content = (await response.read()).decode(errors="replace")
        if response.status == 200:
            stats.markers_checked += 1
            foreign = {t for t in TOKEN.findall(content) if t != c.token}
            if foreign:
                stats.cross_talk.append(f"c{c.n}: evicted {marker} holds {sorted(foreign)[:3]}")


async def heartbeat(url: str, stop: asyncio.Event, gaps: list[float], interval: float = 0.02) -> None:
    async with aiohttp.ClientSession(trust_env=False) as session:
        last = time.perf_counter()
        while not stop.is_set():
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
                    await response.read()
            except (aiohttp.ClientError, TimeoutError):
                pass
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            await asyncio.sleep(interval)


async def sample_rss(pid: int, stop: asyncio.Event, samples: list[tuple[float, float]], started: float) -> None:
    while not stop.is_set():
        samples.append((time.monotonic() - started, memory_mib(pid)))
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def run(args: argparse.Namespace, urls: dict[str, dict[str, str]], pid: int) -> dict[str, Any]:
    stats = Stats()
    conversations = [Conversation(n, args) for n in range(args.conversations)]
    stop = asyncio.Event()
    gaps: list[float] = []
    rss: list[tuple[float, float]] = []
    started = time.monotonic()
    deadline = started + args.deadline
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(trust_env=False, connector=connector) as session:
        # warm up: one request per backend, then RSS starts
        for c in conversations[:2]:
            path, body = Conversation(10**6 + c.n, args).next_request(0)
            await post(session, urls["proxy"][c.kind] + path, body, args.request_timeout)
        rss_start = memory_mib(pid)
        side = [
            asyncio.create_task(heartbeat(urls["proxy"]["ollama"] + "/contextpaw/health", stop, gaps)),
            asyncio.create_task(sample_rss(pid, stop, rss, started)),
        ]
        load_started = time.perf_counter()
        await asyncio.gather(*(converse(c, args, urls, session, stats, deadline) for c in conversations))
        wall = time.perf_counter() - load_started
        stop.set()
        await asyncio.gather(*side)
        async with session.get(urls["proxy"]["ollama"] + "/contextpaw/metrics") as response:
            metrics = (await response.read()).decode()
        async with session.get(urls["proxy"]["ollama"] + "/contextpaw/health") as response:
            proxy_stats = (await response.json())["stats"]
    store = re.search(r"^contextpaw_evicted_store_bytes (\S+)$", metrics, re.M)
    rss_end = memory_mib(pid)
    added_all = stats.added_s + stats.added_overflowing_s
    ms = 1000.0
    return {
        "conversations": args.conversations,
        "turns": args.turns,
        "requests_sent": stats.sent,
        "requests_ok": stats.ok,
        "lost": len(stats.lost),
        "lost_examples": stats.lost[:10],
        "cross_talk": len(stats.cross_talk),
        "cross_talk_examples": stats.cross_talk[:10],
        "compacted": stats.compacted,
        "streamed": stats.streamed,
        "evicted_markers_checked": stats.markers_checked,
        "wall_s": round(wall, 2),
        "throughput_rps": round(stats.ok / wall, 1) if wall else None,
        "note": "each request goes to the fake directly, then through the proxy, so throughput counts proxied requests of a half-proxied load",
        "direct_ms": {"p50": round(pct(stats.direct_s, 0.5) * ms, 2), "p99": round(pct(stats.direct_s, 0.99) * ms, 2)},
        "proxied_ms": {"p50": round(pct(stats.proxied_s, 0.5) * ms, 2), "p99": round(pct(stats.proxied_s, 0.99) * ms, 2)},
        "added_ms": {"p50": round(pct(added_all, 0.5) * ms, 2), "p99": round(pct(added_all, 0.99) * ms, 2)},
        "added_ms_uncompacted": {"p50": round(pct(stats.added_s, 0.5) * ms, 2), "p99": round(pct(stats.added_s, 0.99) * ms, 2)},
        "added_ms_compacted": {
            "p50": round(pct(stats.added_overflowing_s, 0.5) * ms, 2),
            "p99": round(pct(stats.added_overflowing_s, 0.99) * ms, 2),
        },
        "heartbeats": len(gaps),
        "worst_loop_stall_ms": round(max(gaps, default=0.0) * ms, 1),
        "heartbeat_gap_p99_ms": round(pct(gaps, 0.99) * ms, 1) if gaps else None,
        "rss_mib": {"start": round(rss_start, 1), "end": round(rss_end, 1), "max": round(max((r for _, r in rss), default=rss_end), 1)},
        "evicted_store_mib": round(float(store.group(1)) / 2**20, 1) if store else None,
        "proxy_stats": proxy_stats,
        "rss_samples": [(round(t, 1), round(r, 1)) for t, r in rss],
    }


def table(result: dict[str, Any]) -> str:
    rows = [
        ("conversations x turns", f"{result['conversations']} x {result['turns']}"),
        ("requests sent / ok / lost", f"{result['requests_sent']} / {result['requests_ok']} / {result['lost']}"),
        ("cross-talk", str(result["cross_talk"])),
        ("compacted / streamed", f"{result['compacted']} / {result['streamed']}"),
        ("evicted markers checked", str(result["evicted_markers_checked"])),
        ("throughput (proxied req/s)", str(result["throughput_rps"])),
        ("direct p50 / p99 ms", f"{result['direct_ms']['p50']} / {result['direct_ms']['p99']}"),
        ("proxied p50 / p99 ms", f"{result['proxied_ms']['p50']} / {result['proxied_ms']['p99']}"),
        ("added p50 / p99 ms (all)", f"{result['added_ms']['p50']} / {result['added_ms']['p99']}"),
        ("added p50 / p99 ms (not compacted)", f"{result['added_ms_uncompacted']['p50']} / {result['added_ms_uncompacted']['p99']}"),
        ("added p50 / p99 ms (compacted)", f"{result['added_ms_compacted']['p50']} / {result['added_ms_compacted']['p99']}"),
        (
            "worst loop stall ms (heartbeat gap)",
            f"{result['worst_loop_stall_ms']} ({result['heartbeats']} beats, p99 {result['heartbeat_gap_p99_ms']})",
        ),
        ("mitmdump RSS MiB start / end / max", f"{result['rss_mib']['start']} / {result['rss_mib']['end']} / {result['rss_mib']['max']}"),
        ("evicted store MiB (bounded, kept)", str(result["evicted_store_mib"])),
        ("proxy errors / unreachable", f"{result['proxy_stats'].get('errors')} / {result['proxy_stats'].get('unreachable')}"),
        ("wall s", str(result["wall_s"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def start_backends_and_proxy(workdir: Path, slots: int, options: list[str]) -> tuple[list[Backend], dict[str, dict[str, str]], Backend]:
    ollama = start_module("support.fake_ollama", ["--n-ctx", str(N_CTX), "--native"], "/", workdir / "ollama.log")
    llamacpp = start_module("support.fake_llamacpp", ["--n-ctx", str(N_CTX), "--slots", str(slots)], "/health", workdir / "llamacpp.log")
    ports = {"ollama": free_port(), "llamacpp": free_port()}
    argv = [
        sys.executable, "-c", "from mitmproxy.tools.main import mitmdump; mitmdump()", "-q", "-s", str(ADDON),
        "--mode", f"reverse:{ollama.url}@{LOOPBACK}:{ports['ollama']}",
        "--mode", f"reverse:{llamacpp.url}@{LOOPBACK}:{ports['llamacpp']}",
        "--set", f"confdir={workdir / 'conf'}", "--set", "connection_strategy=lazy", "--set", "tcp_timeout=600",
        "--set", f"contextpaw_default_ctx={N_CTX}", "--set", "contextpaw_output_reserve=128",
        *(arg for option in options for arg in ("--set", option)),
    ]  # fmt: skip
    proxy_urls = {k: f"http://{LOOPBACK}:{p}" for k, p in ports.items()}
    proxy = start_process(argv, proxy_urls["ollama"], "/contextpaw/health", workdir / "mitmdump.log", 30)
    urls = {"direct": {"ollama": ollama.url, "llamacpp": llamacpp.url}, "proxy": proxy_urls}
    return [ollama, llamacpp], urls, proxy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=50)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--overflow-every", type=int, default=3, help="every Nth conversation overflows (0: none)")
    p.add_argument("--stream-every", type=int, default=2, help="every Nth conversation streams (0: none)")
    p.add_argument("--slots", type=int, default=8, help="the fake llama-server's parallel slots")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--deadline", type=float, default=600.0, help="seconds for the whole run; later turns count as lost")
    p.add_argument("--json", type=Path, default=REPO / "bench-results" / "load.json")
    p.add_argument("--workdir", type=Path, default=None, help="logs and mitmproxy confdir (default: a temp dir)")
    p.add_argument(
        "--set",
        dest="options",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a mitmproxy option for the proxy, e.g. contextpaw_evicted_mb=16 (repeatable)",
    )
    args = p.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="contextpaw-load-"))
    backends, urls, proxy = start_backends_and_proxy(workdir, args.slots, args.options)
    try:
        result = asyncio.run(run(args, urls, proxy.process.pid))
    finally:
        proxy.stop()
        for backend in backends:
            backend.stop()
    result["logs"] = str(workdir)
    print(table(result))
    for line in result["lost_examples"] + result["cross_talk_examples"]:
        print("  !", line)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.json}")
    return 0 if result["lost"] == 0 and result["cross_talk"] == 0 and result["requests_ok"] == result["requests_sent"] else 1


if __name__ == "__main__":
    os.environ.setdefault("NO_PROXY", "127.0.0.1")
    sys.exit(main())
