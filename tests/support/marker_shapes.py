"""The message shapes markers are tested in, on every API, and the rules each API holds them to."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from contextpaw import wire
from contextpaw.core.markers import MARKER_PREFIX
from contextpaw.core.tokens import EstimateCounter
from contextpaw.fitting.engine import fit_chat

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


def codex_calls(before_hole: str) -> list[dict[str, Any]]:
    """Codex's items: the task, then a turn of reasoning, a call and its big output (the hole),
    then another call; before the hole a user message or a tool output."""
    items = [typed("user", "the task: remember the word ZEBRA")]
    if before_hole == "tool output":
        items += [
            {"type": "function_call", "call_id": "c0", "name": "shell", "arguments": '{"cmd": "ls"}'},
            {"type": "function_call_output", "call_id": "c0", "output": "a b c"},
        ]
    for n in (1, 2):
        items += [
            {"type": "reasoning", "id": f"rs_{n}", "summary": [], "content": [{"type": "reasoning_text", "text": f"read f{n}"}]},
            {"type": "function_call", "call_id": f"c{n}", "name": "shell", "arguments": json.dumps({"cmd": f"cat f{n}"})},
            {"type": "function_call_output", "call_id": f"c{n}", "output": BIG if n == 1 else "short"},
        ]
    return [*items, typed("user", "and now?")]


def tool_turn(n: int, output: str, thinking: bool = False) -> list[dict[str, Any]]:
    use: list[dict[str, Any]] = [{"type": "tool_use", "id": f"t{n}", "name": "read", "input": {"path": f"f{n}"}}]
    if thinking:
        use.insert(0, {"type": "thinking", "thinking": "I should read it.", "signature": "sig"})
    return [
        {"role": "assistant", "content": use},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{n}", "content": output}]},
    ]
