"""What each agent does with ContextPaw's refusals, where the other agent tests do not show it.

aider 0.86.2 reads every error of an `ollama_chat/` model as a connection error (its LiteLLM 1.81
maps no Ollama error by its text or status) and retries it for a minute, whatever the status and
sentence (`test_aider.py` shows it). On Ollama's OpenAI-compatible route (`openai/<model>`) LiteLLM
reads OpenAI's sentence ("This model's maximum context length is N tokens") as
`ContextWindowExceededError`: aider does not retry and tells the user the chat is over the model's
token limit, which it cannot compact by itself.

Claude Code's own instructions and twelve tools are several thousand tokens: on a window too small
for them, compacting the conversation (which Claude Code offers on "prompt is too long") cannot
help, and the refusal says what window would; on that window its plain turn is served.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from support.agents import StartStack, describe, run_aider, run_claude
from support.common import FIXED_REPLY

MODEL = "fake:latest"
TRAIN_CTX = 2048
FAKE_ARGS = ["--model", MODEL, "--n-ctx", str(TRAIN_CTX), "--train-ctx", str(TRAIN_CTX)]
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
FIXED_PART = re.compile(r"the agent's tools and instructions need (\d+) tokens; raise the window to at least (\d+)")


def big_file(work: Path) -> Path:
    path = work / "values.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"value_{i} = 'the value number {i}'\n" for i in range(1000)))
    return path


def test_aider_on_ollamas_openai_route_takes_the_strict_refusal_as_its_token_limit(
    aider: Path, stack: StartStack, home: Path
) -> None:
    running = stack("ollama", FAKE_ARGS, ["contextpaw_policy=strict"])
    openai_route = ["--model", f"openai/{MODEL}", "--openai-api-base", f"{running.front}/v1", "--openai-api-key", "local"]
    run = run_aider(aider, running.front, "say hi", home=home, model=MODEL, files=[big_file(home / "work")],
                    timeout=60, extra_args=openai_route)  # fmt: skip
    sent = running.sent(CHAT)
    assert len(sent) == 1, "aider retried the refusal:\n" + "\n".join(map(describe, sent))
    assert sent[0]["response"]["status"] == 400, describe(sent[0])
    error = json.loads(sent[0]["response"]["body"])["error"]
    assert error["code"] == "context_length_exceeded" and error["message"].startswith("This model's maximum context length is")
    assert not running.forwarded(CHAT), "the refused request reached the server"
    shown = " ".join((run.stdout + run.stderr).split())
    assert "has hit a token limit" in shown and "Retrying in" not in shown, run.describe()


def test_claude_code_is_told_the_window_its_tools_and_instructions_need_and_that_window_serves_it(
    claude_code: Path, stack: StartStack, home: Path
) -> None:
    small = 2048
    running = stack("llamacpp", ["--n-ctx", str(small)])
    run = run_claude(claude_code, running.front, "say hi", home=home / "small", timeout=90)
    sent = running.sent(MESSAGES)
    assert sent and sent[0]["response"]["status"] == 400, run.describe()
    message = json.loads(sent[0]["response"]["body"])["error"]["message"]
    assert message.startswith("prompt is too long: "), message
    found = FIXED_PART.search(message)
    assert found and int(found[1]) > small, message
    assert isinstance(run.result, dict) and run.result.get("terminal_reason") == "prompt_too_long", run.describe()
    assert not running.forwarded(MESSAGES), "the refused request reached the backend"

    named = int(found[2])
    enough = stack("llamacpp", ["--n-ctx", str(named)])
    served = run_claude(claude_code, enough.front, "say hi", home=home / "named", timeout=90)
    assert [e["response"]["status"] for e in enough.sent(MESSAGES)] == [200], "\n".join(map(describe, enough.sent(MESSAGES)))
    assert isinstance(served.result, dict) and served.result.get("result") == FIXED_REPLY, served.describe()
