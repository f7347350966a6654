"""The rescue after a backend refuses a request as longer than its window: one loop for both
transports.

The relay (flows it carries) and the addon's own call (flows it does not) hand in the answer they
got and a way to send a body once more; `decide` (the fitter's `rescue`, bound to the flow's state)
says each round what to do: send a body compacted to the window the error named, answer with a
refusal in the caller's API, or pass the answer on. The fitter bounds the rounds. No I/O here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

RESCUABLE = (400, 500)
"""The statuses a context overflow comes back with (llama-server 400; some Ollama builds 500)."""


class Refusal(Protocol):
    """An answer made here instead of the backend's (the fitter's `Refuse`)."""

    @property
    def status(self) -> int: ...

    @property
    def body(self) -> bytes: ...


Decide = Callable[[int, bytes], Awaitable[bytes | Refusal | None]]
"""(the error's status, the error's body) -> the body to send instead, a refusal, or None."""
Send = Callable[[bytes], Awaitable[tuple[int, bytes | None]]]
"""Send a body; the answer's status and whole body, or None for a body that streams (it goes on as
it comes, and is not asked about)."""


async def rescued(status: int, answer: bytes | None, decide: Decide, send: Send) -> Refusal | None:
    """Rounds until the answer is not an overflow to fit once more, or streams; a refusal to give
    the client instead of the backend's last answer, or None (the last answer sent goes on)."""
    while status in RESCUABLE and answer is not None and (retry := await decide(status, answer)) is not None:
        if not isinstance(retry, bytes):
            return retry
        status, answer = await send(retry)
    return None
