"""The issue's launched session, shortened for CI: opencode started by `contextpaw launch` at the
least window it lives in (24,576), reading 20-40 KB files (5,000-12,000 tokens each) on Ollama
without a tokenizer ContextPaw can read, through the harness that measured every agent
(scripts/bench/agent_sessions.py --via launch). It finishes, its own compaction fires, and
ContextPaw cuts nothing."""

from __future__ import annotations

import sys
from pathlib import Path

from support import agents as cli

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import agent_sessions  # noqa: E402


def test_opencode_launched_lives_on_its_own_compaction_at_its_least_window(tmp_path: Path) -> None:
    binary = cli.require_agents("opencode")["opencode"]
    spec = agent_sessions.Spec("opencode", "ollama", False, "launch", 8, 24576)
    result = agent_sessions.run_session(spec, binary, tmp_path / "session", timeout=400)
    about = f"{result.row()}\n{(tmp_path / 'session' / 'agent.out').read_text()[-3000:]}"
    assert result.finished and result.files_read == 8, about
    assert result.compactions >= 1 and not result.cuts and result.largest_share < 1, about
