"""The budget: how many prompt tokens a request may send.

budget = window - output reserve - template margin. The window is what the request asks for
(Ollama's `num_ctx`), else what the backend reports, else the configured default; the reserve is the
answer length the request asks for, else a default, never more than half the window so that a huge
`max_tokens` cannot leave the prompt nothing. Window discovery is a `WindowSource`; `BackendWindows`
asks the backend (`/props`, `/api/ps`, `/api/show`) through a fetch function the shell hands in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from contextpaw.compact import BudgetTooSmall
from contextpaw.wire import Backend, Kind, Overflow, Params, UpstreamOverflow


@dataclass(frozen=True, slots=True)
class Budget:
    window: int
    reserve: int
    margin: int

    @property
    def tokens(self) -> int:
        return max(self.window - self.reserve - self.margin, 0)

    def refusal(self, required: int) -> Overflow:
        """Policy strict: the request would have to be compacted."""
        cause = f"the request needs {required} tokens but only {self.tokens} fit, and policy strict refuses to compact it"
        return Overflow(required, self.tokens, self.window, cause)

    def impossible(self, error: BudgetTooSmall) -> Overflow:
        """What must be kept does not fit, so no compaction can help."""
        return Overflow(error.required, self.tokens, self.window, str(error))


class WindowSource(Protocol):
    """Where a backend's window comes from when the request does not name one."""

    async def window(self, backend: Backend, model: str) -> int | None: ...


class NoDiscovery:
    """The backend is not asked, so the configured default applies (tests, and unknown servers)."""

    async def window(self, backend: Backend, model: str) -> int | None:
        return None


Fetch = Callable[[str, str, dict[str, Any] | None], Awaitable[Any]]
"""(method, url, JSON body or None) -> the parsed JSON answer, or None when the server did not answer."""


class BackendWindows:
    """Asks the backend what window a model really runs with, and remembers it for a while.

    llama-server: `/props` `default_generation_settings.n_ctx`, the per-slot window. Ollama: the
    loaded model's `context_length` from `/api/ps` (what it actually loaded, which `/v1` requests
    cannot change), else the Modelfile's `num_ctx` from `/api/show`, capped by the model's trained
    length. Answers are kept `ttl` seconds, so a model reloaded with another window is noticed.
    """

    def __init__(self, fetch: Fetch, ttl: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.fetch = fetch
        self.ttl = ttl
        self.clock = clock
        self.known: dict[tuple[str, str], tuple[float, int | None]] = {}

    async def window(self, backend: Backend, model: str) -> int | None:
        key = (backend.url, model)
        cached = self.known.get(key)
        if cached is not None and self.clock() - cached[0] < self.ttl:
            return cached[1]
        if backend.kind == Kind.LLAMACPP:
            found = llamacpp_window(await self.fetch("GET", backend.url + "/props", None))
        else:
            found = ollama_loaded_window(await self.fetch("GET", backend.url + "/api/ps", None), model)
            if found is None and model:
                found = ollama_configured_window(await self.fetch("POST", backend.url + "/api/show", {"model": model}))
        self.known[key] = (self.clock(), found)
        return found


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def llamacpp_window(props: Any) -> int | None:
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    return _positive(settings.get("n_ctx")) if isinstance(settings, dict) else None


def _same_model(listed: str, asked: str) -> bool:
    """Ollama resolves a bare name to `:latest`."""
    def full(name: str) -> str:
        return name if ":" in name else f"{name}:latest"

    return full(listed) == full(asked)


def ollama_loaded_window(ps: Any, model: str) -> int | None:
    models = ps.get("models") if isinstance(ps, dict) else None
    for entry in models if isinstance(models, list) else []:
        if isinstance(entry, dict) and _same_model(str(entry.get("name") or entry.get("model") or ""), model):
            return _positive(entry.get("context_length"))
    return None


def ollama_configured_window(show: Any) -> int | None:
    """The Modelfile `num_ctx` (its `parameters` lines are `name  value`), capped by the trained length."""
    if not isinstance(show, dict):
        return None
    configured = None
    for line in str(show.get("parameters") or "").splitlines():
        name, _, value = line.strip().partition(" ")
        if name == "num_ctx" and value.strip().isdigit():
            configured = int(value.strip())
    info = show.get("model_info") if isinstance(show.get("model_info"), dict) else {}
    arch = info.get("general.architecture")
    trained = _positive(info.get(f"{arch}.context_length"))
    if configured is None:
        return None
    return min(configured, trained) if trained else configured


class Budgeter:
    def __init__(self, *, default_ctx: int, reserve: int, margin: int, source: WindowSource | None = None) -> None:
        self.default_ctx = default_ctx
        self.reserve = reserve
        self.margin = margin
        self.source: WindowSource = source or NoDiscovery()

    async def budget(self, backend: Backend, params: Params) -> Budget:
        window = params.num_ctx or await self.source.window(backend, params.model) or self.default_ctx
        return self.for_window(window, params)

    def for_window(self, window: int, params: Params) -> Budget:
        reserve = min(params.max_output or self.reserve, window // 2)
        return Budget(window, reserve, self.margin)

    def after_upstream_overflow(self, error: UpstreamOverflow, counted: int, params: Params) -> Budget:
        """The budget for a retry after the backend refused: its window, in our counter's units.

        The backend just counted this very prompt; when that is more than we counted, our counter
        undercounts this text, so the budget shrinks by the same ratio and the retry fits.
        """
        budget = self.for_window(error.n_ctx, params)
        if error.n_prompt_tokens <= counted:
            return budget
        scaled = math.floor(budget.tokens * counted / error.n_prompt_tokens)
        return Budget(budget.window, budget.reserve, budget.window - budget.reserve - scaled)
