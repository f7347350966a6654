"""The fake llama-server against llamacpp.md: the overflow 400, consistent counts, the prefix cache
and the three stream formats, driven by the real openai client where one applies."""

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from support.common import FIXED_REPLY, RESPONSES_STREAM_EVENTS, Pacing, running
from support.fake_llamacpp import LlamaSettings, fake_llamacpp_app

N_CTX = 64
QUESTION = [{"role": "user", "content": "SECRET=kiwi What is the SECRET?"}]


@pytest.fixture
def url() -> Iterator[str]:
    with running(fake_llamacpp_app(LlamaSettings(model="fake-model", n_ctx=N_CTX))) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]


def words(n: int) -> str:
    return " w" * n


def test_counts_agree_across_endpoints(url: str, client: openai.OpenAI) -> None:
    body = {"messages": QUESTION}
    prompt = httpx.post(f"{url}/apply-template", json=body).json()["prompt"]
    tokens = httpx.post(f"{url}/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
    counted = httpx.post(f"{url}/v1/chat/completions/input_tokens", json=body).json()
    usage = client.chat.completions.create(model="any", messages=QUESTION).usage
    assert prompt == "<|im_start|>user\nSECRET=kiwi What is the SECRET?<|im_end|>\n<|im_start|>assistant\n"
    assert tokens[0] == 1  # BOS, from add_special only
    assert counted == {"input_tokens": len(tokens), "object": "response.input_tokens"}
    assert usage is not None and usage.prompt_tokens == len(tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_of_n_ctx_tokens_is_the_exact_400(url: str, stream: bool) -> None:
    response = httpx.post(f"{url}/completion", json={"prompt": words(N_CTX - 1), "stream": stream})
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json; charset=utf-8"
    assert response.text == (
        '{"error":{"code":400,"message":"request (64 tokens) exceeds the available context size (64 tokens), '
        'try increasing it","type":"exceed_context_size_error","n_prompt_tokens":64,"n_ctx":64}}'
    )


def test_a_prompt_of_n_ctx_minus_one_tokens_gets_one_token(url: str) -> None:
    response = httpx.post(f"{url}/v1/completions", json={"prompt": words(N_CTX - 2)}).json()
    assert response["usage"]["prompt_tokens"] == N_CTX - 1
    assert response["usage"]["completion_tokens"] == 1
    assert response["choices"][0]["finish_reason"] == "length"


def test_openai_client_sees_the_overflow_body(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": words(N_CTX)}])
    assert raised.value.body["type"] == "exceed_context_size_error"  # type: ignore[index]
    assert raised.value.body["n_ctx"] == N_CTX  # type: ignore[index]


def test_the_model_answers_the_secret_only_when_asked(client: openai.OpenAI) -> None:
    asked = client.chat.completions.create(model="any", messages=QUESTION)
    told = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "SECRET=kiwi"}])
    assert asked.choices[0].message.content == "The secret is kiwi."
    assert asked.choices[0].finish_reason == "stop"
    assert told.choices[0].message.content == FIXED_REPLY


def test_chat_stream_with_the_openai_client(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="any", messages=QUESTION, stream=True, stream_options={"include_usage": True}))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert deltas[0].role == "assistant" and deltas[0].content is None
    assert "".join(d.content or "" for d in deltas) == "The secret is kiwi."
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


def test_chat_stream_wire_format(url: str) -> None:
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": QUESTION, "stream": True})
    data = events(response)
    assert response.headers["content-type"] == "text/event-stream"
    assert data[-1] == "[DONE]"
    finish = json.loads(data[-2])
    assert finish["choices"][0]["delta"] == {} and "timings" in finish and "usage" not in finish


def test_native_stream_ends_without_done_marker(url: str) -> None:
    response = httpx.post(f"{url}/completion", json={"prompt": "SECRET=fig SECRET?", "stream": True})
    data = [json.loads(event) for event in events(response)]
    assert [event["content"] for event in data] == ["The", " secret", " is", " fig.", ""]
    assert [event["stop"] for event in data] == [False] * 4 + [True]
    assert data[-1]["stop_type"] == "eos" and data[-1]["tokens_predicted"] == 4


def test_text_completion_stream_carries_usage_on_the_final_chunk(url: str) -> None:
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "stream": True, "max_tokens": 2})
    data = events(response)
    final = json.loads(data[-2])
    assert data[-1] == "[DONE]"
    assert final["choices"][0] == {"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}
    assert final["usage"]["completion_tokens"] == 2


def test_prefix_cache_is_reported_per_slot(url: str) -> None:
    first = [{"role": "user", "content": "a b c d e f"}]
    second = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "g"}]
    httpx.post(f"{url}/v1/chat/completions", json={"messages": first})
    cached = httpx.post(f"{url}/v1/chat/completions", json={"messages": second}).json()
    uncached = httpx.post(f"{url}/v1/chat/completions", json={"messages": second, "cache_prompt": False}).json()
    shared = "<|im_start|>user\na b c d e f<|im_end|>\n<|im_start|>assistant"  # then "\n" vs "\nok"
    prefix = httpx.post(f"{url}/tokenize", json={"content": shared, "add_special": True}).json()["tokens"]
    timings = cached["timings"]
    assert timings["cache_n"] == len(prefix) == 13
    assert timings["cache_n"] + timings["prompt_n"] == cached["usage"]["prompt_tokens"]
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] == timings["cache_n"]
    assert uncached["timings"]["cache_n"] == 0


def test_each_slot_keeps_its_own_cache() -> None:
    red, blue = " red" * 12, " blue" * 12
    with running(fake_llamacpp_app(LlamaSettings(n_ctx=N_CTX, slots=2))) as url:
        for prompt in (red, blue, f"{red} more"):
            done = httpx.post(f"{url}/completion", json={"prompt": prompt, "n_predict": 1}).json()
    assert done["timings"]["cache_n"] == 13  # BOS and twelve words, from the slot that served red


def test_n_predict_below_minus_one_is_rejected(url: str) -> None:
    response = httpx.post(f"{url}/completion", json={"prompt": "hi", "n_predict": -2})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_window_is_reported_by_props_and_models(url: str) -> None:
    assert httpx.get(f"{url}/props").json()["default_generation_settings"]["n_ctx"] == N_CTX
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["meta"]["n_ctx"] == N_CTX
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_unknown_route_is_llama_servers_404(url: str) -> None:
    response = httpx.get(f"{url}/nowhere")
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}


def test_hang_before_the_first_token_sends_no_headers() -> None:
    with running(fake_llamacpp_app(LlamaSettings(pacing=Pacing(hang_after=0)))) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json={"messages": QUESTION, "stream": True}, timeout=0.5)


def test_hang_mid_stream_after_some_tokens() -> None:
    received: list[str] = []
    with running(fake_llamacpp_app(LlamaSettings(pacing=Pacing(hang_after=2)))) as url:
        body = {"prompt": "SECRET=fig SECRET?", "stream": True}
        with httpx.stream("POST", f"{url}/completion", json=body, timeout=0.5) as response:
            with pytest.raises(httpx.ReadTimeout):
                received.extend(line for line in response.iter_lines() if line)
    assert [json.loads(line.removeprefix("data: "))["content"] for line in received] == ["The", " secret"]


# --- OpenAI's Responses API (/v1/responses), to the real server's conversion and bytes ----------

ASKED = "SECRET=kiwi What is the SECRET?"


def responses_count(url: str, body: dict) -> int:
    counted = httpx.post(f"{url}/v1/responses/input_tokens", json=body)
    assert counted.status_code == 200, counted.text
    assert counted.json()["object"] == "response.input_tokens"
    return counted.json()["input_tokens"]


def chat_count(url: str, messages: list[dict]) -> int:
    return httpx.post(f"{url}/v1/chat/completions/input_tokens", json={"messages": messages}).json()["input_tokens"]


def test_responses_counts_what_the_chat_path_evaluates(url: str, client: openai.OpenAI) -> None:
    body = {"instructions": "Be brief.", "input": ASKED}
    response = client.responses.create(model="any", instructions="Be brief.", input=ASKED)
    counted = client.responses.input_tokens.count(model="any", instructions="Be brief.", input=ASKED)
    chat = chat_count(url, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASKED}])
    assert response.usage is not None
    assert responses_count(url, body) == counted.input_tokens == response.usage.input_tokens == chat
    assert httpx.post(f"{url}/responses/input_tokens", json=body).json()["input_tokens"] == chat  # also without /v1


def test_responses_input_items_convert_as_llama_server_does(url: str) -> None:
    """Messages of every role with string or part content, a function call and its output paired
    by call_id, and a reasoning item folded into the assistant turn; developer becomes system."""
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": "weather in Oslo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
    ]  # fmt: skip
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": ""},  # reasoning and the tool call: the fake renders neither
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "thanks"},
    ]
    assert responses_count(url, {"input": items}) == chat_count(url, chat)


def test_responses_tools_count_like_chat_tools(url: str) -> None:
    tool = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}
    chat_tool = {"type": "function", "function": {"strict": True, **{k: v for k, v in tool.items() if k != "type"}}}
    body = {"input": "hi", "tools": [tool, {"type": "web_search"}]}  # the non-function tool is skipped
    chat = httpx.post(
        f"{url}/v1/chat/completions/input_tokens", json={"messages": [{"role": "user", "content": "hi"}], "tools": [chat_tool]}
    ).json()["input_tokens"]
    assert responses_count(url, body) == chat


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "any"}, "'input' is required"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "llama.cpp does not support 'previous_response_id'."),
        ({"input": 5}, "'input' must be a string or array of objects"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "Cannot determine type of 'item'"),
        ({"input": [{"role": "assistant", "content": "shorthand, no type"}]}, "Cannot determine type of 'item'"),
        ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}]}, "item['content'] is not an array"),
        ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
         "'type' must be one of 'input_text', 'input_image', or 'input_file'"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "'input_file' is not supported by llamacpp at this moment"),
    ],
)  # fmt: skip
def test_responses_refuses_what_llama_server_refuses(url: str, body: dict, message: str) -> None:
    for path in ("/v1/responses", "/v1/responses/input_tokens"):
        response = httpx.post(f"{url}{path}", json=body)
        assert response.status_code == 400
        assert response.json() == {"error": {"code": 400, "message": message, "type": "invalid_request_error"}}


def test_responses_with_the_openai_client(client: openai.OpenAI) -> None:
    response = client.responses.create(model="any", input=ASKED, max_output_tokens=2)
    assert response.object == "response" and response.status == "completed"
    assert response.output_text == "The secret"
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage is not None and response.usage.output_tokens == 2
    assert response.usage.total_tokens == response.usage.input_tokens + 2
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert client.responses.create(model="any", input=ASKED).output_text == "The secret is kiwi."


def test_responses_stream_with_the_openai_client(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="any", input=ASKED, stream=True))
    assert [event.type for event in events] == RESPONSES_STREAM_EVENTS
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "The secret is kiwi."
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.output_text == "The secret is kiwi." and completed.response.status == "completed"
    assert completed.response.usage is not None and completed.response.usage.output_tokens == 4
    assert completed.model_extra is not None and "timings" in completed.model_extra  # beside the response
    # As the real server sends them: no sequence numbers, no output or content indices.
    assert {getattr(event, "sequence_number", None) for event in events} == {None}


def test_responses_stream_helper_fails_on_llama_servers_events(client: openai.OpenAI) -> None:
    """The real server's events lack ``content_index``, which the SDK's stream helper indexes by
    (seen on build 11434): ``client.responses.stream`` raises where iterating raw events works."""
    with pytest.raises(TypeError), client.responses.stream(model="any", input=ASKED) as stream:
        list(stream)


def test_responses_stream_wire_format(url: str) -> None:
    response = httpx.post(f"{url}/v1/responses", json={"input": ASKED, "stream": True})
    assert response.headers["content-type"] == "text/event-stream"
    records = [record for record in response.text.split("\n\n") if record]
    for record in records:
        name, data = record.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")
    created = json.loads(records[0].split("\n")[1].removeprefix("data: "))
    assert created["response"] == {"id": created["response"]["id"], "object": "response", "status": "in_progress"}
    assert "[DONE]" not in response.text


@pytest.mark.parametrize("stream", [False, True])
def test_responses_overflow_is_the_exact_400(client: openai.OpenAI, url: str, stream: bool) -> None:
    body = {"instructions": "Be brief.", "input": words(N_CTX)}
    n_prompt = responses_count(url, body)  # counting never refuses
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="any", stream=stream, **body)  # type: ignore[call-overload]
    assert raised.value.body == {
        "code": 400,
        "message": f"request ({n_prompt} tokens) exceeds the available context size ({N_CTX} tokens), try increasing it",
        "type": "exceed_context_size_error",
        "n_prompt_tokens": n_prompt,
        "n_ctx": N_CTX,
    }
