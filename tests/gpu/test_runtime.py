"""Runtime arbitration: the pure decisions, then the arbiter against fakes.

The fakes move together as the real things would: an Ollama stub whose model holds VRAM until some
time after it leaves ``/api/ps``, a fake NVML that adds up the stub's models and the stand-in
llama-server while its process lives (and for a while after, as the driver does), and a stand-in
llama-server: a tiny script that answers ``/health`` with 503 while "loading", then 200.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from contextpaw.core.lifecycle import IllegalTransition, advance
from contextpaw.gpu import arbiter as runtime
from contextpaw.gpu import supervisor
from contextpaw.gpu.arbiter import Arbiter, ArbiterSettings, RuntimeUnavailable
from contextpaw.gpu.nvml import DeviceMemory, ProcessMemory, VramReading
from contextpaw.gpu.placement import (
    PHASES,
    Admit,
    Decline,
    Load,
    Phase,
    Release,
    Room,
    Wait,
    blocking,
    decide,
    retry_after,
)
from contextpaw.gpu.supervisor import SERVER_STATES, LlamaServer, ServerState, start_problem
from contextpaw.wire import Kind
from support.common import LOOPBACK, free_port
from support.fake_ollama import fake_ollama_app
from support.gpus import NoGpu

MIB = 1 << 20
GIB = 1 << 30
TOTAL_BYTES = 12 * GIB  # the model and the server do not fit together: a switch must evict
BASE_BYTES = 1 * GIB
MODEL = "qwen3:8b"
MODEL_BYTES = 6 * GIB
SERVER_BYTES = 9 * GIB
UNLOAD = {"model": MODEL, "keep_alive": 0}
OLLAMA, LLAMACPP = Kind.OLLAMA, Kind.LLAMACPP
FAST = {
    "wait_timeout": 5.0,
    "drain_timeout": 2.0,
    "switch_timeout": 5.0,
    "health_timeout": 3.0,
    "stop_grace": 0.3,
    "release_timeout": 1.0,
    "poll_interval": 0.02,
    "min_hold": 0.0,
}

SERVER_SCRIPT = r"""
import http.server, os, signal, sys, time

port, load_seconds, pidfile = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if "--ignore-sigterm" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(pidfile, "w") as out:
    out.write(str(os.getpid()))
ready_at = time.monotonic() + load_seconds


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if time.monotonic() >= ready_at else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


print("fake llama-server: loading model", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


# --- decisions ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("owner", "switching_to", "wanted", "cannot_start", "expected"),
    [
        (OLLAMA, None, OLLAMA, None, Admit()),
        (LLAMACPP, None, LLAMACPP, "no command", Admit()),  # a running server needs no start command
        (OLLAMA, LLAMACPP, OLLAMA, None, Wait()),  # the outgoing owner waits, or the drain never ends
        (None, LLAMACPP, LLAMACPP, None, Wait()),
        (OLLAMA, None, LLAMACPP, "no command", Decline("no command")),
        (OLLAMA, None, LLAMACPP, None, Load(LLAMACPP, evict=OLLAMA)),  # no reading: the other goes
        (None, None, OLLAMA, None, Load(OLLAMA)),
    ],
)
def test_decide_without_readings_gives_the_gpu_to_one_runtime(
    owner: Kind | None, switching_to: Kind | None, wanted: Kind, cannot_start: str | None, expected: object
) -> None:
    resident = {owner: 0.0} if owner else {}
    assert decide(resident, switching_to, wanted, cannot_start, now=100.0, min_hold=20.0) == expected


def test_what_fits_beside_the_other_runtime_is_loaded_without_evicting_it() -> None:
    room = Room(free_bytes=40 * GIB, held_bytes={OLLAMA: 15 * GIB})
    assert decide({OLLAMA: 0.0}, None, LLAMACPP, None, now=1.0, min_hold=20.0, need=11 * GIB, room=room) == Load(LLAMACPP)


def test_what_does_not_fit_evicts_the_other_runtime_once_its_hold_is_over() -> None:
    room = Room(free_bytes=8 * GIB, held_bytes={OLLAMA: 15 * GIB})
    held = decide({OLLAMA: 90.0}, None, LLAMACPP, None, now=100.0, min_hold=20.0, need=11 * GIB, room=room)
    assert isinstance(held, Wait) and held.until == 110.0 and "min_hold" in held.reason
    assert decide({OLLAMA: 90.0}, None, LLAMACPP, None, now=110.0, min_hold=20.0, need=11 * GIB, room=room) == Load(LLAMACPP, evict=OLLAMA)


def test_what_would_not_fit_even_alone_is_refused_rather_than_over_committed() -> None:
    room = Room(free_bytes=2 * GIB, held_bytes={OLLAMA: 6 * GIB})  # another process holds the rest
    refused = decide({OLLAMA: 0.0}, None, LLAMACPP, None, now=100.0, min_hold=20.0, need=11 * GIB, room=room)
    assert isinstance(refused, Decline) and "8192 MiB would be free" in refused.reason


def test_a_router_loads_a_model_beside_its_others_where_it_fits() -> None:
    room = Room(free_bytes=12 * GIB, held_bytes={LLAMACPP: 6 * GIB})
    assert decide({LLAMACPP: 95.0}, None, LLAMACPP, None, now=100.0, min_hold=20.0, need=11 * GIB, room=room, serving=False) == Load(
        LLAMACPP
    )


def test_a_router_unloads_its_other_models_for_one_that_does_not_fit_once_their_hold_is_over() -> None:
    room = Room(free_bytes=4 * GIB, held_bytes={LLAMACPP: 9 * GIB})
    held = decide({LLAMACPP: 90.0}, None, LLAMACPP, None, now=100.0, min_hold=20.0, need=11 * GIB, room=room, serving=False)
    assert isinstance(held, Wait) and held.until == 110.0
    swapped = decide({LLAMACPP: 90.0}, None, LLAMACPP, None, now=110.0, min_hold=20.0, need=11 * GIB, room=room, serving=False)
    assert swapped == Load(LLAMACPP, evict=LLAMACPP)
    assert decide({LLAMACPP: 90.0}, None, LLAMACPP, None, now=110.0, min_hold=20.0, serving=False) == Load(LLAMACPP, evict=LLAMACPP), (
        "without a reading, the models it holds go: nothing else is safe"
    )


def test_a_router_model_that_only_ollamas_memory_would_make_room_for_evicts_ollama() -> None:
    room = Room(free_bytes=1 * GIB, held_bytes={LLAMACPP: 2 * GIB, OLLAMA: 15 * GIB})
    resident = {LLAMACPP: 0.0, OLLAMA: 0.0}
    assert decide(resident, None, LLAMACPP, None, now=100.0, min_hold=20.0, need=11 * GIB, room=room, serving=False) == Load(
        LLAMACPP, evict=OLLAMA
    )


def test_only_requests_on_the_evicted_runtime_block_a_switch() -> None:
    assert blocking({OLLAMA: 2, LLAMACPP: 3}, OLLAMA) == 2
    assert blocking({OLLAMA: 2, LLAMACPP: 3}, LLAMACPP) == 3
    assert blocking({OLLAMA: 2, LLAMACPP: 3}, None) == 0, "nothing evicted, nothing to wait for"


def test_release_margin_has_a_floor_and_grows_with_what_was_held() -> None:
    small = Release(before_bytes=10 * GIB, held_bytes=2 * GIB)
    assert small.done(8 * GIB + 256 * MIB)
    assert not small.done(8 * GIB + 257 * MIB)
    large = Release(before_bytes=30 * GIB, held_bytes=20 * GIB)
    assert large.done(11 * GIB)
    assert not large.done(11 * GIB + 1)


@pytest.mark.parametrize(("mean", "seconds"), [(None, 5), (0.2, 1), (7.1, 8)])
def test_retry_after_is_about_one_switch(mean: float | None, seconds: int) -> None:
    assert retry_after(mean) == seconds


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("", "no contextpaw_llamacpp_cmd is configured"),
        ('llama-server -m "unclosed', "cannot be parsed: No closing quotation"),
        ("/nonexistent/llama-server -m model.gguf", "'/nonexistent/llama-server' is not an executable"),
    ],
)
def test_start_problem_names_what_is_wrong(command: str, problem: str) -> None:
    assert problem in (start_problem(command) or "")


def test_an_executable_command_has_no_start_problem() -> None:
    assert start_problem(f"{shlex.quote(sys.executable)} -V") is None


def test_a_switch_takes_only_the_steps_its_phase_table_lists() -> None:
    assert advance(PHASES, Phase.IDLE, Phase.DRAINING) is Phase.DRAINING
    assert advance(PHASES, Phase.DRAINING, Phase.DRAINING) is Phase.DRAINING, "staying is no step"
    with pytest.raises(IllegalTransition, match="cannot go to"):
        advance(PHASES, Phase.IDLE, Phase.STARTING_SERVER)  # nothing starts before the drain
    with pytest.raises(IllegalTransition):
        advance(PHASES, Phase.RELEASING_SERVER, Phase.STARTING_SERVER)  # a stopped server is not the target


def test_every_phase_is_reached_from_idle_and_every_switch_can_settle() -> None:
    reached, todo = {Phase.IDLE}, [Phase.IDLE]
    while todo:
        for following in PHASES[todo.pop()] - reached:
            reached.add(following)
            todo.append(following)
    assert reached == set(Phase)
    assert all({Phase.IDLE, Phase.READY} & PHASES[phase] for phase in Phase if phase is not Phase.IDLE)


@pytest.mark.parametrize(
    ("current", "to"),
    [(ServerState.STOPPED, ServerState.READY), (ServerState.STOPPING, ServerState.STARTING), (ServerState.READY, ServerState.STARTING)],
)
def test_llama_server_is_started_only_once_stopped_and_ready_only_after_starting(current: ServerState, to: ServerState) -> None:
    with pytest.raises(IllegalTransition):
        advance(SERVER_STATES, current, to)


# --- fakes --------------------------------------------------------------------------------------


class OllamaStub:
    """``/api/ps`` and ``keep_alive: 0`` unloads. An unloaded model leaves the list after
    ``unload_delay`` and frees its VRAM ``vram_lag`` later (None: never, as in ollama#9509)."""

    def __init__(self) -> None:
        self.listed = {MODEL: MODEL_BYTES}
        self.vram = dict(self.listed)
        self.requests: list[dict[str, Any]] = []
        self.unload_delay = 0.03
        self.vram_lag: float | None = 0.0
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/ps", self.ps)
        app.router.add_post("/api/generate", self.generate)
        return app

    @property
    def vram_bytes(self) -> int:
        return sum(self.vram.values())

    async def ps(self, request: web.Request) -> web.Response:
        models = [{"name": name, "model": name, "size": size, "size_vram": size} for name, size in self.listed.items()]
        return web.json_response({"models": models})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        asyncio.get_running_loop().call_later(self.unload_delay, self._forget, body["model"])
        return web.json_response({"model": body["model"], "response": "", "done": True, "done_reason": "unload"})

    def _forget(self, name: str) -> None:
        self.listed.pop(name, None)
        if self.vram_lag is not None:
            asyncio.get_running_loop().call_later(self.vram_lag, self.vram.pop, name, None)


class FakeGpu:
    """One 24 GiB card: a base load, the stub's models, and the stand-in server from the moment its
    pid file appears until ``server_lag`` after its process is gone."""

    def __init__(self, ollama: OllamaStub, pidfile: Path) -> None:
        self.ollama = ollama
        self.pidfile = pidfile
        self.server_lag = 0.0
        self.per_process = True
        self._dead_since: float | None = None

    def read(self) -> VramReading:
        pid, alive = self._server()
        held = SERVER_BYTES if alive or self._lingering(pid) else 0
        used = BASE_BYTES + self.ollama.vram_bytes + held
        processes = (ProcessMemory(pid, "llama-server", SERVER_BYTES),) if alive and pid else ()
        device = DeviceMemory(0, "Fake RTX 24G", TOTAL_BYTES, used, TOTAL_BYTES - used,
                              processes if self.per_process else None)  # fmt: skip
        return VramReading((device,))

    def close(self) -> None:
        pass

    def _server(self) -> tuple[int | None, bool]:
        try:
            pid = int(self.pidfile.read_text())
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError):
            return None, False
        except ProcessLookupError:
            return pid, False
        self._dead_since = None
        return pid, True

    def _lingering(self, pid: int | None) -> bool:
        if pid is None:
            return False
        if self._dead_since is None:
            self._dead_since = time.monotonic()
        return time.monotonic() - self._dead_since < self.server_lag


@dataclass
class Spawn:
    used_bytes: int  # what the card held the moment llama-server was started
    server: LlamaServer


@dataclass
class Rig:
    ollama: OllamaStub
    gpu: FakeGpu
    spawns: list[Spawn]
    tmp_path: Path
    arbiters: list[Arbiter]

    def arbiter(self, load_seconds: float = 0.0, flags: str = "", gpu: Any = None, **overrides: Any) -> Arbiter:
        port = free_port()
        script = self.tmp_path / "fake_llama_server.py"
        script.write_text(SERVER_SCRIPT)
        argv = [sys.executable, str(script), str(port), str(load_seconds), str(self.gpu.pidfile), *flags.split()]
        defaults = {
            "ollama_url": self.ollama.url,
            "llamacpp_url": f"http://{LOOPBACK}:{port}",
            "llamacpp_cmd": shlex.join(argv),
            "llamacpp_log": self.tmp_path / "llama-server.log",
            **FAST,
        }
        settings = ArbiterSettings(**{**defaults, **overrides})
        arbiter = Arbiter(settings, gpu or self.gpu)
        self.arbiters.append(arbiter)
        return arbiter


@pytest.fixture
async def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Rig]:
    ollama = OllamaStub()
    server = TestServer(ollama.app(), host=LOOPBACK)
    await server.start_server()
    ollama.url = f"http://{LOOPBACK}:{server.port}"
    gpu = FakeGpu(ollama, tmp_path / "llama.pid")
    spawns: list[Spawn] = []
    spawn = LlamaServer.spawn.__func__  # type: ignore[attr-defined]

    async def recorded(cls: type[LlamaServer], argv: list[str], log_path: Path) -> LlamaServer:
        used = gpu.read().used_bytes
        started = await spawn(cls, argv, log_path)
        spawns.append(Spawn(used, started))
        return started

    monkeypatch.setattr(LlamaServer, "spawn", classmethod(recorded))
    rig = Rig(ollama, gpu, spawns, tmp_path, [])
    yield rig
    for arbiter in rig.arbiters:
        await arbiter.aclose()
    await server.close()


async def claim_for_ollama(arbiter: Arbiter) -> None:
    async with arbiter.use("ollama"):
        pass


async def eventually(arbiter: Arbiter, holds: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first status for which ``holds`` is true, within two seconds."""
    async with asyncio.timeout(2):
        while not holds(status := await arbiter.status()):
            await asyncio.sleep(0.01)
    return status


# --- switching ----------------------------------------------------------------------------------


async def test_switch_to_llamacpp_unloads_ollama_and_waits_for_its_vram(rig: Rig) -> None:
    rig.ollama.vram_lag = 0.2
    arbiter = rig.arbiter()
    await claim_for_ollama(arbiter)
    assert rig.ollama.requests == []
    async with arbiter.use("llamacpp"):
        status = await arbiter.status()
    assert rig.ollama.requests == [UNLOAD]
    assert [spawn.used_bytes for spawn in rig.spawns] == [BASE_BYTES]  # nothing else on the card
    assert status["owner"] == "llamacpp"
    assert status["in_flight"] == {"ollama": 0, "llamacpp": 1}
    assert status["last_switch"]["source"] == "ollama"
    assert status["last_switch"]["seconds"] >= 0.2
    assert status["llamacpp_process"]["vram_bytes"] == SERVER_BYTES
    assert status["vram"][0]["used_bytes"] == BASE_BYTES + SERVER_BYTES
    assert status["counters"]["switches"] == 1  # Ollama's first load evicted nothing: not a switch
    json.dumps(status)


async def test_vram_that_never_comes_back_fails_before_llama_server_starts(rig: Rig) -> None:
    rig.ollama.vram_lag = None
    arbiter = rig.arbiter()
    await claim_for_ollama(arbiter)
    with pytest.raises(RuntimeUnavailable, match="Ollama was evicted but VRAM did not come back within 1s: 7168 MiB"):
        await arbiter.acquire("llamacpp", "flow")
    assert rig.spawns == []
    status = await arbiter.status()
    assert status["owner"] == "ollama"
    assert status["counters"]["failures"] == 1
    assert "VRAM did not come back" in status["errors"][-1]


@pytest.mark.parametrize("per_process", [True, False], ids=["nvml-per-process", "measured-at-start"])
async def test_switch_to_ollama_stops_llama_server_and_waits_for_its_memory(rig: Rig, per_process: bool) -> None:
    rig.gpu.server_lag, rig.gpu.per_process = 0.2, per_process
    arbiter = rig.arbiter()
    async with arbiter.use("llamacpp"):
        pass
    async with arbiter.use("ollama"):
        assert rig.gpu.read().used_bytes == BASE_BYTES
        status = await arbiter.status()
    assert rig.spawns[0].server.process.returncode == -signal.SIGTERM
    assert status["owner"] == "ollama"
    assert status["llamacpp_process"] is None


async def test_a_stopped_server_whose_memory_stays_leaves_the_gpu_to_nobody(rig: Rig) -> None:
    rig.gpu.server_lag = 30
    arbiter = rig.arbiter(release_timeout=0.2)
    async with arbiter.use("llamacpp"):
        pass
    with pytest.raises(RuntimeUnavailable, match="llama-server was evicted but VRAM did not come back within 0.2s"):
        await claim_for_ollama(arbiter)
    status = await arbiter.status()
    assert (status["owner"], status["llamacpp_process"]) == (None, None)
    assert rig.spawns[0].server.process.returncode == -signal.SIGTERM


async def test_sigterm_ignored_gets_sigkill_after_the_grace_period(rig: Rig) -> None:
    arbiter = rig.arbiter(flags="--ignore-sigterm")
    async with arbiter.use("llamacpp"):
        pass
    started = time.monotonic()
    await claim_for_ollama(arbiter)
    assert rig.spawns[0].server.process.returncode == -signal.SIGKILL
    assert time.monotonic() - started >= FAST["stop_grace"]


async def test_without_a_start_command_ollama_is_not_evicted(rig: Rig) -> None:
    arbiter = rig.arbiter(llamacpp_cmd="")
    await claim_for_ollama(arbiter)
    with pytest.raises(RuntimeUnavailable, match="no contextpaw_llamacpp_cmd is configured") as refused:
        await arbiter.acquire("llamacpp", "flow")
    assert refused.value.retry_after is None
    assert rig.ollama.requests == []
    assert MODEL in rig.ollama.listed
    status = await arbiter.status()
    assert (status["owner"], status["counters"]["refused"]) == ("ollama", 1)


async def test_a_start_command_that_exits_is_reported_with_its_log_and_ollama_keeps_the_gpu(rig: Rig) -> None:
    crash = "print('error: failed to load model /models/missing.gguf'); raise SystemExit(3)"
    arbiter = rig.arbiter(llamacpp_cmd=shlex.join([sys.executable, "-c", crash]))
    await claim_for_ollama(arbiter)
    with pytest.raises(RuntimeUnavailable) as failed:
        await arbiter.acquire("llamacpp", "flow")
    assert "llama-server exited with code 3 during startup" in str(failed.value)
    assert "error: failed to load model /models/missing.gguf" in str(failed.value)
    status = await arbiter.status()
    assert (status["owner"], status["counters"]["failures"]) == ("ollama", 1)
    await claim_for_ollama(arbiter)
    assert (await arbiter.status())["counters"]["switches"] == 0  # Ollama was served without a switch


async def test_health_timeout_stops_the_server_and_says_why(rig: Rig) -> None:
    # long enough for the stand-in to have said what it is doing, on a loaded machine too
    arbiter = rig.arbiter(load_seconds=30, health_timeout=2.5)
    unhealthy = r"did not answer http://127\.0\.0\.1:\d+/health with 200 within 2\.5s"
    with pytest.raises(RuntimeUnavailable, match=unhealthy) as failed:
        await arbiter.acquire("llamacpp", "flow")
    assert "fake llama-server: loading model" in str(failed.value)
    assert rig.spawns[0].server.process.returncode == -signal.SIGTERM
    status = await arbiter.status()
    assert (status["owner"], status["llamacpp_process"]) == ("ollama", None)  # it reloads on its next request
    assert "contextpaw starts:" in (rig.tmp_path / "llama-server.log").read_text()


async def test_a_server_that_dies_is_started_again_by_the_next_request(rig: Rig) -> None:
    arbiter = rig.arbiter()
    async with arbiter.use("llamacpp"):
        pass
    os.kill(rig.spawns[0].server.process.pid, signal.SIGKILL)
    status = await eventually(arbiter, lambda status: status["owner"] is None)
    assert "llama-server exited unexpectedly with code -9" in status["errors"][-1]
    async with arbiter.use("llamacpp"):
        pass
    assert len(rig.spawns) == 2


async def test_the_real_fake_ollama_is_emptied_before_llama_server_starts(rig: Rig) -> None:
    server = TestServer(fake_ollama_app(), host=LOOPBACK)
    await server.start_server()
    try:
        ollama_url = f"http://{LOOPBACK}:{server.port}"
        async with aiohttp.ClientSession() as http:
            await http.post(f"{ollama_url}/api/generate", json={"model": "fake:latest", "prompt": ""})
            assert len((await (await http.get(f"{ollama_url}/api/ps")).json())["models"]) == 1
            arbiter = rig.arbiter(ollama_url=ollama_url)
            async with arbiter.use("llamacpp"):
                assert (await (await http.get(f"{ollama_url}/api/ps")).json())["models"] == []
    finally:
        await server.close()


async def test_without_nvml_arbitration_runs_on_process_state_and_says_why(rig: Rig) -> None:
    arbiter = rig.arbiter(gpu=NoGpu())
    async with arbiter.use("llamacpp"):
        status = await arbiter.status()
    assert status["vram"] is None
    assert status["vram_unavailable"] == "NVML unavailable: NVML Shared Library Not Found"
    assert status["llamacpp_process"]["vram_bytes"] is None
    assert rig.ollama.requests == [UNLOAD]
    await claim_for_ollama(arbiter)
    assert rig.spawns[0].server.process.returncode == -signal.SIGTERM


async def test_a_switch_there_and_back_passes_its_phases_and_the_servers_states_in_order(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    steps: dict[str, list[str]] = {"arbiter": [], "server": []}

    def recorded(table: Any, current: Any, to: Any) -> Any:
        steps["arbiter" if table is PHASES else "server"].append(str(to))
        return advance(table, current, to)

    monkeypatch.setattr(runtime, "advance", recorded)
    monkeypatch.setattr(supervisor, "advance", recorded)
    arbiter = rig.arbiter()
    await claim_for_ollama(arbiter)  # Ollama lists its model: resident without a switch
    async with arbiter.use("llamacpp"):
        pass
    async with arbiter.use("ollama"):
        pass
    assert steps["arbiter"] == [
        "draining", "unloading ollama", "waiting for Ollama to release VRAM", "starting llama-server", "ready",
        "draining", "stopping llama-server", "waiting for llama-server to release VRAM", "ready",
    ]  # fmt: skip
    assert steps["server"] == ["starting", "ready", "stopping", "stopped"]


# --- requests around a switch -------------------------------------------------------------------


async def test_a_running_request_finishes_before_its_runtime_is_evicted(rig: Rig) -> None:
    arbiter = rig.arbiter()
    await arbiter.acquire("ollama", "long")
    switch = asyncio.create_task(arbiter.acquire("llamacpp", "next"))
    await asyncio.sleep(0.1)
    status = await arbiter.status()
    assert (status["state"], status["in_flight"]["ollama"], status["waiting"]["llamacpp"]) == ("draining", 1, 1)
    assert not switch.done()
    assert rig.ollama.requests == []
    arbiter.release("long")
    await switch
    assert rig.ollama.requests == [UNLOAD]


async def test_requests_arriving_during_a_switch_wait_and_share_it(rig: Rig) -> None:
    arbiter = rig.arbiter(load_seconds=0.2)
    await asyncio.gather(arbiter.acquire("llamacpp", "a"), arbiter.acquire("llamacpp", "b"))
    status = await arbiter.status()
    assert len(rig.spawns) == 1
    assert (status["in_flight"]["llamacpp"], status["counters"]["loads"]) == (2, 1)


async def test_a_request_for_the_outgoing_runtime_waits_for_the_switch_and_then_its_turn(rig: Rig) -> None:
    arbiter = rig.arbiter(load_seconds=0.1)
    await claim_for_ollama(arbiter)
    to_llamacpp = asyncio.create_task(arbiter.acquire("llamacpp", "a"))
    await eventually(arbiter, lambda status: status["switching_to"] == "llamacpp")
    to_ollama = asyncio.create_task(arbiter.acquire("ollama", "b"))
    await to_llamacpp
    await asyncio.sleep(0.05)
    assert not to_ollama.done()  # "a" runs on llama-server, which is not evicted under it
    arbiter.release("a")
    await to_ollama
    status = await arbiter.status()
    assert (status["owner"], status["counters"]["switches"]) == ("ollama", 2)


async def test_a_switch_nobody_waits_for_any_more_is_cancelled_and_nothing_is_evicted(rig: Rig) -> None:
    """Its only requester got a 503 (Retry-After) while Ollama drained: the switch stops there."""
    arbiter = rig.arbiter(wait_timeout=0.2)
    await arbiter.acquire("ollama", "long")
    with pytest.raises(RuntimeUnavailable, match=r"llamacpp is not ready after 0\.2s \(draining\)") as busy:
        await arbiter.acquire("llamacpp", "late")
    assert busy.value.retry_after is not None
    status = await eventually(arbiter, lambda status: status["counters"]["cancelled"] == 1)
    assert status["owner"] == "ollama" and status["switching_to"] is None
    arbiter.release("long")
    await asyncio.sleep(0.1)
    assert rig.spawns == [] and rig.ollama.requests == [], "nothing was evicted, nothing started"
    assert (await arbiter.status())["counters"]["wait_timeouts"] == 1


async def test_a_switch_whose_clients_went_away_while_llama_server_loads_stops_it(rig: Rig) -> None:
    arbiter = rig.arbiter(load_seconds=30, health_timeout=10)
    waiting = asyncio.create_task(arbiter.acquire("llamacpp", "gone"))
    await eventually(arbiter, lambda status: status["state"] == "starting llama-server")
    waiting.cancel()  # the client disconnected
    status = await eventually(arbiter, lambda status: status["counters"]["cancelled"] == 1 and status["switching_to"] is None)
    assert rig.spawns[0].server.process.returncode is not None and status["llamacpp_process"] is None


async def test_a_runtime_that_won_the_gpu_keeps_it_for_min_hold(rig: Rig) -> None:
    arbiter = rig.arbiter(min_hold=0.5)
    async with arbiter.use("llamacpp"):  # Ollama's model is evicted: llama-server wins the GPU now
        won = asyncio.get_running_loop().time()
    await claim_for_ollama(arbiter)
    held = asyncio.get_running_loop().time() - won
    assert held >= 0.45, f"Ollama got the GPU {held:.2f}s after llama-server won it, inside its hold"
    status = await arbiter.status()
    assert any(d["decision"] == "wait" and "min_hold" in d["reason"] for d in status["decisions"])
    assert any(d["decision"] == "load" and d["evict"] == "ollama" for d in status["decisions"])


async def test_a_drain_that_runs_out_abandons_the_switch_and_ollama_keeps_serving(rig: Rig) -> None:
    arbiter = rig.arbiter(drain_timeout=0.1)
    await arbiter.acquire("ollama", "long")
    with pytest.raises(RuntimeUnavailable, match=r"1 request\(s\) still running after 0\.1s; nothing was evicted"):
        await arbiter.acquire("llamacpp", "late")
    assert rig.ollama.requests == []
    await arbiter.acquire("ollama", "more")
    assert (await arbiter.status())["in_flight"]["ollama"] == 2


async def test_use_releases_when_the_request_fails(rig: Rig) -> None:
    arbiter = rig.arbiter()
    with pytest.raises(ConnectionResetError):
        async with arbiter.use("ollama"):
            raise ConnectionResetError
    assert (await arbiter.status())["in_flight"]["ollama"] == 0


async def test_a_flow_holds_once_and_releases_once(rig: Rig) -> None:
    arbiter = rig.arbiter()
    await arbiter.acquire("ollama", "flow")
    with pytest.raises(ValueError, match="already holds ollama"):
        await arbiter.acquire("ollama", "flow")
    arbiter.release("flow")
    arbiter.release("flow")
    arbiter.release("never-acquired")
    assert (await arbiter.status())["in_flight"] == {"ollama": 0, "llamacpp": 0}


async def test_closing_during_a_start_stops_the_server_and_turns_waiters_away(rig: Rig) -> None:
    arbiter = rig.arbiter(load_seconds=30)
    waiter = asyncio.create_task(arbiter.acquire("llamacpp", "flow"))
    while not rig.spawns:
        await asyncio.sleep(0.01)
    await arbiter.aclose()
    assert rig.spawns[0].server.process.returncode == -signal.SIGTERM
    with pytest.raises(RuntimeUnavailable, match="shutting down"):
        await waiter


async def test_runtime_status_shows_llama_servers_estimated_need_from_its_gguf(rig: Rig) -> None:
    from contextpaw.gpu.vram import estimate, read_shape
    from support.backends import locate_smollm2

    model = locate_smollm2()
    if model.path is None:
        pytest.skip(model.reason)
    arbiter = rig.arbiter(llamacpp_cmd=shlex.join([sys.executable, "-m", str(model.path), "-c", "2048"]))
    status = await arbiter.status()
    assert status["runtimes"]["llamacpp"]["need_bytes"] == estimate(read_shape(model.path), 2048).total_bytes
    assert status["runtimes"]["ollama"]["models"] is not None and status["free_vram_bytes"] is not None


async def test_ollamas_need_for_a_model_not_loaded_yet_comes_from_the_gguf_its_modelfile_names(rig: Rig) -> None:
    from contextpaw.gpu.vram import estimate, read_shape
    from support.backends import locate_smollm2

    model = locate_smollm2()
    if model.path is None:
        pytest.skip(model.reason)
    show = {"modelfile": f"# Modelfile\nFROM {model.path}\n", "parameters": "num_ctx                        2048"}

    async def shown(request: web.Request) -> web.Response:
        return web.json_response(show)

    async def none_loaded(request: web.Request) -> web.Response:
        return web.json_response({"models": []})

    app = web.Application()
    app.router.add_post("/api/show", shown)
    app.router.add_get("/api/ps", none_loaded)
    server = TestServer(app, host=LOOPBACK)
    await server.start_server()
    try:
        arbiter = rig.arbiter(ollama_url=f"http://{LOOPBACK}:{server.port}")
        assert await arbiter.card.ollama.need("smollm2") == estimate(read_shape(model.path), 2048).total_bytes
        assert await arbiter.card.ollama.need() is None, "without a model name nothing is known yet"
    finally:
        await server.close()
