"""Qwen Code 0.24.4 through ContextPaw against the fakes' `/v1/chat/completions`.

Qwen Code speaks OpenAI's chat completions: one streamed `POST /v1/chat/completions` per turn, its
system prompt the first message, the task the last part of a list-of-parts user message after four
`<system-reminder>` parts, 14 function tools (39 KB of schemas) and `max_tokens: 32000` (a model it
does not know gets a 200,000-token window and a 32,000-token answer). That fixed part is 10,187
tokens as the fake llama-server counts it and 22,000 by ContextPaw's byte estimate; on Ollama without
a tokenizer, before calibration, the estimate may run 3.3 times low, so "say hi" goes through
unchanged only in a window of about 75,000 and more (the Ollama cases use 80,000).

A turn that fits goes through byte for byte. A turn that outgrows the window is compacted, with the
head (system prompt, tools, the first user message) as Qwen Code sent it, and answered. Under
`policy=strict` it is refused in OpenAI's own words, which Qwen Code takes for a context overflow
("Context length exceeded; attempting reactive compression." in its debug log): on llama-server,
where the counts are exact, it compresses its own history, sends again and answers.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from support.agents import (
    QWEN_CODE_VERSION,
    AgentRun,
    Stack,
    StartStack,
    body_changes,
    check_recorded,
    contextpaw_headers,
    describe,
    require_agents,
    run_qwen,
)
from support.common import FIXED_REPLY

FIXTURES = Path(__file__).with_name("fixtures")
CHAT = "/v1/chat/completions"
TURN_TIMEOUT = 90  # a turn against a fake takes 5-20 s, most of it Qwen Code starting up
MODEL = "fake-model"
N_CTX = {"llamacpp": 24000, "ollama": 80000}
"""Each fake's window: Qwen Code's "say hi" fits it whole (see above for Ollama's)."""
OVERFLOW_WORDS = {"llamacpp": 30000, "ollama": 90000}
"""A paste that alone outgrows the window, by the fake's own count (a word a token on Ollama)."""
RECOGNISED = "Context length exceeded; attempting reactive compression."
RECOVERED = "Reactive compression succeeded"


@pytest.fixture(scope="session")
def qwen_code() -> Path:
    return require_agents("qwen")["qwen"]


def pasted(words: int, tag: str = "n") -> str:
    """A pasted note of ``words`` words (a fake token each)."""
    return "Summarize these notes:\n" + " ".join(f"{tag}{i}" for i in range(words))


def fake_args(kind: str) -> list[str]:
    """A fake with its window that serves the model Qwen Code asks for (Ollama's trained length is
    the window, so that it is the window ContextPaw finds)."""
    n_ctx = str(N_CTX[kind])
    return ["--n-ctx", n_ctx, "--model", MODEL, *(["--train-ctx", n_ctx] if kind == "ollama" else [])]


def head(body: dict[str, Any]) -> dict[str, Any]:
    """What ContextPaw never cuts: the tools and every message up to and including the first user message."""
    messages = body["messages"]
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return {"tools": body.get("tools"), "messages": messages[: first_user + 1]}


def assert_answered(run: AgentRun) -> None:
    assert run.returncode == 0 and run.extra["text"] == FIXED_REPLY and not run.extra["is_error"], run.describe()


@pytest.mark.parametrize("kind", ["llamacpp", "ollama"])
def test_a_turn_that_fits_is_forwarded_unchanged(qwen_code: Path, stack: StartStack, home: Path, kind: str) -> None:
    running = stack(kind, fake_args(kind))
    run = run_qwen(qwen_code, running.front, "say hi", home=home, timeout=TURN_TIMEOUT)
    sent = running.sent(CHAT)
    assert len(sent) == 1 and sent[0]["response"]["status"] == 200, "\n".join(map(describe, sent))
    forwarded = running.forwarded(CHAT)
    assert len(forwarded) == 1 and forwarded[0]["body_sha256"] == sent[0]["body_sha256"], body_changes(sent[0], forwarded[0])
    assert contextpaw_headers(sent[0]).get("x-contextpaw-compacted") == "false", describe(sent[0])
    assert_answered(run)
    if kind == "llamacpp":
        problem = check_recorded(sent[0], FIXTURES / f"qwen-code-{QWEN_CODE_VERSION}.json", "Qwen Code")
        assert problem is None, problem


def overflow_turn(running: Stack, qwen_code: Path, home: Path, kind: str) -> tuple[AgentRun, dict, dict]:
    """'say hi', then a paste over the window in the same session: the run of the second turn, and
    its request as sent and as forwarded."""
    first = run_qwen(qwen_code, running.front, "say hi", home=home, timeout=TURN_TIMEOUT)
    assert_answered(first)
    run = run_qwen(qwen_code, running.front, pasted(OVERFLOW_WORDS[kind]), home=home, timeout=TURN_TIMEOUT,
                   extra_args=["--resume", first.extra["session"]])  # fmt: skip
    sent, forwarded = running.sent(CHAT), running.forwarded(CHAT)
    assert len(sent) == len(forwarded) == 2, "\n".join(map(describe, sent))
    return run, sent[1], forwarded[1]


@pytest.mark.parametrize("kind", ["llamacpp", "ollama"])
def test_an_overflowing_turn_is_compacted_with_its_head_and_answered(qwen_code: Path, stack: StartStack, home: Path, kind: str) -> None:
    running = stack(kind, fake_args(kind))
    run, sent, forwarded = overflow_turn(running, qwen_code, home, kind)
    headers = contextpaw_headers(sent)
    assert sent["response"]["status"] == 200 and headers.get("x-contextpaw-compacted") == "true", describe(sent)
    assert int(headers["x-contextpaw-original-tokens"]) > N_CTX[kind] > int(headers["x-contextpaw-final-tokens"]), headers
    assert forwarded["body_bytes"] < sent["body_bytes"] and "[ContextPaw:" in json.dumps(forwarded["body"]["messages"])
    assert head(forwarded["body"]) == head(sent["body"]), "Qwen Code's system prompt, tools or task were rewritten"
    # Qwen Code asks for 32,000 less what its own estimate of the prompt takes past its 200,000
    assert forwarded["body"]["max_tokens"] == sent["body"]["max_tokens"], body_changes(sent, forwarded)
    assert '"contextpaw"' in sent["response"]["body"], "the stream carries no contextpaw report"
    if kind == "ollama":
        with urllib.request.urlopen(f"{running.backend}/_fake/last", timeout=10) as last:
            assert json.load(last)["cut"] is False, "Ollama cut what ContextPaw sent"
    assert_answered(run)


@pytest.mark.parametrize("kind", ["llamacpp", "ollama"])
def test_strict_is_context_length_exceeded_which_qwen_code_recognises(qwen_code: Path, stack: StartStack, home: Path, kind: str) -> None:
    """One turn whose paste alone is over the window: OpenAI's 400 `context_length_exceeded` in
    OpenAI's wording, which Qwen Code reads as an overflow; with no history to compress, it stops
    and shows the refusal."""
    running = stack(kind, fake_args(kind), ["contextpaw_policy=strict"])
    run = run_qwen(qwen_code, running.front, pasted(OVERFLOW_WORDS[kind]), home=home, timeout=TURN_TIMEOUT)
    sent = running.sent(CHAT)
    assert sent and all(e["response"]["status"] == 400 for e in sent), "\n".join(map(describe, sent))
    error = json.loads(sent[0]["response"]["body"])["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded"), error
    assert error["message"].startswith(f"This model's maximum context length is {error['num_ctx']} tokens"), error
    assert not running.forwarded(CHAT), "the refused request reached the backend"
    assert RECOGNISED in run.extra["debug"], run.describe()
    assert run.returncode == 1 and run.extra["is_error"] and "maximum context length" in run.extra["error"], run.describe()


def test_under_strict_qwen_code_compresses_its_history_and_goes_on(qwen_code: Path, stack: StartStack, home: Path) -> None:
    """Two pastes that fit one at a time but not together (llama-server's exact counts): the second
    is refused, Qwen Code compresses the first into a summary, sends the turn again, and it fits."""
    running = stack("llamacpp", fake_args("llamacpp"), ["contextpaw_policy=strict"])
    first = run_qwen(qwen_code, running.front, pasted(8000, "a"), home=home, timeout=TURN_TIMEOUT)
    assert_answered(first)
    run = run_qwen(qwen_code, running.front, pasted(8000, "b"), home=home, timeout=TURN_TIMEOUT,
                   extra_args=["--resume", first.extra["session"]])  # fmt: skip
    sent = running.sent(CHAT)
    refused = [e for e in sent if e["response"]["status"] == 400]
    assert refused and all(json.loads(e["response"]["body"])["error"]["code"] == "context_length_exceeded" for e in refused)
    answered = [e for e in sent if e["response"]["status"] == 200]
    assert [e["body_sha256"] for e in answered] == [e["body_sha256"] for e in running.forwarded(CHAT)], (
        "a refused request reached the backend, or an answered one was changed"
    )
    assert RECOGNISED in run.extra["debug"] and RECOVERED in run.extra["debug"], run.describe()
    retried = answered[-1]["body"]
    assert retried.get("tools") and "a7999" not in json.dumps(retried["messages"]), "the first paste was not compressed"
    assert_answered(run)


def test_no_strict_refusal_says_the_turn_fits(qwen_code: Path, stack: StartStack, home: Path) -> None:
    """Under strict, a refusal's numbers are why it was refused: the prompt it names is over the room it names."""
    running = stack("ollama", ["--n-ctx", "32768", "--model", MODEL, "--train-ctx", "32768"], ["contextpaw_policy=strict"])
    run_qwen(qwen_code, running.front, "say hi", home=home, timeout=TURN_TIMEOUT)
    refusals = [json.loads(e["response"]["body"])["error"] for e in running.sent(CHAT) if e["response"]["status"] != 200]
    assert all(error["n_prompt_tokens"] > error["budget"] for error in refusals), refusals
