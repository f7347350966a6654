"""What each agent does with ContextPaw's strict refusal, where the other agent tests do not show it.

aider 0.86.2 reads every error of an `ollama_chat/` model as a connection error (its LiteLLM 1.81
maps no Ollama error by its text or status) and retries it for a minute, whatever the status and
sentence (`test_aider.py` shows it). On Ollama's OpenAI-compatible route (`openai/<model>`) LiteLLM
reads OpenAI's sentence ("This model's maximum context length is N tokens") as
`ContextWindowExceededError`: aider does not retry and tells the user the chat is over the model's
token limit, which it cannot compact by itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from support.agents import StartStack, describe, run_aider

MODEL = "fake:latest"
TRAIN_CTX = 2048
FAKE_ARGS = ["--model", MODEL, "--n-ctx", str(TRAIN_CTX), "--train-ctx", str(TRAIN_CTX)]
CHAT = "/v1/chat/completions"


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
