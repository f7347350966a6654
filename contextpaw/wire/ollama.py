"""Ollama's native API: `/api/chat` and `/api/generate`.

Streams are NDJSON and end with a `done: true` object; `stream` defaults to true. The window is the
request's `options.num_ctx` when it sets one. Errors are `{"error": "<sentence>"}`: most clients read
only that string, so a refusal says everything there and adds the report beside it.

A refusal is what Ollama itself answers to a prompt over its window (`truncate: false`, or a model
that cannot shift its context): a 400 with llama-server's sentence, which Ollama passes on and
opencode matches ("request (N tokens) exceeds the available context size (C tokens), try increasing
it"). The `ollama` library raises it as a `ResponseError` and never retries. No status helps aider
here: its LiteLLM (1.81) reads every error of an `ollama`/`ollama_chat` model as a connection
error, which aider retries for a minute (LiteLLM's main branch reads a 4xx as a bad request, which
aider does not retry); on Ollama's `/v1` route (`openai/<model>`) it reads OpenAI's sentence as
the context window exceeded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from contextpaw.core.conversation import Conversation
from contextpaw.wire import served
from contextpaw.wire.base import EVALUATED_KEYS, Chat, NotCompactable, Overflow, Params, Prompt, Route, int_field, positive


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
    said = f"request ({overflow.required} tokens) exceeds the available context size ({overflow.budget} tokens), try increasing it"
    return {"error": f"{said}; {overflow.message}", "contextpaw": report}


def _proxy_error(reason: str, status: int) -> dict[str, Any]:
    return {"error": reason}


def _is_final(record: Mapping[str, Any]) -> bool:
    return record.get("done") is True


TELLING = re.compile(EVALUATED_KEYS + rb'|"done"\s*:\s*true')
COUNT = (("prompt_eval_count",),)
CHAT = Route(
    "ollama.chat", _chat, _refusal, _proxy_error, "ndjson", _is_final, streams_unless_told=True, prompt_counts=COUNT, telling=TELLING
)
GENERATE = Route(
    "ollama.generate",
    _generate,
    _refusal,
    _proxy_error,
    "ndjson",
    _is_final,
    streams_unless_told=True,
    prompt_counts=COUNT,
    telling=TELLING,
)


# -- the served window in `/api/show` ------------------------------------------------------------
# `model_info["<arch>.context_length"]` is the model file's trained length, which LiteLLM (aider),
# Copilot and others read as the window; `parameters` (`name value` lines, the name padded to 30
# as Ollama writes them) holds the Modelfile's `num_ctx`, which Continue and others read first.

NUM_CTX_LINE = "{:<30} {}"


def _parameters_with_window(parameters: str, window: int) -> tuple[str, int | None]:
    """`parameters` with its `num_ctx` line at most `window` (added when there is none), and the
    value it said when that was more."""
    lines, reported, found = [], None, False
    for line in parameters.splitlines():
        name, _, value = line.strip().partition(" ")
        if name == "num_ctx":
            found = True
            if value.strip().isdigit() and int(value.strip()) > window:
                reported = int(value.strip())
                line = NUM_CTX_LINE.format("num_ctx", window)
        lines.append(line)
    if not found:
        lines.append(NUM_CTX_LINE.format("num_ctx", window))
    return "\n".join(lines), reported


def show_with_window(show: dict[str, Any], window: int) -> dict[str, Any]:
    """`/api/show`'s answer saying the served `window` where it said more, and a `num_ctx` line."""
    updated = dict(show)
    info = show.get("model_info")
    told: list[int] = []
    if isinstance(info, Mapping):
        key = f"{info.get('general.architecture')}.context_length"
        if served.lowered(info.get(key), window):
            told.append(info[key])
            updated["model_info"] = {**info, key: window}
    parameters = show.get("parameters")
    updated["parameters"], reported = _parameters_with_window(parameters if isinstance(parameters, str) else "", window)
    told += [reported] if reported is not None else []
    updated["contextpaw"] = served.note(window, max(told, default=None))
    return updated


def shown_model(request: Any) -> str:
    """The model an `/api/show` request names (`model`, or the older `name` LiteLLM still sends)."""
    if not isinstance(request, Mapping):
        return ""
    name = request.get("model") or request.get("name")
    return name if isinstance(name, str) else ""


# -- asking Ollama for a count: `/api/chat` with `truncate: false` ----------------------------------
# Ollama has no tokenize route. Its native chat refuses (400, with the count) instead of cutting
# when told `truncate: false` (v0.12.6+), and answers with `prompt_eval_count` otherwise: one token
# generated, the prompt evaluated once, and its prefix left in the server's cache for the request
# itself, which its `/v1` and Anthropic routes render with the same template.

NATIVE_ROLES = frozenset({"system", "user", "assistant", "tool"})


def _native_tool(tool: Any) -> dict[str, Any] | None:
    """A tool definition as Ollama's native chat reads it (OpenAI's function shape); None for a
    tool the template would not render (a server-side tool of Anthropic's or the Responses API)."""
    if not isinstance(tool, Mapping):
        return None
    if isinstance(tool.get("function"), Mapping):
        return dict(tool)
    schema = tool.get("input_schema", tool.get("parameters"))
    if not isinstance(tool.get("name"), str) or not isinstance(schema, Mapping):
        return None
    return {"type": "function", "function": {"name": tool["name"], "description": str(tool.get("description", "")), "parameters": schema}}


def counting_chat(parsed: Chat) -> dict[str, Any]:
    """The `/api/chat` body whose count is the count of `parsed` on any of Ollama's chat routes:
    the system text sent beside the messages first, each message as the text the model reads under
    the role the template renders it with, the tools in the native shape; at most one token
    generated, and refused rather than cut (`truncate: false`). No `num_ctx`: the window is the one
    the request itself gets (a native request that names one asks for it as it would)."""
    messages = [{"role": "system", "content": parsed.fixed_text}] if parsed.fixed_text else []
    for m in parsed.conversation.messages:
        role = m.role if m.role in NATIVE_ROLES else "assistant" if m.speaker == "assistant" else "user"
        messages.append({"role": role, "content": m.text})
    tools = parsed.conversation.tools
    native = [t for t in map(_native_tool, tools) if t is not None] if isinstance(tools, list) else []
    options: dict[str, Any] = {"num_predict": 1}
    if parsed.params.num_ctx:
        options["num_ctx"] = parsed.params.num_ctx
    body: dict[str, Any] = {"model": parsed.params.model, "messages": messages, "stream": False, "truncate": False, "options": options}
    if native:
        body["tools"] = native
    return body


REFUSED_COUNT = re.compile(r"request \((\d+) tokens\) exceeds the available context size")


def refused_count(answer: Any) -> int | None:
    """The count in Ollama's refusal of a prompt over its window (llama-server's sentence, passed
    on as the error's text); None for any other answer."""
    error = answer.get("error") if isinstance(answer, Mapping) else None
    found = REFUSED_COUNT.search(error) if isinstance(error, str) else None
    return int(found.group(1)) if found else None


# -- /api/show: what the server says of a model -------------------------------------------------

FROM_LINE = re.compile(r"^FROM\s+(\S+)", re.MULTILINE)


def ollama_model_file(show: Any) -> str | None:
    """From `/api/show`: the file its Modelfile's FROM names (a GGUF blob path, or a model name)."""
    found = FROM_LINE.search(str(show.get("modelfile", ""))) if isinstance(show, dict) else None
    return found.group(1) if found else None


def ollama_show_windows(show: Any) -> tuple[int | None, int | None]:
    """From `/api/show`: the Modelfile `num_ctx` (its `parameters` lines are `name  value`) and the
    trained length."""
    if not isinstance(show, dict):
        return None, None
    configured = None
    for line in str(show.get("parameters") or "").splitlines():
        name, _, value = line.strip().partition(" ")
        if name == "num_ctx" and value.strip().isdigit():
            configured = int(value.strip())
    info = show["model_info"] if isinstance(show.get("model_info"), dict) else {}
    arch = info.get("general.architecture")
    return configured, positive(info.get(f"{arch}.context_length"))
