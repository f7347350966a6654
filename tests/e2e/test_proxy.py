"""ContextPaw in a real mitmdump (and the `contextpaw` command) in front of the fake backends,
driven by the real `ollama` and `openai` clients."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import ollama as ollama_client
import openai
import pytest

from support.backends import Backend

if TYPE_CHECKING:  # conftest is not importable by name when several test folders have one
    from conftest import Proxy

N_CTX = 1024
"""The fakes' window and the proxies' default window (set in conftest.py)."""

SECRET = "kiwi"
SYSTEM = f"SECRET={SECRET}. Answer in one sentence."
QUESTION = "What is the SECRET?"


def overflowing(turns: int = 10) -> list[dict[str, str]]:
    """A chat far over the window, whose answer needs the system prompt that a cut would lose."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Read these notes."}]
    for i in range(turns):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": f"note {i}: " + "lorem ipsum " * 150})
    messages.append({"role": "user", "content": QUESTION})
    return messages


def undercounted() -> list[dict[str, str]]:
    """A chat that our byte estimate thinks fits but the backend counts as too long (one token per 'a')."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a " * 1100 + QUESTION}]


class Headers:
    """Captures the response headers an `ollama` client saw (the client itself does not expose them)."""

    def __init__(self) -> None:
        self.last: httpx.Headers = httpx.Headers()

    def __call__(self, response: httpx.Response) -> None:
        self.last = response.headers


def ollama_at(url: str, **kwargs: object) -> tuple[ollama_client.Client, Headers]:
    headers = Headers()
    return ollama_client.Client(host=url, event_hooks={"response": [headers]}, **kwargs), headers


def openai_at(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)


OPTIONS = {"num_ctx": N_CTX, "num_predict": 16}


# -- compaction, reported in headers, bodies and streams ---------------------------------------------


def test_ollama_chat_is_compacted_and_the_model_keeps_its_system_prompt(proxy: Proxy) -> None:
    client, headers = ollama_at(proxy.ollama)
    reply = client.chat(model="fake", messages=overflowing(), options=OPTIONS)
    assert SECRET in reply.message.content
    assert headers.last["X-ContextPaw-Compacted"] == "true"
    assert reply.prompt_eval_count <= int(headers.last["X-ContextPaw-Budget"])  # the server's count (whole with usage_whole)


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_after_a_cut_tells_the_prompt_size_whole_and_names_the_servers_count(usage_whole: Proxy, stream: bool) -> None:
    """An agent that compacts from usage (opencode) read the cut prompt's size, under its own
    threshold, and never compacted while ContextPaw cut its history turn after turn."""
    client, _ = ollama_at(usage_whole.ollama)
    answer = client.chat(model="fake", messages=overflowing(), options=OPTIONS, stream=stream)
    final = list(answer)[-1] if stream else answer  # what the `ollama` client reads
    body = {"model": "fake", "messages": overflowing(), "options": OPTIONS, "stream": stream}
    with httpx.stream("POST", f"{usage_whole.ollama}/api/chat", json=body) as response:  # and the report beside it
        record = [json.loads(line) for line in response.iter_lines() if line][-1]
    report = record["contextpaw"]
    told = report["usage_told"]
    assert told["server_prompt_tokens"] <= report["budget"] < report["original_tokens"]
    assert final.prompt_eval_count == record["prompt_eval_count"] == told["server_prompt_tokens"] + told["added"]
    assert told["added"] == report["original_tokens"] - report["final_tokens"] > 0


def test_openai_stream_after_a_cut_tells_the_usage_whole_to_the_sdk(usage_whole: Proxy) -> None:
    stream = openai_at(usage_whole.llamacpp).chat.completions.create(
        model="fake", messages=overflowing(), max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    usage = next(c for c in chunks if c.usage is not None)
    told = usage.model_extra["contextpaw"]["usage_told"]
    assert usage.usage.prompt_tokens == told["server_prompt_tokens"] + told["added"] > N_CTX
    assert usage.usage.total_tokens == usage.usage.prompt_tokens + usage.usage.completion_tokens


def test_an_answer_to_a_request_sent_whole_keeps_the_servers_usage(usage_whole: Proxy) -> None:
    completion = openai_at(usage_whole.llamacpp).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": QUESTION}], max_tokens=8
    )
    assert completion.usage is not None and completion.usage.prompt_tokens < 100
    assert "usage_told" not in (completion.model_extra.get("contextpaw") or {})


def test_without_the_option_a_cut_answer_keeps_the_servers_usage(proxy: Proxy) -> None:
    completion = openai_at(proxy.llamacpp).chat.completions.create(model="fake", messages=overflowing(), max_tokens=8)
    report = completion.model_extra["contextpaw"]
    assert report["compacted"] and "usage_told" not in report
    assert completion.usage is not None and completion.usage.prompt_tokens <= report["budget"]


def test_a_client_that_asks_for_the_whole_usage_is_told_it_without_the_option(proxy: Proxy) -> None:
    """`contextpaw launch` has each agent send `X-ContextPaw-Usage: whole`: the option stays off for
    every other client of the same ContextPaw."""
    client = openai.OpenAI(base_url=f"{proxy.llamacpp}/v1", api_key="k", max_retries=0, default_headers={"X-ContextPaw-Usage": "whole"})
    completion = client.chat.completions.create(model="fake", messages=overflowing(), max_tokens=8)
    told = completion.model_extra["contextpaw"]["usage_told"]
    assert completion.usage is not None and completion.usage.prompt_tokens == told["server_prompt_tokens"] + told["added"] > N_CTX


def test_a_client_that_asks_for_the_servers_usage_is_told_it_under_the_option(usage_whole: Proxy) -> None:
    client = openai.OpenAI(
        base_url=f"{usage_whole.llamacpp}/v1", api_key="k", max_retries=0, default_headers={"X-ContextPaw-Usage": "served"}
    )
    completion = client.chat.completions.create(model="fake", messages=overflowing(), max_tokens=8)
    report = completion.model_extra["contextpaw"]
    assert report["compacted"] and "usage_told" not in report
    assert completion.usage is not None and completion.usage.prompt_tokens <= report["budget"]


def test_ollama_chat_stream_carries_the_report_in_the_done_record(proxy: Proxy) -> None:
    client, headers = ollama_at(proxy.ollama)
    parts = list(client.chat(model="fake", messages=overflowing(), options=OPTIONS, stream=True))
    assert parts[-1].done and SECRET in "".join(p.message.content for p in parts)
    assert headers.last["X-ContextPaw-Compacted"] == "true"
    body = {"model": "fake", "messages": overflowing(), "options": OPTIONS}
    with httpx.stream("POST", f"{proxy.ollama}/api/chat", json=body) as response:
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert "contextpaw" not in lines[0] and lines[-1]["done"] is True
    assert lines[-1]["contextpaw"]["compacted"] is True


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_generate_is_compacted(proxy: Proxy, stream: bool) -> None:
    client, headers = ollama_at(proxy.ollama)
    prompt = "lorem ipsum " * 2000 + QUESTION
    result = client.generate(model="fake", prompt=prompt, system=SYSTEM, options=OPTIONS, stream=stream)
    text = "".join(r.response for r in result) if stream else result.response
    assert SECRET in text and headers.last["X-ContextPaw-Compacted"] == "true"


@pytest.mark.parametrize("backend", ["ollama", "llamacpp"])
def test_openai_chat_reports_in_headers_and_body(proxy: Proxy, backend: str) -> None:
    raw = openai_at(getattr(proxy, backend)).chat.completions.with_raw_response.create(model="fake", messages=overflowing(), max_tokens=16)
    completion = raw.parse()
    assert SECRET in completion.choices[0].message.content
    assert raw.headers["X-ContextPaw-Compacted"] == "true"
    report = completion.model_extra["contextpaw"]
    assert report["compacted"] and report["final_tokens"] <= report["budget"] and report["markers"]


@pytest.mark.parametrize("backend", ["ollama", "llamacpp"])
def test_openai_chat_stream_reports_in_the_last_chunk(proxy: Proxy, backend: str) -> None:
    chunks = list(
        openai_at(getattr(proxy, backend)).chat.completions.create(model="fake", messages=overflowing(), max_tokens=16, stream=True)
    )
    carriers = [c for c in chunks if c.model_extra and "contextpaw" in c.model_extra]
    assert carriers == [chunks[-1]]
    assert chunks[-1].model_extra["contextpaw"]["compacted"] is True
    assert SECRET in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("backend", ["ollama", "llamacpp"])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_completions_are_compacted(proxy: Proxy, backend: str, stream: bool) -> None:
    prompt = SYSTEM + " " + "lorem ipsum " * 2000 + QUESTION
    client = openai_at(getattr(proxy, backend))
    result = client.completions.create(model="fake", prompt=prompt, max_tokens=16, stream=stream)
    pieces = list(result) if stream else [result]
    report = pieces[-1].model_extra["contextpaw"]
    assert report["compacted"] and report["strategy"] == "head_tail"


@pytest.mark.parametrize("stream", [False, True])
def test_llamacpp_completion_is_compacted(proxy: Proxy, stream: bool) -> None:
    body = {"prompt": SYSTEM + " " + "lorem ipsum " * 2000 + QUESTION, "n_predict": 16, "stream": stream}
    with httpx.stream("POST", f"{proxy.llamacpp}/completion", json=body) as response:
        assert response.status_code == 200 and response.headers["X-ContextPaw-Compacted"] == "true"
        text = response.read().decode()
    final = json.loads(text.strip().split("\n\n")[-1].removeprefix("data: ")) if stream else json.loads(text)
    assert final["stop"] is True and final["contextpaw"]["compacted"] is True


def test_streams_are_passed_through_as_they_come(slow_proxy: Proxy) -> None:
    client = openai_at(slow_proxy.llamacpp)
    started = time.monotonic()
    arrivals = [
        time.monotonic() - started
        for _ in client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True)
    ]
    assert arrivals[-1] - arrivals[0] > 0.3, "chunks arrived together: the stream was buffered"


# -- policies ---------------------------------------------------------------------------------------


def test_strict_gives_ollama_clients_a_400_with_the_numbers(strict: Proxy) -> None:
    client, _ = ollama_at(strict.ollama)
    with pytest.raises(ollama_client.ResponseError) as refused:
        client.chat(model="fake", messages=overflowing(), options=OPTIONS)
    assert refused.value.status_code == 400
    assert "policy strict" in refused.value.error and f"{N_CTX}-token" in refused.value.error


@pytest.mark.parametrize("backend", ["ollama", "llamacpp"])
def test_strict_gives_openai_clients_context_length_exceeded(strict: Proxy, backend: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:  # OpenAI's own answer to an overlong prompt
        openai_at(getattr(strict, backend)).chat.completions.create(model="fake", messages=overflowing(), max_tokens=16)
    assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
    error = refused.value.response.json()["error"]
    assert (error["type"], error["param"], error["num_ctx"]) == ("invalid_request_error", "messages", N_CTX)
    assert error["n_prompt_tokens"] > error["budget"] == N_CTX - 64  # what the server would admit: max_tokens reserves nothing


# -- the upstream 400, rescued --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_overflow_400_is_compacted_and_retried(proxy: Proxy, stream: bool) -> None:
    body = {"model": "fake", "messages": undercounted(), "options": OPTIONS, "stream": stream}
    response = httpx.post(f"{proxy.ollama}/api/chat", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["X-ContextPaw-Recovered"] == "upstream-400"
    report = json.loads(response.text.splitlines()[-1])["contextpaw"]
    assert report["recovered_from_upstream_400"] is True and report["window"] == N_CTX
    assert "upstream_truncated" not in report


@pytest.mark.parametrize("stream", [False, True])
def test_on_ollamas_v1_an_estimated_chat_is_fitted_with_room_for_the_counts_error(proxy: Proxy, stream: bool) -> None:
    """/v1 cannot carry truncate:false, so a prompt over the window would be cut there: one our
    estimate undercounts three times is fitted so that even then it fits, and the report says so."""
    body = {"model": "fake", "messages": undercounted(), "max_tokens": 16, "stream": stream}
    response = httpx.post(f"{proxy.ollama}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    if stream:
        events = [e.removeprefix("data: ") for e in response.text.strip().split("\n\n")]
        assert events[-1] == "[DONE]"
        report = json.loads(events[-2])["contextpaw"]
    else:
        report = response.json()["contextpaw"]
        assert SECRET in response.json()["choices"][0]["message"]["content"]
    assert report["compacted"] and "X-ContextPaw-Recovered" not in response.headers
    assert any("cannot ask Ollama to refuse" in note for note in report["notes"])
    assert "upstream_truncated" not in report


@pytest.mark.parametrize("route", ["/api/chat"])
def test_a_rescued_stream_is_streamed(stalling_proxy: Proxy, route: str) -> None:
    """The retry after the 400 answers as it generates: its first tokens reach the client while the
    backend is still generating (it never finishes), so nothing waited for the whole answer."""
    body = {"model": "fake", "messages": undercounted(), "max_tokens": 8, "options": {"num_predict": 8}, "stream": True}
    records = []
    with httpx.stream("POST", stalling_proxy.ollama + route, json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["X-ContextPaw-Recovered"] == "upstream-400"
        for line in response.iter_lines():
            if line.strip():
                records.append(json.loads(line.removeprefix("data: ")))
            if len(records) == 2:
                break
    assert len(records) == 2 and not any("contextpaw" in r for r in records)


@pytest.mark.parametrize("route", ["/api/chat"])
def test_a_rescued_streams_report_comes_in_its_last_record(slow_proxy: Proxy, route: str) -> None:
    body = {"model": "fake", "messages": undercounted(), "max_tokens": 8, "options": {"num_predict": 8}, "stream": True}
    with httpx.stream("POST", slow_proxy.ollama + route, json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["X-ContextPaw-Recovered"] == "upstream-400"
        records = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                   if line.strip() and line != "data: [DONE]"]  # fmt: skip
    assert all("contextpaw" not in r for r in records[:-1])
    report = records[-1]["contextpaw"]
    assert report["recovered_from_upstream_400"] is True and report["compacted"] and report["window"] == N_CTX


def test_llama_server_counts_exactly_so_its_400_never_happens(proxy: Proxy) -> None:
    """What our byte estimate undercounts, llama-server's own tokenizer does not: compacted up front."""
    body = {"model": "fake", "messages": undercounted(), "max_tokens": 16}
    response = httpx.post(f"{proxy.llamacpp}/v1/chat/completions", json=body, timeout=30)
    report = response.json()["contextpaw"]
    assert response.status_code == 200 and "X-ContextPaw-Recovered" not in response.headers
    assert report["compacted"] and report["counter"] == "backend" and report["exact"]
    assert report["final_tokens"] <= report["budget"]


def test_the_ollama_client_never_sees_the_rescued_400(proxy: Proxy) -> None:
    client, headers = ollama_at(proxy.ollama)
    reply = client.chat(model="fake", messages=undercounted(), options=OPTIONS)
    assert SECRET in reply.message.content and headers.last["X-ContextPaw-Recovered"] == "upstream-400"


# -- pass-through, own endpoints, failures ---------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "path"), [("ollama", "/api/version"), ("ollama", "/"), ("llamacpp", "/slots?x=1")]
)  # the model routes (/props, /v1/models, /api/show) report the served window: tests/e2e/test_model_routes.py
def test_other_routes_pass_through_byte_for_byte(
    proxy: Proxy, ollama: Backend, llamacpp: Backend, get: Callable, backend: str, path: str
) -> None:
    direct = get({"ollama": ollama, "llamacpp": llamacpp}[backend].url + path)
    proxied = get(getattr(proxy, backend) + path)
    assert (proxied[0], proxied[2]) == (direct[0], direct[2])
    assert "X-ContextPaw-Compacted" not in proxied[1]


def test_health_metrics_and_evicted_content(proxy: Proxy, get: Callable) -> None:
    completion = openai_at(proxy.llamacpp).chat.completions.create(model="fake", messages=overflowing(), max_tokens=16)
    report = completion.model_extra["contextpaw"]
    dropped = next(r for r in report["removals"] if r["action"] == "dropped")
    status, _, body = get(f"{proxy.llamacpp}/contextpaw/evicted/{dropped['marker_id']}")
    assert status == 200 and json.loads(body)["content"][0] == overflowing()[dropped["index"]]

    status, _, body = get(f"{proxy.ollama}/contextpaw/health")
    health = json.loads(body)
    assert status == 200 and health["stats"]["compacted"] >= 1
    assert {(b["kind"], b["answers"]) for b in health["backends"]} == {("ollama", True), ("llamacpp", True)}
    status, headers, body = get(f"{proxy.ollama}/contextpaw/metrics")
    assert status == 200 and b"contextpaw_compacted_total" in body


def test_a_backend_that_is_down_gets_a_json_502(command: Proxy, get: Callable) -> None:
    client, _ = ollama_at(command.ollama)
    with pytest.raises(ollama_client.ResponseError) as down:
        client.chat(model="fake", messages=[{"role": "user", "content": "hi"}])
    assert down.value.status_code == 502 and "does not answer" in down.value.error
    with pytest.raises(openai.APIStatusError) as down_v1:
        openai_at(command.ollama).models.list()
    assert down_v1.value.response.json()["error"]["code"] == "backend_unreachable"
    status, _, body = get(f"{command.ollama}/contextpaw/health")
    assert status == 503
    assert {b["kind"]: b["answers"] for b in json.loads(body)["backends"]} == {"ollama": False, "llamacpp": True}


def test_the_contextpaw_command_compacts(command: Proxy) -> None:
    completion = openai_at(command.llamacpp).chat.completions.create(model="fake", messages=overflowing(), max_tokens=16)
    assert completion.model_extra["contextpaw"]["compacted"] and SECRET in completion.choices[0].message.content


def test_regular_proxy_mode_handles_configured_backends(regular: str, ollama: Backend) -> None:
    client, headers = ollama_at(ollama.url, proxy=regular)
    reply = client.chat(model="fake", messages=overflowing(), options=OPTIONS)
    assert SECRET in reply.message.content and headers.last["X-ContextPaw-Compacted"] == "true"


def test_an_internal_error_fails_open(faulty: Proxy) -> None:
    client, headers = ollama_at(faulty.ollama)
    reply = client.chat(model="fake", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert SECRET in reply.message.content
    assert headers.last["X-ContextPaw-Error"].startswith("RuntimeError")


# -- Ollama's silent truncation, caught -----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_silent_ollama_cut_is_flagged_in_the_report(watching: Proxy, stream: bool) -> None:
    """The client allows truncation, our estimate thinks it fits, and Ollama cuts: we say so."""
    body = {"model": "fake", "messages": undercounted(), "options": OPTIONS, "stream": stream, "truncate": True}
    response = httpx.post(f"{watching.ollama}/api/chat", json=body, timeout=30)
    records = [json.loads(line) for line in response.text.splitlines()]
    final = records[-1]
    flagged = final["contextpaw"]["upstream_truncated"]
    assert flagged["evaluated_tokens"] == final["prompt_eval_count"] and flagged["num_ctx"] == N_CTX
    assert flagged["sent_tokens"] == final["contextpaw"]["final_tokens"]
    if not stream:
        assert response.headers["X-ContextPaw-Upstream-Truncated"].startswith(f"{final['prompt_eval_count']} of ")


def test_near_the_window_ollama_is_told_not_to_truncate_and_its_400_is_rescued(watching: Proxy) -> None:
    """The same request without the client's `truncate`: Ollama refuses instead of cutting, and we fit it."""
    body = {"model": "fake", "messages": undercounted(), "options": OPTIONS, "stream": False}
    response = httpx.post(f"{watching.ollama}/api/chat", json=body, timeout=30)
    report = response.json()["contextpaw"]
    assert response.status_code == 200 and report["recovered_from_upstream_400"]
    assert "upstream_truncated" not in report and SECRET in response.json()["message"]["content"]


# -- digests of what was evicted ------------------------------------------------------------------


def test_evicted_spans_are_summarized_inside_the_budget(summarizing: Proxy, get: Callable) -> None:
    completion = openai_at(summarizing.ollama).chat.completions.create(model="fake", messages=overflowing(), max_tokens=16)
    report = completion.model_extra["contextpaw"]
    assert report["summarized"] and report["summary_reason"] is None
    assert report["final_tokens"] <= report["budget"]
    summarized = [r for r in report["removals"] if r["action"] == "summarized"]
    assert summarized and all(r["marker_id"] in report["markers"] for r in summarized)
    health = json.loads(get(f"{summarizing.ollama}/contextpaw/health")[2])
    assert health["summarizer"]["digests"] >= 1 and health["summarizer"]["failures"] == 0


def test_a_summarizer_that_is_down_leaves_the_plain_marker_and_says_why(summarizer_down: Proxy) -> None:
    completion = openai_at(summarizer_down.ollama).chat.completions.create(model="fake", messages=overflowing(), max_tokens=16)
    report = completion.model_extra["contextpaw"]
    assert report["compacted"] and not report["summarized"] and report["summary_reason"]
    assert {r["action"] for r in report["removals"]} <= {"dropped", "shrunk"}


def test_health_lists_every_backend_before_any_traffic_and_flags_the_dead_one(new_mitmdump: Callable[..., Proxy], ollama: Backend) -> None:
    """A reverse-mode target nobody has used yet is identified at once, and a configured backend that
    does not answer is listed as down, before a single model request."""
    dead = "http://127.0.0.1:9"
    fresh = new_mitmdump("fresh-health", [ollama.url], "--set", f"contextpaw_llamacpp={dead}")
    with fresh.process:
        health = httpx.get(f"{fresh.ollama}/contextpaw/health", timeout=10).json()
    rows = {row["url"]: row for row in health["backends"]}
    assert rows[ollama.url] | {"last_ok_at": "t"} == {"kind": "ollama", "url": ollama.url, "answers": True, "last_error": None,
                                                      "last_error_at": None, "last_ok_at": "t"}  # fmt: skip
    assert rows[dead]["kind"] == "llamacpp" and rows[dead]["answers"] is False


def test_a_page_that_rebinds_its_name_to_the_loopback_cannot_read_the_admin_endpoints(proxy: Proxy) -> None:
    """Reverse mode replaces the Host before any hook; ContextPaw still checks the one the browser sent."""
    forged = {"Host": f"attacker.example:{proxy.ollama.rsplit(':', 1)[1]}"}
    for path in ("/contextpaw/health", "/contextpaw/metrics", "/contextpaw/evicted/cp-0"):
        assert httpx.get(proxy.ollama + path, headers=forged, timeout=10).status_code == 403
    assert httpx.get(proxy.ollama + "/contextpaw/health", timeout=10).status_code == 200
    # nor the backends: reverse mode hands them their own Host, so ContextPaw keeps Ollama's check up
    refused = httpx.get(proxy.ollama + "/api/version", headers=forged, timeout=10)
    assert refused.status_code == 403 and "does not name this machine" in refused.json()["error"]
    assert httpx.get(proxy.ollama + "/api/version", timeout=10).status_code == 200


# -- compressed bodies ------------------------------------------------------------------------------


def test_a_compressed_chat_is_inflated_and_compacted(proxy: Proxy) -> None:
    import gzip

    body = {"model": "fake", "messages": overflowing(), "options": OPTIONS, "stream": False}
    packed = gzip.compress(json.dumps(body).encode())
    response = httpx.post(f"{proxy.ollama}/api/chat", content=packed, headers={"Content-Encoding": "gzip"}, timeout=30)
    assert response.status_code == 200 and response.json()["contextpaw"]["compacted"]
    assert SECRET in response.json()["message"]["content"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
def test_a_compressed_bomb_is_refused_while_inflating_and_other_clients_go_on(
    new_mitmdump: Callable, ollama: Backend, encoding: str
) -> None:
    """A body that inflates past contextpaw_max_body_mb (here 8 MB) gets a 413 in the caller's shape
    once the limit is reached, not after inflating it all; another client is answered meanwhile."""
    import concurrent.futures
    import zlib

    import brotli
    from backports import zstd

    zeros = b'{"model": "fake", "messages": [{"role": "user", "content": "' + b"0" * (400 << 20)
    pack = {
        "gzip": lambda d: zlib.compress(d, wbits=31),
        "deflate": zlib.compress,
        "br": lambda d: brotli.compress(d, quality=1),
        "zstd": zstd.compress,
    }
    bomb = pack[encoding](zeros)
    assert len(bomb) < 2 << 20
    limited = new_mitmdump(f"bomb-{encoding}", [ollama.url], "--set", "contextpaw_max_body_mb=8")
    with limited.process, concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        refused = pool.submit(httpx.post, f"{limited.ollama}/api/chat", content=bomb, headers={"Content-Encoding": encoding}, timeout=60)
        other = httpx.get(f"{limited.ollama}/api/version", timeout=30)
        response = refused.result()
        took = time.monotonic() - started
    assert other.status_code == 200
    assert response.status_code == 413 and "inflates to more than" in response.json()["error"], response.text
    assert took < 10, f"{took:.1f}s: the bomb was inflated past the limit"


@pytest.mark.parametrize(("path", "shape"), [("/api/chat", "ollama"), ("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")])
def test_a_raw_non_ascii_byte_in_the_target_is_refused_in_the_callers_shape(proxy: Proxy, path: str, shape: str) -> None:
    import socket

    host, port = proxy.ollama.removeprefix("http://").rsplit(":", 1)
    body = b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}]}'
    request = (b"POST " + path.encode() + b"?q=caf\xe9 HTTP/1.1\r\nHost: 127.0.0.1:" + port.encode()
               + b"\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    error = json.loads(content)
    if shape == "ollama":
        assert isinstance(error["error"], str) and "percent-encode" in error["error"]
    elif shape == "openai":
        assert error["error"]["code"] == "invalid_request" and "percent-encode" in error["error"]["message"]
    else:
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
