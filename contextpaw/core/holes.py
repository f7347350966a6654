"""The holes of one compaction run: maximal runs of evicted messages, each read by the model as one
marker. Kept up to date on every eviction, so that what the markers cost together is known in
constant time while the engine weighs unit after unit. Pure."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence

from contextpaw.core.conversation import Message
from contextpaw.core.markers import hole_text, kind_of, legend
from contextpaw.core.refs import Refs
from contextpaw.core.shrink import PLACEHOLDER_ID
from contextpaw.core.tokens import Counter

MARKER_SHARE = 0.05
"""The most of the budget a request's markers may take together: the model must read the
conversation, not ContextPaw's notes. Past it, holes merge (`compact`); a window too small for one
marker that names its reference and says how to read it back gets markers without one."""

MARKER_MARGIN = 0.9
"""Holes merge a little before their markers reach `MARKER_SHARE`: the count of a note is close,
not exact, and the share is a promise."""

MARKER_SLACK = 4
"""Tokens allowed for a marker's real id tokenizing differently from the placeholder it was sized with."""

Hole = tuple[int, int]
"""The first and last index of a run of evicted messages."""


def shows_refs(budget: int, counter: Counter, url: str) -> bool:
    """Whether markers in this budget name their reference: two markers, one with the legend, must
    fit within `MARKER_SHARE` of it (a window of 4,096 tokens holds them, not 2,048)."""
    first = hole_text({"user message": 2, "tool result": 2}, 99_999, PLACEHOLDER_ID, None, url, told=False)
    second = hole_text({"tool result": 2}, 99_999, PLACEHOLDER_ID, None, url)
    notes = counter.text(first) + counter.text(second) + 2 * (counter.message_overhead + MARKER_SLACK)
    return notes <= budget * MARKER_SHARE * MARKER_MARGIN


class Holes:
    """The holes by both ends, their markers' cost, and what each marker says."""

    def __init__(
        self,
        msgs: Sequence[Message],
        cost: Sequence[int],
        counter: Counter,
        digests: Mapping[str, str],
        refs: Refs = Refs(),
        shown: bool = True,
    ) -> None:
        self.msgs = msgs
        self.shown = shown
        """Markers name their reference: False where the window is too small to carry one
        (`compact.MARKER_SHARE`); the client's report names it all the same."""
        self.refs = refs
        """Keys each hole's reference, and says where to read it back."""
        self.counter = counter
        self.digests = digests
        """A hole's marker id -> a summary of what it held, carried inside its marker."""
        self.end: dict[int, int] = {}
        """A hole's first index -> its last."""
        self.start: dict[int, int] = {}
        """A hole's last index -> its first."""
        self.starts: list[int] = []
        """Hole starts in order, to find the hole that holds a message."""
        self.marker_total = 0
        self.walls: set[int] = set()
        """Indices no hole joins across (between `i - 1` and `i`): the ends of holes whose markers were
        sent before, so that a new eviction beside one makes a hole and a marker of its own instead of
        rewriting the marker the server has cached."""
        self._marker_cost: dict[Hole, int] = {}
        self._marker_ids: dict[Hole, str] = {}
        """A hole's reference, once made: it hashes every message the hole holds, and rendering, the
        legend's check and the merge each ask for it."""
        self._legend_cost: int | None = None
        # Prefix sums, so a hole's note (its size and what kinds of message it held) costs O(1).
        self._cost_before = [0, *itertools.accumulate(cost)]
        kinds = {kind_of(m.role) for m in msgs}
        self._kinds_before = {k: [0, *itertools.accumulate(1 if kind_of(m.role) == k else 0 for m in msgs)] for k in kinds}

    def __iter__(self) -> Iterator[Hole]:
        """The holes in order."""
        return iter([(start, self.end[start]) for start in self.starts])

    def add(self, indices: Iterable[int]) -> None:
        """Messages that went: each run of them is a hole, joined with the holes just before and after it."""
        for lo, hi in _runs(indices):
            start, end = lo, hi
            if lo - 1 in self.start and lo not in self.walls:
                start = self.start[lo - 1]
                self._forget(start, lo - 1)
            if hi + 1 in self.end and hi + 1 not in self.walls:
                end = self.end[hi + 1]
                self._forget(hi + 1, end)
            self._add(start, end)

    def seal(self) -> None:
        """Wall in every hole as it stands: its marker is sent, and stays byte for byte."""
        for start, end in self:
            self.walls.update((start, end + 1))

    def unwall(self, since: int) -> None:
        """Let the holes after `since` join again: what follows a cut made there is read anew by
        the server anyway, and markers side by side cost the window more than one would."""
        for wall in sorted(w for w in self.walls if w > since):
            self.walls.discard(wall)
            if wall - 1 in self.start and wall in self.end:
                first, last = self.start[wall - 1], self.end[wall]
                self._forget(first, wall - 1)
                self._forget(wall, last)
                self._add(first, last)

    def remove(self, indices: Iterable[int]) -> None:
        """Messages taken back: the hole holding each run of them is split around it."""
        for lo, hi in _runs(indices):
            start = self.starts[bisect.bisect_right(self.starts, lo) - 1]
            end = self.end[start]
            self._forget(start, end)
            for a, b in ((start, lo - 1), (hi + 1, end)):
                if a <= b:
                    self._add(a, b)

    def splits(self, indices: Iterable[int]) -> bool:
        """Whether taking these messages back would split their hole in two (they are not at an end)."""
        runs = _runs(indices)
        lo, hi = runs[0][0], runs[-1][1]
        start = self.starts[bisect.bisect_right(self.starts, lo) - 1]
        return start < lo and hi < self.end[start]

    def taken_back(self, indices: Iterable[int]) -> int | None:
        """How much `marker_total` would change if these messages were taken back (`remove`),
        without taking them back: the engine weighs many units that stay out. None for messages in
        more than one run (a result that strayed from its call), which `remove` must weigh."""
        runs = _runs(indices)
        if len(runs) != 1:
            return None
        ((lo, hi),) = runs
        start = self.starts[bisect.bisect_right(self.starts, lo) - 1]
        end = self.end[start]
        change = -self.marker_cost((start, end))
        for a, b in ((start, lo - 1), (hi + 1, end)):
            if a <= b:
                change += self.marker_cost((a, b))
        return change

    def _add(self, start: int, end: int) -> None:
        self.end[start], self.start[end] = end, start
        bisect.insort(self.starts, start)
        self.marker_total += self.marker_cost((start, end))

    def _forget(self, start: int, end: int) -> None:
        del self.end[start], self.start[end]
        del self.starts[bisect.bisect_left(self.starts, start)]
        self.marker_total -= self.marker_cost((start, end))

    def marker_cost(self, hole: Hole) -> int:
        """Tokens of a hole's marker, with a placeholder id of the real id's length (ids are hashes)."""
        if hole not in self._marker_cost:
            real_id = self.marker_id(hole) if self.digests else None
            note = self.note(hole, PLACEHOLDER_ID, self.digests.get(real_id or ""), told=True)
            self._marker_cost[hole] = self.counter.text(note) + self.counter.message_overhead + MARKER_SLACK
        return self._marker_cost[hole]

    def folded_cost(self, note: str) -> int:
        """What a marker adds to the message it is folded into, counted on its own, as `marker_total`
        did: a counter that knows the message exactly should not have to guess the joined text."""
        return self.counter.text(note) + MARKER_SLACK

    def marker_id(self, hole: Hole) -> str:
        if hole not in self._marker_ids:
            self._marker_ids[hole] = self.refs.ref([self.msgs[i].raw for i in range(hole[0], hole[1] + 1)])
        return self._marker_ids[hole]

    def note(self, hole: Hole, marker_id: str, digest: str | None = None, told: bool = True) -> str:
        """A hole's marker; with the legend unless the request already said it (`told`)."""
        start, stop = hole[0], hole[1] + 1
        kinds = {k: before[stop] - before[start] for k, before in self._kinds_before.items()}
        tokens = self._cost_before[stop] - self._cost_before[start]
        shown_id = marker_id if self.shown else ""
        return hole_text({k: n for k, n in kinds.items() if n}, tokens, shown_id, digest, self.refs.url, told)

    def legend_cost(self) -> int:
        """What the legend adds to the request's first marker."""
        if self._legend_cost is None:
            self._legend_cost = self.counter.text(legend(self.refs.url, self.shown)) + MARKER_SLACK
        return self._legend_cost


def _runs(indices: Iterable[int]) -> list[Hole]:
    """Sorted indices as maximal (first, last) runs; a unit is one run unless a result strayed."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [(a, b) for a, b in runs]
