"""Sizing a parsed request to its budget: what the engine is given, and whether the server agrees.

The engine (through `contextpaw.fitting`) fits to a budget with a counter. Here it gets the best
counter the backend allows (`CounterChoice`) and the conversation's last plan; where llama-server
counts whole requests, the template's cost as the server renders it, and a fit its count finds over
the budget is cut further; on a route where a cut cannot be undone, a budget the count's upper error
bound still fits in. No mitmproxy; what it asks the world goes through the counters.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Mapping

from contextpaw import wire
from contextpaw.calibration import CalibratedCounter, Calibration, Guard, calibration_key
from contextpaw.compact import BudgetTooSmall, Plan, recut_target
from contextpaw.counters import CounterChoice, rough_size
from contextpaw.fitting import Fitted, fit_chat, fit_prompt
from contextpaw.offload import off_loop
from contextpaw.report import Report
from contextpaw.state import LRU, SizedLRU
from contextpaw.tokens import Counter, EstimateCounter
from contextpaw.windows import Budget

VERIFY_ROUNDS = 5
"""Counts by the server of one request's fits: the first, then refits over the budget (cut further)
or well under it (made fuller)."""
MAX_FITS = 2 * VERIFY_ROUNDS
"""Fits made for one request at most, those that repeat a counted one included."""
FILL_SLACK = 8
"""Tokens (or a hundredth of the budget, if more) our count may overstate a cut before it is made
again to use what the server's count shows is left."""

Fit = Callable[[Budget], Fitted]
"""One fit of a parsed request with its counter and template cost, to a budget."""


def _fit_and_tell(fit: Callable[..., Fitted], budget: Budget) -> Fitted:
    """Fit (unchanged up to what the budget admits, else cut to its tokens), and build the report's
    removal rows where the fit runs: for a big request that is the worker thread, and thousands of
    rows built on the event loop would stall it."""
    fitted = fit(budget.tokens, admit=budget.admits)
    fitted.report.removal_rows()
    return fitted


class Sizer:
    """Fits parsed requests to their budgets, counted as well as the backend allows."""

    def __init__(
        self, counters: CounterChoice, calibration: Calibration, estimate: EstimateCounter, plans: SizedLRU, keep_recent: int
    ) -> None:
        self.counters = counters
        self.calibration = calibration
        self.estimate = estimate
        self.plans = plans
        """Each conversation's last `Plan` (the fitter's, which remembers them)."""
        self.keep_recent = keep_recent
        self.overcounts = LRU(plans.limit)
        """Conversation -> how much looser than the budget, in our count, its next turn's fit starts
        (`_overcount`: our count of its last cut ran that much over the server's): that turn
        repeats the cut and appends, instead of making a new cut to our count's error, which would
        move the cached prefix."""

    async def fit(
        self,
        parsed: wire.Chat | wire.Prompt,
        budget: Budget,
        backend: wire.Backend,
        big: bool,
        digests: Mapping[str, str] | None = None,
        previous: Plan | None = None,
        guard: Guard | None = None,
        shaped: bool = False,
    ) -> Fitted:
        """Fit with the conversation's last plan, in a worker thread when the request is big.

        Where the server counts whole requests (llama-server's chats), the decision rests on that
        count: a request it would serve whole goes out unchanged, and otherwise the difference
        between its count and ours is the template's real cost (a template that renders no tools
        makes it negative), so what must be kept is priced as the server prices it.

        With a `guard` (the request's content kind and word floor, on a route that cannot ask
        Ollama to refuse instead of cutting), an inexact count gets a budget its upper error bound
        still fits in, where what must be kept allows it: a cut there cannot be undone. Once
        calibration knows this kind of text, that bound is what it learned (never below what the
        request's words prove), not the estimate's whole width. Where an overshoot is refused
        rather than cut (`shaped`), the calibrated count is the shape's once it is learned."""
        small = await self.counters.small(backend, parsed, budget.tokens, big)
        counter, fixed = await self.counters.best(backend, parsed, small, big, shaped)
        # a request that may not fit is counted whole where the server can (even when its per-text
        # counting failed: the whole count is one call, and the decision rests on it)
        whole = None if small else await self.counters.exact_total(backend, parsed, parsed.body, big)
        scale = 1.0
        if whole is not None:
            if whole <= budget.admits:
                as_sent = Report(False, "none", whole, whole, budget.admits, counter="backend", exact=True, window=budget.window)
                return Fitted(None, as_sent)
            ours = await off_loop(big, functools.partial(parsed.tokens, counter, fixed))
            # The difference is the template's real cost, but never below nothing: a template may
            # drop the tools, while a count of the messages that runs high is theirs, and the check
            # after the cut makes the fit fuller. Should what must be kept not fit so, every text is
            # priced at the server's rate for the whole request instead, and the check says whether
            # that was right.
            around = parsed.fixed_cost(counter, fixed) if isinstance(parsed, wire.Chat) else fixed
            scale, base = whole / ours if 0 < whole < ours else 1.0, fixed
            fixed = max(fixed + whole - ours, fixed - around)
        start = budget
        if whole is not None and (overcount := self.overcounts.get(parsed.key)):
            start = Budget(budget.window, budget.reserve, budget.margin - overcount, limit=0)
        guarded, bound, why = start, None, ""
        if guard is not None and not counter.exact:
            guarded, bound, counter, why = await self._guarded(parsed, budget, backend, big, guard, counter)
        if isinstance(parsed, wire.Chat):  # what only a chat has: turns, a last plan, holes to put digests in
            previous = previous or self.plans.get(parsed.key)

        def with_fixed(fixed: int) -> Fit:
            if isinstance(parsed, wire.Chat):
                return functools.partial(fit_chat, parsed, counter=counter, fixed_tokens=fixed,
                                         keep_recent=self.keep_recent, previous=previous, digests=digests)  # fmt: skip
            return functools.partial(fit_prompt, parsed, counter=counter, fixed_tokens=fixed)

        fit = with_fixed(fixed)
        while True:
            try:
                fitted = await off_loop(big, functools.partial(_fit_and_tell, fit, guarded))
                break
            except BudgetTooSmall as e:
                e.counter = "backend" if whole is not None else counter.name
                if scale < 1:
                    counter, scale = CalibratedCounter(counter, scale), 1.0
                    fixed = base + whole - await off_loop(big, functools.partial(parsed.tokens, counter, base))
                    fit = with_fixed(fixed)
                    continue
                if guarded in (budget, start):
                    raise
                # what must be kept needs more than the guard leaves: as close to the guard as it
                # fits, else the full budget, and the check after the answer says what happened
                needed = budget.at_most(e.required)
                guarded = needed if guarded.tokens < needed.tokens < budget.tokens else budget
                why = "what must be kept needs this much"
        fitted.report.window = budget.window
        if guarded not in (budget, start):
            fitted.report.notes.append(
                f"budget {guarded.tokens} of {budget.tokens}: the count is an estimate, and this route cannot ask "
                f"Ollama to refuse instead of cutting ({why})"
            )
        if whole is None:
            return fitted if bound is None else dataclasses.replace(fitted, bound=bound)
        try:
            fitted, overcount = await self._verified(parsed, fitted, budget, start, backend, big, fit, previous)
        except BudgetTooSmall as e:
            e.counter = "backend"
            raise
        if fitted.body is not None and isinstance(parsed, wire.Chat):
            self.overcounts.put(parsed.key, overcount)
        # a refit under a tightened budget is told against the budget the client is told
        report = fitted.report
        report.counter, report.original_tokens, report.window, report.budget = "backend", whole, budget.window, budget.tokens
        return fitted

    async def _guarded(
        self, parsed: wire.Chat | wire.Prompt, budget: Budget, backend: wire.Backend, big: bool, guard: Guard, counter: Counter
    ) -> tuple[Budget, float, Counter, str]:
        """Where a cut cannot be forbidden: the budget the count's upper error bound still fits in,
        that bound (the verdict's), the counter it bounds, and what held the budget there.

        A request that is cut is sent at the budget's size at most, and that is what must be
        bounded. Samples of its kind bound a request of up to `reach`; a bigger one is held to that
        size if it does better than the estimate's whole width, and is learned from in turn. Once
        the kind is learned by shape, the calibrated shape count fits it: the byte factor, learned
        on whole requests, prices the prose a cut keeps at the rate of the dumps it evicts (an agent
        chat on Ollama's /v1 used 35-77% of its window so)."""
        key = calibration_key(backend, parsed.params.model)
        size = await off_loop(big, functools.partial(rough_size, parsed, self.estimate))
        factor = self.calibration.factor(key)
        sent = min(size, math.ceil(budget.tokens / factor))
        reach = self.calibration.kind_reach(key, guard.kind)
        by_shape = self.calibration.kind_bound(key, guard.kind, min(sent, reach), guard.shape_floor, shaped=True)
        learned = by_shape if by_shape is not None else self.calibration.kind_bound(key, guard.kind, min(sent, reach), guard.floor)
        bound = self.calibration.bounds(key)[1]
        guarded, why = budget.within(bound), f"this kind of text is not learned yet: its count may be {bound:.2f} times low"
        if learned is not None:
            by_kind = budget.within(learned) if reach >= sent else budget.within(learned).at_most(math.floor(reach * factor))
            if by_kind.tokens > guarded.tokens or reach >= sent:
                guarded, bound = by_kind, learned
                why = f"its count of this kind of text may be {learned:.2f} times low"
                if by_kind.tokens < budget.within(learned).tokens:
                    why = f"what was learned of this kind reaches requests of {by_kind.tokens} tokens"
                if by_shape is not None:
                    counter = CalibratedCounter(self.counters.shape, self.calibration.shape_factor(key) or 1.0)
        return guarded, bound, counter, why

    async def _verified(
        self,
        parsed: wire.Chat | wire.Prompt,
        fitted: Fitted,
        budget: Budget,
        start: Budget,
        backend: wire.Backend,
        big: bool,
        fit: Fit,
        previous: Plan | None,
    ) -> tuple[Fitted, int]:
        """Check a compacted llama-server chat against the server's exact count: refit if it is
        over, and once if our count left room that the server's shows.

        A shrunk text is estimated, and a text can tokenize a token differently inside the
        template: the server's total for the whole request is the truth. A few rounds at most, each
        one tightening the budget by what our count of the last one missed. A refit that cannot
        keep what must be kept under the tightened budget is refused with numbers against the
        budget the client is told. Per-text counts run high (a text alone tokenizes longer than
        inside the template), so a cut confirmed well under the budget is made once more to the
        budget less what our count overstated, and kept if the server confirms it too: the window
        is used, not wasted on the count's error; a re-cut is made fuller only up to the headroom
        the engine leaves (`_target`), and cut further when the server counts it past that. A fit
        that only repeats the last plan (the turn appends) is sent as soon as the server counts it
        within the budget: nothing new was cut, and re-admitting would move the cached prefix.
        Every budget from our count of a fit up to the next unit gives that same fit, so an aim
        often repeats one; the server is asked about each body once (`counted`), and the rounds
        go to fits not counted yet. Returns the fit, and how much looser than the budget our count of the conversation's next
        turn starts (`_overcount`; `start` is this turn's).
        """
        tightened, confirmed, overcount = start, None, 0
        target = _target(budget, previous)
        under: tuple[int, int] | None = None
        """Our budget for the fullest fit the server confirmed at or under the target, and its count of it."""
        over: tuple[int, int] | None = None
        """Our least budget whose fit the server counted over the target, and its count."""
        spare: tuple[Fitted, int] | None = None
        """A re-cut's fit within the budget but over the target (and its overcount): sent if none nearer comes."""

        def best() -> tuple[Fitted, int] | None:
            """What goes out when the rounds end: the fullest fit confirmed under the target, else the spare."""
            return (confirmed, overcount) if confirmed is not None else spare

        counted: dict[bytes | None, int] = {}
        """The server's count of each body it counted this request: a budget whose fit repeats one
        costs no call, so the rounds are spent on fits not counted yet."""
        for fits in range(MAX_FITS):
            total = counted.get(fitted.body)
            if total is None:
                sent = await off_loop(big, functools.partial(json.loads, fitted.body)) if fitted.body is not None else parsed.body
                total = await self.counters.exact_total(backend, parsed, sent, big)
                if total is None:
                    if (kept := best()) is not None:
                        return kept
                    fitted.report.exact = False
                    return fitted, 0
                counted[fitted.body] = total
            ours, aim, last = fitted.report.final_tokens, None, len(counted) == VERIFY_ROUNDS or fits == MAX_FITS - 1
            within = total <= (budget.tokens if fitted.body is not None else budget.admits)
            if within:
                fitted.report.final_tokens, fitted.report.exact = total, True  # the server's own count
                if fitted.body is None:
                    fitted.report.original_tokens = total
                    return fitted, 0
            if within and _repeated(fitted.plan, previous):  # it only appends: the whole cached prefix is served
                return fitted, _overcount(tightened, ours, total, budget)
            if within and total <= target:
                if confirmed is None or total >= confirmed.report.final_tokens:
                    confirmed, under = fitted, (tightened.tokens, total)
                    overcount = _overcount(tightened, ours, total, budget)
                room = target - confirmed.report.final_tokens
                if last or room < max(FILL_SLACK, budget.tokens // 100):
                    return confirmed, overcount
                # none over yet: as much further as the server's count of the last one says is left
                aim = _between(under, over, target) if over is not None else under[0] * target // max(under[1], 1)
            elif confirmed is not None:  # a fuller fit went over: aim between it and the one confirmed
                # every budget from our count of it up gives this same fit: aiming between budgets
                # would repeat it, a few tokens at a time, when the server's count is just over
                reach = min(tightened.tokens, ours)
                if over is None or reach < over[0]:
                    over = (reach, total)
                aim = None if last else _between(under, over, target)
            elif within:  # a re-cut the server counts past its headroom: as much tighter as it says
                if spare is None or total < spare[0].report.final_tokens:
                    spare = (fitted, _overcount(tightened, ours, total, budget))
                if last:
                    return spare
                aimed = tightened.tokens * target // total
                tightened = Budget(budget.window, budget.reserve, budget.window - budget.reserve - aimed, limit=0)
            elif tightened.margin < budget.margin:  # last turn's overcount does not hold for this one
                tightened = budget
            else:
                miss = max(total - ours, 1)
                tightened = Budget(budget.window, budget.reserve, tightened.margin + miss, limit=tightened.limit)
            if confirmed is not None:
                if aim is None:
                    return confirmed, overcount
                tightened = Budget(budget.window, budget.reserve, budget.window - budget.reserve - aim, limit=0)  # admits no more
            try:
                fitted = await off_loop(big, functools.partial(_fit_and_tell, fit, tightened))
            except BudgetTooSmall as e:
                if (kept := best()) is not None:
                    return kept
                raise e.rescaled(budget.tokens) from None
        if (kept := best()) is not None:
            return kept
        fitted.report.exact = False
        fitted.report.notes.append("the server's count could not be confirmed within the budget")
        return fitted, 0


def _overcount(tightened: Budget, ours: int, total: int, budget: Budget) -> int:
    """How much looser than the budget, in our count, the conversation's next turn starts: at
    least the budget this fit was made to (so that it repeats), and as far as the budget in our
    count at the rate ours ran over the server's on this fit (`ours` against `total`), so that a
    turn that only appends is seen to fit at once, however high our per-text counts run."""
    return max(tightened.tokens, ours * budget.tokens // max(total, 1), budget.tokens) - budget.tokens


def _target(budget: Budget, previous: Plan | None) -> int:
    """What the server's count of a fit is aimed at: the budget for a conversation's first cut; for
    a re-cut (last turn cut it already), the budget less the engine's headroom, so that the next
    turns append. Filling a re-cut to the budget made every following turn cut again (an agent loop
    at -c 2048: 13 re-cuts in 21 turns, each ending at 93-97% of the budget)."""
    return recut_target(budget.tokens) if previous is not None and (previous.evicted or previous.shrunk) else budget.tokens


def _between(under: tuple[int, int] | None, over: tuple[int, int], target: int) -> int | None:
    """Our budget whose fit the server should count at `target`, on the line through a fit it
    counted under and one it counted over (None: no whole token lies between them)."""
    assert under is not None, "a fit was confirmed before one went over"
    (low, counted_low), (high, counted_high) = under, over
    if high - low <= 1:
        return None
    aim = low + (target - counted_low) * (high - low) // max(counted_high - counted_low, 1)
    return min(max(aim, low + 1), high - 1)


def _repeated(plan: Plan | None, previous: Plan | None) -> bool:
    """Whether a fit made last turn's cuts and no others."""
    return plan is not None and previous is not None and plan.evicted == previous.evicted and plan.shrunk == previous.shrunk
