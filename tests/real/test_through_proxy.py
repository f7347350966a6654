"""The proof end to end: real clients, mitmdump with the ContextPaw addon, a real llama-server with
SmolLM2-135M, directly and under the Ollama simulator.

- Ollama cuts the front of an overflowing chat and answers 200 without the planted secret; through
  ContextPaw the middle goes instead, the report says so, and the secret comes back.
- llama-server refuses the same overflow with a 400; through ContextPaw the request is compacted to
  the window the 400 named, retried once, and answered, streamed or not.
- An agent chat with tool calls, compacted, still renders through a strict chat template.
- A request that fits passes through as it was: the same answer and the same token counts.

The model is tiny: recall is asserted with :func:`~support.proof.recalled` (the secret's
number) and only on the path through ContextPaw; the direct Ollama path must not hold the secret,
which no model can guess once it is cut.
"""

import json
import random
from typing import Any

import httpx
import ollama
import openai
import pytest

from support.backends import Backend
from support.proof import (
    FILLER,
    GREEDY_TOKENS,
    completion_trial,
    make_secret,
    needle_chat,
    openai_trial,
    recalled,
    rendered_prompt,
)

pytestmark = pytest.mark.real

NUM_CTX = 1024
"""The window of both paths: Ollama's `num_ctx` here, the small llama-server's slot (conftest)."""
FILLER_LINES = 150  # about 1,800 tokens: well over the window, secret cut by Ollama's truncation
GREEDY = {"temperature": 0, "num_predict": GREEDY_TOKENS, "num_ctx": NUM_CTX}


@pytest.fixture(scope="module")
def needle() -> tuple[str, list[dict[str, Any]]]:
    rng = random.Random(1234)
    secret = make_secret(rng)
    return secret, needle_chat(secret, FILLER_LINES, rng)


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def assert_compacted_within_budget(report: dict[str, Any] | None) -> None:
    assert report is not None, "no contextpaw report in the response"
    assert report["compacted"] is True
    assert report["final_tokens"] <= report["budget"] < report["original_tokens"], json.dumps(report)
    assert report["evicted_tokens"] > 0 and report["markers"]


# -- Ollama: the silent cut -------------------------------------------------------------------------


def test_ollama_direct_cuts_the_secret_silently(ollama_sim: str, sim_model: str, needle: tuple) -> None:
    secret, messages = needle
    reply = ollama.Client(host=ollama_sim).chat(sim_model, messages, options=GREEDY)
    assert reply.done_reason in ("stop", "length")
    assert reply.prompt_eval_count is not None and reply.prompt_eval_count <= NUM_CTX
    assert secret.split("-")[1] not in (reply.message.content or "")


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_ollama_through_contextpaw_recalls_the_secret(sim_proxy: str, sim_model: str, needle: tuple, stream: bool) -> None:
    secret, messages = needle
    client = ollama.Client(host=sim_proxy)
    if stream:
        chunks = list(client.chat(sim_model, messages, options=GREEDY, stream=True))
        assert chunks[-1].done and not any(c.done for c in chunks[:-1])
        answer, prompt_tokens = "".join(c.message.content or "" for c in chunks), chunks[-1].prompt_eval_count
    else:
        reply = client.chat(sim_model, messages, options=GREEDY)
        answer, prompt_tokens = reply.message.content or "", reply.prompt_eval_count
    assert prompt_tokens is not None and prompt_tokens < NUM_CTX
    assert recalled(secret, answer), answer


def test_ollama_through_contextpaw_reports_the_compaction(sim_proxy: str, sim_model: str, needle: tuple) -> None:
    secret, messages = needle
    body = {"model": sim_model, "messages": messages, "stream": False, "options": GREEDY}
    reply = httpx.post(f"{sim_proxy}/api/chat", json=body, timeout=300)
    assert reply.status_code == 200
    data = reply.json()
    report = data["contextpaw"]
    assert_compacted_within_budget(report)
    assert report["window"] == NUM_CTX and report["recovered_from_upstream_400"] is False
    assert data["prompt_eval_count"] <= report["budget"]  # the server's count of the compacted prompt
    assert reply.headers["X-ContextPaw-Compacted"] == "true"
    assert int(reply.headers["X-ContextPaw-Final-Tokens"]) <= int(reply.headers["X-ContextPaw-Budget"])
    assert int(reply.headers["X-ContextPaw-Evicted-Tokens"]) == report["evicted_tokens"]
    assert recalled(secret, data["message"]["content"]), data["message"]["content"]


def test_ollama_stream_through_contextpaw_ends_with_the_report(sim_proxy: str, sim_model: str, needle: tuple) -> None:
    _, messages = needle
    body = {"model": sim_model, "messages": messages, "stream": True, "options": GREEDY}
    with httpx.stream("POST", f"{sim_proxy}/api/chat", json=body, timeout=300) as reply:
        assert reply.status_code == 200 and reply.headers["X-ContextPaw-Compacted"] == "true"
        records = [json.loads(line) for line in reply.iter_lines() if line.strip()]
    assert records[-1]["done"] is True
    assert [i for i, r in enumerate(records) if "contextpaw" in r] == [len(records) - 1]
    assert_compacted_within_budget(records[-1]["contextpaw"])


# -- llama-server: the 400 ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_llama_server_direct_refuses_with_a_400(small_llama_server: Backend, needle: tuple, stream: bool) -> None:
    _, messages = needle
    with pytest.raises(openai.BadRequestError) as refused:
        client = openai_client(small_llama_server.url)
        client.chat.completions.create(model="smollm2", messages=messages, max_tokens=GREEDY_TOKENS, stream=stream)
    error = refused.value.body
    assert isinstance(error, dict) and error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == NUM_CTX < error["n_prompt_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize("how", ["window discovered", "rescued from the 400"])
def test_llama_server_through_contextpaw_answers_the_overflow(
    llama_proxy: str, rescue_proxy: str, needle: tuple, how: str, stream: bool
) -> None:
    """With the window from /props the overflow is compacted before it is sent; without it, the
    request goes out, llama-server's 400 names the window, and ContextPaw retries once, compacted."""
    secret, messages = needle
    rescued = how == "rescued from the 400"
    proxy = rescue_proxy if rescued else llama_proxy
    trial = openai_trial(openai_client(proxy), "ContextPaw", secret, messages, stream=stream)
    assert trial.status == 200, trial.answer
    assert_compacted_within_budget(trial.report)
    assert trial.report and trial.report["window"] == NUM_CTX
    assert trial.report["recovered_from_upstream_400"] is rescued
    assert trial.prompt_tokens is not None and trial.prompt_tokens <= trial.report["budget"]
    assert trial.headers["x-contextpaw-compacted"] == "true"
    assert (trial.headers.get("x-contextpaw-recovered") == "upstream-400") is rescued
    assert trial.recalled, trial.answer


def test_llama_server_completion_through_contextpaw_answers_the_overflow(
    small_llama_server: Backend, llama_proxy: str, needle: tuple
) -> None:
    """A raw prompt on the native /completion route: cut head+tail, answered."""
    secret, messages = needle
    prompt = rendered_prompt(small_llama_server.url, messages)
    direct = completion_trial(small_llama_server.url, "direct", secret, prompt)
    through = completion_trial(llama_proxy, "ContextPaw", secret, prompt)
    assert direct.status == 400 and direct.answer.startswith("exceed_context_size_error")
    assert through.status == 200, through.answer
    assert_compacted_within_budget(through.report)
    assert through.report and through.report["strategy"] == "head_tail"
    assert through.prompt_tokens is not None and through.prompt_tokens <= through.report["budget"]
    assert through.recalled, through.answer


# -- the strict template: markers that render ---------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file from the workspace.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]


def agent_chat(secret: str, rng: random.Random) -> list[dict[str, Any]]:
    """An agent loop: a task, three file reads with big outputs, a reply, a follow-up and one more
    read whose output is the newest message. Every hole compaction can make lies between two
    different roles."""

    def call(n: int) -> dict[str, Any]:
        arguments = json.dumps({"path": f"logs/build-{n}.log"})
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call_{n}", "type": "function", "function": {"name": "read_file", "arguments": arguments}}
        ]}  # fmt: skip

    def result(n: int, lines: int) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": f"call_{n}", "content": "\n".join(rng.choice(FILLER) for _ in range(lines))}

    return [
        {"role": "system", "content": "You are a coding agent. Use the tools to inspect the workspace."},
        {"role": "user", "content": f"Remember this password: {secret}. Then check the build logs."},
        call(1), result(1, 60),
        call(2), result(2, 40),
        {"role": "assistant", "content": "The first two logs are clean. Shall I read the third one?"},
        {"role": "user", "content": "Yes, read it."},
        call(3), result(3, 70),
        {"role": "user", "content": "What is the password I asked you to remember?"},
    ]  # fmt: skip


def test_the_strict_template_refuses_what_breaks_its_rules(small_llama_server: Backend) -> None:
    """The check below means something: this server's template raises on a misplaced message."""
    broken = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    reply = httpx.post(f"{small_llama_server.url}/apply-template", json={"messages": broken})
    assert reply.status_code == 400 and "roles must alternate" in reply.text


def test_a_compacted_agent_chat_renders_through_the_strict_template(small_llama_server: Backend, llama_proxy: str) -> None:
    rng = random.Random(99)
    secret = make_secret(rng)
    messages = agent_chat(secret, rng)
    rendered = httpx.post(f"{small_llama_server.url}/apply-template", json={"messages": messages, "tools": TOOLS})
    assert rendered.status_code == 200, rendered.text  # the original is valid for the template

    direct = openai_trial(openai_client(small_llama_server.url), "direct", secret, messages, tools=TOOLS)
    assert direct.status == 400 and direct.answer.startswith("exceed_context_size_error")

    through = openai_trial(openai_client(llama_proxy), "ContextPaw", secret, messages, tools=TOOLS)
    assert through.status == 200, through.answer  # a template error would be a 400 "Jinja Exception"
    assert_compacted_within_budget(through.report)
    assert through.report and {r["action"] for r in through.report["removals"]} & {"dropped", "shrunk"}
    assert through.prompt_tokens is not None and through.prompt_tokens <= through.report["budget"]


# -- pass-through -------------------------------------------------------------------------------------

FITTING = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": "Remember this password: COBALT-4321. What is the password?"},
]


def test_a_fitting_chat_passes_through_llama_server_unchanged(small_llama_server: Backend, llama_proxy: str) -> None:
    """Same answer and usage as direct; prompt caching is off so both runs compute the same way."""
    answers = []
    for base_url in (small_llama_server.url, llama_proxy):
        raw = openai_client(base_url).chat.completions.with_raw_response.create(
            model="smollm2", messages=FITTING, max_tokens=GREEDY_TOKENS, temperature=0,  # type: ignore[arg-type]
            extra_body={"cache_prompt": False},
        )  # fmt: skip
        answers.append((raw, raw.parse()))
    (_, direct), (raw, through) = answers
    assert through.choices[0].message.content == direct.choices[0].message.content
    assert through.usage is not None and direct.usage is not None
    assert (through.usage.prompt_tokens, through.usage.completion_tokens) == (
        direct.usage.prompt_tokens, direct.usage.completion_tokens,
    )  # fmt: skip
    report = (through.model_extra or {})["contextpaw"]
    assert report["compacted"] is False and report["strategy"] == "none" and report["removals"] == []
    assert raw.headers["X-ContextPaw-Compacted"] == "false"
    assert "contextpaw" not in (direct.model_extra or {})


def test_a_fitting_chat_passes_through_ollama_unchanged(ollama_sim: str, sim_proxy: str, sim_model: str) -> None:
    """Same answer and counts as direct. The simulator always reuses its prompt cache, so a first call
    warms it and the two compared calls then reuse the same prefix."""
    options = {"temperature": 0, "num_predict": GREEDY_TOKENS, "num_ctx": NUM_CTX}
    ollama.Client(host=ollama_sim).chat(sim_model, FITTING, options=options)
    direct, through = (ollama.Client(host=url).chat(sim_model, FITTING, options=options) for url in (ollama_sim, sim_proxy))
    assert through.message.content == direct.message.content
    assert (through.prompt_eval_count, through.eval_count, through.done_reason) == (
        direct.prompt_eval_count, direct.eval_count, direct.done_reason,
    )  # fmt: skip
    body = {"model": sim_model, "messages": FITTING, "stream": False, "options": options}
    reply = httpx.post(f"{sim_proxy}/api/chat", json=body, timeout=300)
    assert reply.headers["X-ContextPaw-Compacted"] == "false"
    assert reply.json()["contextpaw"]["compacted"] is False
