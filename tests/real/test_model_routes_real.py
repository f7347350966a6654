"""The real llama-server (SmolLM2-135M, trained on 8,192 tokens, started with a 1,024-token slot):
through ContextPaw its model list says the slot's window where clients read one, and its `/props`
says the same, as the real `openai` client reads them."""

import httpx
import openai
import pytest

from support.backends import Backend

pytestmark = pytest.mark.real

SLOT = 1024


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
