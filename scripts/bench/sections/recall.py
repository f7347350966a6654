"""5. Recall: the k/N lines of the demos."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

from rich.progress import Progress

from sections.common import REPO, SCRIPTS

RECALL_LINE = re.compile(r"^(.+): recalled (\d+)/(\d+)$", re.M)


def recall(quick: bool, trials: int, progress: Progress) -> dict[str, Any]:
    """Run the demos as their own processes (each starts its own servers) and keep their k/N."""
    trials = "1" if quick else str(trials)
    runs = {"demo_needle": ["demo/demo_needle.py", "--trials", trials], "demo_400": ["demo/demo_400.py", "--trials", trials]}
    if (SCRIPTS / "measure" / "measure_summary.py").exists():
        runs["measure_summary"] = ["measure/measure_summary.py", "--trials", trials]
    task = progress.add_task("recall demos", total=len(runs))
    out = {}
    for name, argv in runs.items():
        try:
            done = subprocess.run(
                [sys.executable, str(SCRIPTS / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=900, cwd=REPO
            )
            output, code = done.stdout, done.returncode
        except subprocess.TimeoutExpired as e:
            output = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
            code = None
        out[name] = {
            "exit": code,
            "recalled": {m[1]: [int(m[2]), int(m[3])] for m in RECALL_LINE.finditer(output)},
            "table": [line for line in output.splitlines() if line.startswith("|")] if name == "measure_summary" else [],
        }
        progress.advance(task)
    return out
