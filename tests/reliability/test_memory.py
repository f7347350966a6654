"""Memory returns (the probe's N8): after a flow with a big body (as it came in, before the fit
shrank it), once the flow is let go of, the garbage it left is collected and the pages malloc kept
are handed back to the system, once for a burst, off the event loop; malloc's arenas are capped at
start.

RSS over three fuzz passes is measured in scripts/measure/measure_hardening.py (N8 row), not here.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest
from mitmproxy.test import tflow, tutils

from contextpaw.proxy import heap


class FakeLibc:
    def __init__(self, calls: list[str] | None = None) -> None:
        self.trims: list[str] = []
        self.options: list[tuple[int, int]] = []
        self.calls = calls if calls is not None else []

    def malloc_trim(self, pad: int) -> int:
        self.trims.append(threading.current_thread().name)
        self.calls.append("trim")
        return 1

    def mallopt(self, parameter: int, value: int) -> int:
        self.options.append((parameter, value))
        return 1


def flow_with(request_bytes: int, answer_bytes: int = 0, *, streamed: bool = False) -> tflow.tflow:
    flow = tflow.tflow(req=tutils.treq(content=b"x" * request_bytes), resp=tutils.tresp(content=b"y" * answer_bytes))
    flow.response.stream = streamed
    return flow


@pytest.fixture(autouse=True)
def settle_at_once(monkeypatch) -> None:
    monkeypatch.setattr(heap, "SETTLE_S", 0.01)


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
    for flow in (flow_with(1000, 1000), flow_with(1000)):
        memory.request(flow)
        memory.response(flow)
    assert memory.trimming is None and libc.trims == []


async def test_a_request_that_came_in_big_is_followed_by_a_trim_though_the_fit_shrank_it() -> None:
    """The fit replaces a big body with the compacted one before the answer comes: what is judged
    is what came in (what the fuzz pass sends is all shrunk to a 1,024-token window)."""
    libc = FakeLibc()
    memory = heap.ReturnedMemory(libc)
    flow = flow_with(heap.BIG_BYTES)
    memory.request(flow)
    flow.request.content = b"compacted"
    memory.response(flow)
    await settled(memory)
    assert len(libc.trims) == 1


async def test_an_encoded_request_that_may_inflate_big_is_followed_by_a_trim() -> None:
    libc = FakeLibc()
    memory = heap.ReturnedMemory(libc)
    flow = flow_with(heap.BIG_ENCODED_BYTES)
    flow.request.headers["Content-Encoding"] = "gzip"
    memory.request(flow)
    memory.error(flow)
    await settled(memory)
    assert len(libc.trims) == 1


async def test_the_garbage_a_big_flow_left_is_collected_before_the_trim() -> None:
    """mitmproxy's flows sit in reference cycles: their bodies are freed by the collector's full
    pass, which must come before the trim for the trim to hand them back."""

    class Cycle:
        pass

    calls: list[str] = []
    left = Cycle()
    left.me, left.body = left, b"z" * heap.BIG_BYTES
    dead = weakref.ref(left)
    del left
    libc = FakeLibc(calls)
    alive_at_trim: list[bool] = []
    libc.malloc_trim = lambda pad: alive_at_trim.append(dead() is not None) or calls.append("trim")  # type: ignore[method-assign]

    def collect() -> int:
        calls.append("collect")
        return gc.collect()

    enabled = gc.isenabled()
    gc.disable()  # no automatic pass meanwhile: only the one before the trim frees the cycle
    try:
        memory = heap.ReturnedMemory(libc, collect=collect)
        memory.response(flow_with(heap.BIG_BYTES))
        await settled(memory)
    finally:
        if enabled:
            gc.enable()
    assert calls == ["collect", "trim"] and alive_at_trim == [False]


async def test_the_trim_waits_until_the_flow_is_let_go_of(monkeypatch) -> None:
    """The flow's last hook runs while mitmproxy still holds the flow and its bodies."""
    monkeypatch.setattr(heap, "SETTLE_S", 3600)
    libc = FakeLibc()
    memory = heap.ReturnedMemory(libc)
    memory.response(flow_with(heap.BIG_BYTES))
    for _ in range(5):
        await asyncio.sleep(0.01)
    assert libc.trims == [] and memory.trimming is not None and not memory.trimming.done()
    memory.trimming.cancel()
    with pytest.raises(asyncio.CancelledError):
        await memory.trimming


async def test_a_burst_of_big_flows_is_one_trim_and_one_after_it(monkeypatch) -> None:
    monkeypatch.setattr(heap, "TRIM_EVERY_S", 0.2)
    libc = FakeLibc()
    memory = heap.ReturnedMemory(libc)
    memory.response(flow_with(heap.BIG_BYTES))
    while not libc.trims:  # the first trim ran; the rest of the burst comes within TRIM_EVERY_S
        await asyncio.sleep(0.005)
    for _ in range(20):
        memory.error(flow_with(heap.BIG_BYTES))
    await settled(memory)
    assert len(libc.trims) == 2
