"""Codex CLI 0.171.0 through ContextPaw against the fakes' `/v1/responses`.

Codex speaks only OpenAI's Responses API: one streamed `POST /v1/responses` per `codex exec` turn,
with `instructions`, developer and user message items, 9 function tools, `store: false` and
`reasoning`. A turn that fits goes through byte for byte; one that outgrows the window is compacted
and answered; under `policy=strict` the overflow is OpenAI's `400 context_length_exceeded`, which
Codex recognises ("Codex ran out of room in the model's context window").
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from support.agents import (
    CODEX_VERSION,
    Stack,
    StartStack,
    body_changes,
    check_recorded,
    contextpaw_headers,
    describe,
    require_agents,
    run_codex,
)
from support.common import FIXED_REPLY

FIXTURES = Path(__file__).with_name("fixtures")
RESPONSES = "/v1/responses"
TURN_TIMEOUT = 90  # a turn against a fake takes about a second
MODEL = "fake-model"
OUT_OF_ROOM = "ran out of room in the model's context window"


@pytest.fixture(scope="session")
def codex() -> Path:
    return require_agents("codex")["codex"]


def pasted(words: int) -> str:
    """A pasted note of ``words`` words (a fake token each)."""
    return "Summarize these notes:\n" + " ".join(f"n{i}" for i in range(words))


def fake_args(kind: str, n_ctx: int) -> list[str]:
    """A fake with an `n_ctx` window that serves the model Codex asks for."""
    return ["--n-ctx", str(n_ctx), "--model", MODEL, *(["--train-ctx", str(n_ctx)] if kind == "ollama" else [])]


def answer(run_events: list[dict] | None) -> str:
    return "".join(
        e["item"].get("text", "")
        for e in run_events or []
        if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
    )


def only_request(stack: Stack) -> dict:
    sent = stack.sent(RESPONSES)
    assert len(sent) == 1, "Codex sent:\n" + "\n".join(map(describe, sent))
    return sent[0]


@pytest.mark.parametrize("kind", ["llamacpp", "ollama"])
def test_a_turn_that_fits_is_forwarded_unchanged(codex: Path, stack: StartStack, home: Path, kind: str) -> None:
    running = stack(kind, fake_args(kind, 40000))
    run = run_codex(codex, running.front, "say hi", home=home, timeout=TURN_TIMEOUT)
    sent = only_request(running)
    assert sent["response"]["status"] == 200, describe(sent)
    forwarded = running.forwarded(RESPONSES)
    assert len(forwarded) == 1 and forwarded[0]["body_sha256"] == sent["body_sha256"], body_changes(sent, forwarded[0])
    assert contextpaw_headers(sent).get("x-contextpaw-compacted") == "false", describe(sent)
    assert run.returncode == 0 and answer(run.result) == FIXED_REPLY, run.describe()
    if kind == "llamacpp":
        problem = check_recorded(sent, FIXTURES / f"codex-{CODEX_VERSION}.json", "Codex")
        assert problem is None, problem


@pytest.mark.parametrize("kind", ["llamacpp", "ollama"])
def test_an_overflowing_turn_is_compacted_reported_and_answered(codex: Path, stack: StartStack, home: Path, kind: str) -> None:
    running = stack(kind, fake_args(kind, 24000))  # Codex's own instructions and tools take ~12k estimated
    run = run_codex(codex, running.front, pasted(30000), home=home, timeout=TURN_TIMEOUT)
    sent = only_request(running)
    headers = contextpaw_headers(sent)
    assert sent["response"]["status"] == 200 and headers.get("x-contextpaw-compacted") == "true", describe(sent)
    assert int(headers["x-contextpaw-original-tokens"]) > 24000 > int(headers["x-contextpaw-final-tokens"]), headers
    forwarded = running.forwarded(RESPONSES)[-1]
    body = forwarded["body"]
    assert forwarded["body_bytes"] < sent["body_bytes"] and "[ContextPaw:" in json.dumps(body["input"])
    assert body.get("instructions") == sent["body"].get("instructions") and body["tools"] == sent["body"]["tools"]
    assert body["input"][0] == sent["body"]["input"][0], "the head (Codex's developer message) is never rewritten"
    assert '"contextpaw"' in sent["response"]["body"], "the stream carries no report on response.completed"
    if kind == "ollama":
        with urllib.request.urlopen(f"{running.backend}/_fake/last", timeout=10) as last:
            assert json.load(last)["cut"] is False, "Ollama cut what ContextPaw sent"
    assert run.returncode == 0 and answer(run.result) == FIXED_REPLY, run.describe()


def test_strict_is_context_length_exceeded_which_codex_recognises(codex: Path, stack: StartStack, home: Path) -> None:
    running = stack("llamacpp", fake_args("llamacpp", 12000), ["contextpaw_policy=strict"])
    run = run_codex(codex, running.front, pasted(9000), home=home, timeout=TURN_TIMEOUT)
    sent = running.sent(RESPONSES)
    assert sent and all(e["response"]["status"] == 400 for e in sent), "\n".join(map(describe, sent))
    error = json.loads(sent[0]["response"]["body"])["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded", "input")
    assert not running.forwarded(RESPONSES), "the refused request reached the backend"
    failed = [e for e in run.result or [] if e.get("type") == "turn.failed"]
    assert failed and OUT_OF_ROOM in failed[0]["error"]["message"], run.describe()
