"""The calls ContextPaw makes itself (discovery, counting, digests, runtime control), over one HTTP
session, and the `Services` the fitter asks them through."""

from __future__ import annotations

import asyncio
import functools
import os
from typing import Any

import aiohttp

from contextpaw.calls.server_counts import LlamaCppCounting, OllamaCounting
from contextpaw.calls.summarizer import ChatCompletions
from contextpaw.core import logs
from contextpaw.core.tokens import Counter, TokenizerCounter
from contextpaw.fitting.services import Complete, InFlight

logger = logs.get(__name__)

PROBE_TIMEOUT_S = 2.0


class Session:
    """One aiohttp session, made on first use (inside the event loop). It ignores HTTP_PROXY, which
    may point at this very proxy; each caller passes its own timeout and headers per request."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def get(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(trust_env=False)
        return self._session

    def close(self) -> None:
        """Close without awaiting (mitmproxy's `done` is sync on a script reload)."""
        if self._session is not None:
            asyncio.get_running_loop().create_task(self._session.close())
            self._session = None

    async def fetch(self, method: str, url: str, body: dict[str, Any] | None, timeout: float = PROBE_TIMEOUT_S) -> Any:
        """A JSON answer from a backend, or None: discovery is best-effort, never a reason to fail.
        (`contextpaw doctor` waits longer: it may load a model.)"""
        try:
            async with self.get().request(method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def text(self, url: str) -> tuple[int, str] | None:
        """(status, text) of a GET, or None when the server does not answer."""
        try:
            async with self.get().get(url, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                return resp.status, await resp.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError):
            return None


class HttpServices:
    """The fitter's `Services` over the shared session."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.fetch = session.fetch
        self.tokenizers: dict[str, Counter | None] = {}
        """Tokenizer file path -> its counter (None: the file could not be used)."""
        self._loads = InFlight()
        self._counting: LlamaCppCounting | None = None
        self._asking: OllamaCounting | None = None

    @property
    def counting(self) -> LlamaCppCounting:
        if self._counting is None:
            self._counting = LlamaCppCounting(self.session.get())
        return self._counting

    @property
    def asking(self) -> OllamaCounting:
        if self._asking is None:
            self._asking = OllamaCounting(self.session.get())
        return self._asking

    async def tokenizer(self, path: str) -> Counter | None:
        """Load a tokenizer once, in a worker thread (a GGUF vocabulary takes seconds to read), one
        load shared by whoever asks meanwhile; a file this machine cannot read (Ollama's blob on
        another host) means: count another way."""
        if path not in self.tokenizers:
            if not os.path.isfile(path):
                return None
            await self._loads.shared(path, functools.partial(self._load, path))
        return self.tokenizers.get(path)

    async def _load(self, path: str) -> None:
        try:
            self.tokenizers[path] = await asyncio.to_thread(TokenizerCounter.from_file, path)
        except Exception as e:  # any unreadable or unsupported file means: count another way
            logger.warning("cannot count with %s (%s); using another counter", path, e)
            self.tokenizers[path] = None

    def completions(self, url: str, model: str, timeout: float, authorization: str | None) -> Complete:
        headers = {"Authorization": authorization} if authorization else None
        return ChatCompletions(url, model, timeout=timeout, headers=headers, session=self.session.get)
