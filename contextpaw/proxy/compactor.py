"""The `Compactor` addon, the mitmproxy shell of fitting: options and hooks, and nothing else.

The addons, one concern each, in the order their hooks run (`compose.make_addons` wires them, after
the heap and deadline addons):
- `Arbitration` (arbitration.py) makes one runtime own the GPU before a request reaches it;
- `AdminEndpoints` (endpoints.py) answers `/contextpaw/*` itself, and keeps the backends' Host check;
- `Backends` (backends.py) knows which backend a flow goes to, and answers a JSON 502 when it does
  not answer;
- `Compactor` (here) hands each handled request to the `Fitter` once, and puts its report into the answer;
- `Upstream` (upstream.py) sends handled requests through the relay, which answers a failing backend in
  the API's convention (502, 504, or an error record in a stream) and asks the fitter to rescue an overflow.

The decisions live in `contextpaw.fitting` (and below it `wire` and `core`); the hooks
move data between the flow and them. What ContextPaw knows about a flow is one `FlowState`, kept
beside the flow (mitmproxy saves `flow.metadata` with tnetstring, which takes no dataclass); what
mitmweb shows and saved flows keep is written to `flow.metadata` as JSON-like values.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import sqlite3
import weakref
from pathlib import Path
from typing import Any

import aiohttp
from mitmproxy import connection, ctx, exceptions, http
from mitmproxy.flow import Error as FlowError

from contextpaw import wire
from contextpaw.calls.session import PROBE_TIMEOUT_S, Session
from contextpaw.calls.summarizer import Summarizer
from contextpaw.core import logs
from contextpaw.fitting.fitter import Fitter
from contextpaw.fitting.flow import FlowState, Refuse
from contextpaw.fitting.services import OFFLOAD_BYTES, off_loop
from contextpaw.ops import keys
from contextpaw.ops.archive import Archive
from contextpaw.ops.kept import KeptCalibration, remove_leftovers
from contextpaw.ops.metrics import FailureLedger
from contextpaw.proxy.backends import UNDECODED, Backends
from contextpaw.proxy.endpoints import proxy_url
from contextpaw.proxy.replies import (
    COMPACTED_MARK,
    REFUSED_MARK,
    TRUNCATED_MARK,
    cut_comment,
    flag,
    off_comment,
    overflow_comment,
    put_headers,
    reply,
)
from contextpaw.proxy.views import ORIGINAL, REPORT
from contextpaw.relay.exchange import ERROR_HEADER
from contextpaw.relay.rescue import rescued
from contextpaw.settings import FitSettings, declare, unknown_options
from contextpaw.wire import bodies
from contextpaw.wire.bodies import HOP_HEADERS
from contextpaw.wire.streams import KEPT_STREAM, STREAM_TYPES, StreamReport, own_bytes, splice

TRUNCATION_FLAGGED = "contextpaw.truncation_flagged"
"""Set once the flow is marked as cut by its server: the mark and comment are made once."""

logger = logs.get(__name__)

CALIBRATION_FILE = "contextpaw-calibration.json"
OLD_SUMMARY_FILE = "contextpaw-summaries.json"
"""Where the summarizer's cache was kept before it moved into the archive's `digests` table:
removed at start (it holds digests of evicted content outside the archive and its bounds)."""
FIT_OPTIONS = {*FitSettings.options(), "confdir"}
"""The options whose change re-reads the fit settings (confdir: where the state is kept by default)."""

FlowStates = weakref.WeakKeyDictionary[http.HTTPFlow, FlowState]
"""Each handled flow's state, for as long as mitmproxy keeps the flow."""


def remove_old_summaries(state_dir: Path) -> None:
    """Remove the summary cache's JSON file an earlier version kept (and its half-written copies)."""
    old = state_dir / OLD_SUMMARY_FILE
    remove_leftovers(old)
    try:
        old.unlink()
    except FileNotFoundError:
        return
    except OSError as e:
        logger.warning("the old summary cache %s cannot be removed (%s): remove it by hand", old, e)
        return
    logger.info("the old summary cache %s was removed: digests are kept in the archive now", old)


class Compactor:
    """Fits handled requests into the budget, refuses or rescues them, and reports what was lost."""

    def __init__(
        self,
        backends: Backends,
        fitter: Fitter,
        states: FlowStates,
        ledger: FailureLedger,
        session: Session,
        archive: Archive | None = None,
    ) -> None:
        self.backends = backends
        self.archive = archive
        """The evicted store the options choose (None: the fitter's own, as it was made)."""
        self.fitter = fitter
        self.states = states
        self.ledger = ledger
        self.session = session
        self.kept: KeptCalibration | None = None
        self.secret = b""
        """The proxy's secret (`ops.keys`), read when the state dir is set."""

    def load(self, loader: Any) -> None:
        declare(loader, FitSettings.options())

    def configure(self, updated: set[str]) -> None:
        if said := unknown_options(ctx.options.deferred, ctx.options.keys()):
            raise exceptions.OptionsError(said)  # at start: mitmdump exits with it, before it listens
        if not FIT_OPTIONS & updated:
            return
        try:
            settings = FitSettings.parse(ctx.options)
        except ValueError as e:
            raise exceptions.OptionsError(str(e)) from None
        if {"contextpaw_state_dir", "confdir"} & updated:
            remove_old_summaries(settings.state_dir)
            try:
                self.secret = keys.secret(settings.state_dir)
            except OSError as e:  # a read-only state dir: references hold until the next start only
                logger.warning(
                    "the secret cannot be kept in %s (%s): markers of this run are not readable after a restart", settings.state_dir, e
                )
                self.secret = secrets.token_bytes(keys.SECRET_BYTES)
            self.kept = KeptCalibration(settings.state_dir / CALIBRATION_FILE)
            if self.kept.restore(self.fitter.calibration) is False:
                logger.warning("calibration state %s is damaged; starting from scratch", self.kept.path)
        secret = self.secret
        if self.archive is not None:
            try:
                if {"contextpaw_archive", "contextpaw_state_dir", "confdir"} & updated:
                    self._open_archive(settings)
                secret = self.archive.shared_secret(self.secret)
            except Exception as e:  # sqlite3's, the OS's, redis-py's errors: said as the option's
                raise exceptions.OptionsError(f"contextpaw_archive: {settings.archive} cannot be opened: {e}") from None
        summarizer = self.fitter.summarizer
        if {"contextpaw_summarize", "contextpaw_summarizer_timeout", "contextpaw_archive", "contextpaw_state_dir", "confdir"} & updated:
            kept = self.archive if self.archive is not None else self.fitter.store
            summarizer = Summarizer(timeout=settings.summarizer_timeout, kept=kept) if settings.summarize else None
        self.fitter.configure(settings, summarizer, secret)

    def _open_archive(self, settings: FitSettings) -> None:
        """The archive the options name; the default one (SQLite in the state dir) falls back to
        memory, with one warning, where the state dir cannot hold it: the proxy still starts."""
        assert self.archive is not None
        try:
            self.archive.open(settings.archive, settings.state_dir)
        except (OSError, sqlite3.Error) as e:
            if settings.archive != "sqlite":
                raise
            logger.warning("the archive cannot be kept in %s (%s): evicted content is kept in memory only", settings.state_dir, e)
            self.archive.open("memory", settings.state_dir)

    def done(self) -> None:
        """Close the shared session and keep what calibration learned (sync: hot reload)."""
        self.session.close()
        if self.archive is not None:
            self.archive.close()
        if self.kept is not None:
            self.kept.save(self.fitter.calibration, force=True)

    def summary_metrics(self) -> dict[str, float]:
        """Summarizer counters for /contextpaw/metrics (zeros while summarizing is off)."""
        summarizer = self.fitter.summarizer
        stats = summarizer.stats() if summarizer else {}
        return {f"summarizer_{k}": float(stats.get(k, 0)) for k in ("digests", "calls", "cache_hits", "failures", "seconds")}

    # -- request ------------------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        backend = await self.backends.backend_of(flow)
        route = wire.route_for(backend.kind, flow.request.method, flow.request.path) if backend is not None else None
        if backend is None or route is None:
            return
        if UNDECODED in flow.metadata or flow.request.headers.get("content-encoding", "identity").strip().lower() != "identity":
            return  # still encoded (the backends addon decodes what it can, off the loop): never decoded here
        raw = flow.request.raw_content
        if raw is None:
            return
        content_type = flow.request.headers.get("content-type", "")
        if (utf8 := wire.as_utf8(raw, content_type)) is not None:  # read by its declared charset, sent as JSON's own
            flow.request.content = raw = utf8
            flow.request.headers["content-type"] = wire.utf8_type(content_type)
        state = FlowState(
            backend,
            route,
            raw,
            flow.request.path,
            flow.request.headers.get("Authorization"),
            proxy_url(flow),
            session=wire.session_of(flow.request.headers.get(wire.SESSION_HEADER)),
            left=functools.partial(gone, flow.client_conn),
        )
        self.states[flow] = state
        decision = await self.fitter.fit(state)
        if state.left():  # a fit of megabytes takes long enough: nobody waits for the answer
            flow.kill()
            return
        if isinstance(decision, Refuse):
            reply(flow, decision.status, decision.body)
            flag(flow, REFUSED_MARK, _refusal(state, decision.reason))
            flow.metadata[REPORT] = state.report.to_json() if state.report else None
            return
        if state.observed is not None and state.observed.compacted:
            flow.comment = off_comment(route.name, state.observed)
        if decision.compacted and state.report is not None:
            flag(flow, COMPACTED_MARK, cut_comment(route.name, state.report), replace=True)
            flow.metadata[REPORT] = state.report.to_json()  # mitmweb shows it before the answer is in
        if decision.body is not None:
            flow.metadata[ORIGINAL] = raw
            flow.request.content = decision.body

    # -- response -----------------------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        assert response is not None
        state = self.states.get(flow)
        if UNDECODED in flow.metadata:
            response.headers["X-ContextPaw-Error"] = flow.metadata[UNDECODED]
        if state is not None:
            if state.retried:  # the relay's retry, or its refusal (a flow it does not carry is not retried yet)
                self._settled(flow, state)
            put_headers(response.headers, state.headers)
        if (
            (state and state.local)
            or response.raw_content is not None
            or not response.headers.get("content-type", "").startswith(STREAM_TYPES)
        ):
            return  # a whole answer (made here, or read whole in the request hook) is read in `response`
        if state is None or state.watched is None or response.headers.get("content-encoding", "identity") != "identity":
            response.stream = True
            return
        response.stream = self._stream_report(flow, state, keep=KEPT_STREAM)
        if "content-length" in response.headers:
            del response.headers["content-length"]
            response.headers["transfer-encoding"] = "chunked"

    async def response(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        assert response is not None
        state = self.states.get(flow)
        if isinstance(response.stream, StreamReport) and response.stream.kept is not None:
            response.raw_content = bytes(response.stream.kept)  # what the client got, for mitmweb and saved flows
        if state is None or state.watched is None or state.local or response.stream:
            return
        try:
            content = await self._answer(flow)
            if content is None:
                return  # it does not decode within the limit: passed on as it came, headers aside
            if self.fitter.may_rescue(state) and wire.upstream_overflow(response.status_code, content):
                await self._rescue(flow, state)
                assert flow.response is not None
                put_headers(flow.response.headers, state.headers)
                content = flow.response.content or b""  # the retry's answer
            elif response.status_code >= 500 and ERROR_HEADER not in response.headers:
                self.ledger.failed(
                    f"{flow.request.method} {flow.request.path}", f"the backend answered {response.status_code}", where=state.where
                )
            await self._report_in_body(flow, state, content)
        except Exception as e:  # fail open: the client gets the backend's answer as it was
            logger.exception("ContextPaw failed on the response to %s; passing it through", flow.request.path)
            assert flow.response is not None
            flow.response.headers["X-ContextPaw-Error"] = f"{type(e).__name__} on the response; passed through"
            self.ledger.stats.add("errors", where=state.where)

    def error(self, flow: http.HTTPFlow) -> None:
        """A handled flow that ended without a (whole) answer: count it, and say which."""
        if flow in self.states and flow.error and not _client_left(flow.error):
            target = f"{flow.request.host}:{flow.request.port}"
            self.ledger.failed(f"{flow.request.method} {flow.request.path}", flow.error.msg, target=target, where=self.states[flow].where)

    async def _rescue(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """The rescue for a flow the relay does not carry: retried here (until the answer is not an
        overflow, within the fitter's bound), answered in one piece."""
        headers = {k: v for k, v in flow.request.headers.items() if k.lower() not in HOP_HEADERS}
        timeout = aiohttp.ClientTimeout(sock_connect=PROBE_TIMEOUT_S, sock_read=ctx.options.contextpaw_header_timeout)
        assert flow.response is not None

        async def send(retry: bytes) -> tuple[int, bytes]:
            async with self.session.get().post(flow.request.url, data=bodies.as_upload(retry), headers=headers, timeout=timeout) as answer:
                content = await answer.read()
                kept = [(k.encode(), v.encode()) for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS]
                flow.response = http.Response.make(answer.status, content, http.Headers(kept))
                return answer.status, content

        decide = functools.partial(self.fitter.rescue, state)
        refusal = await rescued(flow.response.status_code, flow.response.content or b"", decide, send)
        if refusal is not None:
            reply(flow, refusal.status, refusal.body)
        if state.retried:
            self._settled(flow, state)

    def _settled(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """The retry's answer is in: say whether it recovered; mitmweb shows what was sent last."""
        assert flow.response is not None and state.report is not None
        if state.local:  # nothing that must be kept fits the window the backend named
            flag(flow, REFUSED_MARK, _refusal(state, "after the backend's overflow"), replace=True)
            return
        self.fitter.settle_rescue(state, flow.response.status_code, ERROR_HEADER in flow.response.headers)
        flag(flow, COMPACTED_MARK, cut_comment(state.route.name, state.report), replace=True)
        flow.metadata[ORIGINAL] = state.original
        if state.sent is not None:
            flow.request.content = state.sent

    async def _answer(self, flow: http.HTTPFlow) -> bytes | None:
        """The answer's body, decoded. A compressed one is inflated off the event loop with the
        request's limit (`contextpaw_max_body_mb`), and goes on decoded; one that does not decode
        within it, or in an encoding not read here, is None (passed on as it came). mitmproxy's own
        decoding would run on the loop, unbounded: a 0.5 MB gzip of 512 MB stalled every client.
        An answer over the limit is not read either: parsing JSON holds the interpreter's lock for the
        whole call, even in a worker thread (a 300 MB answer held every other client 7 s); no chat
        answer is that long, and it goes on as it came, saying that its count was not checked."""
        response = flow.response
        assert response is not None
        raw = response.raw_content or b""
        limit = self.backends.settings.max_body_bytes
        if len(raw) > limit:
            logger.warning("%s: an answer of %d bytes was passed on unread (contextpaw_max_body_mb)", flow.request.path, len(raw))
            response.headers["X-ContextPaw-Error"] = (
                f"the answer ({len(raw):,} bytes) is over contextpaw_max_body_mb: passed on unread, its count not checked"
            )
            return None
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            return raw
        if encoding not in bodies.ENCODINGS:
            return None
        try:
            body = await asyncio.to_thread(bodies.inflate, raw, encoding, limit)
        except (bodies.TooLarge, ValueError) as e:
            logger.warning("%s: the answer was passed on as it came, without the report: %s", flow.request.path, e)
            return None
        del response.headers["content-encoding"]
        response.raw_content = body
        return body

    async def _report_in_body(self, flow: http.HTTPFlow, state: FlowState, content: bytes) -> None:
        """Put the report into the answer (`content`, its body as read once); a big one is parsed
        off the event loop."""
        response = flow.response
        assert response is not None
        if not content:
            return
        if response.headers.get("content-type", "").startswith(STREAM_TYPES):
            response.content = self._stream_report(flow, state).transform(content)
            return
        try:
            big = len(content) > OFFLOAD_BYTES
            answer = await off_loop(big, functools.partial(wire.read_json, content)) if big else wire.read_json(content)
        except ValueError:
            self.ledger.failed(
                f"{flow.request.method} {flow.request.path}",
                "the backend's answer is not JSON; passed through as it was",
                where=state.where,
            )
            return
        value = self._final_report(flow, state, answer) if isinstance(answer, dict) else None
        content = own_bytes(state.retold) if value is not None and state.retold is not None else content
        if value is not None and (body := splice(content, value)) is not None:  # a JSON object: parsed above
            response.content = body
        watched = state.watched
        if watched is not None and (truncated := watched.upstream_truncated) is not None:
            response.headers["X-ContextPaw-Upstream-Truncated"] = (
                f"{truncated.evaluated_tokens} of {truncated.sent_tokens} tokens evaluated"
            )
        elif watched is not None and (possible := watched.upstream_truncation_possible) is not None:
            response.headers["X-ContextPaw-Upstream-Truncation-Possible"] = (
                f"possibly: {possible.evaluated_tokens} evaluated of about {possible.sent_tokens}, window {possible.num_ctx}"
            )

    def _stream_report(self, flow: http.HTTPFlow, state: FlowState, keep: int = 0) -> StreamReport:
        route = state.route
        report = functools.partial(self._final_report, flow, state)
        return StreamReport(
            route.framing,
            route.is_final,
            report,
            route.evaluated,
            keep=keep,
            unasked=self.fitter.answers.unasked_records(state),
            telling=route.telling,
            retold=lambda: state.retold,
        )

    def _final_report(self, flow: http.HTTPFlow, state: FlowState, final: Any, counted: int | None = None) -> bytes | None:
        """The fitter's report for the answer's final record (`counted`: the prompt size an earlier
        record of the stream reported); a cut the server made is flagged in mitmweb, and what
        calibration learned is kept. It runs inside the answer's stream, so a failure of ours passes
        the record on as it came (fail open) and is counted."""
        try:
            return self._checked_report(flow, state, final, counted)
        except Exception:
            logger.exception("ContextPaw failed on the final record of %s; passed through", flow.request.path)
            self.ledger.stats.add("errors", where=state.where)
            return None

    def _checked_report(self, flow: http.HTTPFlow, state: FlowState, final: Any, counted: int | None) -> bytes | None:
        value = self.fitter.answers.final_report(state, final, counted)
        whole = wire.usage_whole(self.fitter.settings.usage_whole, flow.request.headers.get(wire.USAGE_HEADER))
        if value is not None and isinstance(final, dict) and whole:
            value = self._usage_told(state, final, value)
        if isinstance(final, dict) and (cache := wire.prompt_cache(final)) is not None:
            reused, evaluated = cache
            self.ledger.stats.add("prompt_tokens_reused", reused, state.where)
            self.ledger.stats.add("prompt_tokens_evaluated", evaluated, state.where)
            if value is not None:  # what a cut cost in prefill, turn by turn: the server's own figures
                value = {**value, "prompt_cache": {"reused_tokens": reused, "evaluated_tokens": evaluated}}
        watched = state.watched
        if watched is not None:
            flow.metadata[REPORT] = value if value is not None and watched is state.report else watched.to_json()
            cut = watched.upstream_truncated or watched.upstream_truncation_possible
            if cut is not None and TRUNCATION_FLAGGED not in flow.metadata:  # a stream may ask twice
                flow.metadata[TRUNCATION_FLAGGED] = True
                told = (
                    f"cut the prompt: {cut.evaluated_tokens} of {cut.sent_tokens} tokens evaluated"
                    if cut is watched.upstream_truncated
                    else f"may have cut the prompt: {cut.evaluated_tokens} evaluated of about {cut.sent_tokens}"
                )
                flag(flow, TRUNCATED_MARK, f"the server {told}" if flow.comment else f"{state.route.name}: the server {told}")
        if self.kept is not None:
            self.kept.save(self.fitter.calibration)
        return own_bytes(value) if value is not None else None

    @staticmethod
    def _usage_told(state: FlowState, final: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
        """After a cut, the answer tells the client the prompt's size as if nothing had been cut:
        the server's count plus what ContextPaw removed. An agent that compacts from usage
        (opencode) otherwise reads the cut prompt's size, under its own threshold, and its history
        grows on behind ContextPaw's cuts. The report says both (`usage_told`)."""
        report = state.report
        if report is None or not report.compacted or report.original_tokens <= report.final_tokens:
            return value
        added = report.original_tokens - report.final_tokens
        retold = wire.told_usage(final, added, state.route.prompt_counts)
        if retold is None:
            return value
        state.retold = retold
        return {**value, "usage_told": {"added": added, "server_prompt_tokens": state.route.evaluated(final)}}


def _client_left(error: FlowError) -> bool:
    """The flow ended because its client went away (or it was killed: by the operator, or by the
    exchange once its client had gone), not because its backend failed."""
    return "client disconnected" in error.msg.lower() or error.msg == FlowError.KILLED_MESSAGE


def _refusal(state: FlowState, otherwise: str) -> str:
    """A refusal's comment: the route, the numbers and the fix (`otherwise`: said when no numbers
    were kept)."""
    if state.overflow is None:
        return f"{state.route.name} refused: {otherwise}"
    return overflow_comment(state.route.name, state.overflow, state.backend.kind)


def gone(client: connection.Client) -> bool:
    """Whether the client has disconnected: its connection ended and is no longer open (a test's
    made-up connection has an end time but stays open)."""
    return client.timestamp_end is not None and not client.connected
