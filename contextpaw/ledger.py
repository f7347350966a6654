"""One ledger of backend failures: what is counted, what is logged, and the last error seen at each
backend (for `/contextpaw/health`), whichever part of ContextPaw saw it fail."""

from __future__ import annotations

from collections.abc import Callable

from contextpaw import logs
from contextpaw.metrics import UNPLACED, Stats, Where

logger = logs.get(__name__)


class FailureLedger:
    def __init__(self, stats: Stats, broken: Callable[[str], None] = lambda target: None) -> None:
        self.stats = stats
        self.broken = broken
        """Told the "host:port" of a backend that refused or broke a connection (not one that was
        only slow): it may have restarted, with another window."""
        self.last_error: dict[str, str] = {}
        """"host:port" -> the last failure seen there; cleared when a connection opens again."""

    def connect_failed(self, target: str, reason: str) -> None:
        """mitmproxy could not connect (its own answer, or ours, says so to the client)."""
        self.last_error[target] = reason
        self.broken(target)

    def connected(self, target: str) -> None:
        self.last_error.pop(target, None)

    def unreachable(self, target: str, what: str, reason: str, where: Where = UNPLACED) -> None:
        """A handled request answered 502 because its backend does not answer."""
        self.last_error[target] = reason
        self.broken(target)
        self.stats.add("unreachable", where=where)
        logger.warning("%s: answered 502: %s", what, reason)

    def failed(
        self, what: str, reason: str, *, target: str | None = None, timed_out: bool = False, answered: str = "", where: Where = UNPLACED
    ) -> None:
        """A backend that answered badly: a 5xx, an answer that is not JSON, a reset or a stall."""
        if target is not None:
            self.last_error[target] = reason
            if not timed_out:
                self.broken(target)
        self.stats.add("upstream_errors", where=where)
        self.stats.add("upstream_timeouts", timed_out, where)
        logger.warning("%s: upstream failure: %s%s", what, reason, f" ({answered})" if answered else "")
