"""A raw prompt (/api/generate, /v1/completions, /completion) fitted into a token budget: it has no
messages to evict, so its middle is cut and its head and tail are kept. Pure."""

from __future__ import annotations

from dataclasses import dataclass, replace

from contextpaw.core.compact import BudgetTooSmall, as_sent
from contextpaw.core.holes import shows_refs
from contextpaw.core.refs import Refs
from contextpaw.core.report import Removal, Report
from contextpaw.core.shrink import SHRINK_FLOOR, cut_ref, shrink_text
from contextpaw.core.tokens import Counter


@dataclass(slots=True)
class PromptResult:
    prompt: str | None
    """What to send; None when nothing changed (forward the original bytes)."""
    report: Report


def compact_prompt(
    prompt: str,
    budget: int,
    counter: Counter,
    *,
    fixed_tokens: int = 0,
    admit: int | None = None,
    refs: Refs = Refs(),
) -> PromptResult:
    """Fit a raw prompt: keep its head and tail, elide the middle with a marker. A prompt of up to
    `admit` tokens (default: the budget) is left as it is."""
    original = fixed_tokens + counter.text(prompt)
    limit = budget if admit is None else max(admit, budget)
    if original <= limit:
        return PromptResult(None, as_sent(original, limit, counter))
    room = budget - fixed_tokens
    if room < SHRINK_FLOOR:
        raise BudgetTooSmall(fixed_tokens + SHRINK_FLOOR, budget, "the system text and template", original, counter)
    shown = shows_refs(budget, counter, refs.url)
    cut = shrink_text(prompt, room, counter, refs.url, shown=shown, legend=True)
    marker_id = cut_ref(refs, prompt, cut)
    kept = cut.apply(prompt, marker_id if shown else "", refs.url)
    report = replace(
        as_sent(original, budget, counter),
        compacted=True,
        strategy="head_tail",
        final_tokens=fixed_tokens + counter.text(kept),
        removals=(Removal(-1, "prompt", cut.elided, "shrunk", marker_id),),
        markers=(marker_id,),
        evicted={marker_id: prompt},
    )
    return PromptResult(kept, report)
