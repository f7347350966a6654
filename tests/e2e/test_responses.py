"""OpenAI's Responses API, `/v1/responses` (what Codex speaks), through ContextPaw in a real
mitmdump, driven by the official `openai` SDK's `client.responses`, in front of the fake
llama-server (which 400s on overflow) and the fake Ollama (which cuts in silence)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from support.backends import Backend

if TYPE_CHECKING:
    from conftest import Proxy

SECRET = "kiwi"
INSTRUCTIONS = f"SECRET={SECRET}. Answer in one sentence."
QUESTION = "What is the SECRET?"
TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Runs a command.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    }
]


def session(calls: int = 6) -> list[dict[str, Any]]:
    """A Codex-shaped session far over the window: a developer message, the task, then reasoning,
    function calls and their big outputs, and the question last."""
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read the files."}]},
    ]
    for i in range(calls):
        items.append(
            {"type": "reasoning", "id": f"rs_{i}", "summary": [], "content": [{"type": "reasoning_text", "text": f"I should read f{i}."}]}
        )
        items.append({"type": "function_call", "call_id": f"call_{i}", "name": "shell", "arguments": json.dumps({"cmd": f"cat f{i}"})})
        items.append({"type": "function_call_output", "call_id": f"call_{i}", "output": f"file {i}: " + "lorem ipsum " * 120})
    items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]})
    return items


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)


def backend_url(proxy: Proxy, backend: str) -> str:
    return proxy.ollama if backend == "ollama" else proxy.llamacpp


@pytest.mark.parametrize("backend", ["ollama", "llamacpp"])
def test_a_turn_that_fits_is_forwarded_unchanged_and_reported(proxy: Proxy, backend: str) -> None:
    raw = client(backend_url(proxy, backend)).responses.with_raw_response.create(
        model="fake", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=16
    )
    response = raw.parse()
    assert SECRET in response.output_text
    assert raw.headers["X-ContextPaw-Compacted"] == "false"
    assert response.model_extra["contextpaw"]["compacted"] is False


@pytest.mark.parametrize("backend", ["ollama", "llamacpp"])
def test_an_overflowing_session_is_compacted_and_the_sdk_reads_the_report(proxy: Proxy, backend: str) -> None:
    raw = client(backend_url(proxy, backend)).responses.with_raw_response.create(
        model="fake", instructions=INSTRUCTIONS, input=session(), tools=TOOLS, max_output_tokens=16
    )
    response = raw.parse()
    assert SECRET in response.output_text, "the instructions are never touched"
    report = response.model_extra["contextpaw"]
    assert raw.headers["X-ContextPaw-Compacted"] == "true" and report["compacted"]
    assert report["final_tokens"] <= report["budget"] and report["removals"]
    assert "upstream_truncated" not in report


@pytest.mark.parametrize("backend", ["ollama", "llamacpp"])
def test_a_stream_carries_the_report_on_response_completed_and_every_event_parses(proxy: Proxy, backend: str) -> None:
    events = list(
        client(backend_url(proxy, backend)).responses.create(
            model="fake", instructions=INSTRUCTIONS, input=session(), tools=TOOLS, max_output_tokens=16, stream=True
        )
    )
    completed = [e for e in events if e.type == "response.completed"]
    assert len(completed) == 1 and events[-1] is completed[0]
    assert SECRET in completed[0].response.output_text
    report = completed[0].model_extra["contextpaw"]
    assert report["compacted"] and report["final_tokens"] <= report["budget"]


def test_strict_is_openais_context_length_exceeded(strict: Proxy) -> None:
    for url in (strict.ollama, strict.llamacpp):
        with pytest.raises(openai.BadRequestError) as raised:
            client(url).responses.create(model="fake", instructions=INSTRUCTIONS, input=session(), max_output_tokens=16)
        error = raised.value
        assert error.status_code == 400 and error.code == "context_length_exceeded"
        assert error.body["type"] == "invalid_request_error" and error.body["param"] == "input"
        assert error.response.json()["contextpaw"]["strategy"] == "refused"


@pytest.mark.parametrize("stream", [False, True])
def test_on_a_cutting_ollama_nothing_is_cut(watching: Proxy, cutting_ollama: Backend, stream: bool) -> None:
    body = {"model": "fake", "instructions": INSTRUCTIONS, "input": session(), "max_output_tokens": 16, "stream": stream}
    response = httpx.post(f"{watching.ollama}/v1/responses", json=body, timeout=30)
    assert response.status_code == 200 and response.headers["X-ContextPaw-Compacted"] == "true"
    assert httpx.get(f"{cutting_ollama.url}/_fake/last").json()["cut"] is False


def test_a_request_with_server_side_history_passes_through_with_a_note(proxy: Proxy) -> None:
    body = {"model": "fake", "previous_response_id": "resp_1", "input": QUESTION, "max_output_tokens": 16}
    response = httpx.post(f"{proxy.llamacpp}/v1/responses", json=body, timeout=30)
    assert response.headers["X-ContextPaw-Compacted"] == "false"
    assert "previous_response_id" in response.json()["contextpaw"]["notes"][0]
