"""opencode 1.18.33 through ContextPaw against the fake llama-server (`--n-ctx 12000`).

opencode speaks `/v1/chat/completions` through a custom provider (`@ai-sdk/openai-compatible`,
bundled in its binary), two requests per new session: a short title request, then the agent
request (10 tools, about 30 KB, `max_tokens` = the model's `limit.output`). An attached file
(`-f`) makes the user message's content a list of parts. A request whose prompt plus `max_tokens`
fits the window must go through unchanged, with no 413; one that outgrows it is compacted; under
`policy=strict` it is refused with OpenAI's 400 `context_length_exceeded`, which opencode takes for
a context overflow (it then compacts its own history and retries; it reads a 413 the same way).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.agents import (
    OPENCODE_VERSION,
    Stack,
    StartStack,
    body_changes,
    check_recorded,
    contextpaw_headers,
    describe,
    run_opencode,
)
from support.common import FIXED_REPLY
from support.recorder import reported_prompt_tokens

FIXTURES = Path(__file__).with_name("fixtures")
CHAT = "/v1/chat/completions"
N_CTX = 12000
TURN_TIMEOUT = 90  # a turn against a fake takes about 5 s, most of it opencode starting up
TOKENS_PER_LINE = 7  # "line N of the notes file" plus the line number opencode puts in front


def notes(work: Path, name: str, lines: int) -> Path:
    path = work / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(f"line {i} of the {name} file" for i in range(lines)) + "\n")
    return path


def agent_requests(stack: Stack) -> list[dict]:
    """The agent's requests (with tools), not the title requests."""
    return [e for e in stack.sent(CHAT) if (e["body"] or {}).get("tools")]


def assert_no_refusal(stack: Stack) -> None:
    refused = [e for e in stack.sent(CHAT) if e["response"]["status"] != 200]
    assert not refused, "ContextPaw refused opencode's requests:\n" + "\n".join(map(describe, refused))


@pytest.mark.parametrize("output", [1024, 4096])
def test_list_of_parts_with_tools_up_to_the_window_is_unchanged(opencode: Path, stack: StartStack, home: Path, output: int) -> None:
    """'say hi', then a file attached (list-of-parts content) that brings the prompt to within a few
    hundred tokens of the window less `limit.output`: every request is forwarded byte for byte, none
    is refused (no spurious 413), and opencode prints the fake's answer both times."""
    running = stack("llamacpp", ["--n-ctx", str(N_CTX)])
    first = run_opencode(opencode, running.front, "say hi", home=home, context=N_CTX, output=output,
                         timeout=TURN_TIMEOUT)  # fmt: skip
    assert_no_refusal(running)
    assert first.returncode == 0 and first.extra["text"] == FIXED_REPLY, first.describe()
    base = reported_prompt_tokens(running.forwarded(CHAT)[-1]) or 0
    lines = (N_CTX - output - base - 600) // TOKENS_PER_LINE
    attached = notes(home / "work", "notes", lines)
    second = run_opencode(opencode, running.front, "summarize the attached file", home=home, context=N_CTX,
                          output=output, files=[attached], session=first.extra["session"],
                          timeout=TURN_TIMEOUT)  # fmt: skip
    assert_no_refusal(running)
    sent, forwarded = running.sent(CHAT), running.forwarded(CHAT)
    assert len(sent) == len(forwarded), "\n".join(map(describe, sent))
    # Near its window opencode may compact its own session after the attachment went (a summary
    # request, then "Continue if you have next steps, ...": seen once in CI), so the request that
    # carried the attachment is not always the last one
    carried = [e for e in agent_requests(running) if isinstance(e["body"]["messages"][-1]["content"], list)]
    assert carried, "the attachment did not make a list of parts"
    prompt = reported_prompt_tokens(forwarded[-1])
    assert prompt is not None and prompt + output <= N_CTX, f"test set-up: {prompt} + {output} > {N_CTX}"
    for a, b in zip(sent, forwarded, strict=True):
        assert a["body_sha256"] == b["body_sha256"], (
            f"ContextPaw changed a request that fits ({prompt} + max_tokens {output} <= {N_CTX}): {body_changes(a, b)}"
        )
        assert contextpaw_headers(a).get("x-contextpaw-compacted") == "false", describe(a)
    assert second.returncode == 0 and second.extra["text"] == FIXED_REPLY, second.describe()
    if output == 1024:
        problem = check_recorded(agent_requests(running)[0], FIXTURES / f"opencode-{OPENCODE_VERSION}.json", "opencode")
        assert problem is None, problem


def test_attachment_over_the_window_is_compacted_and_answered(opencode: Path, stack: StartStack, home: Path) -> None:
    """A file that alone outgrows the window: the request is compacted (smaller, a `[ContextPaw:`
    marker, reported in the headers and the stream), fits when it reaches the backend, and opencode
    prints the fake's answer, with no error."""
    running = stack("llamacpp", ["--n-ctx", str(N_CTX)])
    first = run_opencode(opencode, running.front, "say hi", home=home, context=N_CTX, timeout=TURN_TIMEOUT)
    assert first.returncode == 0 and first.extra["text"] == FIXED_REPLY, first.describe()
    attached = notes(home / "work", "big", 1400)
    run = run_opencode(opencode, running.front, "summarize the attached file", home=home, context=N_CTX,
                       files=[attached], session=first.extra["session"], timeout=TURN_TIMEOUT)  # fmt: skip
    assert_no_refusal(running)
    big = [e for e in agent_requests(running) if e["body_bytes"] > 60_000]
    assert big, "the attachment never went out:\n" + "\n".join(map(describe, running.sent(CHAT)))
    sent = big[0]
    headers = contextpaw_headers(sent)
    assert headers.get("x-contextpaw-compacted") == "true", describe(sent)
    assert int(headers["x-contextpaw-original-tokens"]) > N_CTX > int(headers["x-contextpaw-final-tokens"]), headers
    forwarded = running.forwarded(CHAT)[running.sent(CHAT).index(sent)]
    assert forwarded["body_bytes"] < sent["body_bytes"]
    assert "[ContextPaw:" in json.dumps(forwarded["body"]["messages"]), "no marker where content was cut"
    prompt = reported_prompt_tokens(forwarded)
    assert prompt is not None and prompt < N_CTX, f"the fake counted {prompt} tokens in the compacted request"
    assert '"contextpaw"' in sent["response"]["body"], "the stream carries no contextpaw report"
    assert forwarded["body"]["tools"] == sent["body"]["tools"] and forwarded["body"]["messages"][0] == sent["body"]["messages"][0]
    assert run.returncode == 0 and not run.extra["errors"], run.describe()
    assert run.extra["text"] == FIXED_REPLY, run.describe()


def test_strict_overflow_is_context_length_exceeded(opencode: Path, stack: StartStack, home: Path) -> None:
    """Under `policy=strict` the same attachment is refused with OpenAI's `context_length_exceeded`
    (a 400, or the 413 ContextPaw used to send: opencode reads both as an overflow and reports a
    ContextOverflowError), and nothing of it reaches the backend."""
    running = stack("llamacpp", ["--n-ctx", str(N_CTX)], ["contextpaw_policy=strict"])
    first = run_opencode(opencode, running.front, "say hi", home=home, context=N_CTX, timeout=TURN_TIMEOUT)
    assert_no_refusal(running)
    assert first.returncode == 0 and first.extra["text"] == FIXED_REPLY, first.describe()
    attached = notes(home / "work", "big", 1400)
    run = run_opencode(opencode, running.front, "summarize the attached file", home=home, context=N_CTX,
                       files=[attached], session=first.extra["session"], timeout=TURN_TIMEOUT)  # fmt: skip
    big = [e for e in agent_requests(running) if e["body_bytes"] > 60_000]
    assert big, run.describe()
    refusal = big[0]["response"]
    assert refusal["status"] in (400, 413), describe(big[0])
    error = json.loads(refusal["body"])["error"]
    assert error["code"] == "context_length_exceeded", error
    assert error["n_prompt_tokens"] > N_CTX, error
    assert all(e["body_bytes"] <= 60_000 for e in running.forwarded(CHAT)), "the refused request reached the backend"
    names = [e.get("error", {}).get("name") for e in run.extra["errors"]]
    assert "ContextOverflowError" in names, run.describe()
