"""Claude Code 2.1.332 through ContextPaw against the fake llama-server's `/v1/messages`.

Claude Code sends one `POST /v1/messages?beta=true` per `-p` turn: about 49 KB (12 tools, a system
prompt in three blocks, an environment block as a `role: system` message) and `max_tokens: 32000`,
whatever the window. On the fake that plain "say hi" is about 7,100 tokens, so it fits an 8,192- and
a 12,000-token window: llama-server serves it (generation is capped by the room left), and so
must ContextPaw. A session that grows past the window is compacted; under `policy=strict` the
overflow is Anthropic's own 400 ("prompt is too long: N tokens > M maximum"), which Claude Code
recognises (`terminal_reason: prompt_too_long`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.agents import (
    CLAUDE_CODE_VERSION,
    AgentRun,
    Stack,
    StartStack,
    body_changes,
    check_recorded,
    contextpaw_headers,
    describe,
    run_claude,
)
from support.common import FIXED_REPLY
from support.recorder import reported_prompt_tokens

FIXTURES = Path(__file__).with_name("fixtures")
MESSAGES = "/v1/messages"
TURN_TIMEOUT = 90  # one -p turn against a fake takes about 1 s; the CLI starts in under 1 s
PROMPT_TOO_LONG = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")


def filler(label: str, words: int) -> str:
    """A pasted note of ``words`` distinct words (one fake token each)."""
    return f"Here is note {label}, keep it in mind: " + " ".join(f"{label}-w{i}" for i in range(words))


def only_request(stack: Stack, run: AgentRun) -> dict:
    sent = stack.sent(MESSAGES)
    assert len(sent) == 1, (
        f"Claude Code -p sent {len(sent)} /v1/messages requests, expected 1:\n" + "\n".join(map(describe, sent)) + "\n" + run.describe()
    )
    return sent[0]


@pytest.mark.parametrize("n_ctx", [8192, 12000])
def test_say_hi_is_served_unchanged(claude_code: Path, stack: StartStack, home: Path, n_ctx: int) -> None:
    """Its plain request fits the window: forwarded byte for byte, answered, nothing refused."""
    running = stack("llamacpp", ["--n-ctx", str(n_ctx)])
    run = run_claude(claude_code, running.front, "say hi", home=home, timeout=TURN_TIMEOUT)
    sent = only_request(running, run)
    status = sent["response"]["status"]
    assert status == 200, (
        f"ContextPaw refused Claude Code's plain 'say hi' on a {n_ctx}-token window that serves it "
        f"(max_tokens {sent['body'].get('max_tokens')}): {describe(sent)}"
    )
    forwarded = running.forwarded(MESSAGES)
    assert len(forwarded) == 1, f"ContextPaw forwarded {len(forwarded)} requests for one:\n" + "\n".join(map(describe, forwarded))
    prompt = reported_prompt_tokens(forwarded[0])
    assert prompt is not None and prompt < n_ctx, f"test set-up: the fake counted {prompt} prompt tokens"
    assert forwarded[0]["body_sha256"] == sent["body_sha256"], (
        f"ContextPaw changed a request that fits ({prompt} of {n_ctx} tokens): {body_changes(sent, forwarded[0])}"
    )
    assert contextpaw_headers(sent).get("x-contextpaw-compacted") == "false", describe(sent)
    assert run.returncode == 0, run.describe()
    assert isinstance(run.result, dict), run.describe()
    assert run.result.get("result") == FIXED_REPLY, run.describe()
    assert run.result.get("terminal_reason") == "completed", run.describe()
    problem = check_recorded(sent, FIXTURES / f"claude-code-{CLAUDE_CODE_VERSION}.json", "Claude Code")
    assert problem is None, problem


def test_resumed_session_is_compacted_and_answered(claude_code: Path, stack: StartStack, home: Path) -> None:
    """`claude -p ... -r SESSION` turns, each pasting a note, until the conversation outgrows a
    12,000-token window: the first turns go through unchanged, the overflowing one is compacted
    (smaller, with a `[ContextPaw:` marker where the evicted turns were), reported in the
    `X-ContextPaw-*` headers and the stream, and answered."""
    n_ctx = 12000
    running = stack("llamacpp", ["--n-ctx", str(n_ctx)])
    first = run_claude(claude_code, running.front, "say hi", home=home, timeout=TURN_TIMEOUT)
    assert first.returncode == 0 and isinstance(first.result, dict), first.describe()
    session = first.result["session_id"]
    assert first.result.get("result") == FIXED_REPLY, (
        f"the first turn ('say hi') was not answered: {describe(running.sent(MESSAGES)[0])}\n{first.describe()}"
    )
    compacted = None
    for turn in range(2, 8):
        run = run_claude(claude_code, running.front, filler(f"n{turn}", 1500), home=home, resume=session,
                         timeout=TURN_TIMEOUT)  # fmt: skip
        sent = running.sent(MESSAGES)
        last = sent[-1]
        assert len(sent) == turn and last["response"]["status"] == 200, (
            f"turn {turn} was not served:\n" + "\n".join(map(describe, sent[turn - 1 :])) + "\n" + run.describe()
        )
        assert run.returncode == 0 and run.result.get("result") == FIXED_REPLY, run.describe()
        if contextpaw_headers(last).get("x-contextpaw-compacted") == "true":
            compacted = turn
            break
        forwarded = running.forwarded(MESSAGES)[-1]
        assert forwarded["body_sha256"] == last["body_sha256"], f"turn {turn} fits but was changed: {body_changes(last, forwarded)}"
    assert compacted is not None, "the session never outgrew the window: " + describe(running.sent(MESSAGES)[-1])
    sent, forwarded = running.sent(MESSAGES)[-1], running.forwarded(MESSAGES)[-1]
    headers = contextpaw_headers(sent)
    assert int(headers["x-contextpaw-original-tokens"]) > int(headers["x-contextpaw-final-tokens"]), headers
    assert forwarded["body_bytes"] < sent["body_bytes"], (sent["body_bytes"], forwarded["body_bytes"])
    assert "[ContextPaw:" in json.dumps(forwarded["body"]["messages"]), "no marker where content was evicted"
    prompt = reported_prompt_tokens(forwarded)
    assert prompt is not None and prompt < n_ctx, f"the fake counted {prompt} tokens in the compacted request"
    assert '"contextpaw"' in sent["response"]["body"], "the stream carries no contextpaw report"
    # what must never be evicted: the system prompt, the tools, the task and the latest turn
    assert forwarded["body"]["system"] == sent["body"]["system"]
    assert forwarded["body"]["tools"] == sent["body"]["tools"]
    assert forwarded["body"]["messages"][0] == sent["body"]["messages"][0]
    assert forwarded["body"]["messages"][-1] == sent["body"]["messages"][-1]


def test_strict_overflow_is_prompt_too_long(claude_code: Path, stack: StartStack, home: Path) -> None:
    """Under `policy=strict` a plain turn is still served, and one over the window gets Anthropic's
    400 `invalid_request_error` "prompt is too long: N tokens > M maximum", which Claude Code
    recognises (`terminal_reason: prompt_too_long`); nothing of it reaches the backend."""
    n_ctx = 8192
    running = stack("llamacpp", ["--n-ctx", str(n_ctx)], ["contextpaw_policy=strict"])
    plain = run_claude(claude_code, running.front, "say hi", home=home / "plain", timeout=TURN_TIMEOUT)
    assert running.sent(MESSAGES)[0]["response"]["status"] == 200, "strict refused a request that fits: " + describe(
        running.sent(MESSAGES)[0]
    )
    assert plain.returncode == 0 and plain.result.get("result") == FIXED_REPLY, plain.describe()

    run = run_claude(claude_code, running.front, filler("big", 3000), home=home / "big", timeout=TURN_TIMEOUT)
    sent = running.sent(MESSAGES)[1:]
    assert sent, run.describe()
    refusal = sent[0]["response"]
    assert refusal["status"] == 400, describe(sent[0])
    error = json.loads(refusal["body"])
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    numbers = PROMPT_TOO_LONG.match(error["error"]["message"])
    assert numbers and int(numbers[1]) > int(numbers[2]), error["error"]["message"]
    assert len(running.forwarded(MESSAGES)) == 1, "the refused request reached the backend"
    assert isinstance(run.result, dict), run.describe()
    assert run.result.get("terminal_reason") == "prompt_too_long", run.describe()
    assert run.result.get("is_error") is True and run.result.get("api_error_status") == 400, run.describe()
    assert run.result.get("result", "").startswith("Prompt is too long"), run.describe()
