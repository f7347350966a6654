"""Print what the arbiter would read from NVML, as JSON, to check a GPU machine before enabling
``contextpaw_arbitrate``: device totals, and whether the driver shows per-process usage.

Run: ``python scripts/gpu/nvml_check.py [--samples N] [--interval S]``; exits 1 when NVML is unreadable.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from contextpaw.gpu.nvml import GpuUnavailable, NvmlProbe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1, help="readings to take (default 1)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between readings (default 0.5)")
    args = parser.parse_args(argv)
    probe = NvmlProbe()
    try:
        for index in range(args.samples):
            if index:
                time.sleep(args.interval)
            started = time.perf_counter()
            reading = probe.read()
            elapsed_ms = (time.perf_counter() - started) * 1000
            sample = {"used_bytes": reading.used_bytes, "read_ms": round(elapsed_ms, 3), "vram": reading.as_json()}
            print(json.dumps(sample))
    except GpuUnavailable as error:
        print(json.dumps({"vram": None, "vram_unavailable": str(error)}))
        return 1
    finally:
        probe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
