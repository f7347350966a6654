"""Codex CLI 0.171.0 through ContextPaw against a real llama-server (`-c 8192`) with SmolLM2-135M.

Codex's own request ("say hi") is about 4,600 tokens on SmolLM2 by `/v1/responses/input_tokens`.
A turn that pastes some 6,000 tokens more overflows the window: llama-server refuses it directly
(`400 exceed_context_size_error`, and Codex's turn fails), and through ContextPaw it is compacted
and answered. The same short-answer grammar as the Claude Code test keeps the answer brief
(`test_claude_code_real.py` says why).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.agents import Stack, contextpaw_headers, describe, require_agents, run_codex, start_contextpaw_stack
from support.backends import Backend

pytestmark = pytest.mark.real

N_CTX = 8192
RESPONSES = "/v1/responses"
TURN_TIMEOUT = 300  # a prefill of about 8,000 tokens: 15-60 s on 2 cores, more under load
PASTED = "Here are my notes. " + " ".join(f"item {i} is ready." for i in range(1500)) + "\nSay hi."


@pytest.fixture(scope="module")
def codex() -> Path:
    return require_agents("codex")["codex"]


@pytest.fixture
def through_contextpaw(server_8192: Backend, tmp_path: Path) -> Iterator[Stack]:
    running, stops = start_contextpaw_stack(tmp_path / "stack", server_8192.url)
    with stops:
        yield running


def failed(events: list[dict] | None) -> list[dict]:
    return [e for e in events or [] if e.get("type") == "turn.failed"]


def test_an_overflowing_turn_is_refused_directly_and_answered_through_contextpaw(
    codex: Path, server_8192: Backend, through_contextpaw: Stack, tmp_path: Path
) -> None:
    direct = run_codex(codex, server_8192.url, PASTED, home=tmp_path / "direct", model="smollm2", timeout=TURN_TIMEOUT)
    assert failed(direct.result), f"llama-server served the overflowing turn directly:\n{direct.describe()}"
    run = run_codex(codex, through_contextpaw.front, PASTED, home=tmp_path / "through", model="smollm2", timeout=TURN_TIMEOUT)
    sent = through_contextpaw.sent(RESPONSES)
    assert sent and sent[0]["response"]["status"] == 200, "\n".join(map(describe, sent)) + run.describe()
    headers = contextpaw_headers(sent[0])
    assert headers["x-contextpaw-compacted"] == "true" and int(headers["x-contextpaw-final-tokens"]) < N_CTX, headers
    forwarded = through_contextpaw.forwarded(RESPONSES)[0]
    assert "[ContextPaw:" in json.dumps(forwarded["body"]["input"])
    assert run.returncode == 0 and not failed(run.result), run.describe()
    said = [e for e in run.result or [] if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert said and said[0]["item"]["text"], run.describe()
