"""Sizing a parsed request to its budget: what the engine is given, and whether the server agrees.

The engine (through `contextpaw.fitting`) fits to a budget with a counter. Here it gets the best
counter the backend allows (`CounterChoice`) and the conversation's last plan; where llama-server
counts whole requests, the template's cost as the server renders it, and a fit its count finds over
the budget is cut further; on a route where a cut cannot be undone, a budget the count's upper error
bound still fits in. No mitmproxy; what it asks the world goes through the counters.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping

from contextpaw import wire
from contextpaw.calibration import Calibration, calibration_key
from contextpaw.compact import BudgetTooSmall, Plan
from contextpaw.counters import CounterChoice, rough_size
from contextpaw.fitting import Fitted, fit_chat, fit_prompt
from contextpaw.offload import off_loop
from contextpaw.report import Report
from contextpaw.state import SizedLRU
from contextpaw.tokens import EstimateCounter
from contextpaw.windows import Budget

VERIFY_ROUNDS = 4
"""Refits after the server's whole-request count said a fit was still over the budget."""

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

    async def fit(
        self,
        parsed: wire.Chat | wire.Prompt,
        budget: Budget,
        backend: wire.Backend,
        big: bool,
        digests: Mapping[str, str] | None = None,
        previous: Plan | None = None,
        guard: str | None = None,
    ) -> Fitted:
        """Fit with the conversation's last plan, in a worker thread when the request is big.

        Where the server counts whole requests (llama-server's chats), the decision rests on that
        count: a request it would serve whole goes out unchanged, and otherwise the difference
        between its count and ours is the template's real cost (a template that renders no tools
        makes it negative), so what must be kept is priced as the server prices it.

        With a `guard` (the request's content kind, on a route that cannot ask Ollama to refuse
        instead of cutting), an inexact count gets a budget its upper error bound still fits in,
        where what must be kept allows it: a cut there cannot be undone. Once calibration knows
        this kind of text, that bound is what it learned, not the estimate's whole width."""
        small = await self.counters.small(backend, parsed, budget.tokens, big)
        counter, fixed = await self.counters.best(backend, parsed, small, big)
        # a request that may not fit is counted whole where the server can (even when its per-text
        # counting failed: the whole count is one call, and the decision rests on it)
        whole = None if small else await self.counters.exact_total(backend, parsed, parsed.body, big)
        if whole is not None:
            if whole <= budget.admits:
                as_sent = Report(False, "none", whole, whole, budget.admits, counter="backend", exact=True, window=budget.window)
                return Fitted(None, as_sent)
            fixed += whole - await off_loop(big, functools.partial(parsed.tokens, counter, fixed))
        guarded = budget
        if guard is not None and not counter.exact:
            key = calibration_key(backend, parsed.params.model)
            size = await off_loop(big, functools.partial(rough_size, parsed, self.estimate))
            learned = self.calibration.kind_bound(key, guard, size)
            guarded = budget.within(learned if learned is not None else self.calibration.bounds(key)[1])
        fit: Callable[..., Fitted]
        if isinstance(parsed, wire.Chat):  # what only a chat has: turns, a last plan, holes to put digests in
            previous = previous or self.plans.get(parsed.key)
            fit = functools.partial(fit_chat, parsed, counter=counter, fixed_tokens=fixed,
                                    keep_recent=self.keep_recent, previous=previous, digests=digests)  # fmt: skip
        else:
            fit = functools.partial(fit_prompt, parsed, counter=counter, fixed_tokens=fixed)
        while True:
            try:
                fitted = await off_loop(big, functools.partial(_fit_and_tell, fit, guarded))
                break
            except BudgetTooSmall as e:
                e.counter = "backend" if whole is not None else counter.name
                if guarded == budget:
                    raise
                # what must be kept needs more than the guard leaves: as close to the guard as it
                # fits, else the full budget, and the check after the answer says what happened
                needed = budget.at_most(e.required)
                guarded = needed if guarded.tokens < needed.tokens < budget.tokens else budget
        fitted.report.window = budget.window
        if guarded != budget:
            fitted.report.notes.append(
                f"budget {guarded.tokens} of {budget.tokens}: the count is an estimate, and this route cannot ask "
                "Ollama to refuse instead of cutting"
            )
        if whole is None:
            return fitted
        try:
            fitted = await self._verified(parsed, fitted, budget, backend, big, fit)
        except BudgetTooSmall as e:
            e.counter = "backend"
            raise
        # a refit under a tightened budget is told against the budget the client is told
        report = fitted.report
        report.counter, report.original_tokens, report.window, report.budget = "backend", whole, budget.window, budget.tokens
        return fitted

    async def _verified(
        self, parsed: wire.Chat | wire.Prompt, fitted: Fitted, budget: Budget, backend: wire.Backend, big: bool, fit: Fit
    ) -> Fitted:
        """Check a compacted llama-server chat against the server's exact count; refit if it is over.

        A shrunk text is estimated, and a text can tokenize a token differently inside the
        template: the server's total for the whole request is the truth. A few rounds at most, each
        one tightening the budget by what our count of the last one missed. A refit that cannot
        keep what must be kept under the tightened budget is refused with numbers against the
        budget the client is told.
        """
        tightened = budget
        for _ in range(VERIFY_ROUNDS):
            sent = await off_loop(big, functools.partial(json.loads, fitted.body)) if fitted.body is not None else parsed.body
            total = await self.counters.exact_total(backend, parsed, sent, big)
            if total is None:
                fitted.report.exact = False
                return fitted
            if total <= (budget.tokens if fitted.body is not None else budget.admits):
                fitted.report.final_tokens = total
                if fitted.body is None:
                    fitted.report.original_tokens = total
                return fitted
            miss = max(total - fitted.report.final_tokens, 1)
            tightened = Budget(budget.window, budget.reserve, tightened.margin + miss)
            try:
                fitted = await off_loop(big, functools.partial(_fit_and_tell, fit, tightened))
            except BudgetTooSmall as e:
                raise e.rescaled(budget.tokens) from None
        fitted.report.exact = False
        fitted.report.notes.append("the server's count could not be confirmed within the budget")
        return fitted
