"""llama-server's native `/completion` (also `/completions`).

Streams are SSE without `[DONE]`; the last event carries `"stop": true`. The window is the server's
slot size, which a request cannot change. Errors are `{"error": {"code", "message", "type", ...}}`
with llama-server's own field names (`n_prompt_tokens`, `n_ctx`); a refusal is llama-server's own
answer to a prompt over its window, the 400 `exceed_context_size_error` and its sentence.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from contextpaw.wire import served
from contextpaw.wire.base import EVALUATED_KEYS, REFUSAL_STATUS, NotCompactable, Overflow, Prompt, Route, answer_params, positive


def _completion(body: dict[str, Any]) -> Prompt:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise NotCompactable("only a single string prompt can be compacted")
    return Prompt(body, prompt, answer_params(body, "n_predict", "max_tokens"))


def _refusal(overflow: Overflow, report: dict[str, Any]) -> dict[str, Any]:
    said = f"request ({overflow.required} tokens) exceeds the available context size ({overflow.budget} tokens), try increasing it"
    return {
        "error": {
            "code": REFUSAL_STATUS,
            "message": f"{said}; {overflow.message}",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": overflow.required,
            "budget": overflow.budget,
            "n_ctx": overflow.window,
        },
        "contextpaw": report,
    }


def _proxy_error(reason: str, status: int) -> dict[str, Any]:
    return {"error": {"code": status, "message": reason, "type": "invalid_request_error" if status < 500 else "unavailable_error"}}


def _is_final(record: Mapping[str, Any]) -> bool:
    return record.get("stop") is True


COMPLETION = Route(
    "llamacpp.completion",
    _completion,
    _refusal,
    _proxy_error,
    "sse",
    _is_final,
    telling=re.compile(EVALUATED_KEYS + rb'|"stop"\s*:\s*true'),
)


def props_with_window(props: dict[str, Any], window: int) -> dict[str, Any]:
    """`/props` with `default_generation_settings.n_ctx` (a slot's window) at most `window`: it is
    the served window already, unless ContextPaw fits to a smaller one (a window the server named in
    a 400, or `contextpaw_default_ctx` with discovery off)."""
    settings = props.get("default_generation_settings")
    reported = positive(settings.get("n_ctx")) if isinstance(settings, Mapping) else None
    updated = dict(props)
    if isinstance(settings, Mapping) and served.lowered(reported, window):
        updated["default_generation_settings"] = {**settings, "n_ctx": window}
    updated["contextpaw"] = served.note(window, reported)
    return updated
