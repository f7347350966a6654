"""Prefix stability across turns: what a server cached of turn N is still the start of turn N+1.

An agent's conversation only grows; each turn is fitted with the plan of the turn before (as the
fitter does). Everything the model read up to the last marker of turn N is sent again byte for
byte on turn N+1, unless the budget cannot hold it with what must follow; then the report says so.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contextpaw.core.compact import EARLIER_CUT, MERGED, BudgetTooSmall, Plan, compact_chat, recut_target
from contextpaw.core.conversation import Conversation, Message
from contextpaw.core.markers import MARKER_PREFIX, elision_text, hole_text
from contextpaw.core.shrink import PLACEHOLDER_ID, SHRINK_FLOOR
from contextpaw.core.tokens import EstimateCounter
from contextpaw.fitting.calibration import CalibratedCounter

BASE = EstimateCounter()
MARKER_ID = re.compile(r"ref (cp-[0-9a-f]{12}\.[0-9a-f]{16})")
SLACK = 150
"""What our count of a prefix may differ from the engine's (markers are priced with some slack)."""
WORDS = "alpha beta gamma delta parser token window cache slot build test module".split()


def text(tag: str, lines: int) -> str:
    return "".join(f"{tag} {n}: {' '.join(WORDS[(n + k) % len(WORDS)] for k in range(5))}\n" for n in range(lines))


sizes = st.one_of(st.integers(1, 4), st.integers(10, 80), st.integers(300, 1500))
"""Lines of a message (about 14 tokens a line): a remark, a file, a dump."""


@st.composite
def steps(draw: st.DrawFn, turn: int) -> list[dict]:
    """What one turn of an agent loop appends: tool calls and their results, sometimes a remark
    of the assistant or a word from the user."""
    out: list[dict] = []
    if draw(st.integers(0, 4)) == 0:
        out.append({"role": "assistant", "content": text(f"note{turn}", draw(st.integers(1, 6)))})
        out.append({"role": "user", "content": text(f"ask{turn}", draw(sizes))})
    calls = [
        {"id": f"c{turn}_{k}", "type": "function", "function": {"name": "read", "arguments": json.dumps({"turn": turn, "k": k})}}
        for k in range(draw(st.integers(1, 2)))
    ]
    out.append({"role": "assistant", "content": None, "tool_calls": calls})
    out += [{"role": "tool", "tool_call_id": c["id"], "content": text(f"out{turn}.{k}", draw(sizes))} for k, c in enumerate(calls)]
    return out


@st.composite
def sessions(draw: st.DrawFn) -> dict:
    start = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": text("task", draw(sizes))}]
    turns = [draw(steps(t)) for t in range(draw(st.integers(2, 14)))]
    calibrated = draw(st.booleans())
    factors = [draw(st.floats(0.85, 1.25)) if calibrated else 1.0 for _ in turns]
    return {
        "start": start,
        "turns": turns,
        "factors": factors,
        "budget": draw(st.integers(3200, 8000)),  # markers name their references from about 2,400 (2,900 with a URL)
        "keep_recent": draw(st.integers(1, 6)),
    }


def last_marker(prompt: list[dict]) -> int | None:
    found = [i for i, m in enumerate(prompt) if MARKER_PREFIX in json.dumps(m, ensure_ascii=False)]
    return found[-1] if found else None


def protected(msgs: list[dict], keep_recent: int) -> set[int]:
    """The indices the engine never deletes (the task, the current request, the recent ones, and
    the rest of their tool units)."""
    conv = Conversation.from_wire(msgs)
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    kept = set(range(max(0, len(msgs) - keep_recent), len(msgs))) | {users[0], users[-1]}
    return {i for u in conv.units() if kept.intersection(u.indices) for i in u.indices}


def shrunk_only(message: dict, removals: list) -> bool:
    """Whether the marker in `message` is only a shrunk message's note (no hole's marker)."""
    ids = set(MARKER_ID.findall(json.dumps(message, ensure_ascii=False)))
    return all(r.action == "shrunk" for r in removals if r.marker_id in ids)


def boundary(prompt: list[dict], last: int, removals: list) -> int:
    """The original index of the last message that the prompt's prefix through `last` stands for."""
    ids = set(MARKER_ID.findall(json.dumps(prompt[last], ensure_ascii=False)))
    standalone = Message.from_wire(prompt[last]).content_text.startswith(MARKER_PREFIX) and prompt[last]["content"].endswith(".]")
    ends = [r.index + (1 if r.action != "shrunk" and not standalone else 0) for r in removals if r.marker_id in ids]
    return max(ends)


def least_after(msgs: list[dict], keep_recent: int, after: int, counter, newest_whole: bool = False) -> int:
    """A lower bound on what must follow the prefix: the protected messages after it and the rest
    of the unit it ends in (when the prefix holds the start of that unit), each at no more than its
    shrink floor; and each run of other messages between them, kept (at its floors) or told by a
    marker of its own, as a hole cannot reach across a kept message, and a hole does not join the
    last marker's (a marker once sent stays as it was). With `newest_whole`, the newest unit (the
    file just read) at its whole size: it is shrunk only after the prefix gave way."""
    conv = Conversation.from_wire(msgs)
    straddling = {i for u in conv.units() if min(u.indices) < after for i in u.indices}
    kept = {i for i in protected(msgs, keep_recent) | straddling if i > after}
    floors = [floor(m, counter) for m in conv.messages]
    if newest_whole:
        newest = next(u for u in conv.units() if len(msgs) - 1 in u.indices)
        for i in newest.indices:
            floors[i] = counter.message(conv.messages[i])
        kept |= {i for i in newest.indices if i > after}
    runs = itertools.groupby(range(after + 1, len(msgs)), key=kept.__contains__)
    gaps = [list(run) for is_kept, run in runs if not is_kept]
    marked = sum(min(least_note(counter), sum(floors[i] for i in gap)) for gap in gaps)
    return sum(floors[i] for i in kept) + marked


def least_note(counter) -> int:
    """The least a marker's text costs (a hole of one small message), folded into a message or not."""
    return counter.text(hole_text({"tool result": 1}, 1, PLACEHOLDER_ID))


def least_marker(counter) -> int:
    """The least a marker of its own costs."""
    return counter.message_overhead + least_note(counter)


def floor(message: Message, counter) -> int:
    """The least a message can be cut to: its head and tail and the note between them (one without
    content text, an assistant's tool calls, is never shrunk)."""
    text = message.content_text
    if not text:
        return counter.message(message)
    note = counter.text(elision_text(counter.text(text), text.count("\n"), PLACEHOLDER_ID))
    return min(counter.message(message), counter.message_overhead + SHRINK_FLOOR + note)


@settings(max_examples=150, deadline=None, derandomize=True, report_multiple_bugs=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(sessions())
def test_each_turn_resends_the_last_turns_prompt_through_its_last_marker_unless_the_budget_cannot_hold_it(session):
    msgs = list(session["start"])
    plan: Plan | None = None
    sent: list[dict] | None = None
    sent_removals: list = []
    for turn, factor in zip(session["turns"], session["factors"]):
        msgs = msgs + turn
        counter = CalibratedCounter(BASE, factor) if factor != 1.0 else BASE
        budget, keep_recent = session["budget"], session["keep_recent"]
        try:
            result = compact_chat(Conversation.from_wire(msgs), budget, counter, keep_recent=keep_recent, previous=plan)
        except BudgetTooSmall:
            continue  # refused: nothing was sent, and the plan of the last sent turn still holds
        prompt = msgs if result.messages is None else result.messages
        # a conversation that fits whole goes as it came: nothing is cut, so no cut moved
        last = None if sent is None or result.messages is None else last_marker(sent)
        notes = [n for n in result.report.notes if EARLIER_CUT in n or MERGED in n]
        merged = any(MERGED in n for n in notes)  # the markers' share forced one hole: said, and the reason
        if last is not None and prompt[:last] != sent[:last] and not merged:
            assert notes, f"turn re-cut before the last marker (message {last}) without saying so"
            # and the budget really could not hold it: the prefix, at this turn's count, leaves less
            # than the headroom for what must follow, or less than the least of it
            prefix = sum(counter.message(Message.from_wire(m)) for m in sent[:last])
            # a marker stays byte for byte; a message shrunk there may be cut deeper, to a marker's size at least
            marker = counter.message(Message.from_wire(sent[last]))
            if shrunk_only(sent[last], sent_removals):
                marker = min(marker, least_marker(counter))
            after = boundary(sent, last, sent_removals)
            least = marker + least_after(msgs, keep_recent, after, counter)
            whole = marker + least_after(msgs, keep_recent, after, counter, newest_whole=True)
            target = recut_target(budget, result.plan.headroom)
            assert (prefix + marker > target - SLACK or prefix + least > budget - SLACK
                    or prefix + whole > target - SLACK), notes  # fmt: skip
        elif last is not None and shrunk_only(sent[last], sent_removals) and prompt[last : last + 1] != sent[last : last + 1]:
            assert notes, f"the shrunk message {last} was cut anew without saying so"
        assert result.report.final_tokens <= budget
        sent, sent_removals, plan = prompt, result.report.removals, result.plan


def test_a_re_cut_past_a_parallel_call_straddling_the_last_marker_is_one_the_budget_needs() -> None:
    """The session CI's random run found, with a 900-token budget: the last marker is a shrunk
    result of a parallel call, and what must follow it (the call's other result, the user's message
    and the recent call, at their floors, and between them a unit or its marker) does not fit
    beside the prefix, so the re-cut reaches before the marker and says so. The property's bound
    once left out the runs between protected messages, and took this for a gap in the engine."""
    session = json.loads((Path(__file__).parents[1] / "fixtures" / "prefix_early_cut.json").read_text())
    test_each_turn_resends_the_last_turns_prompt_through_its_last_marker_unless_the_budget_cannot_hold_it.hypothesis.inner_test(session)


def test_a_text_cut_deeper_by_a_token_or_two_is_cut_at_the_next_line_not_evicted_with_its_prefix() -> None:
    """The session CI's run found: the opening shrunk, a 6,000-token read shrunk as the newest, then
    a small turn leaves the prompt one token over the target. A text is cut at whole lines, so
    asking it for one token more moved nothing, eight times, and the engine took the prefix for too
    big and evicted the read before the last marker. Each ask that moves nothing now asks twice as
    much: the read is cut at the next line, and the prefix stays."""
    session = json.loads((Path(__file__).parents[1] / "fixtures" / "prefix_deeper_cut.json").read_text())
    test_each_turn_resends_the_last_turns_prompt_through_its_last_marker_unless_the_budget_cannot_hold_it.hypothesis.inner_test(session)
