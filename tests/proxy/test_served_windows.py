"""The model routes report the served window: the pure rewrites of `/v1/models`, `/api/show` and
`/props`, and the window they are given (found without loading a model)."""

from __future__ import annotations

import json

import pytest

from contextpaw.fitting.windows import BackendWindows
from contextpaw.wire import Backend, Kind, llamacpp, ollama, openai, served

LLAMA = Backend.parse(Kind.LLAMACPP, "http://127.0.0.1:8091")
OLLAMA = Backend.parse(Kind.OLLAMA, "http://127.0.0.1:11435")

LLAMA_MODELS = {
    "models": [{"name": "smol", "model": "smol", "type": "model"}],
    "object": "list",
    "data": [{"id": "smol", "object": "model", "created": 1, "owned_by": "llamacpp",
              "meta": {"vocab_type": 2, "n_vocab": 49152, "n_ctx": 16384, "n_ctx_train": 32768, "n_embd": 576}}],
}  # fmt: skip
OLLAMA_MODELS = {
    "object": "list",
    "data": [{"id": "qwen3:8b", "object": "model", "created": 1, "owned_by": "library"},
             {"id": "llama3.2:latest", "object": "model", "created": 2, "owned_by": "library"}],
}  # fmt: skip
SHOW = {
    "modelfile": "FROM /blobs/sha256-abc\n",
    "parameters": 'stop                           "<|im_end|>"',
    "template": "{{ .Prompt }}",
    "model_info": {"general.architecture": "qwen3", "general.parameter_count": 8, "qwen3.context_length": 40960,
                   "qwen3.rope.scaling.original_context_length": 32768},
    "capabilities": ["completion", "tools"],
}  # fmt: skip


def test_every_model_listed_gets_the_served_window_in_the_fields_clients_read():
    body = openai.models_with_windows(OLLAMA_MODELS, {"qwen3:8b": 4096, "llama3.2:latest": 8192})
    assert [(m["context_length"], m["max_model_len"]) for m in body["data"]] == [(4096, 4096), (8192, 8192)]
    assert [m["contextpaw"] for m in body["data"]] == [{"window": 4096}, {"window": 8192}]


def test_a_model_whose_window_is_unknown_is_listed_as_the_backend_listed_it():
    body = openai.models_with_windows(OLLAMA_MODELS, {"qwen3:8b": 4096})
    assert body["data"][1] == OLLAMA_MODELS["data"][1]
    assert body["object"] == "list"


def test_llama_servers_meta_says_the_served_window_and_the_note_keeps_the_trained_length():
    entry = openai.models_with_windows(LLAMA_MODELS, {"smol": 8192})["data"][0]
    assert entry["meta"] == {**LLAMA_MODELS["data"][0]["meta"], "n_ctx": 8192, "n_ctx_train": 8192}
    assert entry["context_length"] == entry["max_model_len"] == 8192
    assert entry["contextpaw"]["reported"] == 32768 and "8192" in entry["contextpaw"]["note"]
    assert LLAMA_MODELS["data"][0]["meta"]["n_ctx_train"] == 32768  # the backend's answer is not changed in place


def test_a_field_that_says_less_than_the_served_window_is_left_alone():
    listed = {"id": "m", "context_length": 2048, "meta": {"n_ctx": 2048, "n_ctx_train": 2048}}
    entry = openai.models_with_windows({"data": [listed]}, {"m": 4096})["data"][0]
    assert entry["meta"] == {"n_ctx": 2048, "n_ctx_train": 2048}
    assert (entry["context_length"], entry["max_model_len"]) == (2048, 4096)
    assert entry["contextpaw"] == {"window": 4096}


def test_a_context_length_the_backend_lists_over_the_served_window_is_lowered():
    entry = openai.models_with_windows({"data": [{"id": "m", "context_length": 131072}]}, {"m": 4096})["data"][0]
    assert entry["context_length"] == 4096 and entry["contextpaw"]["reported"] == 131072


def test_one_model_by_id_gets_the_window_too():
    one = {"id": "qwen3:8b", "object": "model", "created": 1, "owned_by": "library"}
    assert openai.model_ids(one) == ["qwen3:8b"]
    assert openai.models_with_windows(one, {"qwen3:8b": 4096}) == {
        **one,
        "context_length": 4096,
        "max_model_len": 4096,
        "contextpaw": {"window": 4096},
    }


def test_show_reports_the_served_window_where_the_model_file_says_more():
    body = ollama.show_with_window(SHOW, 4096)
    assert body["model_info"]["qwen3.context_length"] == 4096
    assert body["model_info"]["qwen3.rope.scaling.original_context_length"] == 32768
    assert body["parameters"].splitlines() == ['stop                           "<|im_end|>"', "num_ctx                        4096"]
    assert body["contextpaw"]["window"] == 4096 and body["contextpaw"]["reported"] == 40960
    assert [k for k in body if k != "contextpaw"] == list(SHOW)  # Ollama's field order kept


def test_litellm_reads_the_served_window_from_show():
    """LiteLLM's Ollama `get_model_info` takes the first `model_info` key holding `context_length`."""
    body = json.loads(json.dumps(ollama.show_with_window(SHOW, 4096)))
    assert next(v for k, v in body["model_info"].items() if "context_length" in k) == 4096


def test_a_modelfile_num_ctx_over_the_served_window_is_lowered_and_one_within_it_kept():
    lowered = ollama.show_with_window({**SHOW, "parameters": "num_ctx                        65536"}, 40960)
    assert lowered["parameters"] == "num_ctx                        40960"
    assert lowered["model_info"] == SHOW["model_info"]
    assert lowered["contextpaw"]["reported"] == 65536
    kept = ollama.show_with_window({**SHOW, "parameters": "num_ctx                        8192"}, 8192)
    assert kept["parameters"] == "num_ctx                        8192"
    assert kept["contextpaw"]["reported"] == 40960  # what model_info said


def test_the_model_a_show_request_names_is_read_from_model_or_the_older_name():
    assert ollama.shown_model({"model": "qwen3:8b"}) == "qwen3:8b"
    assert ollama.shown_model({"name": "qwen3:8b"}) == "qwen3:8b"  # LiteLLM
    assert ollama.shown_model([1]) == ""


def test_props_report_a_smaller_window_contextpaw_fits_to_and_keep_the_servers_own():
    props = {"default_generation_settings": {"params": {"n_predict": -1}, "n_ctx": 8192}, "total_slots": 1}
    assert llamacpp.props_with_window(props, 8192) == {**props, "contextpaw": {"window": 8192}}
    smaller = llamacpp.props_with_window(props, 4096)
    assert smaller["default_generation_settings"] == {"params": {"n_predict": -1}, "n_ctx": 4096}
    assert smaller["contextpaw"]["reported"] == 8192


def test_the_header_says_the_served_window_and_what_the_backend_reported():
    assert served.header(4096, None) == "4096 tokens served"
    assert served.header(4096, 40960) == "4096 tokens served; the backend reported 40960"


class Server:
    def __init__(self, answers: dict[tuple[str, str], object]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    async def __call__(self, method: str, url: str, body: object) -> object:
        self.calls.append(url.split("/", 3)[-1])
        return self.answers.get((method, url.split("/", 3)[-1]))


@pytest.mark.asyncio
async def test_the_model_routes_never_load_a_model_to_learn_its_window():
    server = Server({("POST", "api/show"): SHOW, ("GET", "api/ps"): {"models": [{"name": "qwen3:8b", "context_length": 8192}]}})
    assert await BackendWindows(server).listed(OLLAMA, "qwen3:8b") is None
    assert server.calls == ["api/show"]


@pytest.mark.asyncio
async def test_the_model_routes_use_the_configured_default_capped_by_the_trained_length():
    windows = BackendWindows(Server({("POST", "api/show"): SHOW}), ollama_default=65536)
    assert await windows.listed(OLLAMA, "qwen3:8b") == 40960


@pytest.mark.asyncio
async def test_the_model_routes_use_the_window_the_last_request_found_however_long_ago():
    now = [0.0]
    windows = BackendWindows(Server({("POST", "api/show"): SHOW}), clock=lambda: now[0])
    windows.learn(OLLAMA, "qwen3:8b", 4096)
    now[0] += 3600  # long past the seconds a window is trusted for sizing a request
    assert windows.cached(OLLAMA, "qwen3:8b") == (False, None)
    assert await windows.listed(OLLAMA, "qwen3:8b") == 4096
    windows.forget(lambda backend: backend == OLLAMA)  # the backend restarted
    assert await windows.listed(OLLAMA, "qwen3:8b") is None


@pytest.mark.asyncio
async def test_llama_servers_window_for_the_model_routes_is_its_props():
    server = Server({("GET", "props"): {"default_generation_settings": {"n_ctx": 8192}}})
    assert await BackendWindows(server).listed(LLAMA, "") == 8192
