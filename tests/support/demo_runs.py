"""What every demo script does around its trials: a progress line per request on stderr (``[i/N]``,
the time so far, and after the first an estimate of what is left), and an end that leaves nothing
running: Ctrl-C, SIGTERM (``kill``) and SIGHUP (the terminal closed) all unwind the demo's
``ExitStack``, which stops the servers it started (their process groups), and end in one line
instead of a traceback. The table rows stay on stdout, alone.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TextIO

__all__ = ["Progress", "Stopped", "duration", "run_demo"]

INTERRUPTED_STATUS = 130
"""The exit status of a demo ended by Ctrl-C (128 + SIGINT); a signal ``s`` ends it with 128 + s."""


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``1 h 2 min``: as long a wait is read."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


class Progress:
    """``[i/N] what (2 min 10 s so far, about 9 min left)``, said before each step starts. ``plan`` is
    the number of steps, or the kind of each step in order (``["direct", "ContextPaw", ...]``): what
    is left is then, for each step to go, the mean time of the finished steps of its kind (of all
    finished steps while its kind has none), so a quick refusal does not make a slow compaction look
    quick. There is no estimate before the first step has finished. ``clock`` is injectable for tests."""

    def __init__(self, plan: int | Sequence[str], out: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.plan = [""] * plan if isinstance(plan, int) else list(plan)
        self.total = len(self.plan)
        self.out = out
        self.clock = clock
        self.started = clock()
        self.starts: list[float] = []

    @property
    def done(self) -> int:
        """Steps started."""
        return len(self.starts)

    def line(self, what: str) -> str:
        """The line for the next step (it counts as started)."""
        now = self.clock()
        self.starts.append(now)
        timing = f"{duration(now - self.started)} so far"
        if self.done > 1:
            timing += f", about {duration(self.left())} left"
        return f"[{self.done}/{self.total}] {what} ({timing})"

    def left(self) -> float:
        """Seconds the steps from the one starting now to the last should take."""
        finished = len(self.starts) - 1
        took: dict[str, list[float]] = {}
        for i in range(finished):
            took.setdefault(self.plan[i], []).append(self.starts[i + 1] - self.starts[i])
        overall = (self.starts[-1] - self.started) / finished
        mean = {kind: sum(times) / len(times) for kind, times in took.items()}
        return sum(mean.get(kind, overall) for kind in self.plan[finished:])

    def step(self, what: str) -> None:
        self._say(self.line(what))

    def end(self) -> str:
        """The last line: how many steps, in how long."""
        line = f"[{self.done}/{self.total}] done in {duration(self.clock() - self.started)}"
        self._say(line)
        return line

    def _say(self, line: str) -> None:
        """One write with its newline: `print` writes the newline on its own, and a signal between
        the two left the line open, so the demo's last line ("demo_400: terminated; ...") was
        printed onto it."""
        out = self.out or sys.stderr
        out.write(line + "\n")
        out.flush()


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the demo is, as Ctrl-C raises KeyboardInterrupt, so that the
    same unwinding stops its servers."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


SAID = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}
"""What ends a demo besides its end, and how its last line says it."""
ENDING = tuple(SAID)


def run_demo(main: Callable[[list[str] | None], int], argv: list[str] | None = None, *, name: str, servers: str) -> int:
    """``main(argv)``, with Ctrl-C, SIGTERM and SIGHUP unwinding it (its ``ExitStack`` stops the
    ``servers`` it started). The first such signal is the one obeyed: further ones are ignored until
    the servers are stopped, so a second Ctrl-C cannot cut the unwinding short and leave one
    running; one ignored when the demo starts stays ignored. Ends as ``name: interrupted; stopped SERVERS`` on stderr (``terminated`` for SIGTERM,
    ``hung up`` for SIGHUP), status 128 + the signal."""

    def stop(signum: int, frame: FrameType | None) -> None:
        for each in ENDING:
            signal.signal(each, signal.SIG_IGN)
        raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)

    # a signal ignored at start stays ignored (a shell's background job ignores Ctrl-C, nohup SIGHUP)
    previous = {each: signal.signal(each, stop) for each in ENDING if signal.getsignal(each) is not signal.SIG_IGN}
    try:
        return main(argv)
    except KeyboardInterrupt as e:  # Stopped included; the ExitStack has stopped the servers on its way here
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        print(f"{name}: {SAID[signum]}; stopped {servers}", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)
