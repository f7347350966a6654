"""The refusal when an agent's fixed part (its instructions and tool definitions, the head that is
never cut) is over the window by itself: it names what the head needs and the least window that
holds it with room for an answer and the headroom, and that window does hold it."""

from __future__ import annotations

import pytest

from contextpaw.core.compact import HEADROOM, OPENING_SHRUNK, BudgetTooSmall, compact_chat
from contextpaw.core.conversation import Conversation
from contextpaw.core.tokens import EstimateCounter
from contextpaw.fitting.budget import Budgeter
from contextpaw.wire import Params

COUNTER = EstimateCounter()
BUDGETER = Budgeter(default_ctx=8192, reserve=1024, margin=64)
PARAMS = Params("m", False, max_output=32000)
"""Claude Code asks for 32,000 tokens of answer; the reserve is the configured 1,024 at most."""
TOOLS = [
    {"type": "function", "function": {"name": f"tool_{i}", "description": "Does one thing well. " * 40,
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
    for i in range(12)
]  # fmt: skip


def agent_chat(turns: int = 0) -> Conversation:
    """An agent's request: a long system prompt and twelve tools, the task, then `turns` exchanges."""
    messages = [{"role": "system", "content": "Follow the house rules. " * 900}, {"role": "user", "content": "say hi"}]
    for i in range(turns):
        messages += [{"role": "assistant", "content": f"step {i} " * 200}, {"role": "user", "content": f"result {i} " * 200}]
    return Conversation.from_wire(messages, TOOLS)


def refused(conversation: Conversation, window: int) -> BudgetTooSmall:
    with pytest.raises(BudgetTooSmall) as short:
        compact_chat(conversation, BUDGETER.for_window(window, PARAMS).tokens, COUNTER)
    return short.value


@pytest.mark.parametrize("turns", [0, 6])
def test_the_least_window_it_names_holds_the_head_with_the_headroom_free(turns: int) -> None:
    conversation = agent_chat(turns)
    budget = BUDGETER.for_window(8192, PARAMS)
    overflow = budget.impossible(refused(conversation, 8192))
    head = COUNTER.tools(TOOLS) + COUNTER.message(conversation.messages[0])
    assert overflow.head == head > budget.tokens
    assert overflow.fixed_part == (
        f"the agent's tools and instructions need {head} tokens; raise the window to at least {overflow.least_window}"
    )
    assert overflow.message.endswith(overflow.fixed_part)
    assert overflow.least_window is not None
    bigger = BUDGETER.for_window(overflow.least_window, PARAMS)
    fitted = compact_chat(conversation, bigger.tokens, COUNTER)
    assert fitted.report.final_tokens <= bigger.tokens
    assert head <= bigger.tokens * (1 - HEADROOM[0]), "the window named leaves no room for the turns after the head"


def test_a_head_that_fits_is_not_told_to_raise_the_window() -> None:
    """What cannot fit is the task and the latest messages, each at its least, not the head: the
    refusal says nothing of the agent's fixed part."""
    turns = [{"role": "user" if i % 2 else "assistant", "content": f"turn {i} " * 400} for i in range(7)]
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go on."}]
    long_turns = Conversation.from_wire([*opening, *turns])
    budget = BUDGETER.for_window(256, PARAMS)
    short = refused(long_turns, 256)
    overflow = budget.impossible(short)
    assert short.head is None and overflow.fixed_part == "" and "raise the window" not in overflow.message


def test_the_head_is_told_in_the_units_of_the_budget_the_client_is_told() -> None:
    """A refit under a budget tightened by a counting miss shifts the head as it shifts the need."""
    short = refused(agent_chat(), 8192)
    assert short.head is not None
    told = short.rescaled(short.budget + 300)
    assert (told.head, told.required, told.budget) == (short.head + 300, short.required + 300, short.budget + 300)


def test_a_huge_opening_is_the_users_and_is_not_counted_as_the_agents() -> None:
    """The conversation's opening is what the user wrote: the sentence names only the agent's own
    part, and the window it names holds the opening too; an opening alone over the budget is shrunk."""
    rest = [{"role": "user", "content": "note " * 3000}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    agent = Conversation.from_wire([{"role": "system", "content": "Follow the house rules. " * 900}, *rest], TOOLS)
    overflow = BUDGETER.for_window(8192, PARAMS).impossible(refused(agent, 8192))
    assert overflow.head == COUNTER.tools(TOOLS) + COUNTER.message(agent.messages[0])
    assert overflow.least_window is not None
    bigger = BUDGETER.for_window(overflow.least_window, PARAMS)
    assert compact_chat(agent, bigger.tokens, COUNTER).report.final_tokens <= bigger.tokens

    # the user's own opening, over any budget left, is shrunk middle-out rather than refused
    plain = Conversation.from_wire([{"role": "system", "content": "Be brief."}, *rest])
    budget = BUDGETER.for_window(2048, PARAMS).tokens
    fitted = compact_chat(plain, budget, COUNTER)
    assert fitted.report.final_tokens <= budget and OPENING_SHRUNK in fitted.report.notes
