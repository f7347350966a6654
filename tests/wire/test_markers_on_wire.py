"""Every marker, on every route, in a shape its API's parsers take (issue 39).

A hole's marker stands as a message of its own (an assistant one between two user messages, a user
one between two assistant messages) or is folded into the next message's text. Each route here gets
both roles, and each body is checked against its API's rules: llama-server's Responses converter
(the fake's copy of it, `responses_chat`), Anthropic's block rules, and alternating roles as strict
chat templates demand. `tests/real/test_markers_real.py` sends the same shapes to the real server.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from contextpaw import wire
from contextpaw.core.conversation import Message
from contextpaw.core.markers import MARKER_PREFIX, fold
from contextpaw.fitting.engine import fit_chat
from contextpaw.wire import anthropic, ollama, openai, responses
from support.common import anthropic_chat
from support.fake_llamacpp import responses_chat
from support.marker_shapes import (
    BIG,
    COUNTER,
    TEXT_ROLES,
    _text,
    alternate,
    anthropic_rules,
    codex_calls,
    compacted,
    plain,
    shorthand,
    standing,
    tool_turn,
    turns,
    typed,
)

# -- a marker of each role on each route -----------------------------------------------------------

CHAT_ROUTES = [("ollama /api/chat", ollama.CHAT), ("openai chat (both backends, llama.cpp's /chat/completions)", openai.CHAT)]


@pytest.mark.parametrize("role", TEXT_ROLES)
@pytest.mark.parametrize(("name", "route"), CHAT_ROUTES)
def test_a_chat_marker_of_either_role_is_a_plain_message(name: str, route: wire.Route, role: str) -> None:
    body = {"model": "m", "messages": [plain("system", "Be brief."), *turns(plain, role)]}
    sent = compacted(route, body)["messages"]
    markers = standing(sent)
    assert [m["role"] for m in markers] == [role] and markers[0] == {"role": role, "content": _text(markers[0])}
    alternate(sent)


@pytest.mark.parametrize("role", TEXT_ROLES)
@pytest.mark.parametrize("make", [typed, shorthand], ids=["typed items", "shorthand user items"])
def test_a_responses_marker_of_either_role_is_a_typed_item_with_its_roles_part(make: Any, role: str) -> None:
    body = {"model": "m", "instructions": "Be brief.", "input": turns(make, role)}
    sent = compacted(responses.RESPONSES, body)
    markers = standing(sent["input"])
    part = "output_text" if role == "assistant" else "input_text"
    assert len(markers) == 1 and markers[0] == {"type": "message", "role": role, "content": [{"type": part, "text": _text(markers[0])}]}
    alternate(responses_chat(sent)["messages"])  # llama-server's converter takes it: no 400


def test_a_responses_string_input_is_cut_inside_its_one_user_message() -> None:
    parsed = responses.RESPONSES.read(json.dumps({"model": "m", "input": "the task: " + "word " * 3000}).encode())
    assert isinstance(parsed, wire.Chat)
    fitted = fit_chat(parsed, 300, COUNTER, keep_recent=2, previous=None)
    assert fitted.body is not None
    sent = json.loads(fitted.body)
    assert [m["role"] for m in responses_chat(sent)["messages"]] == ["user"]
    assert MARKER_PREFIX in json.dumps(sent["input"])


@pytest.mark.parametrize("before_hole", ["user message", "tool output"])
def test_a_responses_marker_before_a_call_joins_the_turn_and_never_goes_into_reasoning(before_hole: str) -> None:
    body = {"model": "m", "input": codex_calls(before_hole), "tools": [{"type": "function", "name": "shell"}]}
    sent = compacted(responses.RESPONSES, body, budget=400)
    items = sent["input"]
    markers = standing(items)
    assert len(markers) == 1 and markers[0]["type"] == "message", items
    assert all(MARKER_PREFIX not in json.dumps(i) for i in items if i.get("type") == "reasoning")
    alternate(responses_chat(sent)["messages"])


@pytest.mark.parametrize("role", TEXT_ROLES)
def test_an_anthropic_marker_of_either_role_keeps_the_block_rules(role: str) -> None:
    body = {"model": "m", "system": "Be brief.", "max_tokens": 50, "messages": turns(plain, role)}
    sent = compacted(anthropic.MESSAGES, body)["messages"]
    assert [m["role"] for m in standing(sent)] == [role]
    anthropic_rules(sent)
    alternate(anthropic_chat({"messages": sent}))


@pytest.mark.parametrize("thinking", [False, True], ids=["tool use", "thinking and tool use"])
def test_an_anthropic_marker_beside_tool_blocks_goes_after_the_results_and_the_thinking(thinking: bool) -> None:
    messages = [plain("user", "the task"), *tool_turn(1, BIG), *tool_turn(2, "short", thinking), *tool_turn(3, "short")]
    body = {"model": "m", "max_tokens": 50, "messages": messages}
    sent = compacted(anthropic.MESSAGES, body, budget=400)["messages"]
    assert MARKER_PREFIX in json.dumps(sent)
    anthropic_rules(sent)


# -- folding into a content list without text ------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "part"),
    [
        ({"type": "message", "role": "assistant", "content": []}, "output_text"),
        ({"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}, "input_text"),
        ({"type": "function_call_output", "call_id": "c", "output": []}, "input_text"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}, "text"),
    ],
)
def test_a_marker_folded_into_parts_without_text_is_a_part_of_the_apis_type(raw: dict[str, Any], part: str) -> None:
    folded = fold(Message.from_wire(raw), "[ContextPaw: gone]").raw
    parts = folded["output" if "output" in raw else "content"]
    assert {"type": part, "text": "[ContextPaw: gone]"} in parts
    if raw.get("type") or part != "text":
        responses_chat({"input": [folded]})  # llama-server's converter takes it


def test_a_marker_folded_into_a_thinking_turn_goes_after_the_thinking() -> None:
    raw = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "tool_use", "id": "t", "name": "x", "input": {}}],
    }
    kinds = [b["type"] for b in fold(Message.from_wire(raw), "[ContextPaw: gone]").raw["content"]]
    assert kinds == ["thinking", "text", "tool_use"]
