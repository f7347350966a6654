"""The agents' recorded requests (tests/agents/fixtures/) through the engine, without the CLIs: what
each agent sends first, continued as its session goes on, keeps its head when it is cut (pure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from contextpaw import wire
from contextpaw.core.tokens import EstimateCounter
from contextpaw.fitting.engine import fit_chat
from contextpaw.wire import openai

FIXTURES = Path(__file__).parents[1] / "agents" / "fixtures"
COUNTER = EstimateCounter()


def qwen_code_session(files: int) -> dict[str, Any]:
    """Qwen Code 0.24.4's first request as recorded, then ``files`` turns of its ``read_file`` tool,
    each result a file of about 5,000 tokens by the estimate."""
    body = json.loads((FIXTURES / "qwen-code-0.24.4.json").read_text())["request"]["body"]
    for n in range(files):
        call = {"id": f"call_{n}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"file_path": f"/work/file-{n}.txt"})}}  # fmt: skip
        body["messages"] += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{n}", "content": f"file {n}\n" + f"line of file {n}\n" * 1000},
        ]
    return body


def test_qwen_code_session_cut_keeps_its_head_tools_and_pairs() -> None:
    """Its system prompt, 14 tools and first user message (four reminders and the task, as text
    parts) go as sent; what is evicted goes a call with its result; the file just read stays."""
    body = qwen_code_session(files=6)
    chat = openai.CHAT.read(json.dumps(body).encode())
    assert isinstance(chat, wire.Chat)
    fitted = fit_chat(chat, 40_000, COUNTER, keep_recent=2, previous=None)
    assert fitted.body is not None and fitted.report.compacted, fitted.report
    sent = json.loads(fitted.body)
    assert sent["tools"] == body["tools"] and len(sent["tools"]) == 14
    assert sent["messages"][:2] == body["messages"][:2], "the head was rewritten"
    assert sent["messages"][-1] == body["messages"][-1], "the file just read was cut"
    calls = {c["id"] for m in sent["messages"] for c in m.get("tool_calls") or []}
    results = {m["tool_call_id"] for m in sent["messages"] if m["role"] == "tool"}
    assert calls == results and len(calls) < 6, (calls, results)
    assert "[ContextPaw:" in json.dumps(sent["messages"]) and fitted.report.final_tokens <= 40_000
