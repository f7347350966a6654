"""Arbitration of one GPU between Ollama and a llama-server that ContextPaw starts, decided by VRAM.

A card that cannot hold both runtimes' models fails silently: Ollama loads on top of llama-server,
spills to system RAM and runs many times slower while reporting 100% GPU. The proxy sees every
request, so it knows which runtime is wanted. It brings that runtime up beside the other when the
estimate of its need fits what NVML says is free. When it does not fit, it waits until the other
runtime has held the GPU `min_hold` seconds and has no request in flight, evicts it, waits until
NVML shows the memory back, and only then lets the wanted runtime in. A switch nobody waits for any
more is cancelled.

The decisions (:func:`decide`, :func:`blocking`, :class:`Release`, :class:`Room`) are pure;
:class:`Arbiter` is the I/O shell around them. Its runtime I/O (`_ollama_models`, `_evict`,
`_bring_up`, `_need`) is the seam `tests/support/arbitration_sim.py` replaces to replay traces. The
addon calls :meth:`Arbiter.acquire` in its ``request`` hook and :meth:`Arbiter.release` in
``response``/``error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import aiohttp

from contextpaw import logs
from contextpaw.gpu import GpuProbe, NoVram, NvmlProbe, VramReading, sample
from contextpaw.state import LRU
from contextpaw.vram import Need, estimate, read_shape, server_plan
from contextpaw.windows import ollama_model_file, ollama_show_windows

logger = logs.get(__name__)

MIB = 1 << 20
RELEASE_MARGIN_BYTES = 256 * MIB
OLLAMA_DEFAULT_CTX = 4096
"""The window Ollama loads a model with when neither its Modelfile nor the server's setting says."""
DEFAULT_RETRY_AFTER_S = 5
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5)
UNLOAD_TIMEOUT = aiohttp.ClientTimeout(total=30)


class Kind(StrEnum):
    OLLAMA = "ollama"
    LLAMACPP = "llamacpp"


# --- decision core ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Admit:
    """Forward the request now."""


@dataclass(frozen=True)
class Wait:
    """Decide again when something changes, or at ``until`` (a hold that runs out)."""

    reason: str = "a switch is under way"
    until: float | None = None


@dataclass(frozen=True)
class Load:
    """Bring ``to`` up; first evict ``evict`` (None: it fits beside what runs)."""

    to: Kind
    evict: Kind | None = None


@dataclass(frozen=True)
class Refuse:
    """The wanted runtime cannot be brought up, so nothing is evicted for it."""

    reason: str


Decision = Admit | Wait | Load | Refuse


@dataclass(frozen=True)
class Room:
    """The card as NVML reads it: free bytes (the total less what every process uses, ours and
    others'), and what each resident runtime holds."""

    free_bytes: int
    held_bytes: Mapping[Kind, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"free_bytes": self.free_bytes, "held_bytes": {str(k): v for k, v in self.held_bytes.items()}}


def decide(
    resident: Mapping[Kind, float],
    switching_to: Kind | None,
    wanted: Kind,
    cannot_start: str | None,
    *,
    now: float = 0.0,
    min_hold: float = 0.0,
    need: int | None = None,
    room: Room | None = None,
) -> Decision:
    """What a request for ``wanted`` does now.

    ``resident`` maps each runtime on the GPU to when it won it. While a switch is pending every
    request waits (admitting the outgoing runtime would keep its drain from ending). A runtime that
    is not resident is loaded beside the others when its estimated ``need`` fits the ``room``
    NVML reports; otherwise the other runtime must go, but not before it has held the GPU
    ``min_hold`` seconds (against thrashing), and not when even its memory would not make room
    (an over-commit). Without a reading or an estimate, the other runtime goes: nothing else is safe.
    """
    if switching_to is not None:
        return Wait()
    if wanted in resident:
        return Admit()
    if cannot_start:
        return Refuse(cannot_start)
    others = [kind for kind in resident if kind is not wanted]
    if not others:
        return Load(wanted)
    other = others[0]
    if need is not None and room is not None:
        if need <= room.free_bytes:
            return Load(wanted)
        freed = room.free_bytes + room.held_bytes.get(other, 0)
        if other in room.held_bytes and need > freed:
            return Refuse(
                f"{wanted} needs about {need // MIB} MiB but only {freed // MIB} MiB would be free even "
                f"without {other}"
            )
    held_until = resident[other] + min_hold
    if now < held_until:
        return Wait(f"{other} keeps the GPU until its {min_hold:g}s hold is over (contextpaw_min_hold)", held_until)
    return Load(wanted, evict=other)


def blocking(in_flight: Mapping[Kind, int], evicted: Kind | None) -> int:
    """Requests that must finish before ``evicted`` goes: evicting under them would cut their
    responses off."""
    return in_flight[evicted] if evicted is not None else 0


@dataclass(frozen=True)
class Release:
    """What an eviction should give back: total used memory before it, and what the evicted runtime
    held (Ollama's ``size_vram``, or the server process's share)."""

    before_bytes: int
    held_bytes: int

    @property
    def ceiling_bytes(self) -> int:
        """Used memory at which the release counts as done; the margin absorbs the driver's own
        bookkeeping and other programs' drift."""
        margin = max(RELEASE_MARGIN_BYTES, self.held_bytes // 20)
        return self.before_bytes - self.held_bytes + margin

    def done(self, used_bytes: int) -> bool:
        return used_bytes <= self.ceiling_bytes


def _mib(value: int | None) -> str:
    return "?" if value is None else f"{value // MIB} MiB"


def retry_after(mean_switch_seconds: float | None) -> int:
    """Seconds a caller turned away during a switch should wait: about one switch."""
    if mean_switch_seconds is None:
        return DEFAULT_RETRY_AFTER_S
    return max(1, math.ceil(mean_switch_seconds))


def start_problem(command: str) -> str | None:
    """Why llama-server could not be started from ``command``, or None."""
    try:
        argv = shlex.split(command)
    except ValueError as error:
        return f"contextpaw_llamacpp_cmd cannot be parsed: {error}"
    if not argv:
        return "no contextpaw_llamacpp_cmd is configured, so llama-server cannot be started"
    if shutil.which(argv[0]) is None:
        return f"contextpaw_llamacpp_cmd: {argv[0]!r} is not an executable"
    return None


# --- I/O shell ----------------------------------------------------------------------------------


def default_log_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "contextpaw" / "llama-server.log"


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


class SwitchFailed(Exception):
    """A switch step did not succeed; the message is what the operator needs to fix it."""


class SwitchCancelled(Exception):
    """Every request that waited for the switch gave up (a 503, or the client went away)."""


@dataclass
class SwitchRecord:
    source: Kind | None
    """The runtime evicted for it (None: the target fit beside what runs)."""
    target: Kind
    started_at: float
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


class LlamaServer:
    """The llama-server ContextPaw started. It runs in its own session, so stopping its process
    group also reaches anything a wrapper script spawned."""

    def __init__(self, process: asyncio.subprocess.Process, argv: list[str], log_path: Path) -> None:
        self.process = process
        self.argv = argv
        self.log_path = log_path
        self.started_at = time.time()
        self.stopping = False
        self.held_bytes: int | None = None

    @classmethod
    async def spawn(cls, argv: list[str], log_path: Path) -> LlamaServer:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log_file:
            log_file.write(f"--- {time.ctime()} contextpaw starts: {shlex.join(argv)}\n".encode())
            log_file.flush()
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(process, argv, log_path)

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    async def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL if it outlives ``grace``: a server stuck in teardown must not keep
        the card."""
        self.stopping = True
        if not self.running:
            return
        self._signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), grace)
        except TimeoutError:
            self._signal(signal.SIGKILL)
            await self.process.wait()

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    async def log_tail(self, lines: int = 20) -> str:
        return await asyncio.to_thread(_tail, self.log_path, lines)

    def as_json(self, reading: VramReading | NoVram) -> dict[str, Any]:
        return {
            "pid": self.process.pid,
            "command": self.argv,
            "log": str(self.log_path),
            "started_at": self.started_at,
            "vram_bytes": reading.process_bytes(self.process.pid) if isinstance(reading, VramReading) else None,
        }


def _tail(path: Path, lines: int) -> str:
    with path.open("rb") as log_file:
        log_file.seek(0, os.SEEK_END)
        log_file.seek(max(0, log_file.tell() - 8192))
        return b"".join(log_file.readlines()[-lines:]).decode(errors="replace").rstrip()


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
        self.gpu = gpu if gpu is not None else NvmlProbe()
        self.counters = ArbiterCounters()
        self._resident: dict[Kind, float] = {}
        """Runtimes on the GPU, and the loop time at which each won it."""
        self._pending: Kind | None = None
        self._phase = "idle"
        self._in_flight = {kind: 0 for kind in Kind}
        self._waiting = {kind: 0 for kind in Kind}
        self._holders: dict[Hashable, Kind] = {}
        self._server: LlamaServer | None = None
        self._last: SwitchRecord | None = None
        self._errors: deque[str] = deque(maxlen=10)
        self._decisions: deque[dict[str, Any]] = deque(maxlen=20)
        self._needs: dict[Kind, Need | None] = {}
        self._ollama_bytes: int | None = None
        """What Ollama's models held on the GPU when last seen loaded (`/api/ps` `size_vram`)."""
        self._ollama_seen: LRU = LRU(64)
        """Model -> its `size_vram` when last listed."""
        self._ollama_needs: LRU = LRU(64)
        """Model -> the estimate from the GGUF file its Modelfile names, or None."""
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
        ``model`` (an Ollama request's) sizes what loading it takes.
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
                if self._pending is None and wanted not in self._resident:  # only then is anything started
                    if wanted is Kind.LLAMACPP:
                        cannot_start = start_problem(self.settings.llamacpp_cmd)
                    await self._notice_ollama()
                    if self._resident:
                        need, room = await self._need(wanted, model), await self._room()
                decision = decide(self._resident, self._pending, wanted, cannot_start,
                                  now=loop.time(), min_hold=self.settings.min_hold, need=need, room=room)  # fmt: skip
                match decision:
                    case Admit():
                        self._in_flight[wanted] += 1
                        self._holders[flow_id] = wanted
                        return
                    case Refuse(reason):
                        self._decided(wanted, decision, need, room)
                        self.counters.refused += 1
                        raise RuntimeUnavailable(reason)
                    case Load():
                        self._decided(wanted, decision, need, room)
                        awaited = self._begin_switch(decision)
                        continue  # an eager task may have finished the switch already: decide again
                    case Wait(until=until):
                        if until is not None:
                            self._decided(wanted, decision, need, room)
                        if self._pending is wanted:
                            awaited = self._last
                await self._until_changed(deadline, wanted, decision.until)
        finally:
            self._waiting[wanted] -= 1

    def release(self, flow_id: Hashable) -> None:
        """End a request's hold; safe to call for a flow that never acquired or already released."""
        kind = self._holders.pop(flow_id, None)
        if kind is not None:
            self._in_flight[kind] -= 1
            self._notify()

    @contextlib.asynccontextmanager
    async def use(self, kind: str) -> AsyncIterator[None]:
        """Hold ``kind`` for the body of the ``async with``, for callers that live in one coroutine."""
        flow_id = object()
        await self.acquire(kind, flow_id)
        try:
            yield
        finally:
            self.release(flow_id)

    async def status(self) -> dict[str, Any]:
        """The ``GET /contextpaw/runtime`` body."""
        reading = await sample(self.gpu)
        server = self._server
        last = self._last
        loop_now = asyncio.get_running_loop().time()
        models: list[dict[str, Any]] | None = None
        with contextlib.suppress(SwitchFailed):
            models = [{"name": m.get("name"), "size_vram": m.get("size_vram")} for m in await self._ollama_models()]
        runtimes = {
            str(kind): {
                "resident": kind in self._resident,
                "resident_for_s": round(loop_now - self._resident[kind], 1) if kind in self._resident else None,
                "in_flight": self._in_flight[kind],
                "waiting": self._waiting[kind],
                "need_bytes": await self._need(kind),
            }
            for kind in Kind
        }
        runtimes[str(Kind.OLLAMA)]["models"] = models
        runtimes[str(Kind.LLAMACPP)]["process"] = server.as_json(reading) if server else None
        return {
            "owner": max(self._resident, key=self._resident.__getitem__) if self._resident else None,
            """The runtime that won the GPU last (with both resident, the other one is there too)."""
            "resident": [str(kind) for kind in self._resident],
            "llamacpp_process": runtimes[str(Kind.LLAMACPP)]["process"],
            "runtimes": runtimes,
            "free_vram_bytes": sum(d.free_bytes for d in reading.devices) if isinstance(reading, VramReading) else None,
            "min_hold_s": self.settings.min_hold,
            "decisions": list(self._decisions),
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
        await self._stop_server()
        if self._http is not None:
            await self._http.close()
        self.gpu.close()

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

    async def _until(self, condition: Callable[[], Awaitable[bool]], timeout: float) -> bool:
        """Poll ``condition`` until it holds (True) or ``timeout`` passes (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not await condition():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(self.settings.poll_interval)
        return True

    # --- switching ------------------------------------------------------------------------------

    def _begin_switch(self, load: Load) -> SwitchRecord:
        record = SwitchRecord(source=load.evict, target=load.to, started_at=time.time())
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
                        await self._stop_server()
                except (SwitchFailed, TimeoutError) as failure:
                    record.error = str(failure) or (
                        f"switch to {record.target} took longer than {self.settings.switch_timeout:g}s"
                    )
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
            self._phase = "ready" if self._resident else "idle"
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
        if record.target is Kind.LLAMACPP or (self._server and self._server.stopping):
            await self._stop_server()
        if self._server is None:
            self._resident.pop(Kind.LLAMACPP, None)
        if record.source is Kind.OLLAMA:  # unloaded for nothing; it reloads on its next request
            self._resident.setdefault(Kind.OLLAMA, asyncio.get_running_loop().time())

    async def _drain(self, record: SwitchRecord) -> None:
        self._phase = "draining"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.drain_timeout
        while busy := blocking(self._in_flight, record.source):
            self._abandoned(record)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise SwitchFailed(
                    f"{busy} request(s) still running after {self.settings.drain_timeout:g}s; "
                    f"nothing was evicted for {record.target}"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def _evict(self, kind: Kind) -> None:
        if kind is Kind.OLLAMA:
            self._phase = "unloading ollama"
            await self._await_release(await self._unload_ollama(), "Ollama")
        else:
            self._phase = "stopping llama-server"
            await self._await_release(await self._stop_server(), "llama-server")

    async def _bring_up(self, record: SwitchRecord) -> None:
        """llama-server is started; Ollama loads its models itself on the request."""
        if record.target is Kind.LLAMACPP and (self._server is None or not self._server.running):
            self._phase = "starting llama-server"
            await self._start_server(record)

    # --- what is on the card, and what is asked of it --------------------------------------------

    async def _need(self, kind: Kind, model: str | None = None) -> int | None:
        """Bytes ``kind`` will take: llama-server's from its GGUF and command line; Ollama's from what
        `model` held when last loaded (`/api/ps` `size_vram`), else from the GGUF file its Modelfile
        names (`/api/show`), else what its models held last; None when unknown."""
        if kind is Kind.OLLAMA:
            if model is None:
                return self._ollama_bytes
            if model not in self._ollama_needs:
                self._ollama_needs.put(model, await self._ollama_estimate(model))
            return self._ollama_seen.get(model) or self._ollama_needs.get(model) or self._ollama_bytes
        if kind not in self._needs:
            plan = server_plan(self.settings.llamacpp_cmd)
            need = None
            if plan is not None:
                try:
                    shape = await asyncio.to_thread(read_shape, plan.model)
                    need = estimate(shape, plan.ctx or shape.trained_ctx or 4096, plan.kv_type, plan.offloaded)
                except ValueError as e:
                    logger.info("contextpaw runtime: no VRAM estimate for llama-server: %s", e)
            self._needs[kind] = need
        need = self._needs[kind]
        return need.total_bytes if need is not None else None

    async def _ollama_estimate(self, model: str) -> int | None:
        """What loading `model` will take, from the GGUF its Modelfile's FROM names (when this machine
        can read it) at its `num_ctx` (else Ollama's default 4096); None when it cannot be told."""
        try:
            async with self._session().post(f"{self.settings.ollama_url}/api/show", json={"model": model}, timeout=PROBE_TIMEOUT) as response:
                response.raise_for_status()
                show = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        path, (ctx, _) = ollama_model_file(show), ollama_show_windows(show)
        if path is None:
            return None
        try:
            shape = await asyncio.to_thread(read_shape, path)
        except ValueError:
            return None
        return estimate(shape, ctx or OLLAMA_DEFAULT_CTX).total_bytes

    async def _notice_ollama(self) -> None:
        """Ollama loads models for any client, not only through this proxy: one that lists models is
        on the GPU (and owed no hold)."""
        if Kind.OLLAMA not in self._resident:
            with contextlib.suppress(SwitchFailed):
                if await self._ollama_models():
                    self._resident[Kind.OLLAMA] = -math.inf

    async def _room(self) -> Room | None:
        """Free memory now and what each resident runtime holds; None without NVML."""
        reading = await sample(self.gpu)
        if isinstance(reading, NoVram):
            return None
        held: dict[Kind, int] = {}
        server = self._server
        if Kind.LLAMACPP in self._resident and server is not None:
            mine = reading.process_bytes(server.process.pid) or server.held_bytes
            if mine is not None:
                held[Kind.LLAMACPP] = mine
        if Kind.OLLAMA in self._resident:
            with contextlib.suppress(SwitchFailed):
                listed = await self._ollama_models()
                for model in listed:
                    if model.get("size_vram"):
                        self._ollama_seen.put(model.get("name"), model["size_vram"])
                size = sum(model.get("size_vram") or 0 for model in listed)
                if size:
                    held[Kind.OLLAMA] = self._ollama_bytes = size
        free = sum(device.free_bytes for device in reading.devices)
        for kind in self._resident:  # a runtime still loading will take its whole need
            need = await self._need(kind)
            if need is None and kind not in held:
                return None  # what it will take is unknown: no room can be promised beside it
            if need is not None and need > held.get(kind, 0):
                free -= need - held.get(kind, 0)
                held[kind] = need
        return Room(max(free, 0), held)

    def _decided(self, wanted: Kind, decision: Decision, need: int | None, room: Room | None) -> None:
        """Keep and log a decision with the readings behind it (a repeated wait is kept once)."""
        entry = {
            "wanted": str(wanted),
            "decision": type(decision).__name__.lower(),
            "evict": str(decision.evict) if isinstance(decision, Load) and decision.evict else None,
            "reason": getattr(decision, "reason", None),
            "need_bytes": need,
            **(room.as_json() if room is not None else {"free_bytes": None, "held_bytes": None}),
        }
        same = ("wanted", "decision", "evict", "reason")
        if self._decisions and all(self._decisions[-1][k] == entry[k] for k in same):
            return  # a wait goes on: kept once, with the readings it began with
        self._decisions.append({"at": time.time(), **entry})
        logger.info("contextpaw runtime: %s for %s%s%s; need %s, free %s, held %s", entry["decision"], wanted,
                 f", evicting {entry['evict']}" if entry["evict"] else "", f" ({entry['reason']})" if entry["reason"] else "",
                 _mib(need), _mib(entry["free_bytes"]), {k: _mib(v) for k, v in (entry["held_bytes"] or {}).items()})  # fmt: skip

    async def _await_release(self, release: Release | None, holder: str) -> None:
        """Wait until NVML shows ``holder``'s memory back: the driver frees it after the process
        state says so, and loading the other runtime before then spills it to system RAM."""
        if release is None:
            return
        self._phase = f"waiting for {holder} to release VRAM"
        used: list[int] = []

        async def released() -> bool:
            reading = await sample(self.gpu)
            if isinstance(reading, NoVram):
                return True
            used.append(reading.used_bytes)
            return release.done(reading.used_bytes)

        if not await self._until(released, self.settings.release_timeout):
            raise SwitchFailed(
                f"{holder} was evicted but VRAM did not come back within {self.settings.release_timeout:g}s: "
                f"{used[-1] // MIB} MiB used, expected at most {release.ceiling_bytes // MIB} MiB"
            )

    # --- Ollama ---------------------------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        if self._shared is not None:
            return self._shared()
        if self._http is None:
            self._http = aiohttp.ClientSession(trust_env=False)
        return self._http

    async def _ollama_models(self) -> list[dict[str, Any]]:
        """What ``/api/ps`` lists; an Ollama that is not running holds no memory."""
        try:
            async with self._session().get(f"{self.settings.ollama_url}/api/ps", timeout=PROBE_TIMEOUT) as response:
                response.raise_for_status()
                listed = (await response.json())["models"]
        except aiohttp.ClientConnectorError:
            return []
        except (aiohttp.ClientError, TimeoutError, KeyError) as error:
            raise SwitchFailed(f"Ollama /api/ps failed: {error!r}") from error
        return listed

    async def _unload_ollama(self) -> Release | None:
        """Unload every listed model with ``keep_alive: 0``; the expected release is what Ollama says
        they hold on the GPU (``size_vram``)."""
        resident = await self._ollama_models()
        if not resident:
            return None
        before = await sample(self.gpu)
        for model in resident:
            body = {"model": model["name"], "keep_alive": 0}
            try:
                async with self._session().post(
                    f"{self.settings.ollama_url}/api/generate", json=body, timeout=UNLOAD_TIMEOUT
                ) as response:
                    response.raise_for_status()
            except (aiohttp.ClientError, TimeoutError) as error:
                raise SwitchFailed(f"Ollama refused to unload {model['name']}: {error!r}") from error

        async def unloaded() -> bool:
            return not await self._ollama_models()

        if not await self._until(unloaded, self.settings.release_timeout):
            names = ", ".join(model["name"] for model in await self._ollama_models())
            raise SwitchFailed(f"Ollama still lists {names} {self.settings.release_timeout:g}s after unloading")
        if isinstance(before, NoVram):
            return None
        return Release(before.used_bytes, sum(model.get("size_vram") or 0 for model in resident))

    # --- llama-server ---------------------------------------------------------------------------

    async def _start_server(self, record: SwitchRecord) -> None:
        argv = shlex.split(self.settings.llamacpp_cmd)
        before = await sample(self.gpu)
        try:
            server = await LlamaServer.spawn(argv, self.settings.llamacpp_log)
        except OSError as error:
            raise SwitchFailed(f"cannot start llama-server {argv[0]!r}: {error}") from error
        self._server = server

        async def ready() -> bool:
            self._abandoned(record)  # nobody waits: stop loading (the caller stops the server)
            return await self._healthy(server)

        if not await self._until(ready, self.settings.health_timeout):
            raise await self._startup_failure(
                server,
                f"llama-server did not answer {self.settings.llamacpp_url}/health with 200 "
                f"within {self.settings.health_timeout:g}s",
            )
        after = await sample(self.gpu)
        if isinstance(before, VramReading) and isinstance(after, VramReading):
            server.held_bytes = max(0, after.used_bytes - before.used_bytes)
        self._spawn_task(self._watch(server))

    async def _healthy(self, server: LlamaServer) -> bool:
        """200 once the model is loaded; llama-server answers 503 while loading."""
        if not server.running:
            raise await self._startup_failure(
                server, f"llama-server exited with code {server.process.returncode} during startup"
            )
        try:
            async with self._session().get(f"{self.settings.llamacpp_url}/health", timeout=PROBE_TIMEOUT) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _startup_failure(self, server: LlamaServer, what: str) -> SwitchFailed:
        return SwitchFailed(f"{what}; last lines of {server.log_path}:\n{await server.log_tail()}")

    async def _watch(self, server: LlamaServer) -> None:
        """Notice a server that dies on its own, so the next request starts a new one."""
        code = await server.process.wait()
        if server is self._server and not server.stopping:
            self._server = None
            if self._resident.pop(Kind.LLAMACPP, None) is not None and not self._resident:
                self._phase = "idle"
            self._note(f"llama-server exited unexpectedly with code {code}; see {server.log_path}")
            self._notify()

    async def _stop_server(self) -> Release | None:
        """Stop the server this proxy started, never one it did not: the expected release is its own
        NVML share, else what it took when it started."""
        server = self._server
        if server is None or not server.running:
            self._server = None
            return None
        before = await sample(self.gpu)
        await server.stop(self.settings.stop_grace)
        self._server = None
        if isinstance(before, NoVram):
            return None
        held = before.process_bytes(server.process.pid) or server.held_bytes
        return Release(before.used_bytes, held) if held else None

    def _note(self, message: str) -> None:
        logger.warning("contextpaw runtime: %s", message)
        self._errors.append(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}")
