"""Every marker, on every route, in a shape its API's parsers take (issue 39).

A hole's marker stands as a message of its own (an assistant one between two user messages, a user
one between two assistant messages) or is folded into the next message's text. Each route here gets
both roles, and each body is checked against its API's rules: llama-server's Responses converter
(the fake's copy of it, `responses_chat`), Anthropic's block rules, and alternating roles as strict
chat templates demand. `tests/real/test_markers_real.py` sends the same shapes to the real server.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from support.common import anthropic_chat
from support.fake_llamacpp import responses_chat

from contextpaw import wire
from contextpaw.conversation import Message
from contextpaw.fitting import fit_chat
from contextpaw.markers import MARKER_PREFIX, fold
from contextpaw.tokens import EstimateCounter
from contextpaw.wire import anthropic, ollama, openai, responses

COUNTER = EstimateCounter()
BIG = "lorem ipsum " * 300
TEXT_ROLES = ("user", "assistant")


def plain(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": text}


def typed(role: str, text: str) -> dict[str, Any]:
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def shorthand(role: str, text: str) -> dict[str, Any]:
    """A Responses item as many clients write it: a user's as `{"role", "content"}`, an assistant's
    typed (llama-server refuses a shorthand assistant item, the client's own included)."""
    return typed(role, text) if role == "assistant" else plain(role, text)


def turns(make: Any, hole_role: str) -> list[dict[str, Any]]:
    """A chat whose one big message (of `hole_role`) sits between two messages of the other role,
    so that its marker must take a role of its own: the opposite of its neighbours'."""
    other = "user" if hole_role == "assistant" else "assistant"
    head = [make("user", "the task: remember the word ZEBRA")]
    if other == "assistant":
        head.append(make("assistant", "ok"))
    tail = [make("user", "short"), make("assistant", "short too")] if other == "user" else [make("assistant", "short")]
    return [*head, make(hole_role, BIG), *tail, make("user", "and now?")]


def compacted(route: wire.Route, body: dict[str, Any], budget: int = 220) -> dict[str, Any]:
    """The body fitted to the largest budget (from `budget` down) at which a message is dropped, not
    only shrunk: where the engine drops rather than shrinks is its own choice, and may move."""
    parsed = route.read(json.dumps(body).encode())
    assert isinstance(parsed, wire.Chat)
    for within in range(budget, budget // 4, -10):
        fitted = fit_chat(parsed, within, COUNTER, keep_recent=2, previous=None)
        if fitted.body is not None and any(r.action == "dropped" for r in fitted.report.removals):
            return json.loads(fitted.body)
    raise AssertionError("no budget drops a message")


def standing(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The markers that stand as messages of their own."""
    return [m for m in messages if MARKER_PREFIX in json.dumps(m) and _text(m).startswith(MARKER_PREFIX)]


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def alternate(messages: Sequence[Mapping[str, Any]]) -> None:
    """No two messages of one role in a row (tool results aside), as strict templates demand."""
    roles = [m["role"] for m in messages if m["role"] not in ("system", "tool")]
    assert all(a != b for a, b in itertools.pairwise(roles)), roles


def anthropic_rules(messages: Sequence[Mapping[str, Any]]) -> None:
    """Anthropic's rules for `messages`: user and assistant only, alternating; content a string or
    typed blocks, text blocks with a string; tool results first in the user message right after the
    tool uses they answer; thinking first in an assistant turn."""
    alternate(messages)
    for n, message in enumerate(messages):
        assert message["role"] in ("user", "assistant") and set(message) <= {"role", "content"}, message
        content = message["content"]
        if isinstance(content, str):
            continue
        assert isinstance(content, list) and content and all(isinstance(b, dict) and "type" in b for b in content)
        kinds = [b["type"] for b in content]
        assert all(isinstance(b.get("text"), str) for b in content if b["type"] == "text"), content
        results = [b["tool_use_id"] for b in content if b["type"] == "tool_result"]
        if results:
            assert message["role"] == "user" and kinds[: len(results)] == ["tool_result"] * len(results), kinds
            uses = [b["id"] for b in messages[n - 1]["content"] if isinstance(b, dict) and b.get("type") == "tool_use"]
            assert set(results) == set(uses), "tool results answer the tool uses just before them"
        thinking = [k in ("thinking", "redacted_thinking") for k in kinds]
        assert thinking == sorted(thinking, reverse=True), f"thinking comes first: {kinds}"


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


def codex_calls(before_hole: str) -> list[dict[str, Any]]:
    """Codex's items: the task, then a turn of reasoning, a call and its big output (the hole),
    then another call; before the hole a user message or a tool output."""
    items = [typed("user", "the task: remember the word ZEBRA")]
    if before_hole == "tool output":
        items += [
            {"type": "function_call", "call_id": "c0", "name": "shell", "arguments": "{\"cmd\": \"ls\"}"},
            {"type": "function_call_output", "call_id": "c0", "output": "a b c"},
        ]
    for n in (1, 2):
        items += [
            {"type": "reasoning", "id": f"rs_{n}", "summary": [], "content": [{"type": "reasoning_text", "text": f"read f{n}"}]},
            {"type": "function_call", "call_id": f"c{n}", "name": "shell", "arguments": json.dumps({"cmd": f"cat f{n}"})},
            {"type": "function_call_output", "call_id": f"c{n}", "output": BIG if n == 1 else "short"},
        ]
    return [*items, typed("user", "and now?")]


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


def tool_turn(n: int, output: str, thinking: bool = False) -> list[dict[str, Any]]:
    use: list[dict[str, Any]] = [{"type": "tool_use", "id": f"t{n}", "name": "read", "input": {"path": f"f{n}"}}]
    if thinking:
        use.insert(0, {"type": "thinking", "thinking": "I should read it.", "signature": "sig"})
    return [
        {"role": "assistant", "content": use},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{n}", "content": output}]},
    ]


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
    raw = {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "tool_use", "id": "t", "name": "x", "input": {}}]}
    kinds = [b["type"] for b in fold(Message.from_wire(raw), "[ContextPaw: gone]").raw["content"]]
    assert kinds == ["thinking", "text", "tool_use"]
