"""The window a backend serves a model at, discovered when the request does not name one.

The window is what the request asks for (Ollama's `num_ctx`), capped where the server caps it (the
model's trained length from `/api/show`), else what the backend reports, else the configured
default (`contextpaw.fitting.budget.Budgeter` decides which). Discovery is a `WindowSource`;
`BackendWindows` asks the backend (`/props`, `/api/ps`, `/api/show`) through a fetch function the
shell hands in.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

from contextpaw.core.caches import SizedLRU
from contextpaw.fitting.services import Fetch, InFlight
from contextpaw.wire import Backend, Kind, positive
from contextpaw.wire.ollama import ollama_model_file, ollama_show_windows


class WindowSource(Protocol):
    """Where a backend's window comes from when the request does not name one, and the cap the
    server puts on a window the request names."""

    async def window(self, backend: Backend, model: str) -> int | None: ...

    async def trained(self, backend: Backend, model: str) -> int | None: ...


class NoDiscovery:
    """The backend is not asked, so the configured default applies (tests, and unknown servers)."""

    async def window(self, backend: Backend, model: str) -> int | None:
        return None

    async def trained(self, backend: Backend, model: str) -> int | None:
        return None


@dataclass(frozen=True, slots=True)
class OllamaShow:
    """What `/api/show` says of a model that sizing and counting need (the answer itself can be
    hundreds of KB: template, license, tokenizer)."""

    num_ctx: int | None
    """The Modelfile's `PARAMETER num_ctx`."""
    trained: int | None
    """`<arch>.context_length`: Ollama caps every window there, a request's `num_ctx` included."""
    model_file: str | None
    """What the Modelfile's FROM names (a GGUF blob path, or a model name)."""

    @classmethod
    def read(cls, show: Any) -> OllamaShow:
        configured, trained = ollama_show_windows(show)
        return cls(configured, trained, ollama_model_file(show))


WINDOW_TTL_S = 5.0
"""How long a window found is trusted: a backend restarted with another `-c` or `num_ctx` is seen
within this long (the lookup is one small loopback call; at 30 s a window grown from 1,024 to
8,192 was cut to the old one for five more turns)."""
MISS_TTL_S = 30.0
"""How long a backend that gave no window is not asked again: one timeout, not one per request."""

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
    `n_ctx` a server named in a 400; `forget` drops what was learned of a backend that refused or
    reset a connection, which is how a restart shows.
    """

    def __init__(
        self,
        fetch: Fetch,
        ttl: float = WINDOW_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        ollama_default: int | None = None,
        miss_ttl: float = MISS_TTL_S,
    ) -> None:
        self.fetch = fetch
        self.ttl = ttl
        self.miss_ttl = miss_ttl
        self.clock = clock
        self.ollama_default = ollama_default
        self.known = SizedLRU(MAX_MODELS, MAX_NAME_BYTES, lambda key, _: len(key[1].url) + len(key[2]) + 64)
        """(what, backend, model) -> (when, the answer or None); bounded, since model names are
        the client's. `what` is "window" (for requests without a window of their own) or "show"
        (Ollama's `/api/show`, read into an `OllamaShow`)."""
        self._asking = InFlight(self._found)
        """Lookups under way: concurrent first requests for a model share one."""

    async def window(self, backend: Backend, model: str) -> int | None:
        lookup = self._llamacpp if backend.kind == Kind.LLAMACPP else self._ollama
        return await self._once(("window", backend, model), functools.partial(lookup, backend, model))

    async def show(self, backend: Backend, model: str) -> OllamaShow | None:
        """Ollama's `/api/show` for `model`, read once per `ttl`."""
        if not model or backend.kind != Kind.OLLAMA:
            return None

        async def ask() -> OllamaShow | None:
            answer = await self.fetch("POST", backend.url + "/api/show", {"model": model})
            return OllamaShow.read(answer) if answer is not None else None

        return await self._once(("show", backend, model), ask)

    async def trained(self, backend: Backend, model: str) -> int | None:
        show = await self.show(backend, model)
        return show.trained if show is not None else None

    async def _once(self, key: tuple[str, Backend, str], lookup: Callable[[], Awaitable[Any]]) -> Any:
        """The cached answer, or one lookup shared by everyone who asks meanwhile."""
        known, value = self._cached(key)
        if known:
            return value
        return await self._asking.shared(key, lookup)

    def cached(self, backend: Backend, model: str) -> tuple[bool, int | None]:
        """(whether it is known now, the window or None for a miss), without asking anything."""
        return self._cached(("window", backend, model))

    def _cached(self, key: tuple[str, Backend, str]) -> tuple[bool, Any]:
        cached = self.known.get(key)
        if cached is None or self.clock() - cached[0] >= (self.ttl if cached[1] is not None else self.miss_ttl):
            return False, None
        return True, cached[1]

    def _found(self, key: tuple[str, Backend, str], task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is None:
            self.known.put(key, (self.clock(), task.result()))

    def learn(self, backend: Backend, model: str, window: int) -> None:
        """A window the server itself named for requests without `num_ctx` (the `n_ctx` of its 400)."""
        self.known.put(("window", backend, model), (self.clock(), window))

    def forget(self, restarted: Callable[[Backend], bool]) -> None:
        """Ask again of every backend `restarted` names: one that refused or reset a connection may
        be back with another window (`-c`, `num_ctx`) or another model, and what it gave no answer
        to before may be answered now."""
        for key in [key for key in self.known if restarted(key[1])]:
            self.known.discard(key)

    async def _llamacpp(self, backend: Backend, model: str) -> int | None:
        """`/props`'s window; in router mode (one llama-server, many models), the named model's:
        its own `/props` while it is loaded (asked with `autoload=false`, so nothing is loaded to
        answer), else the `--ctx-size` the router would start it with (`/models`)."""
        props = await self.fetch("GET", backend.url + "/props", None)
        if not is_router(props):
            return llamacpp_window(props)
        if not model:
            return None
        loaded = await self.fetch("GET", f"{backend.url}/props?model={quote(model, safe='')}&autoload=false", None)
        return llamacpp_window(loaded) or router_model_window(await self.fetch("GET", backend.url + "/models", None), model)

    async def _ollama(self, backend: Backend, model: str) -> int | None:
        if not model:
            return None
        if (configured := self._configured(await self.show(backend, model))) is not None:
            return configured
        if await self.fetch("POST", backend.url + "/api/generate", {"model": model}) is None:
            return None
        return ollama_loaded_window(await self.fetch("GET", backend.url + "/api/ps", None), model)

    def _configured(self, show: OllamaShow | None) -> int | None:
        """The window Ollama gives a request without `num_ctx` where it is configured: the
        Modelfile's `num_ctx`, else the server's default as the operator states it; capped by the
        trained length."""
        configured = (show.num_ctx if show else None) or self.ollama_default
        trained = show.trained if show else None
        if configured is None:
            return None
        return min(configured, trained) if trained else configured

    async def listed(self, backend: Backend, model: str) -> int | None:
        """The window a request for `model` without one of its own gets, where that is known without
        loading the model (what the model routes report): llama-server's `/props`; on Ollama the
        configured window, else the one the last such request found, however long ago (a model route
        is asked when a client starts, often seconds after its last request; a backend that was
        restarted since is forgotten). None when only a load would tell: a model list or `/api/show`
        loads nothing."""
        if backend.kind == Kind.LLAMACPP:
            return await self.window(backend, model)
        if not model:
            return None
        found = self.known.get(("window", backend, model))
        return self._configured(await self.show(backend, model)) or (found[1] if found else None)


def llamacpp_window(props: Any) -> int | None:
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    return positive(settings.get("n_ctx")) if isinstance(settings, dict) else None


def is_router(props: Any) -> bool:
    """Whether `/props` is a router's: llama-server started with `--models-dir` or
    `--models-preset`, serving many models, each in a child server with its own window."""
    return isinstance(props, dict) and props.get("role") == "router"


def router_model(listing: Any, model: str) -> dict[str, Any] | None:
    """The router's `/models` entry for `model` (its id or one of its aliases)."""
    entries = listing.get("data") if isinstance(listing, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and (entry.get("id") == model or model in (entry.get("aliases") or [])):
            return entry
    return None


def router_model_window(listing: Any, model: str) -> int | None:
    """The window a router gives `model` when it loads it, from the command line it lists for it
    (`status.args`): `--ctx-size` (`-c`), divided among `--parallel` (`-np`) slots unless the
    command says `--kv-unified` (a count the router chose itself shares one pool: measured on the
    pinned build, `ctx-size = 1024` alone gave 4 slots of 1,024, with `parallel = 2` 2 of 2,048 of
    4,096). None where the command names no size (the model's own length then)."""
    entry = router_model(listing, model)
    status = entry.get("status") if entry else None
    args = status.get("args") if isinstance(status, dict) else None
    if not isinstance(args, list):
        return None
    args = [str(a) for a in args]

    def value(*names: str) -> int | None:
        for i, arg in enumerate(args[:-1]):
            if arg in names and args[i + 1].isdigit():
                return int(args[i + 1])
        return None

    size, slots = value("--ctx-size", "-c"), value("--parallel", "-np")
    if not size:
        return None
    unified = any(a in ("--kv-unified", "-kvu") for a in args)
    return positive(size // slots if slots and slots > 1 and not unified else size)


def _same_model(listed: str, asked: str) -> bool:
    """Ollama resolves a bare name to `:latest`."""

    def full(name: str) -> str:
        return name if ":" in name else f"{name}:latest"

    return full(listed) == full(asked)


def ollama_loaded_window(ps: Any, model: str) -> int | None:
    models = ps.get("models") if isinstance(ps, dict) else None
    for entry in models if isinstance(models, list) else []:
        if isinstance(entry, dict) and _same_model(str(entry.get("name") or entry.get("model") or ""), model):
            return positive(entry.get("context_length"))
    return None
