"""The budget: how many prompt tokens a request may send.

budget = window - output reserve - template margin. The window is what the request asks for
(Ollama's `num_ctx`), else what the backend reports, else the configured default; the reserve is the
answer length the request asks for, else a default, never more than half the window so that a huge
`max_tokens` cannot leave the prompt nothing. Window discovery is a `WindowSource`, so a source that
asks the backend (`/api/ps`, `/props`) slots in without touching the arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from contextpaw.compact import BudgetTooSmall
from contextpaw.wire import Backend, Overflow, Params, UpstreamOverflow


@dataclass(frozen=True, slots=True)
class Budget:
    window: int
    reserve: int
    margin: int

    @property
    def tokens(self) -> int:
        return max(self.window - self.reserve - self.margin, 0)

    def refusal(self, required: int) -> Overflow:
        """Policy strict: the request would have to be compacted."""
        cause = f"the request needs {required} tokens but only {self.tokens} fit, and policy strict refuses to compact it"
        return Overflow(required, self.tokens, self.window, cause)

    def impossible(self, error: BudgetTooSmall) -> Overflow:
        """What must be kept does not fit, so no compaction can help."""
        return Overflow(error.required, self.tokens, self.window, str(error))


class WindowSource(Protocol):
    """Where a backend's window comes from when the request does not name one."""

    async def window(self, backend: Backend, model: str) -> int | None: ...


class NoDiscovery:
    """Today's source: the backend is not asked, so the configured default applies."""

    async def window(self, backend: Backend, model: str) -> int | None:
        return None


class Budgeter:
    def __init__(self, *, default_ctx: int, reserve: int, margin: int, source: WindowSource | None = None) -> None:
        self.default_ctx = default_ctx
        self.reserve = reserve
        self.margin = margin
        self.source: WindowSource = source or NoDiscovery()

    async def budget(self, backend: Backend, params: Params) -> Budget:
        window = params.num_ctx or await self.source.window(backend, params.model) or self.default_ctx
        return self.for_window(window, params)

    def for_window(self, window: int, params: Params) -> Budget:
        reserve = min(params.max_output or self.reserve, window // 2)
        return Budget(window, reserve, self.margin)

    def after_upstream_overflow(self, error: UpstreamOverflow, counted: int, params: Params) -> Budget:
        """The budget for a retry after the backend refused: its window, in our counter's units.

        The backend just counted this very prompt; when that is more than we counted, our counter
        undercounts this text, so the budget shrinks by the same ratio and the retry fits.
        """
        budget = self.for_window(error.n_ctx, params)
        if error.n_prompt_tokens <= counted:
            return budget
        scaled = math.floor(budget.tokens * counted / error.n_prompt_tokens)
        return Budget(budget.window, budget.reserve, budget.window - budget.reserve - scaled)
