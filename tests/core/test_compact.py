"""The compaction engine's contract, as properties over random agent conversations and named cases."""

from __future__ import annotations

import json

import jinja2
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from contextpaw.core.compact import OPENING_SHRUNK, BudgetTooSmall, compact_chat, recut_target
from contextpaw.core.conversation import Conversation, Message
from contextpaw.core.markers import MARKER_PREFIX
from contextpaw.core.prompt import compact_prompt
from contextpaw.core.shrink import SHRINK_FLOOR
from contextpaw.core.tokens import EstimateCounter

COUNTER = EstimateCounter()

# -- random conversations ---------------------------------------------------------------------

texts = st.one_of(
    st.just(""),
    st.text(max_size=40),
    st.builds(lambda line, n: (line + "\n") * n, st.text(min_size=1, max_size=30), st.integers(1, 400)),
    st.builds(lambda word, n: " ".join([word] * n), st.sampled_from(["data", "日本語", "ünï", "🐾"]), st.integers(50, 3000)),
)


def _content(text: str, style: int) -> object:
    if style == 0:
        return text
    parts: list[object] = [{"type": "text", "text": text}]
    if style == 2:
        parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
    return parts


@st.composite
def conversations(draw: st.DrawFn, alternating: bool = False) -> tuple[list[dict], list | None]:
    ollama = draw(st.booleans())
    msgs: list[dict] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(st.text(max_size=200))})
    msgs.append({"role": "user", "content": "TASK: " + draw(texts)})
    call_no = 0
    for _ in range(draw(st.integers(0, 25))):
        last = msgs[-1]["role"]
        kind = draw(st.sampled_from(["user", "assistant", "tools"]))
        if alternating:
            kind = "assistant" if last == "user" else "user"
        if kind == "tools" and last != "user" and last != "tool":
            kind = "user"
        if kind == "tools":
            n = draw(st.integers(1, 3))
            calls = []
            for k in range(n):
                fn = {"name": f"tool{k}", "arguments": {"q": draw(st.text(max_size=20))}}
                if ollama:
                    calls.append({"function": fn})
                else:
                    fn["arguments"] = json.dumps(fn["arguments"])
                    calls.append({"id": f"call_{call_no}", "type": "function", "function": fn})
                call_no += 1
            msgs.append({"role": "assistant", "content": "" if ollama else None, "tool_calls": calls})
            for k, call in enumerate(calls):
                result = {"role": "tool", "content": draw(texts)}
                if ollama:
                    result["tool_name"] = call["function"]["name"]
                else:
                    result["tool_call_id"] = call["id"]
                msgs.append(result)
        else:
            message = {"role": kind, "content": _content(draw(texts), draw(st.integers(0, 2)))}
            if kind == "assistant" and draw(st.booleans()):
                message["thinking"] = draw(st.text(max_size=50))
            if ollama and kind == "user" and draw(st.integers(0, 5)) == 0:
                message["images"] = ["iVBORw0KGgo="]
            msgs.append(message)
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "and now?"})
    tools = [{"type": "function", "function": {"name": "tool0", "parameters": {"type": "object"}}}]
    return msgs, (tools if draw(st.booleans()) else None)


def sent_tokens(messages: list, tools: object) -> int:
    return COUNTER.tools(tools) + sum(COUNTER.message(Message.from_wire(m)) for m in messages)


def check_pairing(messages: list) -> None:
    """Every tool result follows its call, every call has all of its results."""
    i = 0
    while i < len(messages):
        m = messages[i]
        calls = m.get("tool_calls") or []
        if m["role"] == "tool":
            raise AssertionError(f"orphaned tool result at {i}")
        if calls:
            results = messages[i + 1 : i + 1 + len(calls)]
            assert len(results) == len(calls) and all(r["role"] == "tool" for r in results), f"call at {i} lost results"
            ids = {c.get("id") for c in calls}
            assert all(r.get("tool_call_id") in ids for r in results if "tool_call_id" in r)
            i += len(calls)
        i += 1


def head_indices(msgs: list) -> set[int]:
    """What is never cut: system messages, and every message up to the first user message unless
    that is the last one (then it is the request, and may be shrunk)."""
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    opening = set(range(users[0] + 1)) if users and users[0] < len(msgs) - 1 else set()
    return opening | {i for i, m in enumerate(msgs) if m["role"] in ("system", "developer")}


def kept_indices(original: list, sent: list) -> list[int]:
    """Original positions of the messages sent unchanged (identity: kept messages are not copied)."""
    position = {id(m): i for i, m in enumerate(original)}
    return [position[id(m)] for m in sent if id(m) in position]


# -- properties ----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), st.floats(0.05, 1.2), st.integers(0, 6))
def test_any_conversation_fits_with_everything_that_matters_intact(case, fraction, keep_recent):
    msgs, tools = case
    conv = Conversation.from_wire(msgs, tools)
    original = sent_tokens(msgs, tools)
    budget = max(1, int(original * fraction))
    try:
        result = compact_chat(conv, budget, COUNTER, keep_recent=keep_recent)
    except BudgetTooSmall as e:
        pinned = COUNTER.tools(tools) + sum(COUNTER.message(Message.from_wire(msgs[i])) for i in head_indices(msgs))
        protected = keep_recent + 1 + 3  # recent messages, the task, and tool units that straddle the line
        assert e.required > budget
        images = sum(Message.from_wire(m).images for m in msgs) * COUNTER.image_tokens  # cannot be shrunk
        assert budget < pinned + images + protected * (SHRINK_FLOOR + 200) + 400, "gave up although shrinking could fit"
        return
    if result.messages is None:
        assert original <= budget and not result.report.compacted
        return
    sent = result.messages
    report = result.report
    # it fits, counted by the same counter, markers included, and the report never understates it
    assert sent_tokens(sent, tools) <= report.final_tokens <= budget
    # system messages are identical and the head is never rewritten
    systems = [m for m in msgs if m["role"] == "system"]
    assert [m for m in sent if m["role"] == "system"] == systems
    assert all(s is m for s, m in zip(sent, msgs[: len(systems)]) if m["role"] == "system")
    head = sorted(i for i in head_indices(msgs) if msgs[i]["role"] != "system")
    if OPENING_SHRUNK in report.notes:  # no budget holds it whole: shrunk middle-out, in its place
        assert all(sent[n] is msgs[n] or {r.index: r.action for r in report.removals}.get(n) == "shrunk" for n in head)
    else:
        assert all(sent[n] is msgs[n] for n in head), "the opening up to the first user message is sent byte for byte"
    # order is preserved and the last user message is there (whole or shrunk middle-out)
    kept = kept_indices(msgs, sent)
    assert kept == sorted(kept)
    last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    last_text = Message.from_wire(msgs[last_user]).content_text
    assert last_user in kept or any(m["role"] == "user" and last_text[:10] in Message.from_wire(m).content_text for m in sent)
    check_pairing(sent)
    # no system marker, no new same-role neighbours
    for a, b in zip(sent, sent[1:]):
        if a["role"] == b["role"] and a["role"] in ("user", "assistant"):
            assert any(x["role"] == y["role"] and x["role"] == a["role"] for x, y in zip(msgs, msgs[1:]))
    # what the report says was dropped is exactly what is missing
    dropped = {r.index for r in report.removals if r.action == "dropped"}
    shrunk = {r.index for r in report.removals if r.action == "shrunk"}
    folded = [Message.from_wire(m).content_text for m in sent if MARKER_PREFIX in json.dumps(m)]
    for i in set(range(len(msgs))) - set(kept) - dropped - shrunk:
        original = Message.from_wire(msgs[i]).content_text
        assert any(f.endswith(original) for f in folded), f"message {i} vanished without a report"
    assert sum(r.tokens for r in report.removals if r.action == "dropped") == sum(
        COUNTER.message(Message.from_wire(msgs[i])) for i in dropped
    )
    assert set(report.markers) == set(report.evicted)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), st.floats(0.1, 0.9))
def test_compaction_is_deterministic_and_idempotent(case, fraction):
    msgs, tools = case
    budget = int(sent_tokens(msgs, tools) * fraction)
    try:
        first = compact_chat(Conversation.from_wire(msgs, tools), budget, COUNTER)
    except BudgetTooSmall:
        return
    again = compact_chat(Conversation.from_wire(msgs, tools), budget, COUNTER)
    assert first.messages == again.messages and first.plan == again.plan
    if first.messages is not None:
        second = compact_chat(Conversation.from_wire(first.messages, tools), budget, COUNTER)
        assert second.messages is None, "an output that fits was changed again"


MISTRAL_STYLE = jinja2.Environment().from_string(
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.index0 != 0 %}{{ raise('system message not first') }}{% endif %}"
    "{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}{{ raise('roles must alternate') }}{% endif %}"
    "{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% elif m.role == 'assistant' %}{{ m.content }}</s>"
    "{% endif %}{% endfor %}"
)


def render_strict(messages: list) -> str:
    def fail(reason: str) -> None:
        raise jinja2.TemplateError(reason)

    return MISTRAL_STYLE.render(messages=messages, raise_exception=fail, **{"raise": fail})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(alternating=True), st.floats(0.05, 0.9))
def test_markers_never_break_a_strict_alternating_template(case, fraction):
    msgs, _ = case
    render_strict(msgs)
    try:
        result = compact_chat(Conversation.from_wire(msgs), int(sent_tokens(msgs, None) * fraction), COUNTER)
    except BudgetTooSmall:
        return
    assume(result.messages is not None)
    render_strict(result.messages)


# -- named regressions ----------------------------------------------------------------------------


def agent_loop(turns: int, dump_lines: int = 200, parallel: int = 1) -> list[dict]:
    msgs: list[dict] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the failing test in parser.py."},
    ]
    for t in range(turns):
        calls = [
            {"id": f"c{t}_{k}", "type": "function", "function": {"name": "read", "arguments": f'{{"n": {t}}}'}} for k in range(parallel)
        ]
        msgs.append({"role": "assistant", "content": None, "tool_calls": calls})
        msgs += [{"role": "tool", "tool_call_id": c["id"], "content": f"output {t}.{k}\n" * dump_lines} for k, c in enumerate(calls)]
    msgs.append({"role": "user", "content": "Status?"})
    return msgs


def test_huge_newest_tool_dump_is_shrunk_middle_out_not_deadlocked():
    msgs = agent_loop(3, dump_lines=10)
    msgs.insert(
        -1,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "big", "type": "function", "function": {"name": "cat", "arguments": "{}"}}],
        },
    )
    msgs.insert(-1, {"role": "tool", "tool_call_id": "big", "content": "".join(f"log line {n}\n" for n in range(20000))})
    result = compact_chat(Conversation.from_wire(msgs), 4000, COUNTER)
    dump = next(m for m in result.messages if m.get("tool_call_id") == "big")
    assert dump["content"].startswith("log line 0\n") and dump["content"].endswith("log line 19999\n")
    assert MARKER_PREFIX in dump["content"] and "tokens" in dump["content"]
    assert any(r.action == "shrunk" for r in result.report.removals)
    assert result.report.final_tokens <= 4000
    # the cut lands on line boundaries: every kept line is whole
    head, _, rest = dump["content"].partition("\n" + MARKER_PREFIX)
    assert head.endswith("log line " + head.rsplit("log line ", 1)[1])


def test_parallel_tool_calls_are_evicted_with_all_their_results():
    msgs = agent_loop(12, dump_lines=100, parallel=3)
    result = compact_chat(Conversation.from_wire(msgs), 6000, COUNTER)
    check_pairing(result.messages)
    dropped = [r for r in result.report.removals if r.action == "dropped"]
    assert dropped and len(dropped) % 4 == 0  # each unit: one call message and three results


def test_system_prompt_alone_over_budget_is_a_clear_error():
    msgs = [{"role": "system", "content": "rule\n" * 5000}, {"role": "user", "content": "hi"}]
    with pytest.raises(BudgetTooSmall, match="system prompt") as err:
        compact_chat(Conversation.from_wire(msgs), 1000, COUNTER)
    assert err.value.required > err.value.budget == 1000


def test_an_opening_too_big_for_any_budget_is_shrunk_middle_out_its_start_and_end_kept():
    """A pasted document as the first message cannot be kept byte for byte in any budget left: it
    is shrunk middle-out like any message that must be kept (its start and end reach the model, a
    marker between them), and the report says so. The system prompt is never touched."""
    task = "DOCUMENT START\n" + "".join(f"requirement {n}: must hold\n" for n in range(5000)) + "DOCUMENT END\n"
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": task},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "What is the last requirement?"},
    ]
    result = compact_chat(Conversation.from_wire(msgs), 3000, COUNTER)
    sent = result.messages
    assert result.report.final_tokens <= 3000 and OPENING_SHRUNK in result.report.notes
    assert sent[0] == msgs[0] and sent[-1] == msgs[-1]
    opening = sent[1]["content"]
    assert opening.startswith("DOCUMENT START\n") and opening.endswith("DOCUMENT END\n") and MARKER_PREFIX in opening
    assert [r.action for r in result.report.removals if r.index == 1] == ["shrunk"]


def test_an_opening_that_fits_stays_byte_for_byte_while_the_rest_gives_way():
    task = "".join(f"requirement {n}: must hold\n" for n in range(200))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task}]
    msgs += [{"role": r, "content": f"{r} {n} " * 200} for n in range(6) for r in ("assistant", "user")]
    budget = COUNTER.message(Message.from_wire(msgs[1])) + 900
    result = compact_chat(Conversation.from_wire(msgs), budget, COUNTER)
    assert result.messages[1] is msgs[1] and OPENING_SHRUNK not in result.report.notes


def test_a_task_sent_after_the_agents_environment_is_the_head_and_never_cut():
    """Codex sends its environment (`<environment_context>`) and the task as two user messages
    before the model answers: both are the opening, which no budget cuts into."""
    environment = {"role": "user", "content": "<environment_context>\n  <cwd>/work</cwd>\n</environment_context>"}
    task = {"role": "user", "content": "".join(f"Read notes/file-{n:02d}.txt, then list every FACT line.\n" for n in range(40))}
    msgs = agent_loop(8, dump_lines=120)
    msgs[1:2] = [environment, task]
    fits = 0
    for budget in range(800, 6000, 200):
        try:
            result = compact_chat(Conversation.from_wire(msgs), budget, COUNTER)
        except BudgetTooSmall:
            continue
        fits += 1
        assert (result.messages or msgs)[:3] == msgs[:3] and all(r.index > 2 for r in result.report.removals), budget
    assert fits > 10


def test_the_task_is_the_first_user_message_that_is_more_than_an_agents_context():
    def task_index(*texts: str) -> int:
        return Conversation.from_wire(
            [{"role": "developer", "content": "rules"}, *({"role": "user", "content": t} for t in texts)]
        ).task_index()

    agents_md = "# AGENTS.md instructions for /work\n\n<INSTRUCTIONS>\nuse tabs\n</INSTRUCTIONS>"
    environment = "<environment_context>\n  <cwd>/work</cwd>\n</environment_context>"
    assert task_index(agents_md, environment, "fix the bug", "and the other one") == 3
    assert task_index("fix the bug", "and the other one", "and a third") == 1, "a run of the user's own words: the first is the task"
    assert task_index("<b>fix</b> the bug and <i>this</i>", "next") == 1, "markup in the user's words is not an agent's context"
    assert Conversation.from_wire([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "go"}]).task_index() == 1


def test_a_huge_request_of_its_own_is_shrunk_middle_out():
    """A first user message that is also the last is the request itself, not history: shrunk."""
    task = "".join(f"requirement {n}: must hold\n" for n in range(5000))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task}]
    result = compact_chat(Conversation.from_wire(msgs), 3000, COUNTER)
    sent_task = result.messages[1]["content"]
    assert sent_task.startswith("requirement 0: must hold") and sent_task.endswith("requirement 4999: must hold\n")
    assert result.messages[0] is msgs[0]
    assert 0.95 * 3000 <= result.report.final_tokens <= 3000


def test_kept_messages_come_out_as_they_came_in():
    msgs = agent_loop(30)
    msgs[5]["x_vendor_field"] = {"keep": [1, 2]}
    result = compact_chat(Conversation.from_wire(msgs), 5000, COUNTER)
    for m in result.messages:
        if MARKER_PREFIX not in json.dumps(m):
            assert any(m is original for original in msgs)


def test_fitting_conversation_is_a_no_op():
    msgs = agent_loop(2)
    result = compact_chat(Conversation.from_wire(msgs), 100_000, COUNTER)
    assert result.messages is None and not result.report.compacted and result.report.removals == ()


def test_evictions_are_sticky_so_the_prefix_survives_the_next_turn():
    msgs = agent_loop(40, dump_lines=60)
    budget = int(sent_tokens(msgs, None) * 0.5)
    turn1 = compact_chat(Conversation.from_wire(msgs), budget, COUNTER)
    grown = msgs + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "n1", "type": "function", "function": {"name": "read", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "n1", "content": "new\n" * 60},
        {"role": "user", "content": "next"},
    ]
    fresh = compact_chat(Conversation.from_wire(grown), budget, COUNTER)
    sticky = compact_chat(Conversation.from_wire(grown), budget, COUNTER, previous=turn1.plan)

    def common_prefix(a: list, b: list) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    assert turn1.plan.evicted <= sticky.plan.evicted
    assert common_prefix(turn1.messages, sticky.messages) >= common_prefix(turn1.messages, fresh.messages)
    assert common_prefix(turn1.messages, sticky.messages) > len(turn1.messages) // 2


def test_an_agent_loop_that_overflows_again_is_cut_after_the_last_marker_with_headroom_so_the_next_turns_only_append():
    """Cutting just enough each turn would move the last hole's marker every turn, and the server
    would evaluate everything after it again; with headroom the next turns append to what it cached,
    and a re-cut changes nothing before the last marker the server has already seen."""
    msgs = agent_loop(30, dump_lines=200)
    budget = int(sent_tokens(msgs, None) * 0.6)
    plan, recut_turns, appended_turns = compact_chat(Conversation.from_wire(msgs), budget, COUNTER).plan, 0, 0
    sent = None
    for t in range(30, 50):
        turn = [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": f"n{t}", "type": "function", "function": {"name": "read", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": f"n{t}", "content": f"output {t}\n" * 200},
        ]
        msgs = msgs[:-1] + turn + [{"role": "user", "content": "Status?"}]
        result = compact_chat(Conversation.from_wire(msgs), budget, COUNTER, previous=plan)
        assert result.report.final_tokens <= budget and not result.report.notes
        if sent is not None and result.messages[: len(sent) - 1] == sent[:-1]:
            appended_turns += 1  # all but the closing question is a prefix of what was sent before
        elif sent is not None:
            recut_turns += 1
            last = max(i for i, m in enumerate(sent) if MARKER_PREFIX in json.dumps(m))
            assert result.messages[:last] == sent[:last], "a re-cut keeps what the server cached"
            assert result.report.final_tokens + sent_tokens(turn, None) <= budget, "a re-cut leaves room for the next turn"
        sent, plan = result.messages, result.plan
    assert appended_turns > recut_turns


def test_marker_names_tokens_says_gone_and_carries_retrieval_id():
    msgs = agent_loop(20)
    result = compact_chat(Conversation.from_wire(msgs), 3000, COUNTER)
    marker = next(m for m in result.messages if "removed; ref cp-" in json.dumps(m))
    text = Message.from_wire(marker).content_text
    assert "tokens" in text and "Do not guess or invent removed text" in text  # the legend, in the first marker
    marker_id = next(i for i in result.report.markers if i in text)
    assert result.report.evicted[marker_id][0]["role"] in ("assistant", "tool")
    assert marker["role"] != "system"


def test_unknown_fields_images_and_ids_survive_a_round_trip():
    raw = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:x"}}],
            "name": "bob",
        },
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "hm",
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "a", "content": "r", "vendor": 1},
        {"role": "user", "content": "x", "images": ["AAAA"]},
    ]
    conv = Conversation.from_wire(raw)
    assert [m.raw for m in conv.messages] == raw and [len(u.indices) for u in conv.units()] == [1, 2, 1]
    assert conv.messages[0].images == 1 and conv.messages[3].images == 1


def test_ollama_tool_results_pair_by_position():
    raw = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {}}}],
        },
        {"role": "tool", "tool_name": "a", "content": "1"},
        {"role": "tool", "tool_name": "b", "content": "2"},
        {"role": "user", "content": "q2"},
    ]
    assert [u.indices for u in Conversation.from_wire(raw).units()] == [(0,), (1, 2, 3), (4,)]


@pytest.mark.parametrize("bad", [[1], [{"content": "no role"}], [{"role": 3, "content": "x"}]])
def test_malformed_messages_are_a_value_error(bad):
    with pytest.raises(ValueError):
        Conversation.from_wire(bad)


def test_raw_prompt_keeps_head_and_tail_and_marks_the_middle():
    prompt = "SECRET=walrus\n" + "".join(f"filler {n}\n" for n in range(8000)) + "What is SECRET?"
    result = compact_prompt(prompt, 1000, COUNTER)
    assert result.prompt.startswith("SECRET=walrus\n") and result.prompt.endswith("What is SECRET?")
    assert MARKER_PREFIX in result.prompt
    assert 0.95 * 1000 <= result.report.final_tokens <= 1000
    assert result.report.removals[0].tokens > 0 and result.report.evicted[result.report.markers[0]] == prompt


def test_raw_prompt_that_fits_is_untouched():
    assert compact_prompt("short", 100, COUNTER).prompt is None


def test_a_digest_rides_in_its_hole_marker_within_the_budget():
    msgs = agent_loop(20)
    first = compact_chat(Conversation.from_wire(msgs), 3000 - 200, COUNTER)  # room left for the digests
    digests = {marker_id: f"Digest of {marker_id}: file outputs 0-9 read." for marker_id in first.report.markers}
    second = compact_chat(Conversation.from_wire(msgs), 3000, COUNTER, digests=digests, previous=first.plan)
    assert second.report.summarized and second.report.final_tokens <= 3000
    carried = [m for m in second.messages if "a digest, not the original text" in json.dumps(m)]
    assert carried and all(any(d in json.dumps(m) for d in digests.values()) for m in carried)
    assert {r.action for r in second.report.removals if r.action != "shrunk"} == {"summarized"}


@settings(max_examples=200, deadline=None)
@given(texts, st.integers(70, 3000))
def test_any_raw_prompt_fits_its_budget(prompt, budget):
    try:
        result = compact_prompt(prompt, budget, COUNTER)
    except BudgetTooSmall:
        assert budget < SHRINK_FLOOR
        return
    if result.prompt is not None:
        assert COUNTER.text(result.prompt) == result.report.final_tokens <= budget


def test_a_repeated_request_is_cut_exactly_as_before():
    """The shrink target is remembered, not the result: no drift from one identical turn to the next."""
    paste = "".join(f"requirement {n}: must hold\n" for n in range(3000))
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": paste}]
    first = compact_chat(Conversation.from_wire(msgs), 2000, COUNTER)
    plan = first.plan
    for _ in range(3):
        again = compact_chat(Conversation.from_wire(msgs), 2000, COUNTER, previous=plan)
        assert again.messages == first.messages
        plan = again.plan


@pytest.mark.parametrize("budget", range(2000, 4001, 250))
def test_room_whole_units_cannot_use_is_filled_with_a_shrunk_one(budget):
    msgs = agent_loop(10, dump_lines=120)  # units of ~700 tokens: whole ones leave gaps that big
    result = compact_chat(Conversation.from_wire(msgs), budget, COUNTER)
    target = recut_target(budget, result.plan.headroom)
    # a shrunk unit's floor and note may not fit the last gap; below 3,000 tokens a fill's note may
    # also take the markers past their share (5%), and is not made
    assert (0.9 if budget >= 3000 else 0.85) * target <= result.report.final_tokens <= target
    check_pairing(result.messages)


@pytest.mark.parametrize("budget", range(8000, 20001, 1500))
def test_room_of_a_few_percent_is_filled_too_where_a_shrunk_unit_fits_in_it(budget):
    """Dumps of ~1,500 tokens leave up to 4% of the budget that no whole unit fits in: that is
    more than a shrunk unit needs (its floor and the note), and it goes to the model, not to waste."""
    msgs = agent_loop(12, dump_lines=600)
    result = compact_chat(Conversation.from_wire(msgs), budget, COUNTER)
    target = recut_target(budget, result.plan.headroom)
    assert 0.99 * target <= result.report.final_tokens <= target
    check_pairing(result.messages)


# -- a fit never ends a few tokens short; cuts and markers read the same next turn ------------------


class JoinedTextCounter(EstimateCounter):
    """Counts texts it was shown exactly (as llama-server's per-text counts are) and any other text
    at a denser rate, as `BackendCounter` estimates a text it has not seen: a message whose parts
    are joined, or whose content was shrunk, costs more than its parts did. A message's cost then
    does not fall as far as its shrunk text's, which a single shrinking pass assumes it does."""

    def __init__(self, seen: set[str]) -> None:
        super().__init__(4.0)
        self.seen = seen
        self.dense = EstimateCounter(2.5)

    def text(self, text: str) -> int:
        return super().text(text) if text in self.seen else self.dense.text(text)


@st.composite
def recent_heavy(draw: st.DrawFn) -> list[dict]:
    """A task, a short history, and recent messages of several text parts, one of them huge."""
    line = draw(st.sampled_from(["log line 42 ok", "def f(x): return x", "データ 12", '{"k": [1, 2]}']))
    msgs: list[dict] = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "TASK: fix it"}]
    for n in range(draw(st.integers(0, 6))):
        msgs.append({"role": "assistant" if n % 2 == 0 else "user", "content": f"turn {n} " * draw(st.integers(1, 200))})
    for _ in range(draw(st.integers(1, 4))):
        parts = [{"type": "text", "text": (line + "\n") * draw(st.integers(1, 800))} for _ in range(draw(st.integers(1, 3)))]
        msgs.append({"role": "user", "content": parts})
        msgs.append({"role": "assistant", "content": "ok " * draw(st.integers(1, 50))})
    msgs.append({"role": "user", "content": [{"type": "text", "text": (line + "\n") * draw(st.integers(1, 1500))}]})
    return msgs


def seen_texts(msgs: list[dict]) -> set[str]:
    parsed = [Message.from_wire(m) for m in msgs]
    return {t for m in parsed for t in (m.text, m.content_text)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recent_heavy(), st.floats(0.02, 0.9), st.integers(1, 6))
def test_a_refusal_names_a_need_that_would_fit_and_every_fit_is_within_the_budget(msgs, fraction, keep_recent):
    counter = JoinedTextCounter(seen_texts(msgs))
    conv = Conversation.from_wire(msgs)
    budget = max(1, int(sum(counter.message(m) for m in conv.messages) * fraction))
    try:
        result = compact_chat(conv, budget, counter, keep_recent=keep_recent)
    except BudgetTooSmall as e:
        assert e.required > budget
        # no refusal a little more shrinking would have avoided: the need it names is enough
        enough = compact_chat(conv, e.required, counter, keep_recent=keep_recent)
        assert enough.report.final_tokens <= e.required
        return
    assert result.report.final_tokens <= budget


def grow(msgs: list[dict], t: int) -> list[dict]:
    return msgs[:-1] + [
        {"role": "assistant", "content": f"step {t}"},
        {"role": "user", "content": "Status?"},
    ]


def test_a_shrunk_message_is_cut_at_the_same_characters_next_turn_though_the_count_moved():
    """Calibration moves between turns; a cut kept by its token target would land a line earlier
    or later, and the server would evaluate everything after it again."""
    msgs = agent_loop(12, dump_lines=40)
    msgs.insert(
        -1,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "big", "type": "function", "function": {"name": "cat", "arguments": "{}"}}],
        },
    )
    msgs.insert(-1, {"role": "tool", "tool_call_id": "big", "content": "".join(f"log line {n}\n" for n in range(6000))})
    turn1 = compact_chat(Conversation.from_wire(msgs), 5000, COUNTER, keep_recent=6)
    moved = EstimateCounter(3.4)  # the next turn's counter counts about 6 % less: the old cut still fits
    turn2 = compact_chat(Conversation.from_wire(grow(msgs, 1)), 5000, moved, keep_recent=6, previous=turn1.plan)
    big1 = next(m for m in turn1.messages if m.get("tool_call_id") == "big")
    big2 = next(m for m in turn2.messages if m.get("tool_call_id") == "big")
    assert MARKER_PREFIX in big1["content"] and big2["content"] == big1["content"]
    assert turn2.report.final_tokens <= 5000


def test_a_markers_text_is_written_once_and_reused_byte_for_byte_while_the_count_moves():
    msgs = agent_loop(30, dump_lines=20)
    budget = int(sent_tokens(msgs, None) * 0.5)
    turn1 = compact_chat(Conversation.from_wire(msgs), budget, COUNTER)
    turn2 = compact_chat(Conversation.from_wire(grow(msgs, 1)), budget, EstimateCounter(3.4), previous=turn1.plan)
    first_marker = next(i for i, m in enumerate(turn1.messages) if MARKER_PREFIX in json.dumps(m))
    assert turn2.messages[: first_marker + 1] == turn1.messages[: first_marker + 1]
    assert turn1.plan.notes and set(turn1.plan.notes) <= set(turn2.plan.notes)


def test_one_removed_message_is_said_in_the_singular():
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "TASK"},
        {"role": "assistant", "content": "", "thinking": "old " * 2000},  # nothing to shrink: it goes whole
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "now?"},
    ]
    result = compact_chat(Conversation.from_wire(msgs), 300, COUNTER, keep_recent=5)
    assert "1 earlier assistant message (" in json.dumps(result.messages) and "tokens) removed" in json.dumps(result.messages)


def test_a_conversation_the_backend_admits_whole_is_not_cut_to_leave_room_for_the_answer():
    msgs = agent_loop(10, dump_lines=20)
    total = sent_tokens(msgs, None)
    result = compact_chat(Conversation.from_wire(msgs), total - 500, COUNTER, admit=total)
    assert result.messages is None and result.report.budget == total
    cut = compact_chat(Conversation.from_wire(msgs), total - 500, COUNTER, admit=total - 1)
    assert cut.messages is not None and cut.report.final_tokens <= total - 500


def test_both_shrunk_results_of_one_parallel_call_are_cut_the_same_way_next_turn():
    """A plan that remembered one cut per unit lost all but one of a parallel call's cuts, and the
    other result was cut anew (or sent whole) on the next turn."""
    msgs = agent_loop(1, dump_lines=4000, parallel=2)
    msgs[-2]["content"] = "".join(f"other {n}\n" for n in range(9000))  # cut elsewhere than the first
    turn1 = compact_chat(Conversation.from_wire(msgs), 3000, COUNTER, keep_recent=4)
    dumps1 = [m for m in turn1.messages if m["role"] == "tool"]
    assert len(dumps1) == 2 and all(MARKER_PREFIX in m["content"] for m in dumps1)
    turn2 = compact_chat(Conversation.from_wire(grow(msgs, 1)), 3000, EstimateCounter(3.4), keep_recent=4, previous=turn1.plan)
    assert [m for m in turn2.messages if m["role"] == "tool"] == dumps1


def test_no_refusal_is_a_few_tokens_short_of_a_fit_the_engine_can_make(capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/measure/measure_fit_margin.py's random conversations near the edge (its first 120 held 3 such
    refusals): none is refused when the same steps, given the tokens it says it lacks, land within
    the budget; no fit goes over it; every refusal's named need fits."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "measure" / "measure_fit_margin.py"
    spec = importlib.util.spec_from_file_location("measure_fit_margin", script)
    assert spec is not None and spec.loader is not None
    margin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(margin)
    assert margin.main(["--cases", "120"]) == 0, capsys.readouterr().out


@given(st.lists(st.sampled_from(["user", "assistant", "tool"]), min_size=1, max_size=40), st.data())
def test_what_taking_messages_back_would_cost_in_markers_is_what_taking_them_back_costs(roles: list[str], data: st.DataObject) -> None:
    """The engine weighs a unit it may take back without taking it back (`Holes.taken_back`): that
    must be exactly what `remove` does to the markers' total, for a unit inside a hole, at its
    edge, or alone in it."""
    from contextpaw.core.holes import Holes

    msgs = [Message.from_wire({"role": role, "content": f"message {i} " * (1 + i % 7)}) for i, role in enumerate(roles)]
    counter = EstimateCounter()
    holes = Holes(msgs, [counter.message(m) for m in msgs], counter, {})
    evicted = sorted(data.draw(st.sets(st.integers(0, len(msgs) - 1), min_size=1)))
    for i in evicted:
        holes.add([i])
    lo = data.draw(st.sampled_from(evicted))
    hi = lo
    while hi + 1 in evicted and data.draw(st.booleans()):
        hi += 1
    run = list(range(lo, hi + 1))
    before = holes.marker_total
    predicted = holes.taken_back(run)
    holes.remove(run)
    assert predicted == holes.marker_total - before


def test_messages_in_two_runs_are_left_for_remove_to_weigh() -> None:
    from contextpaw.core.holes import Holes

    msgs = [Message.from_wire({"role": "user", "content": f"message {i}"}) for i in range(6)]
    counter = EstimateCounter()
    holes = Holes(msgs, [counter.message(m) for m in msgs], counter, {})
    holes.add([1, 2, 3, 4])
    assert holes.taken_back([1, 4]) is None and holes.taken_back([2, 3]) is not None
