"""One handled flow as the core sees it: its phase, what was decided, and what was sent.

`FlowState` goes with a flow from its request to its last byte; `Phase` and `PHASES` say where it is
and where it may go next (in the manner of h11's `_state.py`: every step is in the table, and
`core.lifecycle.advance` raises on any other). The decision a request gets is a `Forward` or a
`Refuse`. Pure data, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from contextpaw import wire
from contextpaw.core.lifecycle import IllegalTransition, advance
from contextpaw.core.refs import Refs
from contextpaw.core.report import Report
from contextpaw.core.truncation import EXACT_BOUNDS
from contextpaw.fitting.calibration import Sample
from contextpaw.ops.metrics import UNPLACED, Where


@dataclass(frozen=True, slots=True)
class Forward:
    """Send the request on: these bytes, or the client's own when ``body`` is None."""

    body: bytes | None = None
    compacted: bool = False
    """The body is a compaction (not only the client's with `truncate: false` added)."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer here, in the caller's convention; the backend never sees the request."""

    status: int
    body: bytes
    reason: str


Decision = Forward | Refuse
UNCHANGED = Forward()


class Phase(Enum):
    """Where a handled flow is in its life. Everything that moves it is in `PHASES`."""

    RECEIVED = "received"
    """The request is in; nothing is decided."""
    FORWARDED = "forwarded"
    """It went to the backend, as it came or fitted."""
    RESCUED = "rescued"
    """The backend refused what was sent as too long, and a compacted retry went instead."""
    REFUSED = "refused"
    """It was answered here, in the caller's API: the backend has not seen it, or refused it for good."""
    JUDGED = "judged"
    """The answer's count of what it evaluated was checked against what was sent (and learned from)."""


PHASES: dict[Phase, frozenset[Phase]] = {
    Phase.RECEIVED: frozenset({Phase.FORWARDED, Phase.REFUSED}),
    Phase.FORWARDED: frozenset({Phase.RESCUED, Phase.REFUSED, Phase.JUDGED}),
    Phase.RESCUED: frozenset({Phase.RESCUED, Phase.REFUSED, Phase.JUDGED}),
    Phase.REFUSED: frozenset(),
    Phase.JUDGED: frozenset({Phase.JUDGED}),  # a stream's final record may be read after a count in it
}
"""The phases each phase may go to; any other step is a bug (`IllegalPhase`)."""


class IllegalPhase(IllegalTransition):
    """A step the phase table does not allow."""

    @staticmethod
    def told(current: Enum, to: Enum) -> str:
        return f"a flow {current.value} cannot be {to.value}"


@dataclass(slots=True, weakref_slot=True)
class FlowState:
    """What ContextPaw knows about one handled flow, from its request to its last byte."""

    backend: wire.Backend
    route: wire.Route
    original: bytes
    """The body as the client sent it."""
    path: str
    """The request's path, for log lines."""
    authorization: str | None = None
    proxy_url: str = ""
    """Where the client reached the proxy (`http://host:port`, as it named it; "" when unknown)."""
    session: str = ""
    """The session the client named (`wire.SESSION_HEADER`): what it evicts is searched within it."""
    left: Callable[[], bool] = field(default=lambda: False)
    """Whether the client has gone (a fit of megabytes takes long enough for it to leave): a request
    nobody waits for is neither counted, kept nor sent."""
    refs: Refs = Refs()
    """How this request's markers name what they stand for (the proxy's secret, `proxy_url`)."""
    report: Report | None = None
    """The report the client is told (compact and strict)."""
    overflow: wire.Overflow | None = None
    """A refusal's numbers (what the request needs, what fits, the least window), for its fix."""
    observed: Report | None = None
    """Under policy off: what would have been done; checked against the answer, never sent."""
    headers: dict[str, str] = field(default_factory=dict)
    """The X-ContextPaw-* headers for the response."""
    calibration: Sample | None = None
    """What was sent, sized for calibration, when the calibrated counter counted this request."""
    sent: bytes | None = None
    """The body sent instead of the original, if any (the rescue's retry is the last one)."""
    sent_tokens: int | None = None
    """Our count of what was sent (under policy off, of the client's own request)."""
    bounds: tuple[float, float] = EXACT_BOUNDS
    """How far the true size of what was sent can be from `sent_tokens`."""
    uncuttable: bool = False
    """What was sent cannot be cut: it says `truncate: false`, or llama-server gets it (a 400)."""
    rescues: int = 0
    """Retries after upstream overflows so far (at most `MAX_RESCUES`)."""
    retold: dict[str, Any] | None = None
    """The answer's final record (or whole answer) with its prompt size told as if nothing had been
    cut (`wire.told_usage`), once the report is made for it; None: it goes as it came."""
    phase: Phase = Phase.RECEIVED
    where: Where = UNPLACED
    """The labels of this request's metrics (its model once it is read)."""

    def advance(self, to: Phase) -> None:
        self.phase = advance(PHASES, self.phase, to, IllegalPhase)

    @property
    def local(self) -> bool:
        """The answer was made here, not by the backend."""
        return self.phase is Phase.REFUSED

    @property
    def retried(self) -> bool:
        return self.rescues > 0

    @property
    def watched(self) -> Report | None:
        """The report the answer is checked against, under any policy."""
        return self.report or self.observed

    @watched.setter
    def watched(self, report: Report) -> None:
        """The verdict on the answer makes the next report (a report is frozen): it takes the
        place of the one it was made from, the report told, else the observed one."""
        if self.report is not None:
            self.report = report
        else:
            self.observed = report
