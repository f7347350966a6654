"""What the fake llama-server, the fake Ollama and the Ollama simulator share.

The scripted "model", the token-id table of the fake tokenizers, pacing for fault tests, lazily
started streams, the llama-server overflow body, and the scaffolding that runs an app on a free
loopback port (in a background thread for tests, or from the command line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

LOOPBACK = "127.0.0.1"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SECRET_QUESTION = "What is the SECRET?"
FIXED_REPLY = "Hello from the fake model."
RESPONSES_STREAM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 4,  # "The", " secret", " is", " kiwi."
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]
"""The events both fakes stream on /v1/responses for the four-token answer to `SECRET=kiwi`, as the
real servers order them."""
_SECRET = re.compile(r"SECRET=([\w-]+)")


def scripted_reply(seen: str) -> str:
    """The fake models' answer to the prompt text they actually saw.

    When the prompt asks ``SECRET?`` the answer names the last ``SECRET=<word>`` that survived
    truncation, or admits it is gone; any other prompt gets a fixed reply. A test can so check
    what reached the model without a real one.
    """
    if "SECRET?" not in seen:
        return FIXED_REPLY
    found = _SECRET.findall(seen)
    return f"The secret is {found[-1]}." if found else "I do not know the secret."


class Vocabulary:
    """Stable ids for the pieces of a fake tokenizer: fixed ids for special pieces, then ids handed
    out from 100 in order of first sight, so the same text always maps to the same ids."""

    def __init__(self, special: dict[str, int]) -> None:
        self._ids = dict(special)
        self._pieces = {i: piece for piece, i in special.items()}
        self._next = 100

    def ids(self, pieces: Iterable[str]) -> list[int]:
        return [self._id(piece) for piece in pieces]

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return [self._pieces[i] for i in ids]

    def _id(self, piece: str) -> int:
        if piece not in self._ids:
            self._ids[piece], self._pieces[self._next] = self._next, piece
            self._next += 1
        return self._ids[piece]


@dataclass(frozen=True)
class Pacing:
    """How fast a fake emits generated tokens: a delay before each, and optionally a hang
    (forever, until the client or the server goes away) before token number ``hang_after``.
    ``hang_after=0`` hangs before any byte of the response, headers included."""

    chunk_delay: float = 0.0
    hang_after: int | None = None

    async def before_token(self, index: int) -> None:
        if self.hang_after is not None and index >= self.hang_after:
            await asyncio.get_running_loop().create_future()
        if self.chunk_delay:
            await asyncio.sleep(self.chunk_delay)


class LazyStream:
    """A chunked response whose headers go out with the first chunk, as both real servers do: a
    request that fails or hangs before its first token has sent nothing yet."""

    def __init__(self, request: web.Request, content_type: str, headers: dict[str, str] | None = None) -> None:
        self._request = request
        self._response = web.StreamResponse(headers={"Content-Type": content_type, **(headers or {})})

    async def write(self, chunk: bytes) -> None:
        if not self._response.prepared:
            await self._response.prepare(self._request)
        await self._response.write(chunk)

    async def close(self) -> web.StreamResponse:
        await self.write(b"")
        await self._response.write_eof()
        return self._response


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def sse(value: Any) -> bytes:
    return f"data: {compact_json(value)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def named_sse(value: dict[str, Any]) -> bytes:
    """An Anthropic stream event: named after its ``type``."""
    return f"event: {value['type']}\ndata: {compact_json(value)}\n\n".encode()


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 503: "overloaded_error"}
    return {"type": "error", "error": {"type": kinds.get(status, "api_error"), "message": message}}


def anthropic_chat(body: dict[str, Any]) -> list[dict[str, Any]]:
    """An Anthropic request's ``system`` and ``messages`` as chat messages, converted the way both
    servers do: text blocks joined, a user message's tool results first as ``tool`` messages, tool
    uses as ``tool_calls``; images, thinking and unknown blocks are not rendered."""
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(b.get("text", "") for b in system if b.get("type") == "text")
    messages = [{"role": "system", "content": system}] if system else []
    for message in body.get("messages") or []:
        role, content = message["role"], message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
        calls = [
            {"id": b["id"], "function": {"name": b["name"], "arguments": b.get("input") or {}}}
            for b in blocks
            if b.get("type") == "tool_use"
        ]
        results = [
            {"role": "tool", "tool_call_id": b["tool_use_id"], "content": _result_text(b.get("content"))}
            for b in blocks
            if b.get("type") == "tool_result"
        ]
        messages += results
        if text or calls:
            messages.append({"role": role, "content": text, **({"tool_calls": calls} if calls else {})})
    return messages


def _result_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return content or ""


def context_overflow_error(n_prompt_tokens: int, n_ctx: int) -> dict[str, Any]:
    """llama-server's 400 body for a prompt of ``n_prompt_tokens >= n_ctx`` (llamacpp.md §1.2);
    Ollama passes it on as a string."""
    return {
        "error": {
            "code": 400,
            "message": f"request ({n_prompt_tokens} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": n_prompt_tokens,
            "n_ctx": n_ctx,
        }
    }


def routing_errors(not_found: Callable[[], web.Response], method_not_allowed: Callable[[], web.Response]) -> Callable[..., Any]:
    """Middleware that answers unknown paths and wrong methods with the imitated server's bodies
    instead of aiohttp's own."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPMethodNotAllowed:
            return method_not_allowed()
        except web.HTTPNotFound:
            return not_found()

    return middleware


def application(middlewares: list[Callable[..., Any]], gets: dict[str, Handler], posts: dict[str, Handler]) -> web.Application:
    """An app with these routes (GET routes answer HEAD too)."""
    app = web.Application(middlewares=middlewares)
    for path, handler in gets.items():
        app.router.add_get(path, handler)
    for path, handler in posts.items():
        app.router.add_post(path, handler)
    return app


FAKE_N_CTX = 1024
"""The window the test suites start the fakes with (their proxies' default window is the same)."""


def free_port() -> int:
    """A loopback port that was free a moment ago (for servers in other processes)."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


_HELD: list[socket.socket] = []
"""The sockets behind `dead_port`, kept bound for the life of the test process."""


def dead_port() -> int:
    """A loopback port where nothing answers, for as long as the tests run: bound here and never
    listened on, so a connection to it is refused, and no server started by a test running beside
    this one (pytest-xdist) can take it, as one can take a port `free_port` gave."""
    held = socket.socket()
    held.bind((LOOPBACK, 0))
    _HELD.append(held)
    return held.getsockname()[1]


@contextmanager
def running(app: web.Application, timeout: float = 10.0, port: int = 0) -> Iterator[str]:
    """Serve ``app`` on a loopback port (a free one, unless ``port`` names it: a server restarted
    where the last one was) from a background thread with its own event loop, so synchronous
    clients (openai, ollama) can be used in the test's thread. Yields the base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-backend", daemon=True)
    thread.start()
    runner = web.AppRunner(app, shutdown_timeout=0.5)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, LOOPBACK, port)
        await site.start()
        return runner.addresses[0][1]

    try:
        port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout)
        yield f"http://{LOOPBACK}:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        loop.close()


def common_arguments(description: str, *, port: int, model: str, n_ctx: int) -> argparse.ArgumentParser:
    """The options every test backend takes; callers add their own and then call :func:`serve`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, default=port, help=f"loopback port to listen on (default {port})")
    parser.add_argument("--model", default=model, help=f"model name served (default {model})")
    parser.add_argument("--n-ctx", type=int, default=n_ctx, help=f"context window in tokens (default {n_ctx})")
    parser.add_argument("--chunk-delay", type=float, default=0.0, help="seconds before each generated token")
    parser.add_argument(
        "--hang-after",
        type=int,
        default=None,
        metavar="N",
        help="hang forever before generated token N (0: before any response byte)",
    )
    return parser


def pacing(args: argparse.Namespace) -> Pacing:
    return Pacing(chunk_delay=args.chunk_delay, hang_after=args.hang_after)


def serve(app: web.Application, port: int) -> None:
    """Run ``app`` on the loopback ``port`` until interrupted (SIGINT or SIGTERM)."""
    web.run_app(app, host=LOOPBACK, port=port, print=lambda _: None, shutdown_timeout=0.5)
