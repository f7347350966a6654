"""Arbitration of one GPU between Ollama and a llama-server that ContextPaw starts, decided by VRAM.

A card that cannot hold both runtimes' models fails silently: Ollama loads on top of llama-server,
spills to system RAM and runs many times slower while reporting 100% GPU. The proxy sees every
request, so it knows which runtime is wanted. It brings that runtime up beside the other when the
estimate of its need fits what NVML says is free. When it does not fit, it waits until the other
runtime has held the GPU `min_hold` seconds and has no request in flight, evicts it, waits until
NVML shows the memory back, and only then lets the wanted runtime in. A switch nobody waits for any
more is cancelled.

Three parts: the rule and the phases of a switch are pure (:mod:`contextpaw.gpu.placement`); the two
runtimes' I/O is :class:`~contextpaw.gpu.ollama_models.OllamaModels` and
:class:`~contextpaw.gpu.supervisor.Supervisor`; :class:`Arbiter`, here, admits requests, drains and
switches on them. Its ``ollama`` and ``supervisor`` are the seam `tests/support/arbitration_sim.py`
replaces to replay traces. The addon calls :meth:`Arbiter.acquire` in its ``request`` hook and
:meth:`Arbiter.release` in ``response``/``error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from contextpaw.core import logs
from contextpaw.core.lifecycle import advance
from contextpaw.gpu.card import Card
from contextpaw.gpu.nvml import GpuProbe, NoVram, NvmlProbe, VramReading
from contextpaw.gpu.ollama_models import OllamaModels
from contextpaw.gpu.placement import (
    PHASES,
    Admission,
    Admit,
    Decline,
    Load,
    Phase,
    Room,
    SwitchCancelled,
    SwitchFailed,
    Wait,
    blocking,
    decide,
    retry_after,
)
from contextpaw.gpu.router import RouterServer, is_router_command
from contextpaw.gpu.supervisor import ServerState, Supervisor, default_log_path, start_problem
from contextpaw.gpu.vram import MIB
from contextpaw.wire import Kind

logger = logs.get(__name__)


@dataclass(frozen=True)
class ArbiterSettings:
    """Where the runtimes listen, how to start llama-server, and the bounds on every wait (seconds)."""

    ollama_url: str
    llamacpp_url: str
    llamacpp_cmd: str = ""
    llamacpp_log: Path = field(default_factory=default_log_path)
    wait_timeout: float = 240.0
    drain_timeout: float = 60.0
    switch_timeout: float = 180.0
    health_timeout: float = 120.0
    stop_grace: float = 10.0
    release_timeout: float = 30.0
    poll_interval: float = 0.25
    min_hold: float = 20.0
    """Seconds a runtime keeps the GPU once it has won it, whatever else is asked for."""


class RuntimeUnavailable(Exception):
    """The wanted runtime cannot serve this request: answer 503, with ``Retry-After`` when asking
    again later may help."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class SwitchRecord:
    source: Kind | None
    """The runtime evicted for it (None: the target fit beside what runs)."""
    target: Kind
    started_at: float
    model: str | None = None
    """The model the request that began it named (what a router llama-server loads)."""
    seconds: float | None = None
    error: str | None = None
    cancelled: bool = False


@dataclass
class ArbiterCounters:
    """Totals for metrics."""

    switches: int = 0
    failures: int = 0
    switch_seconds: float = 0.0
    refused: int = 0
    wait_timeouts: int = 0
    cancelled: int = 0
    loads: int = 0
    """Runtimes brought up, with an eviction (a switch) or without."""
    loaded_beside: int = 0
    """Runtimes brought up beside another one that stayed: both fit."""

    @property
    def mean_switch_seconds(self) -> float | None:
        attempts = self.loads + self.failures
        return self.switch_seconds / attempts if attempts else None


def _mib(value: int | None) -> str:
    return "?" if value is None else f"{value // MIB} MiB"


class DecisionLog:
    """The last decisions with the readings behind them, for the status page, each logged once:
    a wait that goes on is kept with the readings it began with, though requests for the other
    runtime are decided in between."""

    def __init__(self) -> None:
        self.entries: deque[dict[str, Any]] = deque(maxlen=20)
        self._last: dict[str, dict[str, Any]] = {}
        """The last entry for each wanted runtime."""

    def add(self, wanted: Kind, decision: Admission, need: int | None, room: Room | None, model: str | None = None) -> None:
        entry = {
            "wanted": str(wanted),
            "model": model,
            "decision": decision.word,
            "evict": str(decision.evict) if isinstance(decision, Load) and decision.evict else None,
            "reason": getattr(decision, "reason", None),
            "need_bytes": need,
            **(room.as_json() if room is not None else {"free_bytes": None, "held_bytes": None}),
        }
        same = ("model", "decision", "evict", "reason")
        last = self._last.get(entry["wanted"])
        if isinstance(decision, Wait) and last is not None and all(last[k] == entry[k] for k in same):
            return
        self._last[entry["wanted"]] = entry
        self.entries.append({"at": time.time(), **entry})
        logger.info(
            "contextpaw runtime: %s for %s%s%s%s; need %s, free %s, held %s",
            entry["decision"],
            wanted,
            f" ({model})" if model else "",
            f", evicting {entry['evict']}" if entry["evict"] else "",
            f" ({entry['reason']})" if entry["reason"] else "",
            _mib(need),
            _mib(entry["free_bytes"]),
            {k: _mib(v) for k, v in (entry["held_bytes"] or {}).items()},
        )


def card_for(settings: ArbiterSettings, gpu: GpuProbe, session: Callable[[], aiohttp.ClientSession]) -> Card:
    """The card and the two runtimes on it, as ``settings`` describe them."""
    waits = {"release_timeout": settings.release_timeout, "poll_interval": settings.poll_interval}
    process = Supervisor(
        settings.llamacpp_cmd,
        settings.llamacpp_url,
        settings.llamacpp_log,
        session,
        gpu,
        health_timeout=settings.health_timeout,
        stop_grace=settings.stop_grace,
        poll_interval=settings.poll_interval,
    )
    server: Supervisor | RouterServer = process
    if is_router_command(settings.llamacpp_cmd):
        server = RouterServer(process, session, gpu, load_timeout=settings.health_timeout, **waits)
    return Card(gpu, OllamaModels(settings.ollama_url, session, gpu, **waits), server, **waits)


class Arbiter:
    """Gives the GPU to one runtime at a time and admits requests only for that runtime.

    Requests are counted from :meth:`acquire` to :meth:`release`; a switch waits for the other
    runtime's count to reach zero before evicting it. Switches are serialised by one lock and bounded
    by ``switch_timeout``; a failed switch leaves the previous owner in place where it can still serve.
    """

    def __init__(
        self,
        settings: ArbiterSettings,
        gpu: GpuProbe | None = None,
        session: Callable[[], aiohttp.ClientSession] | None = None,
    ) -> None:
        """``session`` gives the proxy's one HTTP session; without it the arbiter keeps its own."""
        self.settings = settings
        self._shared = session
        self.card = card_for(settings, gpu if gpu is not None else NvmlProbe(), self._session)
        self.counters = ArbiterCounters()
        self._resident: dict[Kind, float] = {}
        """Runtimes on the GPU, and the loop time at which each won it."""
        self._pending: Kind | None = None
        self._phase = Phase.IDLE
        self._in_flight = {kind: 0 for kind in Kind}
        self._waiting = {kind: 0 for kind in Kind}
        self._holders: dict[Hashable, Kind] = {}
        self._last: SwitchRecord | None = None
        self._errors: deque[str] = deque(maxlen=10)
        self._decisions = DecisionLog()
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._http: aiohttp.ClientSession | None = None
        self._closed = False

    # --- what the addon calls -------------------------------------------------------------------

    async def acquire(self, kind: str, flow_id: Hashable, model: str | None = None) -> None:
        """Return once ``kind`` owns the GPU and the request is counted as running on it.

        Raises :class:`RuntimeUnavailable` when the runtime cannot be brought up, when the switch
        this request waited for failed, or (with ``retry_after``) when ``wait_timeout`` passes.
        ``model`` (the request's) sizes what loading it takes, and is what a router llama-server loads.
        """
        if flow_id in self._holders:
            raise ValueError(f"flow {flow_id!r} already holds {self._holders[flow_id]}")
        wanted = Kind(kind)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.wait_timeout
        awaited: SwitchRecord | None = None
        self._waiting[wanted] += 1
        try:
            while True:
                if self._closed:
                    raise RuntimeUnavailable("the proxy is shutting down")
                if awaited is not None and awaited.error is not None:
                    raise RuntimeUnavailable(awaited.error)
                cannot_start = need = room = None
                serving = True
                if self._pending is None and wanted in self._resident:
                    serving = await self.card.serves(wanted, model)
                if self._pending is None and (wanted not in self._resident or not serving):  # only then is anything started
                    if wanted is Kind.LLAMACPP:
                        cannot_start = start_problem(self.settings.llamacpp_cmd)
                    if Kind.OLLAMA not in self._resident and await self.card.ollama_loaded():
                        self._resident[Kind.OLLAMA] = -math.inf  # loaded by another client: owed no hold
                    if self._resident:
                        need, room = await self.card.need(wanted, model), await self.card.room(self._resident)
                decision = decide(
                    self._resident,
                    self._pending,
                    wanted,
                    cannot_start,
                    now=loop.time(),
                    min_hold=self.settings.min_hold,
                    need=need,
                    room=room,
                    serving=serving,
                )
                match decision:
                    case Admit():
                        self._in_flight[wanted] += 1
                        self._holders[flow_id] = wanted
                        return
                    case Decline(reason):
                        self._decisions.add(wanted, decision, need, room, model)
                        self.counters.refused += 1
                        raise RuntimeUnavailable(reason)
                    case Load():
                        self._decisions.add(wanted, decision, need, room, model)
                        awaited = self._begin_switch(decision, model)
                        continue  # an eager task may have finished the switch already: decide again
                    case Wait(until=until):
                        if until is not None:
                            self._decisions.add(wanted, decision, need, room, model)
                        if self._pending is wanted:
                            awaited = self._last
                        await self._until_changed(deadline, wanted, until)
        finally:
            self._waiting[wanted] -= 1

    def release(self, flow_id: Hashable) -> None:
        """End a request's hold; safe to call for a flow that never acquired or already released."""
        kind = self._holders.pop(flow_id, None)
        if kind is not None:
            self._in_flight[kind] -= 1
            self._notify()

    @contextlib.asynccontextmanager
    async def use(self, kind: str, model: str | None = None) -> AsyncIterator[None]:
        """Hold ``kind`` (for ``model``) for the body of the ``async with``, for callers that live in one coroutine."""
        flow_id = object()
        await self.acquire(kind, flow_id, model)
        try:
            yield
        finally:
            self.release(flow_id)

    async def status(self) -> dict[str, Any]:
        """The ``GET /contextpaw/runtime`` body."""
        reading, known = await self.card.report()
        last = self._last
        loop_now = asyncio.get_running_loop().time()
        runtimes = {
            str(kind): {
                "resident": kind in self._resident,
                "resident_for_s": round(loop_now - self._resident[kind], 1) if kind in self._resident else None,
                "in_flight": self._in_flight[kind],
                "waiting": self._waiting[kind],
                **known[kind],
            }
            for kind in Kind
        }
        return {
            "owner": max(self._resident, key=self._resident.__getitem__) if self._resident else None,
            """The runtime that won the GPU last (with both resident, the other one is there too)."""
            "resident": [str(kind) for kind in self._resident],
            "llamacpp_process": runtimes[str(Kind.LLAMACPP)]["process"],
            "runtimes": runtimes,
            "free_vram_bytes": sum(d.free_bytes for d in reading.devices) if isinstance(reading, VramReading) else None,
            "min_hold_s": self.settings.min_hold,
            "decisions": list(self._decisions.entries),
            "state": self._phase,
            "switching_to": self._pending,
            "in_flight": dict(self._in_flight),
            "waiting": dict(self._waiting),
            "last_switch": asdict(last) if last else None,
            "counters": asdict(self.counters),
            "vram": reading.as_json() if isinstance(reading, VramReading) else None,
            "vram_unavailable": reading.reason if isinstance(reading, NoVram) else None,
            "errors": list(self._errors),
        }

    async def aclose(self) -> None:
        """Stop what the proxy started; call when the proxy exits."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.card.supervisor.stop()
        if self._http is not None:
            await self._http.close()
        self.card.gpu.close()

    # --- waiting --------------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until_changed(self, deadline: float, wanted: Kind, until: float | None = None) -> None:
        """Until something changes, a hold runs out (`until`), or the request's `deadline` passes."""
        wake = deadline if until is None else min(deadline, until)
        try:
            await asyncio.wait_for(self._changed.wait(), max(0.0, wake - asyncio.get_running_loop().time()))
        except TimeoutError:
            if wake < deadline:
                return
            self.counters.wait_timeouts += 1
            raise RuntimeUnavailable(
                f"{wanted} is not ready after {self.settings.wait_timeout:g}s ({self._phase})",
                retry_after=retry_after(self.counters.mean_switch_seconds),
            ) from None

    # --- switching ------------------------------------------------------------------------------

    def _enter(self, phase: Phase) -> None:
        self._phase = advance(PHASES, self._phase, phase)

    def _begin_switch(self, load: Load, model: str | None) -> SwitchRecord:
        record = SwitchRecord(source=load.evict, target=load.to, started_at=time.time(), model=model)
        self._pending, self._last = load.to, record
        self._spawn_task(self._run_switch(record))
        return record

    def _spawn_task(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_switch(self, record: SwitchRecord) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with self._lock:
                try:
                    await self._drain(record)
                    async with asyncio.timeout(self.settings.switch_timeout):
                        if record.source is not None:
                            self._abandoned(record)
                            await self._evict(record.source)
                            self._resident.pop(record.source, None)
                        self._abandoned(record)
                        await self._bring_up(record)
                except SwitchCancelled as cancel:
                    record.cancelled = True
                    self.counters.cancelled += 1
                    logger.info("contextpaw runtime: switch to %s cancelled: %s", record.target, cancel)
                    if record.target is Kind.LLAMACPP:
                        await self._undo_server()
                except (SwitchFailed, TimeoutError) as failure:
                    record.error = str(failure) or (f"switch to {record.target} took longer than {self.settings.switch_timeout:g}s")
                    await self._recover(record)
                else:
                    self._resident[record.target] = loop.time()
                    self.counters.loads += 1
                    self.counters.switches += record.source is not None
                    self.counters.loaded_beside += record.source is None and len(self._resident) > 1
        finally:
            record.seconds = loop.time() - started
            self.counters.switch_seconds += record.seconds
            self._pending = None
            self._enter(Phase.READY if self._resident else Phase.IDLE)
            self._notify()

    def _abandoned(self, record: SwitchRecord) -> None:
        """Stop a switch nobody waits for any more: every requester was sent its 503 or went away."""
        if self._waiting[record.target] == 0:
            raise SwitchCancelled(f"no request waits for {record.target} any more")

    async def _recover(self, record: SwitchRecord) -> None:
        """No half-started or half-stopped server may keep the card; the previous owner stays if it
        can still serve (Ollama always can: it reloads lazily)."""
        self.counters.failures += 1
        self._note(f"switch to {record.target} failed: {record.error}")
        if record.target is Kind.LLAMACPP or self.card.supervisor.state is ServerState.STOPPING:
            await self._undo_server()
        if self.card.supervisor.state is ServerState.STOPPED or isinstance(self.card.supervisor, RouterServer):
            self._resident.pop(Kind.LLAMACPP, None)  # a router left with its models unloaded holds nothing
        if record.source is Kind.OLLAMA:  # unloaded for nothing; it reloads on its next request
            self._resident.setdefault(Kind.OLLAMA, asyncio.get_running_loop().time())

    async def _drain(self, record: SwitchRecord) -> None:
        self._enter(Phase.DRAINING)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.drain_timeout
        while busy := blocking(self._in_flight, record.source):
            self._abandoned(record)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise SwitchFailed(
                    f"{busy} request(s) still running after {self.settings.drain_timeout:g}s; nothing was evicted for {record.target}"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def _undo_server(self) -> None:
        """A llama-server switch that did not finish leaves nothing on the card: a router's models
        unloaded (the router stays up for the next one), a plain server stopped."""
        server = self.card.supervisor
        if isinstance(server, RouterServer) and server.running:
            try:
                await server.unload()
                return
            except SwitchFailed as failure:
                self._note(f"{failure}; stopping the router")
        await server.stop()

    async def _evict(self, kind: Kind) -> None:
        """Unload Ollama's models, a router's models, or stop the server, then wait for the card to
        show their memory back."""
        server = self.card.supervisor
        if kind is Kind.OLLAMA:
            self._enter(Phase.UNLOADING_OLLAMA)
            release, holder, releasing = await self.card.ollama.unload(), "Ollama", Phase.RELEASING_OLLAMA
        elif isinstance(server, RouterServer) and server.running:
            self._enter(Phase.UNLOADING_MODELS)
            release, holder, releasing = await server.unload(), "llama-server's models", Phase.RELEASING_MODELS
        else:
            self._enter(Phase.STOPPING_SERVER)
            release, holder, releasing = await self.card.supervisor.stop(), "llama-server", Phase.RELEASING_SERVER
        if release is not None:
            self._enter(releasing)
            await self.card.await_release(release, holder)

    async def _bring_up(self, record: SwitchRecord) -> None:
        """llama-server is started, and a router's model loaded; Ollama loads its models itself on
        the request."""
        if record.target is not Kind.LLAMACPP:
            return
        server = self.card.supervisor
        keep_going = lambda: self._abandoned(record)  # noqa: E731  (nobody waits: stop loading)
        if not server.running:
            self._enter(Phase.STARTING_SERVER)
            await server.start(keep_going)
            self._spawn_task(self._watch())
        if isinstance(server, RouterServer) and record.model is not None and not await server.serves(record.model):
            self._enter(Phase.LOADING_MODEL)
            await server.load(record.model, keep_going)

    async def _watch(self) -> None:
        """Notice a server that dies on its own, so the next request starts a new one."""
        why = await self.card.supervisor.died()
        if why is None:
            return
        if self._resident.pop(Kind.LLAMACPP, None) is not None and not self._resident and self._pending is None:
            self._enter(Phase.IDLE)  # during a switch, the switch settles the phase when it ends
        self._note(why)
        self._notify()

    def _session(self) -> aiohttp.ClientSession:
        if self._shared is not None:
            return self._shared()
        if self._http is None:
            self._http = aiohttp.ClientSession(trust_env=False)
        return self._http

    def _note(self, message: str) -> None:
        logger.warning("contextpaw runtime: %s", message)
        self._errors.append(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}")
