"""scripts/bench/bench_agent_loop.py's bookkeeping, without a server: what a turn shared with the last,
which message first differed and why, the summary row and the plot. Nothing here is timed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(SCRIPTS))
import bench_agent_loop as loop  # noqa: E402

MARKER = "[ContextPaw: 2 earlier messages (1 assistant message, 1 tool result, 300 tokens) were removed here.]"


def turn(n: int, compacted: bool, cache_n: int, prompt_n: int, uncut_prompt_n: int) -> dict[str, Any]:
    r: dict[str, Any] = {
        "turn": n,
        "contextpaw": {
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "cached": cache_n / max(1, cache_n + prompt_n),
            "compacted": compacted,
            "notes": [],
        },
        "uncut": {"prompt_n": uncut_prompt_n},
    }
    r["ceiling"] = loop.window_ceiling(r)
    return r


def test_the_loop_at_scale_one_is_the_2048_token_loop_and_bigger_windows_get_longer_results() -> None:
    small, big = loop.agent_turns(30), loop.agent_turns(30, scale=4)
    assert len(small) == len(big) == 30 and small == loop.agent_turns(30, scale=1)
    assert len(small[-1]) == len(big[-1])  # the same messages, longer tool results
    assert sum(len(m["content"]) for m in big[-1]) > 3 * sum(len(m["content"]) for m in small[-1])
    assert (loop.scale_of(1024), loop.scale_of(2048), loop.scale_of(8192)) == (1, 1, 4)
    assert loop.uncut_ctx(2048) == loop.UNCUT_CTX and loop.uncut_ctx(8192) == 4 * 8192


def test_the_ceiling_is_all_but_what_the_turn_adds_and_never_below_zero() -> None:
    assert turn(2, False, 300, 100, 100)["ceiling"] == pytest.approx(0.75)
    assert turn(2, True, 0, 100, 400)["ceiling"] == 0.0


def test_a_turn_that_appends_shares_its_prefix_and_a_grown_hole_is_named_at_its_marker() -> None:
    system, task = {"role": "system", "content": "agent"}, {"role": "user", "content": "task"}
    calls = [{"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}"}]} for i in range(4)]
    results = [{"role": "tool", "content": f"result {i}"} for i in range(4)]
    first = [system, task, calls[0], results[0], calls[1], results[1]]
    cut = [system, task, {"role": "assistant", "content": MARKER}, calls[1], results[1], calls[2], results[2]]
    grown = [
        system,
        task,
        {"role": "assistant", "content": MARKER.replace("2 earlier", "4 earlier")},
        calls[2],
        results[2],
        calls[3],
        results[3],
    ]
    appended = [*grown, {"role": "user", "content": "more"}]
    rows = [turn(1, False, 0, 50, 50), turn(2, True, 10, 60, 20), turn(3, True, 20, 60, 15), turn(4, True, 70, 5, 5)]
    tokens = [[1, 2, 3, 4, 5], [1, 2, 9, 9, 9, 9], [1, 2, 8, 8, 8], [1, 2, 8, 8, 8, 7]]
    loop.trace(rows, [{"messages": m} for m in (first, cut, grown, appended)], tokens)
    assert [r["recut"] for r in rows] == [False, True, True, False]
    assert [r["contextpaw"]["shared_prefix"] for r in rows] == [0, 2, 2, 5]
    assert [r["contextpaw"]["prompt_tokens"] for r in rows] == [5, 6, 5, 6]
    assert rows[1]["recut_detail"]["first_difference"] == 2 and rows[1]["recut_detail"]["why"].startswith("evicted")
    detail = rows[2]["recut_detail"]
    assert (detail["first_difference"], detail["why"], detail["last_marker"]) == (2, "marker text (its hole grew)", 2)
    assert detail["was"]["marker"] and detail["is"]["head"].startswith("[ContextPaw: 4 earlier")
    assert not detail["before_last_marker"]
    assert rows[3]["contextpaw"]["layout"] == "s5 u4 a" + str(len(detail["is"]["head"])) + "* a0 t8 a0 t8 u4"

    summary = loop.table(2048, rows)
    assert (summary["first_compacted_turn"], summary["turns_after_first_cut"], summary["recut_turns"]) == (2, 2, 1)
    assert [c["turn"] for c in summary["recuts"]] == [2, 3]  # the first cut is listed, not counted
    assert summary["reuse_worst"] == pytest.approx(20 / 80) and summary["reuse_worst_turn"] == 3


def test_a_failed_turn_is_listed_not_averaged_and_the_next_is_compared_with_the_last_served() -> None:
    system, task = {"role": "system", "content": "agent"}, {"role": "user", "content": "task"}
    rows = [turn(1, False, 0, 50, 50), turn(2, True, 0, 0, 20), turn(3, True, 40, 10, 10), turn(4, True, 50, 5, 5)]
    rows[1]["contextpaw"]["failed"] = {"status": 400}
    bodies = [{"messages": [system]}, {"messages": [task]}, {"messages": [system, task]}, {"messages": [system, task, task]}]
    loop.trace(rows, bodies, [[1], [2], [1, 2], [1, 2, 2]])
    assert [r["recut"] for r in rows] == [False, False, False, False]
    assert rows[2]["contextpaw"]["shared_prefix"] == 1
    summary = loop.table(2048, rows)
    assert summary["failed_turns"] == [2] and summary["turns_after_first_cut"] == 2


def test_the_count_of_saved_requests_must_match_the_turns() -> None:
    with pytest.raises(RuntimeError, match="saved requests"):
        loop.trace([turn(1, False, 0, 5, 5)], [], [])


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="no matplotlib")
def test_the_plot_is_written(tmp_path: Path) -> None:
    rows = [turn(1, False, 0, 50, 50), turn(2, True, 10, 60, 20)]
    rows[1]["recut"] = True
    section = {"n_ctx": 2048, "turns": rows, "goal": loop.CACHE_GOAL, "table": loop.table(2048, rows)}
    loop.plot(section, tmp_path / "img" / "agent-loop-2048.png")
    assert (tmp_path / "img" / "agent-loop-2048.png").read_bytes()[:4] == b"\x89PNG"


def test_the_benchmark_table_counts_why_each_turn_fell_below_its_ceiling() -> None:
    from sections import report

    rows = [turn(9, True, 50, 50, 10), turn(11, True, 60, 40, 10), turn(12, True, 70, 30, 10)]
    rows[0]["recut_detail"] = {"before_last_marker": False, "earlier_cut_noted": False}
    rows[1]["recut_detail"] = {"before_last_marker": True, "earlier_cut_noted": True}
    rows[2]["recut_detail"] = {"before_last_marker": True, "earlier_cut_noted": False}
    said = report.recut_reasons(rows)
    assert said.startswith("1 re-cut after the last marker") and "1 forced before it by the budget" in said
    assert "1 before it unnoted, 0 other" in said and said.endswith("worst turn 9: 50% of 90%")


def test_every_run_gives_the_proxy_the_same_secret_so_that_two_runs_cut_alike(tmp_path: Path) -> None:
    from contextpaw.ops import keys

    state = tmp_path / "confdir"
    loop.fix_secret(state, loop.BENCH_SECRET)
    assert keys.secret(state) == loop.BENCH_SECRET  # what the proxy reads at its start, not a new one
    other = tmp_path / "other"
    loop.fix_secret(other, bytes(range(32)))
    assert keys.secret(other) == bytes(range(32))
    assert (state / keys.SECRET_FILE).stat().st_mode & 0o077 == 0


def test_a_secret_of_the_wrong_size_is_refused_before_any_server_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        loop.fix_secret(tmp_path, b"short")
    with pytest.raises(SystemExit):
        loop.main(["--secret", "abcd"])
