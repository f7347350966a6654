"""Wire formats: which requests ContextPaw handles, and how each API spells them.

One module per API (`ollama`, `openai`, `llamacpp`, `anthropic`) builds `Route`s: how to read a body into a
conversation or a prompt plus the request parameters that size the budget, how to write the
compacted body back, the API's own error shapes, and how its stream marks the final record. The
types they share are in `base`, which they import; this module puts their routes together. The
compaction engine is not imported here (`contextpaw.fitting.engine` is where a parsed request meets it).
Pure: bytes and dicts in, bytes and dicts out, no mitmproxy and no I/O.
"""

from __future__ import annotations

from typing import Any

from contextpaw.wire import anthropic, llamacpp, ollama, openai, responses
from contextpaw.wire.base import (  # noqa: F401  (the package's surface)
    MODEL_FIELD,
    REFUSAL_STATUS,
    SESSION_HEADER,
    USAGE_HEADER,
    Backend,
    Chat,
    Kind,
    NotCompactable,
    NotFittable,
    Overflow,
    Params,
    Prompt,
    Route,
    Unreadable,
    UpstreamOverflow,
    answer_params,
    as_utf8,
    dumps,
    evaluated_tokens,
    identify,
    int_field,
    keyed,
    load,
    model_of,
    positive,
    prompt_cache,
    read_json,
    session_of,
    told_usage,
    upstream_overflow,
    usage_whole,
    utf8_type,
    write,
)

_OPENAI = {
    "/v1/chat/completions": openai.CHAT,
    "/v1/completions": openai.COMPLETIONS,
    "/v1/responses": responses.RESPONSES,
    "/v1/messages": anthropic.MESSAGES,
}
"""The routes both backends serve the same way (`/v1/messages/count_tokens` and
`/v1/responses/input_tokens` pass through)."""
_ROUTES: dict[Kind, dict[str, Route]] = {
    Kind.OLLAMA: _OPENAI | {"/api/chat": ollama.CHAT, "/api/generate": ollama.GENERATE},
    Kind.LLAMACPP: _OPENAI | {"/chat/completions": openai.CHAT, "/completion": llamacpp.COMPLETION, "/completions": llamacpp.COMPLETION},
}


def route_names(kind: Kind) -> list[str]:
    """The names of the routes ContextPaw handles at a backend of this kind, each once (llama-server
    serves one route at two paths), sorted: the values of the metrics' `route` label there."""
    return sorted({route.name for route in _ROUTES[kind].values()})


def route_for(kind: Kind, method: str, path: str) -> Route | None:
    """The handled route for a request, or None for anything that passes through untouched."""
    if method != "POST":
        return None
    return _ROUTES[kind].get(_plain(path))


def proxy_error(kind: Kind | None, path: str, reason: str, status: int = 502) -> dict[str, Any]:
    """The body of an answer of the proxy's own, in the convention of whatever the client called.

    The kind may be unknown (a reverse target that is down was never identified); Ollama's native
    routes all start with `/api/`.
    """
    path = _plain(path)
    if path.startswith("/v1/messages"):
        return anthropic.MESSAGES.proxy_error(reason, status)
    if path.startswith("/v1/"):
        return openai.CHAT.proxy_error(reason, status)
    if kind is Kind.OLLAMA or (kind is None and path.startswith("/api/")):
        return ollama.CHAT.proxy_error(reason, status)
    return llamacpp.COMPLETION.proxy_error(reason, status)


def _plain(path: str) -> str:
    return path.split("?", 1)[0].rstrip("/") or "/"
