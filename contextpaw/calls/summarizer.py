"""Summarize what compaction evicts, so the model gets the content of a hole back and not only a note.

A marker alone does not stop a model inventing what was in the hole (the seed measured 0/3 facts
with the marker, 3/3 with a digest). So the whole evicted span is summarized, never trimmed to its
head and tail: the facts are usually in the middle. The span is cut into chunks that fit the
summarizer's own window (map), and the partial digests are merged (reduce, recursively when they do
not fit one call).

In an agent loop the same old turns are evicted every turn, and sticky eviction keeps most of the
span the same as last turn. Chunk boundaries are therefore chosen by content, so an insertion only
disturbs the chunk it lands in, and every call is cached by content hash (bounded, persisted):
unchanged chunks are hits, only new ones cost a call, then one reduce. Concurrent requests that need
the same call share it.

Best-effort: a summarizer that is down, slow or silent gives `summarized=False` and the reason, never
an exception and never a partial digest passed off as whole.

The pure parts (`render_span`, `plan_chunks`, `plan_batches`, the prompts, `call_key`, `shorten`)
are in `contextpaw.core.map_reduce`; here are `Summarizer`, which does the calls, and `ChatCompletions`,
the default call.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import aiohttp

from contextpaw.core import logs
from contextpaw.core.caches import LRU
from contextpaw.core.map_reduce import (
    CUT_NOTE,
    MIN_CHUNK_TOKENS,
    MIN_DIGEST_TOKENS,
    Evicted,
    Sizes,
    call_key,
    join_partials,
    map_prompt,
    plan_batches,
    plan_chunks,
    reduce_prompt,
    render_span,
    shorten,
)
from contextpaw.fitting.services import Complete, DigestResult, InFlight, SummaryModel
from contextpaw.ops.evicted import EvictedStore

logger = logs.get(__name__)


class SummaryFailed(Exception):
    """A summarizer call gave no usable answer; the message is the reason reported."""


@dataclass(slots=True)
class _Tally:
    calls: int = 0
    hits: int = 0


class Summarizer:
    """Makes digests: map-reduce over the whole span, with a shared, bounded, persisted call cache.

    One instance serves every backend and model (the model's name is part of each cache key); the
    caller says on each `digest` which `SummaryModel` to use.
    """

    def __init__(
        self,
        *,
        timeout: float = 30.0,
        retry_after: float = 30.0,
        kept: EvictedStore | None = None,
        max_entries: int = 2048,
        parallel: int = 1,
    ) -> None:
        """`parallel`: calls in flight at once (the summarizer's slots); `timeout` is per call, not
        counting the wait for a slot, since a queued call is not a slow one. `kept`: the archive,
        whose `digests` table (SQLite) holds the cache across restarts: read here, written by its
        writer thread as answers come; a store that keeps none leaves the cache in memory."""
        self.timeout = timeout
        self.retry_after = retry_after
        self.kept = kept
        self.max_entries = max_entries
        self._slots = asyncio.Semaphore(parallel)
        self._cache = LRU(max_entries)
        """call key -> answer"""
        self._inflight = InFlight()
        self._failed: dict[str, tuple[float, str]] = {}
        """model -> when its last call failed, and why."""
        self._stats = {"digests": 0, "calls": 0, "cache_hits": 0, "failures": 0, "seconds": 0.0}
        if kept is not None:
            for key, answer in kept.get_digests(max_entries):
                self._cache.put(key, answer)

    async def digest(self, evicted: Evicted, *, model: SummaryModel, cap_tokens: int) -> DigestResult:
        """A digest of all of `evicted` within `cap_tokens` (by `model.counter`), or
        `summarized=False` and why."""
        started = time.monotonic()
        tally = _Tally()
        try:
            text = await self._digest(evicted, model, cap_tokens, tally)
            reason = None
        except SummaryFailed as failure:
            text, reason = None, str(failure)
            self._stats["failures"] += 1
        seconds = time.monotonic() - started
        self._stats["digests"] += 1
        self._stats["seconds"] += seconds
        return DigestResult(text, text is not None, reason, tally.calls, tally.hits, seconds)

    def stats(self) -> dict[str, Any]:
        """Counters for health and metrics; `seconds` is time spent in digests, cache hits included."""
        return {**self._stats, "entries": len(self._cache), "in_flight": len(self._inflight)}

    async def _digest(self, evicted: Evicted, model: SummaryModel, cap_tokens: int, tally: _Tally) -> str:
        counter = model.counter
        if cap_tokens - counter.text(CUT_NOTE) < MIN_DIGEST_TOKENS:
            raise SummaryFailed(f"a cap of {cap_tokens} tokens is too small for a digest")
        pieces = render_span(evicted)
        if not "".join(pieces).strip():
            raise SummaryFailed("nothing to summarize")
        sizes = Sizes.for_window(model.window, cap_tokens, counter, model.chunk_tokens)
        if sizes.room < MIN_CHUNK_TOKENS:
            raise SummaryFailed(f"the summarizer's window of {model.window} tokens is too small")

        async def call(prompt: str, what: str) -> str:
            try:
                return await self._call(prompt, sizes.output, model, tally)
            except SummaryFailed as failure:
                raise SummaryFailed(f"{what}: {failure}") from None

        chunks = plan_chunks(pieces, sizes.room, counter)
        partials = await _all([call(map_prompt(c), f"chunk {n} of {len(chunks)}") for n, c in enumerate(chunks, 1)])
        while len(partials) > 1:
            if counter.text(join_partials(partials)) <= cap_tokens:
                partials = [join_partials(partials)]  # they fit as they are: a merge call could only lose facts
                break
            batches = plan_batches(partials, sizes.room, counter)
            if len(batches) == len(partials):
                raise SummaryFailed("the chunk summaries are too long to merge in this window")
            partials = await _all([call(reduce_prompt(b), "merging the chunk summaries") for b in batches])
        digest = shorten(partials[0].strip(), cap_tokens, counter)
        if digest is None:
            raise SummaryFailed(f"the digest does not fit a cap of {cap_tokens} tokens")
        return digest

    async def _call(self, prompt: str, max_tokens: int, model: SummaryModel, tally: _Tally) -> str:
        """One cached call; a concurrent digest needing the same call awaits the one in flight."""
        key = call_key(model.name, prompt, max_tokens)
        cached = self._cache.get(key)
        if cached is not None:
            tally.hits += 1
            self._stats["cache_hits"] += 1
            self._keep(key, cached)  # the newest on disk too: the bound drops what is used least lately
            return cached
        if key in self._inflight:
            tally.hits += 1
            self._stats["cache_hits"] += 1
        else:
            tally.calls += 1
        return await self._inflight.shared(key, functools.partial(self._run, key, prompt, max_tokens, model))

    async def _run(self, key: str, prompt: str, max_tokens: int, model: SummaryModel) -> str:
        async with self._slots:
            self._refuse_while_failing(model.name)
            self._stats["calls"] += 1
            try:
                answer = await self._ask(model.complete, prompt, max_tokens)
            except SummaryFailed as failure:
                self._failed[model.name] = (time.monotonic(), str(failure))
                raise
        self._failed.pop(model.name, None)
        self._cache.put(key, answer)
        self._keep(key, answer)
        return answer

    def _keep(self, key: str, answer: str) -> None:
        if self.kept is not None:
            self.kept.put_digest(key, answer, self.max_entries)

    async def _ask(self, complete: Complete, prompt: str, max_tokens: int) -> str:
        """One call within the timeout; every way it can go wrong becomes a `SummaryFailed`."""
        try:
            async with asyncio.timeout(self.timeout):
                answer = await complete(prompt, max_tokens)
        except SummaryFailed:
            raise
        except TimeoutError:
            raise SummaryFailed(f"no answer within {self.timeout:g}s") from None
        except Exception as error:  # best-effort: whatever the backend does, the request goes on
            raise SummaryFailed(f"{type(error).__name__}: {error}".rstrip(": ")) from None
        if not isinstance(answer, str) or not answer.strip():
            raise SummaryFailed("the summarizer answered nothing")
        return answer

    def _refuse_while_failing(self, model: str) -> None:
        """Fail fast for `retry_after` seconds after a failure: otherwise every call queued behind it,
        and every later turn, would wait out the timeout again on a summarizer that is down."""
        if model not in self._failed:
            return
        at, reason = self._failed[model]
        ago = time.monotonic() - at
        if ago < self.retry_after:
            raise SummaryFailed(f"not tried: it failed {ago:.0f}s ago ({reason}); next try after {self.retry_after:g}s")


async def _all(calls: Sequence[Awaitable[str]]) -> list[str]:
    """Run every call to the end (successes are cached for next time), then fail on the first failure."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return cast(list[str], results)


class ChatCompletions:
    """The default `complete`: one non-streaming OpenAI-compatible chat call, which Ollama and
    llama-server both serve at `/v1/chat/completions`, at temperature 0 so digests are repeatable.

    `headers` carries what the backend needs (the client's Authorization, say): a summarizer that
    gets 401 on every call would silently never summarize. `session` gives the proxy's one HTTP
    session; without it (scripts) the call makes one of its own.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
        session: Callable[[], aiohttp.ClientSession] | None = None,
    ) -> None:
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.headers = dict(headers or {})
        self._shared = session
        self._own: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self._shared is not None:
            return self._shared()
        if self._own is None or self._own.closed:
            # trust_env=False: a loopback backend must not be sent through the user's HTTP proxy.
            self._own = aiohttp.ClientSession(trust_env=False)
        return self._own

    async def __call__(self, prompt: str, max_tokens: int) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": False,
        }
        async with self._session().post(self.url, json=body, headers=self.headers, timeout=self.timeout) as response:
            if response.status != 200:
                raise SummaryFailed(f"HTTP {response.status} from {self.url}: {(await response.text())[:200]}")
            reply = await response.json(content_type=None)
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise SummaryFailed(f"no choices[0].message.content in the answer from {self.url}") from None
        return content if isinstance(content, str) else ""

    async def close(self) -> None:
        """Close the session this call made for itself (a shared one is its owner's to close)."""
        if self._own is not None:
            await self._own.close()
