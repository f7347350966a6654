"""Claude Code's API on the real model: `/v1/messages` with the official anthropic SDK, direct and
through ContextPaw, against llama-server (an overflow is a 400) and the Ollama simulator (an overflow
is cut in silence), streamed and not."""

import random
from typing import Any

import anthropic
import httpx
import pytest

from support.backends import Backend
from support.proof import anthropic_trial, make_secret, needle_chat

pytestmark = pytest.mark.real

NUM_CTX = 1024
FILLER_LINES = 150
STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])


@pytest.fixture(scope="module")
def needle() -> tuple[str, list[dict[str, Any]]]:
    rng = random.Random(4321)
    secret = make_secret(rng)
    return secret, needle_chat(secret, FILLER_LINES, rng)


@pytest.fixture(scope="module")
def long_needle() -> tuple[str, list[dict[str, Any]]]:
    """Over the simulator's default window (2048), which is what a request without num_ctx gets."""
    rng = random.Random(8765)
    secret = make_secret(rng)
    return secret, needle_chat(secret, 260, rng)


def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="local", max_retries=0, timeout=300)


@STREAMS
def test_llama_server_direct_refuses_the_overflow(small_llama_server: Backend, needle: tuple, stream: bool) -> None:
    secret, messages = needle
    trial = anthropic_trial(client(small_llama_server.url), "direct", secret, messages, stream=stream)
    assert trial.status == 400 and trial.answer.startswith("exceed_context_size_error")


@STREAMS
@pytest.mark.parametrize("how", ["window discovered", "rescued from the 400"])
def test_llama_server_through_contextpaw_answers_the_overflow(
    llama_proxy: str, rescue_proxy: str, needle: tuple, how: str, stream: bool
) -> None:
    secret, messages = needle
    rescued = how == "rescued from the 400"
    trial = anthropic_trial(client(rescue_proxy if rescued else llama_proxy), "ContextPaw", secret, messages, stream=stream)
    assert trial.status == 200, trial.answer
    report = trial.report
    assert report is not None and report["compacted"] and report["final_tokens"] <= report["budget"] < report["original_tokens"]
    assert report["recovered_from_upstream_400"] is rescued and report["window"] == NUM_CTX
    assert trial.headers["x-contextpaw-compacted"] == "true"
    assert trial.prompt_tokens is not None and trial.prompt_tokens <= NUM_CTX
    assert trial.recalled, trial.answer


@STREAMS
def test_ollama_cuts_the_route_in_silence_and_through_contextpaw_nothing_is_cut(
    ollama_sim: str, sim_proxy: str, sim_model: str, long_needle: tuple, stream: bool
) -> None:
    secret, messages = long_needle
    direct = anthropic_trial(client(ollama_sim), "direct", secret, messages, model=sim_model, stream=stream)
    assert direct.status == 200 and httpx.get(f"{ollama_sim}/_fake/last").json()["cut"] is True
    assert not direct.recalled
    through = anthropic_trial(client(sim_proxy), "ContextPaw", secret, messages, model=sim_model, stream=stream)
    assert through.status == 200 and httpx.get(f"{ollama_sim}/_fake/last").json()["cut"] is False
    assert through.report is not None and through.report["compacted"] and "upstream_truncated" not in through.report
    assert through.recalled, through.answer
