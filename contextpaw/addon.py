"""The mitmproxy shell: options and hooks, and nothing else.

Five addons, one concern each, in the order their hooks run:
- `Arbitration` makes one runtime own the GPU before a request reaches it (off by default);
- `AdminEndpoints` answers `/contextpaw/*` itself;
- `Backends` knows which backend a flow goes to, and answers a JSON 502 when it does not answer;
- `Compactor` fits requests into the window and puts the report into the response;
- `Upstream` sends handled requests through the relay, which answers a failing backend in the API's
  convention (502, 504, or an error record in a stream).
The decisions live in `wire`, `windows`, `compact`, `streams` and `evicted`; the hooks move bytes
between mitmproxy and them, off the event loop when the bytes are big, and fail open.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import os
import re
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from mitmproxy import connection, contentviews, ctx, exceptions, http
from mitmproxy.proxy import mode_specs
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from contextpaw import admin, arbitration, wire
from contextpaw.calibration import Calibration
from contextpaw.compact import BudgetTooSmall, Plan
from contextpaw.counting import LlamaCppCounting
from contextpaw.evicted import EvictedStore
from contextpaw.relay import ERROR_HEADER, FLOW_HEADER, Failure, Relay, Timeouts
from contextpaw.report import Report
from contextpaw.streams import STREAM_TYPES, StreamReport, report_bytes, with_report
from contextpaw.state import LRU, write_atomically
from contextpaw.summarize import ChatCompletions, Summarizer, SummaryModel
from contextpaw.tokens import Counter, EstimateCounter, TokenizerCounter
from contextpaw.truncation import detect
from contextpaw.views import ORIGINAL, REPORT, ContextPawView
from contextpaw.windows import Budget, Budgeter, BackendWindows, NoDiscovery

logger = logging.getLogger("contextpaw")

OFFLOAD_BYTES = 256 * 1024
OFFLOAD_MESSAGES = 500
"""Bodies above this size, or with more messages than this, are parsed and compacted in a worker
thread, so other flows keep moving."""
PROBE_TIMEOUT_S = 2.0
RELAY_TIMEOUT_S = 540
"""The relay's default header and idle timeouts: under mitmproxy's default `tcp_timeout` (600 s),
which would otherwise close the client's connection first, without an answer."""
HOP_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding", "accept-encoding",
     FLOW_HEADER.lower()}
)
"""Not copied onto the retry or its answer: they describe one connection or one encoding."""
JSON_TYPE = "application/json; charset=utf-8"
POLICIES = ("compact", "strict", "off")
BACKEND_HEADER = "X-ContextPaw-Backend"
COMPACTED_MARK = ":scissors:"
REFUSED_MARK = ":no_entry:"
TRUNCATED_MARK = ":warning:"
"""mitmweb marks: compacted, refused by ContextPaw (413, 502), cut by the server anyway."""

# flow.metadata keys; values stay JSON-like so saved flows keep them.
ROUTE = "contextpaw.route"
HEADERS = "contextpaw.headers"
"""The X-ContextPaw-* headers for the response."""
LOCAL = "contextpaw.local"
"""The response was made here, not by the backend."""
RETRIED = "contextpaw.retried"
"""A rescue was tried after an upstream 400 (there is never a second)."""
RESENT = "contextpaw.resent"
"""The compacted retry was sent: its answer says whether it recovered."""
OBSERVED = "contextpaw.observed"
"""Under policy off: the report that is not put on the wire but still checked against the answer."""
CALIBRATION = "contextpaw.calibration"
"""(calibration key, factor used) when the calibrated counter counted this request."""
NATIVE_OLLAMA = ("ollama.chat", "ollama.generate")
CALIBRATION_FILE = "contextpaw-calibration.json"
SUMMARY_FILE = "contextpaw-summaries.json"
SAVE_EVERY_S = 10.0
VERIFY_ROUNDS = 3
FROM_LINE = re.compile(r"^FROM\s+(\S+)", re.MULTILINE)

def _reply(flow: http.HTTPFlow, status: int, body: bytes, content_type: str = JSON_TYPE) -> None:
    flow.response = http.Response.make(status, body, {"Content-Type": content_type})
    flow.metadata[LOCAL] = True


def _flag(flow: http.HTTPFlow, mark: str, comment: str, replace: bool = False) -> None:
    """Say it in mitmweb: a mark on the flow, and a line in its comment (after any earlier one,
    unless ``replace``: a rescue's report replaces the first compaction's)."""
    flow.marked = mark
    flow.comment = comment if replace or not flow.comment else f"{flow.comment}; {comment}"


def _calibration_key(backend: wire.Backend, model: str) -> str:
    """Calibration is learned per kind of server and model: each tokenizes and templates its own way."""
    return f"{backend.kind}/{model}"


def _rough(parsed: wire.Chat | wire.Prompt, counter: Counter) -> int:
    """What the estimate makes of a whole request: cheap (byte lengths), for deciding how to count it."""
    if isinstance(parsed, wire.Chat):
        conversation = parsed.conversation
        return counter.tools(conversation.tools) + sum(counter.message(m) for m in conversation.messages)
    return counter.text(parsed.prompt) + counter.text(parsed.fixed_text)


def _big(raw: bytes) -> bool:
    return len(raw) > OFFLOAD_BYTES or raw.count(b'"role"') > OFFLOAD_MESSAGES


async def _off_loop[T](big: bool, fn: Callable[[], T]) -> T:
    return await asyncio.to_thread(fn) if big else fn()


def _is_reverse(flow: http.HTTPFlow) -> bool:
    return isinstance(flow.client_conn.proxy_mode, mode_specs.ReverseMode)


def _endpoint(host: str, port: int) -> tuple[str, int]:
    """A server's address as a key: every loopback name (`localhost`, `127.0.0.1`, `[::1]`) is one
    server, so a regular-mode client that says `localhost` reaches the backend configured as 127.0.0.1."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost":
        return ("loopback", port)
    try:
        return ("loopback", port) if ipaddress.ip_address(name).is_loopback else (name, port)
    except ValueError:
        return (name, port)


def _destination(flow: http.HTTPFlow) -> tuple[str, int]:
    return _endpoint(flow.request.host, flow.request.port)


def _model_request(flow: http.HTTPFlow) -> bool:
    """A request to a route either API handles (chat, generate, completions)."""
    return any(wire.route_for(kind, flow.request.method, flow.request.path) for kind in wire.Kind)


class Backends:
    """Which backend (Ollama or llama-server) a flow goes to, whether it answers, and what it is sent.

    A destination is a backend when it is configured (`contextpaw_ollama`, `contextpaw_llamacpp`),
    when the client names the kind (`X-ContextPaw-Backend`), or when it is a reverse-mode target
    that identifies itself on a probe (once). mitmproxy answers a refused upstream with an HTML page
    that no hook can replace, so a flow without an open upstream connection is checked first and
    answered with a 502 in the caller's own JSON convention. A model request with a body over
    `contextpaw_max_body_mb` gets a 413 in that convention (other routes, such as Ollama's blob
    uploads, are not limited here; mitmproxy's `body_size_limit` and `stream_large_bodies` bound
    what it holds in memory, before any hook).
    """

    def __init__(self, stats: admin.Stats) -> None:
        self.stats = stats
        self.configured: dict[tuple[str, int], wire.Backend] = {}
        self.probed: dict[tuple[str, int], wire.Backend] = {}
        self.reverse_targets: dict[tuple[str, int], wire.Backend] = {}
        """Reverse-mode targets, listed by /contextpaw/health before any traffic (their kind is
        a placeholder until `_identified` asks them)."""
        self.last_error: dict[str, str] = {}
        self.relay: Relay | None = None
        """The relay that carries model requests (`Upstream`'s); it answers while it listens."""
        self._client: aiohttp.ClientSession | None = None

    def load(self, loader: Any) -> None:
        loader.add_option("contextpaw_ollama", Sequence[str], [], "Ollama backend URL (repeatable).")
        loader.add_option("contextpaw_llamacpp", Sequence[str], [], "llama-server backend URL (repeatable).")
        loader.add_option("contextpaw_max_body_mb", int, 256,
                          "Model requests (chat, generate, completions) above this many megabytes are refused with a 413.")  # fmt: skip

    def configure(self, updated: set[str]) -> None:
        if "contextpaw_max_body_mb" in updated and ctx.options.contextpaw_max_body_mb < 1:
            raise exceptions.OptionsError(f"contextpaw_max_body_mb must be at least 1, not {ctx.options.contextpaw_max_body_mb}")
        if "mode" in updated:
            self.reverse_targets = {}
            for spec in ctx.options.mode:
                mode = mode_specs.ProxyMode.parse(spec)
                if isinstance(mode, mode_specs.ReverseMode) and mode.scheme in ("http", "https"):
                    host, port = mode.address
                    url = f"{mode.scheme}://{f'[{host}]' if ':' in host else host}:{port}"
                    self.reverse_targets[_endpoint(host, port)] = wire.Backend.parse(wire.Kind.OLLAMA, url)
        if not {"contextpaw_ollama", "contextpaw_llamacpp"} & updated:
            return
        configured = {}
        for kind in wire.Kind:
            for url in getattr(ctx.options, f"contextpaw_{kind}"):
                try:
                    backend = wire.Backend.parse(kind, url)
                except ValueError as e:
                    raise exceptions.OptionsError(f"contextpaw_{kind}: {e}") from None
                configured[_endpoint(backend.host, backend.port)] = backend
        self.configured = configured

    def done(self) -> None:
        if self._client is not None:
            asyncio.get_running_loop().create_task(self._client.close())
            self._client = None

    def server_connect_error(self, data: ServerConnectionHookData) -> None:
        self.last_error[_address(data)] = data.server.error or "connect failed"

    def server_connected(self, data: ServerConnectionHookData) -> None:
        self.last_error.pop(_address(data), None)

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or not self.serves(flow):
            return
        size, limit = len(flow.request.raw_content or b""), ctx.options.contextpaw_max_body_mb << 20
        if size > limit and _model_request(flow):
            reason = f"ContextPaw: the request body ({size:,} bytes) is over the limit of {limit:,} bytes (contextpaw_max_body_mb)"
            await self._refuse(flow, 413, reason, "too_large")
        elif self.relayed(flow):
            return  # the relay answers for a backend that does not answer
        elif not flow.server_conn.connected and not await self.answers(flow.request.host, flow.request.port):
            reason = f"ContextPaw: the backend at {flow.request.host}:{flow.request.port} does not answer"
            await self._refuse(flow, 502, reason, "unreachable")

    async def _refuse(self, flow: http.HTTPFlow, status: int, reason: str, count: str) -> None:
        backend = await self.backend_of(flow)
        _reply(flow, status, report_bytes(wire.proxy_error(backend and backend.kind, flow.request.path, reason, status)))
        _flag(flow, REFUSED_MARK, f"answered {status}: {reason.removeprefix('ContextPaw: ')}")
        self.stats.add(count)
        logger.warning("%s %s: answered %d: %s", flow.request.method, flow.request.url, status, reason.removeprefix("ContextPaw: "))

    def relayed(self, flow: http.HTTPFlow) -> bool:
        """Whether the relay carries this flow: a model request over plain HTTP to a backend of known
        kind, not already sent via an upstream proxy (`contextpaw_relay` on)."""
        address = _destination(flow)
        known = address in self.configured or address in self.probed
        return (
            self.relay is not None and self.relay.address is not None
            and ctx.options.contextpaw_relay and flow.request.scheme == "http" and flow.server_conn.via is None
            and (known or BACKEND_HEADER in flow.request.headers) and _model_request(flow)
        )  # fmt: skip

    def serves(self, flow: http.HTTPFlow) -> bool:
        """Whether this flow goes to a backend rather than anywhere else a regular proxy reaches."""
        return (
            _is_reverse(flow)
            or _destination(flow) in self.configured
            or BACKEND_HEADER in flow.request.headers
        )

    async def backend_of(self, flow: http.HTTPFlow) -> wire.Backend | None:
        address = _destination(flow)
        if address in self.configured:
            return self.configured[address]
        url = f"{flow.request.scheme}://{flow.request.host}:{flow.request.port}"
        named = flow.request.headers.get(BACKEND_HEADER, "").lower()
        if named in set(wire.Kind):
            return wire.Backend.parse(wire.Kind(named), url)
        if not _is_reverse(flow):
            return None
        return await self._identified(address, url)

    async def _identified(self, address: tuple[str, int], url: str) -> wire.Backend | None:
        """The backend at a reverse-mode target, asked once what it is (None while it does not say)."""
        if address not in self.probed:
            root, props = await asyncio.gather(self._get(url + "/"), self._get(url + "/props"))
            kind = wire.identify(root[1] if root and root[0] == 200 else None, props and props[0])
            if kind is None:
                return None
            self.probed[address] = wire.Backend.parse(kind, url)
            logger.info("%s identified as %s", url, kind)
        return self.probed[address]

    async def answers(self, host: str, port: int) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT_S)
        except (OSError, TimeoutError):
            return False
        writer.close()
        return True

    async def health(self) -> list[dict[str, Any]]:
        """Every configured backend and reverse-mode target, and whether each answers now; a target
        of unknown kind is asked what it is, so a dead one is listed (kind null) before any traffic."""
        def unknown() -> dict[tuple[str, int], wire.Backend]:
            known = self.configured.keys() | self.probed.keys()
            return {a: b for a, b in self.reverse_targets.items() if a not in known}

        await asyncio.gather(*(self._identified(a, b.url) for a, b in unknown().items()))
        kinds = {a: b.kind for a, b in {**self.probed, **self.configured}.items()}
        backends = {**unknown(), **self.probed, **self.configured}
        answers = await asyncio.gather(*(self.answers(b.host, b.port) for b in backends.values()))
        return [
            {"kind": kinds.get(a), "url": b.url, "answers": up, "last_error": self.last_error.get(f"{b.host}:{b.port}")}
            for (a, b), up in zip(backends.items(), answers, strict=True)
        ]

    def client(self) -> aiohttp.ClientSession:
        """The session for calls of our own; it ignores HTTP_PROXY, which may point at this proxy."""
        if self._client is None:
            self._client = aiohttp.ClientSession(trust_env=False)
        return self._client

    async def _get(self, url: str) -> tuple[int, str] | None:
        try:
            async with self.client().get(url, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                return resp.status, await resp.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError):
            return None


def _address(data: ServerConnectionHookData) -> str:
    host, port = data.server.address or ("?", 0)
    return f"{host}:{port}"


class Compactor:
    """Fits handled requests into the budget, refuses or rescues them, and reports what was lost."""

    def __init__(self, backends: Backends, stats: admin.Stats, store: EvictedStore) -> None:
        self.backends = backends
        self.stats = stats
        self.store = store
        self.plans = LRU(1024)
        """Each conversation's last `Plan` (by `wire.Chat.key`): the next turn evicts the same units."""
        self.model_files = LRU(256)
        """(Ollama URL, model) -> the file its Modelfile's FROM names, or None."""
        self.windows = BackendWindows(self._fetch)
        self.budgeter = Budgeter(default_ctx=4096, reserve=1024, margin=64)
        self.estimate = EstimateCounter()
        self.calibration = Calibration()
        self.state_path: Path | None = None
        self._saved_at = 0.0
        self._counting: LlamaCppCounting | None = None
        self.summarizer: Summarizer | None = None
        self.summary_calls: dict[tuple[str, str, str | None], ChatCompletions] = {}
        self.tokenizers: dict[str, Counter | None] = {}
        """Tokenizer file path -> its counter (None: the file could not be used)."""

    def load(self, loader: Any) -> None:
        add = loader.add_option
        add("contextpaw_policy", str, "compact",
            "compact: fit overflowing requests and report it; strict: refuse them with 413; off: pass through.",
            choices=POLICIES)
        add("contextpaw_keep_recent", int, 4, "Most recent messages that are never evicted.")
        add("contextpaw_default_ctx", int, 4096, "Context window when neither the request nor the backend says.")
        add("contextpaw_output_reserve", int, 1024,
            "Tokens kept for the answer when the request sets no limit (at most half the window).")
        add("contextpaw_margin", int, 64, "Tokens kept for the chat template and counting error.")
        add("contextpaw_conversations", int, 1024, "Conversations whose eviction plan is remembered (LRU).")
        add("contextpaw_evicted_items", int, 10_000, "Evicted contents kept for /contextpaw/evicted/<id>.")
        add("contextpaw_evicted_mb", int, 256, "Megabytes of evicted content kept.")
        add("contextpaw_evicted_ttl", int, 86_400, "Seconds evicted content is kept.")
        add("contextpaw_discover_window", bool, True,
            "Ask the backend for the model's real window (llama-server /props; Ollama /api/ps, /api/show).")
        add("contextpaw_tokenizer", str, "",
            "A tokenizer.json or GGUF file to count with, for every model (default: ask llama-server, "
            "or the GGUF Ollama names, else a calibrated estimate).")
        add("contextpaw_forbid_truncation", bool, True,
            "Send truncate:false on Ollama's native routes when a request is near the window, so a residual "
            "overflow comes back as a 400 that ContextPaw rescues instead of a silent cut.")
        add("contextpaw_summarize", bool, False,
            "Put a digest of what was evicted where its marker goes (map-reduce over the whole span).")
        add("contextpaw_summarizer_url", str, "", "The server that writes digests (default: the request's).")
        add("contextpaw_summarizer_model", str, "", "The model that writes digests (default: the request's).")
        add("contextpaw_summarizer_timeout", int, 30, "Seconds one summarizer call may take.")
        add("contextpaw_summary_tokens", int, 256, "The most tokens all digests of one request may take.")
        add("contextpaw_calibrate", bool, True,
            "Learn from the prompt counts servers report how the estimate must be scaled, per backend and model.")
        add("contextpaw_state_dir", str, "", "Where the calibration is kept across restarts (default: confdir).")

    def configure(self, updated: set[str]) -> None:
        o = ctx.options
        if o.contextpaw_policy not in POLICIES:
            raise exceptions.OptionsError(
                f"contextpaw_policy must be one of {', '.join(POLICIES)}, not {o.contextpaw_policy!r}"
            )
        for name, least in MINIMUMS.items():
            if name in updated and getattr(o, name) < least:
                raise exceptions.OptionsError(f"{name} must be at least {least}, not {getattr(o, name)}")
        if o.contextpaw_output_reserve + o.contextpaw_margin >= o.contextpaw_default_ctx:
            raise exceptions.OptionsError(
                f"contextpaw_output_reserve ({o.contextpaw_output_reserve}) + contextpaw_margin "
                f"({o.contextpaw_margin}) leave no room in contextpaw_default_ctx ({o.contextpaw_default_ctx})"
            )
        self.budgeter = Budgeter(
            default_ctx=o.contextpaw_default_ctx,
            reserve=o.contextpaw_output_reserve,
            margin=o.contextpaw_margin,
            source=self.windows if o.contextpaw_discover_window else NoDiscovery(),
        )
        if o.contextpaw_tokenizer and not os.path.isfile(os.path.expanduser(o.contextpaw_tokenizer)):
            raise exceptions.OptionsError(f"contextpaw_tokenizer: no such file {o.contextpaw_tokenizer!r}")
        state_dir = Path(o.contextpaw_state_dir or o.confdir).expanduser()
        if {"contextpaw_state_dir", "confdir"} & updated:
            self._restore_calibration(state_dir)
        if o.contextpaw_summarizer_url:
            try:
                wire.Backend.parse(wire.Kind.OLLAMA, o.contextpaw_summarizer_url)
            except ValueError as e:
                raise exceptions.OptionsError(f"contextpaw_summarizer_url: {e}") from None
        if {"contextpaw_summarize", "contextpaw_summarizer_timeout", "contextpaw_state_dir", "confdir"} & updated:
            self.summarizer = (
                Summarizer(
                    timeout=o.contextpaw_summarizer_timeout,
                    state_path=state_dir / SUMMARY_FILE,
                )
                if o.contextpaw_summarize
                else None
            )
        self.store.max_items = o.contextpaw_evicted_items
        self.store.max_bytes = o.contextpaw_evicted_mb << 20
        self.store.max_age_s = o.contextpaw_evicted_ttl
        self.plans.limit = o.contextpaw_conversations

    def done(self) -> None:
        """Close the summarizer's sessions and keep what calibration learned (sync: hot reload)."""
        for calls in self.summary_calls.values():
            asyncio.get_running_loop().create_task(calls.close())
        self.summary_calls.clear()
        self._save_calibration(force=True)

    def summary_metrics(self) -> dict[str, float]:
        """Summarizer counters for /contextpaw/metrics (zeros while summarizing is off)."""
        stats = self.summarizer.stats() if self.summarizer else {}
        return {f"summarizer_{k}": float(stats.get(k, 0)) for k in ("digests", "calls", "cache_hits", "failures", "seconds")}

    # -- counting ------------------------------------------------------------------------------

    async def counter_for(
        self, backend: wire.Backend, parsed: wire.Chat | wire.Prompt, budget: int | None = None, big: bool = False
    ) -> tuple[Counter, int]:
        """The best counter for this request, and the template's fixed cost when it is known.

        Best source first: a tokenizer file the operator named; llama-server's own tokenizer and
        template; the tokenizer in the GGUF file Ollama names for the model; the calibrated estimate.
        A request the estimate puts at under half the `budget` cannot overflow even if the estimate
        is off by two, so it is not worth a call to the backend: the estimate counts it.
        """
        model = parsed.params.model
        calibrated = self.calibration.counter(_calibration_key(backend, model), self.estimate)
        if budget is not None and await _off_loop(big, functools.partial(_rough, parsed, calibrated)) <= budget // 2:
            return calibrated, 0
        if ctx.options.contextpaw_tokenizer:
            named = await self._tokenizer(os.path.expanduser(ctx.options.contextpaw_tokenizer))
            if named is not None:
                return named, 0
        if backend.kind == wire.Kind.LLAMACPP:
            counted = await self.counting().counter(
                backend.url, parsed.texts, calibrated, chat=isinstance(parsed, wire.Chat), has_system=parsed.has_system
            )
            if counted is not None:
                return counted
        elif (gguf := await self._ollama_model_file(backend, model)) is not None:
            local = await self._tokenizer(gguf)
            if local is not None:
                return local, 0
        return calibrated, 0

    def counting(self) -> LlamaCppCounting:
        if self._counting is None:
            self._counting = LlamaCppCounting(self.backends.client())
        return self._counting

    async def _tokenizer(self, path: str) -> Counter | None:
        """Load a tokenizer once, in a worker thread (a GGUF vocabulary takes seconds to read)."""
        if path not in self.tokenizers:
            try:
                self.tokenizers[path] = await asyncio.to_thread(TokenizerCounter.from_file, path)
            except Exception as e:  # any unreadable or unsupported file means: count another way
                logger.warning("cannot count with %s (%s); using another counter", path, e)
                self.tokenizers[path] = None
        return self.tokenizers[path]

    async def _ollama_model_file(self, backend: wire.Backend, model: str) -> str | None:
        """The model's GGUF blob, when Ollama's Modelfile names one that this machine can read.

        Asked once per model (a request near the window would otherwise ask every time)."""
        key = (backend.url, model)
        if key not in self.model_files:
            show = await self._fetch("POST", backend.url + "/api/show", {"model": model}) if model else None
            found = FROM_LINE.search(str(show.get("modelfile", ""))) if isinstance(show, dict) else None
            self.model_files.put(key, found.group(1) if found else None)
        path = self.model_files.get(key)
        return path if path and os.path.isfile(path) else None

    async def _fetch(self, method: str, url: str, body: dict[str, Any] | None) -> Any:
        """A JSON answer from a backend, or None: discovery is best-effort, never a reason to fail."""
        try:
            async with self.backends.client().request(
                method, url, json=body, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as resp:
                return await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def _verified(
        self,
        parsed: wire.Chat | wire.Prompt,
        fitted: wire.Fitted,
        budget: Budget,
        backend: wire.Backend,
        **fit: Any,
    ) -> wire.Fitted:
        """Check a llama-server chat against the server's exact count; refit if it is over.

        Our per-text counts are exact, but a shrunk text is estimated and a text can tokenize one
        token differently inside the template: the server's total for the whole request is the
        truth. A few rounds at most; each one tightens the budget by what the last one missed.
        """
        if fitted.report.counter != "backend" or not isinstance(parsed, wire.Chat):
            return fitted
        for _ in range(VERIFY_ROUNDS):
            sent = json.loads(fitted.body) if fitted.body is not None else parsed.body
            total = await self.counting().total(
                backend.url, {k: sent[k] for k in ("messages", "tools") if sent.get(k) is not None}
            )
            if total is None:
                fitted.report.exact = False
                return fitted
            if total <= budget.tokens:
                fitted.report.final_tokens = total
                if fitted.body is None:
                    fitted.report.original_tokens = total
                return fitted
            budget = Budget(budget.window, budget.reserve, budget.margin + total - budget.tokens)
            fitted = await self._compact(parsed, budget, backend, big=False, verify=False, **fit)
        fitted.report.exact = False
        fitted.report.notes.append("the server's count could not be confirmed within the budget")
        return fitted

    # -- request ------------------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        backend = await self.backends.backend_of(flow)
        route = backend and wire.route_for(backend.kind, flow.request.method, flow.request.path)
        raw = flow.request.get_content(strict=False)
        if backend is None or route is None or raw is None:
            return
        flow.metadata[ROUTE] = route.name
        self.stats.add("requests")
        try:
            await self._fit(flow, backend, route, raw)
        except Exception as e:  # fail open: the backend answers the request as the client sent it
            logger.exception("ContextPaw failed on %s; forwarding the request unchanged", flow.request.path)
            flow.metadata[HEADERS] = {"X-ContextPaw-Error": f"{type(e).__name__} while compacting; forwarded unchanged"}
            self.stats.add("errors")

    async def _fit(self, flow: http.HTTPFlow, backend: wire.Backend, route: wire.Route, raw: bytes) -> None:
        """Decide and apply; the request body is the last thing changed, so a failure leaves it whole."""
        policy = ctx.options.contextpaw_policy
        big = _big(raw)
        try:
            parsed = await _off_loop(big, functools.partial(route.read, raw))
        except wire.NotCompactable as e:
            logger.debug("%s forwarded as is: %s", flow.request.path, e)
            return
        budget = await self.budgeter.budget(backend, parsed.params)
        try:
            fitted = await self._compact(parsed, budget, backend, big)
        except BudgetTooSmall as e:
            if policy != "off":
                self._refuse(flow, route, budget.impossible(e))
            return
        report = fitted.report
        self.stats.add("original_tokens", report.original_tokens)
        if report.counter == "calibrated":
            key = _calibration_key(backend, parsed.params.model)
            flow.metadata[CALIBRATION] = [key, self.calibration.factor(key)]
        if policy == "off":
            flow.metadata[OBSERVED] = report.to_json()
            if report.compacted:
                flow.comment = f"contextpaw off; would have {report.summary()}"
            return
        if policy == "strict" and report.compacted:
            self._refuse(flow, route, budget.refusal(report.original_tokens))
            return
        if self.summarizer is not None and isinstance(parsed, wire.Chat) and report.evicted_tokens:
            fitted = await self._summarized(flow, parsed, fitted, budget, backend, big)
            report = fitted.report
        self._remember(parsed, fitted)
        self._keep_report(flow, report)
        body = fitted.body
        if self._forbid_truncation(route, parsed, report, budget):
            body = wire.write(json.loads(body) if body is not None else parsed.body, truncate=False)
        if fitted.body is not None:
            self._note_compaction(flow, route, report, parsed.params.model)
        if body is not None:
            flow.metadata[ORIGINAL] = raw
            flow.request.content = body

    @staticmethod
    def _forbid_truncation(route: wire.Route, parsed: wire.Chat | wire.Prompt, report: Report, budget: Budget) -> bool:
        """Ask Ollama to refuse instead of cutting, for requests near enough the window to be at risk.

        Requests far below it are left byte for byte; `truncate` set by the client is respected.
        """
        return (
            ctx.options.contextpaw_forbid_truncation
            and route.name in NATIVE_OLLAMA
            and "truncate" not in parsed.body
            and report.final_tokens > budget.window // 2
            and bool(parsed.conversation.messages if isinstance(parsed, wire.Chat) else parsed.prompt)  # a load request has nothing to cut
        )

    async def _compact(
        self,
        parsed: wire.Chat | wire.Prompt,
        budget: Budget,
        backend: wire.Backend,
        big: bool,
        verify: bool = True,
        digests: Mapping[str, str] | None = None,
        previous: Plan | None = None,
    ) -> wire.Fitted:
        """Fit with the conversation's last plan, in a worker thread when the request is big."""
        counter, fixed = await self.counter_for(backend, parsed, budget.tokens, big)
        turns: dict[str, Any] = {}  # what only a chat has: turns, a last plan, holes to put digests in
        if isinstance(parsed, wire.Chat):
            previous = previous or self.plans.get(parsed.key)
            turns = {"keep_recent": ctx.options.contextpaw_keep_recent, "previous": previous, "digests": digests}
        fit = functools.partial(parsed.fit, budget.tokens, counter, fixed_tokens=fixed, **turns)
        fitted = await _off_loop(big, fit)
        fitted.report.window = budget.window
        if not verify:
            return fitted
        return await self._verified(parsed, fitted, budget, backend, digests=digests, previous=previous)

    # -- digests of what was evicted -----------------------------------------------------------

    async def _summarized(
        self,
        flow: http.HTTPFlow,
        parsed: wire.Chat,
        fitted: wire.Fitted,
        budget: Budget,
        backend: wire.Backend,
        big: bool,
    ) -> wire.Fitted:
        """Put a digest of each evicted span where its marker goes, inside the budget.

        The chat is compacted again with room left for the digests; its holes are summarized; then
        it is compacted a last time with the digests, keeping that plan's evictions so the holes
        come out the same. Best-effort: without a digest the plain marker stays, and the report
        says why.
        """
        assert self.summarizer is not None
        cap = ctx.options.contextpaw_summary_tokens
        roomy = await self._compact(parsed, Budget(budget.window, budget.reserve, budget.margin + cap), backend, big)
        holes = {mid: content for mid, content in roomy.report.evicted.items() if not isinstance(content, str)}
        if not holes:
            return fitted
        model = await self._summary_model(flow, backend, parsed, budget)
        results = await asyncio.gather(
            *(self.summarizer.digest(content, model=model, cap_tokens=cap // len(holes)) for content in holes.values())
        )
        digests = {mid: r.text for mid, r in zip(holes, results, strict=True) if r.text}
        reasons = "; ".join(r.reason for r in results if r.reason) or None
        if reasons:
            logger.warning("%s: %d of %d evicted spans not summarized: %s", flow.request.path, len(holes) - len(digests), len(holes), reasons)
        if not digests:
            fitted.report.summary_reason = reasons
            return fitted
        final = await self._compact(parsed, budget, backend, big, digests=digests, previous=roomy.plan)
        final.report.summary_reason = reasons
        return final

    async def _summary_model(
        self, flow: http.HTTPFlow, backend: wire.Backend, parsed: wire.Chat, budget: Budget
    ) -> SummaryModel:
        """Where digests are made: the configured summarizer, else the request's own backend and model."""
        o = ctx.options
        target = wire.Backend.parse(backend.kind, o.contextpaw_summarizer_url) if o.contextpaw_summarizer_url else backend
        name = o.contextpaw_summarizer_model or parsed.params.model
        window = budget.window if target == backend else await self.windows.window(target, name) or budget.window
        auth = flow.request.headers.get("Authorization")
        key = (target.url, name, auth)
        if key not in self.summary_calls:
            headers = {"Authorization": auth} if auth else None
            self.summary_calls[key] = ChatCompletions(target.url, name, timeout=o.contextpaw_summarizer_timeout, headers=headers)
        counter, _ = await self.counter_for(target, parsed)
        return SummaryModel(self.summary_calls[key], f"{target.url}/{name}", window, counter)

    def _remember(self, parsed: wire.Chat | wire.Prompt, fitted: wire.Fitted) -> None:
        if parsed.key and fitted.plan is not None:
            self.plans.put(parsed.key, fitted.plan)

    def _refuse(self, flow: http.HTTPFlow, route: wire.Route, overflow: wire.Overflow) -> None:
        report = Report(False, "refused", overflow.required, overflow.required, overflow.budget, window=overflow.window)
        self._keep_report(flow, report)
        _reply(flow, 413, report_bytes(route.refusal(overflow, report.to_json())))
        _flag(flow, REFUSED_MARK, f"refused 413: {overflow.message}")
        logger.info("%s refused: %s", route.name, overflow.message)
        self.stats.add("refused")

    @staticmethod
    def _keep_report(flow: http.HTTPFlow, report: Report) -> None:
        flow.metadata[REPORT] = report.to_json()
        flow.metadata[HEADERS] = report.headers()

    def _note_compaction(self, flow: http.HTTPFlow, route: wire.Route, report: Report, model: str) -> None:
        for marker_id, content in report.evicted.items():
            self.store.put(marker_id, content)
        self.stats.add("compacted")
        self.stats.add("evicted_tokens", report.evicted_tokens)
        _flag(flow, COMPACTED_MARK, report.summary(), replace=True)
        logger.info("%s %s: %s", route.name, model, report.summary())
        logger.debug("evicted under %s: %r", report.markers, report.evicted)

    # -- response -----------------------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        assert response is not None
        response.headers.update(flow.metadata.get(HEADERS, {}))
        if flow.metadata.get(RESENT):  # the relay retried it after a 400
            self._settle_rescue(flow)
        if flow.metadata.get(LOCAL) or not response.headers.get("content-type", "").startswith(STREAM_TYPES):
            return
        route = wire.ROUTES.get(flow.metadata.get(ROUTE, ""))
        watched = REPORT in flow.metadata or OBSERVED in flow.metadata
        if route is None or not watched or response.headers.get("content-encoding", "identity") != "identity":
            response.stream = True
            return
        response.stream = StreamReport(route.framing, route.is_final, functools.partial(self._final_report, flow))
        if "content-length" in response.headers:
            del response.headers["content-length"]
            response.headers["transfer-encoding"] = "chunked"

    async def response(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        assert response is not None
        route = wire.ROUTES.get(flow.metadata.get(ROUTE, ""))
        watched = REPORT in flow.metadata or OBSERVED in flow.metadata
        if route is None or not watched or flow.metadata.get(LOCAL) or response.stream:
            return
        try:
            overflow = wire.upstream_overflow(response.status_code, response.content or b"")
            if overflow and self._may_rescue(flow):
                await self._rescue(flow, route, overflow)
            elif flow.response.status_code >= 500 and ERROR_HEADER not in flow.response.headers:
                self._upstream_failed(flow, f"the backend answered {flow.response.status_code}")
            self._report_in_body(flow, route)
        except Exception as e:  # fail open: the client gets the backend's answer as it was
            logger.exception("ContextPaw failed on the response to %s; passing it through", flow.request.path)
            response.headers["X-ContextPaw-Error"] = f"{type(e).__name__} on the response; passed through"
            self.stats.add("errors")

    def error(self, flow: http.HTTPFlow) -> None:
        """A handled flow that ended without a (whole) answer: count it, and say which."""
        if ROUTE in flow.metadata and flow.error and "client disconnected" not in flow.error.msg.lower():
            self._upstream_failed(flow, flow.error.msg)

    def _upstream_failed(self, flow: http.HTTPFlow, what: str) -> None:
        self.stats.add("upstream_errors")
        logger.warning("%s %s: upstream failure: %s", flow.request.method, flow.request.path, what)

    async def rescue_in_relay(self, flow: http.HTTPFlow, status: int, answer: bytes) -> bytes | None:
        """The relay's question when a request it carries comes back with an error: the body to send
        once instead (compacted to the window the backend named), or None to pass the answer on.

        The retried answer then reaches mitmproxy as the flow's answer, streamed if it streams, and
        the flow is still in flight for the GPU arbiter meanwhile. The body is returned encoded as
        the request says (mitmproxy re-encodes what `_refit` sets)."""
        route = wire.ROUTES.get(flow.metadata.get(ROUTE, ""))
        overflow = wire.upstream_overflow(status, answer)
        if route is None or overflow is None or not self._may_rescue(flow):
            return None
        try:
            fitted = await self._refit(flow, route, overflow)
        except Exception as e:  # fail open: the backend's answer goes to the client as it was
            logger.exception("ContextPaw failed to rescue %s; passing the backend's answer on", flow.request.path)
            flow.metadata.setdefault(HEADERS, {})["X-ContextPaw-Error"] = f"{type(e).__name__} in the rescue; passed through"
            self.stats.add("errors")
            return None
        return flow.request.raw_content if fitted is not None else None

    def _may_rescue(self, flow: http.HTTPFlow) -> bool:
        return REPORT in flow.metadata and ctx.options.contextpaw_policy == "compact" and not flow.metadata.get(RETRIED)

    async def _refit(self, flow: http.HTTPFlow, route: wire.Route, overflow: wire.UpstreamOverflow) -> wire.Fitted | None:
        """Compact to the window the backend just named, once per flow (never twice); None if that
        cannot help. The report, plan and evicted content become the retry's."""
        flow.metadata[RETRIED] = True
        raw = flow.metadata.get(ORIGINAL) or flow.request.get_content(strict=False) or b""
        big = _big(raw)
        parsed = await _off_loop(big, functools.partial(route.read, raw))
        backend = await self.backends.backend_of(flow)
        assert backend is not None, "only flows to a backend have a route"
        budget = self.budgeter.after_upstream_overflow(overflow, flow.metadata[REPORT]["original_tokens"], parsed.params)
        try:
            fitted = await self._compact(parsed, budget, backend, big)
        except BudgetTooSmall as e:
            flow.metadata[HEADERS]["X-ContextPaw-Error"] = f"the upstream 400 cannot be rescued: {e}"
            return None
        if fitted.body is None:
            return None
        self.stats.add("retried_400")
        self._remember(parsed, fitted)
        self._keep_report(flow, fitted.report)
        self._note_compaction(flow, route, fitted.report, parsed.params.model)
        flow.metadata[ORIGINAL] = raw
        flow.metadata[RESENT] = True
        flow.request.content = fitted.body  # what was sent last, for mitmweb's view of the flow
        return fitted

    async def _rescue(self, flow: http.HTTPFlow, route: wire.Route, overflow: wire.UpstreamOverflow) -> None:
        """The rescue for a flow the relay does not carry: retried here, answered in one piece."""
        fitted = await self._refit(flow, route, overflow)
        assert flow.response is not None
        if fitted is None:
            flow.response.headers.update(flow.metadata[HEADERS])
            return
        headers = {k: v for k, v in flow.request.headers.items() if k.lower() not in HOP_HEADERS}
        timeout = aiohttp.ClientTimeout(sock_connect=PROBE_TIMEOUT_S, sock_read=ctx.options.contextpaw_header_timeout)
        async with self.backends.client().post(flow.request.url, data=fitted.body, headers=headers, timeout=timeout) as answer:
            body = await answer.read()
            kept = [(k.encode(), v.encode()) for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS]
            status = answer.status
        flow.response = http.Response.make(status, body, http.Headers(kept))
        flow.response.headers.update(flow.metadata[HEADERS])
        self._settle_rescue(flow)

    def _settle_rescue(self, flow: http.HTTPFlow) -> None:
        """Once the retry's status is known: say whether it recovered, in the report, headers and counts."""
        assert flow.response is not None
        recovered = flow.response.status_code < 400
        flow.metadata[REPORT]["recovered_from_upstream_400"] = recovered
        self.stats.add("recovered_400", recovered)
        if recovered:
            flow.response.headers["X-ContextPaw-Recovered"] = "upstream-400"
        elif ERROR_HEADER not in flow.response.headers:  # the relay says so itself when the backend failed
            logger.warning("%s: the backend refused the compacted retry too (%d); its answer is passed on",
                           flow.request.path, flow.response.status_code)  # fmt: skip

    def _report_in_body(self, flow: http.HTTPFlow, route: wire.Route) -> None:
        response = flow.response
        assert response is not None
        if not response.content:
            return
        amend = functools.partial(self._final_report, flow)
        if response.headers.get("content-type", "").startswith(STREAM_TYPES):
            response.content = StreamReport(route.framing, route.is_final, amend).transform(response.content)
            return
        try:
            answer = json.loads(response.content)
        except ValueError:
            self._upstream_failed(flow, "the backend's answer is not JSON; passed through as it was")
            return
        value = amend(answer) if isinstance(answer, dict) else None
        if value is not None and (body := with_report(response.content, value)) is not None:
            response.content = body
        if truncated := flow.metadata.get(REPORT, flow.metadata.get(OBSERVED, {})).get("upstream_truncated"):
            response.headers["X-ContextPaw-Upstream-Truncated"] = (
                f"{truncated['evaluated_tokens']} of {truncated['sent_tokens']} tokens evaluated"
            )

    # -- what the server says it evaluated ---------------------------------------------------

    def _final_report(self, flow: http.HTTPFlow, final: Any) -> bytes | None:
        """The report for the answer's final record, after checking the count the server reports there.

        Ollama evaluating clearly fewer tokens than it was sent means it cut the prompt in silence:
        that is said in the report, the log and the metrics, under every policy. The same count
        teaches the calibrated counter. Under policy off nothing is put on the wire (None).
        """
        report = flow.metadata.get(REPORT) or flow.metadata.get(OBSERVED)
        evaluated = wire.evaluated_tokens(final) if isinstance(final, dict) else None
        if report is None or evaluated is None:
            return report_bytes(report) if REPORT in flow.metadata else None
        backend_kind = wire.ROUTES[flow.metadata[ROUTE]].name.split(".")[0]
        truncation = None
        if backend_kind == "ollama" or flow.metadata.get(ROUTE, "").startswith("ollama"):
            truncation = detect(report["final_tokens"], evaluated, report.get("window"), report.get("exact", False))
        if truncation is not None and "upstream_truncated" not in report:
            report["upstream_truncated"] = truncation.to_json()
            _flag(flow, TRUNCATED_MARK, f"the server cut the prompt: {evaluated} of {report['final_tokens']} tokens evaluated")
            self.stats.add("upstream_truncated")
            logger.warning(
                "%s: the server evaluated %d of the %d prompt tokens it was sent (%s): silent truncation",
                flow.request.path, evaluated, report["final_tokens"], truncation.reason,
            )
        if (calibration := flow.metadata.pop(CALIBRATION, None)) and ctx.options.contextpaw_calibrate:
            key, factor = calibration
            self.calibration.observe(key, round(report["final_tokens"] / factor), evaluated, num_ctx=report.get("window"))
            self._save_calibration()
        return report_bytes(report) if REPORT in flow.metadata else None

    # -- calibration state ---------------------------------------------------------------------

    def _restore_calibration(self, directory: Path) -> None:
        self.state_path = directory / CALIBRATION_FILE
        try:
            with open(self.state_path, encoding="utf-8") as f:
                restored = self.calibration.restore(json.load(f))
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            restored = False
        if not restored:
            logger.warning("calibration state %s is damaged; starting from scratch", self.state_path)

    def _save_calibration(self, force: bool = False) -> None:
        """Write the calibration off the event loop, at most every few seconds."""
        now = time.monotonic()
        if self.state_path is None or (not force and now - self._saved_at < SAVE_EVERY_S):
            return
        self._saved_at = now
        text = json.dumps(self.calibration.state())
        asyncio.get_running_loop().run_in_executor(None, write_atomically, self.state_path, text)


class Upstream:
    """Sends handled requests to their backend through the relay (`contextpaw.relay`), so that a
    backend that resets, hangs or breaks off gets an answer in the caller's API within the timeouts,
    counted as `upstream_errors` (and `upstream_timeouts`) and logged. Other flows, HTTPS backends
    and flows that already go via an upstream proxy are left to mitmproxy.
    """

    def __init__(self, stats: admin.Stats, backends: Backends, compactor: Compactor) -> None:
        self.stats = stats
        self.backends = backends
        self.compactor = compactor
        self.relay = Relay(self._failed, Timeouts(PROBE_TIMEOUT_S, RELAY_TIMEOUT_S, RELAY_TIMEOUT_S), self._rescue)
        self._starting: asyncio.Task[None] | None = None
        self.carried: weakref.WeakValueDictionary[str, http.HTTPFlow] = weakref.WeakValueDictionary()
        """flow id -> the flow the relay carries (the relay knows it by `relay.FLOW_HEADER`)."""

    def load(self, loader: Any) -> None:
        loader.add_option("contextpaw_relay", bool, True,
                          "Send handled requests through ContextPaw's relay, which answers a failing backend "
                          "in the caller's API (JSON 502/504, or an error record in a stream).")  # fmt: skip
        loader.add_option("contextpaw_header_timeout", int, RELAY_TIMEOUT_S,
                          "Seconds a backend may take to start its answer (a long prompt or a long buffered "
                          "answer needs this long on a slow machine); then the client gets a 504.")  # fmt: skip
        loader.add_option("contextpaw_idle_timeout", int, RELAY_TIMEOUT_S,
                          "Seconds a backend may fall silent in the middle of its answer.")  # fmt: skip

    def configure(self, updated: set[str]) -> None:
        o = ctx.options
        for name in ("contextpaw_header_timeout", "contextpaw_idle_timeout"):
            if name in updated and getattr(o, name) < 1:
                raise exceptions.OptionsError(f"{name} must be at least 1, not {getattr(o, name)}")
        self.relay.timeouts = Timeouts(
            connect=PROBE_TIMEOUT_S, headers=o.contextpaw_header_timeout, idle=o.contextpaw_idle_timeout
        )

    def running(self) -> None:
        """Start the relay (sync, as a reloaded script's hooks are called; flows before it listens
        go to their backend directly)."""
        self._starting = asyncio.get_running_loop().create_task(self.relay.start())

    def done(self) -> None:
        self.relay.close()

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or not self.backends.relayed(flow):
            return
        # A fresh server connection: an eagerly opened one cannot take a `via` any more.
        flow.server_conn = connection.Server(address=(flow.request.host, flow.request.port), via=("http", self.relay.address))
        flow.request.headers[FLOW_HEADER] = flow.id  # the relay takes it off before the backend sees it
        self.carried[flow.id] = flow

    async def _rescue(self, flow_id: str, status: int, answer: bytes) -> bytes | None:
        flow = self.carried.get(flow_id)
        return await self.compactor.rescue_in_relay(flow, status, answer) if flow is not None else None

    def http_connect_upstream(self, flow: http.HTTPFlow) -> None:
        if self.relay.address is not None and flow.server_conn.address == self.relay.address:
            flow.request.headers["Proxy-Authorization"] = self.relay.authorization

    def _failed(self, failure: Failure) -> None:
        self.backends.last_error[failure.target] = failure.reason  # for /contextpaw/health
        if not failure.connected:
            self.stats.add("unreachable")
            logger.warning("%s %s: answered 502: %s", failure.method, failure.path, failure.reason)
            return
        self.stats.add("upstream_errors")
        self.stats.add("upstream_timeouts", failure.timed_out)
        answered = "an error record ended the stream" if failure.streamed else ("504" if failure.timed_out else "502")
        logger.warning("%s %s: upstream failure: %s (%s)", failure.method, failure.path, failure.reason, answered)


MINIMUMS = {
    "contextpaw_default_ctx": 1,
    "contextpaw_conversations": 1,
    "contextpaw_evicted_items": 1,
    "contextpaw_evicted_mb": 1,
    "contextpaw_evicted_ttl": 1,
    "contextpaw_keep_recent": 0,
    "contextpaw_output_reserve": 0,
    "contextpaw_margin": 0,
    "contextpaw_summarizer_timeout": 1,
    "contextpaw_summary_tokens": 32,
}


class AdminEndpoints:
    """`/contextpaw/*`: answered here, never forwarded; loopback only unless a token is set."""

    def __init__(self, backends: Backends, compactor: Compactor) -> None:
        self.backends = backends
        self.compactor = compactor
        self.admin = admin.Admin(compactor.stats, compactor.store, self._health)

    def load(self, loader: Any) -> None:
        loader.add_option(
            "contextpaw_admin_token", str | None, None,
            "Token (header X-ContextPaw-Token) that lets non-loopback clients use /contextpaw/*.",
        )

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or not admin.is_admin(flow.request.path):
            return
        if not self.backends.serves(flow):
            return
        client_host = flow.client_conn.peername[0] if flow.client_conn.peername else ""
        token = flow.request.headers.get("X-ContextPaw-Token")
        if admin.authorized(client_host, token, ctx.options.contextpaw_admin_token):
            reply = await self.admin.answer(flow.request.method, flow.request.path)
        else:
            reply = admin.json_reply(403, {"error": "ContextPaw endpoints are for loopback clients or token holders"})
        _reply(flow, reply.status, reply.body, reply.content_type)

    async def _health(self) -> dict[str, Any]:
        return {
            "policy": ctx.options.contextpaw_policy,
            "backends": await self.backends.health(),
            "counter": {
                "order": ["tokenizer option", "backend (llama-server)", "tokenizer (Ollama's GGUF)", "calibrated"],
                "tokenizers": {path: bool(c) for path, c in self.compactor.tokenizers.items()},
                "backend": self.compactor.counting().stats(),
            },
            "calibration": self.compactor.calibration.to_json(),
            "summarizer": self.compactor.summarizer.stats() if self.compactor.summarizer else None,
            "conversations": len(self.compactor.plans),
        }


def make_addons() -> list[object]:
    """The addons, sharing their counts and the evicted store, in hook order; and the content view."""
    contentviews.add(ContextPawView())
    store = EvictedStore(max_items=10_000, max_bytes=256 << 20, max_age_s=86_400)
    stats = admin.Stats(store)
    backends = Backends(stats)
    compactor = Compactor(backends, stats, store)
    gpu = arbitration.Arbitration(backends)
    stats.sources += [gpu.metrics, compactor.summary_metrics]
    upstream = Upstream(stats, backends, compactor)
    backends.relay = upstream.relay
    return [gpu, AdminEndpoints(backends, compactor), backends, compactor, upstream]
