"""Catching Ollama's silent truncation, without false alarms.

Ollama answers 200 after cutting a prompt, and its `prompt_eval_count` is counted after the cut.
Two facts decide it: Ollama only cuts a prompt longer than the window it used, and after a cut
`prompt_eval_count` never exceeds that window. So the verdict rests on the window used, on whether
what was sent could have exceeded it given the error bounds of our count, and on where the count
the server reports lands: on the value its token-level cut always produces, or below any size the
prompt we sent can have (whole messages dropped). A request that carried `truncate: false` cannot
be cut (Ollama answers 400 instead). Pure: the shell supplies the numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from enum import Enum

EXACT_BOUNDS = (0.97, 1.03)
"""How far the true prompt size can be from an exact count (template details, BOS)."""
ESTIMATE_BOUNDS = (0.25, 3.3)
"""How far it can be from the byte estimate (3.2 bytes a token) before calibration: a token is at
least one byte, so no text has more than 3.2 times the tokens it says (dense text such as
one-letter words comes close), and long runs of whitespace or code take up to 13 bytes a token."""


@dataclass(frozen=True, slots=True)
class Truncation:
    sent_tokens: int
    """What was sent, as far as is known: our count, or more where the server's own numbers prove
    more (a cut means the prompt was longer than the window; a whole evaluation counts all of it)."""
    evaluated_tokens: int
    """What the server says it evaluated (0: it said nothing)."""
    num_ctx: int | None
    reason: str
    note: str | None = None
    """Set where our count and the server's disagree: what we counted, and that the server is trusted."""

    def to_json(self) -> dict[str, object]:
        return asdict(self)


class Evaluation(Enum):
    WHOLE = "whole"
    """The server evaluated all of it: flag nothing, and calibration may learn from the count."""
    CUT = "cut"
    UNSURE = "unsure"
    """The numbers allow both: said as possible, never claimed, never learned from (the caller
    prevents this case wherever it can change the request)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    evaluation: Evaluation
    truncation: Truncation | None = None
    window_at_most: int | None = None
    """Set where the count proves the server's window smaller than believed: the most it can be."""


SHRUNK_SLACK = 32
"""Tokens below the least a prompt can be that a count must fall before it proves a window smaller
than believed: rounding, a template's extra or a BOS never explain that many."""
SHRUNK = "the server evaluated fewer tokens than the least the prompt sent can be: its window is smaller than the {window} believed"


def cut_counts(num_ctx: int) -> set[int]:
    """`prompt_eval_count` values that only a token-level cut produces, across Ollama versions."""
    return {num_ctx, num_ctx - 1} | {num_ctx - (num_ctx - keep) // 2 for keep in range(0, 9)}


def could_exceed(sent_tokens: int, window: int, bounds: tuple[float, float]) -> bool:
    """Whether a prompt we count at `sent_tokens` can be over what `window` holds (the runner
    needs one token for BOS)."""
    return sent_tokens * bounds[1] > window - 1


def told(sent_tokens: int, evaluated_tokens: int, window: int, reason: str, cut: bool) -> Truncation:
    """A cut or a possible cut, in numbers that never contradict each other: where the server's
    count says more was sent than we counted, the server is trusted, and the note says so.

    A prompt the server evaluated more of than we counted was sent at least that count, and, if it
    was cut, more than the window (Ollama cuts only a prompt longer than its window)."""
    if sent_tokens >= evaluated_tokens:
        return Truncation(sent_tokens, evaluated_tokens, window, reason)
    least = max(evaluated_tokens, window) if cut else evaluated_tokens
    why = (
        f"a cut means the prompt was longer than the server's {window}-token window" if cut else f"the server evaluated {evaluated_tokens}"
    )
    note = f"ContextPaw counted about {sent_tokens} prompt tokens, but {why}: the server's count is trusted"
    return Truncation(least, evaluated_tokens, window, reason, note)


def unknowable(sent_tokens: int, window: int | None, bounds: tuple[float, float], truncation_forbidden: bool) -> Verdict:
    """The server reported no count (an OpenAI-compatible stream whose usage was not asked for): a
    prompt surely larger than the window was cut, and one that can exceed it may have been, and
    that is said."""
    if truncation_forbidden or (window is not None and not could_exceed(sent_tokens, window, bounds)):
        return Verdict(Evaluation.WHOLE)
    if window is None:
        return Verdict(Evaluation.UNSURE)
    if sent_tokens * bounds[0] > window:
        reason = "the prompt sent is larger than the window the server used (the server reported no prompt count)"
        return Verdict(Evaluation.CUT, told(sent_tokens, 0, window, reason, cut=True))
    doubt = "the server reported no prompt count, and the prompt may have been longer than the window"
    return Verdict(Evaluation.UNSURE, Truncation(sent_tokens, 0, window, doubt))


def judge(
    sent_tokens: int,
    evaluated_tokens: int | None,
    window: int | None,
    bounds: tuple[float, float],
    truncation_forbidden: bool = False,
) -> Verdict:
    """What the server did with a prompt we count at `sent_tokens` (true size within `bounds`
    times that: the low bound is the least the prompt sent can be, the word floor among what
    proves it), given the window it used and the count it reported."""
    if evaluated_tokens is None or evaluated_tokens <= 0 or sent_tokens <= 0:
        return Verdict(Evaluation.UNSURE)
    if truncation_forbidden:
        return Verdict(Evaluation.WHOLE)
    if window is None:
        return Verdict(Evaluation.UNSURE)
    low, _ = bounds
    if evaluated_tokens > window:
        return Verdict(Evaluation.WHOLE)
    if not could_exceed(sent_tokens, window, bounds):
        if evaluated_tokens >= sent_tokens * low - SHRUNK_SLACK:
            return Verdict(Evaluation.WHOLE)
        # the window believed was not the one used (a server restarted with a smaller one): the
        # count proves a cut all the same, and bounds the window used from above
        cut = told(sent_tokens, evaluated_tokens, window, SHRUNK.format(window=window), cut=True)
        return Verdict(Evaluation.CUT, replace(cut, num_ctx=None), window_at_most=evaluated_tokens + 1)
    if sent_tokens * low > window:
        reason = "the prompt sent is larger than the window the server used"
    elif evaluated_tokens in cut_counts(window):
        reason = "count matches Ollama's token-level cut"
    elif evaluated_tokens < sent_tokens * low:
        reason = "server evaluated fewer tokens than were sent"
    else:
        doubt = "the prompt may have been longer than the window; the count sent is an estimate"
        return Verdict(Evaluation.UNSURE, told(sent_tokens, evaluated_tokens, window, doubt, cut=False))
    return Verdict(Evaluation.CUT, told(sent_tokens, evaluated_tokens, window, reason, cut=True))
