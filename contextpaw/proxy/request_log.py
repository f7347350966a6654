"""One INFO line per handled request, when it is over: what came in, what ContextPaw did with it
and what the client got, e.g.

    POST /api/chat ollama.chat fake: compacted 5737 -> 845 tokens (budget 944, window 1024) -> 200

The fitting's own lines (the numbers of a cut, the reason of a refusal) are DEBUG; this is the one a
person reads. It holds no prompt text."""

from __future__ import annotations

import json
import weakref

from mitmproxy import http

from contextpaw.core import logs
from contextpaw.core.report import Report
from contextpaw.fitting.flow import FlowState
from contextpaw.ops.metrics import UNKNOWN

logger = logs.get(__name__)

SMALL_BODY = 64 * 1024
"""A body read for its model when the fitting did not read it (it fitted by its size alone)."""


class RequestLog:
    def __init__(self, states: weakref.WeakKeyDictionary[http.HTTPFlow, FlowState]) -> None:
        self.states = states

    def response(self, flow: http.HTTPFlow) -> None:
        self._say(flow, str(flow.response.status_code) if flow.response else "no answer")

    def error(self, flow: http.HTTPFlow) -> None:
        self._say(flow, f"failed: {flow.error.msg}" if flow.error else "failed")

    def _say(self, flow: http.HTTPFlow, outcome: str) -> None:
        state = self.states.get(flow)
        if state is None:
            return
        if state.report is None and state.observed is not None:  # policy off: nothing was done
            report = state.observed
            what = f"unchanged {report.original_tokens} tokens (policy off)"
        else:
            what = what_happened(state.report)
        logger.info("%s %s %s %s: %s -> %s", flow.request.method, state.path, state.route.name, model_of(state), what, outcome)


def model_of(state: FlowState) -> str:
    """The request's model: as the fitting read it, else from a small body, else "?"."""
    if state.where.model != UNKNOWN:
        return state.where.model
    if len(state.original) <= SMALL_BODY:
        try:
            model = json.loads(state.original).get("model")
        except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, nested too deep
            model = None
        if isinstance(model, str) and model:
            return model
    return "?"


def what_happened(report: Report | None) -> str:
    """compacted / refused / unchanged, with the tokens before -> after and the window."""
    if report is None:
        return "unchanged (not judged)"
    room = f"budget {report.budget}" + (f", window {report.window}" if report.window else "")
    if report.strategy == "refused":
        return f"refused: {report.original_tokens} tokens, {report.required_tokens or report.original_tokens} needed ({room})"
    at_most = "at most " if report.upper_bound else ""
    if report.compacted:
        return f"compacted {report.original_tokens} -> {report.final_tokens} tokens ({room})"
    if not report.original_tokens:
        return "unchanged (" + "; ".join(report.notes or ["not counted"]) + ")"
    return f"unchanged {at_most}{report.original_tokens} -> {report.final_tokens} tokens ({room})"
