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
import platform
import time
from typing import Any

from mitmproxy import http

from contextpaw import logs

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
TRIM_EVERY_S = 5.0
"""At most one trim this often: it walks every arena, and a burst of big requests needs only one."""


class ReturnedMemory:
    """Gives the memory big requests used back to the system (glibc only; elsewhere it does nothing).

    Python frees a 50 MB body at once, but malloc keeps the pages unless the top of the heap is
    free: what is left between live blocks stays resident. `malloc_trim(0)` hands such free pages
    back (madvise); it runs in a worker thread (ctypes lets go of the GIL), after a flow with a big
    body, at most every TRIM_EVERY_S seconds.
    """

    def __init__(self, libc: Any = None) -> None:
        """`libc`: what has glibc's `malloc_trim` and `mallopt` (default: this process's glibc, if any)."""
        self.libc = libc or _glibc()
        self.due = False
        self.trimming: asyncio.Task[None] | None = None
        if self.libc is not None:
            self.libc.mallopt(M_ARENA_MAX, ARENAS)

    def response(self, flow: http.HTTPFlow) -> None:
        self._after(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._after(flow)

    def _after(self, flow: http.HTTPFlow) -> None:
        if self.libc is None or not _big(flow):
            return
        self.due = True
        if self.trimming is None:
            self.trimming = asyncio.get_running_loop().create_task(self._trim())

    async def _trim(self) -> None:
        assert self.libc is not None
        try:
            while self.due:
                self.due = False
                started = time.perf_counter()
                await asyncio.to_thread(self.libc.malloc_trim, 0)
                logger.debug("memory trimmed in %.1f ms", (time.perf_counter() - started) * 1000)
                await asyncio.sleep(TRIM_EVERY_S)
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


def _big(flow: http.HTTPFlow) -> bool:
    """Whether the flow carried a big body; a streamed answer counts, its size unknown here."""
    response = flow.response
    sizes = [len(flow.request.raw_content or b"")]
    if response is not None:
        if response.stream:
            return True
        sizes.append(len(response.raw_content or b""))
    return max(sizes) >= BIG_BYTES
