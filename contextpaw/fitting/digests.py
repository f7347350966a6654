"""Digests of what a fit evicted, put where its markers go, inside the budget.

The fit's third pass for a chat when summaries are on: `contextpaw.calls.summarizer` writes each digest
(over `contextpaw.core.map_reduce`, its pure half); here the chat is sized around them, and the digests are
asked of the configured summarizer, else of the request's own backend and model. No mitmproxy;
what it asks the world goes through the fitter's services.
"""

from __future__ import annotations

import asyncio

from contextpaw import wire
from contextpaw.core import logs
from contextpaw.fitting.budget import Budget
from contextpaw.fitting.calibration import Guard
from contextpaw.fitting.counter_choice import CounterChoice
from contextpaw.fitting.engine import Fitted
from contextpaw.fitting.flow import FlowState
from contextpaw.fitting.services import Digester, Services, SummaryModel
from contextpaw.fitting.sizing import Sizer
from contextpaw.fitting.windows import BackendWindows
from contextpaw.settings import FitSettings

logger = logs.get(__name__)


class Digesting:
    """Puts digests of a chat's evicted spans into its fit."""

    def __init__(self, sizer: Sizer, windows: BackendWindows, counters: CounterChoice, services: Services, settings: FitSettings) -> None:
        self.sizer = sizer
        self.windows = windows
        self.counters = counters
        self.services = services
        self.settings = settings

    async def summarized(
        self,
        summarizer: Digester,
        state: FlowState,
        parsed: wire.Chat,
        fitted: Fitted,
        budget: Budget,
        big: bool,
        guard: Guard | None,
        shaped: bool = False,
    ) -> Fitted:
        """Put a digest of each evicted span where its marker goes, inside the budget.

        The chat is compacted again with room left for the digests; its holes are summarized; then
        it is compacted a last time with the digests, keeping that plan's evictions so the holes
        come out the same. Best-effort: without a digest the plain marker stays, and the report
        says why.
        """
        cap = self.settings.summary_tokens
        backend = state.backend
        roomy = await self.sizer.fit(
            parsed, Budget(budget.window, budget.reserve, budget.margin + cap), backend, big, guard=guard, shaped=shaped, refs=state.refs
        )
        holes = {mid: content for mid, content in roomy.report.evicted.items() if not isinstance(content, str)}
        if not holes:
            return fitted
        model = await self._summary_model(state, parsed, budget)
        results = await asyncio.gather(
            *(summarizer.digest(content, model=model, cap_tokens=cap // len(holes)) for content in holes.values())
        )
        digests = {mid: r.text for mid, r in zip(holes, results, strict=True) if r.text}
        reasons = "; ".join(r.reason for r in results if r.reason) or None
        if reasons:
            logger.warning("%s: %d of %d evicted spans not summarized: %s", state.path, len(holes) - len(digests), len(holes), reasons)
        if not digests:
            return fitted.told(summary_reason=reasons) if reasons else fitted
        final = await self.sizer.fit(
            parsed, budget, backend, big, digests=digests, previous=roomy.plan, guard=guard, shaped=shaped, refs=state.refs
        )
        return final.told(summary_reason=reasons)

    async def _summary_model(self, state: FlowState, parsed: wire.Chat, budget: Budget) -> SummaryModel:
        """Where digests are made: the configured summarizer, else the request's own backend and model."""
        s, backend = self.settings, state.backend
        target = wire.Backend.parse(backend.kind, s.summarizer_url) if s.summarizer_url else backend
        name = s.summarizer_model or parsed.params.model
        window = budget.window if target == backend else await self.windows.window(target, name) or budget.window
        complete = self.services.completions(target.url, name, s.summarizer_timeout, state.authorization)
        counter, _ = await self.counters.best(target, parsed)
        return SummaryModel(complete, f"{target.url}/{name}", window, counter)
