"""GPU arbitration on the wire: the :class:`~contextpaw.gpu.arbiter.Arbiter` in front of every request that
runs a model on the card Ollama and llama-server share.

One concern, as mitmproxy's own addons have: hold a request until its runtime owns the GPU (or answer
503 in the caller's convention), release the hold when the flow ends, and answer
``GET /contextpaw/runtime``. It comes before ``AdminEndpoints``, which answers every other
``/contextpaw/*`` path, and before ``Backends``, whose reachability check would answer 502 for a
llama-server that the arbiter is about to start.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

from mitmproxy import ctx, exceptions, http

from contextpaw import wire
from contextpaw.core import logs
from contextpaw.gpu.arbiter import Arbiter, ArbiterCounters, ArbiterSettings, RuntimeUnavailable
from contextpaw.gpu.supervisor import default_log_path, start_problem
from contextpaw.ops import admin
from contextpaw.proxy.backends import Backends
from contextpaw.proxy.replies import reply
from contextpaw.settings import Option, declare
from contextpaw.wire.streams import report_bytes

logger = logs.get(__name__)

MODEL_SCAN_BYTES = 1 << 20
"""Bodies up to this size are scanned for the model a request loads (on the event loop: about a
millisecond); a bigger one is sized by what Ollama's models held last, and a router llama-server
loads it itself."""
CLIENT_CHECK_S = 0.5
"""How often a request waiting for its runtime checks that its client is still there."""
MODEL_MANAGEMENT = ("/api/show", "/api/pull", "/api/push", "/api/create", "/api/copy", "/api/blobs/")
"""Ollama's POSTs that load no model: they must not take the GPU from llama-server."""


class Timeout(NamedTuple):
    setting: str
    """The :class:`ArbiterSettings` field it sets."""
    default: int
    least: int
    help: str


TIMEOUTS = {
    "contextpaw_arbitrate_wait": Timeout("wait_timeout", 240, 1, "Seconds a request waits for its runtime before a 503 with Retry-After."),
    "contextpaw_arbitrate_drain": Timeout("drain_timeout", 60, 1, "Seconds a switch waits for the other runtime's requests to finish."),
    "contextpaw_switch_timeout": Timeout("switch_timeout", 180, 1, "Seconds a switch may take once drained: evicting, then starting."),
    "contextpaw_llamacpp_health_timeout": Timeout(
        "health_timeout", 120, 1, "Seconds llama-server has to load its model and answer /health."
    ),
    "contextpaw_llamacpp_stop_grace": Timeout("stop_grace", 10, 0, "Seconds between SIGTERM and SIGKILL when stopping llama-server."),
    "contextpaw_vram_release_timeout": Timeout("release_timeout", 30, 1, "Seconds NVML has to show an evicted runtime's memory back."),
    "contextpaw_min_hold": Timeout(
        "min_hold", 20, 0, "Seconds a runtime keeps the GPU once it has won it, against thrashing (the earlier --min-hold)."
    ),
}
"""Whole seconds: mitmproxy cannot set float options from the command line."""

SWITCHES = {
    "contextpaw_arbitrate": Option(
        bool,
        "Give the GPU to one runtime at a time: unload Ollama's models before starting llama-server "
        "(contextpaw_llamacpp_cmd), stop llama-server before Ollama runs again.",
        default=False,
    ),
    "contextpaw_llamacpp_cmd": Option(
        str, "Command that starts llama-server listening at the first contextpaw_llamacpp URL (for contextpaw_arbitrate).", default=""
    ),
    "contextpaw_llamacpp_log": Option(
        str, f"File for the output of the llama-server ContextPaw starts (default {default_log_path()}).", default=""
    ),
}
"""Whether the arbiter runs, and the llama-server it starts."""

ARBITER_OPTIONS = frozenset({*SWITCHES, *TIMEOUTS} | {f"contextpaw_{kind}" for kind in wire.Kind})

_closing: set[asyncio.Task[None]] = set()
"""Arbiters being closed: the loop holds tasks only weakly, and a closing one must not vanish."""


class Arbitration:
    """Gives the GPU to one runtime at a time for the first configured Ollama and llama-server.

    Only requests to those two backends that run a model are held; model listings and health checks
    pass through, so a client polling them does not make the runtimes switch back and forth.
    """

    def __init__(self, backends: Backends, new_arbiter: Callable[[ArbiterSettings], Arbiter] = Arbiter) -> None:
        self.backends = backends
        self.new_arbiter = new_arbiter
        self.arbiter: Arbiter | None = None

    def load(self, loader: Any) -> None:
        declare(loader, SWITCHES)
        for name, timeout in TIMEOUTS.items():
            loader.add_option(name, int, timeout.default, timeout.help)

    def configure(self, updated: set[str]) -> None:
        if not ARBITER_OPTIONS & updated:
            return
        settings = self._settings()
        current = self.arbiter.settings if self.arbiter else None
        if settings == current:
            return
        if self.arbiter is not None:
            _close(self.arbiter)
        self.arbiter = self.new_arbiter(settings) if settings else None

    def _settings(self) -> ArbiterSettings | None:
        """The arbiter the options describe, None while arbitration is off; every error names its option."""
        options = ctx.options
        for name, timeout in TIMEOUTS.items():
            if getattr(options, name) < timeout.least:
                raise exceptions.OptionsError(f"{name} must be at least {timeout.least}s, not {getattr(options, name)}")
        if not options.contextpaw_arbitrate:
            return None
        urls = {kind: self._first_backend(kind).url for kind in wire.Kind}
        if problem := start_problem(options.contextpaw_llamacpp_cmd):
            raise exceptions.OptionsError(f"contextpaw_arbitrate needs llama-server's start command: {problem}")
        return ArbiterSettings(
            ollama_url=urls[wire.Kind.OLLAMA],
            llamacpp_url=urls[wire.Kind.LLAMACPP],
            llamacpp_cmd=options.contextpaw_llamacpp_cmd,
            llamacpp_log=Path(options.contextpaw_llamacpp_log).expanduser() if options.contextpaw_llamacpp_log else default_log_path(),
            **{timeout.setting: float(getattr(options, name)) for name, timeout in TIMEOUTS.items()},
        )

    @staticmethod
    def _first_backend(kind: wire.Kind) -> wire.Backend:
        urls = getattr(ctx.options, f"contextpaw_{kind}")
        if not urls:
            raise exceptions.OptionsError(
                "contextpaw_arbitrate needs an Ollama backend (contextpaw_ollama) and a llama-server backend "
                f"(contextpaw_llamacpp) on the same GPU; contextpaw_{kind} is not set"
            )
        try:
            return wire.Backend.parse(kind, urls[0])
        except ValueError as e:
            raise exceptions.OptionsError(f"contextpaw_{kind}: {e}") from None

    def done(self) -> asyncio.Task[None] | None:
        """Stop the llama-server this proxy started. Sync, because script hot-reload calls ``done``
        without awaiting it; at a normal exit mitmproxy awaits the returned task, so the server is
        stopped before the event loop ends."""
        arbiter, self.arbiter = self.arbiter, None
        return _close(arbiter) if arbiter else None

    # -- flows ------------------------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        if admin.is_admin(flow.request.path):
            return
        arbiter = self.arbiter
        if arbiter is None or not _runs_model(flow.request):
            return
        backend = await self.backends.backend_of(flow)
        if backend is None or backend.url != getattr(arbiter.settings, f"{backend.kind}_url"):
            return
        try:
            await _while_connected(flow, arbiter, backend.kind)
        except RuntimeUnavailable as refusal:
            _refuse(flow, backend.kind, refusal)

    def response(self, flow: http.HTTPFlow) -> None:
        self._release(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._release(flow)

    def _release(self, flow: http.HTTPFlow) -> None:
        if self.arbiter is not None:
            self.arbiter.release(flow.id)

    async def status(self) -> dict[str, Any]:
        """What `/contextpaw/runtime` shows (the admin endpoints serve it)."""
        if self.arbiter is None:
            return {"enabled": False}
        return {"enabled": True, **await self.arbiter.status()}

    def metrics(self) -> dict[str, float]:
        """The arbiter's totals for ``/contextpaw/metrics``; zeros while arbitration is off, so the
        series exist from the start."""
        counters = self.arbiter.counters if self.arbiter else ArbiterCounters()
        return {f"runtime_{name}": float(value) for name, value in asdict(counters).items()}


async def _while_connected(flow: http.HTTPFlow, arbiter: Arbiter, kind: wire.Kind) -> None:
    """Wait for the runtime while the client is there: one that went away stops waiting, so a
    switch nobody waits for any more is cancelled (mitmproxy does not cancel a hook on disconnect)."""
    raw = flow.request.raw_content or b""
    model = wire.model_of(raw) if len(raw) <= MODEL_SCAN_BYTES else None
    waiting = asyncio.ensure_future(arbiter.acquire(kind, flow.id, model))
    while not waiting.done():
        await asyncio.wait({waiting}, timeout=CLIENT_CHECK_S)
        if not waiting.done() and flow.client_conn.timestamp_end is not None:
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            logger.info("%s %s: the client went away while waiting for %s", flow.request.method, flow.request.path, kind)
            return
    waiting.result()


def _runs_model(request: http.Request) -> bool:
    """Whether the request needs its runtime on the GPU: a POST that is not model management."""
    return request.method == "POST" and not request.path.startswith(MODEL_MANAGEMENT)


def _refuse(flow: http.HTTPFlow, kind: wire.Kind, refusal: RuntimeUnavailable) -> None:
    """503 in the convention of the route called, with ``Retry-After`` when asking again may help."""
    body = wire.proxy_error(kind, flow.request.path, f"ContextPaw: {kind} is not available: {refusal}", 503)
    if isinstance(body["error"], dict):  # the OpenAI and llama-server envelopes
        body["error"].update(code=503, type="runtime_unavailable")
    reply(flow, 503, report_bytes(body))
    assert flow.response is not None
    if refusal.retry_after is not None:
        flow.response.headers["Retry-After"] = str(refusal.retry_after)
    logger.warning("%s %s answered 503: %s", kind, flow.request.path, refusal)


def _close(arbiter: Arbiter) -> asyncio.Task[None]:
    """Close without blocking the hook that asks: stopping llama-server may take its stop grace."""
    task = asyncio.get_running_loop().create_task(arbiter.aclose())
    _closing.add(task)
    task.add_done_callback(_closing.discard)
    return task
