"""A fast, deterministic fake llama-server (no model), to llamacpp.md §5.

It reproduces what a proxy depends on: the per-slot window with the exact
``exceed_context_size_error`` 400 (also for ``stream:true``), token counts that agree across
``/tokenize``, ``/apply-template``, ``/v1/chat/completions/input_tokens``, ``usage`` and the error,
a prefix cache per slot (``timings.cache_n``), generation capped by the room left in the window,
and the response formats with their streams (native, ``/v1/completions``, chat, Anthropic's
``/v1/messages`` and OpenAI's Responses API ``/v1/responses``). The model is :func:`scripted_reply`.

Tokenizer: ``<s> </s> <|im_start|> <|im_end|>`` are single special tokens (ids 1-4) when
``parse_special``; the rest splits as ``\\s*\\S+|\\s+\\Z`` (a word with its leading white space, and
trailing white space). Template: ChatML. BOS comes only from ``add_special``.

Run: ``PYTHONPATH=tests python -m support.fake_llamacpp --port 8080 --n-ctx 2048``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .common import (
    SSE_DONE,
    LazyStream,
    Pacing,
    Vocabulary,
    anthropic_chat,
    application,
    common_arguments,
    compact_json,
    context_overflow_error,
    named_sse,
    pacing,
    routing_errors,
    scripted_reply,
    serve,
    sse,
)

BOS = 1
SPECIAL_TOKENS = {"<s>": BOS, "</s>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
_SPECIAL = re.compile("(" + "|".join(map(re.escape, SPECIAL_TOKENS)) + ")")
_PIECE = re.compile(r"\s*\S+|\s+\Z")
FINGERPRINT = "b0-fake"
SLOT_PROMPT_SIMILARITY = 0.1


@dataclass(frozen=True)
class LlamaSettings:
    model: str = "fake-model"
    n_ctx: int = 4096
    slots: int = 1
    pacing: Pacing = field(default_factory=Pacing)
    n_ctx_train: int | None = None
    """The model's trained length in /v1/models (None: n_ctx); a larger one stands for a context
    that --fit or -np made smaller than the model's."""


class Tokenizer:
    """One deterministic tokenizer behind every endpoint, so all the counts agree."""

    def __init__(self) -> None:
        self._vocab = Vocabulary(SPECIAL_TOKENS)

    def pieces(self, text: str, parse_special: bool = True) -> list[str]:
        parts = _SPECIAL.split(text) if parse_special else [text]
        return [piece for part in parts for piece in ([part] if part in SPECIAL_TOKENS else _PIECE.findall(part))]

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        return [BOS] * add_special + self._vocab.ids(self.pieces(text, parse_special))

    def detokenize(self, tokens: list[int]) -> str:
        return "".join(self._vocab.pieces(tokens))


def _text(content: Any) -> str:
    """OpenAI message content: a string, null, or a list of parts of which the text ones count."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return content or ""


def _role(message: dict[str, Any]) -> str:
    """The role the template sees: llama-server's chat parsing turns ``developer`` into ``system``
    (seen on the real server's ``/apply-template``)."""
    role = message["role"]
    return "system" if role == "developer" else role


def render_chatml(body: dict[str, Any]) -> str:
    """The fake's chat template; tools become one system preamble, as llamacpp.md §5 specifies."""
    messages = list(body["messages"])
    if body.get("tools"):
        messages.insert(0, {"role": "system", "content": json.dumps(body["tools"])})
    prompt = "".join(f"<|im_start|>{_role(m)}\n{_text(m.get('content'))}<|im_end|>\n" for m in messages)
    if body.get("add_generation_prompt", True):
        prompt += "<|im_start|>assistant\n"
    return prompt


class RequestError(Exception):
    """An error answered as llama-server does, ``{"error":{"code","message","type"}}``."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.body = {"error": {"code": status, "message": message, "type": kind}}
        self.status = status


# --- OpenAI's Responses API, converted to a chat request -----------------------------------------
#
# As llama-server's server_chat_convert_responses_to_chatcmpl() (tools/server/server-chat.cpp) does,
# with its error messages; each was checked against the real server (build 11434). Unlike OpenAI,
# an item of an unknown type is a 400, not ignored, and so is a shorthand assistant message
# without ``"type": "message"``.


def _invalid(message: str) -> RequestError:
    return RequestError(400, message, "invalid_request_error")


def _is(item: Any, key: str, kind: type) -> bool:
    return isinstance(item, dict) and isinstance(item.get(key), kind)


def _input_parts(parts: list[Any]) -> list[dict[str, Any]]:
    """A user, system or developer message's parts as chat content parts."""
    converted = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_text":
            if "text" not in part:
                raise _invalid("'Input text' requires 'text'")
            converted.append({"text": part["text"], "type": "text"})
        elif kind == "input_image":
            if "image_url" not in part:
                raise _invalid("'image_url' is required")
            converted.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
        elif kind == "input_file":
            raise _invalid("'input_file' is not supported by llamacpp at this moment")
        else:
            raise _invalid("'type' must be one of 'input_text', 'input_image', or 'input_file'")
    return converted


def _output_parts(content: Any) -> list[dict[str, Any]]:
    """An assistant message's parts (``output_text``, ``input_text`` or ``refusal``) as chat parts."""
    if isinstance(content, str):
        return [{"text": content, "type": "text"}]
    converted = []
    for part in content if isinstance(content, list) else []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("output_text", "input_text"):
            if not _is(part, "text", str):
                raise _invalid("'Output text' requires 'text'")
            converted.append({"text": part["text"], "type": "text"})
        elif kind == "refusal":
            if not _is(part, "refusal", str):
                raise _invalid("'Refusal' requires 'refusal'")
            converted.append({"refusal": part["refusal"], "type": "refusal"})
        else:
            raise _invalid("'type' must be one of 'output_text' or 'refusal'")
    return converted


def _input_item(messages: list[dict[str, Any]], item: Any) -> None:
    """Append one input item to the chat ``messages``; an assistant item right after an assistant
    message (a function call, a reasoning item, more text) is merged into it."""
    merge = bool(messages) and messages[-1].get("role") == "assistant"
    if _is(item, "content", str):
        item = {**item, "content": [{"text": item["content"], "type": "input_text"}]}
    kind = item.get("type") if isinstance(item, dict) else None
    if _is(item, "content", list) and _is(item, "role", str) and item["role"] in ("user", "system", "developer"):
        message = {k: v for k, v in item.items() if k not in ("type", "status")}
        messages.append({**message, "content": _input_parts(item["content"])})
    elif _is(item, "role", str) and item["role"] == "assistant" and kind == "message":
        parts = _output_parts(item.get("content"))
        if merge:
            previous = messages[-1]
            previous["content"] = [*(previous["content"] if isinstance(previous.get("content"), list) else []), *parts]
        else:
            messages.append({**{k: v for k, v in item.items() if k not in ("type", "status")}, "content": parts})
    elif kind == "function_call" and all(_is(item, key, str) for key in ("arguments", "call_id", "name")):
        call = {"function": {"arguments": item["arguments"], "name": item["name"]}, "id": item["call_id"], "type": "function"}
        if merge:
            previous = messages[-1]
            previous["tool_calls"] = [*(previous["tool_calls"] if isinstance(previous.get("tool_calls"), list) else []), call]
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output" and _is(item, "call_id", str) and isinstance(item.get("output"), str | list):
        output = item["output"]
        if isinstance(output, list):
            if not all(isinstance(part, dict) and part.get("type") == "input_text" for part in output):
                raise _invalid("Output of tool call should be 'Input text'")
            output = [{**part, "type": "text"} for part in output]
        messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})
    elif kind == "reasoning" and _is(item, "summary", list):
        content = item.get("content")
        if not isinstance(content, list):
            raise _invalid("item['content'] is not an array")
        if not content:
            raise _invalid("item['content'] is empty")
        if not _is(content[0], "text", str):
            raise _invalid("item['content']['text'] is not a string")
        if merge:
            messages[-1]["reasoning_content"] = content[0]["text"]
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": content[0]["text"]})
    else:
        raise _invalid("Cannot determine type of 'item'")


def responses_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses API request as the chat request llama-server turns it into: ``instructions``
    first as a system message, then the ``input`` string or items; function tools only (with
    ``strict`` defaulting to true), ``max_output_tokens`` as ``max_tokens``, ``reasoning.effort``
    as ``reasoning_effort``. Every other field passes through to the chat path."""
    if "input" not in body:
        raise _invalid("'input' is required")
    previous = body.get("previous_response_id")
    if isinstance(previous, str) and previous:
        raise _invalid("llama.cpp does not support 'previous_response_id'.")
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions", "tools", "max_output_tokens", "reasoning")}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        instructions = body["instructions"]
        messages.append({"role": "system", "content": instructions if isinstance(instructions, str) else ""})
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            _input_item(messages, item)
    else:
        raise _invalid("'input' must be a string or array of objects")
    chat["messages"] = messages
    if "tools" in body:
        if not isinstance(body["tools"], list):
            raise _invalid("'tools' must be an array of objects")
        functions = [
            {"type": "function", "function": {"strict": True, **{k: v for k, v in tool.items() if k != "type"}}}
            for tool in body["tools"]
            if isinstance(tool, dict) and tool.get("type") == "function"  # others are skipped with a warning
        ]
        if functions:
            chat["tools"] = functions
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and "effort" in reasoning:
        chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(text=compact_json(value), status=status, content_type="application/json", charset="utf-8")


@dataclass
class Slot:
    index: int
    cached: list[int] = field(default_factory=list)
    busy: bool = False
    last_used: int = 0


class Slots:
    """The server's slots: a request waits (sending nothing) until one is idle, and takes the idle
    slot whose cache shares the longest prefix with its prompt if that covers more than a tenth
    of it (``--slot-prompt-similarity``), else the least recently used one."""

    def __init__(self, count: int) -> None:
        self._slots = [Slot(i) for i in range(count)]
        self._idle = asyncio.Condition()
        self._clock = itertools.count(1)

    @asynccontextmanager
    async def claim(self, tokens: list[int]) -> AsyncIterator[Slot]:
        async with self._idle:
            await self._idle.wait_for(lambda: any(not s.busy for s in self._slots))
            idle = [s for s in self._slots if not s.busy]
            slot = max(idle, key=lambda s: common_prefix(s.cached, tokens))
            if common_prefix(slot.cached, tokens) <= SLOT_PROMPT_SIMILARITY * len(tokens):
                slot = min(idle, key=lambda s: s.last_used)
            slot.busy = True
        try:
            yield slot
        finally:
            async with self._idle:
                slot.busy, slot.last_used = False, next(self._clock)
                self._idle.notify()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass
class Completion:
    """One finished generation, in the terms of llama-server's result objects."""

    n_prompt: int
    n_cached: int
    pieces: list[str]
    tokens: list[int]
    hit_window: bool
    stopped_by_limit: bool
    prompt_text: str
    slot: int

    @property
    def content(self) -> str:
        return "".join(self.pieces)

    @property
    def finish_reason(self) -> str:
        return "length" if self.stopped_by_limit else "stop"

    def usage(self) -> dict[str, Any]:
        n = len(self.pieces)
        return {
            "completion_tokens": n,
            "prompt_tokens": self.n_prompt,
            "total_tokens": n + self.n_prompt,
            "prompt_tokens_details": {"cached_tokens": self.n_cached},
        }

    def timings(self) -> dict[str, Any]:
        """Synthetic but consistent: 0.5 ms per prompt token evaluated, 5 ms per generated token."""
        prompt_n, predicted_n = self.n_prompt - self.n_cached, len(self.pieces)
        prompt_ms, predicted_ms = 0.5 * prompt_n, 5.0 * predicted_n
        return {
            "cache_n": self.n_cached,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": 0.5,
            "prompt_per_second": 2000.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": 5.0,
            "predicted_per_second": 200.0,
        }


class ResponseFormat(ABC):
    """How one endpoint encodes partial and final results (llamacpp.md §4.1-4.3)."""

    done_marker = True
    named_events = False
    """Stream events carry an ``event:`` line (Anthropic's)."""

    def __init__(self, model: str, completion_id: str, body: dict[str, Any]) -> None:
        self.model = model
        self.id = completion_id
        self.created = int(time.time())
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.n_cached = 0
        """Prompt tokens served from the slot's cache (known once a slot is claimed)."""

    @abstractmethod
    def partial(self, piece: str, token: int, decoded: int, n_prompt: int) -> list[dict[str, Any]]:
        """The events for the ``decoded``-th generated piece."""

    @abstractmethod
    def final_events(self, done: Completion) -> list[dict[str, Any]]:
        """The events that end a stream (before any ``[DONE]``)."""

    @abstractmethod
    def whole(self, done: Completion) -> dict[str, Any]:
        """The non-streamed body."""


class NativeFormat(ResponseFormat):
    """``/completion``: bare JSON events and no ``[DONE]``."""

    done_marker = False

    def partial(self, piece: str, token: int, decoded: int, n_prompt: int) -> list[dict[str, Any]]:
        return [
            {
                "index": 0,
                "content": piece,
                "tokens": [token],
                "stop": False,
                "id_slot": -1,
                "tokens_predicted": decoded,
                "tokens_evaluated": n_prompt,
            }
        ]

    def final_events(self, done: Completion) -> list[dict[str, Any]]:
        return [self._final(done, content="", tokens=[])]

    def whole(self, done: Completion) -> dict[str, Any]:
        return self._final(done, content=done.content, tokens=[])

    def _final(self, done: Completion, content: str, tokens: list[int]) -> dict[str, Any]:
        return {
            "index": 0,
            "content": content,
            "tokens": tokens,
            "id_slot": done.slot,
            "stop": True,
            "model": self.model,
            "tokens_predicted": len(done.pieces),
            "tokens_evaluated": done.n_prompt,
            "generation_settings": {"n_predict": -1, "stream": False},
            "prompt": done.prompt_text,
            "has_new_line": "\n" in done.content,
            "truncated": done.hit_window,
            "stop_type": "limit" if done.stopped_by_limit else "eos",
            "stopping_word": "",
            "tokens_cached": done.n_prompt + len(done.pieces),
            "timings": done.timings(),
        }


class TextCompletionFormat(ResponseFormat):
    """``/v1/completions``: the final chunk always carries ``usage``."""

    def _chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "object": "text_completion",
        }

    def partial(self, piece: str, token: int, decoded: int, n_prompt: int) -> list[dict[str, Any]]:
        return [{**self._chunk(piece, None), "id": self.id}]

    def final_events(self, done: Completion) -> list[dict[str, Any]]:
        return [self._final(done, "")]

    def whole(self, done: Completion) -> dict[str, Any]:
        return self._final(done, done.content)

    def _final(self, done: Completion, text: str) -> dict[str, Any]:
        return {
            **self._chunk(text, done.finish_reason),
            "usage": done.usage(),
            "id": self.id,
            "timings": done.timings(),
        }


class ChatFormat(ResponseFormat):
    """``/v1/chat/completions``: a role chunk, content chunks, a finish chunk, an optional usage
    chunk; ``timings`` ride on the last one."""

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "choices": choices,
            "created": self.created,
            "id": self.id,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "object": "chat.completion.chunk",
        }

    def _delta(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return self._chunk([{"finish_reason": finish_reason, "index": 0, "delta": delta}])

    def partial(self, piece: str, token: int, decoded: int, n_prompt: int) -> list[dict[str, Any]]:
        role = [self._delta({"role": "assistant", "content": None})] if decoded == 1 else []
        return [*role, self._delta({"content": piece})]

    def final_events(self, done: Completion) -> list[dict[str, Any]]:
        events = [self._delta({}, done.finish_reason)]
        if self.include_usage:
            events.append({**self._chunk([]), "usage": done.usage()})
        events[-1]["timings"] = done.timings()
        return events

    def whole(self, done: Completion) -> dict[str, Any]:
        return {
            "choices": [
                {
                    "finish_reason": done.finish_reason,
                    "index": 0,
                    "message": {"role": "assistant", "content": done.content},
                }
            ],
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "object": "chat.completion",
            "usage": done.usage(),
            "id": self.id,
            "timings": done.timings(),
        }


class MessagesFormat(ResponseFormat):
    """``/v1/messages``: Anthropic's named events; the prompt size is on ``message_start`` only,
    split into new and cached tokens, and ``message_delta`` carries the output count."""

    done_marker = False
    named_events = True

    def _message(self, content: list[dict[str, Any]], done: Completion | None, n_prompt: int, n_cached: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": None if done is None else self._stop(done),
            "stop_sequence": None,
            "usage": {
                "cache_read_input_tokens": n_cached,
                "input_tokens": n_prompt - n_cached,
                "output_tokens": 0 if done is None else len(done.pieces),
            },
        }

    @staticmethod
    def _stop(done: Completion) -> str:
        return "max_tokens" if done.stopped_by_limit else "end_turn"

    def _start(self, n_prompt: int, n_cached: int) -> list[dict[str, Any]]:
        return [
            {"type": "message_start", "message": self._message([], None, n_prompt, n_cached)},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ]

    def partial(self, piece: str, token: int, decoded: int, n_prompt: int) -> list[dict[str, Any]]:
        start = self._start(n_prompt, self.n_cached) if decoded == 1 else []
        return [*start, {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}]

    def final_events(self, done: Completion) -> list[dict[str, Any]]:
        start = [] if done.pieces else self._start(done.n_prompt, done.n_cached)
        return [
            *start,
            {"type": "content_block_stop", "index": 0},
            {
                "type": "message_delta",
                "delta": {"stop_reason": self._stop(done), "stop_sequence": None},
                "usage": {"output_tokens": len(done.pieces)},
            },
            {"type": "message_stop"},
        ]

    def whole(self, done: Completion) -> dict[str, Any]:
        return self._message([{"type": "text", "text": done.content}], done, done.n_prompt, done.n_cached)


class ResponsesFormat(ResponseFormat):
    """``/v1/responses`` (``to_json_oaicompat_resp[_stream]`` in server-task.cpp, and the real
    server's bytes): named events whose ``event:`` is the data's ``type``, and no ``[DONE]``.

    As the real server sends them, the events carry no ``sequence_number``, ``output_index`` or
    ``content_index``, ``response.created`` and ``response.in_progress`` hold only ``id``,
    ``object`` and ``status``, the final ``response.completed`` holds the whole response with
    ``usage`` (and ``timings`` beside it), and the buffered body has no ``timings``. The openai
    SDK's typed events parse, but its ``responses.stream()`` helper fails on the missing indices.
    """

    done_marker = False
    named_events = True

    def __init__(self, model: str, completion_id: str, body: dict[str, Any]) -> None:
        super().__init__(model, completion_id, body)
        number = completion_id.rsplit("-", 1)[-1]
        self.id = f"resp_{number}"
        self.message_id = f"msg_{number}"

    def _head(self, kind: str) -> dict[str, Any]:
        return {"type": kind, "response": {"id": self.id, "object": "response", "status": "in_progress"}}

    def _start(self) -> list[dict[str, Any]]:
        return [
            self._head("response.created"),
            self._head("response.in_progress"),
            {
                "type": "response.output_item.added",
                "item": {"content": [], "id": self.message_id, "role": "assistant", "status": "in_progress", "type": "message"},
            },
            {"type": "response.content_part.added", "item_id": self.message_id, "part": {"type": "output_text", "text": ""}},
        ]

    @staticmethod
    def usage(done: Completion) -> dict[str, Any]:
        n = len(done.pieces)
        return {
            "input_tokens": done.n_prompt,
            "output_tokens": n,
            "total_tokens": n + done.n_prompt,
            "input_tokens_details": {"cached_tokens": done.n_cached},
        }

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}

    def partial(self, piece: str, token: int, decoded: int, n_prompt: int) -> list[dict[str, Any]]:
        start = self._start() if decoded == 1 else []
        return [*start, {"type": "response.output_text.delta", "item_id": self.message_id, "delta": piece}]

    def final_events(self, done: Completion) -> list[dict[str, Any]]:
        events = [] if done.pieces else self._start()[:2]
        output = []
        if done.content:
            part = self._part(done.content)
            item = {"type": "message", "status": "completed", "id": self.message_id, "content": [part], "role": "assistant"}
            events += [
                {"type": "response.output_text.done", "item_id": self.message_id, "text": done.content},
                {"type": "response.content_part.done", "item_id": self.message_id, "part": part},
                {"type": "response.output_item.done", "item": item},
            ]
            output.append(item)
        response = {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed",
            "model": self.model,
            "output": output,
            "usage": self.usage(done),
        }
        return [*events, {"type": "response.completed", "response": response, "timings": done.timings()}]

    def whole(self, done: Completion) -> dict[str, Any]:
        now = int(time.time())
        item = {"content": [self._part(done.content)], "id": self.message_id, "role": "assistant", "status": "completed", "type": "message"}
        return {
            "completed_at": now,
            "created_at": now,
            "id": self.id,
            "model": self.model,
            "object": "response",
            "output": [item] if done.content else [],
            "status": "completed",
            "usage": self.usage(done),
        }


def _n_predict(body: dict[str, Any]) -> int:
    """The first integer of ``n_predict``, ``max_completion_tokens``, ``max_tokens``; -1 if none (the
    server's ``json_value`` takes a value of the wrong type as absent)."""
    keys = ("n_predict", "max_completion_tokens", "max_tokens")
    value = next((body[k] for k in keys if isinstance(body.get(k), int) and not isinstance(body[k], bool)), -1)
    if value < -1:
        raise RequestError(
            400,
            f"Field 'n_predict': Value must be between -1 <= value <= 2147483647, but got {value}",
            "invalid_request_error",
        )
    return value


class FakeLlamaServer:
    """The routes; state is the tokenizer table and the slots."""

    def __init__(self, settings: LlamaSettings) -> None:
        self.settings = settings
        self.loaded_at = int(time.time())
        """What /v1/models says was created: fixed, so two listings are byte for byte the same."""
        self.tokenizer = Tokenizer()
        self.slots = Slots(settings.slots)
        self._ids = itertools.count(1)

    async def body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as error:
            raise RequestError(400, f"Invalid JSON: {error}", "invalid_request_error") from None
        if not isinstance(body, dict):
            raise RequestError(400, "Invalid request body", "invalid_request_error")
        return body

    def chat_prompt(self, body: dict[str, Any]) -> str:
        if "messages" not in body:
            raise RequestError(400, "'messages' is required", "invalid_request_error")
        return render_chatml(body)

    def prompt_tokens(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if prompt is None:
            raise RequestError(500, '"prompt" is required', "server_error")
        if isinstance(prompt, list):
            return list(prompt)
        return self.tokenizer.tokenize(prompt, add_special=True)

    # --- informational routes -------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def props(self, request: web.Request) -> web.Response:
        s = self.settings
        return _json(
            {
                "default_generation_settings": {
                    "params": {
                        "n_predict": -1,
                        "max_tokens": -1,
                        "n_keep": 0,
                        "n_discard": 0,
                        "stream": False,
                        "temperature": 0.8,
                    },
                    "n_ctx": s.n_ctx,
                },
                "total_slots": s.slots,
                "model_alias": s.model,
                "model_path": f"/models/{s.model}.gguf",
                "chat_template": "<chatml>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "build_info": FINGERPRINT,
                "is_sleeping": False,
                "endpoint_slots": True,
                "endpoint_metrics": False,
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        name = self.settings.model
        meta = {
            "vocab_type": 2,
            "n_vocab": 32000,
            "n_ctx": self.settings.n_ctx,
            "n_ctx_train": self.settings.n_ctx_train or self.settings.n_ctx,
            "n_embd": 64,
            "n_params": 1,
            "size": 1,
        }
        return _json(
            {
                "models": [{"name": name, "model": name, "type": "model", "capabilities": ["completion"]}],
                "object": "list",
                "data": [{"id": name, "object": "model", "created": self.loaded_at, "owned_by": "llamacpp", "meta": meta}],
            }
        )

    async def slot_list(self, request: web.Request) -> web.Response:
        """/slots: each slot's window, as llama-server lists them (its other fields left out)."""
        return _json([{"id": i, "n_ctx": self.settings.n_ctx, "is_processing": False} for i in range(self.settings.slots)])

    # --- counting routes ------------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        text = body.get("content", "")
        parse_special = body.get("parse_special", True)
        tokens = self.tokenizer.tokenize(text, body.get("add_special", False), parse_special)
        if body.get("with_pieces"):
            return _json({"tokens": [{"id": t, "piece": self.tokenizer.detokenize([t])} for t in tokens]})
        return _json({"tokens": tokens})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        return _json({"content": self.tokenizer.detokenize(body.get("tokens", []))})

    async def apply_template(self, request: web.Request) -> web.Response:
        return _json({"prompt": self.chat_prompt(await self.body(request))})

    async def input_tokens(self, request: web.Request) -> web.Response:
        prompt = self.chat_prompt(await self.body(request))
        count = len(self.tokenizer.tokenize(prompt, add_special=True))
        return _json({"input_tokens": count, "object": "response.input_tokens"})

    async def responses_input_tokens(self, request: web.Request) -> web.Response:
        """``/v1/responses/input_tokens``: exactly what ``/v1/responses`` would evaluate."""
        prompt = self.chat_prompt(responses_chat(await self.body(request)))
        count = len(self.tokenizer.tokenize(prompt, add_special=True))
        return _json({"input_tokens": count, "object": "response.input_tokens"})

    def messages_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """An Anthropic request as the chat request the server converts it to."""
        if not isinstance(body.get("messages"), list):
            raise RequestError(400, "'messages' is required", "invalid_request_error")
        return {**body, "messages": anthropic_chat(body)}

    async def count_tokens(self, request: web.Request) -> web.Response:
        prompt = self.chat_prompt(self.messages_body(await self.body(request)))
        return _json({"input_tokens": len(self.tokenizer.tokenize(prompt, add_special=True))})

    # --- generation routes ----------------------------------------------------------------

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await self.body(request)
        return await self.generate(request, body, self.prompt_tokens(body), NativeFormat)

    async def text_completion(self, request: web.Request) -> web.StreamResponse:
        body = await self.body(request)
        return await self.generate(request, body, self.prompt_tokens(body), TextCompletionFormat)

    async def chat_completion(self, request: web.Request) -> web.StreamResponse:
        body = await self.body(request)
        tokens = self.tokenizer.tokenize(self.chat_prompt(body), add_special=True)
        return await self.generate(request, body, tokens, ChatFormat)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = self.messages_body(await self.body(request))
        tokens = self.tokenizer.tokenize(self.chat_prompt(body), add_special=True)
        return await self.generate(request, body, tokens, MessagesFormat)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = responses_chat(await self.body(request))
        tokens = self.tokenizer.tokenize(self.chat_prompt(body), add_special=True)
        return await self.generate(request, body, tokens, ResponsesFormat)

    async def generate(
        self, request: web.Request, body: dict[str, Any], tokens: list[int], kind: type[ResponseFormat]
    ) -> web.StreamResponse:
        """Slot, overflow check, prefix cache, generation budget, then the response (llamacpp.md §5)."""
        n_predict = _n_predict(body)
        encoder = kind(self.settings.model, f"chatcmpl-{next(self._ids):032d}", body)
        stream = bool(body.get("stream"))
        async with self.slots.claim(tokens) as slot:
            n_ctx = self.settings.n_ctx
            if len(tokens) >= n_ctx:
                return _json(context_overflow_error(len(tokens), n_ctx), status=400)
            n_cached = min(common_prefix(slot.cached, tokens), len(tokens) - 1) if body.get("cache_prompt", True) else 0
            room = n_ctx - len(tokens)
            budget = room if n_predict == -1 else min(n_predict, room)
            reply = self.tokenizer.pieces(scripted_reply(self.tokenizer.detokenize(tokens)))
            pieces = reply[:budget]
            generated = self.tokenizer.tokenize("".join(pieces), add_special=False)
            slot.cached = tokens + generated
            encoder.n_cached = n_cached
            done = Completion(
                n_prompt=len(tokens),
                n_cached=n_cached,
                pieces=pieces,
                tokens=generated,
                hit_window=len(reply) > room and budget == room,
                stopped_by_limit=len(reply) > budget,
                prompt_text=self.tokenizer.detokenize(tokens),
                slot=slot.index,
            )
            if stream:
                return await self._stream(request, encoder, done)
            for index in range(len(pieces)):
                await self.settings.pacing.before_token(index)
            return _json(encoder.whole(done))

    async def _stream(self, request: web.Request, encoder: ResponseFormat, done: Completion) -> web.StreamResponse:
        out = LazyStream(request, "text/event-stream", {"X-Accel-Buffering": "no"})
        for index, (piece, token) in enumerate(zip(done.pieces, done.tokens, strict=True)):
            await self.settings.pacing.before_token(index)
            for event in encoder.partial(piece, token, index + 1, done.n_prompt):
                await out.write(named_sse(event) if encoder.named_events else sse(event))
        for event in encoder.final_events(done):
            await out.write(named_sse(event) if encoder.named_events else sse(event))
        if encoder.done_marker:
            await out.write(SSE_DONE)
        return await out.close()


def _not_found() -> web.Response:
    return _json({"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}, status=404)


@web.middleware
async def _request_errors(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as error:
        return _json(error.body, status=error.status)


def fake_llamacpp_app(settings: LlamaSettings = LlamaSettings()) -> web.Application:
    """An aiohttp app imitating llama-server; serve it with :func:`support.common.running`."""
    server = FakeLlamaServer(settings)
    gets = {
        "/health": server.health,
        "/v1/health": server.health,
        "/props": server.props,
        "/v1/models": server.models,
        "/models": server.models,
        "/slots": server.slot_list,
    }
    posts = {
        "/tokenize": server.tokenize,
        "/detokenize": server.detokenize,
        "/apply-template": server.apply_template,
        "/v1/chat/completions/input_tokens": server.input_tokens,
        "/chat/completions/input_tokens": server.input_tokens,
        "/completion": server.completion,
        "/completions": server.completion,
        "/v1/completions": server.text_completion,
        "/v1/chat/completions": server.chat_completion,
        "/chat/completions": server.chat_completion,
        "/v1/messages": server.messages,
        "/v1/messages/count_tokens": server.count_tokens,
        "/v1/responses": server.responses,
        "/responses": server.responses,
        "/v1/responses/input_tokens": server.responses_input_tokens,
        "/responses/input_tokens": server.responses_input_tokens,
    }
    return application([routing_errors(_not_found, _not_found), _request_errors], gets, posts)


def main(argv: list[str] | None = None) -> None:
    parser = common_arguments("A fast deterministic fake llama-server.", port=8080, model="fake-model", n_ctx=4096)
    parser.add_argument("--slots", type=int, default=1, help="parallel slots, each with its own window (default 1)")
    parser.add_argument("--n-ctx-train", type=int, default=None, help="the model's trained length (default: --n-ctx)")
    args = parser.parse_args(argv)
    settings = LlamaSettings(model=args.model, n_ctx=args.n_ctx, slots=args.slots, pacing=pacing(args), n_ctx_train=args.n_ctx_train)
    serve(fake_llamacpp_app(settings), args.port)


if __name__ == "__main__":
    main()
