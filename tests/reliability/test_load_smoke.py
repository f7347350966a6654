"""scripts/bench/load_test.py, tiny (5 conversations x 3 turns), so it keeps working."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from support import backends
from support.backends import REPO


def test_the_load_test_runs_clean(tmp_path: Path, cases: Any) -> None:
    out = tmp_path / "load.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench" / "load_test.py"), "--conversations", "6", "--turns", "3",
         "--overflow-every", "2", "--deadline", "60", "--json", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=120, check=False, env=backends.tests_on_path(),  # the script imports `support`
    )  # fmt: skip
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["requests_ok"] == result["requests_sent"] == 18
    assert result["lost"] == 0 and result["cross_talk"] == 0
    assert result["compacted"] > 0 and result["streamed"] > 0 and result["evicted_markers_checked"] > 0
    assert result["heartbeats"] > 0 and result["rss_mib"]["start"] > 0
    cases["load.requests"] += result["requests_sent"]
