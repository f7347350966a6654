"""When a proxied request is over: one line per handled request, what came in, what ContextPaw
did with it and what the client got, e.g.

    POST /api/chat ollama.chat fake: compacted 5737 -> 845 tokens (budget 944, window 1024) -> 200

The line is INFO for a request that was changed, refused, would have been cut with the policy off,
or ended without a whole answer (or with a 5xx). A request that went on as it came and was answered
gets its line at INFO where it is the only line that names the request (`flow_detail` 0: the
`contextpaw` command's default, or no mitmdump at all), else at DEBUG, beside mitmproxy's own flow
line; and it is made only if the terminal log shows that level (`termlog_verbosity`). Under
mitmproxy a line costs the same at any level, shown or not (the root logger passes every record to
mitmproxy's handlers, which format it and wake the event loop): about 60 µs, a sixth of what
ContextPaw's hooks spend on a small request, paid for nothing under `mitmdump -q`.

and its time, from its start to the end of its answer, by route and by what became of it
(`contextpaw_request_duration_seconds`).

The fitting's own lines (the numbers of a cut, the reason of a refusal) are DEBUG; this is the one a
person reads. It holds no prompt text. The addon runs last, so the time includes every other
response hook (a rescue's retry, the report put into the answer); a streamed answer's response hook
comes when the stream has ended. It does arithmetic only, on the event loop."""

from __future__ import annotations

import json
import logging
import time
import weakref

from mitmproxy import ctx, http
from mitmproxy.optmanager import OptManager

from contextpaw import wire
from contextpaw.core import logs
from contextpaw.core.report import Report
from contextpaw.fitting.flow import FlowState
from contextpaw.ops.metrics import UNKNOWN, Stats
from contextpaw.proxy.backends import Backends
from contextpaw.proxy.replies import REFUSED_MARK

logger = logs.get(__name__)

SMALL_BODY = 64 * 1024
"""A body read for its model when the fitting did not read it (it fitted by its size alone)."""


class RequestLog:
    def __init__(self, states: weakref.WeakKeyDictionary[http.HTTPFlow, FlowState], stats: Stats, backends: Backends) -> None:
        self.states = states
        self.stats = stats
        self.backends = backends
        self.timed: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
        """The flows already timed: each once, whichever of its hooks ends it."""
        self.unchanged_level: int | None = logging.INFO
        """The level of the line of a request that went on unchanged; None: not made (not shown)."""

    def configure(self, updated: set[str]) -> None:
        if {"flow_detail", "termlog_verbosity"} & updated:
            self.unchanged_level = unchanged_level(ctx.options)

    def response(self, flow: http.HTTPFlow) -> None:
        self._time(flow)
        self._say(flow, str(flow.response.status_code) if flow.response else "no answer")

    def error(self, flow: http.HTTPFlow) -> None:
        self._time(flow)
        self._say(flow, f"failed: {flow.error.msg}" if flow.error else "failed")

    def _time(self, flow: http.HTTPFlow) -> None:
        if flow in self.timed:
            return
        state = self.states.get(flow)
        if state is not None:
            where = state.where
        else:  # a request on a handled route answered before the fitting read it (502, 503, 413, 415, ...)
            kind = self.backends.kind_at(f"{flow.request.host}:{flow.request.port}")
            route = wire.route_for(kind, flow.request.method, flow.request.path) if kind is not None else None
            if route is None:
                return
            where = self.stats.where(kind, route.name)
        self.timed.add(flow)
        now = time.time()
        self.stats.proxied(where, outcome(flow, state), now - (flow.request.timestamp_start or now))

    def _say(self, flow: http.HTTPFlow, answered: str) -> None:
        state = self.states.get(flow)
        if state is None:
            return
        level: int | None = logging.INFO
        if outcome(flow, state) == "unchanged" and not (state.observed is not None and state.observed.compacted):
            level = self.unchanged_level
        if level is None:
            return
        if state.report is None and state.observed is not None:  # policy off: nothing was done
            report = state.observed
            what = f"unchanged {report.original_tokens} tokens (policy off)"
        else:
            what = what_happened(state.report)
        logger.log(level, "%s %s %s %s: %s -> %s", flow.request.method, state.path, state.route.name, model_of(state), what, answered)


def unchanged_level(options: OptManager) -> int | None:
    """INFO where no flow line of mitmproxy's names the request, else DEBUG; None where the terminal
    does not show that level (without mitmproxy's terminal log, the handlers decide)."""
    level = logging.INFO if "flow_detail" not in options or options.flow_detail == 0 else logging.DEBUG
    if "termlog_verbosity" in options and level < logging.getLevelName(options.termlog_verbosity.upper()):
        return None
    return level


def outcome(flow: http.HTTPFlow, state: FlowState | None) -> str:
    """compacted, unchanged, refused (answered here) or error (no whole answer, or a 5xx)."""
    if state is not None and state.local:
        return "refused"
    if flow.error is not None or flow.response is None or flow.response.status_code >= 500:
        return "error"
    if state is None:
        return "refused" if flow.marked == REFUSED_MARK else "unchanged"
    return "compacted" if state.report is not None and state.report.compacted else "unchanged"


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
        why = f": {report.notes[0]}" if report.notes else ""
        return f"refused: {report.original_tokens} tokens, {report.required_tokens or report.original_tokens} needed ({room}){why}"
    at_most = "at most " if report.upper_bound else ""
    if report.compacted:
        return f"compacted {report.original_tokens} -> {report.final_tokens} tokens ({room})"
    if not report.original_tokens:
        return "unchanged (" + "; ".join(report.notes or ["not counted"]) + ")"
    return f"unchanged, {at_most}{report.original_tokens} tokens ({room})"
