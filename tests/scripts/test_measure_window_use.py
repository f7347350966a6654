"""scripts/bench/measure_window_use.py's bookkeeping, without servers: the budget it measures against is the
one ContextPaw computes, the guard's note is read, and the chats are shaped as it says."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from contextpaw.core.conversation import Conversation
from contextpaw.core.tokens import EstimateCounter
from contextpaw.fitting.budget import Budgeter
from contextpaw.wire.base import Params

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import measure_window_use as wu  # noqa: E402


def test_the_window_budget_is_contextpaws_for_a_one_token_answer() -> None:
    budgeter = Budgeter(default_ctx=4096, reserve=1024, margin=64)
    for window in (256, 512, 1024, 2048, 4096, 8192):
        budget = asyncio.run(budgeter.budget(None, Params("m", False, num_ctx=window, max_output=1)))  # type: ignore[arg-type]
        assert wu.window_budget(window) == budget.tokens


def test_the_budget_a_fit_was_held_to_is_the_guards_when_it_says_so() -> None:
    guarded = {"budget": 391, "notes": ["budget 391 of 959: the count is an estimate, and this route cannot ask"]}
    assert wu.fitted_to(guarded, {}) == 391
    assert wu.fitted_to({"budget": 959, "notes": []}, {}) == 959
    assert wu.fitted_to(None, {"x-contextpaw-budget": "959"}) == 959


def test_a_row_against_the_windows_budget_flags_a_cut_and_a_missing_report() -> None:
    report = {"compacted": True, "budget": 959, "final_tokens": 950, "counter": "backend", "notes": []}
    sent = {"real_tokens": 940, "report": report, "headers": {}, "seconds": 1.0}
    row = wu.row(wu.LLAMACPP, 1024, wu.SCALED, 4000, sent)
    assert (row["budget"], row["error"]) == (959, None) and abs(row["use"] - 940 / 959) < 1e-9
    cut = {"cut": True, "sent_tokens": 1100, "kept_tokens": 1000, "num_ctx": 1024}
    assert "cut the prompt" in wu.row(wu.OLLAMA_CHAT, 1024, wu.SCALED, 4000, sent, cut)["error"]
    assert wu.row(wu.LLAMACPP, 1024, wu.SCALED, 4000, sent | {"report": None})["error"]
    summary = wu.summary([row])[wu.LLAMACPP]
    assert (summary["measured"], summary["over_100"], summary["met"]) == (1, 0, True)


def test_scaled_chats_have_dumps_of_an_eighth_of_the_window_and_ollama_form_keeps_the_calls() -> None:
    estimate = EstimateCounter()
    chat = wu.agent_chat(4096, 1024, seed=7)
    dumps = [estimate.text(m["content"]) for m in chat if m["role"] == "tool"]
    assert len(dumps) >= 16 and sum(dumps) / len(dumps) < 1024 / 4
    fixed = wu.agent_chat(4096, 1024, seed=7, shape=wu.FIXED)
    assert len(fixed) < len(chat)
    native = wu.ollama_messages(chat)
    assert [m["role"] for m in native] == [m["role"] for m in chat]
    call = next(m for m in native if m.get("tool_calls"))
    assert call["content"] == "" and isinstance(call["tool_calls"][0]["function"]["arguments"], dict)
    assert Conversation.from_wire(json.loads(json.dumps(chat))).messages


def test_a_row_below_its_goal_says_why_in_numbers_and_one_at_its_goal_says_nothing() -> None:
    removals = [
        {"index": 3, "role": "tool", "tokens": 262, "action": "dropped"},
        {"index": 5, "role": "tool", "tokens": 90, "action": "shrunk"},
    ]
    exact = {"compacted": True, "budget": 1983, "final_tokens": 1838, "counter": "backend", "notes": [], "removals": removals}
    short = wu.row(wu.LLAMACPP, 2048, wu.SCALED, 8000, {"real_tokens": 1838, "report": exact, "headers": {}, "seconds": 1.0})
    assert wu.shortfall(short) == "the fit ends 145 tokens under its budget in its own count (the smallest message it removed: 262)"
    high = exact | {"final_tokens": 1918, "counter": "calibrated", "removals": []}
    over = wu.row(wu.OLLAMA_CHAT, 2048, wu.FIXED, 7000, {"real_tokens": 1777, "report": high, "headers": {}, "seconds": 1.0})
    assert wu.shortfall(over) == "ContextPaw's count ran 7.9% over the server's; the fit ends 65 tokens under its budget in its own count"
    why = "this kind of text is not learned yet: its count may be 2.34 times low"
    note = f"budget 472 of 959: the count is an estimate, and this route cannot ask Ollama to refuse instead of cutting ({why})"
    guarded = high | {"final_tokens": 464, "notes": [note]}
    held = wu.row(
        wu.OLLAMA_V1, 1024, wu.FIXED, 4000, {"real_tokens": 335, "report": guarded | {"budget": 959}, "headers": {}, "seconds": 1.0}
    )
    assert wu.shortfall(held).startswith(f"held to 472 of 959 (49.2%), where a cut cannot be refused: {why}; ")
    full = wu.row(
        wu.LLAMACPP, 2048, wu.SCALED, 8000, {"real_tokens": 1960, "report": exact | {"final_tokens": 1960}, "headers": {}, "seconds": 1.0}
    )
    assert wu.shortfall(full) is None
    summary = wu.summary([short, full])[wu.LLAMACPP]
    assert summary["shortfalls"] == [f"-c 2048 scaled: {wu.shortfall(short)}"] and not summary["met"]
