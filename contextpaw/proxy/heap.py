"""The process's memory for a long-lived proxy: the garbage collector's full passes kept off the
event loop's critical path, and what big requests used given back to the system.

A full collection walks every object the process holds, and at start-up mitmproxy, aiohttp and
tokenizers leave about 100,000 of them that live as long as the process: on a 2-CPU machine one
such pass took 68 ms, a stall every client saw now and then. Frozen once mitmproxy is running, they
are skipped by every later collection (0.01 ms for the same pass); what requests allocate is still
collected as before.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import math
import platform
import time
import weakref
from collections.abc import Callable
from typing import Any

from mitmproxy import http

from contextpaw.core import logs

logger = logs.get(__name__)


class StartupHeap:
    """Freezes what start-up made (`gc.freeze`), once per process, when mitmproxy runs (a reloaded
    script does not freeze again: what the old one left is garbage to collect, not start-up)."""

    def running(self) -> None:
        global _frozen
        if _frozen:
            return
        _frozen = True
        gc.collect()
        gc.freeze()
        logger.debug("%d objects made at start-up are left out of garbage collection", gc.get_freeze_count())


_frozen = False


ARENAS = 2
"""glibc's malloc arenas: by default up to 8 per CPU, one for each thread that met contention. The
worker threads that parse big bodies each left their own partly-free arenas behind, and RSS grew
100-130 MiB per fuzz pass while the live heap stayed at 25 MiB (with two: 95, 444, 454 MiB over three)."""
BIG_BYTES = 1 << 20
"""A flow whose request or answer carried at least this much leaves memory worth giving back."""
BIG_ENCODED_BYTES = 64 << 10
"""An encoded (gzip, zstd...) request this size may inflate past BIG_BYTES."""
SETTLE_S = 1.0
"""How long after a big flow's last hook its trim waits: mitmproxy lets go of the flow once the
answer is sent, not in the hook."""
TRIM_EVERY_S = 5.0
"""At most one trim this often: it walks every arena, and a burst of big requests needs only one."""


class ReturnedMemory:
    """Gives the memory big requests used back to the system (glibc only; elsewhere it does nothing).

    A flow's bodies are not freed when it ends: mitmproxy's flows sit in reference cycles (so does
    the state ContextPaw keeps for each, weakly keyed by the flow), and only the collector's full
    pass frees them, which may come many flows later. Measured after a fuzz pass of 200 bodies (the
    probe's N8), 69 MiB of ContextPaw's 317 MiB in use was such garbage, 17-33 MiB of a bare
    mitmdump's. And what is freed stays resident unless the top of the heap is free: what is left
    between live blocks (the evicted store's) stays in RSS, 114 -> 270 MiB of free pages over two
    passes, which `malloc_trim(0)` hands back (madvise).

    So a flow that carried a big body (judged by what came in, before the fit shrinks it) is
    followed, SETTLE_S after its last hook and at most every TRIM_EVERY_S, by a full collection
    (cheap: start-up is frozen, see StartupHeap) and `malloc_trim(0)` in a worker thread (ctypes
    lets go of the GIL).
    """

    def __init__(self, libc: Any = None, collect: Callable[[], int] = gc.collect) -> None:
        """`libc`: what has glibc's `malloc_trim` and `mallopt` (default: this process's glibc, if
        any); `collect`: the collector's full pass."""
        self.libc = libc or _glibc()
        self.collect = collect
        self.due = False
        self.trimming: asyncio.Task[None] | None = None
        self.trimmed_at = -math.inf
        self._big: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
        """Flows whose request came in big (the fit may have made it small since)."""
        if self.libc is not None:
            self.libc.mallopt(M_ARENA_MAX, ARENAS)

    def request(self, flow: http.HTTPFlow) -> None:
        """Before the fit replaces the body: whether what came in was big."""
        if self.libc is not None and _big_request(flow):
            self._big.add(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        self._after(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._after(flow)

    def _after(self, flow: http.HTTPFlow) -> None:
        if self.libc is None:
            return
        came_big = flow in self._big
        self._big.discard(flow)
        if not came_big and not _big(flow):
            return
        self.due = True
        if self.trimming is None:
            self.trimming = asyncio.get_running_loop().create_task(self._trim())

    async def _trim(self) -> None:
        assert self.libc is not None
        try:
            while self.due:
                self.due = False  # a flow that ends from now on is trimmed after this one
                await asyncio.sleep(max(SETTLE_S, self.trimmed_at + TRIM_EVERY_S - time.monotonic()))
                started = time.perf_counter()
                found = self.collect()
                collected = time.perf_counter()
                await asyncio.to_thread(self.libc.malloc_trim, 0)
                self.trimmed_at = time.monotonic()
                logger.debug(
                    "%d objects collected in %.1f ms, memory trimmed in %.1f ms",
                    found,
                    (collected - started) * 1000,
                    (time.perf_counter() - collected) * 1000,
                )
        finally:
            self.trimming = None


M_ARENA_MAX = -8
"""mallopt's parameter for the arena limit (glibc's malloc.h)."""


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    libc.malloc_trim.argtypes, libc.mallopt.argtypes = [ctypes.c_size_t], [ctypes.c_int, ctypes.c_int]
    return libc


def _big_request(flow: http.HTTPFlow) -> bool:
    """Whether the request came in big, or encoded and big enough to inflate past BIG_BYTES."""
    size = len(flow.request.raw_content or b"")
    return size >= (BIG_ENCODED_BYTES if flow.request.headers.get("content-encoding") else BIG_BYTES)


def _big(flow: http.HTTPFlow) -> bool:
    """Whether the flow carries a big body at its end; a streamed answer counts, its size unknown here."""
    response = flow.response
    sizes = [len(flow.request.raw_content or b"")]
    if response is not None:
        if response.stream:
            return True
        sizes.append(len(response.raw_content or b""))
    return max(sizes) >= BIG_BYTES
