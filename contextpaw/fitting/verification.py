"""The search for the fullest cut llama-server's count confirms, sans I/O.

The sizer cuts a request with our per-text count, which is not the server's: a shrunk text is
estimated, a text tokenizes differently inside the template, and per-text counts of an agent's
dumps run high. So the server counts the whole of what would be sent, and this module says what
each count means (`Reading`) and what follows from it (`Send` a fit, or `Refit` to another budget
of ours), one step per count, in a table of steps by reading. The sizer does the fitting and the
asking; nothing here does I/O, so every path is tested with made-up counts.

What the search aims at (`Search.target`): the budget for a conversation's first cut; for a re-cut, the
budget less the engine's headroom, so that the next turns append. A fit within the budget that
only repeats last turn's cuts goes out at once: nothing new was cut. A fit over is cut further by
what our count missed; one well under is made fuller, between the fullest the server confirmed
and the least it counted over, while room is left.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from contextpaw.core.compact import Plan, recut_target
from contextpaw.fitting.budget import Budget
from contextpaw.fitting.engine import Fitted

FILL_SLACK = 8
"""Tokens (or a hundredth of the budget, if more) our count may overstate a cut before it is made
again to use what the server's count shows is left."""


class Reading(Enum):
    """What the server's count of one fit says, in the order it is read."""

    AS_SENT = "the request as it came, within what the budget admits"
    APPENDS = "within the budget, with last turn's cuts and no others"
    CONFIRMED = "within the target, or within the budget where what must be kept holds it over the target"
    PAST_CONFIRMED = "over the target, after a fit within it was confirmed"
    PAST_HEADROOM = "within the budget but over a cut's target, none confirmed yet"
    PAST_LOOSENED = "over, cut to the budget loosened by last turn's overcount"
    OVER = "over the budget"


@dataclass(frozen=True, slots=True)
class Send:
    """This fit goes out; the conversation's next turn starts `overcount` looser than its budget."""

    fitted: Fitted
    overcount: int


@dataclass(frozen=True, slots=True)
class Refit:
    """Cut again to this budget of ours, and count that."""

    budget: Budget
    headroom: float | None = None
    """Leave this share of the budget free instead (None: the fit's own): a fit within the budget
    but past its target is cut deeper by its evictions, while what must be kept, the newest unit,
    may still use the whole budget."""


Step = Send | Refit


class Search:
    """One request's search: fed each fit with the server's count of it, says the next step."""

    def __init__(self, budget: Budget, start: Budget, previous: Plan | None) -> None:
        self.budget = budget
        """The budget the client is told, in the server's tokens."""
        self.previous = previous
        self.tightened = start
        """Our budget for the fit being counted."""
        self.target = budget.tokens
        """What the server's count of a fit is aimed at: the budget less the headroom the engine
        left (`Plan.headroom`), so that the next turns append. Filling a cut to the budget made
        every following turn cut again (an agent loop at -c 2048: 13 re-cuts in 21 turns, each
        ending at 93-97% of the budget)."""
        self.confirmed: Send | None = None
        """The fullest fit the server counted at or under the target."""
        self.under: tuple[int, int] | None = None
        """Our budget for the confirmed fit, and the server's count of it."""
        self.over: tuple[int, int] | None = None
        """Our least budget whose fit the server counted over the target, and its count."""
        self.spare: Send | None = None
        """A re-cut's fit within the budget but over the target: sent if none nearer comes."""
        self._steps: dict[Reading, Callable[[Fitted, int, int, bool], Step]] = {
            Reading.AS_SENT: self._as_sent,
            Reading.APPENDS: self._appends,
            Reading.CONFIRMED: self._confirmed,
            Reading.PAST_CONFIRMED: self._past_confirmed,
            Reading.PAST_HEADROOM: self._past_headroom,
            Reading.PAST_LOOSENED: self._past_loosened,
            Reading.OVER: self._over,
        }

    def best(self) -> Send | None:
        """What goes out when the counts end: the fullest fit confirmed under the target, else the spare."""
        return self.confirmed or self.spare

    def within(self, fitted: Fitted, total: int) -> bool:
        """Whether the server's count fits the budget (the request as it came: what the budget admits)."""
        return total <= (self.budget.tokens if fitted.body is not None else self.budget.admits)

    def read(self, fitted: Fitted, total: int) -> Reading:
        within = self.within(fitted, total)
        if within and fitted.body is None:
            return Reading.AS_SENT
        if within and _repeated(fitted.plan, self.previous):
            return Reading.APPENDS
        if within and (total <= self.target or (fitted.plan is not None and fitted.plan.held)):
            return Reading.CONFIRMED
        if self.confirmed is not None:
            return Reading.PAST_CONFIRMED
        if within:
            return Reading.PAST_HEADROOM
        if self.tightened.margin < self.budget.margin:
            return Reading.PAST_LOOSENED
        return Reading.OVER

    def counted(self, fitted: Fitted, total: int, last: bool) -> Step:
        """The step after the server counted `fitted` at `total` (`last`: no more counts to come).
        A fit within the budget carries the server's count from here on (in the fit the step sends
        or keeps)."""
        if fitted.plan is not None and fitted.plan.headroom:
            self.target = recut_target(self.budget.tokens, fitted.plan.headroom)
        ours = fitted.report.final_tokens
        reading = self.read(fitted, total)
        if self.within(fitted, total):
            fitted = fitted.told(final_tokens=total, exact=True)
        return self._steps[reading](fitted, ours, total, last)

    # -- the steps, one a reading -------------------------------------------------------------

    def _as_sent(self, fitted: Fitted, ours: int, total: int, last: bool) -> Step:
        return Send(fitted.told(original_tokens=total), 0)

    def _appends(self, fitted: Fitted, ours: int, total: int, last: bool) -> Step:
        """The whole cached prefix is served: re-admitting anything would move it."""
        return Send(fitted, self._overcount(ours, total))

    def _confirmed(self, fitted: Fitted, ours: int, total: int, last: bool) -> Step:
        if self.confirmed is None or total >= self.confirmed.fitted.report.final_tokens:
            self.confirmed, self.under = Send(fitted, self._overcount(ours, total)), (self.tightened.tokens, total)
        assert self.under is not None
        room = self.target - self.confirmed.fitted.report.final_tokens
        if last or room < max(FILL_SLACK, self.budget.tokens // 100):
            return self.confirmed
        # none over yet: as much further as the server's count of the last one says is left
        aim = (
            _between(self.under, self.over, self.target) if self.over is not None else self.under[0] * self.target // max(self.under[1], 1)
        )
        return self._aimed(aim)

    def _past_confirmed(self, fitted: Fitted, ours: int, total: int, last: bool) -> Step:
        """A fuller fit went over: aim between it and the one confirmed. Every budget from our count
        of it up gives this same fit, so the line runs from there: aiming between budgets would
        repeat it, a few tokens at a time, when the server's count is just over."""
        reach = min(self.tightened.tokens, ours)
        if self.over is None or reach < self.over[0]:
            self.over = (reach, total)
        assert self.under is not None
        return self._aimed(None if last else _between(self.under, self.over, self.target))

    def _past_headroom(self, fitted: Fitted, ours: int, total: int, last: bool) -> Step:
        """A cut the server counts past its target, within the budget: its evictions aim as much
        lower as the count says, under the same budget."""
        if self.spare is None or total < self.spare.fitted.report.final_tokens:
            self.spare = Send(fitted, self._overcount(ours, total))
        if last or fitted.plan is None:
            return self.spare
        aim = ours * self.target // total
        share = 1 - aim / max(self.tightened.tokens, 1)
        if share <= fitted.plan.headroom or share >= 1:
            return self.spare
        return Refit(self.tightened, headroom=share)

    def _past_loosened(self, fitted: Fitted, ours: int, total: int, last: bool) -> Step:
        """Last turn's overcount does not hold for this one: back to the budget."""
        self.tightened = self.budget
        return Refit(self.tightened)

    def _over(self, fitted: Fitted, ours: int, total: int, last: bool) -> Step:
        """Tighter by what our count of it missed."""
        budget, tightened = self.budget, self.tightened
        self.tightened = Budget(budget.window, budget.reserve, tightened.margin + max(total - ours, 1), limit=tightened.limit)
        return Refit(self.tightened)

    def _aimed(self, aim: int | None) -> Step:
        """A refit to our budget `aim`, or the confirmed fit when there is none to make."""
        assert self.confirmed is not None
        return self.confirmed if aim is None else self._refit(aim)

    def _refit(self, tokens: int) -> Refit:
        """A refit to exactly `tokens` of ours (it admits no more)."""
        budget = self.budget
        self.tightened = Budget(budget.window, budget.reserve, budget.window - budget.reserve - tokens, limit=0)
        return Refit(self.tightened)

    def _overcount(self, ours: int, total: int) -> int:
        """How much looser than the budget, in our count, the conversation's next turn starts: at
        least the budget this fit was made to (so that it repeats), and as far as the budget in our
        count at the rate ours ran over the server's on this fit (`ours` against `total`), so that
        a turn that only appends is seen to fit at once, however high our per-text counts run."""
        budget = self.budget.tokens
        return max(self.tightened.tokens, ours * budget // max(total, 1), budget) - budget


def _between(under: tuple[int, int], over: tuple[int, int], target: int) -> int | None:
    """Our budget whose fit the server should count at `target`, on the line through a fit it
    counted under and one it counted over (None: no whole token lies between them)."""
    (low, counted_low), (high, counted_high) = under, over
    if high - low <= 1:
        return None
    aim = low + (target - counted_low) * (high - low) // max(counted_high - counted_low, 1)
    return min(max(aim, low + 1), high - 1)


def _repeated(plan: Plan | None, previous: Plan | None) -> bool:
    """Whether a fit made last turn's cuts and no others."""
    return plan is not None and previous is not None and plan.evicted == previous.evicted and plan.shrunk == previous.shrunk
