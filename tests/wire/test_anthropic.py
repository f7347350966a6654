"""Anthropic's Messages API as a wire format: its blocks read, its rules kept through compaction,
its error shape and its usage counts (pure: no sockets)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpaw import wire
from contextpaw.core.conversation import Conversation
from contextpaw.core.tokens import EstimateCounter
from contextpaw.fitting.engine import Fitted, fit_chat
from contextpaw.wire import Kind, Overflow, anthropic
from contextpaw.wire.streams import StreamReport, record_bytes

COUNTER = EstimateCounter()
CACHED = {"type": "ephemeral"}
SYSTEM = [{"type": "text", "text": "You are a coding agent. SECRET=kiwi.", "cache_control": CACHED}]


def agent_loop(calls: int, dump_words: int = 300, thinking: bool = False) -> dict[str, Any]:
    """What Claude Code sends: a task, then tool calls answered by (big) tool results, then a question."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "Fix the failing test."}]}]
    for i in range(calls):
        use: list[dict[str, Any]] = [{"type": "text", "text": f"Reading part {i}."}]
        if thinking:
            use.insert(0, {"type": "thinking", "thinking": f"I should read part {i}.", "signature": f"sig{i}"})
        use += [{"type": "tool_use", "id": f"toolu_{i}a", "name": "read", "input": {"path": f"f{i}.py"}},
                {"type": "tool_use", "id": f"toolu_{i}b", "name": "grep", "input": {"q": f"x{i}"}}]  # fmt: skip
        messages.append({"role": "assistant", "content": use})
        results = [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}a", "content": f"part {i}: " + "line of code\n" * dump_words},
            {"type": "tool_result", "tool_use_id": f"toolu_{i}b", "content": [{"type": "text", "text": f"match {i}"}]},
        ]
        messages.append({"role": "user", "content": results})
    messages.append({"role": "assistant", "content": "Done reading."})
    messages.append({"role": "user", "content": [{"type": "text", "text": "What is the SECRET?", "cache_control": CACHED}]})
    return {"model": "m", "max_tokens": 64, "system": SYSTEM, "tools": [{"name": "read", "input_schema": {}}], "messages": messages}


def fitted(body: dict[str, Any], budget: int, keep_recent: int = 2) -> tuple[list[dict[str, Any]], Fitted]:
    chat = anthropic.MESSAGES.read(json.dumps(body).encode())
    assert isinstance(chat, wire.Chat)
    result = fit_chat(chat, budget, COUNTER, keep_recent=keep_recent, previous=None)
    sent = json.loads(result.body) if result.body is not None else body
    return sent["messages"], result


def assert_valid_for_anthropic(messages: list[dict[str, Any]]) -> None:
    """The rules Anthropic's API enforces: roles alternate, starting with a user; every tool_use is
    answered in the very next message; tool results come first in their message and answer a call."""
    assert messages[0]["role"] == "user"
    for before, after in zip(messages, messages[1:]):
        assert before["role"] != after["role"], (before, after)
    for i, message in enumerate(messages):
        blocks = message["content"] if isinstance(message["content"], list) else []
        uses = {b["id"] for b in blocks if b.get("type") == "tool_use"}
        if uses:
            answered = messages[i + 1]["content"]
            assert {b["tool_use_id"] for b in answered if b.get("type") == "tool_result"} == uses
        kinds = [b.get("type") == "tool_result" for b in blocks]
        assert kinds == sorted(kinds, reverse=True), "no block before a tool result"
        if any(kinds):
            called = messages[i - 1]["content"]
            ids = {b["id"] for b in called if isinstance(b, dict) and b.get("type") == "tool_use"}
            assert {b["tool_use_id"] for b in blocks if b.get("type") == "tool_result"} <= ids


def test_the_messages_route_exists_on_both_backends_and_count_tokens_passes_through() -> None:
    for kind in Kind:
        assert wire.route_for(kind, "POST", "/v1/messages") is anthropic.MESSAGES
        assert wire.route_for(kind, "POST", "/v1/messages/count_tokens") is None


def test_system_blocks_are_counted_beside_the_messages_and_never_cut() -> None:
    chat = anthropic.MESSAGES.read(json.dumps(agent_loop(2)).encode())
    assert isinstance(chat, wire.Chat)
    assert chat.fixed_text == SYSTEM[0]["text"] and chat.has_system and SYSTEM[0]["text"] in chat.texts
    assert anthropic.system_text("plain") == "plain"
    with pytest.raises(wire.NotCompactable):
        anthropic.MESSAGES.read(b'{"messages": [], "system": 3}')


def test_a_tool_use_and_its_results_are_one_unit() -> None:
    chat = anthropic.MESSAGES.read(json.dumps(agent_loop(3)).encode())
    assert isinstance(chat, wire.Chat)
    messages = chat.conversation.messages
    assert messages[1].call_ids == ("toolu_0a", "toolu_0b") and messages[2].role == "tool"
    assert messages[2].answers == "toolu_0a" and "line of code" in messages[2].text
    assert [u.indices for u in chat.conversation.units()][:3] == [(0,), (1, 2), (3, 4)]


def test_an_agent_loop_is_compacted_into_a_request_anthropic_accepts() -> None:
    body = agent_loop(8)
    messages, result = fitted(body, budget=2000)
    report = result.report
    assert report.compacted and report.final_tokens <= 2000
    assert_valid_for_anthropic(messages)
    assert messages[0] == body["messages"][0], "the task is kept as sent"
    assert messages[-1] == body["messages"][-1], "the question keeps its cache_control"
    assert any("[ContextPaw:" in json.dumps(m) for m in messages), "the model is told"


@settings(max_examples=60, deadline=None)
@given(calls=st.integers(1, 10), words=st.integers(20, 600), budget=st.integers(900, 6000), keep=st.integers(0, 6), thinking=st.booleans())
def test_every_compaction_keeps_anthropics_rules(calls: int, words: int, budget: int, keep: int, thinking: bool) -> None:
    body = agent_loop(calls, words, thinking)
    try:
        messages, result = fitted(body, budget, keep)
    except Exception as e:  # only "what must be kept does not fit" may stop it
        assert type(e).__name__ == "BudgetTooSmall"
        return
    assert_valid_for_anthropic(messages)
    assert result.report.final_tokens <= budget
    originals = [json.dumps(m, sort_keys=True) for m in body["messages"]]
    for message in messages:
        for block in message["content"] if isinstance(message["content"], list) else []:
            if block.get("type") in ("thinking", "tool_use"):  # signed or structured: never rewritten
                assert any(json.dumps(block, sort_keys=True) in o for o in originals)


def test_a_shrunk_tool_result_keeps_its_id_and_is_cut_inside_its_content() -> None:
    body = agent_loop(1, dump_words=3000)
    messages, result = fitted(body, budget=1500, keep_recent=4)
    assert any(r.action == "shrunk" for r in result.report.removals)
    results = messages[2]["content"]
    assert [b["tool_use_id"] for b in results] == ["toolu_0a", "toolu_0b"]
    assert "[ContextPaw:" in results[0]["content"] and results[0]["content"].startswith("part 0:")
    assert results[1] == body["messages"][2]["content"][1]


def test_unknown_blocks_are_kept_as_they_are() -> None:
    body = agent_loop(3)
    odd = {"type": "server_tool_use_v9", "payload": {"x": [1, 2]}}
    body["messages"][-1]["content"].insert(0, odd)
    messages, _ = fitted(body, budget=1200)
    assert odd in messages[-1]["content"]


def test_a_marker_folded_into_a_tool_result_message_goes_after_its_results() -> None:
    message = wire.Chat(
        {},
        Conversation.from_wire([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": []}]}]),
        wire.Params("m", False),
    ).conversation.messages[0]
    folded = message.with_content("[ContextPaw: note]")
    assert [b["type"] for b in folded.raw["content"]] == ["tool_result", "text"]


def test_the_refusal_is_anthropics_prompt_too_long_error_with_the_report_beside_it() -> None:
    body = anthropic.MESSAGES.refusal(Overflow(5000, 3000, 4096, "too long"), {"compacted": False})
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == "prompt is too long: 5000 tokens > 3000 maximum"
    assert body["contextpaw"] == {"compacted": False}
    assert wire.proxy_error(None, "/v1/messages", "down", 503) == anthropic.error("overloaded_error", "down")
    assert wire.proxy_error(Kind.LLAMACPP, "/v1/messages?beta=true", "gone", 502)["error"]["type"] == "api_error"


@pytest.mark.parametrize(
    ("record", "tokens"),
    [
        ({"type": "message", "usage": {"input_tokens": 14, "cache_read_input_tokens": 31, "output_tokens": 4}}, 45),
        ({"type": "message_start", "message": {"usage": {"input_tokens": 31, "output_tokens": 0}}}, 31),
        ({"type": "message_delta", "usage": {"input_tokens": 900, "output_tokens": 8}}, 900),
        ({"type": "message_delta", "usage": {"output_tokens": 8}}, None),
    ],
)
def test_the_prompt_size_is_read_from_every_place_a_server_reports_it(record: dict, tokens: int | None) -> None:
    assert anthropic.MESSAGES.evaluated(record) == tokens


def stream(events: list[dict[str, Any]]) -> bytes:
    return b"".join(record_bytes("sse", e) for e in events)


def test_in_a_stream_the_report_rides_on_message_delta_with_the_count_from_message_start() -> None:
    events = [
        {"type": "message_start", "message": {"usage": {"input_tokens": 31, "output_tokens": 0}}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}},
        {"type": "message_stop"},
    ]
    seen: list[tuple[dict, int | None]] = []

    def amend(final: dict, counted: int | None) -> bytes:
        seen.append((final, counted))
        return b'{"compacted":true}'

    out = StreamReport("sse", anthropic.MESSAGES.is_final, amend, anthropic.MESSAGES.evaluated).transform(stream(events))
    assert seen == [(events[2], 31)]
    records = out.split(b"\n\n")
    assert records[2].startswith(b"event: message_delta\ndata: ") and records[2].endswith(b',"contextpaw":{"compacted":true}}')
    assert records[3] == b"event: message_stop\ndata: " + json.dumps(events[3], separators=(",", ":")).encode()


def test_an_error_event_in_a_stream_is_named_as_anthropics_clients_expect() -> None:
    assert record_bytes("sse", anthropic.error("api_error", "x")).startswith(b"event: error\ndata: {")
    assert record_bytes("sse", {"error": {"message": "x"}}).startswith(b"data: {")
