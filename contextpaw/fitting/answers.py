"""What the server says it evaluated, checked against what was sent: the never-silent verdict, and
the samples it yields.

Ollama answers 200 after cutting a prompt, and counts what it evaluated after the cut. So every
answer's final record is read for that count (`truncation.judge` decides) before it reaches the
client: a cut, or a cut the numbers cannot rule out, is said in the report (in the body or the
stream's final record), the log and the metrics under every policy, and a whole evaluation teaches
the calibrated counter once. Every answer that carries a count leaves an `Evaluated` sample: the
server's count of that prompt, with its route, model and conversation, for whoever sizes the next
turn (`AnswerCheck.evaluated`).

A streamed OpenAI chat says its count only in a usage chunk, which comes only when asked for: it is
asked for where the client did not (`ask_usage`), and taken out of the stream again
(`unasked_records`), so the client gets the stream it asked for. No I/O.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from contextpaw import wire
from contextpaw.core import logs
from contextpaw.core.caches import LRU
from contextpaw.core.report import Report
from contextpaw.core.tokens import EstimateCounter
from contextpaw.core.truncation import ESTIMATE_BOUNDS, Evaluation, Verdict, judge, unknowable
from contextpaw.fitting.bounds import SIZE_PROOF_BYTES, as_sent
from contextpaw.fitting.calibration import Calibration, Sample
from contextpaw.fitting.counter_choice import rough_size
from contextpaw.fitting.flow import FlowState, Phase
from contextpaw.ops.metrics import Stats
from contextpaw.wire import openai
from contextpaw.wire.streams import Unasked

logger = logs.get(__name__)

REMEMBERED = 4096
"""Requests awaiting their answer, and conversations whose last count is kept (bounded, as every cache here)."""
REMEMBERED_LINES = 1 << 17
"""Lines whose digest is kept: a few windows of an agent's history (about 13 MB)."""
NEARING = 4
"""A conversation whose answered prompt took a quarter of its window or more may overflow soon: a
turn of it proved to fit by its size is read after its answer, for its rate."""


@dataclass(frozen=True, slots=True)
class Evaluated:
    """One answer's count of the prompt it evaluated, beside what was sent: the sample every
    answered request leaves, on every route, streamed or not (`AnswerCheck.evaluated`).

    `prompt_tokens` is the server's own count (`prompt_eval_count`, `usage.prompt_tokens`,
    `usage.input_tokens`, `tokens_evaluated`): after a cut, what was left of the prompt."""

    route: str
    """The route's name (`openai.chat`, `anthropic.messages`, ...)."""
    model: str
    conversation: str | None
    """The request's conversation key (`wire.Chat.key`: the same across a conversation's turns);
    None for a raw prompt, and for a request proved to fit by its size, which is never parsed
    (that is what the proof saves): the first turn that is parsed starts the conversation's keys."""
    prompt_tokens: int
    sent_tokens_estimate: int | None
    """Our count of what was sent (None: not counted)."""
    certain_cut: bool
    """The verdict: the server surely cut the prompt (`prompt_tokens` is what was left of it)."""
    possible_cut: bool = False
    """The numbers cannot rule a cut out (said to the client as possible)."""
    window: int | None = None
    """The window the request was judged against."""
    estimated: int | None = None
    """The byte estimate of what was sent (where the calibrated counter counted it): against
    `prompt_tokens`, the conversation's own ratio of tokens to the estimate."""

    @property
    def whole(self) -> bool:
        """The server evaluated the whole prompt, as far as the verdict can tell."""
        return not (self.certain_cut or self.possible_cut)


@dataclass(frozen=True, slots=True)
class Expected:
    """What an answer is read against, from its parsed request."""

    model: str
    conversation: str | None
    stream: bool
    usage_asked: bool
    """The client asked for the stream's usage itself."""
    usage_added: bool = False
    """ContextPaw asked for it in the client's stead: the usage chunk is taken out of the stream."""
    fingerprints: tuple[tuple[int, int], ...] = ()
    """The request's lines (`wire.Chat.fingerprints`): once it is answered whole and as it came, a
    request made mostly of them is counted at its rate."""


class AnswerCheck:
    """Reads each answer's count of what it evaluated, for the flow it answers."""

    def __init__(
        self,
        calibration: Calibration,
        stats: Stats,
        calibrate: bool = True,
        learn_window: Callable[[wire.Backend, str, int], None] | None = None,
    ) -> None:
        self.calibration = calibration
        self.stats = stats
        self.learn_window = learn_window
        """Where a window an answer proves smaller than believed is told (the next turn is fitted to it)."""
        self.calibrate = calibrate
        """Whether whole evaluations are learned from (`contextpaw_calibrate`)."""
        self._expected: LRU = LRU(REMEMBERED)
        """id(state) -> (a weak reference to it, its `Expected`), until the answer is read."""
        self._answered: LRU = LRU(REMEMBERED)
        """Conversation key -> the `Evaluated` of its last answered request."""
        self._by_line: LRU = LRU(REMEMBERED_LINES)
        """A line's digest -> the conversation key of the last request that carried it, answered
        whole and as the client sent it."""
        self.last: Evaluated | None = None
        """The last answer's sample, on any route."""

    # -- before the request goes --------------------------------------------------------------

    def expect(self, state: FlowState, parsed: wire.Chat | wire.Prompt) -> None:
        """Note what the answer to `state` is read against, from its parsed request."""
        key, marks = (parsed.key, parsed.fingerprints()) if isinstance(parsed, wire.Chat) else (None, ())
        usage = openai.usage_asked(parsed.body)
        self._remember(state, Expected(parsed.params.model, key, parsed.params.stream, usage, fingerprints=marks))

    def asked_stream(self, state: FlowState) -> bool | None:
        """Whether the request of `state` asked for a streamed answer, as parsed; None when it was
        not parsed (a request proved to fit by its size)."""
        expected = self._expected_of(state)
        return expected.stream if expected is not None else None

    def ask_usage(self, state: FlowState, body: bytes | None) -> bytes | None:
        """The body to send instead of `body` (what the fitter decided; None: the client's own)
        so that a streamed OpenAI chat answer says its prompt count: one that asks for its usage
        chunk, where the client did not. None when nothing is to be added: another route, an
        answer that is not streamed (it always carries usage), a client that asked, a flow whose
        answer is not read. A request proved to fit by its size was not parsed, and is not parsed
        here either when its bytes say enough (one `"stream"` key, no `"stream_options"`). A
        streamed text completion is asked on Ollama; llama-server's always ends with its usage."""
        text = state.route is openai.COMPLETIONS and state.backend.kind == wire.Kind.OLLAMA
        if state.watched is None or not (state.route is openai.CHAT or text):
            return None
        expected = self._expected_of(state) or _by_bytes(state.original)
        if expected is None or not expected.stream or expected.usage_asked:
            return None
        try:
            client = json.loads(state.original) if b'"stream_options"' in state.original else {}  # read only if it may say
            asked = openai.asking_usage(body if body is not None else state.original, client)
        except ValueError:
            return None
        self._remember(state, replace(expected, usage_added=True))
        return asked

    def unasked_records(self, state: FlowState) -> Unasked | None:
        """What the answer's stream carries that the client did not ask for (the usage chunk asked
        for in its stead, and the zero usage Ollama puts on each text-completion chunk then), which
        the stream takes out; None when there is nothing."""
        expected = self._expected_of(state)
        return Unasked(openai.is_usage_chunk, "usage") if expected is not None and expected.usage_added else None

    # -- the answer ------------------------------------------------------------------------------

    def evaluated(self, conversation: str) -> Evaluated | None:
        """The last answered request of a conversation (by `wire.Chat.key`): what the server
        counted of its prompt, beside what was sent."""
        return self._answered.get(conversation)

    def evaluated_like(self, parsed: wire.Chat) -> Evaluated | None:
        """The last answered request of `parsed`'s conversation; failing that, of the conversation
        whose last request, answered whole and as it came, carried most of `parsed`'s text. An agent
        that compacts its own history starts a new conversation (Qwen Code's summary request has a
        system prompt of its own, and its opening changes every turn after it; Claude Code's holds
        its summary and the files it reads again), and the server has already counted what it
        repeats: the rate of that count holds for it."""
        own = self._answered.get(parsed.key)
        if own is not None:
            return own
        carried: dict[str, int] = {}
        for digest, size in parsed.fingerprints():
            if (conversation := self._by_line.get(digest)) is not None:
                carried[conversation] = carried.get(conversation, 0) + size
        if not carried:
            return None
        conversation, size = max(carried.items(), key=lambda kv: kv[1])
        sample = self._answered.get(conversation)
        if sample is None or sample.model != parsed.params.model or size * 2 < parsed.characters:
            return None
        return sample

    def final_report(self, state: FlowState, final: Any, counted: int | None = None) -> dict[str, Any] | None:
        """The report (its JSON form) for the answer's final record, after checking the count the
        server reports there.

        Ollama evaluating clearly fewer tokens than it was sent means it cut the prompt in silence:
        that is said in the report, the log and the metrics, under every policy; a cut the numbers
        cannot rule out is said to be possible. The same count teaches the calibrated counter, and
        is kept as the request's `Evaluated`. Under policy off the answer is passed on as it came
        (None) unless the server cut it or may have: then a report of what was sent (the client's
        own request) goes on the wire all the same, in the body or the stream's final record, so
        that no cut is silent under any policy. A count the final record lacks may have come
        earlier in the stream (`counted`).
        """
        report = state.watched
        evaluated = state.route.evaluated(final) if isinstance(final, dict) else None
        evaluated = counted if evaluated is None else evaluated
        answered = isinstance(final, dict) and not final.get("error")  # a Responses body says "error": null
        if report is None or state.sent_tokens is None or not answered:
            if answered and evaluated is not None and state.phase is not Phase.JUDGED:
                self._sample(state, evaluated, None, report.window if report is not None else None)
            return state.report.to_json() if state.report is not None else None
        sent = state.sent_tokens
        if state.backend.kind != wire.Kind.OLLAMA:
            verdict = judge(sent, evaluated, report.window, state.bounds, truncation_forbidden=True)
        elif evaluated is None:  # a /v1 stream without usage says no count
            verdict = unknowable(sent, report.window, state.bounds, state.uncuttable)
        else:
            verdict = judge(sent, evaluated, report.window, state.bounds, state.uncuttable)
            if verdict.evaluation is Evaluation.UNSURE and _no_cut_explains(state.calibration, evaluated, report.window):
                verdict = Verdict(Evaluation.WHOLE)
        if (
            verdict.evaluation is Evaluation.UNSURE
            and (possible := verdict.truncation) is not None
            and report.upstream_truncation_possible is None
        ):
            report = replace(report, upstream_truncation_possible=possible, notes=_noted(report.notes, possible.note))
            state.watched = report
            self.stats.add("upstream_truncation_possible", where=state.where)
            logger.warning(
                "%s: the server may have cut a prompt counted at %d in a %d-token window (%s)",
                state.path,
                possible.sent_tokens,
                report.window or 0,
                possible.reason,
            )
        if verdict.evaluation is Evaluation.CUT and (truncation := verdict.truncation) is not None and report.upstream_truncated is None:
            report = replace(
                report, upstream_truncated=truncation, recovered_from_upstream_400=False, notes=_noted(report.notes, truncation.note)
            )
            state.watched = report
            self.stats.add("upstream_truncated", where=state.where)
            logger.warning(
                "%s: the server evaluated %s of the %d prompt tokens it was sent (%s): silent truncation",
                state.path,
                evaluated if evaluated is not None else "an unknown number",
                truncation.sent_tokens,
                truncation.reason,
            )
            if verdict.window_at_most is not None and self.learn_window is not None:
                model = wire.model_of(state.original) or state.where.model
                self.learn_window(state.backend, model, verdict.window_at_most)
                logger.warning(
                    "%s: %s's window is at most %d tokens, not %s: the next requests are fitted to it",
                    state.path,
                    model,
                    verdict.window_at_most,
                    report.window,
                )
        first = state.phase is not Phase.JUDGED
        state.advance(Phase.JUDGED)
        if first and evaluated is not None:
            self._sample(state, evaluated, verdict, report.window)
        if first and state.calibration is not None and self.calibrate and evaluated is not None:
            sample, whole = state.calibration, verdict.evaluation is Evaluation.WHOLE
            learned = self.calibration.observe(sample.key, sample.estimated, evaluated, whole=whole, kind=sample.kind, shaped=sample.shaped)
            if learned.reason.startswith("impossible"):
                logger.warning("%s: %s; not learned from (the backend's count is evidence, not truth)", state.path, learned.reason)
        if state.report is not None:
            return state.report.to_json()
        if report.upstream_truncated is None and report.upstream_truncation_possible is None:
            return None
        return _as_sent(report, sent).to_json()

    # -- what is kept of each request -----------------------------------------------------------

    def _sample(self, state: FlowState, evaluated: int, verdict: Verdict | None, window: int | None) -> None:
        expected = self._expected_of(state)
        cut = verdict is not None and verdict.evaluation is Evaluation.CUT
        possible = verdict is not None and verdict.evaluation is Evaluation.UNSURE and verdict.truncation is not None
        model = expected.model if expected is not None else (wire.model_of(state.original) or state.where.model)
        conversation = expected.conversation if expected is not None else None
        marks = expected.fingerprints if expected is not None else ()
        estimated = state.calibration.estimated if state.calibration is not None else None
        if (
            conversation is None
            and estimated is None
            and window
            and evaluated * NEARING >= window
            and len(state.original) <= SIZE_PROOF_BYTES
        ):
            conversation, estimated, marks = _read_as_sent(state)
        sample = Evaluated(state.route.name, model, conversation, evaluated, state.sent_tokens, cut, possible, window, estimated)
        self.last = sample
        if conversation is not None:
            self._answered.put(conversation, sample)
            if sample.whole and estimated is not None and not (state.report is not None and state.report.compacted):  # counted as it came
                for digest, _ in marks:
                    self._by_line.put(digest, conversation)

    def _remember(self, state: FlowState, expected: Expected) -> None:
        self._expected.put(id(state), (weakref.ref(state), expected))

    def _expected_of(self, state: FlowState) -> Expected | None:
        kept = self._expected.get(id(state))
        return kept[1] if kept is not None and kept[0]() is state else None


def _no_cut_explains(sized: Sample | None, evaluated: int, window: int | None) -> bool:
    """Whether no cut from the front can explain what the server counted. Ollama drops whole
    messages after the system prompt, oldest first, one at a time until the rest fits, and keeps
    the tools and the latest message (`least` of the byte estimate of what was sent); each message
    is at most 3.3 tokens to the estimate's one. Nothing was cut when the count and all it could
    have dropped stay within the window (a guarded cut of an agent whose tools and system prompt
    are most of its prompt), or when no message it could have dropped is big enough to have been
    the last one: that one took the prompt from over the window to what was counted (an agent's
    turns after its own compaction, a new conversation with no rate of its own, are judged so, not
    "possible" turn after turn)."""
    if sized is None or window is None:
        return False
    high = ESTIMATE_BOUNDS[1]
    if sized.least and evaluated + high * max(sized.estimated - sized.least, 0) <= window:
        return True
    return sized.droppable is not None and evaluated + high * sized.droppable < window - 1


def _read_as_sent(state: FlowState) -> tuple[str | None, int | None, tuple[tuple[int, int], ...]]:
    """A request proved to fit by its size went out unparsed (that is what the proof saves): read
    now (in a conversation `NEARING` its window only), small as it is, for its conversation's key
    the byte estimate of it and its lines' digests, so that the next turn, the first that may
    overflow, is counted at the conversation's own rate."""
    try:
        parsed = wire.keyed(state.route.read(state.original), state.refs.key)
    except (wire.Unreadable, wire.NotFittable, wire.NotCompactable, ValueError):
        return None, None, ()
    if not isinstance(parsed, wire.Chat):
        return None, None, ()
    return parsed.key, rough_size(parsed, EstimateCounter()), parsed.fingerprints()


STREAMED = re.compile(rb'"stream"\s*:\s*true\b')


def _by_bytes(raw: bytes) -> Expected | None:
    """What a body the fitter did not parse (proved to fit by its size) is read against, from its
    bytes where they say enough: one `"stream"` key (so it cannot be another object's), no
    `"stream_options"`; else from the body parsed (such a body is small)."""
    if raw.count(b'"stream"') == 1 and b'"stream_options"' not in raw:
        return Expected(wire.model_of(raw) or "", None, STREAMED.search(raw) is not None, usage_asked=False)
    if len(raw) > SIZE_PROOF_BYTES:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    return Expected(str(body.get("model", "")), None, body.get("stream") is True, openai.usage_asked(body))


def _noted(notes: tuple[str, ...], note: str | None) -> tuple[str, ...]:
    """`notes` with `note` at the end, once."""
    return notes if note is None or note in notes else (*notes, note)


def _as_sent(observed: Report, sent: int) -> Report:
    """Under policy off, the report the client is told: of its own request, as it was sent, with
    the verdict on it (what would have been compacted is in the notes, never claimed)."""
    notes = ["policy off: the request was sent as the client sent it"]
    if observed.compacted:
        notes.append(f"ContextPaw would have {observed.summary()}")
    notes += [note for note in observed.notes if note.startswith("ContextPaw counted")]
    return replace(
        as_sent(observed),
        original_tokens=sent,
        final_tokens=sent,
        upstream_truncated=observed.upstream_truncated,
        upstream_truncation_possible=observed.upstream_truncation_possible,
        notes=tuple(notes),
    )
