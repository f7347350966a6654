"""Counts from the backend itself: llama-server's tokenizer and template, fetched without blocking.

The engine counts synchronously, so the shell asks the server first and hands the engine a
`BackendCounter` holding exact counts for every text in the request (cached by content, so an agent
loop pays only for its new messages). Two more numbers come from the server once per base URL: the
template's fixed cost (system default, generation prompt) and its cost per message. The whole
request's exact total comes from `/v1/chat/completions/input_tokens` (Anthropic's: `/v1/messages/count_tokens`),
used to check the result.
Ollama has no tokenize route: `OllamaCounting` asks its native chat, which refuses instead of
cutting (`truncate: false`) and otherwise counts what it evaluated.
Any failure returns None: the caller falls back to its tokenizer or calibrated counter. A server
whose counting failed is not asked again for `retry_after` seconds, so a hanging `/tokenize` costs one
timeout, not one per request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from contextpaw.core import logs
from contextpaw.core.caches import LRU
from contextpaw.core.tokens import Counter
from contextpaw.wire import bodies
from contextpaw.wire.bodies import JSON_TYPE
from contextpaw.wire.ollama import refused_count

logger = logs.get(__name__)

MIN_RATE_CHARS = 200
"""Texts shorter than this say more about the template than about the tokenizer's rate."""
RATE_SAFETY = 1.05
MISSING_REST_S = 3600.0
"""How long a server that lacks an endpoint (an older llama-server without input_tokens) is not asked."""
CALL_TIMEOUT_S = 3.0
"""llama-server counts on its HTTP threads, not its slots: even a busy one answers in milliseconds."""


ALL = "*"
"""The resting key for a whole server."""
OPENAI_COUNT = "/v1/chat/completions/input_tokens"
"""Where llama-server counts a whole OpenAI chat (Anthropic's requests are counted at their own route)."""


@dataclass(frozen=True, slots=True)
class TemplateCost:
    fixed: int
    """Tokens the template adds once (default system prompt, BOS, generation prompt)."""
    fixed_with_system: int
    """The same when the request brings its own system message (templates drop their default then)."""
    per_message: int


class BackendCounter(Counter):
    """Exact counts fetched from the server for every text of the request.

    A text it has not seen (a marker, the kept part of a shrunk message) is estimated at the densest
    tokens-per-byte rate among this request's own texts, which is how this tokenizer treats this
    kind of content, or by the fallback counter when there is nothing to learn from.
    """

    name = "backend"
    exact = True

    def __init__(self, known: Mapping[str, int], fallback: Counter, per_message: int) -> None:
        self.known = known
        self.fallback = fallback
        # +1: a message's text tokenized alone can merge one token fewer than inside the template
        self.message_overhead = per_message + 1
        rates = [n / len(t.encode("utf-8", "surrogatepass")) for t, n in known.items() if len(t) >= MIN_RATE_CHARS]
        self.rate = max(rates) * RATE_SAFETY if rates else None

    def text(self, text: str) -> int:
        known = self.known.get(text)
        if known is not None:
            return known
        if self.rate is None:
            return self.fallback.text(text)
        return math.ceil(len(text.encode("utf-8", "surrogatepass")) * self.rate)


FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError, ValueError)
"""Every way a counting call can go wrong: down, slow, or an answer of another shape."""


JSON_HEADERS = {"Content-Type": JSON_TYPE}
COUNTS_IN_FLIGHT = 2
"""`/tokenize` calls open at once. A first big request has hundreds of new texts: all at once (a
task and a connection each) they would fill the event loop's queue, and every other client's
request would wait behind them. And llama-server answers on a pool of `n_parallel + 2` HTTP
threads by default (3 with `-np 1`), each held by an open keep-alive connection: a ninth of Codex's
texts waited 5 s for a thread there, past the call's timeout, and the whole count fell back to the
estimate. Two leave a thread for the request itself."""


class LlamaCppCounting:
    """Asks a llama-server to count, with bounded caches, a per-call timeout and a back-off."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        timeout: float = CALL_TIMEOUT_S,
        cache_size: int = 8192,
        retry_after: float = 30.0,
    ) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.retry_after = retry_after
        self.texts: LRU = LRU(cache_size)
        self.totals: LRU = LRU(256)
        self.templates: dict[tuple[str, str], TemplateCost] = {}
        """(base URL, model) -> its template's cost: a router serves models of their own templates."""
        self.calls = 0
        self.failures = 0
        self.seconds = 0.0
        self._resting_until: dict[tuple[str, str], float] = {}
        """(base URL, what) -> when it may be asked again: per-text counting and whole totals rest
        apart (a server without input_tokens can still tokenize)."""

    def _resting(self, base_url: str, what: str) -> bool:
        now, until = time.monotonic(), self._resting_until
        return now < until.get((base_url, what), -math.inf) or now < until.get((base_url, ALL), -math.inf)

    def _failed(self, base_url: str, what: str, error: Exception) -> None:
        """Rest after a failure: `retry_after` seconds, or an hour for an endpoint the server lacks.
        A server that did not answer rests whole (its other endpoints would hang the same way): one
        timeout per request, not one per endpoint."""
        self.failures += 1
        missing = isinstance(error, aiohttp.ClientResponseError) and error.status in (404, 405, 501)
        rest = MISSING_REST_S if missing else self.retry_after
        self._resting_until[(base_url, what)] = time.monotonic() + rest
        if not missing:
            self._resting_until[(base_url, ALL)] = time.monotonic() + rest
        level = logging.INFO if missing else logging.WARNING
        logger.log(level, "%s at %s failed (%s); not asked again for %gs", what, base_url, type(error).__name__, rest)

    async def _post(self, base_url: str, path: str, body: dict[str, Any] | bytes) -> bytes:
        """The answer's body. A dict is written by orjson: a text to count can be megabytes, and
        aiohttp's `json.dumps` takes ten times as long, on the event loop."""
        started = time.perf_counter()
        self.calls += 1
        data = body if isinstance(body, bytes) else _serialized(body)
        try:
            try:
                return await self._post_once(base_url.rstrip("/") + path, data)
            except aiohttp.ServerDisconnectedError:
                # llama-server closes idle keep-alive connections; a pooled one can die as it is reused
                return await self._post_once(base_url.rstrip("/") + path, data)
        finally:
            self.seconds += time.perf_counter() - started

    async def _post_once(self, url: str, data: bytes) -> bytes:
        async with self.session.post(url, timeout=self.timeout, data=bodies.as_upload(data), headers=JSON_HEADERS) as resp:
            resp.raise_for_status()
            return await resp.read()

    async def _answer(self, base_url: str, path: str, body: dict[str, Any] | bytes) -> Any:
        return orjson.loads(await self._post(base_url, path, body))

    async def _tokens(self, base_url: str, text: str, special: bool, model: str = "") -> int:
        body = {"content": text, "add_special": special, "parse_special": special, **_named(model)}
        return token_count(await self._post(base_url, "/tokenize", body))

    async def _count_each(self, base_url: str, texts: list[str], model: str = "") -> list[int]:
        """Each text's tokens, `COUNTS_IN_FLIGHT` calls at a time."""
        counts = [0] * len(texts)
        todo = iter(enumerate(texts))

        async def worker() -> None:
            for i, text in todo:
                counts[i] = await self._tokens(base_url, text, special=False, model=model)

        await asyncio.gather(*(worker() for _ in range(min(COUNTS_IN_FLIGHT, len(texts)))))
        return counts

    async def template(self, base_url: str, model: str = "") -> TemplateCost:
        """Measure the template once per server and model: rendered and counted by the server, with
        one-token messages."""
        if (base_url, model) not in self.templates:
            one = [{"role": "user", "content": "x"}]
            three = [*one, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]
            with_system = [{"role": "system", "content": "s"}, *one]
            counts = []
            for messages in (one, three, with_system):
                prompt = (await self._answer(base_url, "/apply-template", {"messages": messages, **_named(model)}))["prompt"]
                counts.append(await self._tokens(base_url, prompt, special=True, model=model))
            per_message = max(0, (counts[1] - counts[0] - 2) // 2)
            self.templates[(base_url, model)] = TemplateCost(
                fixed=max(0, counts[0] - per_message - 1),
                fixed_with_system=max(0, counts[2] - 2 * per_message - 2),
                per_message=per_message,
            )
        return self.templates[(base_url, model)]

    async def counter(
        self, base_url: str, texts: Iterable[str], fallback: Counter, *, chat: bool, has_system: bool, big: bool = False, model: str = ""
    ) -> tuple[BackendCounter, int] | None:
        """A counter that knows every text in `texts`, and the template's fixed cost; None on failure.

        A raw prompt (`chat` false) goes through no template, so it costs nothing fixed. The texts of
        a `big` request are hashed in a worker thread: on the event loop they would stall it.
        """
        if self._resting(base_url, "counting"):
            return None
        try:
            template = await self.template(base_url, model) if chat else TemplateCost(0, 0, 0)
            keyed = await asyncio.to_thread(_keyed, texts) if big else _keyed(texts)
            missing = [t for t, key in keyed.items() if (base_url, model, key) not in self.texts]
            counts = await self._count_each(base_url, missing, model)
            for text, n in zip(missing, counts, strict=False):  # a short answer counts what it counts
                self.texts.put((base_url, model, keyed[text]), n)
            known = {t: self.texts[(base_url, model, key)] for t, key in keyed.items() if (base_url, model, key) in self.texts}
        except FAILURES as e:
            self._failed(base_url, "counting", e)
            return None
        fixed = template.fixed_with_system if has_system else template.fixed
        return BackendCounter(known, fallback, template.per_message), fixed

    async def total(self, base_url: str, body: Mapping[str, Any], path: str = OPENAI_COUNT, big: bool = False) -> int | None:
        """The server's exact prompt size for a chat body (template and tools included), counted at
        `path` (OpenAI's or Anthropic's counting route); None on failure. The body is serialized
        once, in a worker thread when it is `big`, and those bytes are both the cache key and what
        is sent."""
        data = await asyncio.to_thread(_serialized, body, sort_keys=True) if big else _serialized(body, sort_keys=True)
        key = (base_url, path, hashlib.blake2b(data, digest_size=12).digest())
        if key not in self.totals:
            if self._resting(base_url, path):
                return None
            try:
                answer = await self._answer(base_url, path, data)
                self.totals.put(key, int(answer["input_tokens"]))
            except FAILURES as e:
                self._failed(base_url, path, e)
                return None
        return self.totals[key]

    async def prompt_total(self, base_url: str, prompt: str, big: bool = False, model: str = "") -> int | None:
        """The server's exact size of a raw prompt, as `/completion` tokenizes it (its special
        tokens read as such, the model's BOS added); None on failure. The text of a cut prompt
        that our count only estimates (a marker's hex reference, the kept head and tail) runs
        denser than the prompt it came from."""
        keyed = await asyncio.to_thread(_keyed, [prompt]) if big else _keyed([prompt])
        key = (base_url, "prompt", model, keyed.get(prompt, b""))
        if key not in self.totals:
            if self._resting(base_url, "counting"):
                return None
            try:
                self.totals.put(key, await self._tokens(base_url, prompt, special=True, model=model))
            except FAILURES as e:
                self._failed(base_url, "counting", e)
                return None
        return self.totals[key]

    def stats(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "failures": self.failures,
            "seconds": round(self.seconds, 3),
            "cached_texts": len(self.texts),
        }


ASK_TIMEOUT_S = 180.0
"""Ollama evaluates the prompt to count it (a minute for 30,000 tokens on a CPU): the request itself
would wait that long, and then finds the prompt in the server's cache."""


@dataclass(frozen=True, slots=True)
class OllamaCount:
    """Ollama's answer to a request sent to count it."""

    tokens: int | None
    """Its count of the prompt (None: it refused without saying one, as versions before 0.13 do)."""
    fits: bool
    """It served the prompt whole (False: it refused it as over its window)."""


class OllamaCounting:
    """Asks an Ollama server to count a chat on its native route, one answer cached per body, with
    the time it took kept (the price of asking); a server that fails is not asked for a while."""

    def __init__(self, session: aiohttp.ClientSession, timeout: float = ASK_TIMEOUT_S, retry_after: float = 30.0) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.retry_after = retry_after
        self.counts: LRU = LRU(256)
        self.calls = 0
        self.failures = 0
        self.seconds = 0.0
        self._resting_until: dict[str, float] = {}

    async def count(self, base_url: str, body: Mapping[str, Any], big: bool = False) -> OllamaCount | None:
        """Ollama's count of `body` (`wire.ollama.counting_chat`'s), or None: it failed, or answered
        something that is neither a count nor a refusal."""
        data = await asyncio.to_thread(_serialized, body, sort_keys=True) if big else _serialized(body, sort_keys=True)
        key = (base_url, hashlib.blake2b(data, digest_size=12).digest())
        if key in self.counts:
            return self.counts[key]
        if time.monotonic() < self._resting_until.get(base_url, -math.inf):
            return None
        started = time.perf_counter()
        self.calls += 1
        try:
            async with self.session.post(
                base_url.rstrip("/") + "/api/chat", timeout=self.timeout, data=bodies.as_upload(data), headers=JSON_HEADERS
            ) as resp:
                answer = orjson.loads(await resp.read())
                if resp.status == 200:
                    counted = OllamaCount(int(answer["prompt_eval_count"]), True)
                elif resp.status == 400 and (refused := _refusal(answer)) is not None:
                    counted = refused
                else:
                    raise ValueError(f"answered {resp.status}: {str(answer)[:200]}")
        except FAILURES as e:
            self.failures += 1
            self._resting_until[base_url] = time.monotonic() + self.retry_after
            logger.warning("counting at %s/api/chat failed (%s); not asked again for %gs", base_url, e, self.retry_after)
            return None
        finally:
            self.seconds += time.perf_counter() - started
        self.counts.put(key, counted)
        return counted

    def stats(self) -> dict[str, Any]:
        return {"calls": self.calls, "failures": self.failures, "seconds": round(self.seconds, 3)}


LEGACY_REFUSAL = "the input length exceeds the context length"
"""Ollama's refusal of a prompt over its window before it passed llama-server's sentence on."""


def _refusal(answer: Any) -> OllamaCount | None:
    counted = refused_count(answer)
    if counted is not None:
        return OllamaCount(counted, False)
    error = answer.get("error") if isinstance(answer, Mapping) else None
    return OllamaCount(None, False) if isinstance(error, str) and LEGACY_REFUSAL in error else None


TOKENS_OPEN = re.compile(rb'\s*\{\s*"tokens"\s*:\s*\[')
TOKENS_CLOSE = re.compile(rb"\]\s*\}\s*")
"""/tokenize's answer as llama-server writes it without pieces, `{"tokens":[ids]}`, around its ids."""


def token_count(answer: bytes) -> int:
    """How many tokens /tokenize's answer lists, counted without building the list: a text of a
    million tokens is answered with 7 MB of ids, which `json` parses in some 90 ms on the event
    loop only to be counted (this takes 3). An answer of any other shape is parsed."""
    opening, closing = answer.find(b"["), answer.rfind(b"]")
    if TOKENS_OPEN.fullmatch(answer, 0, opening + 1) and TOKENS_CLOSE.fullmatch(answer, closing):
        if all(answer.find(mark, opening + 1, closing) == -1 for mark in (b"{", b"[", b'"')):  # ids only: no pieces
            commas = answer.count(b",", opening, closing)
            return commas + 1 if commas or answer[opening + 1 : closing].strip() else 0
    return len(orjson.loads(answer)["tokens"])


def _named(model: str) -> dict[str, str]:
    """The `model` field a router llama-server needs on every call (it answers "model name is
    missing from the request" without it); a server of one model reads none."""
    return {"model": model} if model else {}


def _keyed(texts: Iterable[str]) -> dict[str, bytes]:
    """Each distinct non-empty text with its cache key, hashed once (the cache keeps no texts)."""
    return {t: hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=12).digest() for t in dict.fromkeys(texts) if t}


def _serialized(body: Mapping[str, Any], *, sort_keys: bool = False) -> bytes:
    """A call's JSON body, keys sorted where it is a cache key too (the same body, the same key):
    by orjson, in a tenth of `json`'s time (a text to count can be megabytes); by `json` what
    orjson refuses (a kept number, a lone surrogate, escaped as JSON's own)."""
    try:
        return orjson.dumps(body, option=orjson.OPT_SORT_KEYS if sort_keys else None)
    except TypeError:
        return json.dumps(body, sort_keys=sort_keys, default=str).encode()
