"""Throughput of the three evicted stores, measured in one interleaved run (not asserted).

    .venv/bin/python scripts/bench/bench_archive.py [--rounds 5] [--items 2000] [--size 2048]

Each round, in a shuffled order, each store (memory, SQLite in a temporary state dir, Redis on a
redis-server of its own on a free loopback port) takes `--items` puts of `--size`-byte contents
(timed as the caller sees them: `put` hands over to the writer thread), then is flushed (timed:
until everything is on disk or in Redis), then answers as many gets of random ids. Interleaving
rounds spreads the machine's load over the stores alike. Prints the median of each rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from contextpaw.ops.archive_sqlite import ARCHIVE_FILE, SqliteStore  # noqa: E402
from contextpaw.ops.evicted import EvictedStore, MemoryStore, encode  # noqa: E402


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)


def contents(n: int, size: int, seed: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    words = ["error", "GET", "/api/chat", "token", "window", "cache", "parser", "DB_HOST", "build", "test"]
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(size // 6))[:size]
        out.append((f"cp-{seed:04x}{i:08x}", encode([{"role": "tool", "content": text}])))
    return out


def measure(store: EvictedStore, items: list[tuple[str, bytes]], rng: random.Random) -> dict[str, float]:
    started = time.perf_counter()
    for marker_id, data in items:
        store.put(marker_id, data)
    handed = time.perf_counter() - started
    assert store.flush(300)
    written = time.perf_counter() - started
    ids = [marker_id for marker_id, _ in items]
    asked = [rng.choice(ids) for _ in items]
    started = time.perf_counter()
    hits = sum(store.get(marker_id) is not None for marker_id in asked)
    read = time.perf_counter() - started
    assert hits == len(asked), f"{hits} of {len(asked)} read back"
    n = len(items)
    return {"put_per_s": n / handed, "durable_put_per_s": n / written, "get_per_s": n / read}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--size", type=int, default=2048)
    args = parser.parse_args(argv)
    bounds = {"max_items": 10 * args.items, "max_bytes": 1 << 30, "max_age_s": 3600}
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as redis_url:
        kinds = ["memory", "sqlite"] + (["redis"] if redis_url else [])
        rng = random.Random(42)
        for round_ in range(args.rounds):
            rng.shuffle(kinds)
            for kind in kinds:
                store: EvictedStore
                if kind == "memory":
                    store = MemoryStore(**bounds)  # type: ignore[arg-type]
                elif kind == "sqlite":
                    store = SqliteStore(Path(tmp) / f"state-{round_}" / ARCHIVE_FILE, **bounds)  # type: ignore[arg-type]
                else:
                    from contextpaw.ops.archive_redis import RedisStore

                    store = RedisStore(redis_url or "", **bounds, prefix=f"bench:{round_}:")  # type: ignore[arg-type]
                try:
                    results.setdefault(kind, []).append(measure(store, contents(args.items, args.size, round_), rng))
                finally:
                    store.close()
        if not redis_url:
            print("redis-server is not installed: Redis not measured", file=sys.stderr)
    summary = {
        kind: {metric: round(statistics.median(r[metric] for r in rounds)) for metric in rounds[0]} for kind, rounds in results.items()
    }
    print(json.dumps({"rounds": args.rounds, "items": args.items, "size": args.size, "median": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
