"""What the scripts measure a running proxy with: a process's memory and CPU time, and the worst
latency a small request sees while something else runs."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def memory_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (`VmHWM`: its peak) in MiB; NaN once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system), from /proc; NaN once it is gone. What a proxy
    costs per request is this over a run divided by its requests: it counts the proxy's own work,
    not the time it spent waiting for a CPU the machine's other processes held."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worst_latency_while(request: Callable[[httpx.Client], object], busy: Callable[[], None] | None, seconds: float = 0.0,
                        every: float = 0.01) -> float:  # fmt: skip
    """The worst latency (ms) of `request`, made every `every` seconds from another thread while
    `busy` runs (or, without it, for `seconds`), from a little before it to a little after."""
    done, worst = threading.Event(), [0.0]

    def ping() -> None:
        with httpx.Client(timeout=60, trust_env=False) as client:
            while not done.is_set():
                started = time.perf_counter()
                request(client)
                worst[0] = max(worst[0], (time.perf_counter() - started) * 1000)
                time.sleep(every)

    pinger = threading.Thread(target=ping)
    pinger.start()
    time.sleep(0.2)
    if busy is None:
        time.sleep(seconds)
    else:
        busy()
    time.sleep(0.1)
    done.set()
    pinger.join()
    return worst[0]


class PeakMemory:
    """The highest resident memory (MiB) a process reaches while the `with` block runs, sampled
    every `every` seconds (`VmHWM` is the peak of its whole life, which one attack cannot be told by)."""

    def __init__(self, pid: int, every: float = 0.01) -> None:
        self.pid, self.every, self.peak_mib = pid, every, 0.0
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak_mib = max(self.peak_mib, memory_mib(self.pid))
            time.sleep(self.every)

    def __enter__(self) -> PeakMemory:
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._sampler.join()
        self.peak_mib = max(self.peak_mib, memory_mib(self.pid))
