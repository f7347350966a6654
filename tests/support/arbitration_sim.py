"""The real arbiter (`contextpaw.gpu.arbiter.Arbiter`) replayed against request schedules and VRAM
traces, on a simulated clock, with a fake NVML and fake runtimes.

The clock: an asyncio loop whose `time()` is virtual and whose selector, when nothing is ready, moves
the clock to the next timer instead of sleeping; so 120 s of traffic replay in about a second, and
every wait, timeout and hold in the arbiter runs as written. The fakes replace only the arbiter's
two runtimes on its `card` (Ollama's HTTP API, and the supervisor that starts and stops
llama-server; both with their GGUF estimates); every decision, phase, drain, hold and cancellation
is the arbiter's own. Evictions under a running request are counted from the clients' side. Used
by `scripts/bench/bench_arbitration.py` and `tests/scripts/test_bench_arbitration.py`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import selectors
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from contextpaw.gpu import card as arbiter_card
from contextpaw.gpu.arbiter import Arbiter, ArbiterSettings, RuntimeUnavailable
from contextpaw.gpu.nvml import DeviceMemory, ProcessMemory, VramReading
from contextpaw.gpu.placement import Release
from contextpaw.gpu.router import RouterServer
from contextpaw.gpu.supervisor import ServerState
from contextpaw.wire import Kind

GB = 10**9
LLAMA_PID = 4242


class _VirtualSelector(selectors.DefaultSelector):
    """Real file events (the loop's self-pipe, worker threads finishing) first; when there are
    none, the clock jumps to the next timer."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        events = super().select(0 if timeout == 0 else 0.002)
        if events or not timeout:
            return events
        self.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


@dataclass
class SimulatedCard:
    """One GPU: its total, what other processes take over time, and what the runtimes hold."""

    total: int
    others: Callable[[float], int] = lambda t: 0
    held: dict[Kind, int] = field(default_factory=dict)
    over_commits: int = 0
    serving: dict[Kind, int] = field(default_factory=lambda: dict.fromkeys(Kind, 0))
    """Requests each runtime is answering now."""
    evicted_in_flight: int = 0

    def used(self, now: float) -> int:
        return self.others(now) + sum(self.held.values())

    def evict(self, kind: Kind) -> None:
        """A runtime is being evicted: an eviction under a request would cut its answer off."""
        self.evicted_in_flight += self.serving[kind] > 0

    def take(self, kind: Kind, amount: int, now: float) -> None:
        self.held[kind] = amount
        if self.used(now) > self.total:
            self.over_commits += 1


class FakeNvml:
    def __init__(self, card: SimulatedCard, clock: Callable[[], float]) -> None:
        self.card, self.clock = card, clock

    def read(self) -> VramReading:
        now = self.clock()
        used = min(self.card.used(now), self.card.total)
        processes = (ProcessMemory(LLAMA_PID, "llama-server", self.card.held[Kind.LLAMACPP]),) if Kind.LLAMACPP in self.card.held else ()
        device = DeviceMemory(0, "simulated", self.card.total, used, self.card.total - used, processes)
        return VramReading((device,))

    def close(self) -> None:
        pass


class SimulatedOllama:
    """Ollama's API as the arbiter reads it: the model the card holds for it, unloaded in a second."""

    def __init__(self, card: SimulatedCard, need: int) -> None:
        self.card, self.need_bytes = card, need

    async def listed(self) -> list[dict[str, Any]]:
        held = self.card.held.get(Kind.OLLAMA)
        return [{"name": "model", "size_vram": held}] if held else []

    async def as_json(self) -> list[dict[str, Any]]:
        return await self.listed()

    async def held(self) -> int:
        return self.card.held.get(Kind.OLLAMA, 0)

    async def need(self, model: str | None = None) -> int:
        return self.need_bytes

    async def unload(self) -> None:
        self.card.evict(Kind.OLLAMA)
        await asyncio.sleep(1.0)
        self.card.held.pop(Kind.OLLAMA, None)


class SimulatedServer:
    """llama-server as the arbiter's supervisor runs it: up `start_s` after it is started (unless
    nobody waits any more), down a second after it is stopped."""

    def __init__(self, card: SimulatedCard, need: int, start_s: float) -> None:
        self.card, self.need_bytes, self.start_s = card, need, start_s
        self.state = ServerState.STOPPED
        self._stopped = asyncio.Event()

    @property
    def running(self) -> bool:
        return self.state is ServerState.READY

    async def need(self, model: str | None = None) -> int:
        return self.need_bytes

    async def serves(self, model: str | None) -> bool:
        return True

    async def start(self, keep_going: Callable[[], None]) -> None:
        await asyncio.sleep(self.start_s)
        keep_going()
        self.state, self._stopped = ServerState.READY, asyncio.Event()
        self.card.take(Kind.LLAMACPP, self.need_bytes, asyncio.get_running_loop().time())

    async def stop(self) -> None:
        if not self.running:
            return
        self.card.evict(Kind.LLAMACPP)
        await asyncio.sleep(1.0)  # stop and reap
        self.card.held.pop(Kind.LLAMACPP, None)
        self.state = ServerState.STOPPED
        self._stopped.set()

    async def died(self) -> None:
        """It never dies on its own here."""
        await self._stopped.wait()

    def held_bytes(self, reading: VramReading) -> int | None:
        return reading.process_bytes(LLAMA_PID)

    def as_json(self, reading: Any) -> dict[str, Any] | None:
        return {"pid": LLAMA_PID} if self.running else None


class SimulatedRouter(RouterServer):
    """llama-server in router mode: the process up `start_s` after it is started, then each model
    loaded in `load_s` when asked, and unloaded in a second; what the card holds for it is the sum
    of its loaded models' needs."""

    state = ServerState.STOPPED  # its own, not the supervisor's

    def __init__(self, card: SimulatedCard, needs: dict[str, int], start_s: float, load_s: float) -> None:  # the I/O is all here
        self.card, self.needs, self.start_s, self.load_s = card, needs, start_s, load_s
        self.models: set[str] = set()
        self.loads = {}

    @property
    def running(self) -> bool:
        return self.state is ServerState.READY

    async def start(self, keep_going: Callable[[], None]) -> None:
        await asyncio.sleep(self.start_s)
        keep_going()
        self.state = ServerState.READY

    async def stop(self) -> None:
        self.models.clear()
        self.card.held.pop(Kind.LLAMACPP, None)
        self.state = ServerState.STOPPED

    async def died(self) -> None:
        await asyncio.Event().wait()

    async def loaded(self) -> set[str]:
        return set(self.models)

    async def serves(self, model: str | None) -> bool:
        return model is None or model in self.models

    async def need(self, model: str | None = None) -> int | None:
        return self.needs.get(model) if model else None

    async def load(self, model: str, keep_going: Callable[[], None]) -> None:
        await asyncio.sleep(self.load_s)
        keep_going()
        self.models.add(model)
        self.card.take(Kind.LLAMACPP, sum(self.needs[m] for m in self.models), asyncio.get_running_loop().time())

    async def unload(self) -> Release | None:
        if not self.models:
            return None
        self.card.evict(Kind.LLAMACPP)
        await asyncio.sleep(1.0)
        self.models.clear()
        self.card.held.pop(Kind.LLAMACPP, None)
        return None

    def held_bytes(self, reading: VramReading) -> int | None:
        return reading.process_bytes(LLAMA_PID)

    def as_json(self, reading: Any) -> dict[str, Any] | None:
        return {"pid": LLAMA_PID, "loaded": sorted(self.models)} if self.running else None


class SimulatedArbiter(Arbiter):
    """The real arbiter with simulated runtimes behind it: Ollama loads its model on a request it
    admits (`load_s`), llama-server starts in `start_s`, and both give their memory back when evicted."""

    def __init__(
        self,
        settings: ArbiterSettings,
        card: SimulatedCard,
        needs: dict[Kind, int],
        start_s: float = 4.0,
        load_s: float = 3.0,
        router: dict[str, int] | None = None,
    ) -> None:
        nvml = FakeNvml(card, asyncio.get_running_loop().time)  # read in a worker thread
        super().__init__(settings, nvml)
        self.simulated, self.needs, self.load_s = card, needs, load_s
        ollama = SimulatedOllama(card, needs[Kind.OLLAMA])
        server: SimulatedServer | SimulatedRouter = SimulatedServer(card, needs[Kind.LLAMACPP], start_s)
        if router is not None:
            server = SimulatedRouter(card, router, 1.0, load_s)
        self.card = arbiter_card.Card(nvml, ollama, server,  # type: ignore[arg-type]
                                      release_timeout=settings.release_timeout, poll_interval=settings.poll_interval)  # fmt: skip

    async def serve_ollama(self) -> None:
        """An admitted Ollama request loads its model first, as Ollama does."""
        if Kind.OLLAMA not in self.simulated.held:
            await asyncio.sleep(self.load_s)
            self.simulated.take(Kind.OLLAMA, self.needs[Kind.OLLAMA], asyncio.get_running_loop().time())


@dataclass(frozen=True)
class Request:
    at: float
    kind: Kind
    seconds: float = 0.5
    model: str | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    card_bytes: int
    needs: dict[Kind, int]
    schedule: tuple[Request, ...]
    others: Callable[[float], int] = lambda t: 0
    min_hold: float = 20.0
    router: dict[str, int] | None = None
    """A router llama-server's models and what each takes (None: a plain llama-server)."""


def alternating(seconds: float, hz: float = 1.0) -> tuple[Request, ...]:
    """Two clients, one per runtime, each asking at `hz`, half a period apart."""
    period = 1 / hz
    times = [n * period for n in range(int(seconds * hz))]
    return tuple(
        sorted([Request(t, Kind.OLLAMA) for t in times] + [Request(t + period / 2, Kind.LLAMACPP) for t in times], key=lambda r: r.at)
    )


@dataclass
class Outcome:
    scenario: str
    switches: int
    dropped: int
    evicted_in_flight: int
    over_commits: int
    decisions_logged: int
    served: int
    most_resident: int
    cancelled: int
    min_hold: float
    misplaced: int = 0
    """Requests admitted to a router whose model was not loaded (the router would load it unplaced)."""

    def as_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "switches": self.switches,
            "dropped": self.dropped,
            "evicted_in_flight": self.evicted_in_flight,
            "over_commits": self.over_commits,
            "decisions_logged": self.decisions_logged,
            "served": self.served,
            "most_resident": self.most_resident,
            "cancelled": self.cancelled,
            "misplaced": self.misplaced,
        }


class _Decisions(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("contextpaw runtime: ") and " for " in record.getMessage():
            self.count += 1


def replay(scenario: Scenario) -> Outcome:
    """Run the schedule to its end on a simulated clock; count what the issue asks for."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(_replay(scenario))
    finally:
        loop.close()


async def _replay(scenario: Scenario) -> Outcome:
    card = SimulatedCard(scenario.card_bytes, scenario.others)
    settings = ArbiterSettings("http://ollama.invalid", "http://llama.invalid", llamacpp_cmd="true", min_hold=scenario.min_hold)
    arbiter = SimulatedArbiter(settings, card, scenario.needs, router=scenario.router)
    decisions = _Decisions()
    logger = logging.getLogger("contextpaw.gpu.arbiter")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(decisions)
    dropped = served = most = misplaced = 0
    loop = asyncio.get_running_loop()

    async def client(n: int, request: Request) -> None:
        nonlocal dropped, served, most, misplaced
        await asyncio.sleep(max(0.0, request.at - loop.time()))
        try:
            async with arbiter.use(request.kind, request.model):
                most = max(most, len(arbiter._resident))
                misplaced += not await arbiter.card.serves(request.kind, request.model)
                card.serving[request.kind] += 1
                try:
                    if request.kind is Kind.OLLAMA:
                        await arbiter.serve_ollama()
                    await asyncio.sleep(request.seconds)
                finally:
                    card.serving[request.kind] -= 1
                served += 1
        except RuntimeUnavailable:
            dropped += 1

    try:
        await asyncio.gather(*(client(n, r) for n, r in enumerate(scenario.schedule)))
    finally:
        logger.removeHandler(decisions)
        logger.setLevel(level)
        await arbiter.aclose()
    counters = arbiter.counters
    return Outcome(scenario.name, counters.switches, dropped, card.evicted_in_flight, card.over_commits,
                   decisions.count, served, most, counters.cancelled, scenario.min_hold, misplaced)  # fmt: skip


def round_robin(seconds: float, hz: float, clients: tuple[tuple[Kind, str | None], ...]) -> tuple[Request, ...]:
    """One client per (runtime, model), each asking at `hz`, spread evenly over a period."""
    period = 1 / hz
    return tuple(
        sorted(
            (
                Request(n * period + i * period / len(clients), kind, model=model)
                for n in range(int(seconds * hz))
                for i, (kind, model) in enumerate(clients)
            ),
            key=lambda r: r.at,
        )
    )


ROUTER_CLIENTS = ((Kind.OLLAMA, "ollama-model"), (Kind.LLAMACPP, "small"), (Kind.LLAMACPP, "big"))


def scenarios(min_hold: float = 20.0) -> list[Scenario]:
    """The issue's four: thrashing clients; the earlier proxy's 24 GB card; a card both fit on;
    another process taking 10 GB mid-run. Then a router llama-server's two models and one Ollama
    model on one card: where the router's two fit together beside nothing else, and where each
    takes the card alone."""
    big = {Kind.OLLAMA: int(15.1 * GB), Kind.LLAMACPP: int(11.0 * GB)}
    return [
        Scenario("alternating clients, 1 Hz, 120 s", 24 * GB, big, alternating(120), min_hold=min_hold),
        Scenario("24 GB card, 15.1 GB + 11.0 GB", 24 * GB, big, alternating(60, 0.5), min_hold=min_hold),
        Scenario("80 GB card, both fit", 80 * GB, big, alternating(60), min_hold=min_hold),
        Scenario(
            "another process takes 10 GB at 30 s",
            32 * GB,
            big,
            (Request(0, Kind.OLLAMA), *(Request(40 + 2 * n, Kind.LLAMACPP) for n in range(10)), Request(70, Kind.OLLAMA)),
            others=lambda t: 10 * GB if t >= 30 else 0,
            min_hold=min_hold,
        ),  # fmt: skip
        Scenario(
            "router: 6 GB + 11 GB models and Ollama's 15.1 GB, 24 GB card",
            24 * GB,
            big,
            round_robin(120, 1.0, ROUTER_CLIENTS),
            min_hold=min_hold,
            router={"small": 6 * GB, "big": 11 * GB},
        ),  # fmt: skip
        Scenario(
            "router: 9 GB + 11 GB models and Ollama's 15.1 GB, 16 GB card",
            16 * GB,
            big,
            round_robin(120, 1.0, ROUTER_CLIENTS),
            min_hold=min_hold,
            router={"small": 9 * GB, "big": 11 * GB},
        ),  # fmt: skip
    ]


def switch_bound(seconds: float, min_hold: float) -> int:
    return math.ceil(seconds / min_hold)
