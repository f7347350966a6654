"""A fast, deterministic fake Ollama (v0.33 ``head`` profile, ollama.md §5), and the HTTP surface
that :mod:`support.ollama_sim` puts on a real llama-server.

One surface, two engines. :class:`OllamaServer` owns everything Ollama decides itself: num_ctx
resolution, the loaded runner and ``keep_alive``, message-level truncation (whole messages,
oldest first, system messages re-collected to the front), the token-level middle cut that keeps
``num_keep`` (+BOS) tokens and the tail, the 400s, and the native and ``/v1`` wire formats (chat,
completions, the Responses API ``/v1/responses``, Anthropic's ``/v1/messages``). An
:class:`Engine` renders, tokenizes and generates. :class:`WhitespaceEngine` is Ollama's own test
double: whitespace tokens, the ``<|role|> content`` template, and :func:`common.scripted_reply` as model.

Not imitated: the Modelfile (SYSTEM, MESSAGEs, PARAMETERs), images, thinking, ``_debug_render_only``,
the Host-header 403, the queue-full 503, the ``legacy`` profile, the ``context`` request field,
tool calls in the model's output (so no ``function_call`` output items), the built-in web and file
search tools of ``/v1/responses``.

Run: ``PYTHONPATH=tests python -m support.fake_ollama --port 11434 --n-ctx 4096``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from aiohttp import web

from . import common
from .common import LazyStream, Pacing, Vocabulary, compact_json

VERSION = "0.33.0-rc2"
PROMPT_TOO_LONG = (
    "the prompt is longer than the context length currently available to the model; shorten the prompt, "
    "adjust the context length in settings, or use a model with a longer context length"
)
DEFAULT_KEEP_ALIVE_S = 300.0
FOREVER = timedelta(days=292 * 365)
LOAD_DURATION_NS = 1_000_000
GENERATION_BOUND = 10  # num_predict -1 means at most 10 x num_ctx tokens


@dataclass(frozen=True)
class OllamaSettings:
    """What the server (not the model) decides."""

    model: str = "fake:latest"
    num_ctx: int = 4096  # the default window: OLLAMA_CONTEXT_LENGTH, else the VRAM tier
    num_keep: int = 4
    native: bool = False  # /api/chat rendered by llama-server: an overflow is a 400, never a cut
    context_shift: bool = True  # False as for deepseek2: an overflow that needs a cut is a 400
    unload_delay: float = 0.05  # how long an unloaded model stays listed in /api/ps
    pacing: Pacing = field(default_factory=Pacing)


@dataclass(frozen=True)
class ModelCard:
    """What /api/show, /api/tags, /api/ps and /v1/models say about the one model served."""

    architecture: str
    context_length: int  # trained length; requested windows are capped to it
    embedding_length: int
    parameter_count: int
    parameter_size: str
    quantization_level: str
    size: int
    template: str
    blob: str = ""
    """The model file, named in the Modelfile's FROM line as real Ollama names its blob."""


@dataclass(frozen=True)
class Finish:
    """The end of one generation, as the final object's metrics report it."""

    done_reason: str
    prompt_eval_count: int  # tokens placed in the context, after truncation, BOS included
    eval_count: int
    prompt_eval_duration: int  # nanoseconds
    eval_duration: int


class OllamaError(Exception):
    """An error Ollama answers with a status and ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Engine(Protocol):
    async def open(self) -> ModelCard: ...

    async def close(self) -> None: ...

    async def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> str: ...

    async def tokenize(self, text: str, add_special: bool) -> list[int]: ...

    async def adds_bos(self) -> bool: ...

    def generate(self, tokens: list[int], num_predict: int, options: dict[str, Any]) -> AsyncGenerator[str | Finish]:
        """Text pieces as they are generated, then one :class:`Finish`."""
        ...


class WhitespaceEngine:
    """Tokens are whitespace-separated words (plus BOS for the runner-level count); a message
    renders as ``<|role|> content``, the generation prompt as ``<|assistant|>``."""

    BOS = 1

    def __init__(self, train_ctx: int = 32768, add_bos: bool = True) -> None:
        self._train_ctx = train_ctx
        self._add_bos = add_bos
        self._vocab = Vocabulary({"<s>": self.BOS})

    async def open(self) -> ModelCard:
        return ModelCard("llama", self._train_ctx, 64, 1_000_000, "1M", "Q4_0", 1_000_000, "<|{{ .Role }}|> {{ .Content }}")

    async def close(self) -> None:
        return None

    async def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
        parts = [f"<|tools|> {compact_json(tools)}"] if tools else []
        for message in messages:
            parts.append(f"<|{message['role']}|> {message.get('content') or ''}")
            for call in message.get("tool_calls") or []:
                function = call.get("function", {})
                parts.append(f"<|tool_call|> {function.get('name')} {compact_json(function.get('arguments', {}))}")
        parts.append("<|assistant|>")
        return " ".join(parts)

    async def tokenize(self, text: str, add_special: bool) -> list[int]:
        return [self.BOS] * (add_special and self._add_bos) + self._vocab.ids(text.split())

    async def adds_bos(self) -> bool:
        return self._add_bos

    async def generate(self, tokens: list[int], num_predict: int, options: dict[str, Any]) -> AsyncGenerator[str | Finish]:
        seen = " ".join(self._vocab.pieces(t for t in tokens if t != self.BOS))
        words = common.scripted_reply(seen).split()
        emitted = words[:num_predict]
        for index, word in enumerate(emitted):
            yield word if index == 0 else f" {word}"
        reason = "length" if len(words) > len(emitted) else "stop"
        yield Finish(reason, len(tokens), len(emitted), 100_000 * len(tokens), 1_000_000 * len(emitted))


# --- Go's conventions on the wire ---------------------------------------------------------------

_GO_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_GO_ESCAPED = re.compile("[<>&\u2028\u2029]")


def go_json(value: Any) -> str:
    """Compact JSON escaped like Go's encoding/json (``<``, ``>``, ``&`` and U+2028/9 as ``\\u``)."""
    return _GO_ESCAPED.sub(lambda m: _GO_ESCAPES[m.group()], compact_json(value))


def go_time(moment: datetime) -> str:
    """RFC 3339 with the fraction's trailing zeros trimmed, as Go's RFC3339Nano prints."""
    text = moment.strftime("%Y-%m-%dT%H:%M:%S.%f").rstrip("0").rstrip(".")
    offset = moment.strftime("%z")
    return text + ("Z" if offset == "+0000" else f"{offset[:3]}:{offset[3:]}")


def _now() -> str:
    return go_time(datetime.now(UTC))


def _json(value: Any, status: int = 200, content_type: str = "application/json; charset=utf-8") -> web.Response:
    return web.Response(text=go_json(value), status=status, headers={"Content-Type": content_type})


def _plain(text: str, status: int) -> web.Response:
    return web.Response(text=text, status=status, headers={"Content-Type": "text/plain; charset=utf-8"})


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_SECONDS_PER = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: Any) -> float | None:
    """``keep_alive`` as seconds (negative: forever; None: not given): a number of seconds or a Go
    duration string; a unit-less string other than ``"0"`` is Go's 400."""
    if value is None or isinstance(value, int | float):
        return value
    text = str(value)
    sign, body = (-1.0, text[1:]) if text[:1] == "-" else (1.0, text.removeprefix("+"))
    if body == "0":
        return 0.0
    if body and _DURATION.sub("", body) == "":
        return sign * sum(float(n) * _SECONDS_PER[unit] for n, unit in _DURATION.findall(body))
    reason = "missing unit in duration" if re.fullmatch(r"[\d.]+", body) else "invalid duration"
    raise OllamaError(400, f'time: {reason} "{text}"')


def canonical(name: str) -> str:
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


# --- the encoders: one per wire format ------------------------------------------------------------


class Codec(Protocol):
    content_type: str

    def partial(self, piece: str, first: bool) -> list[bytes]: ...

    async def final(self, text: str, finish: Finish) -> list[bytes]: ...

    async def whole(self, text: str, finish: Finish) -> web.Response: ...

    def failure(self, message: str) -> bytes: ...


def _metrics(finish: Finish) -> dict[str, int]:
    """The final object's metrics; zeros are left out, as Go's ``omitempty`` does."""
    total = LOAD_DURATION_NS + finish.prompt_eval_duration + finish.eval_duration
    metrics = {
        "total_duration": total,
        "load_duration": LOAD_DURATION_NS,
        "prompt_eval_count": finish.prompt_eval_count,
        "prompt_eval_duration": finish.prompt_eval_duration,
        "eval_count": finish.eval_count,
        "eval_duration": finish.eval_duration,
    }
    return {key: value for key, value in metrics.items() if value}


class NativeCodec:
    """``/api/chat`` and ``/api/generate``: NDJSON lines, the metrics on the ``done:true`` one."""

    content_type = "application/x-ndjson"

    def __init__(self, model: str, part: Callable[[str], dict[str, Any]], context: Callable[[str], Awaitable[dict[str, Any]]]) -> None:
        self._model = model
        self._part = part
        self._context = context

    def _object(self, text: str, **rest: Any) -> dict[str, Any]:
        return {"model": self._model, "created_at": _now(), **self._part(text), **rest}

    def partial(self, piece: str, first: bool) -> list[bytes]:
        return [f"{go_json(self._object(piece, done=False))}\n".encode()]

    async def _done(self, text: str, shown: str, finish: Finish) -> dict[str, Any]:
        context = await self._context(text)
        return self._object(shown, done=True, done_reason=finish.done_reason, **context, **_metrics(finish))

    async def final(self, text: str, finish: Finish) -> list[bytes]:
        return [f"{go_json(await self._done(text, '', finish))}\n".encode()]

    async def whole(self, text: str, finish: Finish) -> web.Response:
        return _json(await self._done(text, text, finish))

    def failure(self, message: str) -> bytes:
        return f"{go_json({'error': message})}\n".encode()


class OpenAICodec:
    """The ``/v1`` layer (ollama.md §3.6): SSE ending in ``[DONE]``, a ``usage`` chunk only when
    asked for (and then, for text completions, a zero ``usage`` on every chunk); a failure
    mid-stream is swallowed into an empty chunk and the stream ends without ``[DONE]``."""

    content_type = "text/event-stream"
    _ids = itertools.count(417)

    def __init__(self, model: str, body: dict[str, Any], chat: bool) -> None:
        self._model = model
        self._chat = chat
        self._id = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids) % 999}"
        self._created = int(time.time())
        self._include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def _object(self, choices: list[dict[str, Any]], chunk: bool, model: str | None = None, **rest: Any) -> dict[str, Any]:
        kind = ("chat.completion" if self._chat else "text_completion") + (".chunk" if chunk and self._chat else "")
        head = {"id": self._id, "object": kind, "created": self._created}
        tail = {"model": self._model if model is None else model, "system_fingerprint": "fp_ollama"}
        if chunk and not self._chat:  # text completion chunks put choices before model
            return {**head, "choices": choices, **tail, **rest}
        return {**head, **tail, "choices": choices, **rest}

    def _chunk(self, text: str | None, finish_reason: str | None, first: bool = False) -> bytes:
        if self._chat:
            delta = {} if text is None else {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return _sse(self._object([choice], chunk=True))
        choice = {"text": text or "", "index": 0, "finish_reason": finish_reason}
        zero = {"usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}} if self._include_usage else {}
        return _sse(self._object([choice], chunk=True, **zero))

    @staticmethod
    def _usage(finish: Finish) -> dict[str, int]:
        prompt, completion = finish.prompt_eval_count, finish.eval_count
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def partial(self, piece: str, first: bool) -> list[bytes]:
        return [self._chunk(piece, None, first)]

    async def final(self, text: str, finish: Finish) -> list[bytes]:
        events = [self._chunk(None, finish.done_reason)]
        if self._include_usage:
            events.append(_sse(self._object([], chunk=True, usage=self._usage(finish))))
        return [*events, common.SSE_DONE]

    async def whole(self, text: str, finish: Finish) -> web.Response:
        if self._chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish.done_reason,
            }
        else:
            choice = {"text": text, "index": 0, "finish_reason": finish.done_reason}
        body = self._object([choice], chunk=False, usage=self._usage(finish))
        return web.Response(text=go_json(body) + "\n", headers={"Content-Type": "application/json"})

    def failure(self, message: str) -> bytes:
        """Go decodes the ``{"error"}`` line as an empty response: no model, no content."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return _sse(self._object([choice], chunk=True, model=""))


class AnthropicCodec:
    """The ``/v1/messages`` layer (Ollama's anthropic package): ``message_start`` goes out with
    the first piece carrying only an estimate of the prompt (its bytes / 4), since the first chunk
    has no metrics yet; the real ``prompt_eval_count`` comes on ``message_delta``. A failure
    mid-stream becomes an ``error`` event."""

    content_type = "text/event-stream"
    _ids = itertools.count(1)

    def __init__(self, model: str, body: dict[str, Any]) -> None:
        self._model = model
        self._id = f"msg_{next(self._ids):024x}"
        self._estimate = max(1, len(compact_json([body.get("system"), body.get("messages")])) // 4)

    def _message(self, content: list[dict[str, Any]], input_tokens: int, output_tokens: int, **rest: Any) -> dict[str, Any]:
        usage = {"input_tokens": input_tokens, "output_tokens": output_tokens}
        return {"id": self._id, "type": "message", "role": "assistant", "model": self._model, "content": content, **rest, "usage": usage}

    def _start(self) -> list[bytes]:
        return [
            common.named_sse({"type": "message_start", "message": self._message([], self._estimate, 0)}),
            common.named_sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ]

    @staticmethod
    def _stop(finish: Finish) -> str:
        return "max_tokens" if finish.done_reason == "length" else "end_turn"

    def partial(self, piece: str, first: bool) -> list[bytes]:
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}
        return [*(self._start() if first else []), common.named_sse(delta)]

    async def final(self, text: str, finish: Finish) -> list[bytes]:
        usage = {"input_tokens": finish.prompt_eval_count, "output_tokens": finish.eval_count}
        return [
            *([] if text else self._start()),
            common.named_sse({"type": "content_block_stop", "index": 0}),
            common.named_sse({"type": "message_delta", "delta": {"stop_reason": self._stop(finish)}, "usage": usage}),
            common.named_sse({"type": "message_stop"}),
        ]

    async def whole(self, text: str, finish: Finish) -> web.Response:
        content = [{"type": "text", "text": text}] if text else []
        body = self._message(content, finish.prompt_eval_count, finish.eval_count, stop_reason=self._stop(finish))
        return _json(body, content_type="application/json")

    def failure(self, message: str) -> bytes:
        return common.named_sse(common.anthropic_error(500, message))


class ResponsesCodec:
    """``/v1/responses`` (Ollama's openai/responses.go and middleware/openai.go): named SSE events,
    ``event: TYPE`` then the data, which Go marshals from maps, so every object's keys are sorted;
    each event has a ``sequence_number`` from 0, and ``output_index``/``content_index`` where
    OpenAI has them. ``response.created`` and ``response.in_progress`` go out with the first piece
    and carry the whole (echoed) response object; ``response.completed`` adds the output and the
    usage, ``input_tokens`` being ``prompt_eval_count``: what is left after the cut. The buffered
    body is Go's struct, in field order, ending in a newline. No ``[DONE]``; a failure mid-stream
    ends it with nothing more (the error line decodes as an empty chat chunk)."""

    content_type = "text/event-stream"

    def __init__(self, model: str, body: dict[str, Any]) -> None:
        self._model = model
        self._body = body
        self._id = f"resp_{uuid.uuid4()}"
        self._item_id = f"msg_{str(uuid.uuid4())[:8]}"
        self._sequence = itertools.count()
        self._opened = False
        self._text_started = False

    # -- what the request echoes -------------------------------------------------------------

    def _instructions(self) -> str | None:
        return self._body.get("instructions") or None

    def _format(self) -> dict[str, Any]:
        text = self._body.get("text")
        form = text.get("format") if isinstance(text, dict) else None
        if not isinstance(form, dict):
            return {"type": "text"}
        keys = ("type", "name", "schema", "strict")
        return {"type": form.get("type", ""), **{k: form[k] for k in keys[1:] if form.get(k) not in (None, "")}}

    def _reasoning(self) -> dict[str, Any] | None:
        reasoning = self._body.get("reasoning") if isinstance(self._body.get("reasoning"), dict) else {}
        effort, summary = reasoning.get("effort") or None, reasoning.get("summary") or None
        return None if effort is None and summary is None else {"effort": effort, "summary": summary}

    def _tools(self) -> list[dict[str, Any]]:
        return [
            {
                "type": t.get("type", ""),
                "name": t.get("name", ""),
                "description": t.get("description"),
                "strict": t.get("strict"),
                "parameters": _go_map(t.get("parameters")),
            }
            for t in self._body.get("tools") or []
            if isinstance(t, dict)
        ]

    def _object(self, status: str, output: list[Any] | None, usage: dict[str, Any] | None) -> dict[str, Any]:
        """``buildResponseObject``: the response as the stream events carry it."""
        return {
            "id": self._id,
            "object": "response",
            "created_at": int(time.time()),
            "completed_at": None,
            "status": status,
            "incomplete_details": None,
            "model": self._model,
            "previous_response_id": None,
            "instructions": self._instructions(),
            "output": output,
            "error": None,
            "tools": self._tools(),
            "tool_choice": "auto",
            "truncation": self._body.get("truncation") or "disabled",
            "parallel_tool_calls": True,
            "text": {"format": self._format()},
            "top_p": _go_number(self._body.get("top_p", 1.0)),
            "presence_penalty": 0,
            "frequency_penalty": 0,
            "top_logprobs": 0,
            "temperature": _go_number(self._body.get("temperature", 1.0)),
            "reasoning": self._reasoning(),
            "usage": usage,
            "max_output_tokens": self._body.get("max_output_tokens"),
            "max_tool_calls": None,
            "store": False,
            "background": bool(self._body.get("background")),
            "service_tier": "default",
            "metadata": {},
            "safety_identifier": None,
            "prompt_cache_key": None,
        }

    @staticmethod
    def _usage(finish: Finish) -> dict[str, Any]:
        prompt, completion = finish.prompt_eval_count, finish.eval_count
        return {
            "input_tokens": prompt,
            "output_tokens": completion,
            "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _message(self, text: str) -> dict[str, Any]:
        return {"id": self._item_id, "type": "message", "status": "completed", "role": "assistant", "content": [self._part(text)]}

    # -- the stream --------------------------------------------------------------------------

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        data = {**data, "type": kind, "sequence_number": next(self._sequence)}
        return f"event: {kind}\ndata: {go_json(_go_map(data))}\n\n".encode()

    def _open(self) -> list[bytes]:
        if self._opened:
            return []
        self._opened = True
        return [
            self._event("response.created", {"response": self._object("in_progress", [], None)}),
            self._event("response.in_progress", {"response": self._object("in_progress", [], None)}),
        ]

    def partial(self, piece: str, first: bool) -> list[bytes]:
        events = self._open()
        if not self._text_started:
            self._text_started = True
            item = {"id": self._item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            events += [
                self._event("response.output_item.added", {"output_index": 0, "item": item}),
                self._event(
                    "response.content_part.added",
                    {"item_id": self._item_id, "output_index": 0, "content_index": 0, "part": self._part("")},
                ),
            ]
        delta = {"item_id": self._item_id, "output_index": 0, "content_index": 0, "delta": piece, "logprobs": []}
        return [*events, self._event("response.output_text.delta", delta)]

    async def final(self, text: str, finish: Finish) -> list[bytes]:
        events = self._open()
        output = None
        if self._text_started:
            where = {"item_id": self._item_id, "output_index": 0, "content_index": 0}
            events += [
                self._event("response.output_text.done", {**where, "text": text, "logprobs": []}),
                self._event("response.content_part.done", {**where, "part": self._part(text)}),
                self._event("response.output_item.done", {"output_index": 0, "item": self._message(text)}),
            ]
            output = [self._message(text)]
        response = {**self._object("completed", output, self._usage(finish)), "completed_at": int(time.time())}
        return [*events, self._event("response.completed", {"response": response})]

    async def whole(self, text: str, finish: Finish) -> web.Response:
        """``ToResponse``: the struct's field order; a message item even when the text is empty."""
        now = int(time.time())
        body = {
            **self._object("completed", [self._message(text)], self._usage(finish)),
            "completed_at": now,
            "reasoning": {k: v for k, v in (self._reasoning() or {}).items() if v is not None} or None,
        }
        return web.Response(text=go_json(body) + "\n", headers={"Content-Type": "application/json"})

    def failure(self, message: str) -> bytes:
        return b""


def _go_map(value: Any) -> Any:
    """``value`` with every object's keys sorted, as Go's encoding/json writes a ``map[string]any``."""
    if isinstance(value, dict):
        return {key: _go_map(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_go_map(item) for item in value]
    return value


def _go_number(value: Any) -> Any:
    """A float64 as Go prints it: integral values without a fraction (``1``, not ``1.0``)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _sse(value: Any) -> bytes:
    return f"data: {go_json(value)}\n\n".encode()


def openai_error(status: int, message: str) -> web.Response:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
    error = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.Response(text=go_json(error), status=status, headers={"Content-Type": "application/json"})


# --- the server -------------------------------------------------------------------------------


@dataclass
class Runner:
    """The loaded model: its window and when it expires."""

    num_ctx: int
    keep_alive: float
    expires_at: datetime
    unloading: bool = False

    def touch(self, keep_alive: float | None) -> None:
        if keep_alive is not None:
            self.keep_alive = keep_alive
        lifetime = FOREVER if self.keep_alive < 0 else timedelta(seconds=self.keep_alive)
        self.expires_at = datetime.now().astimezone() + lifetime


@dataclass(frozen=True)
class Request:
    """One generation request, after the API-specific parsing."""

    model: str
    messages: list[dict[str, Any]] | None  # None: a raw prompt
    prompt: str
    tools: list[Any] | None
    options: dict[str, Any]
    truncate: bool
    shift: bool | None
    keep_alive: float | None
    native_chat: bool  # only /api/chat takes llama-server's rendering route


class OllamaServer:
    """Ollama's side of every request; the engine does the model's side."""

    def __init__(self, settings: OllamaSettings, engine: Engine) -> None:
        self.started_at = int(time.time())
        """What /v1/models says was created: fixed, so two listings are byte for byte the same."""
        self.settings = settings
        self.engine = engine
        self.card: ModelCard | None = None
        self.runner: Runner | None = None
        self.last_cut: dict[str, Any] | None = None

    async def lifetime(self, app: web.Application) -> AsyncIterator[None]:
        self.card = await self.engine.open()
        yield
        await self.engine.close()

    # --- parsing and model state ----------------------------------------------------------

    @staticmethod
    async def body(request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw:
            raise OllamaError(400, "missing request body")
        try:
            body = json.loads(raw)
        except ValueError as error:
            raise OllamaError(400, str(error)) from None
        if not isinstance(body, dict):
            raise OllamaError(400, "json: cannot unmarshal into Go value of type api.Request")
        return body

    def model(self, body: dict[str, Any]) -> str:
        name = body.get("model") or body.get("name") or ""
        if not name:
            raise OllamaError(400, "model is required")
        if canonical(name) != canonical(self.settings.model):
            raise OllamaError(404, f"model '{name}' not found")
        return name

    def num_ctx(self, options: dict[str, Any]) -> int:
        for key in ("num_ctx", "num_keep", "num_predict"):
            if key in options and not isinstance(options[key], int):
                raise OllamaError(500, f'option "{key}" must be of type integer')
        assert self.card is not None
        return min(max(options.get("num_ctx", self.settings.num_ctx), 4), self.card.context_length)

    def load(self, num_ctx: int, keep_alive: float | None) -> Runner:
        """Reuse the runner when its window matches, else (re)load one (ollama.md §2.2)."""
        if self.runner is None or self.runner.num_ctx != num_ctx:
            kept = DEFAULT_KEEP_ALIVE_S if self.runner is None else self.runner.keep_alive
            self.runner = Runner(num_ctx, kept, datetime.now().astimezone())
        self.runner.touch(keep_alive)
        return self.runner

    def unload(self) -> None:
        """Expire the runner now; it stays listed until the asynchronous unload completes."""
        runner = self.runner
        if runner is None:
            return
        runner.expires_at, runner.unloading = datetime.now().astimezone(), True

        def forget() -> None:
            if self.runner is runner:
                self.runner = None

        asyncio.get_running_loop().call_later(self.settings.unload_delay, forget)

    def load_reply(self, model: str, body: dict[str, Any], part: dict[str, Any]) -> web.Response:
        """An empty prompt loads the model, or with ``keep_alive: 0`` unloads it: one JSON object."""
        keep_alive = keep_alive_seconds(body.get("keep_alive"))
        if keep_alive == 0:
            self.unload()
            reason = "unload"
        else:
            self.load(self.num_ctx(body.get("options") or {}), keep_alive)
            reason = "load"
        return _json({"model": model, "created_at": _now(), **part, "done": True, "done_reason": reason})

    # --- the pipeline ---------------------------------------------------------------------

    async def fit_messages(self, messages: list[dict[str, Any]], tools: list[Any] | None, num_ctx: int) -> str:
        """Drop whole messages oldest-first until the rendered prompt (no BOS) fits ``num_ctx``,
        re-collecting the dropped system messages in front; the last message is always kept."""
        for start in range(len(messages)):
            kept = [m for m in messages[:start] if m["role"] == "system"] + messages[start:]
            prompt = await self.engine.render(kept, tools)
            if start == len(messages) - 1 or len(await self.engine.tokenize(prompt, add_special=False)) <= num_ctx:
                return prompt
        raise AssertionError("unreachable: messages is not empty")

    def shift(self, request: Request) -> bool:
        """Whether the runner shifts its context: the request decides, else the model."""
        return self.settings.context_shift if request.shift is None else request.shift

    async def fit_tokens(self, prompt: str, request: Request, num_ctx: int) -> list[int]:
        """The runner-level step (ollama.md §1.2): the 400s, or the middle cut that keeps the first
        ``num_keep`` (+BOS) tokens and enough of the tail to fill about half the window."""
        tokens = await self.engine.tokenize(prompt, add_special=True)
        if not request.truncate or request.native_chat:
            if len(tokens) >= num_ctx:
                raise OllamaError(400, compact_json(common.context_overflow_error(len(tokens), num_ctx)))
            return tokens
        if len(tokens) <= num_ctx - 1:
            return tokens
        if not self.shift(request):
            raise OllamaError(400, PROMPT_TOO_LONG)
        num_keep = request.options.get("num_keep", self.settings.num_keep)
        keep = len(tokens) if num_keep < 0 else num_keep + await self.engine.adds_bos()
        keep = min(keep, num_ctx - 1)
        limit = num_ctx - max((num_ctx - keep) // 2, 1)
        return tokens[:keep] + tokens[len(tokens) - (limit - keep) :]

    async def run(self, request: Request) -> tuple[str, AsyncGenerator[str | Finish]]:
        """Load, truncate, then start generating: the prompt before the token-level step, and the
        pieces. Errors raised here, before the first piece, carry their own status."""
        num_ctx = self.load(self.num_ctx(request.options), request.keep_alive).num_ctx
        prompt = whole = request.prompt
        if request.messages is not None:
            whole = await self.engine.render(request.messages, request.tools)
            prompt = await self.fit_messages(request.messages, request.tools, num_ctx) if request.truncate else whole
        self.last_cut = None
        tokens = await self.fit_tokens(prompt, request, num_ctx)
        sent = len(await self.engine.tokenize(whole, add_special=True))
        self.last_cut = {"cut": len(tokens) < sent, "sent_tokens": sent, "kept_tokens": len(tokens), "num_ctx": num_ctx}
        num_predict = request.options.get("num_predict", -1)
        num_predict = GENERATION_BOUND * num_ctx if num_predict < 0 else num_predict
        if not self.shift(request):
            num_predict = min(num_predict, num_ctx - len(tokens))
        return prompt, self.engine.generate(tokens, num_predict, request.options)

    async def respond(self, request: web.Request, stream: bool, pieces: AsyncGenerator[str | Finish], codec: Codec) -> web.StreamResponse:
        """Drive a generation into ``codec``: one object, or a stream flushed per piece whose
        headers go out with the first one (so an early error still gets its own status). The
        generation is closed however this ends, so a client that goes away stops the engine."""
        out = LazyStream(request, codec.content_type)
        text: list[str] = []
        try:
            async with aclosing(pieces):
                async for item in pieces:
                    if isinstance(item, Finish):
                        finish = item
                        break
                    await self.settings.pacing.before_token(len(text))
                    text.append(item)
                    for chunk in codec.partial(item, first=len(text) == 1) if stream else ():
                        await out.write(chunk)
        except OllamaError as error:
            if not (stream and text):
                raise
            await out.write(codec.failure(error.message))
            return await out.close()
        if not stream:
            return await codec.whole("".join(text), finish)
        for chunk in await codec.final("".join(text), finish):
            await out.write(chunk)
        return await out.close()

    # --- native routes --------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self.body(request)
        model = self.model(body)
        part = lambda text: {"message": {"role": "assistant", "content": text}}  # noqa: E731
        if not body.get("messages"):
            return self.load_reply(model, body, part(""))
        messages = [{**m, "role": str(m.get("role", "")).lower()} for m in body["messages"]]
        _, pieces = await self.run(self._native(body, model, messages, "", native_chat=self.settings.native))
        return await self.respond(request, body.get("stream", True), pieces, NativeCodec(model, part, _no_context))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self.body(request)
        model = self.model(body)
        part = lambda text: {"response": text}  # noqa: E731
        prompt = body.get("prompt") or ""
        if not prompt:
            return self.load_reply(model, body, part(""))
        if body.get("raw"):
            if any(body.get(key) for key in ("system", "template", "context")):
                raise OllamaError(400, "raw mode does not support template, system, or context")
            messages = None
        else:
            system = [{"role": "system", "content": body["system"]}] if body.get("system") else []
            messages = [*system, {"role": "user", "content": prompt}]
        rendered, pieces = await self.run(self._native(body, model, messages, prompt, native_chat=False))

        async def context(text: str) -> dict[str, Any]:
            """The prompt as rendered before the token-level cut, plus the response, as token ids."""
            return {} if body.get("raw") else {"context": await self.engine.tokenize(rendered + text, add_special=False)}

        return await self.respond(request, body.get("stream", True), pieces, NativeCodec(model, part, context))

    @staticmethod
    def _native(body: dict[str, Any], model: str, messages: list[dict[str, Any]] | None, prompt: str, native_chat: bool) -> Request:
        return Request(
            model=model,
            messages=messages,
            prompt=prompt,
            tools=body.get("tools"),
            options=dict(body.get("options") or {}),
            truncate=body.get("truncate", True) is not False,
            shift=body.get("shift"),
            keep_alive=keep_alive_seconds(body.get("keep_alive")),
            native_chat=native_chat,
        )

    # --- the /v1 layer --------------------------------------------------------------------

    async def openai_chat(self, request: web.Request) -> web.StreamResponse:
        body = await self.body(request)
        model = self.model(body)
        if not body.get("messages"):
            raise OllamaError(400, "[] is too short - 'messages'")
        messages = [message for m in body["messages"] for message in _from_openai_message(m)]
        _, pieces = await self.run(self._openai(body, model, messages, "", native_chat=self.settings.native))
        return await self.respond(request, bool(body.get("stream")), pieces, OpenAICodec(model, body, chat=True))

    async def openai_completion(self, request: web.Request) -> web.StreamResponse:
        body = await self.body(request)
        model = self.model(body)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise OllamaError(400, "invalid type for 'prompt' field")
        messages = [{"role": "user", "content": prompt}]
        _, pieces = await self.run(self._openai(body, model, messages, prompt, native_chat=False))
        return await self.respond(request, bool(body.get("stream")), pieces, OpenAICodec(model, body, chat=False))

    @staticmethod
    def _openai(body: dict[str, Any], model: str, messages: list[dict[str, Any]], prompt: str, native_chat: bool) -> Request:
        """ollama.md §3.6: no num_ctx, truncate, shift or keep_alive can come through here, and
        temperature and top_p default to 1.0."""
        options = {"temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0)}
        renamed = {
            "max_tokens": "num_predict",
            "stop": "stop",
            "seed": "seed",
            "frequency_penalty": "frequency_penalty",
            "presence_penalty": "presence_penalty",
        }
        options |= {ours: body[theirs] for theirs, ours in renamed.items() if body.get(theirs) is not None}
        return Request(model, messages, prompt, body.get("tools"), options, True, None, None, native_chat)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API over the chat pipeline (v0.13.3+): stateless, and like the other
        ``/v1`` routes it takes no ``options``, so the prompt is cut to the default window in
        silence (``/_fake/last`` records it). ``previous_response_id``, ``truncation``, ``store``
        and ``include`` are not fields of Ollama's request type: Go drops them unread, so a
        ``previous_response_id`` is ignored rather than refused, and ``truncation`` is only echoed."""
        body = await self.body(request)
        _check_go_types(body)
        model = self.model(body)
        if body.get("background") is True:
            raise OllamaError(400, "background mode is not supported for local models; use a cloud model or omit the background field")
        messages, tools = responses_messages(body)
        options: dict[str, Any] = {"temperature": body.get("temperature", 1.0)}
        options |= {"top_p": body["top_p"]} if body.get("top_p") is not None else {}
        options |= {"num_predict": body["max_output_tokens"]} if body.get("max_output_tokens") is not None else {}
        codec = ResponsesCodec(model, body)
        stream = body.get("stream") is True
        if not messages:  # Ollama's chat handler only loads the model: done_reason "load", no metrics
            self.load(self.num_ctx({}), None)
            return await self.respond(request, stream, _loaded(), codec)
        _, pieces = await self.run(Request(model, messages, "", tools, options, True, None, None, self.settings.native))
        return await self.respond(request, stream, pieces, codec)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's API over the chat pipeline: no num_ctx, truncate or keep_alive get through,
        so an overflow is cut to the loaded (or default) window in silence."""
        body = await self.body(request)
        model = self.model(body)
        if not isinstance(body.get("messages"), list):
            raise OllamaError(400, "messages is required")
        messages = common.anthropic_chat(body)
        options = {"num_predict": body.get("max_tokens", -1)}
        options |= {k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None}
        request_ = Request(model, messages, "", None, options, True, None, None, self.settings.native)
        _, pieces = await self.run(request_)
        return await self.respond(request, body.get("stream") is True, pieces, AnthropicCodec(model, body))

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Ollama's count here is an estimate: the request's bytes / 4."""
        body = await self.body(request)
        return _json({"input_tokens": max(1, len(compact_json([body.get("system"), body.get("messages")])) // 4)})

    async def last(self, request: web.Request) -> web.Response:
        """Test-only ground truth: whether the last prompt that reached the runner was cut (null
        when the last request was refused before that)."""
        return _json(self.last_cut)

    def _openai_model(self) -> dict[str, Any]:
        return {"id": canonical(self.settings.model), "object": "model", "created": self.started_at, "owned_by": "library"}

    async def openai_models(self, request: web.Request) -> web.Response:
        return web.Response(text=go_json({"object": "list", "data": [self._openai_model()]}), headers={"Content-Type": "application/json"})

    async def openai_model(self, request: web.Request) -> web.Response:
        """`GET /v1/models/{model}`: the one model as the list has it; 404 for one not served."""
        self.model({"model": request.match_info["model"]})
        return web.Response(text=go_json(self._openai_model()), headers={"Content-Type": "application/json"})

    # --- informational routes -------------------------------------------------------------

    async def root(self, request: web.Request) -> web.Response:
        return _plain("Ollama is running", 200)

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": VERSION})

    def _details(self) -> dict[str, Any]:
        assert self.card is not None
        arch = self.card.architecture
        return {
            "parent_model": "",
            "format": "gguf",
            "family": arch,
            "families": [arch],
            "parameter_size": self.card.parameter_size,
            "quantization_level": self.card.quantization_level,
        }

    def _digest(self) -> str:
        return hashlib.sha256(canonical(self.settings.model).encode()).hexdigest()

    async def tags(self, request: web.Request) -> web.Response:
        assert self.card is not None
        name = canonical(self.settings.model)
        details = {
            **self._details(),
            "context_length": self.card.context_length,
            "embedding_length": self.card.embedding_length,
        }
        model = {
            "name": name,
            "model": name,
            "modified_at": go_time(datetime.now().astimezone()),
            "size": self.card.size,
            "digest": self._digest(),
            "details": details,
            "capabilities": ["completion"],
        }
        return _json({"models": [model]})

    async def ps(self, request: web.Request) -> web.Response:
        """The loaded runner with its effective window (``context_length``), CPU-only."""
        assert self.card is not None
        runner = self.runner
        if runner is not None and not runner.unloading and runner.expires_at < datetime.now().astimezone():
            self.runner = runner = None
        name = canonical(self.settings.model)
        models = (
            []
            if runner is None
            else [
                {
                    "name": name,
                    "model": name,
                    "size": self.card.size,
                    "digest": self._digest(),
                    "details": self._details(),
                    "expires_at": go_time(runner.expires_at),
                    "size_vram": 0,
                    "context_length": runner.num_ctx,
                }
            ]
        )
        return _json({"models": models})

    async def show(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        self.model(body)
        assert self.card is not None
        arch = self.card.architecture
        model_info = {
            "general.architecture": arch,
            "general.parameter_count": self.card.parameter_count,
            f"{arch}.context_length": self.card.context_length,
            f"{arch}.embedding_length": self.card.embedding_length,
        }
        return _json(
            {
                "modelfile": f"FROM {self.card.blob or canonical(self.settings.model)}\nTEMPLATE {json.dumps(self.card.template)}\n",
                "template": self.card.template,
                "details": self._details(),
                "model_info": model_info,
                "capabilities": ["completion"],
                "modified_at": go_time(datetime.now().astimezone()),
            }
        )


async def _no_context(text: str) -> dict[str, Any]:
    return {}


def _from_openai_message(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One OpenAI message as Ollama messages: each text part of an array content is its own."""
    role, content = message.get("role", ""), message.get("content")
    if isinstance(content, list):
        return [{"role": role, "content": part.get("text", "")} for part in content if part.get("type") == "text"]
    converted: dict[str, Any] = {"role": role, "content": content or ""}
    if message.get("tool_calls"):
        converted["tool_calls"] = [
            {
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.loads(c["function"].get("arguments") or "{}"),
                }
            }
            for c in message["tool_calls"]
        ]
    return [converted]


async def _loaded() -> AsyncGenerator[str | Finish]:
    yield Finish("load", 0, 0, 0, 0)


# The Responses request's typed fields (Ollama's ResponsesRequest): a value of another JSON type is
# gin's binding error, a 400. Fields it does not declare are dropped unread.
_GO_FIELDS: dict[str, tuple[str, tuple[type, ...]]] = {
    "model": ("string", (str,)),
    "background": ("bool", (bool,)),
    "include": ("[]string", (list,)),
    "instructions": ("string", (str,)),
    "max_output_tokens": ("int", (int,)),
    "reasoning": ("openai.ResponsesReasoning", (dict,)),
    "temperature": ("float64", (int, float)),
    "text": ("openai.ResponsesText", (dict,)),
    "top_p": ("float64", (int, float)),
    "truncation": ("string", (str,)),
    "tools": ("[]openai.ResponsesTool", (list,)),
    "stream": ("bool", (bool,)),
}
_JSON_KINDS = {bool: "bool", int: "number", float: "number", str: "string", list: "array", dict: "object"}


def _check_go_types(body: dict[str, Any]) -> None:
    for name, (go_type, kinds) in _GO_FIELDS.items():
        value = body.get(name)
        wrong_bool = isinstance(value, bool) and bool not in kinds
        if value is not None and (wrong_bool or not isinstance(value, kinds)):
            kind = _JSON_KINDS.get(type(value), "value")
            raise OllamaError(400, f"json: cannot unmarshal {kind} into Go struct field ResponsesRequest.{name} of type {go_type}")
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict):
            raise OllamaError(400, f"json: cannot unmarshal {_JSON_KINDS.get(type(tool), 'value')} into Go struct field "
                              "ResponsesRequest.tools of type openai.ResponsesTool")  # fmt: skip


REASONING_EFFORTS = ("none", "low", "medium", "high", "max")


def _responses_content(parts: Any, where: str, field: str = "content") -> tuple[str, list[Any]]:
    """Responses content parts as Ollama's text (the text parts joined) and images; a file is a
    400, and so is a part type it does not know."""
    if isinstance(parts, str):
        return parts, []
    text, images = "", []
    for index, part in enumerate(parts or []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            text += part.get("text") or ""
        elif kind == "input_image":
            if part.get("image_url"):
                images.append(part["image_url"])
        elif kind == "input_file":
            raise OllamaError(400, "file inputs are not currently supported")
        else:
            raise OllamaError(400, f"{where}{field}[{index}]: unknown content type: {kind or ''}")
    return text, images


def responses_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A Responses request as Ollama's chat messages and tools (``FromResponsesRequest``):
    ``instructions`` as a system message, then the input string or items. A reasoning item's
    ``encrypted_content`` becomes the thinking of the next assistant message; a function call joins
    the assistant message before it; an item whose type Ollama does not know is a 400."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        if items:
            messages.append({"role": "user", "content": items})
        items = []
    elif items is not None and not isinstance(items, list):
        raise OllamaError(400, "input must be a string or array: json: cannot unmarshal into Go value of type []json.RawMessage")
    thinking = ""
    for index, item in enumerate(items or []):
        where = f"input[{index}]: "
        item = item if isinstance(item, dict) else {}
        kind = item.get("type") or ("message" if item.get("role") else "")
        if kind == "reasoning":
            thinking = item.get("encrypted_content") or ""
        elif kind == "message":
            content, images = _responses_content(item.get("content"), where)
            message: dict[str, Any] = {"role": item.get("role", ""), "content": content}
            if images:
                message["images"] = images
            if message["role"] == "assistant" and thinking:
                message["thinking"], thinking = thinking, ""
            messages.append(message)
        elif kind == "function_call":
            try:
                arguments = json.loads(item["arguments"]) if item.get("arguments") else {}
            except ValueError as error:
                raise OllamaError(400, f"failed to parse function call arguments: {error}") from None
            if not isinstance(arguments, dict):
                raise OllamaError(400, "failed to parse function call arguments: not a JSON object")
            call = {"id": item.get("call_id", ""), "function": {"name": item.get("name", ""), "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = [*messages[-1].get("tool_calls", []), call]
                target = messages[-1]
            else:
                target = {"role": "assistant", "content": "", "tool_calls": [call]}
                messages.append(target)
            if thinking:
                target["thinking"], thinking = thinking, ""
        elif kind == "function_call_output":
            content, images = _responses_content(item.get("output"), where, "output")
            message = {"role": "tool", "content": content, "tool_call_id": item.get("call_id", "")}
            if images:
                message["images"] = images
            messages.append(message)
        elif kind:
            raise OllamaError(400, f"{where}unknown input item type: {json.dumps(kind)}")
        else:
            raise OllamaError(400, f"{where}input item missing required 'type' field")
    if thinking:
        messages.append({"role": "assistant", "content": "", "thinking": thinking})
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort and effort not in REASONING_EFFORTS:
        raise OllamaError(400, f'invalid reasoning value: "{effort}" (must be "high", "medium", "low", "max", or "none")')
    tools = [
        {
            "type": t.get("type", ""),
            "function": {"name": t.get("name", ""), "description": t.get("description") or "", "parameters": t.get("parameters")},
        }
        for t in body.get("tools") or []
        if isinstance(t, dict)
    ]
    return messages, tools or None


@web.middleware
async def _ollama_errors(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    """Native routes answer ``{"error": message}``; the ``/v1`` layer wraps it OpenAI's way."""
    try:
        return await handler(request)
    except OllamaError as error:
        if request.path.startswith("/v1/messages"):
            return _json(common.anthropic_error(error.status, error.message), status=error.status)
        if request.path.startswith("/v1/"):
            return openai_error(error.status, error.message)
        return _json({"error": error.message}, status=error.status)


def ollama_app(settings: OllamaSettings, engine: Engine) -> web.Application:
    """Ollama's HTTP surface over ``engine``."""
    server = OllamaServer(settings, engine)
    not_found = lambda: _plain("404 page not found", 404)  # noqa: E731
    not_allowed = lambda: _plain("405 method not allowed", 405)  # noqa: E731
    gets = {
        "/": server.root,
        "/api/version": server.version,
        "/api/tags": server.tags,
        "/api/ps": server.ps,
        "/v1/models": server.openai_models,
        "/v1/models/{model}": server.openai_model,
        "/_fake/last": server.last,
    }
    posts = {
        "/api/chat": server.chat,
        "/api/generate": server.generate,
        "/api/show": server.show,
        "/v1/chat/completions": server.openai_chat,
        "/v1/completions": server.openai_completion,
        "/v1/responses": server.responses,
        "/v1/messages": server.messages,
        "/v1/messages/count_tokens": server.count_tokens,
    }
    app = common.application([common.routing_errors(not_found, not_allowed), _ollama_errors], gets, posts)
    app.cleanup_ctx.append(server.lifetime)
    return app


def fake_ollama_app(settings: OllamaSettings = OllamaSettings(), train_ctx: int = 32768) -> web.Application:
    """The fake: Ollama's surface over the :class:`WhitespaceEngine`."""
    return ollama_app(settings, WhitespaceEngine(train_ctx))


def ollama_arguments(description: str, model: str, n_ctx: int) -> argparse.ArgumentParser:
    """The command-line options of both the fake and the simulator."""
    parser = common.common_arguments(description, port=11434, model=model, n_ctx=n_ctx)
    parser.add_argument("--num-keep", type=int, default=4, help="tokens kept at the head by the middle cut (default 4)")
    parser.add_argument("--native", action="store_true", help="/api/chat in native mode: overflow is a 400")
    parser.add_argument("--no-context-shift", action="store_true", help="as for deepseek2: overflow is a 400")
    return parser


def ollama_settings(args: argparse.Namespace) -> OllamaSettings:
    return OllamaSettings(
        model=args.model,
        num_ctx=args.n_ctx,
        num_keep=args.num_keep,
        native=args.native,
        context_shift=not args.no_context_shift,
        pacing=common.pacing(args),
    )


def main(argv: list[str] | None = None) -> None:
    parser = ollama_arguments("A fast deterministic fake Ollama.", model=OllamaSettings.model, n_ctx=OllamaSettings.num_ctx)
    parser.add_argument("--train-ctx", type=int, default=32768, help="trained length; caps num_ctx (default 32768)")
    args = parser.parse_args(argv)
    common.serve(fake_ollama_app(ollama_settings(args), args.train_ctx), args.port)


if __name__ == "__main__":
    main()
