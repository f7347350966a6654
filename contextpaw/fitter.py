"""The decision for one request, made without mitmproxy and without sockets.

Given the request's bytes, its backend and route, the settings, and what outlives requests (each
conversation's plan, the calibration, discovered windows), the `Fitter` answers once: forward the
request unchanged, forward this body, or refuse with this answer; and it writes the report. After
an upstream overflow it answers the rescue's question: (the body sent, the error answer) -> a new
body or nothing. When the answer's final record arrives, it checks what the server evaluated.

What it must ask the world (windows, exact counts, tokenizer files, digests) goes through `Services`,
which the shell implements over one HTTP session and tests fake. The shell (`addon.py`) only moves
data between the flow and this module.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from contextpaw import logs, wire
from contextpaw.answers import AnswerCheck
from contextpaw.calibration import Calibration, calibration_key, content_kind
from contextpaw.compact import BudgetTooSmall, Plan
from contextpaw.counters import CounterChoice, rough_size
from contextpaw.evicted import EvictedStore, encode
from contextpaw.fitting import Fitted, fit_chat, fit_prompt
from contextpaw.flow import UNCHANGED, Decision, FlowState, Forward, Phase, Refuse
from contextpaw.metrics import Stats
from contextpaw.offload import is_big, off_loop
from contextpaw.report import SIZE_BOUND, Report
from contextpaw.settings import FitSettings
from contextpaw.state import SizedLRU
from contextpaw.streams import report_bytes
from contextpaw.summarize import Complete, Summarizer, SummaryModel
from contextpaw.tokens import EXACT_COUNTERS, Counter, EstimateCounter
from contextpaw.truncation import EXACT_BOUNDS, could_exceed
from contextpaw.windows import BackendWindows, Budget, Budgeter, Fetch, NoDiscovery

logger = logs.get(__name__)

VERIFY_ROUNDS = 4
"""Refits after the server's whole-request count said a fit was still over the budget."""
MAX_RESCUES = 3
"""Retries after upstream overflows, each compacted to what the server said of the last one."""
NATIVE_OLLAMA = ("ollama.chat", "ollama.generate")
PLAN_BYTES = 32 << 20
"""Memory the remembered conversation plans may hold together (besides `contextpaw_conversations`)."""
SIZE_PROOF_BYTES = 64 * 1024
"""Bodies up to this size are first checked for fitting by their size alone (see `_fits_by_size`)."""
UNPROVABLE = (b'"num_ctx"', b'"previous_response_id"', b"image")
"""What a body's size cannot bound: a window of its own, history kept on the server, and images (a
few bytes of base64 can cost hundreds of tokens)."""
TEMPLATE_ALLOWANCE = 512
MESSAGE_ALLOWANCE = 16
"""Tokens a chat template may add: once (a default system prompt, the generation prompt), and per message."""


class BackendCounting(Protocol):
    """llama-server's own counts (`contextpaw.counting.LlamaCppCounting`)."""

    async def counter(
        self, base_url: str, texts: Iterable[str], fallback: Counter, *, chat: bool, has_system: bool, big: bool = False
    ) -> tuple[Counter, int] | None: ...

    async def total(self, base_url: str, body: Mapping[str, Any], path: str = ..., big: bool = False) -> int | None: ...

    def stats(self) -> dict[str, Any]: ...


class Services(Protocol):
    """What the fitter asks of the world; every call is best-effort (None: do without)."""

    fetch: Fetch
    """A JSON answer from a backend, or None."""
    counting: BackendCounting

    async def tokenizer(self, path: str) -> Counter | None:
        """A counter from a tokenizer or GGUF file (loaded once, off the event loop)."""
        ...

    def completions(self, url: str, model: str, timeout: float, authorization: str | None) -> Complete:
        """The call that writes a digest with this model."""
        ...


Fit = Callable[[Budget], Fitted]
"""One fit of a parsed request with its counter and template cost, to a budget."""


def _fit_and_tell(fit: Callable[..., Fitted], budget: Budget) -> Fitted:
    """Fit (unchanged up to what the budget admits, else cut to its tokens), and build the report's
    removal rows where the fit runs: for a big request that is the worker thread, and thousands of
    rows built on the event loop would stall it."""
    fitted = fit(budget.tokens, admit=budget.admits)
    fitted.report.removal_rows()
    return fitted


def _without_truncation(body: bytes | Mapping[str, Any]) -> bytes:
    """The body with `truncate: false` (Ollama answers 400 instead of cutting)."""
    return wire.write(json.loads(body) if isinstance(body, bytes) else body, truncate=False)


def _encoded(evicted: Mapping[str, Any]) -> dict[str, bytes]:
    return {marker_id: encode(content) for marker_id, content in evicted.items()}


async def _guard(state: FlowState, big: bool) -> str | None:
    """The request's content kind where a cut cannot be forbidden (it sizes the guard); else None."""
    return await off_loop(big, lambda: content_kind(state.original)) if _uncapped(state) else None


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
        self.windows = BackendWindows(services.fetch)
        self.estimate = EstimateCounter()
        self.calibration = Calibration()
        self.counters = CounterChoice(services, self.windows, self.calibration, self.estimate, settings)
        self.answers = AnswerCheck(self.calibration, stats)
        """Each answer's count of what was evaluated, checked (the verdict) and learned from."""
        self.summarizer: Summarizer | None = None
        self.settings = settings
        self.budgeter = Budgeter(default_ctx=settings.default_ctx, reserve=settings.output_reserve, margin=settings.margin)
        self.configure(settings)

    def configure(self, settings: FitSettings, summarizer: Summarizer | None = None) -> None:
        """Take new settings; the summarizer is the shell's (it keeps digests in a file)."""
        self.settings = settings
        self.summarizer = summarizer
        self.answers.calibrate = settings.calibrate
        self.counters.settings = settings
        self.windows.ollama_default = settings.ollama_context_length or None
        self.budgeter = Budgeter(
            default_ctx=settings.default_ctx,
            reserve=settings.output_reserve,
            margin=settings.margin,
            source=self.windows if settings.discover_window else NoDiscovery(),
        )
        self.store.max_items = settings.evicted_items
        self.store.max_bytes = settings.evicted_bytes
        self.store.max_age_s = settings.evicted_ttl
        self.plans.limit = settings.conversations

    # -- the request ----------------------------------------------------------------------------

    async def fit(self, state: FlowState) -> Decision:
        """The one decision for a request; an internal failure forwards it unchanged and says so."""
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
            state.advance(Phase.FORWARDED)
        return decision

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
            parsed = await off_loop(big, functools.partial(state.route.read, state.original))
        except wire.NotFittable as e:
            logger.info("%s forwarded as is: %s", state.route.name, e)
            self._keep(state, Report(False, "none", 0, 0, 0, counter="none", notes=[f"not fitted: {e}"]))
            return UNCHANGED
        except wire.NotCompactable as e:
            logger.debug("%s forwarded as is: %s", state.path, e)
            return UNCHANGED
        self._place(state, parsed.params.model)
        budget = await self.budgeter.budget(state.backend, parsed.params)
        kind = await _guard(state, big)
        try:
            fitted = await self._compact(parsed, budget, state.backend, big, guard=kind)
        except BudgetTooSmall as e:
            if policy != "off":
                return self._refuse(state, budget.impossible(e), e.counter)
            # nothing would fit, and it goes as it came: the verdict still needs its size
            size = e.original if e.original is not None else e.required
            as_sent = Report(False, "none", size, size, budget.admits, counter=e.counter, exact=e.counter in EXACT_COUNTERS, window=budget.window)
            fitted = Fitted(None, as_sent)
        report = fitted.report
        self.stats.add("original_tokens", report.original_tokens, state.where)
        key = calibration_key(state.backend, parsed.params.model)
        if report.counter == "calibrated":
            sent = fitted.body if fitted.body is not None else state.original
            unchanged = fitted.body is None and kind is not None  # the guard read the same bytes
            sent_kind = kind if unchanged else await off_loop(big, lambda: content_kind(sent))
            state.calibration = (key, self.calibration.factor(key), sent_kind)
        state.bounds = self._bounds(parsed, report, key, kind)
        said = parsed.body.get("truncate") is False or state.backend.kind == wire.Kind.LLAMACPP
        if policy == "off":
            state.observed, state.sent_tokens, state.uncuttable = report, report.original_tokens, said
            return UNCHANGED
        if policy == "strict" and report.compacted:
            return self._refuse(state, budget.refusal(report.original_tokens), report.counter)
        if self.summarizer is not None and isinstance(parsed, wire.Chat) and report.evicted_tokens:
            fitted = await self._summarized(state, parsed, fitted, budget, big, kind)
            report = fitted.report
        body = fitted.body
        forbid = self._forbid_truncation(state.route, parsed, report, budget, state.bounds)
        if forbid:
            body = await off_loop(big, functools.partial(_without_truncation, body if body is not None else parsed.body))
        self._remember(parsed, fitted)
        self._keep(state, report)
        if fitted.body is not None:
            await self._note_compaction(state, report, parsed.params.model, big, started)
        state.sent, state.sent_tokens, state.uncuttable = body, report.final_tokens, said or forbid
        return Forward(body, fitted.body is not None)

    def _fits_by_size(self, state: FlowState) -> Report | None:
        """A request proved to fit from its byte length alone, with nothing parsed, counted or asked.

        A token is at least one byte of text, and the JSON of a text is never shorter than its UTF-8;
        so the body's length, plus an allowance for the template, bounds its prompt. Below the least
        budget its window gives (half kept for any answer length), it cannot overflow, and Ollama
        cannot cut it. A request that names its own window, whose model cannot be read at once, or
        whose window is not known yet takes the full path.
        """
        raw = state.original
        if len(raw) > SIZE_PROOF_BYTES or any(word in raw for word in UNPROVABLE) or (model := wire.model_of(raw)) is None:
            return None  # a window of its own, history kept by the server, images, or a model name not read at once
        self._place(state, model)
        if self.settings.discover_window:
            known, window = self.windows.cached(state.backend, model)
            if not known:
                return None
        else:
            window = None
        window = window or self.settings.default_ctx
        bound = len(raw) + TEMPLATE_ALLOWANCE + MESSAGE_ALLOWANCE * raw.count(b'"role"')
        admits = self.budgeter.admits(window)
        if bound > admits:
            return None
        note = f"fits by its size: at most {bound} tokens ({len(raw)} bytes and the template's allowance)"
        return Report(False, "none", bound, bound, admits, counter=SIZE_BOUND, window=window, notes=[note])

    def _bounds(self, parsed: wire.Chat | wire.Prompt, report: Report, key: str, kind: str | None) -> tuple[float, float]:
        """How far the true size of what is sent can be from our count of it, for the verdict.

        A count of each text is exact for the texts, not for how the server renders them: a
        template may leave the tool definitions out (SmolLM2's does) and spend fewer tokens per
        message than we allow. So the low bound leaves those out: what was surely sent is the
        rest. Only the server's count of the whole request is exact as a whole. The high bound is
        the guard's: what calibration learned of this kind of request, where it knows it."""
        low, high = EXACT_BOUNDS if report.exact else self.calibration.bounds(key)
        if kind is not None and report.counter == "calibrated":
            size = round(report.final_tokens / self.calibration.factor(key))
            high = self.calibration.kind_bound(key, kind, size) or high
        if report.counter == "backend" or not isinstance(parsed, wire.Chat) or report.final_tokens <= 0:
            return low, high
        conversation = parsed.conversation
        rendered_maybe = self.estimate.tools(conversation.tools) + len(conversation.messages) * self.estimate.message_overhead
        return low * max(report.final_tokens - rendered_maybe, 0) / report.final_tokens, high

    def _forbid_truncation(
        self, route: wire.Route, parsed: wire.Chat | wire.Prompt, report: Report, budget: Budget, bounds: tuple[float, float]
    ) -> bool:
        """Ask Ollama to refuse instead of cutting, for requests that can exceed the window given
        the error bounds of our count.

        Requests that cannot are left byte for byte; `truncate` set by the client is respected.
        """
        return (
            self.settings.forbid_truncation
            and route.name in NATIVE_OLLAMA
            and "truncate" not in parsed.body
            and could_exceed(report.final_tokens, budget.window, bounds)
            and bool(parsed.conversation.messages if isinstance(parsed, wire.Chat) else parsed.prompt)  # a load request has nothing to cut
        )

    def _refuse(self, state: FlowState, overflow: wire.Overflow, counter: str) -> Refuse:
        """Answer in the caller's convention, with one set of numbers everywhere: the request's
        size, what the least of it needs, and the budget, as the counter that decided counted them."""
        original = overflow.original if overflow.original is not None else overflow.required
        report = Report(
            False, "refused", original, 0, overflow.budget, counter=counter, exact=counter in EXACT_COUNTERS,
            window=overflow.window, required_tokens=overflow.required,
        )
        self._keep(state, report)
        state.advance(Phase.REFUSED)
        logger.info("%s refused: %s", state.route.name, overflow.message)
        self.stats.add("refused", where=state.where)
        status = state.route.refusal_status
        return Refuse(status, report_bytes(state.route.refusal(overflow, report.to_json())), f"refused {status}: {overflow.message}")

    @staticmethod
    def _keep(state: FlowState, report: Report) -> None:
        state.report = report
        state.headers = report.headers()

    def _remember(self, parsed: wire.Chat | wire.Prompt, fitted: Fitted) -> None:
        if parsed.key and fitted.plan is not None:
            self.plans.put(parsed.key, fitted.plan)

    async def _note_compaction(self, state: FlowState, report: Report, model: str, big: bool, started: float) -> None:
        """Log, keep and count a compaction; the counts go last, so a failure before them (which
        forwards the request unchanged) leaves no count of a compaction that was never sent. The log
        line holds no prompt text; the evicted content is encoded for the store off the event loop
        when the request is big (it can be most of a megabyte)."""
        logger.info("%s %s: %s", state.route.name, model, report.summary())
        encoded = await off_loop(big, functools.partial(_encoded, report.evicted))
        for marker_id, data in encoded.items():
            self.store.put(marker_id, data)
        self.stats.compaction(state.where, time.perf_counter() - started, report.evicted_tokens)

    # -- counting -------------------------------------------------------------------------------

    async def _verified(
        self, parsed: wire.Chat | wire.Prompt, fitted: Fitted, budget: Budget, backend: wire.Backend, big: bool, fit: Fit
    ) -> Fitted:
        """Check a compacted llama-server chat against the server's exact count; refit if it is over.

        A shrunk text is estimated, and a text can tokenize a token differently inside the
        template: the server's total for the whole request is the truth. A few rounds at most, each
        one tightening the budget by what our count of the last one missed. A refit that cannot
        keep what must be kept under the tightened budget is refused with numbers against the
        budget the client is told.
        """
        tightened = budget
        for _ in range(VERIFY_ROUNDS):
            sent = await off_loop(big, functools.partial(json.loads, fitted.body)) if fitted.body is not None else parsed.body
            total = await self.counters.exact_total(backend, parsed, sent, big)
            if total is None:
                fitted.report.exact = False
                return fitted
            if total <= (budget.tokens if fitted.body is not None else budget.admits):
                fitted.report.final_tokens = total
                if fitted.body is None:
                    fitted.report.original_tokens = total
                return fitted
            miss = max(total - fitted.report.final_tokens, 1)
            tightened = Budget(budget.window, budget.reserve, tightened.margin + miss)
            try:
                fitted = await off_loop(big, functools.partial(_fit_and_tell, fit, tightened))
            except BudgetTooSmall as e:
                raise e.rescaled(budget.tokens) from None
        fitted.report.exact = False
        fitted.report.notes.append("the server's count could not be confirmed within the budget")
        return fitted

    async def _compact(
        self,
        parsed: wire.Chat | wire.Prompt,
        budget: Budget,
        backend: wire.Backend,
        big: bool,
        digests: Mapping[str, str] | None = None,
        previous: Plan | None = None,
        guard: str | None = None,
    ) -> Fitted:
        """Fit with the conversation's last plan, in a worker thread when the request is big.

        Where the server counts whole requests (llama-server's chats), the decision rests on that
        count: a request it would serve whole goes out unchanged, and otherwise the difference
        between its count and ours is the template's real cost (a template that renders no tools
        makes it negative), so what must be kept is priced as the server prices it.

        With a `guard` (the request's content kind, on a route that cannot ask Ollama to refuse
        instead of cutting), an inexact count gets a budget its upper error bound still fits in,
        where what must be kept allows it: a cut there cannot be undone. Once calibration knows
        this kind of text, that bound is what it learned, not the estimate's whole width."""
        small = await self.counters.small(backend, parsed, budget.tokens, big)
        counter, fixed = await self.counters.best(backend, parsed, small, big)
        # a request that may not fit is counted whole where the server can (even when its per-text
        # counting failed: the whole count is one call, and the decision rests on it)
        whole = None if small else await self.counters.exact_total(backend, parsed, parsed.body, big)
        if whole is not None:
            if whole <= budget.admits:
                as_sent = Report(False, "none", whole, whole, budget.admits, counter="backend", exact=True, window=budget.window)
                return Fitted(None, as_sent)
            fixed += whole - await off_loop(big, functools.partial(parsed.tokens, counter, fixed))
        guarded = budget
        if guard is not None and not counter.exact:
            key = calibration_key(backend, parsed.params.model)
            size = await off_loop(big, functools.partial(rough_size, parsed, self.estimate))
            learned = self.calibration.kind_bound(key, guard, size)
            guarded = budget.within(learned if learned is not None else self.calibration.bounds(key)[1])
        fit: Callable[..., Fitted]
        if isinstance(parsed, wire.Chat):  # what only a chat has: turns, a last plan, holes to put digests in
            previous = previous or self.plans.get(parsed.key)
            fit = functools.partial(fit_chat, parsed, counter=counter, fixed_tokens=fixed,
                                    keep_recent=self.settings.keep_recent, previous=previous, digests=digests)  # fmt: skip
        else:
            fit = functools.partial(fit_prompt, parsed, counter=counter, fixed_tokens=fixed)
        while True:
            try:
                fitted = await off_loop(big, functools.partial(_fit_and_tell, fit, guarded))
                break
            except BudgetTooSmall as e:
                e.counter = "backend" if whole is not None else counter.name
                if guarded == budget:
                    raise
                # what must be kept needs more than the guard leaves: as close to the guard as it
                # fits, else the full budget, and the check after the answer says what happened
                needed = budget.at_most(e.required)
                guarded = needed if guarded.tokens < needed.tokens < budget.tokens else budget
        fitted.report.window = budget.window
        if guarded != budget:
            fitted.report.notes.append(
                f"budget {guarded.tokens} of {budget.tokens}: the count is an estimate, and this route cannot ask "
                "Ollama to refuse instead of cutting"
            )
        if whole is None:
            return fitted
        try:
            fitted = await self._verified(parsed, fitted, budget, backend, big, fit)
        except BudgetTooSmall as e:
            e.counter = "backend"
            raise
        # a refit under a tightened budget is told against the budget the client is told
        report = fitted.report
        report.counter, report.original_tokens, report.window, report.budget = "backend", whole, budget.window, budget.tokens
        return fitted

    # -- digests of what was evicted ------------------------------------------------------------

    async def _summarized(
        self, state: FlowState, parsed: wire.Chat, fitted: Fitted, budget: Budget, big: bool, guard: str | None
    ) -> Fitted:
        """Put a digest of each evicted span where its marker goes, inside the budget.

        The chat is compacted again with room left for the digests; its holes are summarized; then
        it is compacted a last time with the digests, keeping that plan's evictions so the holes
        come out the same. Best-effort: without a digest the plain marker stays, and the report
        says why.
        """
        assert self.summarizer is not None
        cap = self.settings.summary_tokens
        backend = state.backend
        roomy = await self._compact(parsed, Budget(budget.window, budget.reserve, budget.margin + cap), backend, big, guard=guard)
        holes = {mid: content for mid, content in roomy.report.evicted.items() if not isinstance(content, str)}
        if not holes:
            return fitted
        model = await self._summary_model(state, parsed, budget)
        results = await asyncio.gather(
            *(self.summarizer.digest(content, model=model, cap_tokens=cap // len(holes)) for content in holes.values())
        )
        digests = {mid: r.text for mid, r in zip(holes, results, strict=True) if r.text}
        reasons = "; ".join(r.reason for r in results if r.reason) or None
        if reasons:
            logger.warning("%s: %d of %d evicted spans not summarized: %s", state.path, len(holes) - len(digests), len(holes), reasons)
        if not digests:
            fitted.report.summary_reason = reasons
            return fitted
        final = await self._compact(parsed, budget, backend, big, digests=digests, previous=roomy.plan, guard=guard)
        final.report.summary_reason = reasons
        return final

    async def _summary_model(self, state: FlowState, parsed: wire.Chat, budget: Budget) -> SummaryModel:
        """Where digests are made: the configured summarizer, else the request's own backend and model."""
        s, backend = self.settings, state.backend
        target = wire.Backend.parse(backend.kind, s.summarizer_url) if s.summarizer_url else backend
        name = s.summarizer_model or parsed.params.model
        window = budget.window if target == backend else await self.windows.window(target, name) or budget.window
        complete = self.services.completions(target.url, name, s.summarizer_timeout, state.authorization)
        counter, _ = await self.counters.best(target, parsed)
        return SummaryModel(complete, f"{target.url}/{name}", window, counter)

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
        parsed = await off_loop(big, functools.partial(state.route.read, state.original))
        if parsed.params.num_ctx is None:  # the window requests without num_ctx get, from the server
            self.windows.learn(state.backend, parsed.params.model, overflow.n_ctx)
        sent = state.sent_tokens if state.sent_tokens is not None else state.report.final_tokens
        budget = self.budgeter.after_upstream_overflow(overflow, sent, parsed.params)
        try:
            fitted = await self._compact(parsed, budget, state.backend, big)
        except BudgetTooSmall as e:
            return self._refuse(state, budget.impossible(e), e.counter)
        if fitted.body is None:
            return None
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
        state.report.recovered_from_upstream_400 = recovered
        self.stats.add("recovered_400", recovered, state.where)
        if recovered:
            state.headers["X-ContextPaw-Recovered"] = "upstream-400"
        elif not relay_failed:  # the relay says so itself when the backend failed
            logger.warning("%s: the backend refused the compacted retry too (%d); its answer is passed on",
                           state.path, status)  # fmt: skip
        return recovered
