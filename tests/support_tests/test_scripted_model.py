"""The scripted model's measures of a session (tests/support/scripted_model.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support.scripted_model import (
    FACTS_FILE,
    ResponsesAnswer,
    Script,
    ScriptedModel,
    Session,
    Settings,
    from_chat,
    from_responses,
    render_messages,
    retrieved,
)


class Characters:
    """A tokenizer of one token per character: the measures are lengths, whatever the vocabulary."""

    class Encoding:
        def __init__(self, text: str) -> None:
            self.ids = [ord(c) for c in text]

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        return self.Encoding(text)


def chat(*messages: tuple[str, str]) -> dict[str, Any]:
    return {"messages": [{"role": role, "content": content} for role, content in messages]}


HEAD = (("system", "sys"), ("user", "task"))
READ_1 = (("assistant", "call 1"), ("tool", "file one"))
READ_2 = (("assistant", "call 2"), ("tool", "file two"))
READ_3 = (("assistant", "call 3"), ("tool", "file three"))


def length(body: dict[str, Any], start: int) -> int:
    return len(render_messages(from_chat(body).messages[start:]))


def test_the_least_a_turn_costs_is_the_messages_it_adds_whatever_was_cut_before_them() -> None:
    model = ScriptedModel(Settings(1000, "ollama", False, Path("unused.gguf"), None), Characters())
    session = Session(files=[])
    opening = chat(*HEAD, *READ_1)
    later = chat(*HEAD, *READ_1, *READ_2)
    after_a_cut = chat(*HEAD, ("user", "[ContextPaw: 2 messages evicted]"), *READ_2, *READ_3)
    assert model.new(session, from_chat(opening)) == length(opening, 0)  # nothing before it: all of it is new
    assert model.new(session, from_chat(later)) == length(later, 4)
    assert model.new(session, from_chat(after_a_cut)) == length(after_a_cut, 5)  # the marker is the cut's, not the turn's


def test_aider_s_summary_request_asks_in_its_system_message_and_is_answered_as_a_summary() -> None:
    history = "# USER\nI ran this command:\n\ncat /p/notes/file-01.txt\n# ASSISTANT\nOk.\n"
    asked = from_chat(chat(("system", "*Briefly* summarize this partial conversation about programming."), ("user", history)))
    assert Script().reply(None, asked, "").kind == "summary"


def test_a_question_without_tools_is_answered_with_the_facts_in_a_whole_file_listing_and_the_last_one_finally() -> None:
    seen = "FACT-01: the key is amber\nFACT-02: the key is basil"
    asked = from_chat(chat(("system", "Act as an expert software developer."), ("user", "Which FACT lines can you see now?")))
    answer = Script().reply(None, asked, seen)
    assert answer.kind == "answer" and f"{FACTS_FILE}\n```\nFACT-01: the key is amber\nFACT-02: the key is basil\n```" in answer.text
    last = from_chat(chat(("user", "List every FACT line you can see, and we are done.")))
    assert Script().reply(None, last, seen).kind == "final"


REF = "cp-0123456789ab.0123456789abcdef"
RETRIEVE = "mcp__contextpaw__contextpaw_retrieve"


def with_retrieval(*messages: dict[str, Any]) -> dict[str, Any]:
    """A chat request of a session reading /p/file-01.txt and /p/file-02.txt, offering the agent's
    read tool and ContextPaw's retrieval tool (Claude Code's spelling)."""
    tools = [{"type": "function", "function": {"name": name}} for name in ("Read", RETRIEVE)]
    head = [{"role": "user", "content": "Read /p/file-01.txt then /p/file-02.txt"}]
    return {"tools": tools, "messages": [*head, *messages]}


MARKER = {
    "role": "user",
    "content": f"[ContextPaw: 2 earlier messages (300 tokens) removed; ref {REF}. Do not guess or invent removed text.]",
}


def retrieve_call(call_id: str) -> dict[str, Any]:
    call = {"id": call_id, "type": "function", "function": {"name": RETRIEVE, "arguments": json.dumps({"ref": REF})}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def test_with_retrieve_a_marker_s_reference_is_asked_for_once_with_the_agent_s_spelling_of_the_tool() -> None:
    script = Script(retrieve=True)
    conversation = from_chat(with_retrieval(MARKER))
    session = script.session("s", conversation)
    asked = script.reply(session, conversation, "")
    assert asked.kind == "retrieve" and asked.call is not None
    assert asked.call.name == RETRIEVE and json.loads(asked.call.arguments) == {"ref": REF}
    back = from_chat(with_retrieval(MARKER, retrieve_call("c1"), {"role": "tool", "tool_call_id": "c1", "content": "the text"}))
    assert retrieved(back) == [{"call": "c1", "ref": REF, "text": "the text"}]
    assert script.reply(session, back, "").kind == "tool"  # the reference was asked for once: the reading goes on
    assert script.reply(session, conversation, "").kind == "tool"


def test_with_retrieve_a_tool_in_a_responses_namespace_is_called_by_its_namespace_and_name() -> None:
    """Codex offers an MCP server's tools in a namespace (`mcp__contextpaw`): the call names both."""
    namespace = {"type": "namespace", "name": "mcp__contextpaw", "tools": [{"type": "function", "name": "contextpaw_retrieve"}]}
    body = {"tools": [{"type": "function", "name": "exec_command"}, namespace],
            "input": [{"role": "user", "content": "Read /p/file-01.txt then /p/file-02.txt"}, MARKER]}  # fmt: skip
    script = Script(retrieve=True)
    conversation = from_responses(body)
    asked = script.reply(script.session("s", conversation), conversation, "")
    assert asked.kind == "retrieve" and asked.call is not None
    assert (asked.call.namespace, asked.call.name) == ("mcp__contextpaw", "contextpaw_retrieve")
    item = ResponsesAnswer("m", body).whole(asked, (1, 1))["output"][0]
    assert (item["namespace"], item["name"]) == ("mcp__contextpaw", "contextpaw_retrieve")
    back = from_responses(
        {**body, "input": [*body["input"], item, {"type": "function_call_output", "call_id": item["call_id"], "output": "t"}]}
    )
    assert retrieved(back) == [{"call": item["call_id"], "ref": REF, "text": "t"}]


def test_without_retrieve_or_without_the_tool_a_marker_asks_for_nothing() -> None:
    conversation = from_chat(with_retrieval(MARKER))
    assert Script().reply(Script().session("s", conversation), conversation, "").kind == "tool"
    bare = from_chat({**with_retrieval(MARKER), "tools": [{"type": "function", "function": {"name": "Read"}}]})
    script = Script(retrieve=True)
    assert script.reply(script.session("s", bare), bare, "").kind == "tool"
