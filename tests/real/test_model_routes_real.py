"""The model routes on the real model, as the real clients read them.

- llama-server (SmolLM2-135M, trained on 8,192 tokens, started with a 1,024-token slot): through
  ContextPaw its model list says the slot's window where clients read one, and `/props` says it too.
- The Ollama simulator on the real llama-server, serving a window of 1,024 of a model it reports as
  2,048: once a request without `num_ctx` has found the window, `/api/show` through ContextPaw says
  1,024, to the `ollama` client and to aider, which sizes itself by it.
"""

import re
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from support.agents import require_agents, run_aider
from support.backends import Backend, running, start_proxy
from support.fake_ollama import OllamaSettings
from support.ollama_sim import ollama_sim_app

pytestmark = pytest.mark.real

SLOT = 1024
SIM_MODEL = "smollm2:135m"


def test_the_real_llama_servers_model_list_reports_the_slot_not_the_trained_length(small_llama_server: Backend, llama_proxy: str) -> None:
    (direct,) = openai.OpenAI(base_url=small_llama_server.url + "/v1", api_key="x").models.list().data
    trained = direct.meta["n_ctx_train"]  # type: ignore[attr-defined]
    assert trained > SLOT, f"test set-up: the model's trained length {trained}"
    (model,) = openai.OpenAI(base_url=llama_proxy + "/v1", api_key="x").models.list().data
    assert (model.context_length, model.max_model_len, model.meta["n_ctx_train"]) == (SLOT, SLOT, SLOT)  # type: ignore[attr-defined]
    assert model.contextpaw["reported"] == trained  # type: ignore[attr-defined]
    props = httpx.get(llama_proxy + "/props", timeout=10)
    assert props.json()["default_generation_settings"]["n_ctx"] == SLOT
    assert props.headers["X-ContextPaw-Window"] == f"{SLOT} tokens served"


def context_length(show: ollama.ShowResponse) -> int:
    info = show.modelinfo or {}
    return info[f"{info['general.architecture']}.context_length"]


def test_ollama_show_on_the_real_model_says_the_window_a_request_found(llama_server: Backend, tmp_path: Path) -> None:
    with running(ollama_sim_app(llama_server.url, OllamaSettings(model=SIM_MODEL, num_ctx=SLOT))) as sim:
        reported = context_length(ollama.Client(host=sim).show(SIM_MODEL))
        assert reported > SLOT, f"test set-up: the simulator reports {reported}"
        with start_proxy(sim, tmp_path / "conf", tmp_path / "mitmdump.log") as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
            client.chat.completions.create(model=SIM_MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
            assert context_length(ollama.Client(host=proxy.url).show(SIM_MODEL)) == SLOT
            run = run_aider(require_agents("aider")["aider"], proxy.url, "/tokens", home=tmp_path / "home", model=SIM_MODEL, timeout=90)
            assert re.search(rf"{SLOT:,} tokens max context window size", run.stdout), run.describe()
