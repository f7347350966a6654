"""The GPU and the two runtimes that share it, as the arbiter reads them: what NVML says is free,
what each resident runtime holds (by its own word: Ollama's ``/api/ps``, the server's NVML share),
what each will take, and whether an eviction's memory came back.

The readings feed :func:`contextpaw.gpu.placement.decide`; the runtimes' I/O is
:class:`~contextpaw.gpu.ollama_models.OllamaModels` and :class:`~contextpaw.gpu.supervisor.Supervisor`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from typing import Any

from contextpaw.gpu.nvml import GpuProbe, NoVram, VramReading, poll_until, sample
from contextpaw.gpu.ollama_models import OllamaModels
from contextpaw.gpu.placement import Release, Room, SwitchFailed, room_left
from contextpaw.gpu.router import RouterServer
from contextpaw.gpu.supervisor import Supervisor
from contextpaw.gpu.vram import MIB
from contextpaw.wire import Kind


class Card:
    """One GPU (``gpu``, every device NVML lists), Ollama's models on it, and the llama-server the
    proxy runs there; ``release_timeout`` bounds the wait for evicted memory to come back."""

    def __init__(
        self, gpu: GpuProbe, ollama: OllamaModels, supervisor: Supervisor | RouterServer, *, release_timeout: float, poll_interval: float
    ) -> None:
        self.gpu = gpu
        self.ollama = ollama
        self.supervisor = supervisor
        self.release_timeout = release_timeout
        self.poll_interval = poll_interval

    async def need(self, kind: Kind, model: str | None = None) -> int | None:
        """Bytes ``kind`` will take (Ollama's for ``model``, when the request names one); None when unknown."""
        return await (self.ollama.need(model) if kind is Kind.OLLAMA else self.supervisor.need(model))

    async def serves(self, kind: Kind, model: str | None) -> bool:
        """Whether resident ``kind`` answers a request for ``model`` without loading anything the
        arbiter must place: Ollama loads its own; a router llama-server must be asked to."""
        return kind is Kind.OLLAMA or await self.supervisor.serves(model)

    async def report(self) -> tuple[VramReading | NoVram, dict[Kind, dict[str, Any]]]:
        """A reading now, and what the card knows of each runtime for the status page: its need,
        Ollama's listed models, the server process."""
        reading = await sample(self.gpu)
        models = await self.ollama.as_json()
        known: dict[Kind, dict[str, Any]] = {kind: {"need_bytes": await self.need(kind)} for kind in Kind}
        known[Kind.OLLAMA]["models"] = models
        known[Kind.LLAMACPP]["process"] = self.supervisor.as_json(reading)
        return reading, known

    async def ollama_loaded(self) -> bool:
        """Whether Ollama lists a model: it loads them for any client, not only through this proxy."""
        try:
            return bool(await self.ollama.listed())
        except SwitchFailed:
            return False

    async def room(self, resident: Collection[Kind]) -> Room | None:
        """Free memory now and what each ``resident`` runtime holds; None without NVML."""
        reading = await sample(self.gpu)
        if isinstance(reading, NoVram):
            return None
        held: dict[Kind, int] = {}
        if Kind.LLAMACPP in resident and (mine := self.supervisor.held_bytes(reading)) is not None:
            held[Kind.LLAMACPP] = mine
        if Kind.OLLAMA in resident:
            with contextlib.suppress(SwitchFailed):
                if size := await self.ollama.held():
                    held[Kind.OLLAMA] = size
        needs = {kind: await self.need(kind) for kind in tuple(resident)}
        return room_left(sum(device.free_bytes for device in reading.devices), held, needs)

    async def await_release(self, release: Release, holder: str) -> None:
        """Wait until NVML shows ``holder``'s memory back: the driver frees it after the process
        state says so, and loading the other runtime before then spills it to system RAM."""
        used: list[int] = []

        async def released() -> bool:
            reading = await sample(self.gpu)
            if isinstance(reading, NoVram):
                return True
            used.append(reading.used_bytes)
            return release.done(reading.used_bytes)

        if not await poll_until(released, self.release_timeout, self.poll_interval):
            raise SwitchFailed(
                f"{holder} was evicted but VRAM did not come back within {self.release_timeout:g}s: "
                f"{used[-1] // MIB} MiB used, expected at most {release.ceiling_bytes // MIB} MiB"
            )
