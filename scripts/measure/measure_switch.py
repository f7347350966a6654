"""Switch latency on this machine, with the real llama-server and the bundled model.

    PYTHONPATH=tests .venv/bin/python scripts/measure/measure_switch.py [--rounds 5]

Each round, the arbiter (the real `contextpaw.gpu.arbiter.Arbiter`, no GPU here) hands the GPU from an
Ollama (the fake, holding a model) to llama-server: drain, unload Ollama, start llama-server, wait
for /health, and then the first token of a completion; and back again (stop llama-server). Beside
it, a bare restart of the same binary: start, /health, first token. Prints each round and the
medians as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from contextpaw.gpu.arbiter import Arbiter, ArbiterSettings

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import free_port, locate_llama_server, locate_smollm2, start_module, start_process

LOOPBACK = "127.0.0.1"


def first_token(url: str) -> None:
    reply = httpx.post(f"{url}/completion", json={"prompt": "Hello", "n_predict": 1}, timeout=120)
    reply.raise_for_status()


async def arbiter_round(arbiter: Arbiter, llama_url: str, ollama_url: str) -> dict[str, float]:
    await asyncio.to_thread(
        httpx.post, f"{ollama_url}/api/generate", json={"model": "fake", "prompt": ""}, timeout=30
    )  # Ollama holds its model
    started = time.perf_counter()
    async with arbiter.use("llamacpp"):
        healthy = time.perf_counter()
        await asyncio.to_thread(first_token, llama_url)
        token = time.perf_counter()
    back = time.perf_counter()
    async with arbiter.use("ollama"):
        returned = time.perf_counter()
    return {"to_llama_healthy_s": healthy - started, "to_llama_first_token_s": token - started, "back_to_ollama_s": returned - back}


def bare_round(argv: list[str], url: str, log: Path) -> dict[str, float]:
    started = time.perf_counter()
    server = start_process(argv, url, "/health", log, 120, poll=0.02)  # the arbiter's poll interval
    try:
        healthy = time.perf_counter()
        first_token(url)
        token = time.perf_counter()
    finally:
        server.stop()
    return {"bare_healthy_s": healthy - started, "bare_first_token_s": token - started}


async def main_async(rounds: int) -> int:
    binary, model = locate_llama_server(build=False), locate_smollm2()
    if binary.path is None or model.path is None:
        print(f"no real backend: {binary.reason or model.reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="contextpaw-switch-") as tmp:
        work = Path(tmp)
        port = free_port()
        llama_url = f"http://{LOOPBACK}:{port}"
        argv = [str(binary.path), "-m", str(model.path), "-c", "2048", "-np", "1", "--host", LOOPBACK, "--port", str(port)]
        with start_module("support.fake_ollama", ["--model", "fake"], "/", work / "ollama.log") as ollama:
            settings = ArbiterSettings(ollama.url, llama_url, llamacpp_cmd=shlex.join(argv), llamacpp_log=work / "llama.log",
                                       min_hold=0.0, poll_interval=0.02)  # fmt: skip
            arbiter = Arbiter(settings)
            rows = []
            try:
                for n in range(rounds):
                    row = {**await arbiter_round(arbiter, llama_url, ollama.url), **bare_round(argv, llama_url, work / "bare.log")}
                    rows.append(row)
                    print(json.dumps({"round": n, **{k: round(v, 3) for k, v in row.items()}}), flush=True)
            finally:
                await arbiter.aclose()
    medians = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    print(json.dumps({"medians": medians, "cpu_only": True}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    return asyncio.run(main_async(ap.parse_args(argv).rounds))


if __name__ == "__main__":
    sys.exit(main())
