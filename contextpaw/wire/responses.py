"""OpenAI's Responses API, `/v1/responses`: the only API Codex speaks.

Both backends serve it: llama-server converts it to its chat path (and counts it whole at
`/v1/responses/input_tokens`); Ollama (v0.13.3 and later) serves it stateless, with no `options`,
so like its other `/v1` routes it cuts a long prompt to its window in silence.

`instructions` sits beside the conversation, as a system prompt does, and with `tools` is counted
and never touched. `input` is a string or a list of items: messages (roles user, assistant, system,
developer; content a string or `input_text`/`output_text`/`input_image`/`input_file` parts), tool
calls and their outputs paired by `call_id` (`function_call`, `custom_tool_call` and their
`*_output`), `reasoning` items that belong to the turn they precede, and types not known here, kept
as sent (`conversation.Message.from_wire` reads each). A request that names `previous_response_id`
keeps its history on the server, out of reach: it goes as it came, and the report says so.

`stream` defaults to false. A stream is SSE with named events; the final one carrying data is
`response.completed` (or `response.incomplete`, `response.failed`), whose `response.usage` holds
the prompt size as `input_tokens`, as the buffered response's `usage` does. Errors are OpenAI's;
an overflow opens with the sentence OpenAI's Responses API itself sends (`OVERFLOW`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from contextpaw.core.conversation import Conversation
from contextpaw.wire import openai
from contextpaw.wire.base import Chat, NotCompactable, NotFittable, Route, answer_params, int_field

EXACT_COUNT = ("/v1/responses/input_tokens", ("model", "instructions", "input", "tools"))
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
OVERFLOW = "Your input exceeds the context window of this model. Please adjust your input and try again."
"""The Responses API's own message beside `context_length_exceeded` (it names no numbers)."""


def _responses(body: dict[str, Any]) -> Chat:
    if body.get("previous_response_id"):
        raise NotFittable("it names previous_response_id: its history is kept by the server, so it was not fitted")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise NotCompactable("input is neither a string nor a list of items")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise NotCompactable("instructions is not a string")
    conversation = Conversation.from_wire(items, body.get("tools"))
    params = answer_params(body, "max_output_tokens")
    return Chat(body, conversation, params, instructions or "", EXACT_COUNT, field="input", marker=marker_item)


def marker_item(role: str, text: str) -> dict[str, Any]:
    """A marker as a typed message item, as Codex writes its own: llama-server refuses an assistant
    item without `"type": "message"` ("Cannot determine type of 'item'"), and OpenAI takes only
    `output_text` parts from the assistant and `input_text` parts from anyone else."""
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def _is_final(record: Mapping[str, Any]) -> bool:
    kind = record.get("type")
    return isinstance(kind, str) and kind in FINAL_EVENTS  # a list there is not hashable


def _evaluated(record: Mapping[str, Any]) -> int | None:
    """The prompt size in a response object, or in a stream event that carries one (`response`)."""
    response = record.get("response")
    usage = (response if isinstance(response, Mapping) else record).get("usage")
    return int_field(usage, "input_tokens")


RESPONSES = Route(
    "openai.responses",
    _responses,
    openai.refusal("input", OVERFLOW),
    openai.proxy_error,
    "sse",
    _is_final,
    evaluated=_evaluated,
    telling=re.compile(rb'"usage"|"response\.(?:completed|incomplete|failed)"'),  # FINAL_EVENTS
)
