"""The budget: how many prompt tokens a request may send.

Two numbers, as the backends themselves decide. A prompt of up to `admits` tokens (the window less
the template margin) goes out unchanged: neither llama-server nor Ollama holds the answer's length
back from the prompt; they serve a prompt that fits and stop the answer when the window is full. A
prompt that must be cut anyway is cut to `tokens` (the window less room for a real answer and the
margin): the reserve is the smaller of what the request caps (`max_tokens`, `num_predict`) and the
`contextpaw_output_reserve` option, and never more than half the window, so Claude Code's
`max_tokens: 32000` takes no more than anyone's. `Budgeter` picks the window
(`contextpaw.fitting.windows` discovers it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from contextpaw.core.compact import BudgetTooSmall
from contextpaw.fitting.windows import NoDiscovery, WindowSource
from contextpaw.wire import Backend, Overflow, Params, UpstreamOverflow


@dataclass(frozen=True, slots=True)
class Budget:
    window: int
    reserve: int
    margin: int
    limit: int | None = None
    """What goes out unchanged when it is not the whole window less the margin (after the server
    refused a request as too long, nothing goes out unchanged that is over `tokens`)."""

    @property
    def tokens(self) -> int:
        """What a request that must be cut is cut to: room is left for the answer."""
        return max(self.window - self.reserve - self.margin, 0)

    @property
    def admits(self) -> int:
        """The largest prompt that goes out unchanged: what the backend would serve whole."""
        return self.limit if self.limit is not None else max(self.window - self.margin, 0)

    def within(self, ratio: float) -> Budget:
        """The budget a count that may be `ratio` times too low still fits in."""
        if ratio <= 1:
            return self
        return Budget(self.window, self.reserve, self.margin + self.tokens - math.floor(self.tokens / ratio))

    def at_most(self, tokens: int) -> Budget:
        """This budget cut to `tokens` (never raised above what it is)."""
        return Budget(self.window, self.reserve, self.margin + max(self.tokens - tokens, 0))

    def refusal(self, required: int, bound: float | None = None) -> Overflow:
        """Policy strict: the request would have to be compacted. Where our count of it fits and
        only its error bound does not (`bound`: how many times low it may run, on a route that
        cannot forbid the server's cut), the refusal names that bound's count: numbers that say it
        fits are no reason to refuse."""
        if required <= self.admits and bound is not None and bound > 1:
            upper = math.ceil(required * bound)
            cause = (
                f"the request counts {required} tokens by an estimate that may run {bound:.2f} times low, so up to "
                f"{upper}, and only {self.admits} fit; policy strict refuses to compact it"
            )
            return Overflow(upper, self.admits, self.window, cause, required, strict=True)
        cause = f"the request needs {required} tokens but only {self.admits} fit, and policy strict refuses to compact it"
        return Overflow(required, self.admits, self.window, cause, required, strict=True)

    def impossible(self, error: BudgetTooSmall) -> Overflow:
        """What must be kept does not fit, so no compaction can help; when the head alone is over,
        the least window that holds it, with this budget's room for the answer and the template."""
        error = error.rescaled(self.tokens) if error.budget != self.tokens else error
        least = error.least_budget
        least_window = None if least is None else least + self.window - self.tokens
        return Overflow(error.required, self.tokens, self.window, str(error), error.original, error.head, least_window)


class Budgeter:
    def __init__(self, *, default_ctx: int, reserve: int, margin: int, source: WindowSource | None = None) -> None:
        self.default_ctx = default_ctx
        self.reserve = reserve
        self.margin = margin
        self.source: WindowSource = source or NoDiscovery()

    def admits(self, window: int) -> int:
        """The largest prompt that goes out unchanged in `window`, whatever answer length it asks for."""
        return Budget(window, 0, min(self.margin, window // 8)).admits

    async def budget(self, backend: Backend, params: Params) -> Budget:
        if params.num_ctx is not None:
            trained = await self.source.trained(backend, params.model)
            return self.for_window(min(params.num_ctx, trained) if trained else params.num_ctx, params)
        return self.for_window(await self.source.window(backend, params.model) or self.default_ctx, params)

    def for_window(self, window: int, params: Params) -> Budget:
        """The answer's reserve is the smaller of the request's cap and the configured reserve, and
        at most half the window; the margin at most an eighth: a tiny window (`num_ctx` 128 and
        below) still holds a short prompt."""
        reserve = min(params.max_output or self.reserve, self.reserve, window // 2)
        return Budget(window, reserve, min(self.margin, window // 8))

    def after_upstream_overflow(self, error: UpstreamOverflow, counted: int, params: Params) -> Budget:
        """The budget for a retry after the backend refused: its window, in our counter's units.

        The backend just counted this very prompt; when that is more than we counted, our counter
        undercounts this text, so the budget shrinks by the same ratio and the retry fits.
        """
        budget = self.for_window(error.n_ctx, params)
        if error.n_prompt_tokens <= counted:
            return Budget(budget.window, budget.reserve, budget.margin, budget.tokens)
        scaled = math.floor(budget.tokens * counted / error.n_prompt_tokens)
        return Budget(budget.window, budget.reserve, budget.window - budget.reserve - scaled, scaled)
