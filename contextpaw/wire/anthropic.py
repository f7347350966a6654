"""Anthropic's Messages API, `/v1/messages`: what Claude Code and Anthropic's SDKs speak.

Both backends serve it (Ollama since v0.14, llama-server since PR #17570). `system` sits beside the
messages, as a string or a list of text blocks; content is a string or a list of blocks (`text`,
`image`, `tool_use`, `tool_result`, `thinking`, `document`, and others, all kept as sent). Roles
alternate user/assistant. `stream` defaults to false; a stream is SSE with named events, and the
final one carrying data is the single `message_delta`. Errors are `{"type": "error", "error":
{"type", "message"}}`.

The prompt size comes in `usage.input_tokens` (plus the cache's share where a server reports one):
on the body, on `message_start`, and on Ollama's `message_delta`. llama-server counts a whole request
at `/v1/messages/count_tokens`; Ollama's count there is only its own estimate (bytes / 4).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from contextpaw.core.conversation import Conversation
from contextpaw.wire.base import Chat, NotCompactable, Overflow, Route, answer_params, int_field

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
EXACT_COUNT = ("/v1/messages/count_tokens", ("model", "system", "messages", "tools"))
USAGE_FIELDS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
"""A prompt's tokens are split between these: new, read from the cache, written to the cache."""


def system_text(system: Any) -> str:
    """The text of `system`: the string, or its text blocks joined (what servers render)."""
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n".join(b["text"] for b in system if isinstance(b, Mapping) and isinstance(b.get("text"), str))
    raise NotCompactable("system is neither a string nor a list of blocks")


def _messages(body: dict[str, Any]) -> Chat:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise NotCompactable("messages is not a list")
    conversation = Conversation.from_wire(messages, body.get("tools"))
    return Chat(body, conversation, answer_params(body, "max_tokens"), system_text(body.get("system")), EXACT_COUNT)


def error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _refusal(overflow: Overflow, report: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's own 400 `invalid_request_error` for a prompt over the window, in the wording its
    clients recognise (Claude Code looks for "prompt is too long", reads the two numbers after it and
    offers to compact); ContextPaw's numbers and report ride beside it. When the agent's own
    tools and instructions are over the window, a sentence after it says what window they need:
    compacting the conversation, which Claude Code offers, cannot help."""
    message = f"prompt is too long: {overflow.required} tokens > {overflow.budget} maximum"
    if overflow.fixed_part:
        message = f"{message}; {overflow.fixed_part}"
    return {**error("invalid_request_error", message), "contextpaw": report}


def _proxy_error(reason: str, status: int) -> dict[str, Any]:
    return error(ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error"), reason)


def _is_final(record: Mapping[str, Any]) -> bool:
    return record.get("type") == "message_delta"


def _evaluated(record: Mapping[str, Any]) -> int | None:
    """The prompt size in a response body, a `message_start` (inside `message`) or a `message_delta`."""
    message = record.get("message")
    usage = (message if isinstance(message, Mapping) else record).get("usage")
    parts = [int_field(usage, name) for name in USAGE_FIELDS]
    if parts[0] is None:
        return None
    return sum(p for p in parts if p is not None)


MESSAGES = Route(
    "anthropic.messages",
    _messages,
    _refusal,
    _proxy_error,
    "sse",
    _is_final,
    evaluated=_evaluated,
    prompt_counts=(("usage", "input_tokens"),),
    telling=re.compile(rb'"usage"|"message_delta"'),
)
