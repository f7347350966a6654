"""The Arbitration addon with taddons/tflow: options, holds on the GPU, 503s, /contextpaw/runtime.

Most tests use a fake arbiter that records holds; the last ones use the real Arbiter with nothing on
the card, where a switch to Ollama evicts nothing and a llama-server that exits at once fails its start.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import time
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import exceptions, http
from mitmproxy.test import taddons

from contextpaw.gpu.arbiter import Arbiter, ArbiterCounters, ArbiterSettings, RuntimeUnavailable
from contextpaw.proxy.arbitration import Arbitration
from contextpaw.proxy.compose import make_addons
from contextpaw.proxy.endpoints import AdminEndpoints
from support.flows import get, post
from support.gpus import NoGpu

OLLAMA_PORT, LLAMACPP_PORT, CLOSED_PORT = 11435, 8091, 9
SERVER_CMD = shlex.join([sys.executable, "-c", "import sys; sys.exit(3)"])
"""A 'llama-server' that exits during startup; an executable, so the option is valid."""
ON = {
    "contextpaw_arbitrate": True,
    "contextpaw_ollama": [f"http://127.0.0.1:{OLLAMA_PORT}"],
    "contextpaw_llamacpp": [f"http://127.0.0.1:{LLAMACPP_PORT}"],
    "contextpaw_llamacpp_cmd": SERVER_CMD,
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}


class FakeArbiter:
    """Records holds; refuses every acquire with ``refusal`` when one is set."""

    def __init__(self, settings: ArbiterSettings) -> None:
        self.settings = settings
        self.counters = ArbiterCounters()
        self.held: dict[Hashable, str] = {}
        self.refusal: RuntimeUnavailable | None = None
        self.closed = False

    async def acquire(self, kind: str, flow_id: Hashable, model: str | None = None) -> None:
        if self.refusal is not None:
            raise self.refusal
        self.held[flow_id] = kind

    def release(self, flow_id: Hashable) -> None:
        self.held.pop(flow_id, None)

    async def status(self) -> dict[str, Any]:
        return {"owner": "ollama", "in_flight": len(self.held)}

    async def aclose(self) -> None:
        self.closed = True


@dataclass
class Proxy:
    tctx: taddons.context
    arbitration: Arbitration
    admin: AdminEndpoints

    @property
    def arbiter(self) -> Any:
        return self.arbitration.arbiter

    def turn_on(self, **options: Any) -> None:
        self.tctx.configure(self.arbitration, **{**ON, **options})


def proxy_with(new_arbiter: Any) -> Any:
    """The addons as make_addons() orders them, with a test arbiter."""
    addons = make_addons(new_arbiter)
    arbitration = next(each for each in addons if isinstance(each, Arbitration))
    admin = next(each for each in addons if isinstance(each, AdminEndpoints))
    return taddons.context(*addons), arbitration, admin


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[Proxy]:
    context, arbitration, admin = proxy_with(FakeArbiter)
    with context as tctx:
        tctx.configure(
            arbitration,
            contextpaw_ollama=ON["contextpaw_ollama"],
            contextpaw_llamacpp=ON["contextpaw_llamacpp"],
            contextpaw_llamacpp_log=str(tmp_path / "llama-server.log"),
        )
        yield Proxy(tctx, arbitration, admin)
        if (closing := arbitration.done()) is not None:
            await closing


# -- options ----------------------------------------------------------------------------------------


async def test_off_by_default_and_on_with_both_backends(proxy: Proxy, tmp_path: Path) -> None:
    assert proxy.arbiter is None
    proxy.turn_on(contextpaw_arbitrate_wait=30, contextpaw_llamacpp_stop_grace=0)
    settings = proxy.arbiter.settings
    assert (settings.ollama_url, settings.llamacpp_url) == ("http://127.0.0.1:11435", "http://127.0.0.1:8091")
    assert (settings.wait_timeout, settings.drain_timeout, settings.stop_grace) == (30.0, 60.0, 0.0)
    assert settings.llamacpp_cmd == SERVER_CMD
    assert settings.llamacpp_log == tmp_path / "llama-server.log"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"contextpaw_arbitrate_wait": 0}, "contextpaw_arbitrate_wait must be at least 1s, not 0"),
        ({"contextpaw_llamacpp_stop_grace": -1}, "contextpaw_llamacpp_stop_grace must be at least 0s"),
        ({"contextpaw_llamacpp": []}, "needs an Ollama backend .* contextpaw_llamacpp is not set"),
        ({"contextpaw_ollama": []}, "contextpaw_ollama is not set"),
        ({"contextpaw_ollama": ["ftp://nope"]}, "contextpaw_ollama: .* is not an http"),
        ({"contextpaw_llamacpp_cmd": ""}, "needs llama-server's start command: no contextpaw_llamacpp_cmd"),
        ({"contextpaw_llamacpp_cmd": "/nonexistent/llama-server -m x.gguf"}, "is not an executable"),
        ({"contextpaw_llamacpp_cmd": 'llama-server -m "open'}, "cannot be parsed"),
    ],
)
async def test_options_are_validated_with_a_clear_message(proxy: Proxy, options: dict, message: str) -> None:
    with pytest.raises(exceptions.OptionsError, match=message):
        proxy.turn_on(**options)
    assert proxy.arbiter is None


async def test_an_option_change_replaces_and_closes_the_arbiter(proxy: Proxy) -> None:
    proxy.turn_on()
    first = proxy.arbiter
    proxy.tctx.configure(proxy.arbitration, contextpaw_policy="strict")  # not an arbitration option
    proxy.tctx.configure(proxy.arbitration, contextpaw_arbitrate_drain=60)  # the value it has
    assert proxy.arbiter is first
    proxy.tctx.configure(proxy.arbitration, contextpaw_arbitrate_drain=5)
    second = proxy.arbiter
    assert second is not first and second.settings.drain_timeout == 5.0
    proxy.tctx.configure(proxy.arbitration, contextpaw_arbitrate=False)
    assert proxy.arbiter is None
    await asyncio.sleep(0)
    assert first.closed and second.closed


# -- holds ------------------------------------------------------------------------------------------


async def test_a_model_request_holds_its_runtime_until_response(proxy: Proxy) -> None:
    proxy.turn_on()
    flow = post("/v1/chat/completions", CHAT, port=LLAMACPP_PORT)
    await proxy.arbitration.request(flow)
    assert proxy.arbiter.held == {flow.id: "llamacpp"}
    flow.response = http.Response.make(200, b"{}")
    proxy.arbitration.response(flow)
    assert proxy.arbiter.held == {}


async def test_an_error_releases_the_hold(proxy: Proxy) -> None:
    proxy.turn_on()
    flow = post("/api/chat", CHAT)
    await proxy.arbitration.request(flow)
    assert proxy.arbiter.held == {flow.id: "ollama"}
    proxy.arbitration.error(flow)
    assert proxy.arbiter.held == {}


@pytest.mark.parametrize(
    ("method", "path", "port"),
    [
        ("GET", "/api/tags", OLLAMA_PORT),  # listings must not switch the GPU
        ("POST", "/api/show", OLLAMA_PORT),
        ("GET", "/v1/models", LLAMACPP_PORT),
        ("POST", "/api/chat", CLOSED_PORT),  # not a backend the arbiter governs
    ],
)
async def test_requests_that_run_no_model_here_are_not_held(proxy: Proxy, method: str, path: str, port: int) -> None:
    proxy.turn_on()
    flow = post(path, CHAT, port=port)
    flow.request.method = method
    await proxy.arbitration.request(flow)
    assert proxy.arbiter.held == {}
    assert flow.response is None


async def test_nothing_is_held_while_arbitration_is_off(proxy: Proxy) -> None:
    flow = post("/api/chat", CHAT)
    await proxy.arbitration.request(flow)
    proxy.arbitration.response(flow)
    assert flow.response is None


# -- 503 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "port", "error"),
    [
        ("/api/chat", OLLAMA_PORT, "ContextPaw: ollama is not available: llama-server is starting"),
        (
            "/v1/chat/completions",
            OLLAMA_PORT,
            {
                "message": "ContextPaw: ollama is not available: llama-server is starting",
                "type": "runtime_unavailable",
                "param": None,
                "code": 503,
            },
        ),
        (
            "/completion",
            LLAMACPP_PORT,
            {
                "message": "ContextPaw: llamacpp is not available: llama-server is starting",
                "type": "runtime_unavailable",
                "code": 503,
            },
        ),
    ],
)
async def test_unavailable_runtime_is_a_503_in_the_callers_convention(proxy: Proxy, path: str, port: int, error: object) -> None:
    proxy.turn_on()
    proxy.arbiter.refusal = RuntimeUnavailable("llama-server is starting", retry_after=7)
    flow = post(path, CHAT, port=port)
    await proxy.arbitration.request(flow)
    assert flow.response.status_code == 503
    assert flow.response.headers["Retry-After"] == "7"
    assert json.loads(flow.response.content) == {"error": error}


async def test_no_retry_after_when_waiting_would_not_help(proxy: Proxy) -> None:
    proxy.turn_on()
    proxy.arbiter.refusal = RuntimeUnavailable("no contextpaw_llamacpp_cmd is configured")
    flow = post("/v1/chat/completions", CHAT, port=LLAMACPP_PORT)
    await proxy.arbitration.request(flow)
    assert flow.response.status_code == 503
    assert "Retry-After" not in flow.response.headers


# -- /contextpaw/runtime ----------------------------------------------------------------------------


async def runtime_status(proxy: Proxy, peer: str = "127.0.0.1", port: int = OLLAMA_PORT, **headers: str) -> http.Response:
    """Through Arbitration, then AdminEndpoints as the chain runs them."""
    flow = get("/contextpaw/runtime", port=port, peer=peer)
    flow.request.headers.update(headers)
    await proxy.arbitration.request(flow)
    await proxy.admin.request(flow)
    assert flow.response is not None
    return flow.response


async def test_runtime_endpoint_off_and_on(proxy: Proxy) -> None:
    off = await runtime_status(proxy)
    assert (off.status_code, json.loads(off.content)) == (200, {"enabled": False})
    proxy.turn_on()
    on = await runtime_status(proxy)
    assert json.loads(on.content) == {"enabled": True, "owner": "ollama", "in_flight": 0}


async def test_runtime_endpoint_is_for_loopback_or_token_holders(proxy: Proxy) -> None:
    proxy.turn_on()
    assert (await runtime_status(proxy, peer="192.0.2.7")).status_code == 403
    proxy.tctx.configure(proxy.admin, contextpaw_admin_token="s3cret")
    allowed = await runtime_status(proxy, peer="192.0.2.7", **{"X-ContextPaw-Token": "s3cret"})
    assert allowed.status_code == 200


async def test_other_admin_paths_are_left_to_admin_endpoints(proxy: Proxy) -> None:
    flow = get("/contextpaw/health")
    await proxy.arbitration.request(flow)
    assert flow.response is None


async def test_metrics_are_the_arbiters_counters(proxy: Proxy) -> None:
    assert proxy.arbitration.metrics()["runtime_switches"] == 0.0
    proxy.turn_on()
    proxy.arbiter.counters.refused = 2
    assert proxy.arbitration.metrics() == {
        "runtime_switches": 0.0,
        "runtime_failures": 0.0,
        "runtime_switch_seconds": 0.0,
        "runtime_refused": 2.0,
        "runtime_wait_timeouts": 0.0,
        "runtime_cancelled": 0.0,
        "runtime_loads": 0.0,
        "runtime_loaded_beside": 0.0,
    }


# -- the real Arbiter -------------------------------------------------------------------------------


@pytest.fixture
async def real(tmp_path: Path) -> AsyncIterator[Proxy]:
    """Ollama is a closed port (it holds nothing to unload), the card cannot be read, and tasks start
    eagerly, as mitmproxy's master makes them."""
    loop = asyncio.get_running_loop()
    loop.set_task_factory(asyncio.eager_task_factory)
    context, arbitration, admin = proxy_with(lambda settings: Arbiter(settings, NoGpu()))
    with context as tctx:
        proxy = Proxy(tctx, arbitration, admin)
        proxy.turn_on(
            contextpaw_ollama=[f"http://127.0.0.1:{CLOSED_PORT}"],
            contextpaw_llamacpp=[f"http://127.0.0.1:{CLOSED_PORT + 1}"],
            contextpaw_llamacpp_log=str(tmp_path / "llama-server.log"),
            contextpaw_arbitrate_wait=2,
            contextpaw_min_hold=0,
        )
        yield proxy
        await arbitration.done()
    loop.set_task_factory(None)


async def test_real_arbiter_holds_ollama_then_refuses_a_server_that_dies(real: Proxy) -> None:
    chat = post("/api/chat", CHAT, port=CLOSED_PORT)
    await real.arbitration.request(chat)
    assert chat.response is None
    status = json.loads((await runtime_status(real, port=CLOSED_PORT)).content)
    assert (status["enabled"], status["owner"], status["in_flight"]["ollama"]) == (True, "ollama", 1)
    real.arbitration.response(chat)

    completion = post("/v1/chat/completions", CHAT, port=CLOSED_PORT + 1)
    await real.arbitration.request(completion)
    assert completion.response.status_code == 503
    error = json.loads(completion.response.content)["error"]
    assert "llama-server exited with code 3 during startup" in error["message"]
    status = json.loads((await runtime_status(real, port=CLOSED_PORT)).content)
    assert (status["owner"], status["in_flight"], status["counters"]["failures"]) == (
        "ollama", {"ollama": 0, "llamacpp": 0}, 1,
    )  # fmt: skip
    assert real.arbitration.metrics()["runtime_failures"] == 1.0


async def test_a_client_that_goes_away_stops_waiting_for_its_runtime(proxy: Proxy) -> None:
    proxy.turn_on()
    gave_up = asyncio.Event()

    async def forever(kind: str, flow_id: Hashable, model: str | None = None) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            gave_up.set()
            raise

    proxy.arbiter.acquire = forever
    chat = post("/api/chat", CHAT, port=OLLAMA_PORT)
    hook = asyncio.create_task(proxy.arbitration.request(chat))
    await asyncio.sleep(0.1)
    assert not hook.done()
    chat.client_conn.timestamp_end = time.time()  # the client disconnected
    await asyncio.wait_for(hook, 2)
    assert gave_up.is_set() and chat.response is None
