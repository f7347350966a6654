"""The model routes through a real mitmdump report the window the server serves, as the real
`openai` and `ollama` clients read it: Ollama's `/api/show` and `/v1/models`, llama-server's
`/v1/models` and `/props`; and an answer that cannot be read passes as it came."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from aiohttp import web

from support.backends import Backend, start_proxy
from support.common import running
from support.fake_llamacpp import LlamaSettings, fake_llamacpp_app
from support.fake_ollama import OllamaSettings, fake_ollama_app

SERVED = 4096
TRAINED = 32768
MODEL = "fake:latest"


@pytest.fixture(scope="module")
def fake_ollama() -> Iterator[str]:
    """An Ollama serving a window of 4,096 (its OLLAMA_CONTEXT_LENGTH) of a model trained to 32,768."""
    with running(fake_ollama_app(OllamaSettings(model=MODEL, num_ctx=SERVED), train_ctx=TRAINED)) as url:
        yield url


@pytest.fixture(scope="module")
def told(fake_ollama: str, workdir: Path) -> Iterator[Backend]:
    """ContextPaw told the server's default window (`contextpaw_ollama_context_length`)."""
    options = [f"contextpaw_ollama_context_length={SERVED}", f"contextpaw_state_dir={workdir / 'routes-told'}"]
    with start_proxy(fake_ollama, workdir / "conf", workdir / "routes-told.log", options=options) as proxy:
        yield proxy


def context_length(show: ollama.ShowResponse) -> int:
    info = show.modelinfo or {}
    return info[f"{info['general.architecture']}.context_length"]


def test_ollama_show_through_contextpaw_reports_the_served_window_not_the_trained_length(fake_ollama: str, told: Backend) -> None:
    assert context_length(ollama.Client(host=fake_ollama).show(MODEL)) == TRAINED  # the backend's own answer
    show = ollama.Client(host=told.url).show(MODEL)
    assert context_length(show) == SERVED
    assert f"num_ctx                        {SERVED}" in (show.parameters or "").splitlines()
    answer = httpx.post(told.url + "/api/show", json={"name": MODEL}, timeout=10)  # as LiteLLM asks
    assert answer.headers["X-ContextPaw-Window"] == f"{SERVED} tokens served; the backend reported {TRAINED}"
    assert answer.json()["contextpaw"]["reported"] == TRAINED


def test_the_openai_model_list_on_ollama_carries_the_served_window(told: Backend) -> None:
    client = openai.OpenAI(base_url=told.url + "/v1", api_key="x")
    models = client.models.list().data
    assert [(m.id, m.context_length, m.max_model_len) for m in models] == [(MODEL, SERVED, SERVED)]  # type: ignore[attr-defined]
    one = client.models.retrieve(MODEL)
    assert (one.id, one.context_length, one.max_model_len) == (MODEL, SERVED, SERVED)  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):  # an error answer passes as Ollama gave it
        client.models.retrieve("missing:latest")


def test_ollama_show_says_the_window_once_a_request_without_num_ctx_has_learned_it(fake_ollama: str, workdir: Path) -> None:
    """Nothing is loaded to answer `/api/show`: until a request finds the window, the answer is the
    backend's; after it, the served window."""
    options = [f"contextpaw_state_dir={workdir / 'routes-learned'}"]
    with start_proxy(fake_ollama, workdir / "conf", workdir / "routes-learned.log", options=options) as proxy:
        first = httpx.post(proxy.url + "/api/show", json={"model": MODEL}, timeout=10)
        assert "X-ContextPaw-Window" not in first.headers and "contextpaw" not in first.json()
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert context_length(ollama.Client(host=proxy.url).show(MODEL)) == SERVED


def test_llama_servers_model_list_and_props_report_the_slot_window(workdir: Path) -> None:
    """`-c 2048` of a model trained to 8,192: `meta.n_ctx_train` is not read as the window."""
    with running(fake_llamacpp_app(LlamaSettings(n_ctx=2048, n_ctx_train=8192))) as url:
        options = [f"contextpaw_state_dir={workdir / 'routes-llama'}"]
        with start_proxy(url, workdir / "conf", workdir / "routes-llama.log", options=options) as proxy:
            (model,) = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x").models.list().data
            assert (model.context_length, model.max_model_len) == (2048, 2048)  # type: ignore[attr-defined]
            assert model.meta["n_ctx_train"] == 2048 and model.contextpaw["reported"] == 8192  # type: ignore[attr-defined]
            props = httpx.get(proxy.url + "/props", timeout=10)
            assert props.json()["default_generation_settings"]["n_ctx"] == 2048
            assert props.headers["X-ContextPaw-Window"] == "2048 tokens served"


def test_with_discovery_off_the_model_routes_say_the_default_window_contextpaw_fits_to(workdir: Path) -> None:
    with running(fake_llamacpp_app(LlamaSettings(n_ctx=4096))) as url:
        options = [f"contextpaw_state_dir={workdir / 'routes-undiscovered'}", "contextpaw_discover_window=false",
                   "contextpaw_default_ctx=2048"]  # fmt: skip
        with start_proxy(url, workdir / "conf", workdir / "routes-undiscovered.log", options=options) as proxy:
            props = httpx.get(proxy.url + "/props", timeout=10)
            assert props.json()["default_generation_settings"]["n_ctx"] == 2048
            assert props.headers["X-ContextPaw-Window"] == "2048 tokens served; the backend reported 4096"


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (b'{"model_info": {"llama.context_length": 8192', "JSONDecodeError"),
        (b'{"model_info": {"llama.context_length": 8192}, "tokens": "' + b"t" * (5 << 20) + b'"}', "over the 4 MB"),
    ],
    ids=["not JSON", "a verbose show's size"],
)
def test_a_model_route_answer_that_is_not_read_passes_as_it_came_and_says_so(workdir: Path, answer: bytes, said: str) -> None:
    async def show(request: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    async def root(request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    app = web.Application()
    app.router.add_get("/", root)
    app.router.add_post("/api/show", show)
    with running(app) as url:
        options = [f"contextpaw_state_dir={workdir / 'routes-broken'}", f"contextpaw_ollama_context_length={SERVED}"]
        with start_proxy(url, workdir / "conf", workdir / "routes-broken.log", options=options) as proxy:
            got = httpx.post(proxy.url + "/api/show", json={"model": MODEL}, timeout=10)
            assert got.content == answer
            assert "passed on without the served window" in got.headers["X-ContextPaw-Error"]
            assert said in got.headers["X-ContextPaw-Error"]
