"""The room a cut leaves for the next turns (`contextpaw_headroom`): sized from the turns, or set."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from contextpaw.core.compact import HEADROOM, TURN_SLACK, compact_chat, recut_target
from contextpaw.core.conversation import Conversation
from contextpaw.core.tokens import EstimateCounter
from contextpaw.settings import FIT_OPTIONS, read

COUNTER = EstimateCounter()


def reads(turns: int, lines: int) -> list[dict]:
    msgs: list[dict] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read every file."}]
    for n in range(turns):
        msgs += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": f"c{n}", "type": "function", "function": {"name": "read", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": f"c{n}", "content": f"line {n} of the file\n" * lines},
        ]
    return msgs


def test_a_cut_leaves_room_for_one_more_turn_like_the_last_ones() -> None:
    """Turns of a file each: the cut leaves about one file's room, so the next turn appends."""
    msgs = reads(12, 120)
    budget = 6000
    result = compact_chat(Conversation.from_wire(msgs), budget, COUNTER)
    turn = COUNTER.message(Conversation.from_wire(msgs).messages[-1]) + COUNTER.message(Conversation.from_wire(msgs).messages[-2])
    assert HEADROOM[0] <= result.plan.headroom <= HEADROOM[1]
    assert result.plan.headroom == pytest.approx(turn / budget + TURN_SLACK, abs=0.005)
    assert result.report.final_tokens <= result.report.target == recut_target(budget, result.plan.headroom)
    grown = msgs + reads(13, 120)[-2:]
    grown[-2]["tool_calls"][0]["id"] = grown[-1]["tool_call_id"] = "next"
    appended = compact_chat(Conversation.from_wire(grown), budget, COUNTER, previous=result.plan)
    assert appended.messages[: len(result.messages)] == result.messages, "the next turn appends to what was sent"


@pytest.mark.parametrize("share", [0.0, 0.2, 0.5])
def test_a_set_headroom_is_the_share_every_cut_leaves(share: float) -> None:
    msgs = reads(12, 120)
    result = compact_chat(Conversation.from_wire(msgs), 6000, COUNTER, headroom=share)
    assert result.plan.headroom == share and result.report.target == 6000 - int(6000 * share)
    assert 0.95 * result.report.target <= result.report.final_tokens <= result.report.target


@pytest.mark.parametrize(("value", "share"), [("auto", None), ("0", 0.0), ("20", 0.2), ("50", 0.5), ("12.5", 0.125)])
def test_the_option_reads_auto_or_a_percentage_of_the_budget(value: str, share: float | None) -> None:
    options = SimpleNamespace(contextpaw_headroom=value)
    assert read(options, {"contextpaw_headroom": FIT_OPTIONS["contextpaw_headroom"]})["headroom"] == share


@pytest.mark.parametrize("value", ["a lot", "-5", "51"])
def test_a_headroom_that_is_neither_auto_nor_a_percentage_is_refused_by_name(value: str) -> None:
    options = SimpleNamespace(contextpaw_headroom=value)
    with pytest.raises(ValueError, match="contextpaw_headroom"):
        read(options, {"contextpaw_headroom": FIT_OPTIONS["contextpaw_headroom"]})


def test_a_fresh_file_that_needs_the_headroom_is_kept_whole_and_the_fit_says_it_is_held_there() -> None:
    """Everything older gone, the file just read still takes the fit past its target: it is kept
    whole up to the budget (the next turn will cut), the plan says so for the server's check, and
    the report's target is the room the kept part leaves (with a note), not one no cut could reach."""
    msgs = reads(6, 120)
    msgs[-1]["content"] = "fresh line\n" * 1400  # 4,818 tokens
    budget = 5300
    result = compact_chat(Conversation.from_wire(msgs), budget, COUNTER)
    assert result.messages[-1] is msgs[-1], "the file just read is sent whole"
    assert result.report.final_tokens <= budget and result.plan.held
    assert abs(result.report.target - result.report.final_tokens) <= 1, (result.report.target, result.report.final_tokens)
    assert any("less than its headroom" in note for note in result.report.notes), result.report.notes
    roomy = compact_chat(Conversation.from_wire(reads(12, 120)), 6000, COUNTER)
    assert not roomy.plan.held
