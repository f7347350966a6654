"""What the client is told of a cut, on every path: a real mitmdump with ContextPaw in front of the
fake Ollama (which cuts in silence and records it) and the fake llama-server, under policy off,
buffered and streamed (NDJSON and SSE), with real clients where agents use them (the `openai` SDK).

- The verdict is of what was sent (policy off: the client's own request, not the compaction that was
  computed but not sent), and a text has at least as many tokens as words: 5,800 words into a
  2,048-token window is a certain cut, not a possible one.
- A possible cut reaches the client on every path: its own header on a buffered answer, and the
  report in the body or in the stream's final record.
- A streamed OpenAI chat is asked for its usage where the client did not ask, judged by it, and the
  client gets the stream it asked for: no usage chunk, llama-server's `timings` where they would be.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from support.backends import Backend, start_module, start_proxy

WINDOW = 2048
"""The fake Ollama's window for requests that name none; ContextPaw learns it."""
WORDS = ("alpha", "beta", "gamma", "delta", "result", "value")
SECRET = "The SECRET is kiwi. Answer in one short sentence."
QUESTION = "What is the SECRET?"


def prose(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def notes(total_words: int, messages: int = 22) -> list[dict[str, Any]]:
    """The issue's chat: a system prompt, then notes and acknowledgements, then the question."""
    each = total_words // (messages // 2)
    chat: list[dict[str, Any]] = []
    for i in range(messages // 2):
        chat += [{"role": "user", "content": f"Note {i}: {prose(each, i)}"}, {"role": "assistant", "content": "Noted."}]
    return chat + [{"role": "user", "content": QUESTION}]


def request(route: str, total_words: int, stream: bool) -> dict[str, Any]:
    """The chat in the route's own shape."""
    chat = notes(total_words)
    if route == "/v1/messages":
        return {"model": "fake", "stream": stream, "system": SECRET, "messages": chat, "max_tokens": 8}
    if route == "/v1/responses":
        role = {"user": "input_text", "assistant": "output_text"}
        items = [{"type": "message", "role": m["role"], "content": [{"type": role[m["role"]], "text": m["content"]}]} for m in chat]
        return {"model": "fake", "stream": stream, "instructions": SECRET, "input": items, "max_output_tokens": 8}
    extra = {"max_tokens": 8} if route.startswith("/v1") else {"options": {"num_predict": 8}}
    return {"model": "fake", "stream": stream, "messages": [{"role": "system", "content": SECRET}, *chat]} | extra


def records(text: str) -> list[dict[str, Any]]:
    """Every JSON record of an answer: a buffered body, NDJSON lines or SSE `data:` events."""
    out = []
    for line in text.splitlines():
        line = line.strip().removeprefix("data:").strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def told(response: httpx.Response) -> dict[str, Any]:
    """The report the client received (in the body, or the stream's last record that has one)."""
    reports = [r["contextpaw"] for r in records(response.text) if "contextpaw" in r]
    assert reports, f"no report reached the client: {response.text[-400:]}"
    return reports[-1]


@pytest.fixture(scope="module")
def cutting(workdir: Path) -> Iterator[Backend]:
    args = ["--n-ctx", str(WINDOW), "--train-ctx", str(4 * WINDOW), "--model", "fake"]
    with start_module("support.fake_ollama", args, "/", workdir / "told-ollama.log") as backend:
        yield backend


@pytest.fixture(scope="module")
def llama(workdir: Path) -> Iterator[Backend]:
    with start_module("support.fake_llamacpp", ["--n-ctx", "4096"], "/health", workdir / "told-llama.log") as backend:
        yield backend


def proxy(workdir: Path, backend: Backend, name: str, policy: str) -> Backend:
    options = [f"contextpaw_policy={policy}", f"contextpaw_state_dir={workdir / name}", "contextpaw_calibrate=false"]
    return start_proxy(backend.url, workdir / "conf", workdir / f"{name}.log", options=options)


@pytest.fixture(scope="module")
def off(workdir: Path, cutting: Backend) -> Iterator[Backend]:
    with proxy(workdir, cutting, "told-off", "off") as running:
        yield running


@pytest.fixture(scope="module")
def llama_off(workdir: Path, llama: Backend) -> Iterator[Backend]:
    with proxy(workdir, llama, "told-llama-off", "off") as running:
        yield running


def last_cut(backend: Backend) -> dict[str, Any]:
    return httpx.get(f"{backend.url}/_fake/last", timeout=10).json()


ROUTES = ["/api/chat", "/v1/chat/completions", "/v1/messages", "/v1/responses"]


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize("route", ROUTES)
def test_under_policy_off_more_words_than_the_window_holds_is_told_as_a_certain_cut(
    off: Backend, cutting: Backend, route: str, stream: bool
) -> None:
    """5,800 words into a 2,048-token window: the server cut it, and whatever our estimate says, at
    least 5,800 tokens were sent. The client is told it was cut, never only that it may have been."""
    response = httpx.post(off.url + route, json=request(route, 5800, stream), timeout=60)
    assert response.status_code == 200
    assert last_cut(cutting)["cut"]
    report = told(response)
    cut = report.get("upstream_truncated")
    assert cut is not None and "upstream_truncation_possible" not in report, report
    assert cut["sent_tokens"] >= 5800 > WINDOW >= cut["evaluated_tokens"]
    assert not report["compacted"] and report["final_tokens"] == report["original_tokens"] == cut["sent_tokens"]
    if not stream:
        evaluated, _, sent = response.headers["X-ContextPaw-Upstream-Truncated"].split()[:3]
        assert int(evaluated) <= int(sent)


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize("route", ROUTES)
def test_under_policy_off_a_possible_cut_reaches_the_client_on_every_path(off: Backend, cutting: Backend, route: str, stream: bool) -> None:
    """1,500 words: the byte estimate allows more than the window, the words do not prove it, and
    the server's count does not tell. The client hears "possible": in its header when buffered, in
    the report in the body or the stream's final record, never only in ContextPaw's own counter."""
    response = httpx.post(off.url + route, json=request(route, 1500, stream), timeout=60)
    assert response.status_code == 200
    assert not last_cut(cutting)["cut"]
    report = told(response)
    possible = report.get("upstream_truncation_possible")
    assert possible is not None and "upstream_truncated" not in report, report
    assert possible["sent_tokens"] >= possible["evaluated_tokens"]
    if not stream:
        assert response.headers["X-ContextPaw-Upstream-Truncation-Possible"].startswith("possibly: ")
    assert "X-ContextPaw-Upstream-Truncated" not in response.headers


def tool_dump(results: int, words: int) -> list[dict[str, Any]]:
    """An agent's chat whose bulk is tool results: the words of what the user wrote prove little."""
    chat: list[dict[str, Any]] = [{"role": "system", "content": SECRET}, {"role": "user", "content": "Read the files."}]
    for i in range(results):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "read", "arguments": json.dumps({"n": i})}}
        chat += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": f"call_{i}", "content": prose(words, 100 + i)}]  # fmt: skip
    return chat + [{"role": "user", "content": QUESTION}]


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)


def test_a_stream_whose_client_did_not_ask_for_usage_is_judged_by_it_and_gets_none(off: Backend, cutting: Backend) -> None:
    """The openai SDK streams without `include_usage`: ContextPaw asks for it, the server's count
    proves the cut (tool results are no word floor's), and the client gets no usage chunk."""
    chunks = list(sdk(off.url).chat.completions.create(model="fake", messages=tool_dump(6, 600), max_tokens=8, stream=True))  # type: ignore[arg-type]
    assert last_cut(cutting)["cut"]
    assert all(chunk.usage is None and chunk.choices for chunk in chunks), "a usage chunk the client did not ask for"
    reports = [c.model_extra["contextpaw"] for c in chunks if c.model_extra and "contextpaw" in c.model_extra]
    assert len(reports) == 1
    cut = reports[0].get("upstream_truncated") or reports[0].get("upstream_truncation_possible")
    assert cut is not None and 0 < cut["evaluated_tokens"] <= WINDOW, "judged by the count the usage chunk carried"
    assert chunks[-1].choices[0].finish_reason is not None and "contextpaw" in (chunks[-1].model_extra or {})


def test_a_text_completion_stream_whose_client_did_not_ask_for_usage_is_judged_by_it_and_gets_none(off: Backend, cutting: Backend) -> None:
    """Ollama's `/v1/completions` streams the usage only when asked, and then puts a zero `usage` on
    every chunk: ContextPaw asks, judges the cut by the usage chunk's count, and the openai SDK's
    client, which did not ask, gets chunks without any usage and the report on the last one."""
    prompt = f"{SECRET}\n{prose(5800, 7)}\n{QUESTION}"
    chunks = list(sdk(off.url).completions.create(model="fake", prompt=prompt, max_tokens=8, stream=True))
    assert last_cut(cutting)["cut"]
    assert all(chunk.usage is None and chunk.choices for chunk in chunks), "usage the client did not ask for"
    reports = [c.model_extra["contextpaw"] for c in chunks if c.model_extra and "contextpaw" in c.model_extra]
    assert len(reports) == 1 and "contextpaw" in (chunks[-1].model_extra or {})
    cut = reports[0].get("upstream_truncated")
    assert cut is not None and 0 < cut["evaluated_tokens"] <= WINDOW < 5800 <= cut["sent_tokens"], reports[0]


def test_a_client_that_asked_for_usage_keeps_its_usage_chunk_with_the_report(off: Backend, cutting: Backend) -> None:
    stream = sdk(off.url).chat.completions.create(
        model="fake",
        messages=tool_dump(6, 600),
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    )
    chunks = list(stream)
    assert last_cut(cutting)["cut"]
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0] is chunks[-1] and not usage[0].choices
    report = usage[0].model_extra["contextpaw"]
    cut = report.get("upstream_truncated") or report.get("upstream_truncation_possible")
    assert cut is not None and cut["evaluated_tokens"] == usage[0].usage.prompt_tokens


def shape(chunks: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What a stream is made of, without its ids, times and report."""
    return [
        (len(c.get("choices") or []), "usage" in c, "timings" in c, [ch.get("finish_reason") for ch in c.get("choices") or []])
        for c in chunks
    ]


def test_llama_servers_stream_reaches_a_client_that_did_not_ask_for_usage_as_it_would_without_contextpaw(
    llama_off: Backend, llama: Backend
) -> None:
    """llama-server puts `timings` on the last event: on the finish chunk without `include_usage`,
    on the usage chunk with it. ContextPaw asked for it, so the timings go back where they were."""
    body = {"model": "fake", "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": prose(200, 7)}]}
    direct = records(httpx.post(llama.url + "/v1/chat/completions", json=body, timeout=60).text)
    through = records(httpx.post(llama_off.url + "/v1/chat/completions", json=body, timeout=60).text)
    assert shape(through) == shape(direct) and direct[-1].get("timings")
    assert set(through[-1]["timings"]) == set(direct[-1]["timings"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
