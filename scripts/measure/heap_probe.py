"""What a running proxy's memory is made of, for `measure_hardening.py --probe` (never loaded in
production): a mitmproxy script that answers on its own port (`HEAP_PROBE_PORT`) with one JSON line
per connection:

- RSS, and RSS once `malloc_trim(0)` has run (what is free inside malloc but still resident);
- `mallinfo2`: bytes malloc holds in its arenas and in mmap'd chunks, in use and free;
- Python's live objects by type (counts and, for bytes/str/bytearray, their sizes), the big ones;
- with `HEAP_PROBE_TRACE=N`, tracemalloc with N frames: the top sizes by line, and the change since
  the previous probe.

    mitmdump -s scripts/measure/heap_probe.py -s contextpaw_addon.py ...   (HEAP_PROBE_PORT=PORT)
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import gc
import json
import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

MIB = 1 << 20


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def mallinfo() -> dict[str, float]:
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Mallinfo2
    info = libc.mallinfo2()
    return {
        "arena_mib": info.arena / MIB,  # sbrk'd + non-main arenas' heaps
        "mmap_mib": info.hblkhd / MIB,  # big chunks, each its own mmap
        "in_use_mib": info.uordblks / MIB,
        "free_mib": info.fordblks / MIB,
        "free_chunks": info.ordblks,
    }


def arenas() -> int:
    """How many arenas malloc made (malloc_info's XML, one `<heap nr=` each)."""
    libc = ctypes.CDLL(None)
    libc.open_memstream.restype = ctypes.c_void_p
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    text = ctypes.string_at(buf, size.value).decode()
    libc.free(buf)
    return text.count("<heap nr=")


class HeapProbe:
    def __init__(self) -> None:
        self.port = int(os.environ.get("HEAP_PROBE_PORT", "0"))
        frames = int(os.environ.get("HEAP_PROBE_TRACE", "0"))
        if frames:
            tracemalloc.start(frames)
        self.previous: tracemalloc.Snapshot | None = None
        self.server: asyncio.AbstractServer | None = None
        self.trims = 0
        self.wrapped = False

    async def running(self) -> None:
        if self.port:
            self.server = await asyncio.start_server(self._answer, "127.0.0.1", self.port)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        report = self.report()
        writer.write(json.dumps(report).encode() + b"\n")
        await writer.drain()
        writer.close()

    def request(self, flow: Any) -> None:
        if not self.wrapped:
            self.wrapped = wrap_trims(self)

    def report(self) -> dict[str, Any]:
        before = {"rss_mib": rss_mib(), "malloc": mallinfo(), "gc_stats": gc.get_stats(), "gc_count": gc.get_count()}
        started = time.perf_counter()
        found = gc.collect()
        before["gc_ms"] = (time.perf_counter() - started) * 1000
        out: dict[str, Any] = {"before_gc": before, "gc_found": found, "rss_mib": rss_mib(), "malloc": mallinfo(), "arenas": arenas(), "threads": threading.active_count(),
                               "allocated_blocks": sys.getallocatedblocks()}  # fmt: skip
        counts: collections.Counter[str] = collections.Counter()
        sizes: collections.Counter[str] = collections.Counter()
        big: list[tuple[int, str]] = []
        everything = reachable()
        for obj in everything:
            name = type(obj).__qualname__
            counts[name] += 1
            size = sys.getsizeof(obj)
            sizes[name] += size
            if size >= 256 * 1024:
                big.append((size, name))
        out["objects"] = dict(counts.most_common(30))
        out["reachable_objects"] = len(everything)
        out["reachable_mib"] = sum(sizes.values()) / MIB
        out["sizes_mib"] = {k: round(v / MIB, 2) for k, v in sizes.most_common(20)}
        out["big_objects"] = {"count": len(big), "mib": sum(s for s, _ in big) / MIB,
                              "by_type": dict(collections.Counter(n for _, n in big))}  # fmt: skip
        out["caches"] = caches(everything)
        out["trims"] = self.trims
        if tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            out["traced_mib"] = tracemalloc.get_traced_memory()[0] / MIB
            out["top"] = [f"{s.size / MIB:.2f} MiB {s.count} {s.traceback.format()[-1].strip()}" for s in snap.statistics("lineno")[:15]]
            if self.previous is not None:
                out["grew"] = [f"{d.size_diff / MIB:+.2f} MiB {d.count_diff:+} {d.traceback.format()[-1].strip()}"
                               for d in snap.compare_to(self.previous, "lineno")[:15]]  # fmt: skip
            self.previous = snap
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim(0)
        out["rss_after_trim_mib"] = rss_mib()
        out["malloc_after_trim"] = mallinfo()
        return out


def reachable() -> list[Any]:
    """Every object reachable from the modules, mitmproxy's master and what the collector tracks
    (`gc.get_objects` leaves out what `gc.freeze` froze), each once. The `_asyncio` module's own
    referents are never asked for: on 3.12 that hands out its free list, and the collector loops
    forever on it afterwards (CPython gh-122695)."""
    from mitmproxy import ctx

    todo: list[Any] = [sys.modules, getattr(ctx, "master", None), *gc.get_objects()]
    seen: dict[int, Any] = {id(sys.modules.get("_asyncio")): sys.modules.get("_asyncio")}
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen[id(obj)] = obj
        todo.extend(gc.get_referents(obj))
    return list(seen.values())


def caches(everything: list[Any]) -> dict[str, Any]:
    """Every bounded cache ContextPaw holds (its LRUs, the evicted store), and mitmproxy's flows."""
    out: dict[str, Any] = {}
    from mitmproxy import http

    out["HTTPFlow"] = sum(isinstance(obj, http.HTTPFlow) for obj in everything)
    try:
        from contextpaw.core.caches import LRU
        from contextpaw.ops.evicted import EvictedStore
    except ImportError:
        return out
    for obj in everything:
        if isinstance(obj, LRU):
            key = f"{type(obj).__name__}[{obj.limit}]"
            out.setdefault(key, []).append([len(obj), getattr(obj, "bytes", None)])
        elif isinstance(obj, EvictedStore):
            out["EvictedStore"] = [len(obj), obj.bytes]
    return out


def wrap_trims(probe: HeapProbe) -> bool:
    """Count ContextPaw's trims (once its script is loaded); whether it was found."""
    from mitmproxy import ctx
    from mitmproxy.addonmanager import traverse

    for each in traverse(ctx.master.addons.chain):
        if type(each).__name__ == "ReturnedMemory" and getattr(each, "libc", None) is not None:
            each.libc = Counting(each.libc, probe)
            return True
    return False


class Counting:
    """A libc whose `malloc_trim` calls are counted."""

    def __init__(self, libc: Any, probe: HeapProbe) -> None:
        self.libc, self.probe = libc, probe

    def malloc_trim(self, pad: int) -> int:
        self.probe.trims += 1
        return self.libc.malloc_trim(pad)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.libc, name)


addons = [HeapProbe()]
