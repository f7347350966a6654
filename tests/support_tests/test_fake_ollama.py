"""The fake Ollama against ollama.md §1 and §5: silent message- and token-level truncation with
the counts Ollama reports, the 400s, and the native and /v1 wire formats, driven by the real
ollama and openai clients.

Token arithmetic of the fake: a message costs 1 + its words, the generation prompt 1, BOS 1
(counted only at the runner level and in ``prompt_eval_count``).
"""

import json
import time
from collections.abc import Iterator

import httpx
import ollama
import openai
import pytest

from support.common import RESPONSES_STREAM_EVENTS, Pacing, running
from support.fake_ollama import OllamaSettings, fake_ollama_app

NUM_CTX = 64
MODEL = "fake"
QUESTION = "What is the SECRET?"


def filler(n: int) -> str:
    return " ".join(["w"] * n)


@pytest.fixture
def url() -> Iterator[str]:
    with running(fake_ollama_app(OllamaSettings(model=MODEL, num_ctx=NUM_CTX))) as base:
        yield base


@pytest.fixture
def client(url: str) -> ollama.Client:
    return ollama.Client(host=url)


def test_a_prompt_that_fits_is_counted_whole(client: ollama.Client) -> None:
    reply = client.chat(MODEL, [{"role": "system", "content": "SECRET=kiwi"}, {"role": "user", "content": QUESTION}])
    assert reply.message.content == "The secret is kiwi."
    assert reply.prompt_eval_count == 1 + 2 + 5 + 1  # BOS, system, user, generation prompt
    assert reply.done_reason == "stop" and reply.eval_count == 4


def test_message_level_truncation_drops_oldest_turns_and_moves_system_up(client: ollama.Client) -> None:
    messages = [
        {"role": "user", "content": f"SECRET=lost {filler(30)}"},
        {"role": "system", "content": "SECRET=kept"},
        {"role": "assistant", "content": filler(50)},
        {"role": "user", "content": f"{filler(10)} {QUESTION}"},
    ]
    reply = client.chat(MODEL, messages)
    # 32+2+51+15+1 tokens do not fit 64, nor 2+51+15+1 without the first turn; system+user+1 do
    assert reply.prompt_eval_count == 1 + 2 + 15 + 1
    assert reply.message.content == "The secret is kept."


def test_the_last_message_alone_gets_the_middle_cut(client: ollama.Client) -> None:
    reply = client.chat(MODEL, [{"role": "user", "content": f"{filler(3)} SECRET=kiwi {filler(200)} {QUESTION}"}])
    keep = 4 + 1  # num_keep plus BOS
    assert reply.prompt_eval_count == NUM_CTX - (NUM_CTX - keep) // 2 == 35
    assert reply.message.content == "I do not know the secret."


def test_the_cut_keeps_the_first_num_keep_tokens(client: ollama.Client) -> None:
    reply = client.chat(MODEL, [{"role": "user", "content": f"SECRET=head {filler(200)} {QUESTION}"}])
    assert reply.message.content == "The secret is head."  # BOS, <|user|>, SECRET=head are within keep


def test_num_keep_from_the_request_options(client: ollama.Client) -> None:
    options = {"num_keep": 0}
    reply = client.chat(MODEL, [{"role": "user", "content": f"SECRET=head {filler(200)} {QUESTION}"}], options=options)
    assert reply.prompt_eval_count == NUM_CTX - (NUM_CTX - 1) // 2
    assert reply.message.content == "I do not know the secret."


def test_truncate_false_is_the_llama_server_400_as_a_string(url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": filler(100)}], "truncate": False}
    response = httpx.post(f"{url}/api/chat", json=body)
    assert response.status_code == 400
    inner = json.loads(response.json()["error"])
    assert inner == {
        "error": {
            "code": 400,
            "message": "request (103 tokens) exceeds the available context size (64 tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 103,
            "n_ctx": 64,
        }
    }


def test_shift_false_refuses_with_ollamas_own_message(url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": filler(100)}], "shift": False}
    response = httpx.post(f"{url}/api/chat", json=body)
    assert response.status_code == 400
    assert response.json()["error"].startswith("the prompt is longer than the context length")


def test_native_mode_chat_is_a_400_and_v1_wraps_it() -> None:
    with running(fake_ollama_app(OllamaSettings(model=MODEL, num_ctx=NUM_CTX, native=True))) as url:
        messages = [{"role": "user", "content": filler(100)}]
        with pytest.raises(ollama.ResponseError) as native:
            ollama.Client(host=url).chat(MODEL, messages)
        with pytest.raises(openai.BadRequestError) as raised:
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
            )
    assert native.value.status_code == 400
    assert json.loads(native.value.error)["error"]["n_prompt_tokens"] == 103
    error = raised.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error"
    assert json.loads(error["message"])["error"]["type"] == "exceed_context_size_error"


def test_stream_is_ndjson_ending_with_the_metrics(url: str, client: ollama.Client) -> None:
    chunks = list(client.chat(MODEL, [{"role": "user", "content": f"SECRET=fig {QUESTION}"}], stream=True))
    assert "".join(c.message.content or "" for c in chunks) == "The secret is fig."
    assert [c.done for c in chunks] == [False] * 4 + [True]
    assert chunks[-1].prompt_eval_count == 1 + 6 + 1 and chunks[-1].eval_count == 4
    assert all(c.prompt_eval_count is None for c in chunks[:-1])
    raw = httpx.post(f"{url}/api/chat", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert raw.headers["content-type"] == "application/x-ndjson"
    assert all(json.loads(line)["model"] == MODEL for line in raw.text.splitlines())


def test_raw_generate_loses_text_right_after_the_head(client: ollama.Client) -> None:
    reply = client.generate(MODEL, f"SECRET=a {filler(5)} SECRET=b {filler(200)} SECRET?", raw=True)
    assert reply.response == "The secret is a."  # SECRET=b sat just after the kept head
    assert reply.prompt_eval_count == 35 and reply.context is None


def test_generate_goes_through_the_template_and_returns_context(client: ollama.Client) -> None:
    reply = client.generate(MODEL, QUESTION, system="SECRET=sys")
    assert reply.response == "The secret is sys."
    assert reply.prompt_eval_count == 1 + 2 + 5 + 1
    # the prompt as rendered, then the reply: its first word runs into "<|assistant|>"
    assert reply.context is not None and len(reply.context) == 2 + 5 + 1 + 4 - 1


def test_load_ps_and_unload(client: ollama.Client) -> None:
    loaded = client.generate(MODEL, "", options={"num_ctx": 48})
    listed = client.ps().models
    unloaded = client.generate(MODEL, "", keep_alive=0)
    still_listed = client.ps().models
    time.sleep(0.2)
    assert loaded.done_reason == "load" and unloaded.done_reason == "unload"
    assert [m.context_length for m in listed] == [48]
    assert [m.name for m in still_listed] == ["fake:latest"]
    assert client.ps().models == []


def test_num_ctx_is_capped_to_the_trained_length() -> None:
    with running(fake_ollama_app(OllamaSettings(model=MODEL), train_ctx=128)) as url:
        client = ollama.Client(host=url)
        client.chat(MODEL, [{"role": "user", "content": "hi"}], options={"num_ctx": 100_000})
        assert [m.context_length for m in client.ps().models] == [128]


def test_a_unitless_keep_alive_is_gos_400(url: str) -> None:
    response = httpx.post(f"{url}/api/generate", json={"model": MODEL, "prompt": "hi", "keep_alive": "10"})
    assert response.status_code == 400
    assert response.json() == {"error": 'time: missing unit in duration "10"'}


def test_unknown_model_is_404(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat("other", [{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 404 and raised.value.error == "model 'other' not found"


def test_v1_chat_uses_the_default_window_and_reports_usage(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": f"{filler(3)} SECRET=kiwi {filler(200)} {QUESTION}"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},  # type: ignore[arg-type]
        )
    )
    assert whole.usage is not None and whole.usage.prompt_tokens == 35  # silently cut, like /api/chat
    assert whole.choices[0].message.content == "I do not know the secret."
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage == whole.usage


def test_v1_completions(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    whole = client.completions.create(model=MODEL, prompt=f"SECRET=kiwi {QUESTION}", max_tokens=2)
    streamed = list(client.completions.create(model=MODEL, prompt="hello", stream=True))
    assert whole.choices[0].text == "The secret" and whole.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in streamed) == "Hello from the fake model."


def test_informational_routes(url: str, client: ollama.Client) -> None:
    root = httpx.get(f"{url}/")
    assert (root.status_code, root.text) == (200, "Ollama is running")
    assert httpx.get(f"{url}/api/version").json() == {"version": "0.33.0-rc2"}
    assert client.list().models[0].model == "fake:latest"
    assert client.show(MODEL).modelinfo == {
        "general.architecture": "llama",
        "general.parameter_count": 1_000_000,
        "llama.context_length": 32768,
        "llama.embedding_length": 64,
    }
    assert (httpx.get(f"{url}/nowhere").text, httpx.get(f"{url}/api/chat").text) == (
        "404 page not found",
        "405 method not allowed",
    )


def test_hang_mid_stream() -> None:
    received: list[str] = []
    with running(fake_ollama_app(OllamaSettings(model=MODEL, pacing=Pacing(hang_after=1)))) as url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=0.5) as response:
            with pytest.raises(httpx.ReadTimeout):
                received.extend(response.iter_lines())
    assert [json.loads(line)["message"]["content"] for line in received] == ["Hello"]


# --- OpenAI's Responses API (/v1/responses), as Ollama serves it (v0.13.3+) --------------------

ASKED = f"SECRET=kiwi {QUESTION}"
LONG = f"{filler(3)} SECRET=kiwi {filler(200)} {QUESTION}"  # 208 tokens in a 64-token window


@pytest.fixture
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def last(url: str) -> dict:
    return httpx.get(f"{url}/_fake/last").json()


def test_responses_with_the_openai_client(oai: openai.OpenAI, url: str) -> None:
    response = oai.responses.create(model=MODEL, instructions="Be brief.", input=ASKED, temperature=0)
    assert response.object == "response" and response.status == "completed" and response.model == MODEL
    assert response.output_text == "The secret is kiwi."
    assert response.instructions == "Be brief." and response.truncation == "disabled" and response.store is False
    assert response.usage is not None and response.usage.output_tokens == 4
    assert response.usage.input_tokens == 1 + 3 + 6 + 1 == last(url)["kept_tokens"]  # BOS, two messages, prompt
    assert last(url)["cut"] is False


def test_responses_stream_with_the_openai_client(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model=MODEL, input=ASKED, stream=True))
    assert [e.type for e in events] == RESPONSES_STREAM_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.output_text == "The secret is kiwi."
    assert completed.response.usage is not None and completed.response.usage.input_tokens == 1 + 6 + 1


def test_responses_stream_helper_accumulates_ollamas_events(oai: openai.OpenAI) -> None:
    with oai.responses.stream(model=MODEL, input=ASKED) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "The secret is kiwi."


def test_responses_stream_wire_format_is_gos(url: str) -> None:
    response = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": ASKED, "stream": True})
    assert response.headers["content-type"] == "text/event-stream"
    records = [record for record in response.text.split("\n\n") if record]
    for record in records:
        name, data = record.split("\n")
        keys = list(json.loads(data.removeprefix("data: ")))
        assert keys == sorted(keys)  # Go marshals the event maps with their keys sorted
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")
    assert "[DONE]" not in response.text


@pytest.mark.parametrize("stream", [False, True])
def test_responses_overflow_is_cut_in_silence(oai: openai.OpenAI, url: str, stream: bool) -> None:
    """No options get through, so not even num_ctx: the default window, and the middle cut."""
    extra = {"options": {"num_ctx": 4096}}  # not a field of Ollama's Responses request: dropped unread
    if stream:
        events = list(oai.responses.create(model=MODEL, input=LONG, stream=True, extra_body=extra))
        assert events[-1].type == "response.completed"
        response = events[-1].response
    else:
        response = oai.responses.create(model=MODEL, input=LONG, extra_body=extra)
    assert response.status == "completed" and response.output_text == "I do not know the secret."
    assert last(url) == {"cut": True, "sent_tokens": 1 + 1 + 208 + 1, "kept_tokens": 35, "num_ctx": NUM_CTX}
    assert response.usage is not None and response.usage.input_tokens == 35  # counted after the cut


def test_responses_input_items_render_as_chat_messages(oai: openai.OpenAI, url: str) -> None:
    """Message items of each role, a function call merged into the assistant turn before it, its
    output as a tool message, a reasoning item (its encrypted_content the next turn's thinking)."""
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": "weather in Oslo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "look it up"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sunny"}]},
    ]
    chat = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]  # fmt: skip
    response = oai.responses.create(model=MODEL, input=items)  # type: ignore[arg-type]
    completion = oai.chat.completions.create(model=MODEL, messages=chat)  # type: ignore[arg-type]
    assert response.usage is not None and completion.usage is not None
    assert response.usage.input_tokens == completion.usage.prompt_tokens


def test_responses_is_stateless_and_ignores_previous_response_id(oai: openai.OpenAI) -> None:
    """``previous_response_id`` is not a field of Ollama's request type, so Go drops it: the
    request runs on its own input, with no 400 and no trace of the missing history."""
    alone = oai.responses.create(model=MODEL, input=ASKED)
    chained = oai.responses.create(model=MODEL, input=ASKED, previous_response_id=alone.id)
    assert chained.status == "completed" and chained.previous_response_id is None
    assert chained.usage is not None and alone.usage is not None
    assert chained.usage.input_tokens == alone.usage.input_tokens


def test_responses_errors_are_openais(oai: openai.OpenAI, url: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        oai.responses.create(model=MODEL, input=[{"type": "web_search_call", "id": "ws_1"}])  # type: ignore[list-item]
    assert raised.value.body == {
        "message": 'input[0]: unknown input item type: "web_search_call"',
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="other", input="hi")
    counted = httpx.post(f"{url}/v1/responses/input_tokens", json={"model": MODEL, "input": "hi"})
    assert (counted.status_code, counted.text) == (404, "404 page not found")  # Ollama has no count route
