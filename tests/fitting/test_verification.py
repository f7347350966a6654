"""The verify loop's search, sans I/O: each reading of a server's count, and the step it leads to."""

from __future__ import annotations

import pytest

from contextpaw.core.compact import Plan, recut_target
from contextpaw.core.report import Report
from contextpaw.fitting.budget import Budget
from contextpaw.fitting.engine import Fitted
from contextpaw.fitting.verification import Reading, Refit, Search, Send

BUDGET = Budget(window=2048, reserve=1, margin=64)  # 1983 tokens, as -c 2048 with max_tokens 1
FIRST_CUT = Plan(evicted=frozenset({"a"}))
HEADROOM = 0.25


def fit(ours: int, plan: Plan = FIRST_CUT, body: bytes | None = b"{}") -> Fitted:
    """A cut our count makes `ours` tokens."""
    return Fitted(body, Report(True, "evict", 9000, ours, BUDGET.tokens, counter="backend"), plan)


def carried(fitted: Fitted, total: int) -> Fitted:
    """`fitted` as the search sends or keeps it once the server counted it within the budget (a
    report is frozen: the search makes the one with the server's count)."""
    return fitted.told(final_tokens=total, exact=True)


def test_a_fit_the_server_counts_over_the_budget_is_cut_tighter_by_what_our_count_missed() -> None:
    search = Search(BUDGET, BUDGET, None)
    first = fit(1950)
    assert search.read(first, 2010) is Reading.OVER
    step = search.counted(first, 2010, last=False)
    assert isinstance(step, Refit) and step.budget.tokens == BUDGET.tokens - 60
    assert first.report.final_tokens == 1950 and not first.report.exact, "a fit over keeps our count: it is not sent"


def test_a_cut_confirmed_well_under_the_target_is_made_fuller_at_the_rate_the_server_counted_it() -> None:
    search = Search(BUDGET, BUDGET, None)
    under = fit(1957)
    step = search.counted(under, 1339, last=False)
    assert isinstance(step, Refit) and step.budget.tokens == 1983 * 1983 // 1339 and step.budget.limit == 0
    assert under.report.final_tokens == 1957 and not under.report.exact, "the fit counted is left as it was"
    kept = search.best()
    assert kept is not None and kept.fitted.report.final_tokens == 1339 and kept.fitted.report.exact, (
        "a fit within carries the server's count"
    )
    assert kept == Send(carried(under, 1339), 1957 * 1983 // 1339 - 1983), "the next turn starts as much looser as our count ran over"


def test_once_a_fuller_fit_went_over_the_next_aim_lies_between_it_and_the_one_confirmed() -> None:
    search = Search(BUDGET, BUDGET, None)
    search.counted(fit(1957), 1339, last=False)
    fuller = search.counted(fit(2878), 1882, last=False)
    assert isinstance(fuller, Refit) and fuller.budget.tokens == 2936 * 1983 // 1882
    too_full = fit(3043)
    assert search.read(too_full, 2115) is Reading.PAST_CONFIRMED
    between = search.counted(too_full, 2115, last=False)
    assert isinstance(between, Refit) and 2936 < between.budget.tokens < 3043


def test_with_no_whole_token_between_a_fit_under_and_one_over_the_fullest_confirmed_goes_out() -> None:
    search = Search(BUDGET, BUDGET, None)
    search.counted(fit(1900), 1800, last=False)
    confirmed = fit(2000)
    search.counted(confirmed, 1900, last=False)  # aimed at 2000 * 1983 // 1900 = 2087
    search.tightened = Budget(BUDGET.window, BUDGET.reserve, BUDGET.window - BUDGET.reserve - 2001, limit=0)
    step = search.counted(fit(2001), 2040, last=False)
    assert isinstance(step, Send) and step.fitted == carried(confirmed, 1900)


def test_a_turn_that_only_repeats_last_turns_cuts_goes_out_as_soon_as_it_is_within_the_budget() -> None:
    search = Search(BUDGET, BUDGET, FIRST_CUT)
    repeat = fit(1700)
    assert search.read(repeat, 1200) is Reading.APPENDS
    step = search.counted(repeat, 1200, last=False)
    assert isinstance(step, Send) and step.fitted == carried(repeat, 1200), "no fuller fit: it would move the cached prefix"


def test_a_cut_the_server_counts_past_its_target_leaves_more_headroom_under_the_same_budget_and_is_kept_in_case() -> None:
    """Our count put the cut on its target (1,480 of 1,487), the server's past it (1,900): the
    evictions aim lower by the server's rate, and the budget stays, so the newest unit may still
    use it whole."""
    search = Search(BUDGET, BUDGET, Plan(evicted=frozenset({"b"})))
    recut = fit(1480, plan=Plan(evicted=frozenset({"a"}), headroom=HEADROOM))
    step = search.counted(recut, 1900, last=False)
    assert search.target == recut_target(BUDGET.tokens, HEADROOM) < BUDGET.tokens, "the fit began from last turn's cuts"
    assert search.read(recut, 1900) is Reading.PAST_HEADROOM
    assert isinstance(step, Refit) and step.budget.tokens == BUDGET.tokens
    assert step.headroom == pytest.approx(1 - (1480 * search.target // 1900) / BUDGET.tokens)
    assert search.best() is not None and search.best().fitted == carried(recut, 1900)
    assert search.counted(fit(1940), 1890, last=True).fitted.report.final_tokens == 1890, "on the last count the nearest goes"


def test_a_turn_started_loose_by_last_turns_overcount_that_goes_over_starts_again_from_the_budget() -> None:
    loose = Budget(BUDGET.window, BUDGET.reserve, BUDGET.margin - 900, limit=0)
    search = Search(BUDGET, loose, None)
    over = fit(2800)
    assert search.read(over, 2100) is Reading.PAST_LOOSENED
    step = search.counted(over, 2100, last=False)
    assert isinstance(step, Refit) and step.budget == BUDGET


def test_the_request_as_it_came_goes_out_when_the_server_counts_it_within_what_the_budget_admits() -> None:
    search = Search(BUDGET, BUDGET, None)
    whole = fit(2100, plan=Plan(), body=None)
    step = search.counted(whole, BUDGET.admits, last=False)
    assert isinstance(step, Send) and step.overcount == 0
    sent = step.fitted.report
    assert sent.original_tokens == sent.final_tokens == BUDGET.admits and sent.exact


def test_every_reading_has_a_step() -> None:
    search = Search(BUDGET, BUDGET, None)
    assert set(search._steps) == set(Reading)


def test_a_refit_that_starts_from_last_turns_cuts_is_aimed_at_the_re_cut_target_though_the_first_fit_was_whole() -> None:
    """Started loose by last turn's overcount, the whole request fitted uncut; counted over, it is
    cut again from last turn's cuts, and that re-cut keeps the engine's headroom."""
    loose = Budget(BUDGET.window, BUDGET.reserve, BUDGET.margin - 900, limit=0)
    search = Search(BUDGET, loose, FIRST_CUT)
    assert search.counted(fit(2800, plan=Plan(), body=None), 2100, last=False) == Refit(BUDGET)
    recut = fit(1480, plan=Plan(evicted=frozenset({"a", "b"}), headroom=HEADROOM))
    assert search.read(recut, 1900) is Reading.CONFIRMED, "before it is counted, the target is the budget"
    step = search.counted(recut, 1900, last=False)
    assert search.target == recut_target(BUDGET.tokens, HEADROOM) and isinstance(step, Refit), "over the re-cut target: cut tighter"


def test_on_the_last_count_a_fit_past_the_confirmed_one_sends_the_confirmed_one() -> None:
    search = Search(BUDGET, BUDGET, None)
    confirmed = fit(1957)
    search.counted(confirmed, 1339, last=False)
    step = search.counted(fit(2878), 2100, last=True)
    assert isinstance(step, Send) and step.fitted == carried(confirmed, 1339)


def test_a_fit_held_over_its_target_by_what_must_be_kept_is_sent_as_it_is() -> None:
    """The newest tool result kept whole takes the fit past the target, within the budget: cut
    tighter, it would be shrunk, so the server's count of it within the budget sends it."""
    search = Search(BUDGET, BUDGET, None)
    held = fit(1900, plan=Plan(evicted=frozenset({"a"}), headroom=HEADROOM, held=True))
    assert search.read(held, 1880) is Reading.CONFIRMED
    step = search.counted(held, 1880, last=False)
    assert isinstance(step, Send) and step.fitted == carried(held, 1880)
    unheld = fit(1480, plan=Plan(evicted=frozenset({"a"}), headroom=HEADROOM))
    assert isinstance(Search(BUDGET, BUDGET, None).counted(unheld, 1880, last=False), Refit), "a fit that could go lower is cut deeper"


def test_a_cut_past_its_target_that_its_own_count_already_put_past_it_is_sent() -> None:
    """The engine could not reach its target (what lies before the last marker, what must be
    kept): aiming it lower again would not move it, so the fit within the budget goes."""
    search = Search(BUDGET, BUDGET, None)
    over = fit(1950, plan=Plan(evicted=frozenset({"a"}), headroom=HEADROOM))
    step = search.counted(over, 1900, last=False)
    assert isinstance(step, Send) and step.fitted == carried(over, 1900)
