"""A llama-server in router mode (`--models-preset` or `--models-dir`) as the arbiter drives it:
the process starts once and stays, and the card is shared by loading and unloading its models.

A router serves many models, each in a child server with its own window, and says which are loaded
(`GET /models`); `POST /models/load` and `/models/unload` take one by name. Stopping the process to
make room for Ollama would throw away what the router is for, so :class:`RouterServer` answers the
arbiter as :class:`~contextpaw.gpu.supervisor.Supervisor` does (the process is the supervisor's) and
adds what is per model: what one will take (the GGUF and `--ctx-size` of its listed command), the
one a request wants loaded before it is admitted, and the others unloaded when they must go.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from contextpaw.core import logs
from contextpaw.fitting.windows import router_model
from contextpaw.gpu.nvml import GpuProbe, NoVram, VramReading, poll_until, sample
from contextpaw.gpu.placement import Release, SwitchFailed
from contextpaw.gpu.supervisor import TRAINED_CTX_FALLBACK, Supervisor
from contextpaw.gpu.vram import estimate, read_shape, server_plan

logger = logs.get(__name__)

ROUTER_FLAGS = ("--models-preset", "--models-dir")
MODELS_TIMEOUT = aiohttp.ClientTimeout(total=10)
LOADED, UNLOADED = "loaded", "unloaded"


def is_router_command(command: str) -> bool:
    """Whether a llama-server command starts a router (many models, loaded on demand)."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return False
    return any(arg.partition("=")[0] in ROUTER_FLAGS for arg in argv)


def statuses(listing: Any) -> dict[str, str]:
    """Each model the router lists, by id, and its status (`loaded`, `loading`, `unloaded`...)."""
    entries = listing.get("data") if isinstance(listing, dict) else None
    found = {}
    for entry in entries if isinstance(entries, list) else []:
        status = entry.get("status") if isinstance(entry, dict) else None
        if isinstance(status, dict) and isinstance(entry.get("id"), str):
            found[entry["id"]] = str(status.get("value"))
    return found


def children(pid: int) -> list[int]:
    """The processes `pid` started (the router's model servers), from /proc; none elsewhere."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


class RouterServer:
    """The router at ``url``, its process run by ``supervisor``; ``load_timeout`` bounds a model's
    load and ``release_timeout`` an unload."""

    def __init__(
        self,
        supervisor: Supervisor,
        session: Callable[[], aiohttp.ClientSession],
        gpu: GpuProbe,
        *,
        load_timeout: float,
        release_timeout: float,
        poll_interval: float,
    ) -> None:
        self.supervisor = supervisor
        self.url = supervisor.url
        self._session = session
        self.gpu = gpu
        self.load_timeout = load_timeout
        self.release_timeout = release_timeout
        self.poll_interval = poll_interval
        self.loads: dict[str, int] = {}
        """The models the arbiter loaded, and what the card's use grew by while each loaded (for
        drivers that do not account per process)."""
        self._needs: dict[str, int | None] = {}

    # -- what the arbiter reads, as of a Supervisor --------------------------------------------

    @property
    def state(self) -> Any:
        return self.supervisor.state

    @property
    def running(self) -> bool:
        return self.supervisor.running

    def held_bytes(self, reading: VramReading) -> int | None:
        """What the router and its model servers hold: their NVML shares, else what loads took."""
        server = self.supervisor.server
        if server is None:
            return None
        pid = server.process.pid
        shares = [b for p in (pid, *children(pid)) if (b := reading.process_bytes(p)) is not None]
        return sum(shares) if shares else (sum(self.loads.values()) or None)

    def as_json(self, reading: VramReading | NoVram) -> dict[str, Any] | None:
        process = self.supervisor.as_json(reading)
        return None if process is None else {**process, "router": True, "loaded": sorted(self.loads)}

    async def died(self) -> str | None:
        return await self.supervisor.died()

    async def stop(self) -> Release | None:
        """Stop the router process (the proxy exits, or a start failed)."""
        self.loads.clear()
        return await self.supervisor.stop()

    # -- per model -----------------------------------------------------------------------------

    async def listing(self) -> dict[str, Any] | None:
        """`GET /models`; None when the router does not answer."""
        if not self.supervisor.running:
            return None
        try:
            async with self._session().get(f"{self.url}/models", timeout=MODELS_TIMEOUT) as response:
                response.raise_for_status()
                listing = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return listing if isinstance(listing, dict) else None

    async def loaded(self) -> set[str]:
        """The models the router holds now (loading counts: it is taking the memory)."""
        listing = await self.listing()
        return {m for m, s in statuses(listing).items() if s != UNLOADED}

    async def serves(self, model: str | None) -> bool:
        """Whether a request for `model` is served without loading anything (no model named: the
        router picks one it holds, or loads its own choice, and the arbiter cannot tell which)."""
        if model is None:
            return True
        listing = await self.listing()
        entry = router_model(listing, model) if listing else None
        return entry is not None and statuses({"data": [entry]}).get(entry["id"]) == LOADED

    async def need(self, model: str | None = None) -> int | None:
        """Bytes loading `model` takes, from the GGUF and `--ctx-size` of the command the router lists
        for it (read once a model); None when the router names none."""
        if model is None:
            return None
        if model not in self._needs:
            listing = await self.listing()
            entry = router_model(listing, model) if listing else None
            status = entry.get("status") if entry else None
            args = status.get("args") if isinstance(status, dict) else None
            plan = server_plan(shlex.join(str(a) for a in args)) if isinstance(args, list) else None
            if plan is None:
                return None
            try:
                shape = await asyncio.to_thread(read_shape, plan.model)
            except ValueError:
                self._needs[model] = None
            else:
                self._needs[model] = estimate(
                    shape, plan.ctx or shape.trained_ctx or TRAINED_CTX_FALLBACK, plan.kv_type, plan.offloaded
                ).total_bytes
        return self._needs[model]

    async def start(self, keep_going: Callable[[], None]) -> None:
        """Start the router process; it loads no model until asked."""
        await self.supervisor.start(keep_going)

    async def load(self, model: str, keep_going: Callable[[], None]) -> None:
        """Load `model` and wait until the router says it is loaded; raises :class:`SwitchFailed`
        with where to read why. ``keep_going`` is asked between polls, as in a start."""
        before = await sample(self.gpu)
        await self._ask("load", model)

        async def ready() -> bool:
            keep_going()
            listing = await self.listing()
            entry = router_model(listing, model) if listing else None
            value = statuses({"data": [entry]}).get(entry["id"]) if entry else None
            if value == UNLOADED or value is None:
                raise SwitchFailed(f"llama-server's router could not load {model!r}; see {self.supervisor.log_path}")
            return value == LOADED

        if not await poll_until(ready, self.load_timeout, self.poll_interval):
            raise SwitchFailed(f"llama-server's router did not load {model!r} within {self.load_timeout:g}s")
        after = await sample(self.gpu)
        grew = after.used_bytes - before.used_bytes if isinstance(before, VramReading) and isinstance(after, VramReading) else 0
        self.loads[model] = max(grew, 0)

    async def unload(self) -> Release | None:
        """Unload every model the router holds and wait until it lists none loaded; the expected
        release is what they held on the card."""
        held = await self.loaded()
        if not held:
            return None
        before = await sample(self.gpu)
        release = Release(before.used_bytes, self.held_bytes(before) or 0) if isinstance(before, VramReading) else None
        for model in sorted(held):
            await self._ask("unload", model)

        async def unloaded() -> bool:
            return not await self.loaded()

        if not await poll_until(unloaded, self.release_timeout, self.poll_interval):
            raise SwitchFailed(
                f"llama-server's router still holds {', '.join(sorted(await self.loaded()))} {self.release_timeout:g}s after unloading"
            )
        self.loads.clear()
        logger.info("contextpaw runtime: llama-server's router unloaded %s", ", ".join(sorted(held)))
        return release if release is not None and release.held_bytes else None

    async def _ask(self, verb: str, model: str) -> None:
        """`POST /models/<verb>`; the router's 400 for a model already in that state is no failure."""
        try:
            async with self._session().post(f"{self.url}/models/{verb}", json={"model": model}, timeout=MODELS_TIMEOUT) as response:
                if response.status == 400 and "running" in await response.text():
                    return
                response.raise_for_status()
        except (aiohttp.ClientError, TimeoutError) as error:
            raise SwitchFailed(f"llama-server's router refused to {verb} {model!r}: {error!r}") from error
