"""Each refusal in its client's own words, read by the real SDK clients through a real mitmdump in
front of the fake backends.

Clients tell an overflow from any other error in two ways: by a code (Codex reads OpenAI's
`context_length_exceeded`) or by the text (LiteLLM, aider, Cline and opencode match OpenAI's "This
model's maximum context length is N tokens", Claude Code "prompt is too long", opencode and LiteLLM
llama-server's "exceeds the available context size"). So every refusal carries its API's own
status, code and sentence with the numbers, and ContextPaw's own words only after it. When what an
agent sends on every turn (its instructions and tool definitions) is over the window by itself, no
compaction can help, and each refusal says which window would.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import ollama as ollama_client
import openai
import pytest

if TYPE_CHECKING:  # conftest is not importable by name when several test folders have one
    from conftest import Proxy

N_CTX = 1024
"""The fakes' window and the proxies' default window (conftest.py)."""
BACKENDS = ["ollama", "llamacpp"]

OPENAI_SENTENCE = re.compile(
    r"This model's maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
    r"\((\d+) in the messages, (\d+) in the completion\)\. Please reduce the length of the messages or completion\. ContextPaw: "
)
RESPONSES_SENTENCE = "Your input exceeds the context window of this model. Please adjust your input and try again. "
ANTHROPIC_SENTENCE = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")
LLAMA_SERVER_SENTENCE = re.compile(  # Ollama passes it on as its own
    r"request \((\d+) tokens\) exceeds the available context size \((\d+) tokens\), try increasing it; ContextPaw: "
)
FIXED_PART = re.compile(r"the agent's tools and instructions need (\d+) tokens; raise the window to at least (\d+)")


def notes() -> list[dict[str, str]]:
    """A chat far over the window, opened by a short task (the head stays small)."""
    chat = [{"role": "user", "content": "Keep the notes that follow."}]
    for i in range(8):
        chat.append({"role": "assistant" if i % 2 == 0 else "user", "content": f"note {i}: " + "lorem ipsum " * 150})
    chat.append({"role": "user", "content": "What was note 3 about?"})
    return chat


INSTRUCTIONS = "Follow every rule of the house style. " * 220
"""An agent's system prompt over the whole window by itself (about 1,800 tokens to the estimate)."""
READ_FILE = {
    "name": "read_file",
    "description": "Read a file of the project.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
"""The agent's one tool, written in each API's shape below."""


def openai_at(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)


def anthropic_at(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)


def openai_error(refused: pytest.ExceptionInfo[openai.BadRequestError], param: str) -> dict[str, Any]:
    """The error object, once its status, type, code and param are OpenAI's for an overlong prompt."""
    assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
    error = refused.value.response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    return error


def numbers_of(pattern: re.Pattern[str], message: str) -> tuple[int, int]:
    found = pattern.search(message)
    assert found, message
    return int(found[1]), int(found[2])


def openai_numbers(message: str, error: dict[str, Any]) -> tuple[int, int]:
    """OpenAI's sentence's window and messages' tokens; what it says was requested is the two it names."""
    found = OPENAI_SENTENCE.search(message)
    assert found, message
    window, requested, messages, room = (int(found[i]) for i in (1, 2, 3, 4))
    assert requested == messages + room > window and room == error["num_ctx"] - error["budget"], message
    return window, messages


# -- the overflow under strict, on every route -------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_openai_chat_refusal_is_openais_sentence_with_the_numbers(strict: Proxy, backend: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        openai_at(getattr(strict, backend)).chat.completions.create(model="fake", messages=notes(), max_tokens=16)
    error = openai_error(refused, "messages")
    assert OPENAI_SENTENCE.match(error["message"]), error["message"]
    assert openai_numbers(error["message"], error) == (error["num_ctx"], error["n_prompt_tokens"])
    assert error["n_prompt_tokens"] > error["budget"] and "policy strict" in error["message"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_openai_completions_refusal_is_openais_sentence_with_the_numbers(strict: Proxy, backend: str) -> None:
    prompt = "lorem ipsum " * 2000 + "What comes next?"
    with pytest.raises(openai.BadRequestError) as refused:
        openai_at(getattr(strict, backend)).completions.create(model="fake", prompt=prompt, max_tokens=16)
    error = openai_error(refused, "prompt")
    assert OPENAI_SENTENCE.match(error["message"]), error["message"]
    assert openai_numbers(error["message"], error) == (error["num_ctx"], error["n_prompt_tokens"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_responses_refusal_opens_with_the_responses_apis_own_sentence(strict: Proxy, backend: str) -> None:
    """OpenAI's Responses API says "Your input exceeds the context window of this model" beside
    `context_length_exceeded` (and no numbers); OpenAI's sentence with the numbers follows it."""
    with pytest.raises(openai.BadRequestError) as refused:
        openai_at(getattr(strict, backend)).responses.create(model="fake", input=notes(), max_output_tokens=16)
    error = openai_error(refused, "input")
    assert error["message"].startswith(RESPONSES_SENTENCE), error["message"]
    assert OPENAI_SENTENCE.match(error["message"].removeprefix(RESPONSES_SENTENCE)), error["message"]
    assert openai_numbers(error["message"], error) == (error["num_ctx"], error["n_prompt_tokens"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_anthropic_refusal_is_prompt_is_too_long_as_the_sdk_raises_it(strict: Proxy, backend: str) -> None:
    """The SDK raises `BadRequestError` (400, `invalid_request_error`), whose message Claude Code
    reads: "prompt is too long", then the two numbers."""
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_at(getattr(strict, backend)).messages.create(model="fake", max_tokens=16, messages=notes())
    assert refused.value.status_code == 400
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    needed, most = numbers_of(ANTHROPIC_SENTENCE, body["error"]["message"])
    assert ANTHROPIC_SENTENCE.fullmatch(body["error"]["message"]) and needed > most


@pytest.mark.parametrize("route", ["chat", "generate"])
def test_ollama_refusal_is_a_400_the_ollama_library_raises_once(strict: Proxy, route: str) -> None:
    """Ollama's own status for a prompt over its window, with llama-server's sentence (which Ollama
    passes on): the library raises `ResponseError` and sends nothing again."""
    calls: list[int] = []
    client = ollama_client.Client(host=strict.ollama, event_hooks={"request": [lambda request: calls.append(1)]})
    options = {"num_ctx": N_CTX, "num_predict": 16}
    with pytest.raises(ollama_client.ResponseError) as refused:
        if route == "chat":
            client.chat(model="fake", messages=notes(), options=options)
        else:
            client.generate(model="fake", prompt="lorem ipsum " * 2000, options=options)
    assert refused.value.status_code == 400 and len(calls) == 1
    needed, available = numbers_of(LLAMA_SERVER_SENTENCE, refused.value.error)
    assert needed > available and f"{N_CTX}-token" in refused.value.error


def test_llama_server_native_refusal_is_its_own_exceed_context_size_error(strict: Proxy) -> None:
    """llama-server has no SDK: its `/completion` clients read its own 400 and sentence."""
    body = {"prompt": "lorem ipsum " * 2000, "n_predict": 16}
    response = httpx.post(f"{strict.llamacpp}/completion", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["type"], error["n_ctx"]) == (400, "exceed_context_size_error", N_CTX)
    assert numbers_of(LLAMA_SERVER_SENTENCE, error["message"]) == (error["n_prompt_tokens"], error["budget"])


# -- what an agent sends on every turn does not fit ----------------------------------------------------


def fixed_part(message: str, window: int = N_CTX) -> tuple[int, int]:
    """The head's tokens and the least window, once both say the window is what must change."""
    head, least = numbers_of(FIXED_PART, message)
    assert head < least and least > window, message
    return head, least


@pytest.mark.parametrize("backend", BACKENDS)
def test_instructions_and_tools_over_the_window_say_what_window_they_need(proxy: Proxy, backend: str) -> None:
    """Compaction on, and still refused: the system prompt and tools alone are over the budget. Every
    API's refusal says so, after its own sentence, with the same two numbers."""
    url = getattr(proxy, backend)
    chat = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "say hi"}]
    said: list[tuple[int, int]] = []

    with pytest.raises(openai.BadRequestError) as chat_refused:
        openai_at(url).chat.completions.create(
            model="fake", messages=chat, tools=[{"type": "function", "function": READ_FILE}], max_tokens=16
        )
    message = openai_error(chat_refused, "messages")["message"]
    assert OPENAI_SENTENCE.match(message), message
    said.append(fixed_part(message))

    with pytest.raises(openai.BadRequestError) as responses_refused:
        openai_at(url).responses.create(
            model="fake",
            instructions=INSTRUCTIONS,
            input="say hi",
            tools=[{"type": "function", **READ_FILE}],
            max_output_tokens=16,
        )
    said.append(fixed_part(openai_error(responses_refused, "input")["message"]))

    with pytest.raises(anthropic.BadRequestError) as messages_refused:
        tool = {"name": READ_FILE["name"], "description": READ_FILE["description"], "input_schema": READ_FILE["parameters"]}
        anthropic_at(url).messages.create(model="fake", max_tokens=16, system=INSTRUCTIONS, messages=chat[1:], tools=[tool])
    message = messages_refused.value.body["error"]["message"]  # type: ignore[index]
    assert ANTHROPIC_SENTENCE.match(message), message
    said.append(fixed_part(message))

    if backend == "ollama":
        with pytest.raises(ollama_client.ResponseError) as native_refused:
            ollama_client.Client(host=url).chat(
                model="fake",
                messages=chat,
                tools=[{"type": "function", "function": READ_FILE}],
                options={"num_ctx": N_CTX, "num_predict": 16},
            )
        assert native_refused.value.status_code == 400 and LLAMA_SERVER_SENTENCE.match(native_refused.value.error)
        said.append(fixed_part(native_refused.value.error))
    heads = [head for head, _ in said]
    assert max(heads) - min(heads) < 64, f"the APIs disagree on what the same instructions need: {said}"
