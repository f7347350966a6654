"""Sizing a parsed request to its budget: what the engine is given, and whether the server agrees.

The engine (through `contextpaw.fitting.engine`) fits to a budget with a counter. Here it gets the best
counter the backend allows (`CounterChoice`) and the conversation's last plan; where llama-server
counts whole requests, the template's cost as the server renders it, and a fit its count finds over
the budget is cut further; on a route where a cut cannot be undone, a budget the count's upper error
bound still fits in. No mitmproxy; what it asks the world goes through the counters.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping

from contextpaw import wire
from contextpaw.core.caches import LRU, SizedLRU
from contextpaw.core.compact import BudgetTooSmall, Plan
from contextpaw.core.refs import Refs
from contextpaw.core.report import Report
from contextpaw.core.tokens import EstimateCounter
from contextpaw.core.truncation import ESTIMATE_BOUNDS
from contextpaw.fitting.answers import Evaluated
from contextpaw.fitting.budget import Budget
from contextpaw.fitting.calibration import CalibratedCounter, Calibration, Guard, calibration_key
from contextpaw.fitting.counter_choice import CounterChoice, rough_size
from contextpaw.fitting.engine import Fitted, fit_chat, fit_prompt
from contextpaw.fitting.services import off_loop
from contextpaw.fitting.verification import Search, Send

VERIFY_ROUNDS = 5
"""Counts by the server of one request's fits: the first, then refits over the budget (cut further)
or well under it (made fuller)."""
MAX_FITS = 2 * VERIFY_ROUNDS
"""Fits made for one request at most, those that repeat a counted one included."""
ANCHOR_MARGIN = 1.06
"""How far the server's count of a conversation's turn may run over our count at the ratio its
last answered turn showed: what a turn adds (a file just read) may tokenize denser than the rest,
and a cut aims below the budget by the headroom besides."""

Fit = Callable[..., Fitted]
"""One fit of a parsed request with its counter and template cost: (budget's tokens, admit=, and
for a chat headroom=) -> the fit."""


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
        self,
        counters: CounterChoice,
        calibration: Calibration,
        estimate: EstimateCounter,
        plans: SizedLRU,
        keep_recent: int,
        answered: Callable[[wire.Chat], Evaluated | None] = lambda parsed: None,
        headroom: float | None = None,
    ) -> None:
        self.counters = counters
        self.calibration = calibration
        self.estimate = estimate
        self.plans = plans
        """Each conversation's last `Plan` (the fitter's, which remembers them)."""
        self.keep_recent = keep_recent
        self.headroom = headroom
        """The share of the budget a cut leaves free (`contextpaw_headroom`; None: what a turn adds)."""
        self.answered = answered
        """A chat's last answered turn (its conversation's, else the one whose text it mostly
        repeats): the server's count of what was sent, beside ours."""
        self.overcounts = LRU(plans.limit)
        """Conversation -> how much looser than the budget, in our count, its next turn's fit starts
        (`verification.Search._overcount`: our count of its last cut ran that much over the server's): that turn
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
        refs: Refs = Refs(),
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
        if whole is not None and whole <= budget.admits:
            as_sent = Report(False, "none", whole, whole, budget.admits, counter="backend", exact=True, window=budget.window)
            return Fitted(None, as_sent)
        if whole is not None and isinstance(parsed, wire.Chat):  # a raw prompt has no template to price
            ours = await off_loop(big, functools.partial(parsed.tokens, counter, fixed))
            # The difference is the template's real cost, but never below nothing: a template may
            # drop the tools, while a count of the messages that runs high is theirs, and the check
            # after the cut makes the fit fuller. Should what must be kept not fit so, every text is
            # priced at the server's rate for the whole request instead, and the check says whether
            # that was right.
            around = parsed.fixed_cost(counter, fixed)
            scale, base = whole / ours if 0 < whole < ours else 1.0, fixed
            fixed = max(fixed + whole - ours, fixed - around)
        start = budget
        if whole is not None and (overcount := self.overcounts.get(parsed.key)):
            start = Budget(budget.window, budget.reserve, budget.margin - overcount, limit=0)
        guarded, bound, why, opening = start, None, "", ""
        if guard is not None and not counter.exact and (anchored := self._anchored(parsed, guard)) is not None:
            (counter, whose), bound = anchored, ANCHOR_MARGIN
            guarded = budget.within(bound)
            why = f"counted at {whose}, {counter.factor:.2f} tokens to the estimate's one, which may run {bound:.2f} times low"
        elif guard is not None and not counter.exact:
            # the sizes the guard's questions ask about, each made once (a big request's are passes over megabytes)
            proved = await off_loop(big, functools.partial(rough_size, parsed, self.estimate))
            counted = await off_loop(big, functools.partial(parsed.tokens, counter, fixed)) if isinstance(parsed, wire.Chat) else None
            if counted is not None and self._opening(parsed, counted, proved, budget, guard):
                bound = self.calibration.bounds(calibration_key(backend, parsed.params.model))[1]
                opening = (
                    "the conversation's opening goes out whole: its count fits the window at the estimate's own "
                    "rate, and the server's count of it says whether it was cut"
                )
            else:
                guarded, bound, why = self._guarded(parsed, budget, backend, proved, guard)
                asked = await self._asked(parsed, counted, proved, guarded, budget, backend, big, guard)
                if isinstance(asked, Fitted):
                    return asked
                if asked is not None:
                    (counter, why), bound = asked, ANCHOR_MARGIN
                    guarded = budget.within(bound)
        if isinstance(parsed, wire.Chat):  # what only a chat has: turns, a last plan, holes to put digests in
            previous = previous or self.plans.get(parsed.key)

        def with_fixed(fixed: int) -> Fit:
            if isinstance(parsed, wire.Chat):
                return functools.partial(
                    fit_chat,
                    parsed,
                    counter=counter,
                    fixed_tokens=fixed,
                    keep_recent=self.keep_recent,
                    previous=previous,
                    digests=digests,
                    headroom=self.headroom,
                    refs=refs,
                )
            return functools.partial(fit_prompt, parsed, counter=counter, fixed_tokens=fixed, refs=refs)

        fit = with_fixed(fixed)
        reserve_note = ""
        while True:
            try:
                fitted = await off_loop(big, functools.partial(_fit_and_tell, fit, guarded))
                break
            except BudgetTooSmall as e:
                e.counter = "backend" if whole is not None else counter.name
                if scale < 1 and whole is not None and isinstance(parsed, wire.Chat):  # a scale comes with a whole count
                    counter, scale = CalibratedCounter(counter, scale), 1.0
                    fixed = base + whole - await off_loop(big, functools.partial(parsed.tokens, counter, base))
                    fit = with_fixed(fixed)
                    continue
                if guarded in (budget, start):
                    if not budget.reserve or e.required > budget.admits:
                        raise
                    # the reserve is room for an answer to a request that must be cut: one whose
                    # least fits the window without it goes out so, and the answer is judged
                    budget = start = guarded = Budget(budget.window, 0, budget.margin, limit=budget.limit)
                    reserve_note = (
                        f"what must be kept needs {e.required} of the window's {budget.admits} tokens: "
                        f"cut to that, with less room for the answer than its reserve, rather than refused"
                    )
                    continue
                # what must be kept needs more than the guard leaves: as close to the guard as it
                # fits, else the full budget, and the check after the answer says what happened
                needed = budget.at_most(e.required)
                guarded = needed if guarded.tokens < needed.tokens < budget.tokens else budget
                why = "what must be kept needs this much"
        notes = [opening] if opening else []
        if reserve_note:
            notes.append(reserve_note)
        if guarded not in (budget, start):
            notes.append(
                f"budget {guarded.tokens} of {budget.tokens}: the count is an estimate, and this route cannot ask "
                f"Ollama to refuse instead of cutting ({why})"
            )
        fitted = fitted.told(window=budget.window, notes=(*fitted.report.notes, *notes))
        if whole is None:
            return fitted if bound is None else dataclasses.replace(fitted, bound=bound)
        try:
            sent = await self._verified(parsed, fitted, budget, start, backend, big, fit, previous)
        except BudgetTooSmall as e:
            e.counter = "backend"
            raise
        fitted = sent.fitted
        if fitted.body is not None and isinstance(parsed, wire.Chat):
            self.overcounts.put(parsed.key, sent.overcount)
        # a refit under a tightened budget is told against the budget the client is told
        return fitted.told(counter="backend", original_tokens=whole, window=budget.window, budget=budget.tokens)

    def _anchored(self, parsed: wire.Chat | wire.Prompt, guard: Guard) -> tuple[CalibratedCounter, str] | None:
        """The estimate at the rate the server counted this conversation's last answered turn (or,
        in a new conversation, the last one whose text this request mostly repeats), and whose rate
        that is: the request is mostly what was sent then, so its count is off only by how the new
        part differs (where no such turn is known, the server cut it, or its count is one no text
        could give, None: the guard's bounds hold). Never below what this request's words prove."""
        if not isinstance(parsed, wire.Chat):
            return None
        last = self.answered(parsed)
        if last is None or not last.whole or not last.estimated:
            return None
        rate = last.prompt_tokens / last.estimated
        if not ESTIMATE_BOUNDS[0] <= rate <= ESTIMATE_BOUNDS[1]:  # no text tokenizes so: not a count of what was sent
            return None
        whose = "this conversation's own rate" if last.conversation == parsed.key else "the rate of the conversation whose text it repeats"
        return CalibratedCounter(self.estimate, max(rate, guard.floor)), whose

    @staticmethod
    def _opening(parsed: wire.Chat | wire.Prompt, counted: int, proved: int, budget: Budget, guard: Guard) -> bool:
        """Whether this is a conversation's opening (nothing after its task's message) that fits
        the window at the estimate's own rate, never below what its words prove. Its only cuttable
        part is the task itself, which the guard would shrink for the estimate's width alone (Qwen
        Code sends its instructions and the task as one message of 22,000 estimated tokens, 15,845
        in the model's count, into a 32,768-token window): sent whole, it is judged by the server's
        count, which tells a cut. (`counted`: our count of it; `proved`: the estimate of its words.)"""
        if not isinstance(parsed, wire.Chat):
            return False
        if parsed.conversation.task_index() != len(parsed.conversation.messages) - 1:
            return False
        return max(counted, math.ceil(proved * guard.floor)) <= budget.admits

    async def _asked(
        self,
        parsed: wire.Chat | wire.Prompt,
        counted: int | None,
        proved: int,
        guarded: Budget,
        budget: Budget,
        backend: wire.Backend,
        big: bool,
        guard: Guard,
    ) -> Fitted | tuple[CalibratedCounter, str] | None:
        """Where the guard would cut a chat that may fit, Ollama's own count of it (asked on its
        native route, `CounterChoice.asked`): a request it counts within the window goes out
        unchanged, its count in the report; one over it is cut at the rate that count shows (the
        counter, and why). None: nothing to ask (no cut, or its words prove it over), or no
        answer, and the guard holds. An answer to a count that no text could give (an Ollama
        older than `truncate: false` cut the prompt and counted what it kept) is no answer.
        (`counted`: our count of the chat, None for a raw prompt; `proved`: the estimate of its words.)"""
        if not isinstance(parsed, wire.Chat) or counted is None:
            return None
        if counted <= guarded.admits or math.ceil(proved * guard.floor) > budget.admits:
            return None
        started = time.perf_counter()
        asked = await self.counters.asked(backend, parsed, big)
        if asked is None or asked.tokens is None or not proved:
            return None
        rate, took = asked.tokens / proved, time.perf_counter() - started
        if not ESTIMATE_BOUNDS[0] <= rate <= ESTIMATE_BOUNDS[1]:
            return None
        said = f"Ollama counted it at {asked.tokens} tokens, asked on /api/chat with truncate:false in {took:.2f}s"
        if asked.fits and asked.tokens <= budget.admits:
            note = f"{said}: it fits the {budget.admits} the window admits, and goes out unchanged"
            report = Report(
                False, "none", asked.tokens, asked.tokens, budget.admits, counter="backend", exact=True, window=budget.window, notes=(note,)
            )
            return Fitted(None, report)
        return CalibratedCounter(self.estimate, max(rate, guard.floor)), f"{said}, over the window: cut at its rate"

    def _guarded(
        self, parsed: wire.Chat | wire.Prompt, budget: Budget, backend: wire.Backend, size: int, guard: Guard
    ) -> tuple[Budget, float, str]:
        """Where a cut cannot be forbidden: the budget the calibrated estimate's upper error bound
        still fits in, that bound (the verdict's), and what held the budget there.

        A request that is cut is sent at the budget's size at most, and that is what must be
        bounded. Samples of its kind bound a request of up to `reach`; a bigger one is held to that
        size if it does better than the estimate's whole width, and is learned from in turn. The
        bound is of the byte estimate, learned on whole requests of the kind: a cut keeps other
        text than it evicts, and only a count whose factor is the densest text's prices what stays
        no lower than it is (a shape count learned on prose and JSON prices camelCase code at 0.7
        of its tokens, and a cut that kept it overflowed the window in silence). (`size`: what the
        estimate makes of the whole request.)"""
        key = calibration_key(backend, parsed.params.model)
        factor = self.calibration.factor(key)
        sent = min(size, math.ceil(budget.tokens / factor))
        reach = self.calibration.kind_reach(key, guard.kind)
        learned = self.calibration.kind_bound(key, guard.kind, min(sent, reach), guard.floor)
        bound = self.calibration.bounds(key)[1]
        guarded, why = budget.within(bound), f"this kind of text is not learned yet: its count may be {bound:.2f} times low"
        if learned is not None:
            held = budget.within(learned)
            by_kind = held if reach >= sent else held.at_most(math.floor(reach * factor))
            if by_kind.tokens > guarded.tokens or reach >= sent:
                guarded, bound = by_kind, learned
                why = f"its count of this kind of text may be {learned:.2f} times low"
                if by_kind.tokens < held.tokens:
                    why = f"samples of this kind reach requests of {reach} estimated tokens, and the cut is held to that size"
        return guarded, bound, why

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
    ) -> Send:
        """Check a compacted llama-server chat against the server's exact count, and cut it again
        as `verification.Search` says, until it sends a fit: over the budget, cut further; well
        under it, made fuller. At most `VERIFY_ROUNDS` counts, and a body is counted once (every
        budget from our count of a fit up to the next unit gives that same fit, so an aim often
        repeats one). A refit that cannot keep what must be kept under the tightened budget is
        refused with numbers against the budget the client is told. Returns the fit, with how much
        looser than the budget our count of the conversation's next turn starts (`start` is this
        turn's).
        """
        search = Search(budget, start, previous)
        if fitted.plan is not None and fitted.plan.headroom:
            # refits keep the first fit's share of headroom: sized anew from each tightened budget,
            # it would not fall in line with the budget, and the search aims along that line
            fit = functools.partial(fit, headroom=fitted.plan.headroom)
        counted: dict[bytes | None, int] = {}
        """The server's count of each body it counted this request: a budget whose fit repeats one
        costs no call, so the counts go to fits not counted yet."""
        for fits in range(MAX_FITS):
            total = counted.get(fitted.body)
            if total is None:
                if len(counted) == VERIFY_ROUNDS:
                    break
                sent = await off_loop(big, functools.partial(wire.load, fitted.body)) if fitted.body is not None else parsed.body
                total = await self.counters.exact_total(backend, parsed, sent, big)
                if total is None:
                    return search.best() or _unconfirmed(fitted)
                counted[fitted.body] = total
            step = search.counted(fitted, total, last=len(counted) == VERIFY_ROUNDS or fits == MAX_FITS - 1)
            if isinstance(step, Send):
                return step
            refit = fit if step.headroom is None else functools.partial(fit, headroom=step.headroom)
            try:
                fitted = await off_loop(big, functools.partial(_fit_and_tell, refit, step.budget))
            except BudgetTooSmall as e:
                if (kept := search.best()) is not None:
                    return kept
                raise e.rescaled(budget.tokens) from None
        if (kept := search.best()) is not None:
            return kept
        return _unconfirmed(fitted, "the server's count could not be confirmed within the budget")


def _unconfirmed(fitted: Fitted, note: str | None = None) -> Send:
    """A fit sent on our count alone: the server's could not be had, or not within the budget (`note`)."""
    notes = fitted.report.notes if note is None else (*fitted.report.notes, note)
    return Send(fitted.told(exact=False, notes=notes), 0)
