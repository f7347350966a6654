"""aider 0.86.2 through ContextPaw against the fake Ollama, whose model was trained on 2,048 tokens.

aider calls `POST /api/show` a few times, then `POST /api/chat` (`stream: false`) with
`options.num_ctx` of about 1.25 x its own count + 8,192 (here about 9,000), whatever the model's
trained length. Ollama caps num_ctx at the trained length and then, in its default mode, drops
what does not fit in silence. So ContextPaw must fit the request to the trained length, not to
aider's num_ctx, and flag any cut the server makes anyway.

The fake runs in Ollama's default (cutting) mode; its `/_fake/last` says whether it cut the last
prompt. 2,048 rather than 1,024: aider's own system prompt (the whole-file edit format with its
examples) is over 500 tokens, and must fit with room for the answer. Under `policy=strict` the
overflow is refused; aider (litellm) reads any Ollama error as a connection error, prints it and
retries with back-off (0.25 s doubling to 32 s, about 64 s in all) before it gives up: that test
stops aider after its first retries, once it has shown the reason.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from support.agents import (
    AIDER_VERSION,
    Stack,
    StartStack,
    body_changes,
    check_recorded,
    contextpaw_headers,
    describe,
    run_aider,
)
from support.common import FIXED_REPLY
from support.recorder import reported_prompt_tokens

FIXTURES = Path(__file__).with_name("fixtures")
CHAT = "/api/chat"
MODEL = "fake:latest"
TRAIN_CTX = 2048
FAKE_ARGS = ["--model", MODEL, "--n-ctx", str(TRAIN_CTX), "--train-ctx", str(TRAIN_CTX)]
TURN_TIMEOUT = 60  # aider starts in about 3 s and answers at once from the fake
STRICT_TIMEOUT = 20  # enough for its first retries; all of them would take 0.25 + 0.5 + ... + 32 s


def source_file(work: Path, lines: int) -> Path:
    path = work / "values.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"value_{i} = 'the value number {i}'\n" for i in range(lines)))
    return path


def last_cut(stack_backend: str) -> dict:
    with urllib.request.urlopen(f"{stack_backend}/_fake/last", timeout=5) as response:
        return json.loads(response.read())


def chat(stack: Stack) -> tuple[dict, dict]:
    sent, forwarded = stack.sent(CHAT), stack.forwarded(CHAT)
    assert sent, "aider sent no /api/chat"
    return sent[-1], (forwarded[-1] if forwarded else {})


def test_small_file_fits_and_is_forwarded_as_sent(aider: Path, stack: StartStack, home: Path) -> None:
    """aider's num_ctx (~9,000) is over the trained length, but the prompt fits 2,048: served, not
    cut, and forwarded as sent (ContextPaw may add only `truncate: false`, so a residual overflow
    is a 400 it can rescue rather than a silent cut); its budget is the trained length."""
    running = stack("ollama", FAKE_ARGS)
    run = run_aider(aider, running.front, "say hi", home=home, model=MODEL,
                    files=[source_file(home / "work", 20)], timeout=TURN_TIMEOUT)  # fmt: skip
    sent, forwarded = chat(running)
    assert sent["response"]["status"] == 200, describe(sent)
    assert sent["body"]["options"]["num_ctx"] > TRAIN_CTX, f"test set-up: aider asked num_ctx {sent['body']['options']}"
    budget = int(contextpaw_headers(sent)["x-contextpaw-budget"])
    assert budget <= TRAIN_CTX, (
        f"ContextPaw budgets {budget} tokens for a model trained on {TRAIN_CTX} (aider's num_ctx "
        f"{sent['body']['options']['num_ctx']} is not capped at the trained length)"
    )
    changes = body_changes(sent, forwarded)
    if "truncate" not in sent["body"] and forwarded["body"].get("truncate") is False:
        del changes["truncate"]
    assert not changes, f"ContextPaw changed a request that fits: {changes}"
    assert contextpaw_headers(sent).get("x-contextpaw-compacted") == "false", describe(sent)
    assert last_cut(running.backend)["cut"] is False, last_cut(running.backend)
    assert run.returncode == 0 and FIXED_REPLY in run.stdout, run.describe()
    problem = check_recorded(sent, FIXTURES / f"aider-{AIDER_VERSION}.json", "aider")
    assert problem is None, problem


def test_big_file_is_fitted_to_the_trained_length(aider: Path, stack: StartStack, home: Path) -> None:
    """A file three times the trained length: ContextPaw compacts to fit 2,048 (not aider's num_ctx),
    says so (headers, body report, a `[ContextPaw:` marker), and the server has nothing left to cut in
    silence: it either keeps the whole forwarded prompt or the cut is flagged."""
    running = stack("ollama", FAKE_ARGS)
    run = run_aider(aider, running.front, "say hi", home=home, model=MODEL,
                    files=[source_file(home / "work", 1000)], timeout=TURN_TIMEOUT)  # fmt: skip
    sent, forwarded = chat(running)
    assert sent["response"]["status"] == 200, describe(sent)
    headers = contextpaw_headers(sent)
    assert int(headers["x-contextpaw-budget"]) <= TRAIN_CTX, (
        f"ContextPaw fitted to {headers['x-contextpaw-budget']} tokens, over the trained length {TRAIN_CTX}: {headers}"
    )
    assert headers.get("x-contextpaw-compacted") == "true", describe(sent)
    assert forwarded["body_bytes"] < sent["body_bytes"]
    assert "[ContextPaw:" in json.dumps(forwarded["body"]["messages"]), "no marker where content was cut"
    assert json.loads(sent["response"]["body"]).get("contextpaw", {}).get("compacted") is True, "no report in the body"
    cut = last_cut(running.backend)
    flagged = "x-contextpaw-upstream-truncated" in headers
    assert not cut["cut"] or flagged, f"Ollama cut the forwarded prompt in silence: {cut}, {headers}"
    assert reported_prompt_tokens(forwarded) <= TRAIN_CTX
    assert forwarded["body"]["messages"][0] == sent["body"]["messages"][0], "the system prompt was changed"
    assert run.returncode == 0 and FIXED_REPLY in run.stdout, run.describe()


def test_strict_refuses_the_big_file(aider: Path, stack: StartStack, home: Path) -> None:
    """Under `policy=strict` the same file is refused with Ollama's error shape (`{"error": ...}`)
    before it reaches the server, every time aider retries, and aider shows the reason."""
    running = stack("ollama", FAKE_ARGS, ["contextpaw_policy=strict"])
    run = run_aider(aider, running.front, "say hi", home=home, model=MODEL,
                    files=[source_file(home / "work", 1000)], timeout=STRICT_TIMEOUT)  # fmt: skip
    sent = running.sent(CHAT)
    assert sent, run.describe()
    refusal = sent[0]["response"]
    assert refusal["status"] in (400, 413), describe(sent[0])
    error = json.loads(refusal["body"])
    assert isinstance(error.get("error"), str) and "strict" in error["error"], error
    assert int(contextpaw_headers(sent[0])["x-contextpaw-budget"]) <= TRAIN_CTX, describe(sent[0])
    assert not running.forwarded(CHAT), "the refused request reached the server"
    assert all(e["response"]["status"] == refusal["status"] for e in sent), "\n".join(map(describe, sent))
    shown = " ".join((run.stdout + run.stderr).split())
    assert "policy strict refuses" in shown and "Retrying in" in shown, run.describe()
