"""7. The engine at 1,200 to 10,000 messages."""

from __future__ import annotations

import statistics
import time
from typing import Any

import bench_compact
from rich.progress import Progress

from contextpaw.core.conversation import Conversation
from contextpaw.core.tokens import EstimateCounter

SCALING_ROUNDS = 7
"""Interleaved runs of each size in the engine's scaling row."""


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
