"""A conversation keeps its cuts across a restart: with the SQLite archive, the plan one fitter made
is read back by a new fitter over the same database, so the next turn repeats the same cuts and the
server's cached prefix still holds."""

from __future__ import annotations

from pathlib import Path

from contextpaw.fitting.fitter import Fitter
from contextpaw.fitting.flow import Forward
from contextpaw.ops.archive_sqlite import ARCHIVE_FILE, SqliteStore
from contextpaw.ops.metrics import Stats
from contextpaw.settings import FitSettings
from support.fitters import FakeServices, chat, next_turn, repeats_prefix, state

SECRET = b"kept" * 8
"""The proxy's secret, read from the state directory at each start: the same after a restart."""


def started(path: Path) -> Fitter:
    store = SqliteStore(path, max_items=100, max_bytes=1 << 20, max_age_s=3600)
    f = Fitter(FakeServices(), Stats(store), store, FitSettings())
    f.configure(f.settings, None, SECRET)
    return f


async def test_the_next_turn_after_a_restart_repeats_the_first_turns_cuts(tmp_path: Path) -> None:
    path = tmp_path / "state" / ARCHIVE_FILE
    first = started(path)
    turn = chat(turns=16, num_ctx=4096)  # a window whose markers share holds several
    one = state(turn)
    decision = await first.fit(one)
    assert isinstance(decision, Forward) and decision.body is not None and one.report is not None
    key = next(iter(first.plans))
    first.store.close()  # the proxy stops; its plans in memory go with it

    second = started(path)
    assert key not in second.plans
    again, two, asked = await next_turn(second, turn)
    second.store.close()
    assert isinstance(again, Forward) and two.report is not None
    assert asked == [key]
    assert repeats_prefix(decision.body, again.body), (one.report.notes, two.report.notes)  # the cached prefix still holds
    holes = lambda report: {r.marker_id for r in report.removals if r.action == "dropped"}  # noqa: E731
    assert holes(one.report) <= holes(two.report)  # a text cut deeper is a marker of its own
