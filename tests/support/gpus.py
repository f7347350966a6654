"""GPU readings for tests: a machine with no NVML."""

from __future__ import annotations

from contextpaw.gpu.nvml import GpuUnavailable, VramReading


class NoGpu:
    def read(self) -> VramReading:
        raise GpuUnavailable("NVML unavailable: NVML Shared Library Not Found")

    def close(self) -> None:
        pass
