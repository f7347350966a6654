"""Counting from the conversation itself, where no tokenizer is known (Ollama's OpenAI route).

Ollama's `/v1/chat/completions` cuts an overflowing prompt in silence and cannot be asked to
refuse, so without the model's tokenizer the estimate's whole width (3.3 times) once held every
cut to a third of the window, and the file the agent had just read reached the model as a few
hundred characters. Each answer says exactly how many tokens its prompt took: the next turn is
counted at that conversation's own rate, so a cut fills the window to its target.
"""

from __future__ import annotations

import json
import math
from typing import Any

from contextpaw import wire
from contextpaw.core.tokens import EstimateCounter
from contextpaw.fitting.counter_choice import rough_size
from contextpaw.fitting.flow import UNCHANGED, Forward, Refuse
from support.common import FIXED_REPLY
from support.fitters import OLLAMA, OPENAI, fitter, state

WINDOW = 16384
RATE = 1.7
"""The model's true tokens to one of the estimate's (code and JSON run denser than prose)."""


def true_tokens(body: dict[str, Any]) -> int:
    """The model's own count of a body: the estimate at a rate the proxy is never told."""
    return math.ceil(rough_size(OPENAI.read(json.dumps(body).encode()), EstimateCounter()) * RATE)


def source_file(n: int, lines: int) -> str:
    return "".join(f"    value_{n}_{i} = compute(table[{i}], offset={n * i})  # FACT-{n}\n" for i in range(lines))


def session_body(reads: int, lines: int) -> dict[str, Any]:
    """An agent's chat: a system prompt and task, then one file read per turn."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": "Read the files one by one, then list every FACT line."},
    ]
    for n in range(reads):
        call = {"id": f"call_{n}", "type": "function", "function": {"name": "read", "arguments": json.dumps({"path": f"f{n}.py"})}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{n}", "content": source_file(n, lines)},
        ]
    return {"model": "qwen-no-tokenizer", "messages": messages}


def cut_of(report: Any) -> list[tuple[int, str]]:
    return [(r.index, r.action) for r in report.removals]


async def answer(f: Any, s: Any, sent: dict[str, Any]) -> int:
    """The server's answer to what was sent, with its own count of the prompt."""
    counted = true_tokens(sent)
    assert counted <= WINDOW, f"the model would cut {counted} tokens into {WINDOW} in silence"
    f.answers.final_report(s, {"choices": [{"message": {"content": FIXED_REPLY}}], "usage": {"prompt_tokens": counted}})
    return counted


async def test_without_a_tokenizer_each_cut_fills_the_window_to_its_target_at_the_conversations_own_rate() -> None:
    """The first turns are proved to fit by their size and go out unparsed; their answers still
    teach the conversation's rate, so the first turn that may overflow is not cut for the
    estimate's width."""
    f = fitter(default_ctx=WINDOW, output_reserve=0, discover_window=False)
    uses, fresh_whole, cuts, removed = [], [], 0, []
    for reads in range(1, 15):
        body = session_body(reads, lines=50)
        s = state(body, OPENAI, OLLAMA)
        decision = await f.fit(s)
        sent = body if decision == UNCHANGED else json.loads(decision.body)  # type: ignore[union-attr]
        if true_tokens(body) <= 0.9 * WINDOW and not cuts:
            assert decision == UNCHANGED, f"turn {reads} fits the window ({true_tokens(body)} of {WINDOW}) but was cut"
        counted = await answer(f, s, sent)
        assert s.report is not None
        report = s.report
        if isinstance(decision, Forward) and decision.compacted and cut_of(report) != removed:  # a new cut; else it appends
            cuts, removed = cuts + 1, cut_of(report)
            assert counted <= report.budget, f"turn {reads}: {counted} of {report.budget}"
            if cuts > 1:  # the first cut follows turns that fit; from then on the turns are anchored
                assert abs(counted - report.target) <= 0.05 * report.target, (reads, counted, report.target)
            fresh = body["messages"][-1]["content"]
            fresh_whole.append(fresh in json.dumps(sent["messages"][-1]["content"]) or sent["messages"][-1]["content"] == fresh)
            assert sent["messages"][:2] == body["messages"][:2], "the head goes as it came"
        if cuts:
            uses.append(counted / WINDOW)
    assert cuts >= 3, "the session overflowed the window several times"
    assert all(fresh_whole), "the file the agent just read reaches the model whole"
    assert sum(uses) / len(uses) >= 0.8, f"from the first cut on the prompts use {sum(uses) / len(uses):.0%} of the window"


async def test_a_count_the_estimates_bounds_cannot_explain_is_not_taken_for_the_conversations_rate() -> None:
    """A server that says it evaluated 200 tokens of thousands sent is not believed: counted at
    that rate, the next turn would go out many times over the window."""
    f = fitter(default_ctx=WINDOW, output_reserve=0, discover_window=False)
    s = state(session_body(6, lines=50), OPENAI, OLLAMA)
    await f.fit(s)
    f.answers.final_report(s, {"choices": [], "usage": {"prompt_tokens": 200}})
    again = state(session_body(7, lines=50), OPENAI, OLLAMA)
    await f.fit(again)
    assert again.report is not None and not any("own rate" in note for note in again.report.notes), again.report.notes


MESSAGES = wire.route_for(wire.Kind.OLLAMA, "POST", "/v1/messages")


def claude_like(reads: int) -> dict[str, Any]:
    """Claude Code's shape: a long system prompt and many tool schemas (half the window here), so
    that even its first request is over what the estimate's width allows, then a file read a turn
    as tool_use / tool_result blocks."""
    tools = [
        {"name": f"Tool{t}", "description": "Does one thing well. " * 25,
         "input_schema": {"type": "object", "properties": {f"arg{a}": {"type": "string", "description": "an argument " * 8} for a in range(4)}}}
        for t in range(12)
    ]  # fmt: skip
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read the files one by one, then list every FACT line."}]
    for n in range(reads):
        messages += [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": f"toolu_{n}", "name": "Read", "input": {"file_path": f"f{n}.py"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": source_file(n, 40)}]},
        ]
    return {"model": "qwen-no-tokenizer", "max_tokens": 32000, "system": "You are Claude Code. " * 80, "tools": tools, "messages": messages}


async def test_a_guarded_cut_whose_count_no_cut_from_the_front_can_explain_teaches_the_conversations_rate() -> None:
    """Claude Code's first request is over what the estimate's width allows, so it is cut to what
    must be kept, and its answer can only be judged possibly cut. But Ollama cuts from the front
    and keeps the system prompt, the tools and the last message: when even those, at the rate the
    count implies, could not have overflowed the window, the count is of the whole, and the next
    turns are counted at that rate; the file just read then reaches the model whole."""
    f = fitter(default_ctx=WINDOW, output_reserve=0, discover_window=False)
    anchored = []
    for reads in range(1, 9):
        body = claude_like(reads)
        s = state(body, MESSAGES, OLLAMA)
        decision = await f.fit(s)
        sent = body if decision == UNCHANGED else json.loads(decision.body)  # type: ignore[union-attr]
        counted = math.ceil(rough_size(MESSAGES.read(json.dumps(sent).encode()), EstimateCounter()) * RATE)
        assert counted <= WINDOW
        f.answers.final_report(s, {"type": "message_delta", "usage": {"input_tokens": counted, "output_tokens": 3}}, counted)
        assert s.report is not None
        anchored.append(any("own rate" in note for note in s.report.notes))
        if reads > 1:
            assert sent["messages"][-1] == body["messages"][-1], f"turn {reads}: the file just read is sent whole"
    assert all(anchored[1:]), anchored


def opening(words: int) -> dict[str, Any]:
    """Qwen Code's opening: its instructions, the environment and the task in one user message."""
    text = "Follow the project's conventions when you edit code and explain each change briefly. "
    return {"model": "qwen-no-tokenizer", "messages": [
        {"role": "system", "content": "You are Qwen Code, an interactive CLI agent."},
        {"role": "user", "content": text * (words // 13) + "Task: read the files one by one."}]}  # fmt: skip


async def test_an_opening_that_fits_at_the_estimates_rate_goes_out_whole_and_is_judged_by_the_servers_count() -> None:
    """Before any answer tells a conversation's rate, the guard allows for the estimate being 3.3
    times low; an opening that is one big message would be shrunk for that width alone. It goes out
    whole; the server's count of it says whether it was cut (here: no)."""
    f = fitter(default_ctx=WINDOW, output_reserve=0, discover_window=False)
    body = opening(words=3500)
    assert true_tokens(body) <= WINDOW < 3.3 * rough_size(OPENAI.read(json.dumps(body).encode()), EstimateCounter())
    s = state(body, OPENAI, OLLAMA)
    assert await f.fit(s) == UNCHANGED
    assert s.report is not None and any("opening goes out whole" in note for note in s.report.notes), s.report.notes
    await answer(f, s, body)
    assert s.report.upstream_truncated is None and s.report.upstream_truncation_possible is None


async def test_an_opening_over_the_window_at_the_estimates_rate_is_still_cut_to_the_guard() -> None:
    f = fitter(default_ctx=WINDOW, output_reserve=0, discover_window=False)
    s = state(opening(words=30000), OPENAI, OLLAMA)
    decision = await f.fit(s)
    assert isinstance(decision, Forward) and decision.compacted
    assert s.report is not None and not any("opening goes out whole" in note for note in s.report.notes)


async def test_a_strict_refusal_for_the_counts_error_names_the_count_it_feared_not_one_that_fits() -> None:
    """Qwen Code under strict on Ollama's /v1 without a tokenizer was refused with "maximum context
    length is 32704 tokens. However, your messages resulted in 21996 tokens": a refusal's numbers
    are its reason, so a turn whose count fits and whose count's error bound does not is refused
    with that bound's count."""
    f = fitter(default_ctx=WINDOW, output_reserve=0, discover_window=False, policy="strict")
    reads = 1
    while True:  # turns that fit by the conversation's own rate, until one fits only by its count
        body = session_body(reads, lines=50)
        s = state(body, OPENAI, OLLAMA)
        decision = await f.fit(s)
        if isinstance(decision, Refuse):
            break
        await answer(f, s, body)
        reads += 1
    error = json.loads(decision.body)["error"]
    assert s.report is not None and s.report.original_tokens <= error["budget"], "the turn's own count fits"
    assert error["n_prompt_tokens"] > error["budget"], error
    assert f"({error['n_prompt_tokens']} in the messages" in error["message"] and "may run" in error["message"], error


async def test_a_new_conversations_turn_no_droppable_message_could_explain_is_judged_whole_and_teaches_its_rate() -> None:
    """After an agent compacts its own history, its conversation is new: no rate of its own, so the
    guard's width holds it. Ollama drops the oldest messages one at a time until the rest fits, so
    the last one dropped must have been bigger than what the window had left over the count; when
    no message is that big even at 3.3 tokens to the estimate's one, nothing was cut. Judged
    "possible" instead, such a conversation never learned its rate and was cut every turn."""
    f = fitter(default_ctx=WINDOW, output_reserve=0, discover_window=False)
    body = session_body(16, lines=14)
    s = state(body, OPENAI, OLLAMA)
    decision = await f.fit(s)
    sent = body if decision == UNCHANGED else json.loads(decision.body)  # type: ignore[union-attr]
    estimated = rough_size(OPENAI.read(json.dumps(sent).encode()), EstimateCounter())
    assert s.calibration is not None and s.calibration.droppable is not None
    counted = await answer(f, s, sent)
    assert counted + 3.3 * (estimated - s.calibration.least) > WINDOW, "all it could drop does not rule a cut out"
    assert counted + 3.3 * s.calibration.droppable < WINDOW, "no one message could have been the last dropped"
    assert s.report is not None and s.report.upstream_truncation_possible is None, s.report.upstream_truncation_possible
    later = state(session_body(17, lines=14), OPENAI, OLLAMA)
    await f.fit(later)
    assert later.report is not None and any("own rate" in note for note in later.report.notes), later.report.notes


def summary_request(body: dict[str, Any], extra: str = "") -> dict[str, Any]:
    """An agent's own compaction: a system prompt of its own, the history it holds, and the ask."""
    messages = [{"role": "system", "content": "You summarize coding sessions for the agent that continues them."}]
    messages += body["messages"][1:] + [{"role": "user", "content": extra + "Summarize the session so far: files read, facts found."}]
    return {"model": body["model"], "messages": messages}


async def answered_session(f: Any, share: float) -> dict[str, Any]:
    """Turns answered whole and as they came, until the next would pass `share` of the window."""
    reads = 1
    while true_tokens(session_body(reads + 1, lines=50)) <= share * WINDOW:
        reads += 1
    for n in range(1, reads + 1):
        s = state(session_body(n, lines=50), OPENAI, OLLAMA)
        assert await f.fit(s) == UNCHANGED, f"turn {n} fits the window"
        await answer(f, s, session_body(n, lines=50))
    return session_body(reads, lines=50)


async def test_an_agents_summary_request_is_counted_at_the_rate_of_the_conversation_it_repeats() -> None:
    """Claude Code compacts its own history with a request whose system prompt is its own: a new
    conversation, with no rate of its own, that the guard's width (3.3 times) once cut though it was
    sized to fit. Its messages are the ones the server has just counted whole: it is counted at that
    rate, and goes out as it came. (Calibration off: a fresh proxy has learned no kind of text, and
    the agent tests run so.)"""
    f = fitter(default_ctx=WINDOW, output_reserve=0, discover_window=False, calibrate=False)
    last = await answered_session(f, 0.7)
    summary = summary_request(last)
    assert true_tokens(summary) <= 0.8 * WINDOW < 3.3 * rough_size(OPENAI.read(json.dumps(summary).encode()), EstimateCounter())
    s = state(summary, OPENAI, OLLAMA)
    assert await f.fit(s) == UNCHANGED
    assert s.report is not None and any("text it repeats" in note for note in s.report.notes), s.report.notes
    await answer(f, s, summary)
    assert s.report.upstream_truncated is None and s.report.upstream_truncation_possible is None


async def test_a_new_conversation_that_repeats_less_than_half_of_an_answered_one_is_not_counted_at_its_rate() -> None:
    """One file in common says little of how the rest tokenizes: the guard's bounds hold."""
    f = fitter(default_ctx=WINDOW, output_reserve=0, discover_window=False, calibrate=False)
    last = await answered_session(f, 0.7)
    other = summary_request(last, extra="Also consider: " + "".join(f"other_{i} = frobnicate({i})\n" for i in range(900)))
    s = state(other, OPENAI, OLLAMA)
    decision = await f.fit(s)
    assert isinstance(decision, Forward) and decision.compacted, "held to the guard's width"
    assert s.report is not None and not any("text it repeats" in note for note in s.report.notes), s.report.notes


async def test_the_conversation_after_an_agents_summary_is_counted_at_the_rate_of_the_files_it_reads_again() -> None:
    """After its summary Claude Code starts a new conversation: the summary, then the last files it
    read, attached again in messages of another shape. Those lines are what the server just counted;
    the new conversation is counted at that rate and goes out as it came."""
    f = fitter(default_ctx=WINDOW, output_reserve=0, discover_window=False, calibrate=False)
    last = await answered_session(f, 0.7)
    files = [m["content"] for m in last["messages"] if m["role"] == "tool"]
    after = {"model": last["model"], "messages": [
        last["messages"][0],
        {"role": "user", "content": "This session continues an earlier one. Summary: files read, facts found.\n"
                                    + "".join(f"Contents of f{n}.py:\n{text}" for n, text in enumerate(files))},
        {"role": "assistant", "content": "Reading the next file."},
        {"role": "user", "content": "Go on."},
    ]}  # fmt: skip
    assert true_tokens(after) <= 0.8 * WINDOW < 3.3 * rough_size(OPENAI.read(json.dumps(after).encode()), EstimateCounter())
    s = state(after, OPENAI, OLLAMA)
    assert await f.fit(s) == UNCHANGED
    assert s.report is not None and any("text it repeats" in note for note in s.report.notes), s.report.notes
