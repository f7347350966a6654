"""Work on big bodies goes to a worker thread, so that other flows keep moving meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

OFFLOAD_BYTES = 256 * 1024
OFFLOAD_MESSAGES = 500
"""Bodies above this size, or with more messages than this, are parsed and compacted in a worker
thread, so other flows keep moving."""


def is_big(raw: bytes) -> bool:
    return len(raw) > OFFLOAD_BYTES or raw.count(b'"role"') > OFFLOAD_MESSAGES


async def off_loop[T](big: bool, fn: Callable[[], T]) -> T:
    return await asyncio.to_thread(fn) if big else fn()
