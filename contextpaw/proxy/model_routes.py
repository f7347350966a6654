"""The shell of the model routes: `GET /v1/models` (and `/v1/models/{id}`, llama-server's `/models`),
`POST /api/show` and `GET /props` answered with the window the server really serves.

An agent that reads its window from these routes then compacts its own history at the right point,
and ContextPaw stays the safety net. The window is the one ContextPaw fits requests without a window
of their own to, found without loading a model (`BackendWindows.listed`); a model whose window only
a load would tell is passed as the backend listed it. The rewriting is in the wire modules
(`openai.models_with_windows`, `ollama.show_with_window`, `llamacpp.props_with_window`); here the
answer is read, the windows asked for, and the body put back. Fail open: an answer that cannot be
read goes on as it came, with `X-ContextPaw-Error`.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from mitmproxy import http

from contextpaw import wire
from contextpaw.core import logs
from contextpaw.fitting.fitter import Fitter
from contextpaw.fitting.services import OFFLOAD_BYTES, off_loop
from contextpaw.proxy.backends import Backends
from contextpaw.wire import llamacpp, ollama, openai, served

logger = logs.get(__name__)

MAX_READ_BYTES = 4 << 20
"""The largest answer read here: a model list or `/api/show` is tens of KB; a verbose `/api/show`
(the whole vocabulary, several MB) goes on as it came, since parsing it would hold every other flow
(JSON parsing holds the interpreter's lock, even in a worker thread)."""


def _route(kind: wire.Kind, method: str, path: str) -> str | None:
    """Which model route a request is, by the path its backend serves it on."""
    path = path.split("?", 1)[0].rstrip("/")
    if method == "GET" and (path == "/v1/models" or path.startswith("/v1/models/") or (kind == wire.Kind.LLAMACPP and path == "/models")):
        return "models"
    if method == "POST" and path == "/api/show":
        return "show"
    if method == "GET" and path == "/props" and kind == wire.Kind.LLAMACPP:
        return "props"
    return None


def _names(route: str, request: Any, answer: dict[str, Any]) -> list[str]:
    """The models an answer is about: those a list names, the one `/api/show` was asked of; `/props`
    is about the one window llama-server serves whatever the model."""
    if route == "models":
        return openai.model_ids(answer)
    return [ollama.shown_model(request)] if route == "show" else [""]


def _rewrite(route: str, answer: dict[str, Any], names: list[str], windows: dict[str, int]) -> dict[str, Any] | None:
    """The answer with the served window; None when no window is known for what it names."""
    if route == "models":
        known = {m: windows[m] for m in names if m in windows}
        return openai.models_with_windows(answer, known) if known else None
    window = windows.get(names[0])
    if window is None:
        return None
    return ollama.show_with_window(answer, window) if route == "show" else llamacpp.props_with_window(answer, window)


class ModelRoutes:
    """Puts the served window into the answers of the model routes."""

    def __init__(self, backends: Backends, fitter: Fitter) -> None:
        self.backends = backends
        self.fitter = fitter

    async def request(self, flow: http.HTTPFlow) -> None:
        """An answer read here must come uncompressed (they are small; a compressed one would be
        inflated on the event loop)."""
        if flow.response is None and await self._routed(flow) is not None:
            flow.request.headers.pop("accept-encoding", None)

    async def response(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        routed = await self._routed(flow)
        if routed is None or response is None or response.status_code != 200 or response.stream:
            return
        backend, route = routed
        try:
            raw = response.raw_content or b""
            if response.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity"):
                raise ValueError(f"the answer is {response.headers['content-encoding']}-encoded")
            if len(raw) > min(MAX_READ_BYTES, self.backends.settings.max_body_bytes):
                raise ValueError(f"the answer ({len(raw):,} bytes) is over the {MAX_READ_BYTES >> 20} MB a model route's answer is read to")
            answer = await off_loop(len(raw) > OFFLOAD_BYTES, functools.partial(json.loads, raw))
            if not isinstance(answer, dict):
                raise ValueError("the answer is not a JSON object")
            request = json.loads(flow.request.content or b"{}") if route == "show" else None
            names = _names(route, request, answer)
            rewritten = _rewrite(route, answer, names, await self._windows(backend, names))
            if rewritten is None:
                return  # no window known without loading the model: as the backend answered
            response.content = await off_loop(len(raw) > OFFLOAD_BYTES, functools.partial(_dumps, rewritten))
            note = rewritten.get("contextpaw")  # one model's (a list's are on each model)
            if isinstance(note, dict):
                response.headers[served.WINDOW_HEADER] = served.header(note["window"], note.get("reported"))
        except Exception as e:  # fail open: the client gets the backend's answer as it was
            logger.warning("%s %s: passed on without the served window: %s", flow.request.method, flow.request.path, e)
            reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            response.headers["X-ContextPaw-Error"] = f"passed on without the served window: {reason}"

    async def _routed(self, flow: http.HTTPFlow) -> tuple[wire.Backend, str] | None:
        """The flow's backend and which model route it is, or None for any other flow."""
        backend = await self.backends.backend_of(flow)
        route = backend and _route(backend.kind, flow.request.method, flow.request.path)
        return (backend, route) if backend and route else None

    async def _windows(self, backend: wire.Backend, names: list[str]) -> dict[str, int]:
        """The served window of each model, where it is known without loading one: the window of
        requests without their own (`contextpaw_default_ctx` when discovery is off)."""
        settings = self.fitter.settings
        if not settings.discover_window:
            return dict.fromkeys(names, settings.default_ctx)
        found = await asyncio.gather(*(self.fitter.windows.listed(backend, name) for name in names))
        return {name: window for name, window in zip(names, found, strict=True) if window}


def _dumps(body: dict[str, Any]) -> bytes:
    """JSON as the backends write it: UTF-8, not ASCII escapes, no spaces."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
