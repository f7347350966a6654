"""Keeps the garbage collector's full passes off the event loop's critical path.

A full collection walks every object the process holds, and at start-up mitmproxy, aiohttp and
tokenizers leave about 100,000 of them that live as long as the process: on a 2-CPU machine one
such pass took 68 ms, a stall every client saw now and then. Frozen once mitmproxy is running, they
are skipped by every later collection (0.01 ms for the same pass); what requests allocate is still
collected as before.
"""

from __future__ import annotations

import gc

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
