"""Memory returns (the probe's N8): after a flow with a big body, the pages malloc kept are handed
back to the system, once for a burst, off the event loop; malloc's arenas are capped at start.

RSS over three fuzz passes is measured in scripts/measure_hardening.py (N8 row), not here.
"""

from __future__ import annotations

import asyncio
import threading

from mitmproxy.test import tflow, tutils

from contextpaw import heap


class FakeLibc:
    def __init__(self) -> None:
        self.trims: list[str] = []
        self.options: list[tuple[int, int]] = []

    def malloc_trim(self, pad: int) -> int:
        self.trims.append(threading.current_thread().name)
        return 1

    def mallopt(self, parameter: int, value: int) -> int:
        self.options.append((parameter, value))
        return 1


def flow_with(request_bytes: int, answer_bytes: int = 0, *, streamed: bool = False) -> tflow.tflow:
    flow = tflow.tflow(req=tutils.treq(content=b"x" * request_bytes), resp=tutils.tresp(content=b"y" * answer_bytes))
    flow.response.stream = streamed
    return flow


async def settled(memory: heap.ReturnedMemory) -> None:
    while memory.trimming is not None:
        await asyncio.sleep(0.01)


def test_the_arenas_are_capped_at_start() -> None:
    libc = FakeLibc()
    heap.ReturnedMemory(libc)
    assert libc.options == [(heap.M_ARENA_MAX, heap.ARENAS)]


async def test_a_flow_with_a_big_body_is_followed_by_a_trim_in_a_worker_thread(monkeypatch) -> None:
    monkeypatch.setattr(heap, "TRIM_EVERY_S", 0.01)
    for flow in (flow_with(heap.BIG_BYTES), flow_with(10, heap.BIG_BYTES), flow_with(10, streamed=True)):
        libc = FakeLibc()
        memory = heap.ReturnedMemory(libc)
        memory.response(flow)
        await settled(memory)
        assert len(libc.trims) == 1 and libc.trims[0] != threading.current_thread().name


async def test_small_flows_are_not_followed_by_a_trim() -> None:
    libc = FakeLibc()
    memory = heap.ReturnedMemory(libc)
    memory.response(flow_with(1000, 1000))
    memory.error(flow_with(1000))
    assert memory.trimming is None and libc.trims == []


async def test_a_burst_of_big_flows_is_one_trim_and_one_after_it(monkeypatch) -> None:
    monkeypatch.setattr(heap, "TRIM_EVERY_S", 0.2)
    libc = FakeLibc()
    memory = heap.ReturnedMemory(libc)
    memory.response(flow_with(heap.BIG_BYTES))
    await asyncio.sleep(0.05)  # the first trim ran; the rest of the burst comes within TRIM_EVERY_S
    for _ in range(20):
        memory.error(flow_with(heap.BIG_BYTES))
    await settled(memory)
    assert len(libc.trims) == 2
