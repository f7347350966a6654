"""Every marker shape through the real llama-server's own parsers (issue 39).

The bodies of `tests/wire/test_markers_on_wire.py`, compacted by ContextPaw so that a hole's marker stands
as an assistant message, a user message, or is folded beside tool blocks, go to the small
llama-server (its strict ChatML refuses two messages of one role in a row) on each route it serves:
its OpenAI chat, Responses and Anthropic converters, and Ollama's native chat through the simulator.
Each must be answered 200. Then a Codex-shaped Responses request of 93 message items goes through
ContextPaw into the 1,024-token window and is answered 200: the marker item llama-server refused
with 400 "Cannot determine type of 'item'".
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from contextpaw import wire
from contextpaw.wire import anthropic, ollama, openai, responses
from support import marker_shapes as shapes
from support.backends import Backend
from support.proof import FILLER, make_secret

pytestmark = pytest.mark.real

TIMEOUT = 300
Body = Callable[[str], dict[str, Any]]


def chat(role: str) -> dict[str, Any]:
    return {"model": "m", "messages": [shapes.plain("system", "Be brief."), *shapes.turns(shapes.plain, role)]}


def items(make: Any) -> Body:
    return lambda role: {"model": "m", "instructions": "Be brief.", "input": shapes.turns(make, role)}


def codex(before_hole: str) -> dict[str, Any]:
    return {
        "model": "m",
        "input": shapes.codex_calls(before_hole),
        "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
    }


def messages(role: str) -> dict[str, Any]:
    return {"model": "m", "system": "Be brief.", "max_tokens": 1, "messages": shapes.turns(shapes.plain, role)}


def tool_blocks(thinking: str) -> dict[str, Any]:
    turns = [
        shapes.plain("user", "the task"),
        *shapes.tool_turn(1, shapes.BIG),
        *shapes.tool_turn(2, "short", thinking == "thinking"),
        *shapes.tool_turn(3, "short"),
    ]
    return {"model": "m", "max_tokens": 1, "messages": turns}


CASES: list[tuple[str, str, wire.Route, Body, str]] = [
    *[
        ("openai chat", path, openai.CHAT, chat, role)
        for path in ("/v1/chat/completions", "/chat/completions")
        for role in shapes.TEXT_ROLES
    ],
    *[("responses, typed items", "/v1/responses", responses.RESPONSES, items(shapes.typed), role) for role in shapes.TEXT_ROLES],
    *[
        ("responses, shorthand user items", "/v1/responses", responses.RESPONSES, items(shapes.shorthand), role)
        for role in shapes.TEXT_ROLES
    ],
    *[("responses, before a call", "/v1/responses", responses.RESPONSES, codex, before) for before in ("user message", "tool output")],
    *[("anthropic", "/v1/messages", anthropic.MESSAGES, messages, role) for role in shapes.TEXT_ROLES],
    *[("anthropic, tool blocks", "/v1/messages", anthropic.MESSAGES, tool_blocks, how) for how in ("tool use", "thinking")],
]


def one_token(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body asking for one token of answer, in its API's field."""
    field = {"/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens"}.get(path, "max_tokens")
    return {**body, field: 1, "stream": False}


@pytest.mark.parametrize(("api", "path", "route", "body", "case"), CASES, ids=[f"{c[0]}-{c[1]}-{c[4]}" for c in CASES])
def test_every_marker_shape_is_taken_by_llama_servers_own_parsers(
    small_llama_server: Backend, api: str, path: str, route: wire.Route, body: Body, case: str
) -> None:
    sent = one_token(path, shapes.compacted(route, body(case), budget=400 if "tool" in api or "call" in api else 220))
    assert shapes.MARKER_PREFIX in json.dumps(sent)
    answer = httpx.post(small_llama_server.url + path, json=sent, timeout=TIMEOUT)
    assert answer.status_code == 200, f"{answer.status_code} {answer.text[:400]}\n{json.dumps(sent)[:2000]}"


@pytest.mark.parametrize("role", shapes.TEXT_ROLES)
def test_an_ollama_chat_marker_is_taken_by_the_simulator_over_llama_server(ollama_sim: str, sim_model: str, role: str) -> None:
    sent = {**shapes.compacted(ollama.CHAT, chat(role)), "model": sim_model, "stream": False, "options": {"num_predict": 1}}
    answer = httpx.post(ollama_sim + "/api/chat", json=sent, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text[:400]


def codex_session(secret: str, pairs: int = 45) -> dict[str, Any]:
    """Codex's request as the issue sent it: instructions, then 93 typed message items (the task with
    the secret, 45 turns of acknowledgement and log, an acknowledgement and the question)."""
    rng = random.Random(39)
    part = {"user": "input_text", "assistant": "output_text"}

    def item(role: str, text: str) -> dict[str, Any]:
        return {"type": "message", "role": role, "content": [{"type": part[role], "text": text}]}

    turns = [item("user", f"Remember this password: {secret}. I will ask for it.")]
    for _ in range(pairs):
        turns += [item("assistant", "Noted."), item("user", "More of the log:\n" + "\n".join(rng.choice(FILLER) for _ in range(3)))]
    turns += [item("assistant", "Noted."), item("user", "What is the password I asked you to remember?")]
    return {
        "model": "smollm2",
        "instructions": "You are a coding agent. Answer briefly.",
        "input": turns,
        "max_output_tokens": 16,
        "temperature": 0,
        "stream": False,
    }


def test_a_codex_shaped_responses_request_is_compacted_and_answered(small_llama_server: Backend, llama_proxy: str) -> None:
    body = codex_session(make_secret(random.Random(39)))
    assert len(body["input"]) == 93
    direct = httpx.post(small_llama_server.url + "/v1/responses", json=body, timeout=TIMEOUT)
    assert direct.status_code == 400 and "exceed_context_size_error" in direct.text, direct.text[:300]
    answer = httpx.post(llama_proxy + "/v1/responses", json=body, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text[:400]
    report = answer.json()["contextpaw"]
    assert report["compacted"] and report["markers"] and report["final_tokens"] <= report["budget"], report
    assert answer.headers["x-contextpaw-compacted"] == "true"
