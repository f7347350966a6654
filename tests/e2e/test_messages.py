"""Claude Code's API, `/v1/messages`, through ContextPaw in a real mitmdump, driven by the official
`anthropic` SDK, in front of the fake llama-server (which 400s on overflow) and the fake Ollama
(which cuts in silence, or in native mode 400s)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import pytest

from support.backends import Backend

if TYPE_CHECKING:
    from conftest import Proxy

SECRET = "kiwi"
SYSTEM = [{"type": "text", "text": f"SECRET={SECRET}. Answer in one sentence.", "cache_control": {"type": "ephemeral"}}]
QUESTION = "What is the SECRET?"


def overflowing(calls: int = 6) -> list[dict[str, Any]]:
    """An agent loop far over the window: tool calls answered by big tool results."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read the files."}]
    for i in range(calls):
        messages.append({"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "read", "input": {"n": i}}]})
        messages.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"file {i}: " + "lorem ipsum " * 120}],
            }
        )
    messages.append({"role": "assistant", "content": "I have read them."})
    messages.append({"role": "user", "content": QUESTION})
    return messages


def undercounted() -> list[dict[str, Any]]:
    """Fits by our byte estimate, but the backend counts one token per 'a'."""
    return [{"role": "user", "content": "a " * 1100 + QUESTION}]


def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)


def backend_url(proxy: Proxy, backend: str) -> str:
    return proxy.ollama if backend == "ollama" else proxy.llamacpp


BACKENDS = ["ollama", "llamacpp"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_overflowing_agent_loop_is_compacted_and_the_sdk_reads_the_report(proxy: Proxy, backend: str) -> None:
    raw = client(backend_url(proxy, backend)).messages.with_raw_response.create(
        model="fake", max_tokens=16, system=SYSTEM, messages=overflowing()
    )
    message = raw.parse()
    assert SECRET in message.content[0].text
    report = message.model_extra["contextpaw"]
    assert raw.headers["X-ContextPaw-Compacted"] == "true" and report["compacted"]
    assert report["final_tokens"] <= report["budget"] and report["removals"]
    assert {r["role"] for r in report["removals"]} <= {"tool", "assistant"}, "the task and the question stay"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stream_parses_in_the_sdk_and_carries_the_report_on_message_delta(proxy: Proxy, backend: str) -> None:
    with client(backend_url(proxy, backend)).messages.stream(model="fake", max_tokens=16, system=SYSTEM, messages=overflowing()) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert SECRET in final.content[0].text
    assert [e.type for e in events][0] == "message_start" and events[-1].type == "message_stop"
    deltas = [e for e in events if e.type == "message_delta"]
    assert len(deltas) == 1 and deltas[0].model_extra["contextpaw"]["compacted"]
    assert not any("contextpaw" in (e.model_extra or {}) for e in events if e.type != "message_delta")


def test_llama_server_counts_this_route_exactly_so_its_400_never_happens(proxy: Proxy) -> None:
    raw = client(proxy.llamacpp).messages.with_raw_response.create(model="fake", max_tokens=16, messages=undercounted())
    report = raw.parse().model_extra["contextpaw"]
    assert report["counter"] == "backend" and report["exact"] and "X-ContextPaw-Recovered" not in raw.headers


@pytest.mark.parametrize("stream", [False, True])
def test_on_ollama_the_route_is_fitted_with_room_for_the_estimates_error(proxy: Proxy, stream: bool) -> None:
    """Ollama's /v1/messages cannot carry `truncate: false`: a request our estimate undercounts is
    fitted so that even at the estimate's worst it fits, and the report says so (the rescue of a
    400, should one still come, is the fitter's, tested there)."""
    body = {"model": "fake", "max_tokens": 16, "messages": undercounted(), "stream": stream, "system": SYSTEM}
    response = httpx.post(f"{proxy.ollama}/v1/messages", json=body, timeout=30)
    assert response.status_code == 200 and "X-ContextPaw-Recovered" not in response.headers
    if stream:
        deltas = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines() if '"message_delta"' in line]
        report = deltas[0]["contextpaw"]
    else:
        report = response.json()["contextpaw"]
        assert SECRET in response.json()["content"][0]["text"]
    assert report["compacted"] and any("cannot ask Ollama to refuse" in note for note in report["notes"])
    assert "upstream_truncated" not in report


@pytest.mark.parametrize("stream", [False, True])
def test_on_a_cutting_ollama_the_route_is_fitted_to_the_real_window_and_nothing_is_cut(
    watching: Proxy, cutting_ollama: Backend, stream: bool
) -> None:
    body = {"model": "fake", "max_tokens": 16, "messages": undercounted(), "stream": stream, "system": SYSTEM}
    response = httpx.post(f"{watching.ollama}/v1/messages", json=body, timeout=30)
    assert response.status_code == 200
    assert httpx.get(f"{cutting_ollama.url}/_fake/last").json()["cut"] is False
    assert response.headers["X-ContextPaw-Compacted"] == "true"


def test_strict_answers_with_anthropics_prompt_too_long_error(strict: Proxy) -> None:
    for url in (strict.ollama, strict.llamacpp):
        with pytest.raises(anthropic.BadRequestError) as raised:
            client(url).messages.create(model="fake", max_tokens=16, system=SYSTEM, messages=overflowing())
        error = raised.value
        assert error.status_code == 400 and error.body["error"]["type"] == "invalid_request_error"
        assert error.body["error"]["message"].startswith("prompt is too long: ")
        assert " tokens > " in error.body["error"]["message"] and error.body["error"]["message"].endswith(" maximum")
        assert error.body["contextpaw"]["strategy"] == "refused"


def test_count_tokens_passes_through_untouched(proxy: Proxy, llamacpp: Backend) -> None:
    body = {"model": "fake", "system": SYSTEM, "messages": overflowing()}
    through = client(proxy.llamacpp).messages.count_tokens(**body)
    direct = httpx.post(f"{llamacpp.url}/v1/messages/count_tokens", json=body).json()
    assert through.input_tokens == direct["input_tokens"] > 1024


def test_a_backend_that_is_down_answers_in_anthropics_shape(new_mitmdump: Any) -> None:
    from support.backends import dead_port

    dead = new_mitmdump("messages-dead", [f"http://127.0.0.1:{dead_port()}"])
    with dead.process:
        with pytest.raises(anthropic.APIStatusError) as raised:
            client(dead.ollama).messages.create(model="fake", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 502 and raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "api_error"
