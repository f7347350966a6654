"""Counting what the server counts, on the real model: exact where the server can count, and Ollama's
silent cuts caught by comparing what it evaluated with what it was sent."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from contextpaw.core.tokens import TokenizerCounter
from support.backends import Backend, locate_smollm2, start_proxy

pytestmark = pytest.mark.real

VARIED_CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Zähle: 1, 2, 3… 日本語 🐾"}],
    [
        {"role": "user", "content": "Read the file."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "def f(x):\n    return x * 2\n" * 20},
        {"role": "user", "content": "Summarize it."},
    ],
    [{"role": "user", "content": "lorem ipsum dolor sit amet " * 120}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "   spaced\t\ttabs\n\n\n"}],
    [{"role": "system", "content": "JSON only."}, {"role": "user", "content": json.dumps({"k": [1, 2.5, None, "v"] * 30})}],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


FILLER = "lorem ipsum dolor sit amet " * 60
"""Enough that a chat is over half the small server's budget, where ContextPaw asks the server to count
(far below it, the estimate decides: the request could not overflow even if it were off by two)."""


def near_the_budget(messages: list[dict]) -> list[dict]:
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    padded = {**messages[first_user], "content": FILLER + messages[first_user]["content"]}
    return [*messages[:first_user], padded, *messages[first_user + 1 :]]


@pytest.mark.parametrize("chat", range(len(VARIED_CHATS)))
@pytest.mark.parametrize("with_tools", [False, True])
def test_reported_prompt_size_equals_llama_servers_own_count(llama_proxy: str, chat: int, with_tools: bool) -> None:
    body = {"model": "m", "messages": near_the_budget(VARIED_CHATS[chat]), "max_tokens": 1, "temperature": 0}
    if with_tools:
        body["tools"] = TOOLS
    answer = httpx.post(f"{llama_proxy}/v1/chat/completions", json=body, timeout=120).json()
    report = answer["contextpaw"]
    assert report["counter"] == "backend" and report["exact"], report
    assert report["final_tokens"] == answer.get("usage", {}).get("prompt_tokens"), json.dumps(answer)


def test_tokenizer_rebuilt_from_the_gguf_counts_like_llama_server(llama_server: Backend) -> None:
    counter = TokenizerCounter.from_file(str(locate_smollm2().path))
    texts = [m["content"] or "" for chat in VARIED_CHATS for m in chat] + [json.dumps(TOOLS)]
    for text in texts:
        served = httpx.post(f"{llama_server.url}/tokenize", json={"content": text}, timeout=30).json()["tokens"]
        assert counter.text(text) == len(served), text[:40]


@pytest.fixture(scope="module")
def observing(ollama_sim: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """ContextPaw with policy off in front of the simulator: it changes nothing, and still watches."""
    work = tmp_path_factory.mktemp("observing")
    options = [f"contextpaw_ollama={ollama_sim}", "contextpaw_policy=off"]
    with start_proxy(ollama_sim, work / "conf", work / "mitmdump.log", options=options) as proxy:
        yield proxy.url


def truncations(proxy: str) -> int:
    return httpx.get(f"{proxy}/contextpaw/health", timeout=10).json()["stats"]["upstream_truncated"]


@pytest.mark.parametrize("stream", [False, True])
def test_every_silent_cut_of_the_simulator_is_flagged_and_nothing_else(
    observing: str, ollama_sim: str, sim_model: str, stream: bool
) -> None:
    num_ctx = 512
    flagged_wrongly, missed = [], []
    for lines in (5, 20, 40, 60, 90, 140):
        messages = [
            {"role": "user", "content": "Remember: the code is 7741."},
            {"role": "assistant", "content": "OK."},
            {"role": "user", "content": "status line\n" * lines + "What is the code?"},
        ]
        body = {
            "model": sim_model,
            "messages": messages,
            "stream": False,
            "options": {"num_ctx": num_ctx, "num_predict": 1, "temperature": 0},
        }
        overflows = httpx.post(f"{ollama_sim}/api/chat", json={**body, "truncate": False}, timeout=120).status_code == 400
        before = truncations(observing)
        response = httpx.post(f"{observing}/api/chat", json={**body, "stream": stream}, timeout=120)
        assert response.status_code == 200 and "contextpaw" not in response.text  # off: nothing added
        flagged = truncations(observing) - before == 1
        if flagged and not overflows:
            flagged_wrongly.append(lines)
        if overflows and not flagged:
            missed.append(lines)
    assert not flagged_wrongly and not missed, f"wrongly flagged {flagged_wrongly}, missed {missed}"
