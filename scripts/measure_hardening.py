"""The hardening figures for the README's fault table, measured on a real mitmdump with the addon.

    .venv/bin/python scripts/measure_hardening.py [--bomb-mb 400] [--names 2000] [--conversations 50]

1. A compressed bomb: a gzip body that inflates to `--bomb-mb` MB, sent to /api/chat while another
   client sends a small request every 20 ms. Prints the time to the 413, the worst latency the other
   client saw meanwhile (and the same client's worst latency with no bomb, as the floor), and the
   proxy's peak RSS.
2. A soak: `--names` requests each naming a distinct 32 KB model, and `--conversations` long
   conversations (each turn adding to its history, compacted every turn). Prints the proxy's RSS
   after each tenth of the run: it must stay flat once the bounded caches are full.

Everything runs against the fake Ollama (fast, deterministic); the numbers are the proxy's own.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: tests/support/ as `support`
from support.backends import start_module, start_proxy
from support.measure import memory_mib, worst_latency_while


def bomb(proxy: str, pid: int, megabytes: int) -> dict[str, float]:
    head = b'{"model": "fake", "messages": [{"role": "user", "content": "'
    packed = gzip.compress(head + b"0" * (megabytes << 20), compresslevel=6)

    def version(client: httpx.Client) -> None:
        client.get(f"{proxy}/api/version")

    floor = worst_latency_while(version, None, 2.0, every=0.02)
    refused: list[tuple[httpx.Response, float]] = []

    def send() -> None:
        started = time.perf_counter()
        response = httpx.post(f"{proxy}/api/chat", content=packed, headers={"Content-Encoding": "gzip"}, timeout=120)
        refused.append((response, time.perf_counter() - started))

    worst = worst_latency_while(version, send, every=0.02)
    response, took = refused[0]
    assert response.status_code == 413, response.text[:200]
    return {
        "compressed_mb": round(len(packed) / (1 << 20), 2),
        "inflates_to_mb": megabytes,
        "refused_in_s": round(took, 2),
        "worst_other_client_ms": round(worst, 1),
        "worst_other_client_idle_ms": round(floor, 1),
        "peak_rss_mib": round(memory_mib(pid, "VmHWM"), 1),
    }


def soak(proxy: str, pid: int, names: int, conversations: int) -> list[tuple[str, float]]:
    samples = [("start", memory_mib(pid))]
    steps = names + conversations * 40
    done = 0
    histories = [[{"role": "system", "content": f"Conversation {c}."}, {"role": "user", "content": f"task {c}"}]
                 for c in range(conversations)]  # fmt: skip
    with httpx.Client(timeout=60) as client:
        for n in range(names):
            body = {"model": f"m{n}-" + "x" * 32_000, "messages": [{"role": "user", "content": "hi"}], "stream": False}
            client.post(f"{proxy}/api/chat", json=body)
            done += 1
            if done % max(steps // 10, 1) == 0:
                samples.append((f"{done}/{steps}", memory_mib(pid)))
        for turn in range(40):
            for c, history in enumerate(histories):
                history += [{"role": "assistant", "content": f"step {turn} " + "log line\n" * 50},
                            {"role": "user", "content": f"tool output {turn}: " + "data " * 400}]  # fmt: skip
                body = {"model": "fake", "messages": history, "stream": False, "options": {"num_ctx": 4096, "num_predict": 4}}
                client.post(f"{proxy}/api/chat", json=body)
                done += 1
                if done % max(steps // 10, 1) == 0:
                    samples.append((f"{done}/{steps}", memory_mib(pid)))
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bomb-mb", type=int, default=400)
    ap.add_argument("--names", type=int, default=2000)
    ap.add_argument("--conversations", type=int, default=50)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="contextpaw-hardening-") as tmp:
        work = Path(tmp)
        with start_module("support.fake_ollama", ["--n-ctx", "4096", "--model", "fake"], "/", work / "ollama.log") as backend:
            options = [f"contextpaw_ollama={backend.url}", f"contextpaw_state_dir={work / 'state'}"]
            with start_proxy(backend.url, work / "conf", work / "bomb.log", options=options) as proxy:
                print(json.dumps({"measure": "bomb", **bomb(proxy.url, proxy.process.pid, args.bomb_mb)}))
            with start_proxy(backend.url, work / "conf", work / "soak.log", options=options) as proxy:
                samples = soak(proxy.url, proxy.process.pid, args.names, args.conversations)
    print("| after | RSS MiB |\n|---|---:|")
    for label, rss in samples:
        print(f"| {label} | {rss:.1f} |")
    later = [rss for _, rss in samples[len(samples) // 2 :]]
    print(json.dumps({"measure": "soak", "start_mib": round(samples[0][1], 1), "end_mib": round(samples[-1][1], 1),
                      "second_half_spread_mib": round(max(later) - min(later), 1),
                      "second_half_median_mib": round(statistics.median(later), 1)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
