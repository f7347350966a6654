"""Ollama's native API: `/api/chat` and `/api/generate`.

Streams are NDJSON and end with a `done: true` object; `stream` defaults to true. The window is the
request's `options.num_ctx` when it sets one. Errors are `{"error": "<sentence>"}`: most clients read
only that string, so a refusal says everything there and adds the report beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from contextpaw.conversation import Conversation
from contextpaw.wire.base import Chat, NotCompactable, Overflow, Params, Prompt, Route, int_field, positive


def _params(body: Mapping[str, Any]) -> Params:
    options = body.get("options")
    return Params(
        model=str(body.get("model", "")),
        stream=body.get("stream", True) is not False,
        num_ctx=positive(int_field(options, "num_ctx")),
        max_output=positive(int_field(options, "num_predict")),
    )


def _chat(body: dict[str, Any]) -> Chat:
    messages = body.get("messages") or []
    if not isinstance(messages, list):
        raise NotCompactable("messages is not a list")
    return Chat(body, Conversation.from_wire(messages, body.get("tools")), _params(body))


def _generate(body: dict[str, Any]) -> Prompt:
    prompt = body.get("prompt")
    prompt = "" if prompt is None else prompt
    if not isinstance(prompt, str):
        raise NotCompactable("prompt is not a string")
    fixed = "\n".join(t for t in (body.get("system"), body.get("suffix")) if isinstance(t, str) and t)
    images = body.get("images")
    return Prompt(body, prompt, _params(body), fixed, len(images) if isinstance(images, list) else 0)


def _refusal(overflow: Overflow, report: dict[str, Any]) -> dict[str, Any]:
    return {"error": overflow.message, "contextpaw": report}


def _proxy_error(reason: str, status: int) -> dict[str, Any]:
    return {"error": reason}


def _is_final(record: Mapping[str, Any]) -> bool:
    return record.get("done") is True


CHAT = Route("ollama.chat", _chat, _refusal, _proxy_error, "ndjson", _is_final)
GENERATE = Route("ollama.generate", _generate, _refusal, _proxy_error, "ndjson", _is_final)
