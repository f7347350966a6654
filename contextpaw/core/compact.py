"""The compaction engine: fit a conversation into a token budget, and report every cut.

Pure: no I/O, no clock, no randomness; the same input gives the same output. The shell hands in the
budget, a counter and the previous turn's `Plan`, and gets back what to send, a `Report`, and the
`Plan` to hand in next turn.

Rules, in order of precedence:
1. System/developer messages and tool definitions are never touched. If they alone exceed the
   budget, `BudgetTooSmall` is raised (the shell refuses in the API's own error): nothing else could help.
2. The task (the first user message that is more than an agent's wrapped context; the head pins it),
   the current request (last user message) and the last `keep_recent` messages are never deleted. Tool units
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

The rules and their steps are here; the parts they use have modules of their own: `holes` (runs of
evicted messages and what their markers cost), `shrink` (cutting a text middle-out) and `rendering`
(what is sent, and what the report tells of it). A raw prompt, which has no messages, is `prompt`'s.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from contextpaw.core.conversation import Conversation, Message, Unit
from contextpaw.core.holes import MARKER_MARGIN, MARKER_SHARE, MARKER_SLACK, Holes, shows_refs
from contextpaw.core.markers import elision_text
from contextpaw.core.refs import Refs, kept
from contextpaw.core.rendering import render
from contextpaw.core.report import Report
from contextpaw.core.shrink import PLACEHOLDER_ID, SHRINK_FLOOR, Cut, cut_ref, shrink_text
from contextpaw.core.tokens import Counter

FILL = 0.995
"""Below this share of the budget, leftover room is filled with the head and tail of an evicted unit
(where they fit in it with their note: a room smaller than that stays). Near the whole budget: room
that whole units leave is context the model could have had (an agent chat cut to -c 2048 left 7%)."""

HEADROOM = (0.10, 0.20)
"""The least and the most share of the budget a cut leaves free (`headroom_share`). A cut that
fills the budget makes the next turn cut again, and every cut makes the server read again what
follows it; room for a turn lets the next one append. Turns bigger than the most (an agent reading
a 30 KB file a turn into 32k) are not given room: the window would stay a third empty for one
turn in two, so the cut leaves the least and the next turn cuts again. Measured with Claude Code,
Codex and opencode reading twelve such files through a 32,768-token Ollama without a tokenizer:
room for the turn, 64-76% of the window used from the first cut on, 39-44% of each prompt read
again; room of 15%, 76-78% and 45-64%; direct, Ollama's own cut reads 50-72% again."""
TURN_SLACK = 0.01
"""Added to a turn's share of the budget: a turn just like the last ones must append, not land a
marker's worth of tokens over."""
HEADROOM_TURNS = 3
"""How many of the latest turns size the headroom: a cut leaves room for one more turn like them
(their mean), so a turn appends after each cut. Room for two held an agent reading a file a turn
to 78% of a 16k window on average; room for one, 85%."""

SIZE_CLASS = 1.5
"""Units whose sizes are within this ratio are evicted oldest first (`_ChatCompaction.stalest_biggest`)."""

NIBBLE = 4
"""A message's first cut takes at least this many times what its note costs."""

SHRINK_ROUNDS = 8
"""Passes over the protected messages before a fit is given up as impossible."""

EARLIER_CUT = "cut at or before the last turn's last marker"
"""Said in the report's notes when the budget cannot hold last turn's prompt up to its last marker."""
GAVE_WAY = "the earlier turns' cuts could not hold what must be kept now"
"""Said when a plan from earlier turns gives way to a fresh fit rather than refuse the turn."""
WINDOW_GREW = "the window grew"
"""Said when a conversation cut for a smaller window is cut afresh for the one it has now."""
MERGED = "markers merged"
"""Said when holes merge into one because their markers would take more than `MARKER_SHARE`."""
GROWN = 1.25
"""A budget this many times the one a plan was made for drops the plan's cuts: the room is used."""
OPENING_SHRUNK = "the conversation's opening alone is over the budget: its first messages shrunk middle-out"
"""Said when the task's message, too big for any budget left, is shrunk rather than refused."""


def recut_target(budget: int, headroom: float) -> int:
    """What a cut is made to: the budget less the headroom, so that the next turns append."""
    return budget - int(budget * headroom)


def headroom_share(messages: tuple[Message, ...], cost: list[int], budget: int) -> float:
    """The share of the budget a cut leaves free: what one turn adds, as the latest turns did.

    A turn starts at an assistant message (the answer, then what the client adds: a tool's result,
    the user's next words); a conversation with no answer yet is sized by its last message. Turns
    too big for `HEADROOM`'s most get its least: they cut every turn whatever room is left."""
    starts = [i for i, m in enumerate(messages) if m.speaker == "assistant"]
    if starts:
        bounds = [*starts[-HEADROOM_TURNS:], len(messages)]
        turns = [sum(cost[a:b]) for a, b in itertools.pairwise(bounds)]
        grows = sum(turns) / len(turns)
    else:
        grows = cost[-1] if cost else 0
    low, high = HEADROOM
    share = grows / max(budget, 1) + TURN_SLACK
    return low if share > high else max(share, low)


class BudgetTooSmall(Exception):
    """What must be kept does not fit; carries the numbers for the caller's refusal."""

    def __init__(
        self,
        required: int,
        budget: int,
        what: str,
        original: int | None = None,
        counter: Counter | None = None,
        head: int | None = None,
        least_budget: int | None = None,
    ) -> None:
        super().__init__(f"{what} need {required} tokens but the budget is {budget}; nothing can be removed to fit")
        self.required = required
        self.budget = budget
        self.what = what
        self.original = original
        """The whole request's size, in the same counter's units (None: not counted)."""
        self.counter = counter.name if counter is not None else "estimate"
        """The counter that decided (the fitter names the server's whole count where it used it)."""
        self.head = head
        """The agent's own part of the request (system prompt, tool definitions, the template), when
        it alone is over the budget: the window, not the conversation, is what must change (None: it
        fits)."""
        self.least_budget = least_budget
        """The budget that holds what is never cut (that part and the conversation's opening) with
        the headroom free for the turns after it (None with `head`)."""

    def rescaled(self, budget: int) -> BudgetTooSmall:
        """The same shortfall told against `budget`: a refit under a budget tightened by a
        counting miss says what the request needs in the units of the budget the client is told."""
        shift = budget - self.budget
        head = None if self.head is None else self.head + shift
        least = None if self.least_budget is None else self.least_budget + shift
        rescaled = BudgetTooSmall(self.required + shift, budget, self.what, self.original, None, head, least)
        rescaled.counter = self.counter
        return rescaled


@dataclass(frozen=True, slots=True)
class Plan:
    """One turn's decisions, remembered per conversation so the next turn keeps them."""

    evicted: frozenset[str] = frozenset()
    """Keys of evicted units."""
    shrunk: Mapping[str, Cut] = field(default_factory=dict)
    """Message (its unit's key and place in the unit) -> where its text was cut (so the same cut repeats)."""
    notes: Mapping[str, str] = field(default_factory=dict)
    """Marker id -> the marker's text as it was sent (so the same hole reads the same next turn)."""
    hole_starts: frozenset[str] = frozenset()
    """Keys of the units that begin a hole: holes side by side stay apart next turn, each marker as
    it was sent."""
    headroom: float = 0.0
    """The share of the budget this cut left free (0: nothing was cut): a check of the fit by the
    server aims it there, as the engine did."""
    held: bool = False
    """The fit is over its target because what must be kept needs the room: the newest unit is
    kept whole up to the budget rather than cut for the next turns' room. A check of the fit by
    the server takes it as it is (cut tighter, the newest unit would be shrunk)."""
    budget: int = 0
    """The budget the cuts were made for (0: unknown, a plan from before it was kept): a window
    grown well past it is used, not held to the old cuts (`GROWN`)."""
    shown: bool = True
    """The markers name their references (`holes.shows_refs`): decided at a conversation's first
    cut and kept, so that a count that moves between turns never rewrites a marker sent."""

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON values, for a store several instances share."""
        return {
            "evicted": sorted(self.evicted),
            "shrunk": {k: [c.target, c.head, c.tail, c.elided, int(c.legend)] for k, c in self.shrunk.items()},
            "notes": dict(self.notes),
            "hole_starts": sorted(self.hole_starts),
            "headroom": self.headroom,
            "held": self.held,
            "budget": self.budget,
            "shown": self.shown,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """The plan `to_json` wrote; a ValueError (or KeyError, TypeError) for anything else."""
        return cls(
            frozenset(str(k) for k in data["evicted"]),
            {str(k): _cut(v) for k, v in data["shrunk"].items()},
            {str(k): str(v) for k, v in data["notes"].items()},
            frozenset(str(k) for k in data["hole_starts"]),
            float(data["headroom"]),
            bool(data["held"]),
            int(data.get("budget", 0)),
            bool(data.get("shown", True)),
        )

    @property
    def footprint(self) -> int:
        """About the bytes this plan holds in memory (its keys, sets and texts), to bound how many are kept."""
        keys = sum(sys.getsizeof(k) for k in self.evicted) + sum(sys.getsizeof(k) + 80 for k in self.shrunk)
        notes = sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in self.notes.items())
        return sys.getsizeof(self.evicted) + sys.getsizeof(self.shrunk) + sys.getsizeof(self.notes) + keys + notes


def _cut(values: Any) -> Cut:
    """A cut as `Plan.to_json` wrote it: four numbers, and whether its note carries the legend."""
    target, head, tail, elided, *legend = (int(n) for n in values)
    return Cut(target, head, tail, elided, bool(legend and legend[0]))


@dataclass(slots=True)
class ChatResult:
    messages: list[Mapping[str, Any]] | None
    """What to send; None when nothing changed (forward the original bytes)."""
    report: Report
    plan: Plan


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
    headroom: float | None = None,
    refs: Refs = Refs(),
) -> ChatResult:
    """Fit `conversation` into `budget` tokens (tools and `fixed_tokens` of template included).

    A conversation of up to `admit` tokens (default: the budget) is left as it is: the backend
    would serve it whole. One over that is cut below `budget` by `headroom` (a share of it;
    default: what a turn adds, `headroom_share`), so that the next turns append; what must be kept
    may use the whole budget.
    `digests` maps a hole's marker id (from an earlier run's report) to a summary of what it held;
    a hole that comes out the same carries its digest inside the marker, within the budget.
    `refs` names what markers stand for (keyed references) and how to read it back.
    """
    fixed = fixed_tokens + counter.tools(conversation.tools)
    cost = [counter.message(m) for m in conversation.messages]
    limit = budget if admit is None else max(admit, budget)
    if fixed + sum(cost) <= limit:  # the common case, decided before any of the bookkeeping
        return ChatResult(None, as_sent(fixed + sum(cost), limit, counter), Plan())
    share = headroom_share(conversation.messages, cost, budget) if headroom is None else headroom
    given_way: list[str] = []
    if previous is not None and previous.budget and budget >= previous.budget * GROWN and (previous.evicted or previous.shrunk):
        given_way.append(f"{WINDOW_GREW} from {previous.budget} to {budget} tokens: cut afresh, the earlier cuts dropped")
        previous = None

    def fit(within: int, plan: Plan | None) -> ChatResult:
        result = _ChatCompaction(conversation, within, counter, keep_recent, plan or Plan(), fixed, cost, digests or {}, share, refs).run()
        plan = replace(result.plan, budget=budget) if result.report.compacted else result.plan
        report = replace(result.report, notes=(*given_way, *result.report.notes)) if given_way else result.report
        return ChatResult(result.messages, report, plan)

    try:
        return _fitted(fit, budget, previous)
    except BudgetTooSmall:
        if previous is None or not (previous.evicted or previous.shrunk):
            raise
    # the earlier turns' cuts cannot hold what must be kept now: they give way to a fresh fit,
    # which a conversation sent as new would get
    given_way.append(f"{GAVE_WAY}: cut afresh")
    return _fitted(fit, budget, None)


def _fitted(fit: Callable[[int, Plan | None], ChatResult], budget: int, previous: Plan | None) -> ChatResult:
    """`fit` within `budget`, or a little over it where the engine's steps land within it after all."""
    try:
        return fit(budget, previous)
    except BudgetTooSmall as short:
        # The engine's steps (whole units out, middle-out shrinks) can overshoot what it names as
        # the least: granted the few tokens it says it lacks, the same steps may land within the
        # first budget. A bounded search for that fit, before a refusal a few tokens short.
        shortfall = short.required - budget
        if not 0 < shortfall <= max(NEAR_MISS_TOKENS, budget // 50):
            raise
        for extra in (shortfall, 2 * shortfall + MARKER_SLACK, 4 * shortfall + 2 * MARKER_SLACK):
            try:
                nearer = fit(budget + extra, previous)
            except BudgetTooSmall:
                continue
            if nearer.report.final_tokens <= budget:
                return replace(nearer, report=replace(nearer.report, budget=budget))
        raise


def as_sent(tokens: int, budget: int, counter: Counter) -> Report:
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
        digests: Mapping[str, str],
        headroom: float,
        refs: Refs = Refs(),
    ) -> None:
        self.msgs = list(conv.messages)
        self.budget = budget
        self.headroom = headroom
        self.target = recut_target(budget, headroom)
        """What evictions aim at: the budget less the headroom. Shrinking a kept message aims at the
        budget itself: room for the next turns is not worth cutting into what must be kept."""
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
        # the head: up to the task's message (after the agent's own context, where it sends that as a
        # message of its own), never the request itself
        head = min(conv.task_index(), n - 2)
        pinned = {u for u in self.units if any(self.msgs[i].pinned or i <= head for i in u.indices)}
        self.fresh = frozenset(self.unit_of[n - 1].indices) if n else frozenset()
        """The newest unit (the tool result just read, the user's latest words): shrunk last."""
        self.pinned = [u for u in self.units if u in pinned]
        self.protected = [u for u in self.units if u not in pinned and protected.intersection(u.indices)]
        guarded = pinned | set(self.protected)
        self.evictable = [u for u in self.units if u not in guarded]
        self.largest = max((self.unit_cost[u] for u in self.evictable), default=1)
        """The biggest evictable unit: sizes are classed by their ratio to it (`stalest_biggest`)."""
        self.evicted: set[Unit] = set()
        self.sticky: set[Unit] = set()
        """Units evicted last turn, evicted again before anything else is decided."""
        self.kept = sum(self.cost)
        self.shrunk: dict[int, tuple[Message, int, Cut]] = {}
        """index -> (the shrunk message, its tokens, where its text was cut)"""
        self.refs = refs
        cut_before = bool(previous.evicted or previous.shrunk)
        shown = previous.shown if cut_before else shows_refs(budget, counter, refs.url)
        self.holes = Holes(self.msgs, self.cost, counter, digests, refs, shown=shown)
        self.cap = int(budget * MARKER_SHARE * MARKER_MARGIN)
        """The most the markers may take together before their holes merge."""

    def run(self) -> ChatResult:
        original = self.fixed + self.kept
        notes: list[str] = []
        pinned = self.fixed + sum(self.unit_cost[u] for u in self.pinned)
        if pinned > self.budget:
            what = "the system prompt, the tool definitions and the conversation's opening"
            own = self.fixed + sum(c for m, c in zip(self.msgs, self.cost, strict=True) if m.pinned)
            if own > self.budget:  # the agent's own part: no conversation is small enough
                raise self.too_small(what, own, math.ceil(pinned / (1 - self.headroom)))
            # the opening (a pasted document, say) cannot be kept byte for byte in any budget left:
            # it is shrunk middle-out like any message that must be kept, its start and end whole
            opening = [u for u in self.pinned if not any(self.msgs[i].pinned for i in u.indices)]
            self.pinned = [u for u in self.pinned if u not in opening]
            self.protected = [u for u in self.units if u in opening or u in self.protected]
            notes.append(OPENING_SHRUNK)

        last = self.repeat_previous()
        cut = last is None or self.total() > self.budget
        if last is None:
            self.evict_until(self.target, sorted(self.evictable, key=self.stalest_biggest))
            self.bridge()
            self.give_back(self.target, shrink_next=True)
            self.shrink_protected(self.budget)
            self.must_fit()
            self.refill(self.target)
            self.fill(self.target)
        elif cut and (changed := self.recut(last)) is not None:
            notes.append(changed)
        if (merged := self.merge()) is not None:  # also where last turn's cuts repeat: the share is a promise
            notes.append(merged)

        sent = render(self.msgs, self.cost, self.shrunk, self.holes, written=self.previous.notes, fixed=self.fixed, counter=self.counter)
        if unkept := [ref for ref in sent.evicted if not kept(ref)]:
            notes.append(
                f"{len(unkept)} removed part{'s' if len(unkept) > 1 else ''} over the archive's bound of {self.refs.most_bytes:,} "
                "bytes: not kept, and their markers say so instead of naming a reference"
            )
        headroom = room = self.headroom if cut else self.previous.headroom
        held = cut and self.total() > self.target and self.evicted.issuperset(self.evictable)
        if held:  # all that could go is gone: the room left is what the kept part leaves, and the target is said so
            room = max(self.budget - sent.tokens, 0) / self.budget
            newest = "shrunk to fit" if self.fresh.intersection(self.shrunk) else "whole"
            notes.append(
                f"what must be kept (the head, the latest turns and the file just read, {newest}) takes "
                f"{sent.tokens} of the budget's {self.budget} tokens: the cut leaves "
                f"{room:.0%} of it free, less than its headroom of {self.headroom:.0%}"
            )
        report = replace(sent.told(as_sent(original, self.budget, self.counter)), headroom=room, notes=tuple(notes))
        starts = {h[0] for h in self.holes}
        plan = Plan(
            evicted=frozenset(u.key for u in self.evicted),
            shrunk={self.cut_key(i): c for i, (_, _, c) in self.shrunk.items() if self.unit_of[i] not in self.evicted},
            notes=sent.notes,
            hole_starts=frozenset(u.key for u in self.evicted if min(u.indices) in starts),
            headroom=headroom,
            held=held,
            shown=self.holes.shown,
        )
        return ChatResult([m.raw for m in sent.messages], report, plan)

    # -- sizes ------------------------------------------------------------------------------

    def evict(self, unit: Unit) -> None:
        self.evicted.add(unit)
        self.kept -= self.unit_size(unit)
        self.holes.add(unit.indices)

    def readmit(self, unit: Unit) -> None:
        self.evicted.discard(unit)
        self.kept += self.unit_size(unit)
        self.holes.remove(unit.indices)

    def total_taken_back(self, unit: Unit) -> int:
        """What `total` would be with an evicted unit taken back: weighed by the holes without
        taking it back (the engine weighs many units that stay out), or, for a unit in more than
        one run, by taking it back and evicting it again."""
        markers = self.holes.taken_back(unit.indices)
        if markers is not None:
            return self.total() + self.unit_size(unit) + markers
        self.readmit(unit)
        total = self.total()
        self.evict(unit)
        return total

    def unit_size(self, unit: Unit) -> int:
        """What a unit adds to the kept messages as its messages stand (shrunk or whole)."""
        return sum(self.size(i) for i in unit.indices)

    def size(self, i: int) -> int:
        return self.shrunk[i][1] if i in self.shrunk else self.cost[i]

    def total(self) -> int:
        """Tokens of what would be sent now: kept messages, shrunk sizes and hole markers (with
        the legend, which the first says)."""
        return self.fixed + self.kept + self.holes.marker_total + self.hole_legend()

    def hole_legend(self) -> int:
        """The legend's cost where a hole's marker says it: there are holes, and no cut text says it."""
        if not self.holes.starts or any(cut.legend for _, _, cut in self.shrunk.values()):
            return 0
        return self.holes.legend_cost()

    def marker_tokens(self) -> int:
        """What ContextPaw's own notes take: the holes' markers, the legend, each shrunk message's note."""
        notes = self.holes.marker_total + self.hole_legend()
        for i, (_, _, cut) in self.shrunk.items():
            notes += self.note_cost(cut.elided, self.msgs[i].content_text.count("\n", cut.head, cut.tail), cut.legend)
        return notes

    def note_cost(self, tokens: int, lines: int, legend: bool) -> int:
        """Tokens of the note in a text cut middle-out, its reference sized by a placeholder."""
        shown = PLACEHOLDER_ID if self.holes.shown else ""
        return self.counter.text(elision_text(tokens, lines, shown, self.refs.url, not legend))

    # -- steps ------------------------------------------------------------------------------

    def repeat_previous(self) -> int | None:
        """Make last turn's cuts again: its evicted units stay evicted (sticky) and its shrunk
        messages are cut at the same characters, whatever the counter thinks of them now. Returns
        the index of the last message a cut stands for (None: last turn cut nothing here)."""
        for unit in self.evictable:
            if unit.key in self.previous.evicted:
                if unit.key in self.previous.hole_starts:
                    self.holes.walls.add(min(unit.indices))
                self.evict(unit)
        self.holes.seal()
        self.sticky = set(self.evicted)
        ends = [max(u.indices) for u in self.sticky]
        for unit in self.units:
            for i in unit.indices:
                cut = self.previous.shrunk.get(self.cut_key(i))
                if cut is not None and unit not in self.evicted and self.msgs[i].content_text:
                    self.cut(i, cut)
                    ends.append(i)
        return max(ends, default=None)

    def recut(self, last: int) -> str | None:
        """A conversation that overflows again, last cut at message `last`: what was sent up to
        there is what the server cached, so the new cut goes after it, to the target (the headroom
        lets the next turns append instead of each cutting anew).

        Units after the last cut go first, biggest first, each hole with a marker of its own: a
        marker once sent is never rewritten. A message shrunk last is cut deeper next, then
        protected messages after the last cut are shrunk (not the newest). Only when the target
        cannot hold the prefix with what must follow, the newest unit whole, is anything before
        it cut (and the newest shrunk only after that, into the budget), and the note returned says
        so (None: nothing before it was cut)."""
        target = self.target
        after = [u for u in self.evictable if min(u.indices) > last]
        self.evict_until(target, sorted(after, key=self.stalest_biggest))
        changed = None
        ask = 0
        for _ in range(SHRINK_ROUNDS if last in self.shrunk else 0):  # a cut's cost does not fall exactly as its text's
            before = self.total()
            if before <= target:
                break
            # a text is cut at whole lines: where asking for what is over moved nothing, ask twice as much
            ask = before - target if ask == 0 else 2 * ask
            if not self.shrink(last, ask):
                break
            changed = "its cut goes deeper"
            if self.total() < before:
                ask = 0
        if self.total() > target and self.prefix_tokens(last) <= target:
            self.shrink_protected(self.budget, after=last, fresh=False)
        if self.total() > target:
            prefix = self.prefix_tokens(last)
            changed = (
                f"the {prefix} tokens up to it leave {target - prefix} of the {target}-token target, too little for what must follow whole"
            )
            # the prefix gives up its latest units until it leaves the headroom, no more: what it
            # keeps is still cached, and what follows it is shrunk into the room
            latest_first = sorted(self.evictable, key=lambda u: u.indices, reverse=True)
            self.evict_until(target, latest_first, lambda: self.prefix_tokens(last))
            self.shrink_protected(self.budget, after=last, fresh=False)
            if self.total() > target:
                self.evict_until(target, latest_first)
                self.shrink_protected(self.budget)
                self.must_fit()
            earliest = min((min(u.indices) for u in self.evicted - self.sticky if min(u.indices) <= last), default=last)
            self.holes.unwall(earliest)
        self.bridge()
        self.give_back(target)
        self.refill(target)
        self.fill(target)
        return f"{EARLIER_CUT} (message {last}): {changed}" if changed else None

    def prefix_tokens(self, last: int) -> int:
        """Tokens of what is sent up to message `last` as the cuts stand: kept messages and markers."""
        kept = sum(self.size(i) for i in range(last + 1) if self.unit_of[i] not in self.evicted)
        return self.fixed + kept + sum(self.holes.marker_cost(h) for h in self.holes if h[1] <= last)

    def shrink_protected(self, limit: int, after: int = -1, fresh: bool = True) -> None:
        """Shrink protected messages middle-out, biggest first and the newest unit last (the file
        the agent just read reaches it whole wherever the rest can give way): the others down to
        the target, as evicted units would make room, the newest until the rest fits in `limit`,
        or none can give more. With `after`, only messages after it, and of the units
        that straddle it also those that are not protected (they cannot go without what comes
        before). Without `fresh`, the newest unit is left whole: the caller has older units to
        evict first.

        A message's cost does not fall exactly as far as its text's (the note, a content part, how
        the cut tokenizes), so a pass that lands a few tokens over is followed by another, which
        cuts deeper by what is still over, until it fits or no message can give more.
        """
        units = (
            self.protected
            if after < 0
            else [*self.protected, *(u for u in self.evictable if u not in self.evicted and min(u.indices) <= after)]
        )
        candidates = sorted(
            (i for u in units for i in u.indices if i > after and self.msgs[i].content_text),
            key=lambda i: (-self.cost[i], i),
        )
        # older messages give way down to the target, as evicted units would; the newest only to `limit`
        rest = [i for i in candidates if i not in self.fresh]
        newest = [i for i in candidates if i in self.fresh] if fresh else []
        for group, aim in ((rest, min(limit, self.target)), (newest, limit)):
            for _ in range(SHRINK_ROUNDS):
                gave = False
                for i in group:
                    over = self.total() - aim
                    if over <= 0:
                        break
                    gave = self.shrink(i, over) or gave
                if not gave or self.total() <= aim:
                    break
            if self.total() <= limit:
                return

    def must_fit(self) -> None:
        """The last resort when shrinking did not reach the budget: the least this request can be,
        which may still fit; if not, the refusal."""
        if self.total() > self.budget:
            self.least()
        if self.total() > self.budget:
            raise self.too_small("the task, the recent messages and the markers")

    def least(self) -> None:
        """Cut to the least this request can be: everything evictable gone in one hole, every
        protected message at its floor."""
        self.holes.unwall(-1)
        for unit in self.evictable:
            if unit not in self.evicted:
                self.evict(unit)
        for i in (i for u in self.protected for i in u.indices if self.msgs[i].content_text):
            while self.shrink(i, self.size(i)):
                pass

    def too_small(self, what: str, head: int | None = None, least_budget: int | None = None) -> BudgetTooSmall:
        """The refusal, naming the least this request can be cut to, so a budget of that much fits it
        (and, when the agent's own part alone is over the budget, its tokens and the budget that
        would hold what is never cut)."""
        self.least()
        original = self.fixed + sum(self.cost)
        required = self.total()
        if not self.holes.shown and shows_refs(required, self.counter, self.refs.url):
            required += self.named_refs_cost()  # a budget of that much has its markers name their references
        return BudgetTooSmall(required, self.budget, what, original, self.counter, head, least_budget)

    def named_refs_cost(self) -> int:
        """What the markers would add if they named their references (and said the legend once)."""
        shown = Holes(self.msgs, self.cost, self.counter, self.holes.digests, self.refs, shown=True)
        shown.add(i for u in self.evicted for i in u.indices)
        notes = shown.marker_total + (shown.legend_cost() if shown.starts else 0) - self.holes.marker_total
        per_cut = self.counter.text(elision_text(1, 0, PLACEHOLDER_ID, self.refs.url)) - self.counter.text(
            elision_text(1, 0, "", self.refs.url)
        )
        legend = 0 if shown.starts or not self.shrunk else shown.legend_cost()
        slack = MARKER_SLACK * (1 + len(self.shrunk) + len(shown.starts))  # notes of a new length cut texts anew
        return max(notes, 0) + len(self.shrunk) * max(per_cut, 0) + legend + slack

    def shrink(self, i: int, over: int) -> bool:
        """Cut message `i`'s text middle-out by `over` more tokens (to no less than the floor);
        False if it cannot give any more."""
        message = self.msgs[i]
        text = message.content_text
        own = self.counter.text(text)
        current = self.shrunk.get(i)
        now = current[2].target if current is not None else own
        # the request's first note says how to read it back; a text cut where no other note does, says it
        legend = not self.holes.starts and not any(c.legend for j, (_, _, c) in self.shrunk.items() if j != i)
        cost = self.note_cost(own, text.count("\n"), legend)
        # a cut takes at least a few times what its note costs: a note that stands for a few tokens
        # is a marker the model reads for nothing
        target = max(SHRINK_FLOOR + cost, now - max(over, NIBBLE * cost) if current is None else now - over)
        if target >= now:
            return False
        self.cut(i, shrink_text(text, target, self.counter, self.refs.url, shown=self.holes.shown, legend=legend))
        return True

    def cut(self, i: int, cut: Cut) -> None:
        text = self.msgs[i].content_text
        marker_id = cut_ref(self.refs, text, cut) if self.holes.shown else ""
        smaller = self.msgs[i].with_content(cut.apply(text, marker_id, self.refs.url))
        size = self.counter.message(smaller)
        self.kept += size - self.size(i)
        self.shrunk[i] = (smaller, size, cut)

    def cut_key(self, i: int) -> str:
        """What names message `i` in a plan's cuts: its unit's key and its place in the unit."""
        unit = self.unit_of[i]
        return f"{unit.key}:{unit.indices.index(i)}"

    def stalest_biggest(self, unit: Unit) -> tuple[int, tuple[int, ...]]:
        """The eviction order: the biggest units first, and among units of about one size (of one
        class of `SIZE_CLASS` times, counted down from the biggest) the oldest, so that a run of like tool results is cut from its
        stale end, and the holes gather before what the agent read last."""
        return int(math.log(self.largest / max(self.unit_cost[unit], 1), SIZE_CLASS)), unit.indices

    def biggest(self, unit: Unit) -> int:
        return max(unit.indices, key=lambda i: (self.cost[i], -i))

    def unshrink(self, i: int) -> None:
        _, size, _ = self.shrunk.pop(i)
        self.kept -= size - self.cost[i]

    def bridge(self) -> None:
        """Evict each unit kept between two holes this turn's cut may join, where its marker saved
        costs more than the unit (a chat's one-line answer between two evicted pastes): a cut makes
        one hole, not one per message it took, and the model reads no answers to questions gone."""
        for unit in self.evictable:
            lo, hi = min(unit.indices), max(unit.indices)
            if unit in self.evicted or lo - 1 not in self.holes.start or hi + 1 not in self.holes.end:
                continue
            if lo in self.holes.walls or hi + 1 in self.holes.walls:
                continue
            before = self.total()
            self.evict(unit)
            if self.total() > before:
                self.readmit(unit)

    def give_back(self, limit: int, shrink_next: bool = False) -> None:
        """Take back, newest first, the units at the newest end of each hole this turn's cut made,
        while the total stays within `limit`. Evicting small units one by one costs a marker each,
        so the cut took more than it needed until the bridge joined them into one hole; taking back
        at a hole's end never splits it. On a first cut (`shrink_next`), the first end unit too big
        to take back whole is offered to `fill`, shrunk into the room left; a re-cut leaves it out,
        as its note would be one marker more each turn."""
        offered = not shrink_next
        for start in sorted(self.holes.starts, reverse=True):
            while start in self.holes.end:
                unit = self.unit_of[self.holes.end[start]]
                if unit in self.sticky or min(unit.indices) < start:
                    break
                if self.total_taken_back(unit) > limit:
                    if not offered:
                        offered = True
                        self.fill(limit, [unit])
                    break
                self.readmit(unit)

    def merge(self) -> str | None:
        """Where the markers take more than `MARKER_SHARE` of the budget, their holes, and the texts
        cut that could go, become one hole: what lay between them goes too (a chat's short answers
        between evicted questions), then the hole gives back its newest units while the target
        holds them. The one marker that stands for them all is new, so the prompt is read again
        from the first hole on: said in the notes (None: the markers are within their share, or
        there is one hole)."""
        tokens = self.marker_tokens()
        if tokens > self.cap:
            self.unshrink_for_markers()
        holes = list(self.holes)
        cut = [i for i in self.shrunk if self.unit_of[i] in self.evictable]
        if len(holes) + len(cut) < 2 or self.marker_tokens() <= self.cap:
            return None
        if any(self.holes.digests.get(self.holes.marker_id(h)) for h in holes):
            return None  # a digest is what the model reads of its hole, asked for (contextpaw_summarize): kept
        ends = [i for hole in holes for i in hole] + cut
        first, last = min(ends), max(ends)
        self.holes.unwall(-1)
        for unit in self.evictable:
            if unit not in self.evicted and first <= max(unit.indices) and min(unit.indices) <= last:
                for i in unit.indices:
                    if i in self.shrunk:
                        self.unshrink(i)
                self.evict(unit)
        while len(self.holes.starts) == 1:  # the newest end of the one hole gives back: it stays one hole
            start = self.holes.starts[0]
            unit = self.unit_of[self.holes.end[start]]
            if min(unit.indices) <= start or self.total_taken_back(unit) > self.target:
                break
            self.readmit(unit)
        if len(self.holes.starts) == 1:  # the room left takes the hole's newest unit, shrunk
            self.fill(self.target, [self.unit_of[self.holes.end[self.holes.starts[0]]]])
        return (
            f"{MERGED}: {len(holes) + len(cut)} markers took {tokens} tokens, over {MARKER_SHARE:.0%} of the budget "
            f"({self.cap}); their holes are one now, with what lay between them"
        )

    def unshrink_for_markers(self) -> None:
        """Take back this turn's cuts into kept messages that only made room for the next turns
        (the budget holds them whole), while the markers are over their share: a note is worth
        less than the room it makes when the window is this small."""
        for i in sorted(self.shrunk, key=lambda i: self.shrunk[i][2].elided):
            if self.marker_tokens() <= self.cap:
                return
            if self.cut_key(i) in self.previous.shrunk or self.unit_of[i] in self.evicted:
                continue
            cut = self.shrunk[i][2]
            self.unshrink(i)
            if self.total() > self.budget:
                self.cut(i, cut)

    def fill(self, limit: int, units: list[Unit] | None = None) -> None:
        """Use room that whole units could not, up to `limit`: re-admit the smallest unit evicted
        this turn (or the first of `units` that can) that fits once its biggest message is shrunk
        middle-out (its call and results stay together), where its note keeps the markers within
        their share, and, taken from a hole's end, it makes no hole two. Last turn's holes stay as
        they were sent."""
        if units is None:
            ends = (u for u in self.evicted - self.sticky if not self.holes.splits(u.indices))
            units = sorted(ends, key=lambda u: (self.unit_cost[u], u.indices))
        for unit in units:
            if self.total() >= limit * FILL:
                return
            biggest = self.biggest(unit)
            if not self.msgs[biggest].content_text:
                continue
            self.readmit(unit)
            over = self.total() - limit
            if self.shrink(biggest, over) and self.total() <= limit and self.marker_tokens() <= self.cap:
                return
            if biggest in self.shrunk:
                self.unshrink(biggest)
            self.evict(unit)

    def evict_until(self, limit: int, order: list[Unit], size: Callable[[], int] | None = None) -> None:
        """Evict units in `order` until the total (or `size`) fits in `limit`; then take back each
        of them whose hole's marker costs more than the unit did (a small unit between kept ones)."""
        # Markers only add tokens, so the kept sum is a cheap lower bound for the full total.
        measure = size or self.total
        fits: Callable[[], bool] = (
            (lambda: measure() <= limit) if size else (lambda: self.fixed + self.kept <= limit and self.total() <= limit)
        )
        evicted = []
        for unit in order:
            if fits():
                break
            if unit not in self.evicted:
                self.evict(unit)
                evicted.append(unit)
        for unit in evicted:
            if size is None:
                if self.total_taken_back(unit) <= self.total():  # its marker costs more than it did
                    self.readmit(unit)
                continue
            before = measure()
            self.readmit(unit)
            if measure() > before:
                self.evict(unit)

    def refill(self, limit: int) -> None:
        """Re-admit units evicted this turn that fit in the room left (up to `limit`), biggest first
        and, among units of about one size, the newest (the holes stay before what is kept)."""
        for unit in sorted(self.evicted - self.sticky, key=lambda u: (self.stalest_biggest(u)[0], -max(u.indices))):
            if self.fixed + self.kept + self.unit_cost[unit] > limit:
                continue
            taken_back = self.total_taken_back(unit)
            if taken_back <= limit and taken_back - self.total() <= self.unit_size(unit):  # no hole split in two
                self.readmit(unit)
