"""Agents that learn their window from the model routes learn the served one through ContextPaw.

aider 0.86.2 (LiteLLM 1.81 inside) asks Ollama's `POST /api/show` for an `ollama_chat/` model and
takes the first `model_info` key holding `context_length` as its `max_input_tokens`: its warnings,
repo-map size and the point where it summarizes its own chat history follow from it, and `/tokens`
prints it. The fake Ollama serves a window of 4,096 (its OLLAMA_CONTEXT_LENGTH, which ContextPaw is
told) of a model trained to 32,768: direct, aider believes 32,768; through ContextPaw, 4,096.
"""

from __future__ import annotations

import re
from pathlib import Path

from support.agents import StartStack, run_aider

MODEL = "fake:latest"
SERVED, TRAINED = 4096, 32768
FAKE_ARGS = ["--model", MODEL, "--n-ctx", str(SERVED), "--train-ctx", str(TRAINED)]
WINDOW = re.compile(r"([\d,]+) tokens max context window size")


def aiders_window(aider: Path, base_url: str, home: Path) -> int:
    run = run_aider(aider, base_url, "/tokens", home=home, model=MODEL, timeout=60)
    found = WINDOW.findall(run.stdout)
    assert run.returncode == 0 and found, run.describe()
    return int(found[-1].replace(",", ""))


def test_aider_sizes_itself_to_the_served_window_read_from_api_show(aider: Path, stack: StartStack, home: Path) -> None:
    running = stack("ollama", FAKE_ARGS, [f"contextpaw_ollama_context_length={SERVED}"])
    assert aiders_window(aider, running.backend, home) == TRAINED  # the backend's own answer
    assert aiders_window(aider, running.front, home) == SERVED
    assert running.sent("/api/show"), "aider did not ask /api/show"
