"""Window discovery: what each backend says its window is, parsed and cached."""

from __future__ import annotations

import pytest

from contextpaw.fitting.budget import Budgeter
from contextpaw.fitting.windows import BackendWindows
from contextpaw.wire import Backend, Kind, Params

LLAMA = Backend.parse(Kind.LLAMACPP, "http://127.0.0.1:8091")
OLLAMA = Backend.parse(Kind.OLLAMA, "http://127.0.0.1:11435")
SHOW = {
    "parameters": 'stop                           "<|im_end|>"\nnum_ctx                        65536',
    "model_info": {"general.architecture": "qwen3", "qwen3.context_length": 40960},
    "modelfile": "FROM /blobs/sha256-abc\nPARAMETER num_ctx 65536",
}


class Server:
    """Answers like a backend would, and counts the calls."""

    def __init__(self, answers: dict[tuple[str, str], object]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    async def __call__(self, method: str, url: str, body: object) -> object:
        self.calls.append(url)
        return self.answers.get((method, url.split("/", 3)[-1]))


async def test_llama_server_window_is_the_slot_size_from_props():
    server = Server({("GET", "props"): {"default_generation_settings": {"n_ctx": 2048, "params": {}}}})
    assert await BackendWindows(server).window(LLAMA, "any") == 2048


LOADED = {"model": "qwen3", "done": True, "done_reason": "load"}


async def test_a_cold_ollama_is_asked_by_loading_the_model_as_a_request_without_num_ctx_would():
    ps = {"models": [{"name": "qwen3:latest", "context_length": 2048}, {"name": "other:1b", "context_length": 4096}]}
    server = Server({("GET", "api/ps"): ps, ("POST", "api/generate"): LOADED})
    assert await BackendWindows(server).window(OLLAMA, "qwen3") == 2048
    assert server.calls == [OLLAMA.url + "/api/show", OLLAMA.url + "/api/generate", OLLAMA.url + "/api/ps"]


async def test_ollama_uses_the_modelfile_capped_by_the_trained_length_without_loading_anything():
    server = Server({("GET", "api/ps"): {"models": []}, ("POST", "api/show"): SHOW})
    assert await BackendWindows(server).window(OLLAMA, "qwen3") == 40960
    assert server.calls == [OLLAMA.url + "/api/show"]


async def test_the_servers_stated_default_is_capped_by_the_trained_length():
    show = {"parameters": "", "model_info": {"general.architecture": "qwen3", "qwen3.context_length": 40960}}
    server = Server({("POST", "api/show"): show})
    assert await BackendWindows(server, ollama_default=2048).window(OLLAMA, "qwen3") == 2048
    assert await BackendWindows(server, ollama_default=65536).window(OLLAMA, "other") == 40960


async def test_what_is_found_and_that_nothing_was_found_are_kept_apart_for_a_while():
    now = [0.0]
    server = Server({})
    windows = BackendWindows(server, ttl=30, miss_ttl=5, clock=lambda: now[0])
    assert await windows.window(LLAMA, "m") is None
    assert await windows.window(LLAMA, "m") is None
    assert len(server.calls) == 1, "a server that does not answer costs one timeout"
    server.answers[("GET", "props")] = {"default_generation_settings": {"n_ctx": 2048}}
    now[0] = 5.5
    assert await windows.window(LLAMA, "m") == 2048, "the default that stood in was not kept as the window"
    await windows.window(LLAMA, "m")
    assert len(server.calls) == 2
    now[0] = 36
    await windows.window(LLAMA, "m")
    assert len(server.calls) == 3


async def test_a_window_named_in_a_400_is_learned():
    windows = BackendWindows(Server({}))
    windows.learn(OLLAMA, "qwen3", 2048)
    assert await windows.window(OLLAMA, "qwen3") == 2048


@pytest.mark.parametrize(("num_ctx", "discovered", "window"), [(1024, 8192, 1024), (None, 8192, 8192), (None, None, 4096)])
async def test_the_request_wins_then_the_backend_then_the_default(num_ctx, discovered, window):
    server = Server({("GET", "props"): {"default_generation_settings": {"n_ctx": discovered}}} if discovered else {})
    budgeter = Budgeter(default_ctx=4096, reserve=256, margin=64, source=BackendWindows(server))
    budget = await budgeter.budget(LLAMA, Params(model="m", stream=False, num_ctx=num_ctx))
    assert budget.window == window and budget.tokens == window - 256 - 64


async def test_concurrent_first_requests_for_a_model_share_one_lookup() -> None:
    import asyncio

    class Slow(Server):
        async def __call__(self, method: str, url: str, body: object) -> object:
            await asyncio.sleep(0.05)
            return await super().__call__(method, url, body)

    server = Slow({("POST", "api/show"): SHOW})
    windows = BackendWindows(server)
    found = await asyncio.gather(*(windows.window(OLLAMA, "qwen3") for _ in range(50)))
    assert found == [40960] * 50 and server.calls == ["http://127.0.0.1:11435/api/show"]


async def test_the_windows_remembered_are_bounded_whatever_model_names_clients_send() -> None:
    from contextpaw.fitting.windows import MAX_MODELS, MAX_NAME_BYTES

    windows = BackendWindows(Server({("POST", "api/show"): SHOW}))
    for n in range(MAX_MODELS + 500):
        await windows.window(OLLAMA, f"model-{n}-" + "x" * 32_000)
    assert len(windows.known) < MAX_MODELS and windows.known.bytes <= MAX_NAME_BYTES and not windows._asking
    for n in range(MAX_MODELS + 500):
        await windows.window(OLLAMA, f"m{n}")
    assert len(windows.known) == MAX_MODELS


async def test_a_window_that_grows_when_the_backend_restarts_is_used_within_seconds():
    """llama-server restarted from -c 1024 to -c 8192: the next requests after a few seconds are
    sized to the new window (they were cut to the old one for half a minute)."""
    now = [0.0]
    server = Server({("GET", "props"): {"default_generation_settings": {"n_ctx": 1024}}})
    windows = BackendWindows(server, clock=lambda: now[0])
    assert await windows.window(LLAMA, "m") == 1024
    server.answers[("GET", "props")] = {"default_generation_settings": {"n_ctx": 8192}}
    now[0] = 5.0
    assert await windows.window(LLAMA, "m") == 8192


async def test_what_was_learned_of_a_backend_that_refused_or_reset_a_connection_is_asked_again():
    """A restart shows as a refused or reset connection: the window (and a miss) found there are
    asked again at once, other backends' are kept."""
    server = Server({("GET", "props"): {"default_generation_settings": {"n_ctx": 1024}}, ("POST", "api/show"): SHOW})
    windows = BackendWindows(server)
    assert await windows.window(LLAMA, "m") == 1024 and await windows.window(OLLAMA, "qwen3") == 40960
    server.answers[("GET", "props")] = {"default_generation_settings": {"n_ctx": 8192}}
    windows.forget(lambda backend: backend == LLAMA)
    assert await windows.window(LLAMA, "m") == 8192 and await windows.window(OLLAMA, "qwen3") == 40960
    assert server.calls.count(OLLAMA.url + "/api/show") == 1
    assert windows.known.bytes == sum(windows.known.size(key, value) for key, value in windows.known.items())


def test_the_ledger_tells_of_refused_and_reset_connections_but_not_of_slow_answers():
    from contextpaw.ops.evicted import MemoryStore
    from contextpaw.ops.metrics import FailureLedger, Stats
    from contextpaw.proxy.backends import located

    told: list[str] = []
    ledger = FailureLedger(Stats(MemoryStore(max_items=1, max_bytes=1, max_age_s=1)), broken=told.append)
    ledger.unreachable("127.0.0.1:8091", "POST /v1/chat/completions", "refused")
    ledger.failed("POST /completion", "reset the connection", target="localhost:8091")
    ledger.failed("POST /completion", "sent no answer for 2 s", target="127.0.0.1:8091", timed_out=True)
    ledger.connect_failed("[::1]:8091", "refused")
    assert told == ["127.0.0.1:8091", "localhost:8091", "[::1]:8091"]
    assert all(located(target, LLAMA) for target in told) and not located("127.0.0.1:8092", LLAMA)
