"""Reports mean what they say: a refusal names the counter that decided it, and a size that is only
an upper bound is never told as a count (report JSON, headers)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from contextpaw import wire
from contextpaw.core.report import Removal, Report
from contextpaw.fitting.flow import Refuse
from support.common import context_overflow_error
from support.fitters import LLAMACPP, ToolBlindCounting, chat, fitter, state, with_counting

MESSAGES = wire.route_for(wire.Kind.LLAMACPP, "POST", "/v1/messages")


async def test_a_system_prompt_too_long_alone_is_refused_on_llama_servers_own_count() -> None:
    body = {"model": "m", "max_tokens": 16, "system": "rule " * 3000, "messages": [{"role": "user", "content": "hi"}]}
    counting = ToolBlindCounting()
    f = with_counting(fitter(default_ctx=1024, discover_window=False), counting)
    s = state(body, MESSAGES, LLAMACPP)
    decision = await f.fit(s)
    assert isinstance(decision, Refuse) and s.report is not None
    report = json.loads(decision.body)["contextpaw"]
    assert (report["counter"], report["exact"]) == ("backend", True)
    assert counting.totals and report["original_tokens"] == await counting.total("", body)


def size_proved() -> Report:
    return Report(False, "none", 612, 612, 960, counter="size", window=1024, notes=("fits by its size: at most 612 tokens",))


def test_a_size_bound_is_a_header_named_at_most_never_original_tokens() -> None:
    headers = size_proved().headers()
    assert headers == {"X-ContextPaw-Compacted": "false", "X-ContextPaw-Tokens-At-Most": "612", "X-ContextPaw-Budget": "960"}


def test_a_size_bound_is_marked_as_one_in_the_report() -> None:
    told = size_proved().to_json()
    assert told["upper_bound"] is True and told["original_tokens"] == 612 and told["counter"] == "size"


def test_a_counted_report_names_its_counts_and_carries_no_bound_mark() -> None:
    counted = Report(True, "evict", 5000, 900, 960, counter="backend", exact=True, window=1024)
    assert "upper_bound" not in counted.to_json()
    headers = counted.headers()
    assert headers["X-ContextPaw-Original-Tokens"] == "5000" and headers["X-ContextPaw-Final-Tokens"] == "900"
    assert "X-ContextPaw-Tokens-At-Most" not in headers


async def test_a_small_request_proved_to_fit_is_told_as_at_most_its_bound() -> None:
    f = fitter(discover_window=False, default_ctx=8192)
    s = state({"model": "m", "messages": [{"role": "user", "content": "Hello again"}]})
    await f.fit(s)
    assert s.report is not None and s.report.counter == "size"
    bound = int(s.headers["X-ContextPaw-Tokens-At-Most"])
    assert bound >= len("Hello again") and "X-ContextPaw-Original-Tokens" not in s.headers


def test_a_report_is_frozen_and_the_next_one_made_from_it_keeps_its_removals_rows() -> None:
    cut = Report(True, "evict", 5000, 900, 960, removals=(Removal(3, "tool", 4100, "dropped", "m1"),), markers=("m1",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cut.final_tokens = 800  # type: ignore[misc]
    rows = cut.removal_rows()
    noted = dataclasses.replace(cut, notes=("a note",))
    assert noted.removal_rows() is rows, "the rows are built once for the same removals"
    assert cut.notes == () and noted.to_json()["notes"] == ["a note"] and noted.to_json()["removals"] == rows


async def test_the_verdict_on_an_answer_makes_a_new_report_and_leaves_the_one_told_before_as_it_was() -> None:
    f = fitter(output_reserve=0, forbid_truncation=False)
    s = state(chat())
    await f.fit(s)
    before = s.report
    assert before is not None and before.compacted
    value = f.answers.final_report(s, {"done": True, "prompt_eval_count": 1024})  # Ollama's cut of a 2048 window
    assert s.report is not before and s.report is not None and s.report.upstream_truncated is not None
    assert value == s.report.to_json() and before.upstream_truncated is None and not any("trusted" in n for n in before.notes)


async def test_a_rescue_that_recovered_says_so_in_a_new_report() -> None:
    f, s = fitter(), state(chat(num_ctx=8192))
    await f.fit(s)
    assert s.sent_tokens is not None
    overflow = json.dumps({"error": json.dumps(context_overflow_error(s.sent_tokens * 2, 4096))}).encode()  # as Ollama passes it on
    retry = await f.rescue(s, 400, overflow)
    told = s.report
    assert isinstance(retry, bytes) and told is not None and not told.recovered_from_upstream_400
    assert f.settle_rescue(s, 200, relay_failed=False)
    assert s.report is not told and s.report is not None and s.report.recovered_from_upstream_400
    assert s.report.to_json() == {**told.to_json(), "recovered_from_upstream_400": True}
