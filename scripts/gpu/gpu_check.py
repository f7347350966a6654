"""The VRAM estimate against what a real card measures (for a machine with an NVIDIA GPU).

    bash scripts/gpu/gpu_check.sh          # or: PYTHONPATH=tests .venv/bin/python scripts/gpu/gpu_check.py [--ctx 4096]

NVML readings before, while llama-server runs the bundled SmolLM2 model with `-ngl 99`, and after it
stops; the arbiter's estimate for that command (GGUF weights + KV cache + compute margin) beside the
measured use (the process's own NVML share, and the device's used delta). A llama-server built
without CUDA offloads nothing, and the table says so. Under 5 minutes; exits 2 without NVML.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path

import httpx

from contextpaw.gpu.nvml import GpuUnavailable, NvmlProbe
from contextpaw.gpu.vram import estimate, read_shape, server_plan

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import free_port, locate_llama_server, locate_smollm2, start_process

MIB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args(argv)
    probe = NvmlProbe()
    try:
        before = probe.read()
    except GpuUnavailable as e:
        print(json.dumps({"nvml": None, "reason": str(e)}))
        return 2
    binary, model = locate_llama_server(build=False), locate_smollm2()
    if binary.path is None or model.path is None:
        print(json.dumps({"error": binary.reason or model.reason}))
        return 2
    port = free_port()
    argv_ = [
        str(binary.path),
        "-m",
        str(model.path),
        "-c",
        str(args.ctx),
        "-ngl",
        "99",
        "-np",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    plan = server_plan(shlex.join(argv_))
    assert plan is not None
    need = estimate(read_shape(plan.model), args.ctx, plan.kv_type, plan.offloaded)
    log = Path("/tmp/contextpaw-gpu-check.log")
    server = start_process(argv_, f"http://127.0.0.1:{port}", "/health", log, 180)
    try:
        httpx.post(f"{server.url}/completion", json={"prompt": "Hello", "n_predict": 8}, timeout=120)
        loaded = probe.read()
    finally:
        server.stop()
    time.sleep(2)
    after = probe.read()
    own = loaded.process_bytes(server.process.pid)
    delta = loaded.used_bytes - before.used_bytes
    layers = re.search(r"offloaded (\d+)/(\d+) layers to GPU", log.read_text(errors="replace"))
    offloaded = bool(layers and int(layers.group(1)) > 0)
    rows = [
        ("device", loaded.devices[0].name),
        ("used before (MiB)", before.used_bytes // MIB),
        ("used while loaded (MiB)", loaded.used_bytes // MIB),
        ("used after stop (MiB)", after.used_bytes // MIB),
        ("measured: llama-server's own share (MiB)", own // MIB if own is not None else "not reported"),
        ("measured: used delta (MiB)", delta // MIB),
        ("estimate: weights (MiB)", need.weights_bytes // MIB),
        ("estimate: KV cache at ctx (MiB)", need.kv_bytes // MIB),
        ("estimate: compute margin (MiB)", need.compute_bytes // MIB),
        ("estimate: total (MiB)", need.total_bytes // MIB),
        ("estimate / measured", round(need.total_bytes / max(own or delta, 1), 2)),
        (
            "layers offloaded to the GPU",
            f"{layers.group(1)}/{layers.group(2)}" if offloaded and layers else "none: this llama-server build has no GPU backend",
        ),
    ]
    print("| reading | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(json.dumps({"need": need.as_json(), "own_bytes": own, "delta_bytes": delta, "offloaded": offloaded}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
