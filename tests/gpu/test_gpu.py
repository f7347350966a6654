"""NvmlProbe turns pynvml's answers into readings, and every NVML failure into a reason.

pynvml is replaced function by function, so these run the same with or without a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from contextpaw.gpu.nvml import GpuUnavailable, NoVram, NvmlProbe, VramReading, sample

GIB = 1 << 30


class FakeNvml:
    """Two 24 GiB cards; pid 41 spans both, pid 42 hides its usage (None) as WDDM does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, process_error: int | None = None) -> None:
        self.inits = 0
        self.shutdowns = 0
        self.process_error = process_error
        self.memory = [SimpleNamespace(total=24 * GIB, used=10 * GIB, free=14 * GIB),
                       SimpleNamespace(total=24 * GIB, used=3 * GIB, free=21 * GIB)]  # fmt: skip
        self.processes = [[SimpleNamespace(pid=41, usedGpuMemory=8 * GIB), SimpleNamespace(pid=42, usedGpuMemory=None)],
                          [SimpleNamespace(pid=41, usedGpuMemory=2 * GIB)]]  # fmt: skip
        for name, value in {
            "nvmlInit": self.init,
            "nvmlShutdown": self.shutdown,
            "nvmlDeviceGetCount": lambda: 2,
            "nvmlDeviceGetHandleByIndex": lambda index: index,
            "nvmlDeviceGetMemoryInfo": lambda handle: self.memory[handle],
            "nvmlDeviceGetName": lambda handle: f"Fake RTX {handle}",
            "nvmlDeviceGetComputeRunningProcesses": self.running,
            "nvmlSystemGetProcessName": self.process_name,
        }.items():
            monkeypatch.setattr(pynvml, name, value)

    def init(self) -> None:
        self.inits += 1

    def shutdown(self) -> None:
        self.shutdowns += 1

    def running(self, handle: int) -> list[SimpleNamespace]:
        if self.process_error is not None:
            raise pynvml.NVMLError(self.process_error)
        return self.processes[handle]

    @staticmethod
    def process_name(pid: int) -> str:
        if pid == 42:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        return "/usr/bin/llama-server"


def test_reading_sums_devices_and_attributes_memory_to_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(monkeypatch)
    reading = NvmlProbe().read()
    assert reading.used_bytes == 13 * GIB
    assert [device.name for device in reading.devices] == ["Fake RTX 0", "Fake RTX 1"]
    assert reading.process_bytes(41) == 10 * GIB
    assert reading.process_bytes(42) is None
    assert reading.process_bytes(7) is None
    first = reading.as_json()[0]
    assert first["free_bytes"] == 14 * GIB
    assert first["processes"] == (
        {"pid": 41, "name": "/usr/bin/llama-server", "used_bytes": 8 * GIB},
        {"pid": 42, "name": None, "used_bytes": None},
    )


def test_per_process_refusal_keeps_the_device_totals(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(monkeypatch, process_error=pynvml.NVML_ERROR_NO_PERMISSION)
    device = NvmlProbe().read().devices[0]
    assert device.used_bytes == 10 * GIB
    assert device.processes is None
    assert device.processes_unavailable == "per-process usage unavailable: Insufficient Permissions"


def test_missing_driver_is_a_reason_remembered_without_retrying(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def init() -> None:
        calls.append(1)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", init)
    probe = NvmlProbe()
    for _ in range(2):
        with pytest.raises(GpuUnavailable, match="NVML unavailable: NVML Shared Library Not Found"):
            probe.read()
    assert len(calls) == 1
    probe.close()


def test_a_failing_read_after_init_is_unavailable_too(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(monkeypatch)

    def lost(handle: int) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lost)
    with pytest.raises(GpuUnavailable, match="NVML read failed"):
        NvmlProbe().read()
    assert nvml.inits == 1


def test_close_shuts_nvml_down_once_and_only_if_started(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(monkeypatch)
    NvmlProbe().close()
    assert nvml.shutdowns == 0
    probe = NvmlProbe()
    probe.read()
    probe.read()
    probe.close()
    probe.close()
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


async def test_sample_reads_off_the_loop_and_turns_failure_into_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(monkeypatch)
    assert isinstance(await sample(NvmlProbe()), VramReading)

    def init() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", init)
    assert await sample(NvmlProbe()) == NoVram("NVML unavailable: Driver Not Loaded")
