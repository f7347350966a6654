"""The llama-server ContextPaw starts: spawned in a session of its own, ready once ``/health``
answers 200, stopped with SIGTERM and then SIGKILL, and noticed when it dies on its own.

Its life is a :class:`ServerState` whose steps :data:`SERVER_STATES` lists, in the manner of
llama-swap's process states: stopped, starting, ready, stopping, stopped. A server that exits while
it starts, or on its own once ready, goes straight back to stopped. The supervisor never touches a
server it did not start.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

import aiohttp

from contextpaw.core import logs
from contextpaw.core.lifecycle import advance, staying
from contextpaw.gpu.nvml import GpuProbe, NoVram, VramReading, poll_until, sample
from contextpaw.gpu.placement import Release, SwitchFailed
from contextpaw.gpu.vram import Need, estimate, read_shape, server_plan

logger = logs.get(__name__)

HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=5)
TRAINED_CTX_FALLBACK = 4096
"""The context assumed for the estimate when neither the command line nor the GGUF header says."""


def default_log_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "contextpaw" / "llama-server.log"


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


class LlamaServer:
    """One llama-server process. It runs in its own session, so stopping its process group also
    reaches anything a wrapper script spawned."""

    def __init__(self, process: asyncio.subprocess.Process, argv: list[str], log_path: Path) -> None:
        self.process = process
        self.argv = argv
        self.log_path = log_path
        self.started_at = time.time()

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


def _tail(path: Path, lines: int) -> str:
    with path.open("rb") as log_file:
        log_file.seek(0, os.SEEK_END)
        log_file.seek(max(0, log_file.tell() - 8192))
        return b"".join(log_file.readlines()[-lines:]).decode(errors="replace").rstrip()


class ServerState(StrEnum):
    STOPPED = "stopped"
    """No process of ours (the one it had exited, or was stopped)."""
    STARTING = "starting"
    """Spawned, or being spawned, and not yet answering /health with 200."""
    READY = "ready"
    STOPPING = "stopping"
    """Signalled; a stop cut short (a switch that timed out) stays here until stopped again."""


SERVER_STATES: Mapping[ServerState, frozenset[ServerState]] = staying(
    {
        ServerState.STOPPED: frozenset({ServerState.STARTING}),
        ServerState.STARTING: frozenset({ServerState.READY, ServerState.STOPPING, ServerState.STOPPED}),
        ServerState.READY: frozenset({ServerState.STOPPING, ServerState.STOPPED}),
        ServerState.STOPPING: frozenset({ServerState.STOPPED}),
    }
)
"""From each state, the states the server may go to next (staying is no step); STOPPED from
STARTING or READY is a process that exited by itself (or could not be spawned)."""


class Supervisor:
    """Starts, health-checks and stops the one llama-server ``command`` describes, listening at
    ``url``, with its output appended to ``log_path``."""

    def __init__(
        self,
        command: str,
        url: str,
        log_path: Path,
        session: Callable[[], aiohttp.ClientSession],
        gpu: GpuProbe,
        *,
        health_timeout: float,
        stop_grace: float,
        poll_interval: float,
    ) -> None:
        self.command = command
        self.url = url
        self.log_path = log_path
        self._session = session
        self.gpu = gpu
        self.health_timeout = health_timeout
        self.stop_grace = stop_grace
        self.poll_interval = poll_interval
        self.state = ServerState.STOPPED
        self.server: LlamaServer | None = None
        self.measured_bytes: int | None = None
        """What the card's use grew by while the current server started (for drivers that do not
        account per process)."""
        self._need: Need | None = None
        self._need_read = False

    @property
    def running(self) -> bool:
        return self.server is not None and self.server.running

    def held_bytes(self, reading: VramReading) -> int | None:
        """What the server holds on the card: its own NVML share, else what it took when it started."""
        if self.server is None:
            return None
        return reading.process_bytes(self.server.process.pid) or self.measured_bytes

    def as_json(self, reading: VramReading | NoVram) -> dict[str, Any] | None:
        server = self.server
        if server is None:
            return None
        return {
            "pid": server.process.pid,
            "command": server.argv,
            "log": str(server.log_path),
            "started_at": server.started_at,
            "vram_bytes": reading.process_bytes(server.process.pid) if isinstance(reading, VramReading) else None,
        }

    async def serves(self, model: str | None) -> bool:
        """A plain server serves what it was started with, whatever model a request names."""
        return True

    async def need(self, model: str | None = None) -> int | None:
        """Bytes the server will take, from its GGUF header and command line (read once); None when
        the command names no readable model. ``model`` is a router's concern: one model here."""
        if not self._need_read:
            self._need_read, self._need = True, await self._estimate()
        return self._need.total_bytes if self._need is not None else None

    async def _estimate(self) -> Need | None:
        plan = server_plan(self.command)
        if plan is None:
            return None
        try:
            shape = await asyncio.to_thread(read_shape, plan.model)
        except ValueError as e:
            logger.info("contextpaw runtime: no VRAM estimate for llama-server: %s", e)
            return None
        return estimate(shape, plan.ctx or shape.trained_ctx or TRAINED_CTX_FALLBACK, plan.kv_type, plan.offloaded)

    async def start(self, keep_going: Callable[[], None]) -> None:
        """Spawn the server and wait until it is healthy; raises :class:`SwitchFailed` with the end
        of its log when it exits or does not answer in ``health_timeout``. ``keep_going`` is asked
        between polls and raises to stop waiting (the caller then stops the server)."""
        if self.server is not None and not self.server.running:
            self._forget()  # it exited, and nobody has noticed yet
        self._enter(ServerState.STARTING)
        argv = shlex.split(self.command)
        before = await sample(self.gpu)
        try:
            server = await LlamaServer.spawn(argv, self.log_path)
        except OSError as error:
            self._enter(ServerState.STOPPED)
            raise SwitchFailed(f"cannot start llama-server {argv[0]!r}: {error}") from error
        self.server, self.measured_bytes = server, None

        async def ready() -> bool:
            keep_going()
            return await self._healthy(server)

        if not await poll_until(ready, self.health_timeout, self.poll_interval):
            raise await self._startup_failure(
                server, f"llama-server did not answer {self.url}/health with 200 within {self.health_timeout:g}s"
            )
        after = await sample(self.gpu)
        if isinstance(before, VramReading) and isinstance(after, VramReading):
            self.measured_bytes = max(0, after.used_bytes - before.used_bytes)
        self._enter(ServerState.READY)

    async def _healthy(self, server: LlamaServer) -> bool:
        """200 once the model is loaded; llama-server answers 503 while loading."""
        if not server.running:
            raise await self._startup_failure(server, f"llama-server exited with code {server.process.returncode} during startup")
        try:
            async with self._session().get(f"{self.url}/health", timeout=HEALTH_TIMEOUT) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    @staticmethod
    async def _startup_failure(server: LlamaServer, what: str) -> SwitchFailed:
        return SwitchFailed(f"{what}; last lines of {server.log_path}:\n{await server.log_tail()}")

    async def died(self) -> str | None:
        """Wait until the ready server exits; why, when nobody stopped it (None: it was stopped,
        or replaced)."""
        server = self.server
        if server is None:
            return None
        code = await server.process.wait()
        if server is not self.server or self.state is not ServerState.READY:
            return None
        self._forget()
        return f"llama-server exited unexpectedly with code {code}; see {server.log_path}"

    async def stop(self) -> Release | None:
        """Stop the server this proxy started, never one it did not: the expected release is its own
        NVML share, else what it took when it started."""
        server = self.server
        if server is None or not server.running:
            self._forget()
            return None
        before = await sample(self.gpu)
        self._enter(ServerState.STOPPING)
        await server.stop(self.stop_grace)
        self._forget()
        if isinstance(before, NoVram):
            return None
        held = before.process_bytes(server.process.pid) or self.measured_bytes
        return Release(before.used_bytes, held) if held else None

    def _forget(self) -> None:
        self._enter(ServerState.STOPPED)
        self.server = None

    def _enter(self, state: ServerState) -> None:
        self.state = advance(SERVER_STATES, self.state, state)
