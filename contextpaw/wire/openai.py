"""The OpenAI-compatible API both backends serve: `/v1/chat/completions` and `/v1/completions`.

Streams are SSE ending with `data: [DONE]`; `stream` defaults to false. The request cannot name a
window, only the answer length. Errors are `{"error": {"message", "type", "code", ...}}`, the shape
OpenAI clients raise from. A refusal is OpenAI's own answer to an overlong prompt, a 400
`invalid_request_error` with code `context_length_exceeded` and OpenAI's own sentence with its
numbers: Codex reacts to the code; LiteLLM (aider), Cline and opencode to the text ("This model's
maximum context length is N tokens ..."); a 413 reads to all of them as a size limit. ContextPaw's
own words follow that sentence.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from contextpaw.core.conversation import Conversation
from contextpaw.wire import served
from contextpaw.wire.base import EVALUATED_KEYS, Chat, NotCompactable, Overflow, Prompt, Route, answer_params, load, write

MAX_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "n_predict")
"""llama-server reads `n_predict` too; all three mean the same limit."""


def _chat(body: dict[str, Any]) -> Chat:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise NotCompactable("messages is not a list")
    return Chat(body, Conversation.from_wire(messages, body.get("tools")), answer_params(body, *MAX_OUTPUT_FIELDS))


def _completion(body: dict[str, Any]) -> Prompt:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise NotCompactable("only a single string prompt can be compacted")
    return Prompt(body, prompt, answer_params(body, *MAX_OUTPUT_FIELDS))


def overlong(overflow: Overflow) -> str:
    """OpenAI's sentence for a prompt over the window, with its numbers: the window, and what was
    asked of it, the messages and the room kept for the answer (and the template) beside them. Its
    maximum is the window, never the budget (a 4,096-token window was said to be 3,008)."""
    room = max(overflow.window - overflow.budget, 0)
    return (
        f"This model's maximum context length is {overflow.window} tokens. However, you requested "
        f"{overflow.required + room} tokens ({overflow.required} in the messages, {room} in the completion). "
        "Please reduce the length of the messages or completion."
    )


def refusal(param: str, opening: str = "") -> Callable[[Overflow, dict[str, Any]], dict[str, Any]]:
    """OpenAI's overflow error naming `param` (the field that holds the prompt): `opening` (an
    API's own sentence, where it has one), OpenAI's sentence with the numbers, then ContextPaw's;
    the numbers and report beside it."""

    def refuse(overflow: Overflow, report: dict[str, Any]) -> dict[str, Any]:
        error = {
            "message": " ".join(s for s in (opening, overlong(overflow), overflow.message) if s),
            "type": "invalid_request_error",
            "param": param,
            "code": "context_length_exceeded",
            "n_prompt_tokens": overflow.required,
            "budget": overflow.budget,
            "num_ctx": overflow.window,
        }
        return {"error": error, "contextpaw": report}

    return refuse


PROXY_CODES = {
    400: "invalid_request",
    403: "forbidden",
    413: "request_too_large",
    431: "request_header_too_large",
    503: "backend_unavailable",
    504: "backend_timeout",
}


def proxy_error(reason: str, status: int) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "api_error"
    return {"error": {"message": reason, "type": kind, "param": None, "code": PROXY_CODES.get(status, "backend_unreachable")}}


def _is_final(record: Mapping[str, Any]) -> bool:
    """The finish chunk or the usage chunk: nothing but the report may follow them."""
    choices = record.get("choices")
    if not isinstance(choices, list):
        return False
    return not choices or any(isinstance(c, Mapping) and c.get("finish_reason") for c in choices)


TELLING = re.compile(EVALUATED_KEYS + rb'|"finish_reason"\s*:\s*[^n\s]|"choices"\s*:\s*\[\s*\]')
"""A finish reason that is not null, no choices, or a count: a token chunk has none of them."""
USAGE = (("usage", "prompt_tokens"), ("usage", "total_tokens"))
CHAT = Route("openai.chat", _chat, refusal("messages"), proxy_error, "sse", _is_final, prompt_counts=USAGE, telling=TELLING)
COMPLETIONS = Route(
    "openai.completions", _completion, refusal("prompt"), proxy_error, "sse", _is_final, prompt_counts=USAGE, telling=TELLING
)


# -- the usage a stream carries only when asked for -------------------------------------------------
# A streamed chat answer says how many prompt tokens were evaluated only in a usage chunk, and that
# chunk comes only when the request asks for it (`stream_options.include_usage`). ContextPaw asks for
# it where the client did not (the verdict and calibration need the count), and takes the chunk out
# again, so that the client gets the stream it asked for (`contextpaw.fitting.answers`, `contextpaw.wire.streams`).

USAGE_OPTION = b'"stream_options":{"include_usage":true}'


def usage_asked(body: Mapping[str, Any]) -> bool:
    """Whether a request asks for the stream's usage chunk itself."""
    options = body.get("stream_options")
    return isinstance(options, Mapping) and options.get("include_usage") is True


def asking_usage(raw: bytes, client: Mapping[str, Any]) -> bytes:
    """`raw`, the bytes of a streamed chat request that does not ask for usage, asking for it
    (`client`: the client's body, for its own `stream_options`).

    Without `stream_options` of its own (the common case) the option goes first in the object and
    every other byte stays as it was, nothing parsed; beside the client's own options it joins
    them, and the body is written again."""
    if "stream_options" not in client:
        start = raw.index(b"{") + 1
        comma = b"" if raw[start:].lstrip().startswith(b"}") else b","
        return raw[:start] + USAGE_OPTION + comma + raw[start:]
    body = load(raw)
    options = body.get("stream_options")
    return write(body, stream_options={**(options if isinstance(options, Mapping) else {}), "include_usage": True})


def is_usage_chunk(record: Mapping[str, Any]) -> bool:
    """The chunk `include_usage` adds at the end of a chat stream: no choices, the usage."""
    return record.get("choices") == [] and isinstance(record.get("usage"), Mapping)


# -- the served window on the model list ---------------------------------------------------------
# `GET /v1/models` (and `/v1/models/{id}`) say nothing of the window on Ollama, and on llama-server
# only in `meta` (`n_ctx`, the whole cache, and `n_ctx_train`, the model file's length). Clients
# read `context_length` (llama-swap, OpenRouter), `max_model_len` (vLLM) or `meta.n_ctx` /
# `meta.n_ctx_train` (llama.cpp front-ends): each model gets the first two, and any of them that
# says more than the served window is lowered to it (one that says less, as llama-swap may, stays).

WINDOW_FIELDS = ("context_length", "max_model_len")
META_WINDOWS = ("n_ctx", "n_ctx_train")


def _models(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The model objects of a list (`data`) or the one model `/v1/models/{id}` answers."""
    data = body.get("data")
    entries = data if isinstance(data, list) else [body]
    return [e for e in entries if isinstance(e, Mapping) and isinstance(e.get("id"), str)]


def model_ids(body: Any) -> list[str]:
    """The ids of the models an answer lists (one for `/v1/models/{id}`)."""
    return [e["id"] for e in _models(body)] if isinstance(body, Mapping) else []


def _with_window(model: Mapping[str, Any], window: int) -> dict[str, Any]:
    meta = model.get("meta")
    meta = meta if isinstance(meta, Mapping) else None
    told = [meta[k] for k in META_WINDOWS if meta is not None and served.lowered(meta.get(k), window)]
    told += [model[k] for k in WINDOW_FIELDS if served.lowered(model.get(k), window)]
    updated = {**model, **{k: window for k in WINDOW_FIELDS if k not in model or served.lowered(model[k], window)}}
    if meta is not None:
        updated["meta"] = {**meta, **{k: window for k in META_WINDOWS if served.lowered(meta.get(k), window)}}
    updated["contextpaw"] = served.note(window, max(told, default=None))
    return updated


def models_with_windows(body: dict[str, Any], windows: Mapping[str, int]) -> dict[str, Any]:
    """`body` with each model whose window is known (by id in `windows`) saying it in every field
    clients read; other models and fields as they were."""

    def fitted(entry: Any) -> Any:
        window = windows.get(str(entry.get("id"))) if isinstance(entry, Mapping) else None
        return _with_window(entry, window) if window else entry

    data = body.get("data")
    if isinstance(data, list):
        return {**body, "data": [fitted(e) for e in data]}
    return dict(fitted(body))
