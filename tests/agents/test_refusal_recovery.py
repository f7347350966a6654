"""What each agent does with ContextPaw's refusals, beside what it does with the server's own.

An agent that is told its conversation is over the window can compact its own history and go on;
whether it does depends on whether it recognises the error. Through ContextPaw under
`policy=strict`, against a fake llama-server whose window the agent does not know, a session's
second turn is refused, and:

- Claude Code (resumed session) compacts and answers, as it does on llama-server's own 400;
- Qwen Code compresses its history and answers; on llama-server's own 400 it stops with the error;
- opencode compacts and answers (it also reports a ContextOverflowError), as on llama-server's 400;
- Codex says it "ran out of room" and stops (`test_codex.py`); on llama-server's 400 it stops with
  the raw error;
- aider on `ollama_chat/` retries for a minute (`test_aider.py`): its LiteLLM 1.81 reads every error
  of an Ollama model, whatever its status, as a connection error. On Ollama's OpenAI-compatible
  route (`openai/<model>`) LiteLLM reads OpenAI's sentence ("This model's maximum context length is
  N tokens") as `ContextWindowExceededError`: aider does not retry, and tells the user the chat is
  over the model's token limit, which it does not compact by itself.

Claude Code's own instructions and twelve tools are several thousand tokens: on a window too small
for them, compacting the conversation cannot help, and the refusal says what window would; on that
window its plain turn is served.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.agents import StartStack, describe, require_agents, run_aider, run_claude, run_opencode, run_qwen
from support.common import FIXED_REPLY

MODEL = "fake:latest"
TRAIN_CTX = 2048
FAKE_ARGS = ["--model", MODEL, "--n-ctx", str(TRAIN_CTX), "--train-ctx", str(TRAIN_CTX)]
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
FIXED_PART = re.compile(r"the agent's tools and instructions need (\d+) tokens; raise the window to at least (\d+)")


@pytest.fixture(scope="session")
def qwen_code() -> Path:
    return require_agents("qwen")["qwen"]


def filler(label: str, words: int) -> str:
    """A pasted note of ``words`` distinct words (one fake token each)."""
    return f"Here is note {label}, keep it in mind: " + " ".join(f"{label}-w{i}" for i in range(words))


def statuses(entries: list[dict]) -> list[int]:
    return [e["response"]["status"] for e in entries]


def lines_file(work: Path, name: str, lines: int) -> Path:
    path = work / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(f"line {i} of the {name} file" for i in range(lines)) + "\n")
    return path


def test_aider_on_ollamas_openai_route_takes_the_strict_refusal_as_its_token_limit(aider: Path, stack: StartStack, home: Path) -> None:
    running = stack("ollama", FAKE_ARGS, ["contextpaw_policy=strict"])
    openai_route = ["--model", f"openai/{MODEL}", "--openai-api-base", f"{running.front}/v1", "--openai-api-key", "local"]
    run = run_aider(aider, running.front, "say hi", home=home, model=MODEL, files=[lines_file(home / "work", "notes.txt", 1000)],
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


def test_claude_code_compacts_its_session_after_the_strict_refusal_and_answers(claude_code: Path, stack: StartStack, home: Path) -> None:
    running = stack("llamacpp", ["--n-ctx", "16384"], ["contextpaw_policy=strict"])
    first = run_claude(claude_code, running.front, filler("a", 4000), home=home, timeout=120)
    assert isinstance(first.result, dict) and first.result.get("terminal_reason") == "completed", first.describe()
    turn = len(running.sent(MESSAGES))
    second = run_claude(claude_code, running.front, filler("b", 6000), home=home, resume=first.result["session_id"], timeout=180)
    sent = running.sent(MESSAGES)[turn:]
    assert statuses(sent)[0] == 400 and "prompt is too long" in sent[0]["response"]["body"], describe(sent[0])
    assert statuses(sent)[1:] and set(statuses(sent)[1:]) == {200}, "\n".join(map(describe, sent))
    assert isinstance(second.result, dict) and second.result.get("result") == FIXED_REPLY, second.describe()


def test_qwen_code_compresses_its_history_after_the_strict_refusal_and_answers(qwen_code: Path, stack: StartStack, home: Path) -> None:
    running = stack("llamacpp", ["--n-ctx", "32768"], ["contextpaw_policy=strict"])
    first = run_qwen(qwen_code, running.front, filler("a", 8000), home=home, timeout=150)
    assert first.extra["text"] == FIXED_REPLY, first.describe()
    turn = len(running.sent(CHAT))
    second = run_qwen(qwen_code, running.front, filler("b", 16000), home=home, timeout=240,
                      extra_args=["--resume", first.extra["session"]])  # fmt: skip
    sent = running.sent(CHAT)[turn:]
    refused = [e for e in sent if e["response"]["status"] == 400]
    assert refused and all(json.loads(e["response"]["body"])["error"]["code"] == "context_length_exceeded" for e in refused)
    assert statuses(sent)[-1] == 200 and sent[-1]["body_bytes"] < refused[0]["body_bytes"], "\n".join(map(describe, sent))
    assert second.extra["text"] == FIXED_REPLY and not second.extra["is_error"], second.describe()


def test_opencode_compacts_its_session_after_the_strict_refusal_and_answers(opencode: Path, stack: StartStack, home: Path) -> None:
    """Its window set far above the server's (100,000 against 12,000), as when nobody told it, so
    its own compaction waits for the refusal."""
    running = stack("llamacpp", ["--n-ctx", "12000"], ["contextpaw_policy=strict"])
    work = home / "work"
    first = run_opencode(opencode, running.front, "read the attached file", home=home, context=100_000,
                         files=[lines_file(work, "a", 700)], timeout=120)  # fmt: skip
    assert first.extra["text"] == FIXED_REPLY, first.describe()
    turn = len(running.sent(CHAT))
    second = run_opencode(opencode, running.front, "and this one", home=home, context=100_000,
                          files=[lines_file(work, "b", 1000)], session=first.extra["session"], timeout=180)  # fmt: skip
    sent = running.sent(CHAT)[turn:]
    assert statuses(sent)[0] == 400, describe(sent[0])
    assert json.loads(sent[0]["response"]["body"])["error"]["code"] == "context_length_exceeded"
    assert statuses(sent)[1:] and set(statuses(sent)[1:]) == {200}, "\n".join(map(describe, sent))
    assert second.extra["text"].endswith(FIXED_REPLY), second.describe()
