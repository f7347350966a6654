"""The compaction engine: fit a conversation or a prompt into a token budget, and report every cut.

Pure: no I/O, no clock, no randomness; the same input gives the same output. The shell hands in the
budget, a counter and the previous turn's `Plan`, and gets back what to send, a `Report`, and the
`Plan` to hand in next turn.

Rules, in order of precedence:
1. System/developer messages and tool definitions are never touched. If they alone exceed the
   budget, `BudgetTooSmall` is raised (the shell refuses in the API's own error): nothing else could help.
2. The task (first user message), the current request (last user message) and the last
   `keep_recent` messages are never deleted. Tool units
   (a call and all of its results) are kept or evicted whole.
3. Everything else is evictable, biggest unit first. Last turn's cuts are made again (evicted units
   stay evicted, shrunk messages are cut at the same characters), so the prompt's prefix, and the
   server's prefix cache, survive from one turn to the next; when that is not enough, only what
   comes after the last cut is cut (latest first, with headroom for the next turns), unless the
   budget cannot hold the prefix with what must follow: then its latest units go, and the report
   says so (`EARLIER_CUT`).
4. If evicting all of that is not enough, protected messages are shrunk middle-out, biggest first,
   round after round (a message's cost does not fall exactly with its text) until it fits or
   nothing more can go: a fit never ends a few tokens short.
5. Evicted units that fit back into the room left over are re-admitted, so the window is used; room
   still left is filled with the head and tail of the smallest evicted unit, shrunk to fit.

What the model reads stays the same from turn to turn wherever the budget allows: a marker's text is
written once and reused byte for byte (`Plan.notes`), and a shrunk message is cut at the same
characters again (`Plan.shrunk`), so a server's prefix cache holds up to the last cut.
"""

from __future__ import annotations

import bisect
import itertools
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from contextpaw.conversation import Conversation, Message, Unit, content_id
from contextpaw.markers import elision_text, fold, hole_text, kind_of, marker_role
from contextpaw.report import Removal, Report
from contextpaw.tokens import Counter

SHRINK_FLOOR = 64
"""A shrunk message keeps at least this many tokens of its own text (head and tail), note aside."""

FILL = 0.95
"""Below this share of the budget, leftover room is filled with the head and tail of an evicted unit."""

HEADROOM = 0.25
"""When a conversation overflows again, evict this share of the budget more than needed: the next
turns then append to the cached prefix instead of each cutting it anew."""

MARKER_SLACK = 4
"""Tokens allowed for a marker's real id tokenizing differently from the placeholder it was sized with."""

SHRINK_ROUNDS = 8
"""Passes over the protected messages before a fit is given up as impossible."""

EARLIER_CUT = "cut at or before the last turn's last marker"
"""Said in the report's notes when the budget cannot hold last turn's prompt up to its last marker."""

PLACEHOLDER_ID = "cp-" + "0" * 12
"""A marker id of the real ids' length, for sizing a note before its id is known (ids are hashes)."""


class BudgetTooSmall(Exception):
    """What must be kept does not fit; carries the numbers for the caller's refusal."""

    def __init__(self, required: int, budget: int, what: str, original: int | None = None, counter: Counter | None = None) -> None:
        super().__init__(
            f"{what} need {required} tokens but the budget is {budget}; nothing can be removed to fit"
        )
        self.required = required
        self.budget = budget
        self.what = what
        self.original = original
        """The whole request's size, in the same counter's units (None: not counted)."""
        self.counter = counter.name if counter is not None else "estimate"
        """The counter that decided (the fitter names the server's whole count where it used it)."""

    def rescaled(self, budget: int) -> BudgetTooSmall:
        """The same shortfall told against `budget`: a refit under a budget tightened by a
        counting miss says what the request needs in the units of the budget the client is told."""
        rescaled = BudgetTooSmall(self.required + budget - self.budget, budget, self.what, self.original)
        rescaled.counter = self.counter
        return rescaled


@dataclass(frozen=True, slots=True)
class Cut:
    """Where a message's text was cut middle-out: kept `text[:head]` and `text[tail:]`; the note
    between them says `elided` tokens. Remembered in the plan, so the next turn cuts the same
    characters and says the same words, whatever the counter thinks of them by then."""

    target: int
    """The tokens the text was cut to."""
    head: int
    tail: int
    elided: int

    def apply(self, text: str, marker_id: str) -> str:
        if self.head == 0 and self.tail >= len(text):  # nothing of the text left but the note
            return elision_text(self.elided, text.count("\n"), marker_id).strip("\n")
        note = elision_text(self.elided, text.count("\n", self.head, self.tail), marker_id)
        return text[: self.head] + note + text[self.tail :]


@dataclass(frozen=True, slots=True)
class Plan:
    """One turn's decisions, remembered per conversation so the next turn keeps them."""

    evicted: frozenset[str] = frozenset()
    """Keys of evicted units."""
    shrunk: Mapping[str, Cut] = field(default_factory=dict)
    """Message (its unit's key and place in the unit) -> where its text was cut (so the same cut repeats)."""
    notes: Mapping[str, str] = field(default_factory=dict)
    """Marker id -> the marker's text as it was sent (so the same hole reads the same next turn)."""

    @property
    def footprint(self) -> int:
        """About the bytes this plan holds in memory (its keys, sets and texts), to bound how many are kept."""
        keys = sum(sys.getsizeof(k) for k in self.evicted) + sum(sys.getsizeof(k) + 80 for k in self.shrunk)
        notes = sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in self.notes.items())
        return sys.getsizeof(self.evicted) + sys.getsizeof(self.shrunk) + sys.getsizeof(self.notes) + keys + notes


@dataclass(slots=True)
class ChatResult:
    messages: list[Mapping[str, Any]] | None
    """What to send; None when nothing changed (forward the original bytes)."""
    report: Report
    plan: Plan


@dataclass(slots=True)
class PromptResult:
    prompt: str | None
    report: Report


NEAR_MISS_TOKENS = 32
"""A refusal short by at most this many tokens (or a fiftieth of the budget) is first searched for a
fit: the engine's own steps can overshoot the least it names."""


def compact_chat(
    conversation: Conversation,
    budget: int,
    counter: Counter,
    *,
    keep_recent: int = 4,
    previous: Plan | None = None,
    fixed_tokens: int = 0,
    digests: Mapping[str, str] | None = None,
    admit: int | None = None,
) -> ChatResult:
    """Fit `conversation` into `budget` tokens (tools and `fixed_tokens` of template included).

    A conversation of up to `admit` tokens (default: the budget) is left as it is: the backend
    would serve it whole. One over that is cut to `budget`.
    `digests` maps a hole's marker id (from an earlier run's report) to a summary of what it held;
    a hole that comes out the same carries its digest inside the marker, within the budget.
    """
    fixed = fixed_tokens + counter.tools(conversation.tools)
    cost = [counter.message(m) for m in conversation.messages]
    limit = budget if admit is None else max(admit, budget)
    if fixed + sum(cost) <= limit:  # the common case, decided before any of the bookkeeping
        return ChatResult(None, _as_sent(fixed + sum(cost), limit, counter), Plan())
    def fit(within: int) -> ChatResult:
        run = _ChatCompaction(conversation, within, counter, keep_recent, previous or Plan(), fixed, cost)
        run.digests = dict(digests or {})
        return run.run()

    try:
        return fit(budget)
    except BudgetTooSmall as short:
        # The engine's steps (whole units out, middle-out shrinks) can overshoot what it names as
        # the least: granted the few tokens it says it lacks, the same steps may land within the
        # first budget. A bounded search for that fit, before a refusal a few tokens short.
        shortfall = short.required - budget
        if not 0 < shortfall <= max(NEAR_MISS_TOKENS, budget // 50):
            raise
        for extra in (shortfall, 2 * shortfall + MARKER_SLACK, 4 * shortfall + 2 * MARKER_SLACK):
            try:
                nearer = fit(budget + extra)
            except BudgetTooSmall:
                continue
            if nearer.report.final_tokens <= budget:
                nearer.report.budget = budget
                return nearer
        raise


def _as_sent(tokens: int, budget: int, counter: Counter) -> Report:
    """The report of a request that goes out as it came in (so far)."""
    return Report(
        compacted=False,
        strategy="none",
        original_tokens=tokens,
        final_tokens=tokens,
        budget=budget,
        counter=counter.name,
        exact=counter.exact,
    )


class _ChatCompaction:
    """The state of one compaction run; a class only to keep the steps readable."""

    def __init__(
        self,
        conv: Conversation,
        budget: int,
        counter: Counter,
        keep_recent: int,
        previous: Plan,
        fixed: int,
        cost: list[int],
    ) -> None:
        self.msgs = list(conv.messages)
        self.budget = budget
        self.counter = counter
        self.previous = previous
        self.fixed = fixed
        self.cost = cost
        self.units = conv.units()
        self.unit_of = {i: u for u in self.units for i in u.indices}
        self.unit_cost = {u: sum(self.cost[i] for i in u.indices) for u in self.units}
        n = len(self.msgs)
        users = [i for i, m in enumerate(self.msgs) if m.role == "user"]
        protected = set(range(max(0, n - keep_recent), n)) | ({users[0], users[-1]} if users else set())
        pinned = {u for u in self.units if any(self.msgs[i].pinned for i in u.indices)}
        self.pinned = [u for u in self.units if u in pinned]
        self.protected = [u for u in self.units if u not in pinned and protected.intersection(u.indices)]
        guarded = pinned | set(self.protected)
        self.evictable = [u for u in self.units if u not in guarded]
        self.evicted: set[Unit] = set()
        self.sticky: set[Unit] = set()
        """Units evicted last turn, evicted again before anything else is decided."""
        self.kept = sum(self.cost)
        self.shrunk: dict[int, tuple[Message, int, Cut]] = {}
        """index -> (the shrunk message, its tokens, where its text was cut)"""
        # Holes (maximal runs of evicted messages) by both ends, and their markers' cost, kept up to
        # date on every eviction so that the total is known in constant time.
        self.hole_end: dict[int, int] = {}
        self.hole_start: dict[int, int] = {}
        self.starts: list[int] = []
        """Hole starts in order, to find the hole that holds a message."""
        self.marker_total = 0
        self._marker_cost: dict[tuple[int, int], int] = {}
        self.digests: dict[str, str] = {}
        # Prefix sums, so a hole's note (its size and what kinds of message it held) costs O(1).
        self._cost_before = [0, *itertools.accumulate(self.cost)]
        kinds = {kind_of(m.role) for m in self.msgs}
        self._kinds_before = {
            k: [0, *itertools.accumulate(1 if kind_of(m.role) == k else 0 for m in self.msgs)] for k in kinds
        }

    def run(self) -> ChatResult:
        report = _as_sent(self.fixed + self.kept, self.budget, self.counter)
        pinned = self.fixed + sum(self.unit_cost[u] for u in self.pinned)
        if pinned > self.budget:
            raise self.too_small("the system prompt and tool definitions")

        last = self.repeat_previous()
        if last is None:
            self.evict_until(self.budget, sorted(self.evictable, key=lambda u: (-self.unit_cost[u], u.indices)))
            self.shrink_protected(self.budget)
            self.must_fit()
            self.refill(self.budget)
            self.fill()
        elif self.total() > self.budget:
            self.recut(last, report)

        messages, removals, evicted, final, notes = self.render()
        report.compacted = True
        report.final_tokens = final
        report.removals = removals
        report.markers = list(dict.fromkeys(r.marker_id for r in removals))
        report.evicted = evicted
        actions = {r.action for r in removals}
        report.strategy = "+".join(
            a for a, k in (("evict", "dropped"), ("summarize", "summarized"), ("shrink", "shrunk")) if k in actions
        )
        report.summarized = "summarized" in actions
        plan = Plan(
            evicted=frozenset(u.key for u in self.evicted),
            shrunk={self.cut_key(i): cut for i, (_, _, cut) in self.shrunk.items() if self.unit_of[i] not in self.evicted},
            notes=notes,
        )
        return ChatResult([m.raw for m in messages], report, plan)

    # -- sizes ------------------------------------------------------------------------------

    def evict(self, unit: Unit) -> None:
        self.evicted.add(unit)
        self.kept -= sum(self.size(i) for i in unit.indices)
        for lo, hi in _runs(unit.indices):
            start, end = lo, hi
            if lo - 1 in self.hole_start:  # joins the hole that ends just before it
                start = self.hole_start[lo - 1]
                self._forget_hole(start, lo - 1)
            if hi + 1 in self.hole_end:  # and the one that starts just after it
                end = self.hole_end[hi + 1]
                self._forget_hole(hi + 1, end)
            self._add_hole(start, end)

    def readmit(self, unit: Unit) -> None:
        self.evicted.discard(unit)
        self.kept += sum(self.size(i) for i in unit.indices)
        for lo, hi in _runs(unit.indices):
            start = self.starts[bisect.bisect_right(self.starts, lo) - 1]  # the hole holding it
            end = self.hole_end[start]
            self._forget_hole(start, end)
            for a, b in ((start, lo - 1), (hi + 1, end)):
                if a <= b:
                    self._add_hole(a, b)

    def _add_hole(self, start: int, end: int) -> None:
        self.hole_end[start], self.hole_start[end] = end, start
        bisect.insort(self.starts, start)
        self.marker_total += self.marker_cost((start, end))

    def _forget_hole(self, start: int, end: int) -> None:
        del self.hole_end[start], self.hole_start[end]
        del self.starts[bisect.bisect_left(self.starts, start)]
        self.marker_total -= self.marker_cost((start, end))

    def size(self, i: int) -> int:
        return self.shrunk[i][1] if i in self.shrunk else self.cost[i]

    def total(self) -> int:
        """Tokens of what would be sent now: kept messages, shrunk sizes and hole markers."""
        return self.fixed + self.kept + self.marker_total

    def holes(self) -> list[tuple[int, int]]:
        """Maximal runs of evicted message indices, as (first, last) pairs in order."""
        return [(start, self.hole_end[start]) for start in self.starts]

    def marker_cost(self, hole: tuple[int, int]) -> int:
        """Tokens of a hole's marker, with a placeholder id of the real id's length (ids are hashes)."""
        if hole not in self._marker_cost:
            real_id = self.hole_id(hole) if self.digests else None
            note = self.hole_note(hole, PLACEHOLDER_ID, self.digests.get(real_id or ""))
            self._marker_cost[hole] = self.counter.text(note) + self.counter.message_overhead + MARKER_SLACK
        return self._marker_cost[hole]

    def folded_cost(self, note: str) -> int:
        """What a marker adds to the message it is folded into, counted on its own, as `total` did: a
        counter that knows the message exactly should not have to guess the joined text."""
        return self.counter.text(note) + MARKER_SLACK

    def hole_id(self, hole: tuple[int, int]) -> str:
        return content_id([self.msgs[i].raw for i in range(hole[0], hole[1] + 1)])

    def hole_note(self, hole: tuple[int, int], marker_id: str, digest: str | None = None) -> str:
        start, stop = hole[0], hole[1] + 1
        kinds = {k: before[stop] - before[start] for k, before in self._kinds_before.items()}
        tokens = self._cost_before[stop] - self._cost_before[start]
        return hole_text({k: n for k, n in kinds.items() if n}, tokens, marker_id, digest)

    # -- steps ------------------------------------------------------------------------------

    def repeat_previous(self) -> int | None:
        """Make last turn's cuts again: its evicted units stay evicted (sticky) and its shrunk
        messages are cut at the same characters, whatever the counter thinks of them now. Returns
        the index of the last message a cut stands for (None: last turn cut nothing here)."""
        for unit in self.evictable:
            if unit.key in self.previous.evicted:
                self.evict(unit)
        self.sticky = set(self.evicted)
        ends = [max(u.indices) for u in self.sticky]
        for unit in self.units:
            for i in unit.indices:
                cut = self.previous.shrunk.get(self.cut_key(i))
                if cut is not None and unit not in self.evicted and self.msgs[i].content_text:
                    self.cut(i, cut)
                    ends.append(i)
        return max(ends, default=None)

    def recut(self, last: int, report: Report) -> None:
        """A conversation that overflows again, last cut at message `last`: what was sent up to
        there is what the server cached, so the new cut goes after it, and deep enough (headroom)
        that the next turns append instead of each cutting anew.

        Units after the last cut go first, latest first, so the first message that changes is as
        late as it can be (the last hole grows when the unit right after it goes too: only its
        marker changes, and the prefix does not grow by a unit every re-cut). A message shrunk
        last is cut deeper next, then protected messages after the last cut are shrunk, as long as
        the prefix leaves the headroom for them. Only when the budget cannot hold the prefix with
        what must follow is anything before it cut, and the report says so."""
        target = self.budget - int(self.budget * HEADROOM)
        latest_first = sorted(self.evictable, key=lambda u: u.indices, reverse=True)
        self.evict_until(target, [u for u in latest_first if min(u.indices) > last])
        changed = None
        if self.total() > self.budget and last in self.shrunk and self.shrink(last, self.total() - target):
            changed = "its cut goes deeper"
        if self.total() > self.budget and self.prefix_tokens(last) <= target:
            self.shrink_protected(target, after=last)
        if self.total() > self.budget:
            prefix = self.prefix_tokens(last)
            changed = f"the {prefix} tokens up to it leave {self.budget - prefix} of the {self.budget}-token budget, too little for what must follow"
            # the prefix gives up its latest units until it leaves the headroom, no more: what it
            # keeps is still cached, and what follows it is shrunk into the room
            self.evict_until(target, latest_first, lambda: self.prefix_tokens(last))
            self.shrink_protected(target, after=last)
            if self.total() > self.budget:
                self.evict_until(target, latest_first)
                self.shrink_protected(target)
                self.must_fit()
        if changed:
            report.notes.append(f"{EARLIER_CUT} (message {last}): {changed}")
        self.refill(target)

    def prefix_tokens(self, last: int) -> int:
        """Tokens of what is sent up to message `last` as the cuts stand: kept messages and markers."""
        kept = sum(self.size(i) for i in range(last + 1) if self.unit_of[i] not in self.evicted)
        return self.fixed + kept + sum(self.marker_cost(h) for h in self.holes() if h[1] <= last)

    def shrink_protected(self, limit: int, after: int = -1) -> None:
        """Shrink protected messages middle-out, biggest first, until the rest fits in `limit` or
        none can give more. With `after`, only messages after it, and of the units that straddle
        it also those that are not protected (they cannot go without what comes before).

        A message's cost does not fall exactly as far as its text's (the note, a content part, how
        the cut tokenizes), so a pass that lands a few tokens over is followed by another, which
        cuts deeper by what is still over, until it fits or no message can give more.
        """
        units = self.protected if after < 0 else [*self.protected, *(u for u in self.evictable if u not in self.evicted and min(u.indices) <= after)]
        candidates = sorted(
            (i for u in units for i in u.indices if i > after and self.msgs[i].content_text),
            key=lambda i: (-self.cost[i], i),
        )
        for _ in range(SHRINK_ROUNDS):
            gave = False
            for i in candidates:
                over = self.total() - limit
                if over <= 0:
                    return
                gave = self.shrink(i, over) or gave
            if not gave:
                return

    def must_fit(self) -> None:
        """The last resort when shrinking did not reach the budget: the least this request can be,
        which may still fit; if not, the refusal."""
        if self.total() > self.budget:
            self.least()
        if self.total() > self.budget:
            raise self.too_small("the task, the recent messages and the markers")

    def least(self) -> None:
        """Cut to the least this request can be: everything evictable gone, every protected message
        at its floor."""
        for unit in self.evictable:
            if unit not in self.evicted:
                self.evict(unit)
        for i in (i for u in self.protected for i in u.indices if self.msgs[i].content_text):
            while self.shrink(i, self.size(i)):
                pass

    def too_small(self, what: str) -> BudgetTooSmall:
        """The refusal, naming the least this request can be cut to, so a budget of that much fits it."""
        self.least()
        return BudgetTooSmall(self.total(), self.budget, what, self.fixed + sum(self.cost), self.counter)

    def shrink(self, i: int, over: int) -> bool:
        """Cut message `i`'s text middle-out by `over` more tokens (to no less than the floor);
        False if it cannot give any more."""
        message = self.msgs[i]
        text = message.content_text
        own = self.counter.text(text)
        current = self.shrunk.get(i)
        now = current[2].target if current is not None else own
        floor = SHRINK_FLOOR + self.counter.text(elision_text(own, text.count("\n"), PLACEHOLDER_ID))
        target = max(floor, now - over)
        if target >= now:
            return False
        self.cut(i, shrink_text(text, target, self.counter))
        return True

    def cut(self, i: int, cut: Cut) -> None:
        text = self.msgs[i].content_text
        smaller = self.msgs[i].with_content(cut.apply(text, content_id(text)))
        size = self.counter.message(smaller)
        self.kept += size - self.size(i)
        self.shrunk[i] = (smaller, size, cut)

    def cut_key(self, i: int) -> str:
        """What names message `i` in a plan's cuts: its unit's key and its place in the unit."""
        unit = self.unit_of[i]
        return f"{unit.key}:{unit.indices.index(i)}"

    def biggest(self, unit: Unit) -> int:
        return max(unit.indices, key=lambda i: (self.cost[i], -i))

    def unshrink(self, i: int) -> None:
        _, size, _ = self.shrunk.pop(i)
        self.kept -= size - self.cost[i]

    def fill(self) -> None:
        """Use room that whole units could not: re-admit the smallest evicted unit that fits once its
        biggest message is shrunk middle-out (its call and results stay together)."""
        for unit in sorted(self.evicted, key=lambda u: (self.unit_cost[u], u.indices)):
            if self.total() >= self.budget * FILL:
                return
            biggest = self.biggest(unit)
            if not self.msgs[biggest].content_text:
                continue
            self.readmit(unit)
            over = self.total() - self.budget
            if self.shrink(biggest, over) and self.total() <= self.budget:
                return
            if biggest in self.shrunk:
                self.unshrink(biggest)
            self.evict(unit)

    def evict_until(self, limit: int, order: list[Unit], size: Callable[[], int] | None = None) -> None:
        """Evict units in `order` until the total (or `size`) fits in `limit`; then take back each
        of them whose hole's marker costs more than the unit did (a small unit between kept ones)."""
        # Markers only add tokens, so the kept sum is a cheap lower bound for the full total.
        measure = size or self.total
        fits = (lambda: measure() <= limit) if size else (lambda: self.fixed + self.kept <= limit and self.total() <= limit)
        evicted = []
        for unit in order:
            if fits():
                break
            if unit not in self.evicted:
                self.evict(unit)
                evicted.append(unit)
        for unit in evicted:
            before = measure()
            self.readmit(unit)
            if measure() > before:
                self.evict(unit)

    def refill(self, limit: int) -> None:
        """Re-admit units evicted this turn that fit in the room left (up to `limit`), biggest first."""
        for unit in sorted(self.evicted - self.sticky, key=lambda u: (-self.unit_cost[u], u.indices)):
            if self.fixed + self.kept + self.unit_cost[unit] > limit:
                continue
            self.readmit(unit)
            if self.total() > limit:
                self.evict(unit)

    def render(self) -> tuple[list[Message], list[Removal], dict[str, Any], int, dict[str, str]]:
        holes = {h[0]: h for h in self.holes()}
        out: list[Message] = []
        removals: list[Removal] = []
        evicted: dict[str, Any] = {}
        notes: dict[str, str] = {}
        final = self.fixed
        pending_fold: str | None = None
        i = 0
        while i < len(self.msgs):
            if i in holes:
                first, last = holes[i]
                marker_id = self.hole_id(holes[i])
                evicted[marker_id] = [self.msgs[j].raw for j in range(first, last + 1)]
                digest = self.digests.get(marker_id)
                action = "summarized" if digest else "dropped"
                removals += [Removal(j, self.msgs[j].role, self.cost[j], action, marker_id) for j in range(first, last + 1)]
                if digest or marker_id not in self.previous.notes:
                    note = self.hole_note(holes[i], marker_id, digest)
                else:
                    note = self.previous.notes[marker_id]  # written once: the prefix stays the same
                if not digest:
                    notes[marker_id] = note
                after = last + 1
                role = marker_role(
                    out[-1].speaker if out else None, self.msgs[after].speaker if after < len(self.msgs) else None
                )
                if role is None and after < len(self.msgs) and self.msgs[after].foldable:
                    pending_fold = note
                elif role is None and after == len(self.msgs) and out[-1].foldable:
                    out[-1] = fold(out[-1], note)
                    final += self.folded_cost(note)
                else:  # a role of its own, or next to items that hold no text (a Responses call)
                    out.append(Message.from_wire({"role": role or "user", "content": note}))
                    final += self.counter.message(out[-1])
                i = after
                continue
            if i in self.shrunk:
                message, size, cut = self.shrunk[i]
                marker_id = content_id(self.msgs[i].content_text)
                evicted[marker_id] = self.msgs[i].content_text
                removals.append(Removal(i, message.role, cut.elided, "shrunk", marker_id))
            else:
                message, size = self.msgs[i], self.cost[i]
            if pending_fold is not None:
                message, size = fold(message, pending_fold), size + self.folded_cost(pending_fold)
                pending_fold = None
            out.append(message)
            final += size
            i += 1
        return out, removals, evicted, final, notes


def _runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted indices as maximal (first, last) runs; a unit is one run unless a result strayed."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [(a, b) for a, b in runs]


def shrink_text(text: str, target: int, counter: Counter) -> Cut:
    """Where to cut `text` so that its head and tail fit in `target` tokens, note included; cuts
    fall at line ends.

    Each pass scales the kept characters by how far the last result overshot, and always by at
    least one token's worth, so it terminates; the last resort keeps only the note. The note is
    sized with a placeholder id of the real id's length.
    """
    total = counter.text(text)
    chars_per_token = max(len(text) / max(total, 1), 1.0)
    keep_chars = int(len(text) * target / max(total, 1))
    while keep_chars > 0:
        head, tail = _head_tail(text, keep_chars)
        elided = max(total - counter.text(head) - counter.text(tail), 0)
        cut = Cut(target, len(head), len(text) - len(tail), elided)
        size = counter.text(cut.apply(text, PLACEHOLDER_ID))
        if size <= target:
            return cut
        keep_chars = min(int(keep_chars * target / size), keep_chars - int((size - target) * chars_per_token) - 1)
    return Cut(target, 0, len(text), total)


def _head_tail(text: str, keep_chars: int) -> tuple[str, str]:
    """Split `keep_chars` between head and tail, moving each cut to a line end if one is near."""
    half = keep_chars // 2
    head_end = half
    newline = text.rfind("\n", 0, head_end)
    if newline >= half * 0.75:
        head_end = newline + 1
    tail_start = len(text) - (keep_chars - head_end)
    newline = text.find("\n", tail_start)
    if newline != -1 and newline - tail_start <= half * 0.25:
        tail_start = newline + 1
    tail_start = max(tail_start, head_end)
    return text[:head_end], text[tail_start:]


def compact_prompt(
    prompt: str,
    budget: int,
    counter: Counter,
    *,
    fixed_tokens: int = 0,
    admit: int | None = None,
) -> PromptResult:
    """Fit a raw prompt: keep its head and tail, elide the middle with a marker. A prompt of up to
    `admit` tokens (default: the budget) is left as it is."""
    original = fixed_tokens + counter.text(prompt)
    limit = budget if admit is None else max(admit, budget)
    if original <= limit:
        return PromptResult(None, _as_sent(original, limit, counter))
    report = _as_sent(original, budget, counter)
    room = budget - fixed_tokens
    if room < SHRINK_FLOOR:
        raise BudgetTooSmall(fixed_tokens + SHRINK_FLOOR, budget, "the system text and template", original, counter)
    marker_id = content_id(prompt)
    cut = shrink_text(prompt, room, counter)
    kept = cut.apply(prompt, marker_id)
    report.compacted = True
    report.strategy = "head_tail"
    report.final_tokens = fixed_tokens + counter.text(kept)
    report.removals = [Removal(-1, "prompt", cut.elided, "shrunk", marker_id)]
    report.markers = [marker_id]
    report.evicted = {marker_id: prompt}
    return PromptResult(kept, report)
