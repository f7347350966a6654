"""GPU memory readings through NVML, behind a small interface that tests replace with a fake.

The arbiter needs to know whether memory was really given back after it unloaded a runtime: Ollama
drops a model from ``/api/ps`` before the driver frees it, and a stopped process can hold VRAM until
it is reaped. Machines without a GPU or driver still arbitrate on process state; every reading then
says why there is none instead of failing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import pynvml


class GpuUnavailable(Exception):
    """NVML cannot be read here (no library, no driver, no device); the message says which."""


@dataclass(frozen=True)
class ProcessMemory:
    """One process's share of a device. ``used_bytes`` is None where the driver does not account per
    process (Windows WDDM, some containers)."""

    pid: int
    name: str | None
    used_bytes: int | None


@dataclass(frozen=True)
class DeviceMemory:
    index: int
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    processes: tuple[ProcessMemory, ...] | None
    processes_unavailable: str | None = None


@dataclass(frozen=True)
class VramReading:
    """All devices at one instant; the arbiter compares totals because a runtime may span cards."""

    devices: tuple[DeviceMemory, ...]

    @property
    def used_bytes(self) -> int:
        return sum(device.used_bytes for device in self.devices)

    def process_bytes(self, pid: int) -> int | None:
        """Memory ``pid`` holds across devices, or None when no device accounts for it."""
        shares = [
            process.used_bytes
            for device in self.devices
            for process in device.processes or ()
            if process.pid == pid and process.used_bytes is not None
        ]
        return sum(shares) if shares else None

    def as_json(self) -> list[dict[str, Any]]:
        return [asdict(device) for device in self.devices]


@dataclass(frozen=True)
class NoVram:
    """The outcome of a read that found no GPU to measure, kept so reports can say why."""

    reason: str


class GpuProbe(Protocol):
    """What the arbiter needs from a GPU; synchronous because NVML is."""

    def read(self) -> VramReading:
        """Every device now; raises :class:`GpuUnavailable`."""
        ...

    def close(self) -> None: ...


class NvmlProbe:
    """NVML through ``pynvml``, initialised on first read.

    A failed initialisation is remembered: a missing library or driver does not appear while the
    proxy runs, and retrying would cost a library search on every poll.
    """

    def __init__(self) -> None:
        self._initialised = False
        self._failure: str | None = None

    def read(self) -> VramReading:
        self._initialise()
        try:
            count = pynvml.nvmlDeviceGetCount()
            return VramReading(tuple(self._device(index) for index in range(count)))
        except pynvml.NVMLError as error:
            raise GpuUnavailable(f"NVML read failed: {error}") from error

    def close(self) -> None:
        if self._initialised:
            self._initialised = False
            pynvml.nvmlShutdown()

    def _initialise(self) -> None:
        if self._failure is not None:
            raise GpuUnavailable(self._failure)
        if self._initialised:
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            self._failure = f"NVML unavailable: {error}"
            raise GpuUnavailable(self._failure) from error
        self._initialised = True

    def _device(self, index: int) -> DeviceMemory:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            processes, unavailable = self._processes(handle), None
        except pynvml.NVMLError as error:
            processes, unavailable = None, f"per-process usage unavailable: {error}"
        return DeviceMemory(
            index=index,
            name=pynvml.nvmlDeviceGetName(handle),
            total_bytes=memory.total,
            used_bytes=memory.used,
            free_bytes=memory.free,
            processes=processes,
            processes_unavailable=unavailable,
        )

    def _processes(self, handle: Any) -> tuple[ProcessMemory, ...]:
        return tuple(
            ProcessMemory(pid=process.pid, name=_process_name(process.pid), used_bytes=process.usedGpuMemory)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        )


def _process_name(pid: int) -> str | None:
    """The executable's path; None where the driver hides other users' processes."""
    try:
        return pynvml.nvmlSystemGetProcessName(pid)
    except pynvml.NVMLError:
        return None


async def sample(probe: GpuProbe) -> VramReading | NoVram:
    """Read off the event loop: NVML is fast, but a wedged driver must not stall every stream."""
    try:
        return await asyncio.to_thread(probe.read)
    except GpuUnavailable as error:
        return NoVram(str(error))


async def poll_until(condition: Callable[[], Awaitable[bool]], timeout: float, interval: float) -> bool:
    """Poll ``condition`` every ``interval`` seconds until it holds (True) or ``timeout`` passes
    (False): how a switch waits for the card, Ollama or llama-server to catch up with what it asked."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await condition():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(interval)
    return True
