"""The real llama-server in router mode (`--models-preset`: one server, many models, each its own
window), behind ContextPaw: each model's window is learned from the router without loading it or
a 400, requests are counted by the model they name, and an overflow to the small one is fitted
before it is sent while the big one takes the same chat whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.backends import LOOPBACK, Backend, free_port, start_process, start_proxy

PRESETS = {"small": 1024, "big": 2048}
"""Two presets of the one SmolLM2 GGUF, each with its own `ctx-size` (a slot each: `parallel = 1`)."""


@pytest.fixture(scope="module")
def router(real_backend: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    binary, model = real_backend
    work = tmp_path_factory.mktemp("router")
    presets = work / "presets.ini"
    presets.write_text("".join(f"[{name}]\nmodel = {model}\nctx-size = {size}\nparallel = 1\n\n" for name, size in PRESETS.items()))
    port = free_port()
    argv = [str(binary), "--models-preset", str(presets), "--models-max", "2", "--host", LOOPBACK, "--port", str(port)]
    with start_process(argv, f"http://{LOOPBACK}:{port}", "/health", work / "router.log", 120) as server:
        yield server


@pytest.fixture(scope="module")
def proxy(router: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    work = tmp_path_factory.mktemp("router-proxy")
    options = [f"contextpaw_llamacpp={router.url}", f"contextpaw_state_dir={work / 'state'}", "contextpaw_output_reserve=64"]
    with start_proxy(router.url, work / "conf", work / "mitmdump.log", options=options) as running:
        yield running


def loaded(url: str) -> set[str]:
    listing = httpx.get(url + "/models", timeout=30).json()["data"]
    return {m["id"] for m in listing if m["status"]["value"] == "loaded"}


def chat(model: str, words: int) -> dict[str, object]:
    notes = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"note {i}: " + "amber basil cedar delta " * (words // 40)}
             for i in range(10)]  # fmt: skip
    return {"model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": "Be brief."}, *notes, {"role": "user", "content": "Which notes?"}]}  # fmt: skip


def test_each_models_window_is_learned_from_the_router_without_loading_it(proxy: Backend, router: Backend) -> None:
    windows = {name: httpx.get(f"{proxy.url}/contextpaw/window?model={name}", timeout=60).json() for name in PRESETS}
    assert {name: w["window"] for name, w in windows.items()} == PRESETS, windows
    assert all(w["source"] == "backend" for w in windows.values()), windows
    assert loaded(router.url) == set(), "nothing was loaded to learn a window"


def test_an_overflow_to_the_small_model_is_fitted_before_it_is_sent_and_the_big_one_takes_it_whole(proxy: Backend) -> None:
    body = chat("small", 1400)  # about 1,500 tokens: over 1,024, under 2,048
    small = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=300)
    assert small.status_code == 200, small.text
    report = small.json()["contextpaw"]
    assert report["compacted"] and not report.get("recovered_from_upstream_400"), report
    assert report["counter"] == "backend" and small.json()["usage"]["prompt_tokens"] <= 1024
    big = httpx.post(proxy.url + "/v1/chat/completions", json={**body, "model": "big"}, timeout=300)
    assert big.status_code == 200 and big.headers["X-ContextPaw-Compacted"] == "false", big.text
    assert 1024 < big.json()["usage"]["prompt_tokens"] <= 2048


def test_the_doctor_names_each_models_window_and_what_is_loaded(router: Backend) -> None:
    """It said PROBLEM "reports no window in /props (router mode ...)", with the fix "run one
    llama-server per model": giving up what the server is for."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "contextpaw.command.cli", "doctor", "--llamacpp", router.url, "--json"],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    findings = __import__("json").loads(done.stdout)
    said = {f["subject"]: f for f in (findings["findings"] if isinstance(findings, dict) else findings)}
    router_line = said[f"{router.url} (llama-server, router mode)"]
    assert router_line["level"] == "ok" and "small 1,024" in router_line["what"] and "big 2,048" in router_line["what"]
    assert "at most 2 loaded at once" in router_line["what"]
    assert not any("reports no window" in f["what"] for f in said.values())
    small = said[f"{router.url} (llama-server, router mode) model small"]
    assert small["level"] == "note" and "ctx-size = " in small["fix"] and "[small] preset" in small["fix"]


def test_the_report_and_the_metrics_say_what_the_prompt_cache_saved(proxy: Backend) -> None:
    """llama-server's `timings.cache_n` beside `prompt_n`: the next turn of a conversation finds its
    prefix in the server's cache, and the report says how much (turn by turn, what a cut cost)."""
    body = chat("big", 800)
    first = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=300).json()
    body["messages"] += [{"role": "assistant", "content": "Ten notes."}, {"role": "user", "content": "And the first?"}]
    second = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=300).json()
    one, two = first["contextpaw"]["prompt_cache"], second["contextpaw"]["prompt_cache"]
    assert two["reused_tokens"] >= one["reused_tokens"] + one["evaluated_tokens"] - 8, (one, two)
    assert two["evaluated_tokens"] < 60 and two["reused_tokens"] + two["evaluated_tokens"] == second["usage"]["prompt_tokens"]
    metrics = httpx.get(proxy.url + "/contextpaw/metrics", timeout=30).text
    assert 'contextpaw_prompt_tokens_reused_total{backend="llamacpp"' in metrics


def test_the_model_list_through_contextpaw_names_each_models_served_window(proxy: Backend) -> None:
    listed = httpx.get(proxy.url + "/v1/models", timeout=60).json()["data"]
    windows = {m["id"]: m.get("contextpaw", {}).get("window") for m in listed}
    assert windows == PRESETS, listed


async def test_the_arbiter_shares_the_card_by_loading_and_unloading_the_routers_models(
    real_backend: tuple[Path, Path], tmp_path: Path
) -> None:
    """A router llama-server the arbiter starts (CPU models here, no NVML): each request's model is
    loaded before it is admitted, another model takes the card by unloading the first, and Ollama
    takes it by unloading the router's models; the router process stays up throughout."""
    import shlex

    from aiohttp.test_utils import TestServer

    from contextpaw.gpu.arbiter import Arbiter, ArbiterSettings
    from support.fake_ollama import fake_ollama_app
    from support.gpus import NoGpu

    binary, model = real_backend
    presets = tmp_path / "presets.ini"
    presets.write_text("".join(f"[{name}]\nmodel = {model}\nctx-size = {size}\nparallel = 1\n\n" for name, size in PRESETS.items()))
    port = free_port()
    command = shlex.join([str(binary), "--models-preset", str(presets), "--host", LOOPBACK, "--port", str(port)])
    router = f"http://{LOOPBACK}:{port}"
    ollama = TestServer(fake_ollama_app(), host=LOOPBACK)
    await ollama.start_server()
    settings = ArbiterSettings(f"http://{LOOPBACK}:{ollama.port}", router, llamacpp_cmd=command,
                               llamacpp_log=tmp_path / "router.log", min_hold=0.0, poll_interval=0.1)  # fmt: skip
    arbiter = Arbiter(settings, NoGpu())
    try:
        async with arbiter.use("llamacpp", "small"):
            assert loaded(router) == {"small"}
            pid = (await arbiter.status())["llamacpp_process"]["pid"]
        async with arbiter.use("llamacpp", "big"):
            assert loaded(router) == {"big"}, "the small one was unloaded to make room"
        async with arbiter.use("llamacpp", "big"):
            assert loaded(router) == {"big"}
        async with arbiter.use("ollama", "fake"):
            assert loaded(router) == set(), "Ollama took the card from the router's models"
            status = await arbiter.status()
            assert status["llamacpp_process"]["pid"] == pid, "the router process stayed up"
        async with arbiter.use("llamacpp", "small"):
            assert loaded(router) == {"small"}
        assert arbiter.counters.switches == 3 and arbiter.counters.failures == 0, arbiter.counters
        said = [(d["wanted"], d["model"], d["evict"]) for d in status["decisions"]]
        assert ("llamacpp", "big", "llamacpp") in said and ("ollama", "fake", "llamacpp") in said, said
    finally:
        await arbiter.aclose()
        await ollama.close()
    assert httpx_refused(router), "the router the arbiter started is stopped with it"


def httpx_refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=5)
    except httpx.ConnectError:
        return True
    return False


@pytest.mark.parametrize("model", list(PRESETS))
def test_the_needle_is_recalled_through_contextpaw_by_each_model_where_the_router_refuses_it(
    router: Backend, proxy: Backend, model: str
) -> None:
    """The proof demo's row, per model of one router: the overflowing needle chat is a 400 straight
    from the router, and through ContextPaw it is fitted to that model's own window and the secret
    comes back."""
    import random

    import openai

    from support.proof import make_secret, needle_chat, openai_trial, overflow_lines

    rng = random.Random(PRESETS[model])
    secret = make_secret(rng)
    messages = needle_chat(secret, overflow_lines(PRESETS[model], 0), rng)
    direct = openai_trial(openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0), "direct", secret, messages, model=model)
    through = openai_trial(openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=600), "ContextPaw",
                           secret, messages, model=model)  # fmt: skip
    assert direct.status == 400 and "exceed_context_size_error" in direct.answer, direct.answer
    assert through.status == 200 and through.compacted and through.report is not None, through.answer
    assert through.report["window"] == PRESETS[model] and not through.report["recovered_from_upstream_400"]
    assert through.recalled, through.answer
