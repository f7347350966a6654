"""Interleaved A/B of the small-request path: bare mitmdump and ContextPaw variants, one run.

    PYTHONPATH=tests .venv/bin/python scripts/bench/bench_ab.py NAME=CHECKOUT[,OPTION=VALUE...] ... [--rounds 8] [--requests 200] [--stream]

Each NAME runs one mitmdump in reverse mode in front of one fake llama-server; CHECKOUT is a
checkout of ContextPaw whose `contextpaw_addon.py` it loads (a `git worktree` of another commit, say),
or `bare` for mitmdump without a script; OPTIONs are `--set`s for that mitmdump (for example
`contextpaw_relay=false`). In each round every path sends `--requests` small fitting POSTs from one
keep-alive client (with `--stream`, streamed: the answer comes as SSE records), in turns that
alternate direction, so machine noise hits each path alike. Prints, per path: mean and p50 latency,
CPU a request (the mitmdump process's own, from /proc), and both against the first path. What a
change to the per-request path costs is measured here, not in tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import free_port, start_module, start_process  # noqa: E402
from support.measure import cpu_seconds  # noqa: E402

WINDOW = 65_536
"""The fake's and ContextPaw's window: every request fits, nothing is compacted."""


def body(i: int, stream: bool = False) -> bytes:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Request {i}: say hi."}]
    return json.dumps({"model": "fake-model", "messages": messages, "max_tokens": 8, "stream": stream}).encode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", metavar="NAME=CHECKOUT[,OPTION=VALUE...]")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200, help="small POSTs per path and round")
    ap.add_argument("--stream", action="store_true", help="ask for streamed answers")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="contextpaw-ab-")))
        fake = stack.enter_context(start_module("support.fake_llamacpp", ["--n-ctx", str(WINDOW)], "/health", work / "fake.log"))
        urls, processes = {}, {}
        for spec in args.paths:
            name, _, rest = spec.partition("=")
            checkout, *options = rest.split(",")
            port = free_port()
            argv_ = [sys.executable, "-c", "from mitmproxy.tools.main import mitmdump; mitmdump()", "-q",
                     "--mode", f"reverse:{fake.url}@127.0.0.1:{port}", "--set", "connection_strategy=lazy",
                     "--set", f"confdir={work / name}"]  # fmt: skip
            if checkout != "bare":
                argv_ += ["-s", str(Path(checkout) / "contextpaw_addon.py"), "--set", f"contextpaw_default_ctx={WINDOW}",
                          "--set", "contextpaw_calibrate=false", "--set", f"contextpaw_llamacpp={fake.url}"]  # fmt: skip
            for option in options:
                argv_ += ["--set", option]
            urls[name] = f"http://127.0.0.1:{port}"
            processes[name] = stack.enter_context(start_process(argv_, urls[name], "/health", work / f"{name}.log", 60))
        clients = {name: stack.enter_context(httpx.Client(trust_env=False, timeout=30)) for name in urls}
        for name, url in urls.items():  # warm up: connections, window discovery
            for i in range(30):
                clients[name].post(
                    url + "/v1/chat/completions", content=body(-i, args.stream), headers={"content-type": "application/json"}
                ).raise_for_status()
        names = list(urls)
        latency: dict[str, list[float]] = {name: [] for name in names}
        cpu = dict.fromkeys(names, 0.0)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                before = cpu_seconds(processes[name].process.pid)
                for i in range(args.requests):
                    started = time.perf_counter()
                    clients[name].post(
                        urls[name] + "/v1/chat/completions", content=body(i, args.stream), headers={"content-type": "application/json"}
                    )
                    latency[name].append(time.perf_counter() - started)
                cpu[name] += cpu_seconds(processes[name].process.pid) - before
    first = names[0]
    for name in names:
        mean, per_request = statistics.fmean(latency[name]), cpu[name] / len(latency[name])
        share = f"{cpu[name] / cpu[first]:.2f}x" if cpu[first] > 0 else "- (too short a run for the CPU clock's ticks)"
        print(f"{name:24s} mean {mean * 1000:.3f} ms  p50 {statistics.median(latency[name]) * 1000:.3f} ms  "
              f"CPU {per_request * 1000:.3f} ms a request  throughput {statistics.fmean(latency[first]) / mean:.2f}x  "
              f"CPU {share} of {first}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
