"""What the server says it evaluated, checked against what was sent: the never-silent verdict, and
the calibration sample it yields.

Ollama answers 200 after cutting a prompt, and counts what it evaluated after the cut. So every
answer's final record is read for that count (`truncation.judge` decides) before it reaches the
client: a cut is said in the report, the log and the metrics under every policy, and a whole
evaluation teaches the calibrated counter once. No I/O.
"""

from __future__ import annotations

from typing import Any

from contextpaw import logs, wire
from contextpaw.calibration import Calibration
from contextpaw.flow import FlowState, Phase
from contextpaw.metrics import Stats
from contextpaw.truncation import Evaluation, judge, unknowable

logger = logs.get(__name__)


class AnswerCheck:
    """Reads each answer's count of what it evaluated, for the flow it answers."""

    def __init__(self, calibration: Calibration, stats: Stats, calibrate: bool = True) -> None:
        self.calibration = calibration
        self.stats = stats
        self.calibrate = calibrate
        """Whether whole evaluations are learned from (`contextpaw_calibrate`)."""

    def final_report(self, state: FlowState, final: Any, counted: int | None = None) -> dict[str, Any] | None:
        """The report (its JSON form) for the answer's final record, after checking the count the
        server reports there.

        Ollama evaluating clearly fewer tokens than it was sent means it cut the prompt in silence:
        that is said in the report, the log and the metrics, under every policy. The same count
        teaches the calibrated counter. Under policy off the answer is passed on as it came (None)
        unless the server cut it: then the report goes on the wire all the same, in the
        body or the stream's final record, so that no cut is silent under any policy. A count the
        final record lacks may have come earlier in the stream (`counted`).
        """
        report = state.watched
        evaluated = state.route.evaluated(final) if isinstance(final, dict) else None
        evaluated = counted if evaluated is None else evaluated
        on_wire = state.report is not None
        answered = isinstance(final, dict) and not final.get("error")  # a Responses body says "error": null
        if report is None or state.sent_tokens is None or not answered:
            return state.report.to_json() if state.report is not None else None
        sent = state.sent_tokens
        if state.backend.kind != wire.Kind.OLLAMA:
            verdict = judge(sent, evaluated, report.window, state.bounds, truncation_forbidden=True)
        elif evaluated is None:  # a /v1 stream without stream_options.include_usage says no count
            verdict = unknowable(sent, report.window, state.bounds, state.uncuttable)
        else:
            verdict = judge(sent, evaluated, report.window, state.bounds, state.uncuttable)
        if verdict.evaluation is Evaluation.UNSURE and verdict.truncation is not None and report.upstream_truncation_possible is None:
            report.upstream_truncation_possible = verdict.truncation
            self.stats.add("upstream_truncation_possible", where=state.where)
            logger.warning("%s: the server may have cut a prompt counted at %d in a %d-token window (%s)",
                           state.path, sent, report.window or 0, verdict.truncation.reason)  # fmt: skip
        if verdict.evaluation is Evaluation.CUT and (truncation := verdict.truncation) is not None and report.upstream_truncated is None:
            report.upstream_truncated = truncation
            report.recovered_from_upstream_400 = False
            self.stats.add("upstream_truncated", where=state.where)
            logger.warning(
                "%s: the server evaluated %d of the %d prompt tokens it was sent (%s): silent truncation",
                state.path, evaluated, sent, truncation.reason,
            )  # fmt: skip
        first = state.phase is not Phase.JUDGED
        state.advance(Phase.JUDGED)
        if first and state.calibration is not None and self.calibrate and evaluated is not None:
            sample, whole = state.calibration, verdict.evaluation is Evaluation.WHOLE
            learned = self.calibration.observe(sample.key, sample.estimated, evaluated, whole=whole, kind=sample.kind, shaped=sample.shaped)
            if learned.reason.startswith("impossible"):
                logger.warning("%s: %s; not learned from (the backend's count is evidence, not truth)", state.path, learned.reason)
        return report.to_json() if on_wire or report.upstream_truncated is not None else None
