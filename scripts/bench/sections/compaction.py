"""2./3. Compaction cost and window use, per counter."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import bench_compact
from rich.progress import Progress

from contextpaw.calls.server_counts import BackendCounter, LlamaCppCounting
from contextpaw.core.conversation import Conversation
from contextpaw.core.tokens import Counter, EstimateCounter, TokenizerCounter
from contextpaw.fitting.calibration import CalibratedCounter

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import start_llama_server

CALIBRATION_FACTOR = 1.1
"""A typical learned factor; the calibrated counter costs the same whatever its value."""
WINDOW_GOAL = 0.95


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


@contextlib.contextmanager
def counting_server(binary: Path | None, model: Path | None, work: Path) -> Iterator[str | None]:
    """A real llama-server to count with, when there is one to start."""
    if binary is None or model is None:
        yield None
        return
    with start_llama_server(binary, model, 2048, work / "llama-count.log") as server:
        yield server.url
