"""Catching Ollama's silent truncation: the server evaluated fewer tokens than it was sent.

Ollama answers 200 after cutting a prompt, and its `prompt_eval_count` is counted after the cut. Two
signs give it away: the count lands on the value its token-level cut always produces
(`num_ctx - (num_ctx - keep) // 2`, or `num_ctx`/`num_ctx - 1` on older builds), or it is clearly
below what we know we sent (whole messages dropped). Pure: the shell supplies both numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

EXACT_TOLERANCE = 0.02
"""Allowed shortfall when our count is exact (template details, BOS)."""

ESTIMATE_TOLERANCE = 0.25
"""Allowed shortfall when our count is an estimate, which errs high on purpose."""


@dataclass(frozen=True, slots=True)
class Truncation:
    sent_tokens: int
    evaluated_tokens: int
    num_ctx: int | None
    reason: str

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def cut_counts(num_ctx: int) -> set[int]:
    """`prompt_eval_count` values that only a token-level cut produces, across Ollama versions."""
    return {num_ctx, num_ctx - 1} | {num_ctx - (num_ctx - keep) // 2 for keep in range(0, 9)}


def detect(sent_tokens: int, evaluated_tokens: int | None, num_ctx: int | None, exact: bool) -> Truncation | None:
    """A `Truncation` when the server evaluated clearly less than it was sent, else None."""
    if evaluated_tokens is None or sent_tokens <= 0 or evaluated_tokens >= sent_tokens:
        return None
    if num_ctx and evaluated_tokens in cut_counts(num_ctx) and sent_tokens > num_ctx // 2:
        return Truncation(sent_tokens, evaluated_tokens, num_ctx, "count matches Ollama's token-level cut")
    tolerance = EXACT_TOLERANCE if exact else ESTIMATE_TOLERANCE
    plausible = exact or num_ctx is None or sent_tokens * (1 - tolerance) > num_ctx * 0.5
    if plausible and evaluated_tokens < sent_tokens * (1 - tolerance) - 8:
        return Truncation(sent_tokens, evaluated_tokens, num_ctx, "server evaluated fewer tokens than were sent")
    return None
