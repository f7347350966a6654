"""Claude Code 2.1.332 through ContextPaw against a real llama-server (`-c 8192`) with SmolLM2-135M.

Claude Code's plain "say hi" is about 4,100 tokens on SmolLM2 (its template renders no tools) with
`max_tokens: 32000`. llama-server serves it; ContextPaw must too. A resumed session that grows past
the window is compacted and still answered.

Each answer is kept to a short sentence by the server's default grammar (`--grammar`, a few
letters and a full stop): with `max_tokens: 32000` SmolLM2 would otherwise write until the window is
full (this llama-server build does not clamp a request's max_tokens to `-n`), and an answer cut to
nothing (an end-of-turn bias) makes Claude Code ask again. The cost is the prefill:
about 4,100 tokens for a first turn, 15 to 60 s on two cores depending on load.

Skipped without the real backend (tests/real/conftest.py) or without the CLI
(scripts/install/get_agents.sh); under CI only an unreachable registry may skip the CLI.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.agents import Stack, body_changes, contextpaw_headers, describe, require_agents, run_claude, start_contextpaw_stack
from support.backends import Backend

pytestmark = pytest.mark.real

N_CTX = 8192
MESSAGES = "/v1/messages"
TURN_TIMEOUT = 300  # a turn prefills at most about 4,000 new tokens: 15-60 s on 2 cores, more under load


@pytest.fixture(scope="module")
def claude_code() -> Path:
    return require_agents("claude")["claude"]


@pytest.fixture(scope="module")
def cwd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One working directory for every run: it is in Claude Code's environment block, so the first
    turns of the tests render alike and the server's prompt cache serves the second one."""
    return tmp_path_factory.mktemp("claude-cwd")


@pytest.fixture
def through_contextpaw(server_8192: Backend, tmp_path: Path) -> Iterator[Stack]:
    running, stops = start_contextpaw_stack(tmp_path / "stack", server_8192.url)
    with stops:
        yield running


def test_say_hi_is_served(claude_code: Path, through_contextpaw: Stack, tmp_path: Path, cwd: Path) -> None:
    run = run_claude(claude_code, through_contextpaw.front, "say hi", home=tmp_path / "home", model="smollm2",
                     cwd=cwd, timeout=TURN_TIMEOUT)  # fmt: skip
    sent, forwarded = through_contextpaw.sent(MESSAGES), through_contextpaw.forwarded(MESSAGES)
    assert sent, run.describe()
    assert sent[0]["response"]["status"] == 200, (
        f"ContextPaw refused Claude Code's plain 'say hi' on a real {N_CTX}-token llama-server: {describe(sent[0])}"
    )
    assert len(forwarded) == len(sent), "\n".join(map(describe, forwarded))
    for a, b in zip(sent, forwarded, strict=True):
        assert a["response"]["status"] == 200, describe(a)
        assert a["body_sha256"] == b["body_sha256"], f"ContextPaw changed a request that fits: {body_changes(a, b)}"
    assert run.returncode == 0 and isinstance(run.result, dict), run.describe()
    assert run.result.get("terminal_reason") == "completed" and run.result.get("is_error") is False, run.describe()
    assert run.result.get("result"), run.describe()


def test_resumed_session_is_compacted(claude_code: Path, through_contextpaw: Stack, tmp_path: Path, cwd: Path) -> None:
    home = tmp_path / "home"
    first = run_claude(claude_code, through_contextpaw.front, "say hi", home=home, model="smollm2", cwd=cwd,
                       timeout=TURN_TIMEOUT)  # fmt: skip
    assert first.returncode == 0 and isinstance(first.result, dict), first.describe()
    assert first.result.get("is_error") is False, describe(through_contextpaw.sent(MESSAGES)[0])
    session = first.result["session_id"]
    for turn in range(2, 6):
        note = f"Here is note {turn}, keep it in mind: " + " ".join(f"n{turn}w{i}" for i in range(800))
        run = run_claude(claude_code, through_contextpaw.front, note, home=home, model="smollm2", resume=session,
                         cwd=cwd, timeout=TURN_TIMEOUT)  # fmt: skip
        last = through_contextpaw.sent(MESSAGES)[-1]
        assert last["response"]["status"] == 200, describe(last) + "\n" + run.describe()
        assert run.returncode == 0 and run.result.get("is_error") is False, run.describe()
        if contextpaw_headers(last).get("x-contextpaw-compacted") == "true":
            break
    else:
        pytest.fail("the session never outgrew the window: " + describe(through_contextpaw.sent(MESSAGES)[-1]))
    forwarded = through_contextpaw.forwarded(MESSAGES)[-1]
    headers = contextpaw_headers(last)
    assert int(headers["x-contextpaw-original-tokens"]) > int(headers["x-contextpaw-final-tokens"]), headers
    assert int(headers["x-contextpaw-final-tokens"]) < N_CTX, headers
    assert forwarded["body_bytes"] < last["body_bytes"]
    assert "[ContextPaw:" in json.dumps(forwarded["body"]["messages"])
    assert run.result.get("result"), run.describe()
