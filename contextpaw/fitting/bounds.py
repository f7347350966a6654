"""How far a request's true size can be from what we know of it, and what those bounds decide.

A small body is proved to fit by its byte length alone, before anything is parsed (`size_bound`);
a counted request carries bounds on how far its true size can be from our count, for the verdict
after the answer (`count_bounds`), the least among them being what the request's words prove
(`word_floor`); and where those bounds let it exceed its window, Ollama is told to refuse instead
of cutting (`forbid_truncation`). Pure: the fitter supplies the numbers.
"""

from __future__ import annotations

from contextpaw import wire
from contextpaw.core.report import Report
from contextpaw.core.tokens import EstimateCounter
from contextpaw.core.truncation import ESTIMATE_BOUNDS, EXACT_BOUNDS, could_exceed
from contextpaw.fitting.budget import Budget
from contextpaw.fitting.calibration import Calibration, Sample

NATIVE_OLLAMA = ("ollama.chat", "ollama.generate")
"""Ollama's routes that can carry `truncate: false`."""
SIZE_PROOF_BYTES = 64 * 1024
"""Bodies up to this size are first checked for fitting by their size alone (see `size_bound`)."""
UNPROVABLE = (b'"num_ctx"', b'"previous_response_id"', b"image")
"""What a body's size cannot bound: a window of its own, history kept on the server, and images (a
few bytes of base64 can cost hundreds of tokens)."""
TEMPLATE_ALLOWANCE = 512
MESSAGE_ALLOWANCE = 16
"""Tokens a chat template may add: once (a default system prompt, the generation prompt), and per message."""
FLOOR_ROLES = ("system", "user")
"""The messages every chat template renders whole. Tool results are left out of the word floor: a
template written for a model without tools may leave them out of the prompt."""
WORDS_CHUNK = 1 << 16
"""Words are counted a chunk at a time (`str.split` of a megabyte builds a list of every word)."""


def size_bound(raw: bytes) -> tuple[str, int] | None:
    """The body's model and an upper bound of its prompt in tokens, from its bytes alone.

    A token is at least one byte of text, and the JSON of a text is never shorter than its UTF-8;
    so the body's length, plus an allowance for the template, bounds its prompt. None for a body
    too big to be worth it, one that names its own window, keeps history on the server or carries
    images, or whose model cannot be read at once.
    """
    if len(raw) > SIZE_PROOF_BYTES or any(word in raw for word in UNPROVABLE) or (model := wire.model_of(raw)) is None:
        return None
    return model, len(raw) + TEMPLATE_ALLOWANCE + MESSAGE_ALLOWANCE * raw.count(b'"role"')


def words(text: str) -> int:
    """How many whitespace-separated words `text` has (a word across a chunk's seam counted once)."""
    if len(text) <= WORDS_CHUNK:
        return len(text.split())
    pieces = range(0, len(text), WORDS_CHUNK)
    return max(sum(len(text[i : i + WORDS_CHUNK].split()) for i in pieces) - (len(pieces) - 1), 0)


def word_floor(parsed: wire.Chat | wire.Prompt) -> int:
    """The least number of tokens the prompt of `parsed` has, whatever the tokenizer: tokenizers
    split at whitespace before they merge (GPT-2's pre-tokenizer, SentencePiece's word boundaries),
    so a text has at least as many tokens as words. Only what every template renders counts: the
    system text and prompt, the system and user messages (a tool result may be left out by a
    template without tools, an assistant's reasoning by one that drops old thinking)."""
    if isinstance(parsed, wire.Prompt):
        return words(parsed.prompt)
    fixed = words(parsed.fixed_text) if parsed.fixed_text else 0
    return fixed + sum(words(m.text) for m in parsed.conversation.messages if m.role in FLOOR_ROLES)


def as_sent(report: Report) -> Report:
    """The report of a request sent as the client sent it, beside the compaction `report` that was
    computed for it but not sent (policy off): the verdict is of what was sent."""
    size = report.original_tokens
    return Report(False, "none", size, size, report.budget, counter=report.counter, exact=report.exact, window=report.window)


def count_bounds(
    parsed: wire.Chat | wire.Prompt,
    report: Report,
    sample: Sample | None,
    key: str,
    bound: float | None,
    calibration: Calibration,
    estimate: EstimateCounter,
) -> tuple[float, float]:
    """How far the true size of what is sent can be from our count of it, for the verdict.

    A count of each text is exact for the texts, not for how the server renders them: a
    template may leave the tool definitions out (SmolLM2's does) and spend fewer tokens per
    message than we allow. So the low bound leaves those out: what was surely sent is the
    rest. Only the server's count of the whole request is exact as a whole. Where a guard sized
    the fit, the high bound is the one it sized it with (`bound`: what calibration learned of this
    kind of request, or the estimate's whole width). Otherwise a count by
    shape has no bounds of its own: the byte estimate of what was sent (the `sample`) gives them.

    The low bound is never below what the words of what was sent prove (`word_floor`): a text has
    at least as many tokens as words, so 5,800 words cannot fit in a 2,048-token window, whatever
    the estimate says. `parsed` is what was sent when `report` is not a compaction (a compaction's
    texts are not parsed again, and keep the bounds of the count)."""
    low, high = EXACT_BOUNDS if report.exact else calibration.bounds(key)
    if sample is not None and not report.exact and report.final_tokens > 0:
        scale = sample.estimated / report.final_tokens
        low, high = min(low, ESTIMATE_BOUNDS[0] * scale), max(high, ESTIMATE_BOUNDS[1] * scale)
    if bound is not None:
        high = bound
    if report.final_tokens <= 0:
        return low, high
    if report.counter != "backend" and isinstance(parsed, wire.Chat):
        conversation = parsed.conversation
        rendered_maybe = estimate.tools(conversation.tools) + len(conversation.messages) * estimate.message_overhead
        low = low * max(report.final_tokens - rendered_maybe, 0) / report.final_tokens
    if not report.compacted:
        low = max(low, word_floor(parsed) / report.final_tokens)
    return low, max(high, low)


def forbid_truncation(
    route: wire.Route, parsed: wire.Chat | wire.Prompt, report: Report, budget: Budget, bounds: tuple[float, float]
) -> bool:
    """Whether to ask Ollama to refuse instead of cutting: a request on a native route that can
    exceed the window given the error bounds of our count.

    Requests that cannot are left byte for byte; `truncate` set by the client is respected.
    """
    return (
        route.name in NATIVE_OLLAMA
        and "truncate" not in parsed.body
        and could_exceed(report.final_tokens, budget.window, bounds)
        and bool(parsed.conversation.messages if isinstance(parsed, wire.Chat) else parsed.prompt)  # a load request has nothing to cut
    )
