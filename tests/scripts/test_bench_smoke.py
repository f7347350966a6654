"""scripts/bench/bench.py --quick --skip-real runs end to end and writes every section, the table and the plots.

The real-backend sections are skipped here on purpose (they take minutes on a real model); the
JSON must still name them, saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import backends

REPO = Path(__file__).resolve().parents[2]
# the scripts reuse the test support (`support`, from tests/): they are run with tests/ on PYTHONPATH
SECTIONS = {"machine", "overhead", "compaction", "window_use", "agent_loop", "recall", "loop_health", "scaling"}
SECTIONS |= {"burst", "big_answer", "fuzz_cpu", "sessions"}  # issue 44's, beside bare mitmdump in the same run

pytest.importorskip("matplotlib")


def test_quick_bench_writes_every_section(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench" / "bench.py"), "--quick", "--skip-real", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=420, cwd=REPO, env=backends.tests_on_path(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert SECTIONS <= result.keys()
    assert result["machine"]["cpus"] and result["machine"]["mitmproxy"].startswith("12.")
    overhead = result["overhead"]
    for case in ("small", "big"):
        assert {p: overhead[case][p]["n"] > 0 for p in ("direct", "mitmdump", "ContextPaw")} == dict.fromkeys(
            ("direct", "mitmdump", "ContextPaw"), True
        )
    assert overhead["stream"]["ContextPaw"]["ttfb"]["p50_ms"] > 0
    assert {"estimate", "calibrated"} <= result["compaction"]["counters"].keys()
    assert result["window_use"]["by_counter"]
    assert result["agent_loop"] == {"skipped": "--skip-real"} and result["recall"] == {"skipped": "--skip-real"}
    assert result["agent_sessions"] == {"skipped": "--skip-real"}
    markdown = (tmp_path / "bench.md").read_text()
    assert "## 1. Proxy overhead" in markdown and "## 5. Recall" in markdown and markdown in done.stdout
    assert {"bench-overhead.png", "bench-compaction.png", "bench-window-use.png"} <= {p.name for p in (tmp_path / "img").glob("*.png")}
    reran = tmp_path / "reran"
    again = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench" / "bench.py"), "--quick", "--skip-real", "--out", str(reran),
         "--reuse", str(tmp_path / "bench.json"), "--only", "scaling"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=backends.tests_on_path(),
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    partial = json.loads((reran / "bench.json").read_text())
    assert partial["overhead"] == overhead and partial["compaction"] == result["compaction"]
    assert partial["scaling"] != result["scaling"]  # measured again: its timings are new
    assert "overhead" in partial["reused"]["sections"] and "scaling" not in partial["reused"]["sections"]
    assert f"from the run of {result['machine']['date']}" in (reran / "bench.md").read_text()


def test_only_without_reuse_is_refused() -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench.py"), "--only", "scaling"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=backends.tests_on_path())  # fmt: skip
    assert done.returncode == 2 and "--only needs --reuse" in done.stderr


def test_the_interleaved_ab_bench_measures_each_path_against_the_first() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench" / "bench_ab.py"), "bare=bare", f"paw={REPO}", f"plain={REPO},contextpaw_relay=false",
         "--rounds", "2", "--requests", "3"],
        capture_output=True, text=True, timeout=420, cwd=REPO, env=backends.tests_on_path(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line for line in done.stdout.splitlines()}
    assert rows.keys() == {"bare", "paw", "plain"}
    assert "throughput 1.00x" in rows["bare"] and all("of bare" in row for row in rows.values())
    assert all("ms a request" in row for row in rows.values())
