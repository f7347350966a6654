"""scripts/bench/bench.py's sections of issue 44 in --quick mode: a burst of overflowing requests and a
big buffered answer beside a small client, CPU per fuzz pass, and many sessions, each measured through
bare mitmdump and through ContextPaw in the same run, each with its row in the goals table.

What the numbers are is not judged here (the machine is shared); that each was measured on both paths,
that every request was answered, and that each goal row says met or why not.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import backends

REPO = Path(__file__).resolve().parents[2]
NEW = ("burst", "big_answer", "fuzz_cpu", "sessions")
PATHS = ("mitmdump", "ContextPaw")

pytest.importorskip("matplotlib")


def test_the_pressure_sections_measure_bare_mitmdump_and_contextpaw_side_by_side(tmp_path: Path) -> None:
    earlier = tmp_path / "earlier.json"
    skipped = {"skipped": "not measured here"}
    earlier.write_text(json.dumps({"machine": {"cpus": 2, "load_average": [0, 0, 0], "python": "3.12", "mitmproxy": "12",
                                               "date": "2026-01-01 00:00"}, "quick": True,
                                   **dict.fromkeys(("overhead", "compaction", "window_use", "agent_loop", "recall"), skipped)}))  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench" / "bench.py"), "--quick", "--skip-real", "--out", str(tmp_path / "out"),
         "--reuse", str(earlier), "--only", *NEW],
        capture_output=True, text=True, timeout=240, cwd=REPO, env=backends.tests_on_path(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert set(NEW) <= result.keys() and "burst" not in result["reused"]["sections"]

    burst = result["burst"]
    for path in PATHS:
        (run,) = burst[path]["runs"]
        assert sum(run["statuses"].values()) == burst["requests"], run["statuses"]  # every request answered
        assert run["n"] > 0 and run["failed"] == 0  # the small client got through all along
        assert burst[path]["peak_rss_mib"] > 0 and burst[path]["worst_ms"] >= burst[path]["p99_ms"] > 0
    assert burst["ContextPaw"]["runs"][0]["statuses"] == {"200": burst["requests"]}  # each one compacted and served
    assert burst["contextpaw_stats"]["compacted"] == burst["requests"]

    answer = result["big_answer"]
    for path in PATHS:
        (run,) = answer[path]["runs"]
        assert run["statuses"] == {"200": 1} and run["answer_bytes"] >= answer["answer_mb"] * 2**20
        assert run["failed"] == 0 and answer[path]["worst_ms"] > 0

    fuzz = result["fuzz_cpu"]
    assert all(fuzz[path]["cpu_s"] > 0 for path in PATHS) and fuzz["contextpaw_stats"]["errors"] == 0

    sessions = result["sessions"]
    for path in PATHS:
        (run,) = sessions[path]["runs"]
        assert run["answered"] == sessions["conversations"] * sessions["turns"] and run["failed"] == 0

    table = (tmp_path / "out" / "bench.md").read_text().split("## Goals, side by side")[1].split("\n## ")[0]
    rows = [line for line in table.splitlines() if re.match(r"\| (others'|CPU per fuzz pass|\d+ sessions)", line)]
    assert len(rows) == 4, table
    for row in rows:
        verdict = row.rstrip(" |").rsplit("| ", 1)[1]
        assert verdict == "met" or (verdict.startswith("not met: ") and re.search(r"\d", verdict)), row
    for heading in ("## 8. Others under pressure", "## 9. CPU per fuzz pass", "## 10. Many sessions, nothing overflowing"):
        assert heading in done.stdout
