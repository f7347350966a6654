"""The Ollama simulator over a real llama-server with SmolLM2-135M: what current Ollama does to an
overflowing prompt, shown with a real model and the real ollama client.

A secret planted at the start is recalled while everything fits, and is silently gone (HTTP 200,
a plausible answer, ``prompt_eval_count`` within num_ctx) once Ollama truncates; only
``truncate: false`` makes the overflow visible.
"""

import json
import time
from typing import Any

import httpx
import ollama
import openai
import pytest

from support.backends import Backend

pytestmark = pytest.mark.real

SECRET = "The secret password is PELICAN."
FILLER = "The weather report said the day would be mild and calm. "
QUESTION = "What is the secret password?"
GREEDY = {"temperature": 0, "num_predict": 16}


def count(llama_server: Backend, messages: list[dict[str, Any]], add_special: bool = True) -> int:
    """Tokens of ``messages`` rendered by the model's own template, counted by llama-server."""
    prompt = httpx.post(f"{llama_server.url}/apply-template", json={"messages": messages}).json()["prompt"]
    body = {"content": prompt, "add_special": add_special}
    return len(httpx.post(f"{llama_server.url}/tokenize", json=body).json()["tokens"])


def adds_bos(llama_server: Backend) -> int:
    tokens = [
        httpx.post(f"{llama_server.url}/tokenize", json={"content": "a", "add_special": special}).json()["tokens"]
        for special in (True, False)
    ]
    return len(tokens[0]) - len(tokens[1])


def test_the_secret_is_recalled_while_everything_fits(ollama_sim: str, sim_model: str, llama_server: Backend) -> None:
    messages = [{"role": "system", "content": SECRET}, {"role": "user", "content": FILLER * 10 + QUESTION}]
    reply = ollama.Client(host=ollama_sim).chat(sim_model, messages, options=GREEDY)
    assert "PELICAN" in (reply.message.content or "")
    assert reply.prompt_eval_count == count(llama_server, messages)


def test_dropping_old_turns_loses_the_secret_silently(ollama_sim: str, sim_model: str, llama_server: Backend) -> None:
    messages = [
        {"role": "user", "content": SECRET},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": FILLER * 30 + QUESTION},
    ]
    num_ctx = count(llama_server, messages[1:]) + 1  # room for all but the first turn
    assert count(llama_server, messages, add_special=False) > num_ctx
    reply = ollama.Client(host=ollama_sim).chat(sim_model, messages, options={**GREEDY, "num_ctx": num_ctx})
    assert reply.done_reason in ("stop", "length")
    assert reply.prompt_eval_count == count(llama_server, messages[1:])
    assert "PELICAN" not in (reply.message.content or "")


def test_the_middle_cut_loses_the_secret_and_reports_the_magic_count(ollama_sim: str, sim_model: str, llama_server: Backend) -> None:
    messages = [{"role": "user", "content": SECRET + " " + FILLER * 60 + QUESTION}]
    num_ctx = 512
    assert count(llama_server, messages) > num_ctx
    keep = 4 + adds_bos(llama_server)  # num_keep and BOS
    chunks = list(ollama.Client(host=ollama_sim).chat(sim_model, messages, options={**GREEDY, "num_ctx": num_ctx}, stream=True))
    final = chunks[-1]
    assert final.done and not any(chunk.done for chunk in chunks[:-1])
    assert final.prompt_eval_count == num_ctx - (num_ctx - keep) // 2 <= num_ctx
    assert "PELICAN" not in "".join(chunk.message.content or "" for chunk in chunks)


def test_truncate_false_is_the_400_with_llama_servers_body(ollama_sim: str, sim_model: str, llama_server: Backend) -> None:
    messages = [{"role": "user", "content": SECRET + " " + FILLER * 30 + QUESTION}]
    body = {"model": sim_model, "messages": messages, "options": {"num_ctx": 256}, "truncate": False}
    response = httpx.post(f"{ollama_sim}/api/chat", json=body)
    assert response.status_code == 400
    error = json.loads(response.json()["error"])["error"]
    assert error["type"] == "exceed_context_size_error"
    assert (error["n_prompt_tokens"], error["n_ctx"]) == (count(llama_server, messages), 256)


def test_ps_reports_the_window_and_keep_alive_0_unloads(ollama_sim: str, sim_model: str) -> None:
    client = ollama.Client(host=ollama_sim)
    loaded = client.generate(sim_model, "", options={"num_ctx": 384})
    windows = [model.context_length for model in client.ps().models]
    unloaded = client.generate(sim_model, "", keep_alive=0)
    time.sleep(0.2)
    assert (loaded.done_reason, unloaded.done_reason) == ("load", "unload")
    assert windows == [384]
    assert client.ps().models == []


def test_v1_chat_reports_the_prompt_the_model_saw(ollama_sim: str, sim_model: str, llama_server: Backend) -> None:
    messages = [{"role": "system", "content": SECRET}, {"role": "user", "content": QUESTION}]
    client = openai.OpenAI(base_url=f"{ollama_sim}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=sim_model, messages=messages, temperature=0, max_tokens=16)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.prompt_tokens == count(llama_server, messages)
    assert "PELICAN" in (reply.choices[0].message.content or "")
