"""An agent's fresh conversation on Ollama's `/v1` route, through a real mitmdump, with no tokenizer
for the model: the estimate alone would cut it (its text may run 3.3 times denser than the
estimate), so ContextPaw asks Ollama's native `/api/chat` to count it first, and it goes out as the
client sent it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from support.backends import Backend, free_port, start_proxy
from support.common import running
from support.fake_ollama import OllamaSettings, fake_ollama_app
from support.fitters import read_request

WINDOW = 32768
FILE_WORDS = 18000
"""A file read whole: 18,000 words, about 18,500 tokens with the rest of the request (the issue's
request: 18,513 of 32,768), and some 33,000 estimated tokens."""


def agent_request() -> dict[str, Any]:
    line = "The handler reads the request, checks the user and returns the settings it found.\n"
    return read_request("fake:latest", line * (FILE_WORDS // len(line.split())), 256)


@contextmanager
def contextpaw(workdir: Path, name: str, *options: str) -> Iterator[Backend]:
    port = free_port()
    with running(fake_ollama_app(OllamaSettings(num_ctx=WINDOW), WINDOW), port=port):
        settings = [f"contextpaw_state_dir={workdir / name}", "contextpaw_calibrate=false", *options]
        with start_proxy(f"http://127.0.0.1:{port}", workdir / "conf", workdir / f"{name}.log", options=settings) as proxy:
            yield proxy


def sent(proxy: Backend) -> tuple[dict[str, str], Any, dict[str, Any]]:
    """The answer's headers and completion, and what the health page says of asking Ollama."""
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(**agent_request())
    health = httpx.get(proxy.url + "/contextpaw/health", timeout=10).json()
    return dict(raw.headers), raw.parse(), health["counter"]["ollama_asked"]


def test_a_fresh_conversation_that_fits_goes_out_unchanged_once_ollama_counted_it(workdir: Path) -> None:
    with contextpaw(workdir, "asking") as proxy:
        headers, completion, asked = sent(proxy)
    assert asked["calls"] == 1 and asked["failures"] == 0
    assert headers.get("x-contextpaw-compacted") != "true", headers
    assert completion.usage.prompt_tokens > FILE_WORDS, "the server read the whole file"
    report = completion.model_extra.get("contextpaw") or {}
    assert not report.get("compacted")


def test_without_asking_the_estimate_cuts_the_same_request(workdir: Path) -> None:
    """What the test above covers: the estimate's width alone cuts it."""
    with contextpaw(workdir, "not-asking", "contextpaw_ask_ollama=false") as proxy:
        headers, completion, asked = sent(proxy)
    assert headers.get("x-contextpaw-compacted") == "true" and asked["calls"] == 0
    assert completion.usage.prompt_tokens < FILE_WORDS
