"""The decision for one request, made without mitmproxy and without sockets.

Given the request's bytes, its backend and route, the settings, and what outlives requests (each
conversation's plan, the calibration, discovered windows), the `Fitter` answers once: forward the
request unchanged, forward this body, or refuse with this answer; and it writes the report. After
an upstream overflow it answers the rescue's question: (the body sent, the error answer) -> a new
body or nothing. When the answer's final record arrives, it checks what the server evaluated.

What it must ask the world (windows, exact counts, tokenizer files, digests) goes through `Services`,
which the shell implements over one HTTP session and tests fake. The shell (`addon.py`) only moves
data between the flow and this module.

The steps have their own modules: `bounds` (the size proof, the verdict's bounds, `truncate: false`),
`sizing` (a parsed request's counter, guard and fit to its budget, checked by the server's count) and
`digesting` (digests of what was evicted, put into the fit).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from collections.abc import Mapping
from typing import Any

from contextpaw import wire
from contextpaw.core import logs
from contextpaw.core.caches import LRU, SizedLRU
from contextpaw.core.compact import BudgetTooSmall, Plan
from contextpaw.core.refs import Refs, kept, store_id
from contextpaw.core.report import SIZE_BOUND, Report
from contextpaw.core.tokens import EXACT_COUNTERS, EstimateCounter, ShapeCounter
from contextpaw.fitting.answers import AnswerCheck
from contextpaw.fitting.bounds import NATIVE_OLLAMA, as_sent, count_bounds, forbid_truncation, size_bound
from contextpaw.fitting.budget import Budgeter
from contextpaw.fitting.calibration import Calibration, Guard, Sample, calibration_key, content_kind, word_floor
from contextpaw.fitting.counter_choice import CounterChoice, biggest_droppable, least_kept, rough_size
from contextpaw.fitting.digests import Digesting
from contextpaw.fitting.engine import Fitted, forbidding_truncation
from contextpaw.fitting.flow import UNCHANGED, Decision, FlowState, Forward, Phase, Refuse
from contextpaw.fitting.services import Digester, Services, is_big, off_loop
from contextpaw.fitting.sizing import Sizer
from contextpaw.fitting.windows import BackendWindows, NoDiscovery
from contextpaw.ops.evicted import EvictedStore, encode
from contextpaw.ops.metrics import Stats
from contextpaw.settings import FitSettings
from contextpaw.wire.streams import report_bytes

logger = logs.get(__name__)

MAX_RESCUES = 3
"""Retries after upstream overflows, each compacted to what the server said of the last one."""
PLAN_BYTES = 32 << 20
"""Memory the remembered conversation plans may hold together (besides `contextpaw_conversations`)."""
WRITTEN_WAIT_S = 2.0
"""The most a compacted request waits for the archive to write what its markers stand for."""


def _without_truncation(body: bytes | Mapping[str, Any]) -> bytes:
    """The body with `truncate: false` (Ollama answers 400 instead of cutting): the client's written
    once with it, a fit's (written by the engine) with it added at its end, never parsed again."""
    return forbidding_truncation(body) if isinstance(body, bytes) else wire.write(body, truncate=False)


def _encoded(evicted: Mapping[str, Any]) -> dict[str, bytes]:
    """Each marker's content as the archive keeps it, under its id (never its capability)."""
    return {store_id(ref): encode(content) for ref, content in evicted.items() if kept(ref)}  # a bare id's marker says it is not kept


async def _guard(state: FlowState, parsed: wire.Chat | wire.Prompt, estimate: EstimateCounter, big: bool) -> Guard | None:
    """What sizes the guard where a cut cannot be forbidden (the request's content kind and word
    floor); else None."""
    if not _uncapped(state):
        return None
    return await off_loop(big, lambda: Guard(content_kind(state.original), word_floor(parsed.texts, estimate)))


def _refusable(state: FlowState, parsed: wire.Chat | wire.Prompt, settings: FitSettings) -> bool:
    """Whether a request that overshoots its window will be refused rather than cut: on Ollama's
    native routes, which carry our `truncate: false` (unless the client set `truncate` itself).
    There the fit may count by shape (closer, but with no physical bound): a miss costs a rescue,
    never a silent cut."""
    return (
        settings.forbid_truncation
        and state.backend.kind == wire.Kind.OLLAMA
        and state.route.name in NATIVE_OLLAMA
        and "truncate" not in parsed.body
    )


def _uncapped(state: FlowState) -> bool:
    """Ollama's `/v1` routes cannot carry `truncate: false`: a prompt over the window is cut there."""
    return state.backend.kind == wire.Kind.OLLAMA and state.route.name not in NATIVE_OLLAMA


class Fitter:
    """Fits handled requests into the budget, refuses or rescues them, and reports what was lost."""

    def __init__(self, services: Services, stats: Stats, store: EvictedStore, settings: FitSettings) -> None:
        self.services = services
        self.stats = stats
        self.store = store
        self.plans = SizedLRU(settings.conversations, PLAN_BYTES, lambda key, plan: len(key) + plan.footprint)
        """Each conversation's last `Plan` (by `wire.Chat.key`): the next turn evicts the same units."""
        self.plans_written = LRU(settings.conversations)
        """Conversation -> when this instance last wrote its plan to the store (`_unkept`)."""
        self.windows = BackendWindows(services.fetch)
        self.estimate = EstimateCounter()
        self.shape = ShapeCounter()
        self.calibration = Calibration()
        self.counters = CounterChoice(services, self.windows, self.calibration, self.estimate, self.shape, settings)
        self.answers = AnswerCheck(self.calibration, stats, learn_window=self.windows.learn)
        """Each answer's count of what was evaluated, checked (the verdict) and learned from."""
        self.sizer = Sizer(
            self.counters, self.calibration, self.estimate, self.plans, settings.keep_recent, self.answers.evaluated_like, settings.headroom
        )
        self.digesting = Digesting(self.sizer, self.windows, self.counters, services, settings)
        self.summarizer: Digester | None = None
        self.secret = b""
        """The proxy's secret (`ops.keys`, passed in by the shell): keys what markers and plans are named by."""
        self.settings = settings
        self.budgeter = Budgeter(default_ctx=settings.default_ctx, reserve=settings.output_reserve, margin=settings.margin)
        self.configure(settings)

    def configure(self, settings: FitSettings, summarizer: Digester | None = None, secret: bytes | None = None) -> None:
        """Take new settings; the summarizer is the shell's (it keeps digests in a file), and so is
        the secret (read from the state dir) that keys marker references and conversation keys."""
        self.settings = settings
        if secret is not None:
            self.secret = secret
        self.summarizer = summarizer
        self.answers.calibrate = settings.calibrate
        self.counters.settings = settings
        self.sizer.keep_recent = settings.keep_recent
        self.sizer.headroom = settings.headroom
        self.digesting.settings = settings
        self.windows.ollama_default = settings.ollama_context_length or None
        self.budgeter = Budgeter(
            default_ctx=settings.default_ctx,
            reserve=settings.output_reserve,
            margin=settings.margin,
            source=self.windows if settings.discover_window else NoDiscovery(),
        )
        self.store.bound(max_items=settings.evicted_items, max_bytes=settings.evicted_bytes, max_age_s=settings.evicted_ttl)
        self.plans.limit = self.sizer.overcounts.limit = self.plans_written.limit = settings.conversations

    # -- the request ----------------------------------------------------------------------------

    async def fit(self, state: FlowState) -> Decision:
        """The one decision for a request; an internal failure forwards it unchanged and says so."""
        state.refs = Refs(self.secret, state.proxy_url, self.settings.evicted_bytes)
        self._place(state)
        try:
            decision = await self._fit(state)
        except Exception as e:  # fail open: the backend answers the request as the client sent it
            logger.exception("ContextPaw failed on %s; forwarding the request unchanged", state.path)
            state.report = state.observed = state.sent = state.sent_tokens = None
            state.headers = {"X-ContextPaw-Error": f"{type(e).__name__} while compacting; forwarded unchanged"}
            state.phase = Phase.RECEIVED  # whatever was decided is undone: it goes as it came
            self.stats.add("errors", where=state.where)
            decision = UNCHANGED
        finally:  # counted once the model is read, so that every count of the request has its labels
            self.stats.add("requests", where=state.where)
        if isinstance(decision, Forward):
            decision = self._asking_usage(state, decision)
            state.advance(Phase.FORWARDED)
        return decision

    def _asking_usage(self, state: FlowState, decision: Forward) -> Forward:
        """A streamed OpenAI chat asks for its usage chunk where the client did not: the verdict and
        calibration need the count (`AnswerCheck.ask_usage`; the chunk is taken out of the stream)."""
        body = self.answers.ask_usage(state, decision.body)
        if body is None:
            return decision
        state.sent = body
        return Forward(body, decision.compacted)

    def _place(self, state: FlowState, model: str | None = None) -> None:
        state.where = self.stats.where(state.backend.kind, state.route.name, model)

    async def _fit(self, state: FlowState) -> Decision:
        started = time.perf_counter()
        policy = self.settings.policy
        if (small := self._fits_by_size(state)) is not None:
            state.sent_tokens, state.bounds = small.final_tokens, (0.0, 1.0)  # an upper bound
            if policy == "off":
                state.observed = small
            else:
                self._keep(state, small)
            return UNCHANGED
        big = is_big(state.original)
        try:
            parsed = wire.keyed(await off_loop(big, functools.partial(state.route.read, state.original)), state.refs.key)
        except wire.Unreadable as e:  # it may overflow, and nothing can be judged: said, never silent
            logger.warning("%s forwarded unjudged: %s", state.path, e)
            self._keep(state, Report(False, "none", 0, 0, 0, counter="none", notes=(f"not judged: {e}; it went as it came",)))
            state.headers["X-ContextPaw-Error"] = f"not judged: {e}; forwarded as it came"
            return UNCHANGED
        except wire.NotFittable as e:
            logger.debug("%s forwarded as is: %s", state.route.name, e)
            self._keep(state, Report(False, "none", 0, 0, 0, counter="none", notes=(f"not fitted: {e}",)))
            return UNCHANGED
        except wire.NotCompactable as e:
            logger.debug("%s forwarded as is: %s", state.path, e)
            return UNCHANGED
        self._place(state, parsed.params.model)
        if isinstance(parsed, wire.Chat) and big:  # its lines' digests and its key, made in the thread, not on the loop
            await off_loop(big, lambda: (parsed.fingerprints(), parsed.key))
        self.answers.expect(state, parsed)
        budget = await self.budgeter.budget(state.backend, parsed.params)
        guard = await _guard(state, parsed, self.estimate, big)
        shaped = _refusable(state, parsed, self.settings)
        try:
            await self._recall(parsed)
            fitted = await self.sizer.fit(parsed, budget, state.backend, big, guard=guard, shaped=shaped, refs=state.refs)
        except BudgetTooSmall as e:
            if policy != "off":
                return self._refuse(state, budget.impossible(e), e.counter)
            # nothing would fit, and it goes as it came: the verdict still needs its size
            size = e.original if e.original is not None else e.required
            as_sent = Report(
                False, "none", size, size, budget.admits, counter=e.counter, exact=e.counter in EXACT_COUNTERS, window=budget.window
            )
            fitted = Fitted(None, as_sent)
        report = fitted.report
        self.stats.add("original_tokens", report.original_tokens, state.where)
        key = calibration_key(state.backend, parsed.params.model)
        await self._sample(state, key, parsed, fitted, guard, big)
        state.bounds = count_bounds(parsed, report, state.calibration, key, fitted.bound, self.calibration, self.estimate)
        said = parsed.body.get("truncate") is False or state.backend.kind == wire.Kind.LLAMACPP
        if policy == "off":
            state.observed, state.sent_tokens, state.uncuttable = report, report.original_tokens, said
            await self._judged_as_sent(state, key, parsed, fitted, guard, big)
            return UNCHANGED
        if policy == "strict" and report.compacted:
            return self._refuse(state, budget.refusal(report.original_tokens, fitted.bound), report.counter)
        if self.summarizer is not None and isinstance(parsed, wire.Chat) and report.evicted_tokens:
            fitted = await self.digesting.summarized(self.summarizer, state, parsed, fitted, budget, big, guard, shaped)
            if fitted.report is not report:
                report = fitted.report
                await self._sample(state, key, parsed, fitted, guard, big)
                state.bounds = count_bounds(parsed, report, state.calibration, key, fitted.bound, self.calibration, self.estimate)
        body = fitted.body
        forbid = self.settings.forbid_truncation and forbid_truncation(state.route, parsed, report, budget, state.bounds)
        if forbid:
            body = await off_loop(big, functools.partial(_without_truncation, body if body is not None else parsed.body))
        self._remember(parsed, fitted)
        self._keep(state, report)
        if fitted.body is not None:
            await self._note_compaction(state, report, parsed.params.model, big, started)
        state.sent, state.sent_tokens, state.uncuttable = body, report.final_tokens, said or forbid
        return Forward(body, fitted.body is not None)

    async def _judged_as_sent(
        self, state: FlowState, key: str, parsed: wire.Chat | wire.Prompt, fitted: Fitted, guard: Guard | None, big: bool
    ) -> None:
        """Under policy off the request goes as the client sent it: the verdict's sample and bounds
        are of that, not of the compaction that was computed but not sent (nor held to the guard's
        bound, which sized that compaction)."""
        if fitted.body is None:
            return
        sent = Fitted(None, as_sent(fitted.report))
        await self._sample(state, key, parsed, sent, guard, big)
        state.bounds = count_bounds(parsed, sent.report, state.calibration, key, None, self.calibration, self.estimate)

    async def _sample(
        self, state: FlowState, key: str, parsed: wire.Chat | wire.Prompt, fitted: Fitted, guard: Guard | None, big: bool
    ) -> None:
        """Size exactly what is sent for calibration, where the calibrated counter counted it: by
        the byte estimate (its factor, and the verdict's bounds) and by shape (the fit's count on
        routes that refuse an overshoot), with its content kind."""
        if fitted.report.counter != "calibrated":
            state.calibration = None
            return
        if fitted.body is None:  # unchanged, it is the bytes the guard read
            sent, kind = parsed, guard.kind if guard is not None else None
        else:
            sent, kind = await off_loop(big, functools.partial(state.route.read, fitted.body)), None
        body = fitted.body if fitted.body is not None else state.original

        def sized() -> Sample:
            return Sample(
                key,
                rough_size(sent, self.estimate),
                rough_size(sent, self.shape),
                kind or content_kind(body),
                least_kept(sent, self.estimate),
                biggest_droppable(sent, self.estimate),
            )

        state.calibration = await off_loop(big, sized)

    def _fits_by_size(self, state: FlowState) -> Report | None:
        """A request proved to fit from its byte length alone (`size_bound`), with nothing parsed,
        counted or asked: below the least budget its window gives (half kept for any answer length),
        it cannot overflow, and Ollama cannot cut it. A request whose window is not known yet takes
        the full path."""
        if (sized := size_bound(state.original)) is None:
            return None
        model, bound = sized
        self._place(state, model)
        if self.settings.discover_window:
            known, window = self.windows.cached(state.backend, model)
            if not known:
                return None
        else:
            window = None
        window = window or self.settings.default_ctx
        admits = self.budgeter.admits(window)
        if bound > admits:
            return None
        note = f"fits by its size: at most {bound} tokens ({len(state.original)} bytes and the template's allowance)"
        return Report(False, "none", bound, bound, admits, counter=SIZE_BOUND, window=window, notes=(note,))

    def _refuse(self, state: FlowState, overflow: wire.Overflow, counter: str) -> Refuse:
        """Answer in the caller's convention, with one set of numbers everywhere: the request's
        size, what the least of it needs, and the budget, as the counter that decided counted them."""
        original = overflow.original if overflow.original is not None else overflow.required
        report = Report(
            False,
            "refused",
            original,
            0,
            overflow.budget,
            counter=counter,
            exact=counter in EXACT_COUNTERS,
            window=overflow.window,
            required_tokens=overflow.required,
            notes=(overflow.message.removeprefix("ContextPaw: "),),  # why, and what would fix it: the log line says it too
        )
        self._keep(state, report)
        state.overflow = overflow
        state.advance(Phase.REFUSED)
        logger.debug("%s refused: %s", state.route.name, overflow.message)
        self.stats.add("refused", where=state.where)
        status = wire.REFUSAL_STATUS
        return Refuse(status, report_bytes(state.route.refusal(overflow, report.to_json())), f"refused {status}: {overflow.message}")

    @staticmethod
    def _keep(state: FlowState, report: Report) -> None:
        state.report = report
        state.headers = report.headers()

    def _remember(self, parsed: wire.Chat | wire.Prompt, fitted: Fitted) -> None:
        if parsed.key and fitted.plan is not None:
            unkept = self.store.keeps_plans and self._unkept(parsed.key, fitted.plan)
            self.plans.put(parsed.key, fitted.plan)
            if unkept:
                self.store.put_plan(parsed.key, json.dumps(fitted.plan.to_json()).encode())

    def _unkept(self, key: str, plan: Plan) -> bool:
        """Whether the store lacks `plan` for `key`: a turn that changes nothing repeats the last
        plan (the one remembered, which is what was written), and writing it again each turn cost a
        transaction a request. It is written once more when half its age bound has passed (the
        store expires it), and always to a store other instances write too (one of them may have
        put a newer one)."""
        now = time.monotonic()
        written = self.plans_written.get(key)
        if not self.store.shared and written is not None and self.plans.get(key) == plan and now - written < self.store.max_age_s / 2:
            return False
        self.plans_written.put(key, now)
        return True

    async def _recall(self, parsed: wire.Chat | wire.Prompt) -> None:
        """A conversation this instance has no plan of may have one in the store: kept before a
        restart (SQLite), or by another instance that served its last turn (Redis). Read it off the
        event loop, and keep it as its own."""
        if not self.store.keeps_plans or not parsed.key or parsed.key in self.plans:
            return
        data = await asyncio.to_thread(self.store.get_plan, parsed.key)
        if data is None:
            return
        try:
            self.plans.put(parsed.key, Plan.from_json(json.loads(data)))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("a kept plan could not be read (%s): the conversation is cut anew", e)

    async def _note_compaction(self, state: FlowState, report: Report, model: str, big: bool, started: float) -> None:
        """Log, keep and count a compaction; the counts go last, so a failure before them (which
        forwards the request unchanged) leaves no count of a compaction that was never sent. The log
        line holds no prompt text; the evicted content is encoded for the store off the event loop
        when the request is big (it can be most of a megabyte), and the request waits (in a thread,
        `WRITTEN_WAIT_S` at most) until the archive has written it: a marker the model reads stands
        for content on disk, whatever happens to the proxy next (a `kill -9` lost 2.3% of references
        written behind the answer). It is said when decided (INFO): the answer's own line comes when
        the answer ends, minutes later on a slow server."""
        if state.left():
            logger.info("%s %s %s: the client went away while its request was fitted: not sent", state.path, state.route.name, model)
            return
        logger.info("%s %s %s: %s, sent on (%.2f s)", state.path, state.route.name, model, report.summary(), time.perf_counter() - started)
        encoded = await off_loop(big, functools.partial(_encoded, report.evicted))
        for marker_id, data in encoded.items():
            self.store.put(marker_id, data, state.session)
        if encoded and not await asyncio.to_thread(self.store.flush, WRITTEN_WAIT_S):
            logger.warning(
                "the archive has not written this request's removed content within %g s: it is sent on, "
                "its references read from memory until the write is done",
                WRITTEN_WAIT_S,
            )
        self.stats.compaction(state.where, time.perf_counter() - started, report.evicted_tokens)

    # -- the rescue after an upstream overflow -------------------------------------------------

    def may_rescue(self, state: FlowState) -> bool:
        """Whether an overflow the backend answers is ours to answer: retried while rounds are
        left, then refused in the caller's shape."""
        return state.report is not None and self.settings.policy == "compact" and not state.local and state.rescues <= MAX_RESCUES

    async def rescue(self, state: FlowState, status: int, answer: bytes) -> bytes | Refuse | None:
        """After the backend refused what was sent as too long: the body to send instead, compacted
        to what the server said of that body; a refusal in the caller's shape when nothing that must
        be kept fits; None to pass its answer on. Never raises (fail open, said in a header)."""
        overflow = wire.upstream_overflow(status, answer)
        if overflow is None or not self.may_rescue(state):
            return None
        assert state.report is not None
        if state.rescues >= MAX_RESCUES:  # out of rounds: the client gets its own API's overflow error
            sent = state.sent_tokens if state.sent_tokens is not None else state.report.final_tokens
            cause = f"the backend refused the request {state.rescues + 1} times as longer than its {overflow.n_ctx}-token window"
            shortfall = wire.Overflow(overflow.n_prompt_tokens, overflow.n_ctx, overflow.n_ctx, cause, sent)
            logger.warning("%s: %s; answered with the API's own overflow error", state.path, cause)
            return self._refuse(state, shortfall, "backend")
        try:
            return await self._refit(state, overflow)
        except Exception as e:  # fail open: the backend's answer goes to the client as it was
            logger.exception("ContextPaw failed to rescue %s; passing the backend's answer on", state.path)
            state.headers["X-ContextPaw-Error"] = f"{type(e).__name__} in the rescue; passed through"
            self.stats.add("errors", where=state.where)
            return None

    async def _refit(self, state: FlowState, overflow: wire.UpstreamOverflow) -> bytes | Refuse | None:
        """Compact the client's request again, to the window the backend just named, in our
        counter's units: the server counted `n_prompt_tokens` for the body we counted at
        `sent_tokens`. The report, plan and evicted content become the retry's; a retry to a native
        route says `truncate: false`, so it is refused again rather than cut."""
        started = time.perf_counter()
        state.rescues += 1
        assert state.report is not None, "only a reported flow is rescued"
        big = is_big(state.original)
        parsed = wire.keyed(await off_loop(big, functools.partial(state.route.read, state.original)), state.refs.key)
        if parsed.params.num_ctx is None:  # the window requests without num_ctx get, from the server
            self.windows.learn(state.backend, parsed.params.model, overflow.n_ctx)
        sent = state.sent_tokens if state.sent_tokens is not None else state.report.final_tokens
        budget = self.budgeter.after_upstream_overflow(overflow, sent, parsed.params)
        try:
            fitted = await self.sizer.fit(
                parsed, budget, state.backend, big, shaped=_refusable(state, parsed, self.settings), refs=state.refs
            )
        except BudgetTooSmall as e:
            return self._refuse(state, budget.impossible(e), e.counter)
        if fitted.body is None:
            return None
        await self._sample(state, calibration_key(state.backend, parsed.params.model), parsed, fitted, None, big)
        body = fitted.body
        native = state.route.name in NATIVE_OLLAMA and "truncate" not in parsed.body
        if native:
            body = await off_loop(big, functools.partial(_without_truncation, body))
        self.stats.add("retried_400", where=state.where)
        self._remember(parsed, fitted)
        self._keep(state, fitted.report)
        await self._note_compaction(state, fitted.report, parsed.params.model, big, started)
        state.sent, state.sent_tokens = body, fitted.report.final_tokens
        state.uncuttable = state.uncuttable or native
        state.advance(Phase.RESCUED)
        return body

    def settle_rescue(self, state: FlowState, status: int, relay_failed: bool) -> bool:
        """Once the retry's status is known: whether it recovered, in the report, headers and counts."""
        assert state.report is not None
        recovered = status < 400
        state.report = dataclasses.replace(state.report, recovered_from_upstream_400=recovered)
        self.stats.add("recovered_400", recovered, state.where)
        if recovered:
            state.headers["X-ContextPaw-Recovered"] = "upstream-400"
        elif not relay_failed:  # the relay says so itself when the backend failed
            logger.warning("%s: the backend refused the compacted retry too (%d); its answer is passed on", state.path, status)
        return recovered
