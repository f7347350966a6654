"""The fuzz pass the scripts measure a proxy with: seeded bodies of every size and shape (chats of
one to 300 turns from 1 KB to 8 MB, gzip, cut-short JSON, streams), sent from a few threads.
scripts/measure/measure_hardening.py (its N8 row: RSS and CPU per pass) and scripts/bench/bench.py
(the proxy's CPU per pass, beside bare mitmdump's) send the same bodies."""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import random

import httpx


def fuzz_bodies(count: int, seed: int = 8) -> list[tuple[bytes, dict[str, str]]]:
    """`count` seeded bodies, each with the headers to send it with."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        size = int(2 ** rng.uniform(10, 23))  # 1 KB .. 8 MB
        turns = rng.choice([1, 2, 10, 100, 300])
        words = max(size // 6 // turns, 1)
        messages = [{"role": ("user", "assistant")[t % 2], "content": " ".join(f"w{rng.randint(0, 99999)}" for _ in range(min(words, 200))) * max(words // 200, 1)}
                    for t in range(turns)] + [{"role": "user", "content": "go"}]  # fmt: skip
        body = json.dumps({"model": "m", "messages": messages, "stream": rng.random() < 0.3}).encode()
        headers: dict[str, str] = {}
        kind = rng.random()
        if kind < 0.15:
            body, headers = gzip.compress(body, 1), {"Content-Encoding": "gzip"}
        elif kind < 0.2:
            body = body[: rng.randint(1, len(body))]  # cut short: bad JSON
        out.append((body, headers))
    return out


def fuzz_pass(url: str, bodies: list[tuple[bytes, dict[str, str]]], threads: int = 4) -> None:
    """POST every body to `url` (a chat route) from `threads` threads; what comes back is not judged."""

    def send(item: tuple[bytes, dict[str, str]]) -> None:
        try:
            httpx.post(url, content=item[0], headers={"Content-Type": "application/json", **item[1]}, timeout=300, trust_env=False)
        except httpx.HTTPError:
            pass

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(send, bodies))
