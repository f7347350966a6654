"""The budget: how many prompt tokens a request may send.

budget = window - output reserve - template margin. The window is what the request asks for
(Ollama's `num_ctx`), else what the backend reports, else the configured default; the reserve is the
answer length the request asks for, else a default, never more than half the window so that a huge
`max_tokens` cannot leave the prompt nothing. Window discovery is a `WindowSource`; `BackendWindows`
asks the backend (`/props`, `/api/ps`, `/api/show`) through a fetch function the shell hands in.
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from contextpaw.compact import BudgetTooSmall
from contextpaw.state import SizedLRU
from contextpaw.wire import Backend, Kind, Overflow, Params, UpstreamOverflow


@dataclass(frozen=True, slots=True)
class Budget:
    window: int
    reserve: int
    margin: int

    @property
    def tokens(self) -> int:
        return max(self.window - self.reserve - self.margin, 0)

    def within(self, ratio: float) -> Budget:
        """The budget a count that may be `ratio` times too low still fits in."""
        if ratio <= 1:
            return self
        return Budget(self.window, self.reserve, self.margin + self.tokens - math.floor(self.tokens / ratio))

    def at_most(self, tokens: int) -> Budget:
        """This budget cut to `tokens` (never raised above what it is)."""
        return Budget(self.window, self.reserve, self.margin + max(self.tokens - tokens, 0))

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


MAX_MODELS = 1024
MAX_NAME_BYTES = 1 << 20
"""Windows remembered at most (by backend and model name), and the bytes their names may hold."""


class BackendWindows:
    """Asks the backend what window a model really runs with, and remembers what it learned.

    llama-server: `/props` `default_generation_settings.n_ctx`, the per-slot window. Ollama: the
    window a request without `num_ctx` gets, which is all `/v1` requests can be: the Modelfile's
    `num_ctx`, else the server's default (`OLLAMA_CONTEXT_LENGTH` as the operator states it), capped
    by the trained length, else what `/api/ps` lists once the model is loaded the way such a request
    loads it (an empty `/api/generate` without options, which a loaded runner of the same window
    answers at once, and which the request itself would have paid for). A runner listed in
    `/api/ps` alone proves nothing: one loaded with an explicit `num_ctx` is reloaded by the next
    request without one. What was found is kept `ttl` seconds; that nothing was found is kept as such
    (`miss_ttl` seconds), so a server that does not answer costs one timeout, not one per request.
    The default that stands in meanwhile is never stored as the window. `learn` records the
    `n_ctx` a server named in a 400.
    """

    def __init__(
        self,
        fetch: Fetch,
        ttl: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        ollama_default: int | None = None,
        miss_ttl: float = 30.0,
    ) -> None:
        self.fetch = fetch
        self.ttl = ttl
        self.miss_ttl = miss_ttl
        self.clock = clock
        self.ollama_default = ollama_default
        self.known = SizedLRU(MAX_MODELS, MAX_NAME_BYTES, lambda key, _: len(key[0]) + len(key[1]) + 64)
        """(backend URL, model) -> (when, the window or None); bounded, since model names are the client's."""
        self._asking: dict[tuple[str, str], asyncio.Task[int | None]] = {}
        """Lookups under way: concurrent first requests for a model share one."""

    async def window(self, backend: Backend, model: str) -> int | None:
        key = (backend.url, model)
        cached = self.known.get(key)
        if cached is not None and self.clock() - cached[0] < (self.ttl if cached[1] is not None else self.miss_ttl):
            return cached[1]
        task = self._asking.get(key)
        if task is None:
            lookup = self._llamacpp(backend) if backend.kind == Kind.LLAMACPP else self._ollama(backend, model)
            task = self._asking[key] = asyncio.ensure_future(lookup)
            task.add_done_callback(functools.partial(self._found, key))
        return await asyncio.shield(task)  # a request that goes away leaves the lookup to the others

    def cached(self, backend: Backend, model: str) -> tuple[bool, int | None]:
        """(whether it is known now, the window or None for a miss), without asking anything."""
        cached = self.known.get((backend.url, model))
        if cached is None or self.clock() - cached[0] >= (self.ttl if cached[1] is not None else self.miss_ttl):
            return False, None
        return True, cached[1]

    def _found(self, key: tuple[str, str], task: asyncio.Task[int | None]) -> None:
        del self._asking[key]
        if not task.cancelled() and task.exception() is None:
            self.known.put(key, (self.clock(), task.result()))

    def learn(self, backend: Backend, model: str, window: int) -> None:
        """A window the server itself named for requests without `num_ctx` (the `n_ctx` of its 400)."""
        self.known.put((backend.url, model), (self.clock(), window))

    async def _llamacpp(self, backend: Backend) -> int | None:
        return llamacpp_window(await self.fetch("GET", backend.url + "/props", None))

    async def _ollama(self, backend: Backend, model: str) -> int | None:
        if not model:
            return None
        configured, trained = ollama_show_windows(await self.fetch("POST", backend.url + "/api/show", {"model": model}))
        if configured is None and self.ollama_default:
            configured = self.ollama_default
        if configured is not None:
            return min(configured, trained) if trained else configured
        if await self.fetch("POST", backend.url + "/api/generate", {"model": model}) is None:
            return None
        return ollama_loaded_window(await self.fetch("GET", backend.url + "/api/ps", None), model)


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


FROM_LINE = re.compile(r"^FROM\s+(\S+)", re.MULTILINE)


def ollama_model_file(show: Any) -> str | None:
    """From `/api/show`: the file its Modelfile's FROM names (a GGUF blob path, or a model name)."""
    found = FROM_LINE.search(str(show.get("modelfile", ""))) if isinstance(show, dict) else None
    return found.group(1) if found else None


def ollama_show_windows(show: Any) -> tuple[int | None, int | None]:
    """From `/api/show`: the Modelfile `num_ctx` (its `parameters` lines are `name  value`) and the
    trained length."""
    if not isinstance(show, dict):
        return None, None
    configured = None
    for line in str(show.get("parameters") or "").splitlines():
        name, _, value = line.strip().partition(" ")
        if name == "num_ctx" and value.strip().isdigit():
            configured = int(value.strip())
    info = show.get("model_info") if isinstance(show.get("model_info"), dict) else {}
    arch = info.get("general.architecture")
    return configured, _positive(info.get(f"{arch}.context_length"))


class Budgeter:
    def __init__(self, *, default_ctx: int, reserve: int, margin: int, source: WindowSource | None = None) -> None:
        self.default_ctx = default_ctx
        self.reserve = reserve
        self.margin = margin
        self.source: WindowSource = source or NoDiscovery()

    def floor(self, window: int) -> int:
        """The least budget any request gets in `window`, whatever answer length it asks for."""
        return Budget(window, window // 2, min(self.margin, window // 8)).tokens

    async def budget(self, backend: Backend, params: Params) -> Budget:
        window = params.num_ctx or await self.source.window(backend, params.model) or self.default_ctx
        return self.for_window(window, params)

    def for_window(self, window: int, params: Params) -> Budget:
        """The answer's reserve takes at most half the window, the margin at most an eighth: a tiny
        window (`num_ctx` 128 and below) still holds a short prompt."""
        reserve = min(params.max_output or self.reserve, window // 2)
        return Budget(window, reserve, min(self.margin, window // 8))

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
