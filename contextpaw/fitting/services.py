"""What the fitting asks of the world, and how it waits for it: the services the shell hands in
(fetches, llama-server's counts, tokenizers, the summarizer), one task per key while it runs, and
big bodies off the event loop. Protocols and asyncio only: the calls themselves are
`contextpaw.calls`."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from contextpaw.core.map_reduce import Evicted
from contextpaw.core.tokens import Counter

OFFLOAD_BYTES = 256 * 1024
OFFLOAD_MESSAGES = 500
"""Bodies above this size, or with more messages than this, are parsed and compacted in a worker
thread, so other flows keep moving."""


BIG_WORK = ThreadPoolExecutor(max_workers=1, thread_name_prefix="contextpaw-big-body")
"""The one thread that parses, fits and writes big bodies. Pure-Python work holds the interpreter's
lock in any thread; the event loop asks for it back after each switch interval (5 ms), and gets it
next only when one other thread holds it. With asyncio's default pool, a burst of 64 multi-megabyte
requests kept six threads asking, and a small request waited its turn behind all of them."""


def is_big(raw: bytes) -> bool:
    return len(raw) > OFFLOAD_BYTES or raw.count(b'"role"') > OFFLOAD_MESSAGES


async def off_loop[T](big: bool, fn: Callable[[], T]) -> T:
    """`fn()`, in the big-body thread when `big` (one at a time: the lock allows no more anyway)."""
    return await asyncio.get_running_loop().run_in_executor(BIG_WORK, fn) if big else fn()


class InFlight:
    """One task per key while it runs: whoever asks meanwhile shares it, so concurrent first
    requests cost one lookup. `ended(key, task)` is told when a task ends, before it is forgotten."""

    def __init__(self, ended: Callable[[Any, asyncio.Task[Any]], None] | None = None) -> None:
        self.ended = ended
        self._tasks: dict[Any, asyncio.Task[Any]] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, key: object) -> bool:
        return key in self._tasks

    def task(self, key: Any, start: Callable[[], Awaitable[Any]]) -> asyncio.Task[Any]:
        """The task under way for `key`, started now if there is none."""
        task = self._tasks.get(key)
        if task is None:
            task = self._tasks[key] = asyncio.ensure_future(start())
            task.add_done_callback(functools.partial(self._end, key))
        return task

    async def shared(self, key: Any, start: Callable[[], Awaitable[Any]]) -> Any:
        """The task's result; a caller that goes away leaves the task to the others."""
        return await asyncio.shield(self.task(key, start))

    def _end(self, key: Any, task: asyncio.Task[Any]) -> None:
        del self._tasks[key]
        if self.ended is not None:
            self.ended(key, task)


Fetch = Callable[[str, str, dict[str, Any] | None], Awaitable[Any]]
"""(method, url, JSON body or None) -> the parsed JSON answer, or None when the server did not answer."""


class BackendCounting(Protocol):
    """llama-server's own counts (`contextpaw.calls.server_counts.LlamaCppCounting`)."""

    async def counter(
        self, base_url: str, texts: Iterable[str], fallback: Counter, *, chat: bool, has_system: bool, big: bool = False, model: str = ""
    ) -> tuple[Counter, int] | None: ...

    async def total(self, base_url: str, body: Mapping[str, Any], path: str = ..., big: bool = False) -> int | None: ...

    async def prompt_total(self, base_url: str, prompt: str, big: bool = False, model: str = "") -> int | None: ...

    def stats(self) -> dict[str, Any]: ...


class AskedCount(Protocol):
    """Ollama's answer: its count (None where it refused without one), and whether it served the prompt whole."""

    @property
    def tokens(self) -> int | None: ...

    @property
    def fits(self) -> bool: ...


class OllamaAsking(Protocol):
    """Ollama's own count of a chat, asked on its native route (`contextpaw.calls.server_counts.OllamaCounting`)."""

    async def count(self, base_url: str, body: Mapping[str, Any], big: bool = False) -> AskedCount | None: ...

    def stats(self) -> dict[str, Any]: ...


class Services(Protocol):
    """What the fitter asks of the world; every call is best-effort (None: do without)."""

    @property
    def fetch(self) -> Fetch:
        """A JSON answer from a backend, or None."""
        ...

    @property
    def counting(self) -> BackendCounting: ...

    @property
    def asking(self) -> OllamaAsking: ...

    async def tokenizer(self, path: str) -> Counter | None:
        """A counter from a tokenizer or GGUF file (loaded once, off the event loop)."""
        ...

    def completions(self, url: str, model: str, timeout: float, authorization: str | None) -> Complete:
        """The call that writes a digest with this model."""
        ...


Complete = Callable[[str, int], Awaitable[str]]
"""One summarizer call: prompt text and the most tokens to generate -> the model's answer."""


@dataclass(frozen=True, slots=True)
class SummaryModel:
    """The model that writes digests, as the caller routes to it and discovered it."""

    complete: Complete
    name: str
    """What `complete` calls (backend and model), so digests from different models do not mix."""
    window: int
    """Its context window as discovered (llama-server /props n_ctx, Ollama's loaded num_ctx)."""
    counter: Counter
    """Counts tokens as it does, or over-counts: log text can be 1.5 bytes a token, not 3-4."""
    chunk_tokens: int | None = None
    """The most text one call should read, when less than the window: a small model loses detail
    past a few hundred tokens."""


@dataclass(frozen=True, slots=True)
class DigestResult:
    text: str | None
    """The digest, within the cap, unlabelled (the hole's marker says it is a summary); None when
    there is none."""
    summarized: bool
    reason: str | None
    """Why there is no digest (None when there is one)."""
    calls: int
    """Summarizer calls this digest started."""
    cache_hits: int
    """Calls answered from the cache or shared with a concurrent digest."""
    seconds: float


class Digester(Protocol):
    """Makes a digest of evicted content (`contextpaw.calls.summarizer.Summarizer`)."""

    async def digest(self, evicted: Evicted, *, model: SummaryModel, cap_tokens: int) -> DigestResult: ...

    def stats(self) -> dict[str, Any]: ...
