"""The real agent CLIs through ContextPaw in file-reading sessions that overflow the window (issue 38).

One short session per pinned agent (Claude Code, Codex, opencode, Qwen Code) and backend behaviour:
the scripted model (tests/support/scripted_model.py) behaving like Ollama (a silent cut), with and
without a tokenizer ContextPaw can load, and like llama-server (400 on overflow). Each session reads
``FILES`` generated files of 20-40 KB (about 8-12k tokens each) in a ``N_CTX`` window, one per turn
with the agent's own read tool, so the history overflows from the third turn on; then the agent
gives the final answer. Each session runs once (about 10-25 s) and every test below reads its
measures (scripts/bench/agent_sessions.py, which runs the whole matrix, direct too).

What must hold through ContextPaw: the agent finishes; every tool call reaches the model with its
result; no cut by the server goes untold; the head (system, tools, every message up to and including
the first user message) reaches the model as the client sent it; every ``[ContextPaw:`` marker is
in the report the client got. What should hold and does not yet everywhere (the engine is being
changed for it; the cases marked xfail say what was measured): the file just read reaches the model
whole, and a cut fills the window.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.agents import CLAUDE_CODE_VERSION, check_recorded, require_agents
from support.recorder import read_log

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import agent_sessions as sessions  # noqa: E402

FIXTURES = Path(__file__).with_name("fixtures")
FILES = 4
N_CTX = 32768

CASES = [
    ("claude", "ollama", False),
    ("claude", "ollama", True),
    ("claude", "llamacpp", True),
    ("codex", "ollama", False),
    ("codex", "ollama", True),
    ("codex", "llamacpp", True),
    ("opencode", "ollama", False),
    ("opencode", "ollama", True),
    ("opencode", "llamacpp", True),
    ("qwen", "ollama", False),
    ("qwen", "ollama", True),
    ("qwen", "llamacpp", True),
]

PARAMS = [pytest.param(agent, behaviour, tokenizer, id=f"{agent}-{behaviour}-{'tok' if tokenizer else 'est'}")
          for agent, behaviour, tokenizer in CASES]  # fmt: skip

_results: dict[tuple[str, str, bool], sessions.Result] = {}


@pytest.fixture
def session(tmp_path_factory: pytest.TempPathFactory, agent: str, behaviour: str, tokenizer: bool) -> sessions.Result:
    """The session of this case, run once for all the checks on it."""
    key = (agent, behaviour, tokenizer)
    if key not in _results:
        binary = require_agents(agent)[agent]
        spec = sessions.Spec(agent, behaviour, tokenizer, "contextpaw", FILES, N_CTX)
        work = tmp_path_factory.mktemp(spec.name)
        _results[key] = sessions.run_session(spec, binary, work, timeout=240)
        _results[key].notes.append(f"logs: {work}")
    return _results[key]


def about(result: sessions.Result) -> str:
    return f"{result.spec.name}: {result.row()}\nnotes: {result.notes}\nhead: {result.head_changes}"


@pytest.mark.parametrize(("agent", "behaviour", "tokenizer"), PARAMS)
def test_the_agent_finishes(session: sessions.Result) -> None:
    assert session.finished, about(session) + f"\nfinal answer: {session.final_answer[:500]!r}"
    assert session.turns >= FILES + 1, about(session)
    assert session.cuts, "the session never outgrew the window: " + about(session)


@pytest.mark.parametrize(("agent", "behaviour", "tokenizer"), PARAMS)
def test_tool_pairs_intact(session: sessions.Result) -> None:
    assert session.pairs_checked and session.pairs_intact == session.pairs_checked, about(session)


@pytest.mark.parametrize(("agent", "behaviour", "tokenizer"), PARAMS)
def test_no_silent_cut(session: sessions.Result) -> None:
    assert session.silent_cuts == 0, about(session)


@pytest.mark.parametrize(("agent", "behaviour", "tokenizer"), PARAMS)
def test_head_byte_identical(session: sessions.Result) -> None:
    assert session.head_checked >= session.turns and session.head_identical == session.head_checked, about(session)


@pytest.mark.parametrize(("agent", "behaviour", "tokenizer"), PARAMS)
def test_markers_reported(session: sessions.Result) -> None:
    assert session.marked, "no request carried a marker: " + about(session)
    assert session.markers_reported == session.marked, about(session)


@pytest.mark.parametrize(("agent", "behaviour", "tokenizer"), PARAMS)
def test_fresh_tool_result_whole(session: sessions.Result) -> None:
    """Each file is 8-12k tokens, the head 8-12k: the file just read fits beside what must be kept."""
    assert session.fresh_turns and session.fresh_whole == session.fresh_turns, (
        f"characters of the fresh file that reached the model, per turn: {session.fresh_sizes}\n" + about(session)
    )


@pytest.mark.parametrize(("agent", "behaviour", "tokenizer"), PARAMS)
def test_no_cut_falls_short_of_its_target(session: sessions.Result) -> None:
    """A cut aims at the window less the room it leaves for the next turn (X-ContextPaw-Target):
    by the server's count it lands there, or above it where the file just read needs the room
    (never over the budget), never far below it."""
    aimed = [c for c in session.cuts if c["by"] == "contextpaw" and c.get("target_tokens")]
    # without a tokenizer the turn is counted at the last turn's rate, and what a turn adds may be
    # lighter than the rest: Codex's cuts landed at 94.8-100 % of their target (d66b535). A re-cut
    # evicts whole files of 8-12k tokens in this 32k window and keeps the prefix before its last
    # marker: Codex on llama-server once landed at 89.2 % (23,953 of 26,855)
    short = [(c["evaluated"], c["target_tokens"]) for c in aimed if c["evaluated"] < 0.85 * c["target_tokens"]]
    assert not short, f"cuts the server counted short of their target (count, target): {short}\n" + about(session)


def test_claude_code_counts_what_read_returns(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Claude Code's Read tool asks the server to count a file before it returns it
    (``POST /v1/messages/count_tokens`` with the file as the one user message and no tools): recorded
    once in fixtures/, compared by shape since."""
    binary = require_agents("claude")["claude"]
    spec = sessions.Spec("claude", "llamacpp", True, "contextpaw", 1, N_CTX)
    work = tmp_path_factory.mktemp(spec.name)
    result = sessions.run_session(spec, binary, work, timeout=120)
    counted = [e for e in read_log(work / "stack" / "sent.jsonl") if e["path"].startswith("/v1/messages/count_tokens")]
    assert result.finished and counted, about(result)
    problem = check_recorded(counted[0], FIXTURES / f"claude-code-{CLAUDE_CODE_VERSION}-read-count-tokens.json", "Claude Code")
    assert problem is None, problem
