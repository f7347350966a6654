"""The Responses demo as `scripts/demo/demo.sh` runs it, on the real llama-server: a Codex session of
typed items (the task with the secret, the log read by shell calls, the question) overflows the
window; through ContextPaw it is answered 200, compacted, and SmolLM2-135M recalls the secret, on
llama-server and on the Ollama simulator, streamed and not (issue 39)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import backends

pytestmark = pytest.mark.real

DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo" / "demo_responses.py"


def test_the_codex_shaped_responses_demo_recalls_the_secret_through_contextpaw(real_backend: tuple[Path, Path]) -> None:
    """As `scripts/demo/demo.sh` runs it: its own llama-server at -c 1024, and the simulator over another."""
    done = subprocess.run(
        [sys.executable, str(DEMO), "--trials", "2", "--shape", "codex", "--num-ctx", "1024"],
        capture_output=True, text=True, timeout=1800, env=backends.tests_on_path(),  # the demo imports `support`
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    recall = dict(re.findall(r"^(\S+ \S+): recalled (\d+/\d+)$", done.stdout, re.MULTILINE))
    assert recall.get("llama-server ContextPaw") == "2/2" and recall.get("Ollama ContextPaw") == "2/2", done.stdout[-3000:]
    assert "| llama-server direct | 400 |" in done.stdout, "the session overflows the window"
