"""The hardening figures for the README's fault table: one row per fault of the probe (N1-N14), each
measured on ContextPaw and on a bare mitmdump in front of the same backend, in the same run.

    PYTHONPATH=tests .venv/bin/python scripts/measure/measure_hardening.py [--quick] [--passes 3]

For each attack: the worst latency another client saw meanwhile (a small chat request every 20 ms)
through ContextPaw and through the bare mitmdump, each proxy's peak RSS during it, and the outcome
(refused in the caller's shape, or passed whole). The fuzz row (N8) is `--passes` passes of the
same seeded bodies: the proxy's RSS after each (flat within 50 MiB after the first, is the bound)
and its CPU time in each. With `--probe 0` (or a number of tracemalloc frames), scripts/measure/heap_probe.py
runs in both proxies and says after each pass what their memory is made of (live objects, garbage
the collector had not reached yet, malloc's free pages, RSS once trimmed); it collects and trims as
it looks, so the RSS figures of a probed run are not the product's.

The backend is this script run as a llama-server look-alike (`--serve PORT`): it counts a token a
word, and serves each attack as the request's `X-Attack` header says, from bytes made at start-up.
"""

from __future__ import annotations

import argparse
import bz2
import concurrent.futures
import contextlib
import gzip
import json
import os
import random
import select
import socket
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from contextpaw.proxy.backends import MAX_BODY_MB
from contextpaw.proxy.heap import SETTLE_S, TRIM_EVERY_S

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import ADDON, Backend, free_port, start_process
from support.common import LOOPBACK
from support.fuzz import fuzz_bodies, fuzz_pass
from support.measure import PeakMemory, cpu_seconds, memory_mib, worst_latency_while

N_CTX = 1024
ROUTE = "/v1/chat/completions"
MB = 1 << 20


def chat(text: str, **extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}], **extra}).encode()


# -- the backend -------------------------------------------------------------------------------


def serve(port: int, sizes: dict[str, int]) -> None:
    from aiohttp import web

    record = b"data: " + b"x" * sizes["record"]
    big = b'{"choices": [{"message": {"role": "assistant", "content": "' + b"y" * sizes["answer"] + b'"}}]}'
    packed = gzip.compress(b'{"pad": "' + b"0" * sizes["inflated_answer"] + b'"}', compresslevel=9)

    def answer(text: str, prompt_tokens: int) -> dict[str, Any]:
        return {"id": "c", "object": "chat.completion", "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}}  # fmt: skip

    async def props(request: web.Request) -> web.Response:
        return web.json_response({"default_generation_settings": {"n_ctx": N_CTX}, "total_slots": 1})

    async def counting(request: web.Request) -> web.Response:
        body = await request.json()
        if request.path == "/apply-template":
            return web.json_response({"prompt": "\n".join(f"{m['role']}: {m['content']}" for m in body["messages"])})
        if request.path == "/tokenize":
            return web.json_response({"tokens": list(range(len(body["content"].split())))})
        return web.json_response({"input_tokens": sum(len(str(m.get("content", "")).split()) + 2 for m in body["messages"])})

    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        attack = request.headers.get("X-Attack", "")
        if attack == "record":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for at in range(0, len(record), MB):
                await response.write(record[at : at + MB])
            await response.write(b"\n\ndata: [DONE]\n\n")
            await response.write_eof()
            return response
        if attack == "big-answer":
            return web.Response(body=big, content_type="application/json")
        if attack == "gzip-answer":
            return web.Response(body=packed, headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        try:
            body = json.loads(raw)
            words = sum(len(str(m.get("content", "")).split()) + 2 for m in body["messages"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return web.json_response({"received_bytes": len(raw), "encoding": request.headers.get("Content-Encoding", "")}, status=400)
        encoding = request.headers.get("Content-Encoding")
        said = f"received {len(raw)} bytes" + (f" {encoding}" if encoding else "")
        return web.json_response(answer(said, 10 if attack == "lie" else words))

    async def echo(request: web.Request) -> web.Response:
        raw = await request.read()
        return web.json_response({"received_bytes": len(raw), "encoding": request.headers.get("Content-Encoding", "")})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/props", props)
    app.router.add_get("/health", lambda request: web.json_response({"status": "ok"}))
    for path in ("/tokenize", "/apply-template", f"{ROUTE}/input_tokens"):
        app.router.add_post(path, counting)
    app.router.add_post(ROUTE, completions)
    app.router.add_route("*", "/{tail:.*}", echo)
    web.run_app(app, host=LOOPBACK, port=port, print=None)


# -- the two proxies ---------------------------------------------------------------------------


@dataclass
class Proxy:
    """A mitmdump with two listeners: one in front of the attacked backend, one in front of a backend
    of its own for the other client, so that what the other client waits for is the proxy, not a
    backend the attack keeps busy."""

    process: Backend
    url: str
    ping_url: str
    probe_port: int = 0

    @property
    def pid(self) -> int:
        return self.process.process.pid


def start_mitmdump(name: str, upstream: str, ping_upstream: str, work: Path, options: list[str] | None,
                   probe: int = -1, env: dict[str, str] | None = None) -> Proxy:  # fmt: skip
    """Bare mitmdump (`options` None) or mitmdump with ContextPaw and `options`; with `probe` at
    least 0, scripts/measure/heap_probe.py too, tracing that many frames (what `heap_report` asks it);
    `env` is added to the environment."""
    port, ping_port = free_port(), free_port()
    argv = [sys.executable, "-c", "from mitmproxy.tools.main import mitmdump; mitmdump()", "-q",
            "--mode", f"reverse:{upstream}@{LOOPBACK}:{port}", "--mode", f"reverse:{ping_upstream}@{LOOPBACK}:{ping_port}",
            "--set", "connection_strategy=lazy", "--set", f"confdir={work / name}-conf", "--set", "tcp_timeout=3600"]  # fmt: skip
    environment = {**os.environ, **(env or {})}
    probe_port = 0
    if probe >= 0:
        probe_port = free_port()
        argv += ["-s", str(Path(__file__).with_name("heap_probe.py"))]
        environment |= {"HEAP_PROBE_PORT": str(probe_port), "HEAP_PROBE_TRACE": str(probe)}
    if options is not None:
        argv += ["-s", str(ADDON), *(arg for option in options for arg in ("--set", option))]
    url = f"http://{LOOPBACK}:{port}"
    process = start_process(argv, url, "/health", work / f"{name}.log", 30, env=environment)
    return Proxy(process, url, f"http://{LOOPBACK}:{ping_port}", probe_port)


def heap_report(proxy: Proxy) -> dict[str, Any]:
    """What scripts/measure/heap_probe.py in the proxy says its memory is made of."""
    with socket.create_connection((LOOPBACK, proxy.probe_port), timeout=600) as s:
        s.sendall(b"report\n")
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    return json.loads(data)


def ping(client: httpx.Client, base: str, failed: list[str]) -> None:
    """Another client's small chat; a failure is kept (the worst latency then counts the time to it)."""
    try:
        answer = client.post(base + ROUTE, content=chat("a small question"), headers={"Content-Type": "application/json"})
        if answer.status_code != 200:
            failed.append(str(answer.status_code))
    except httpx.HTTPError as e:
        failed.append(type(e).__name__)


def post(base: str, body: bytes, path: str = ROUTE, timeout: float = 300, **headers: str) -> httpx.Response:
    return httpx.post(base + path, content=body, headers={"Content-Type": "application/json", **headers},
                      timeout=timeout, trust_env=False)  # fmt: skip


def described(response: httpx.Response) -> str:
    """The outcome in a few words: a refusal with its status and whether the body is JSON in an
    API's error shape, or what passed."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code >= 400:
        shaped = isinstance(body, dict) and ("error" in body or "received_bytes" in body)
        from_backend = isinstance(body, dict) and "received_bytes" in body
        who = "backend" if from_backend else "refused"
        return f"{who} {response.status_code}{' in shape' if shaped else ' (not JSON)'}"
    return f"{response.status_code}, {len(response.content):,} bytes"


# -- the attacks: each takes a proxy's address and tells what came of it ----------------------------

Attack = Callable[[str], str]


def bomb(encoding: str, compress: Callable[[bytes], bytes], megabytes: int, path: str = ROUTE) -> Attack:
    packed = compress(b'{"model": "m", "messages": [{"role": "user", "content": "' + b"0" * (megabytes * MB) + b'"}]}')

    def attack(base: str) -> str:
        response = post(base, packed, path, **{"Content-Encoding": encoding})
        return f"{len(packed):,} B {encoding} -> {megabytes} MB: {described(response)}"

    return attack


def stream_record(base: str) -> str:
    total = 0
    with httpx.stream("POST", base + ROUTE, content=chat("go", stream=True), timeout=300, trust_env=False,
                      headers={"Content-Type": "application/json", "X-Attack": "record"}) as response:  # fmt: skip
        for piece in response.iter_raw():
            total += len(piece)
    return f"{response.status_code}, {total / MB:.0f} MB streamed"


def answer_attack(kind: str) -> Attack:
    def attack(base: str) -> str:
        response = post(base, chat("hi"), **{"X-Attack": kind})
        return f"{response.status_code}, {len(response.content) / MB:.1f} MB to the client"

    return attack


def lying_backend(base: str) -> str:
    """20 answers that claim 10 tokens for 40 KB prompts, then a 12 KB chat for the 1,024-token window."""
    for _ in range(20):
        post(base, chat("word " * 8000), **{"X-Attack": "lie"})
    response = post(base, json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "be brief"}, *({"role": r, "content": "word " * 400} for r in ["user", "assistant"] * 3),
        {"role": "user", "content": "and now?"}]}).encode())  # fmt: skip
    sent = response.json()["choices"][0]["message"]["content"] if response.status_code == 200 else response.text[:80]
    final = response.headers.get("X-ContextPaw-Final-Tokens")
    return f"{response.status_code}, backend {sent}" + (f", final {final} tokens" if final else "")


def off_by_one(requests: int) -> Attack:
    """Concurrent 1 MB chats of many turns: none may be refused one token short."""
    rng = random.Random(6)
    bodies = [json.dumps({"model": "m", "messages": [
        {"role": "user" if t % 2 == 0 else "assistant", "content": " ".join("w" * rng.randint(1, 9) for _ in range(rng.randint(50, 4000)))}
        for t in range(60)] + [{"role": "user", "content": "go"}]}).encode() for _ in range(requests)]  # fmt: skip

    def attack(base: str) -> str:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda body: post(base, body), bodies))
        short = sum("nothing can be removed" in a.text for a in answers)
        statuses = sorted({a.status_code for a in answers})
        return f"{requests} x {len(bodies[0]) / MB:.1f} MB: statuses {statuses}, {short} refused short"

    return attack


def giant_message(megabytes: int) -> Attack:
    body = chat("word " * (megabytes * MB // 5))

    def attack(base: str) -> str:
        return f"{megabytes} MB message: {described(post(base, body))}"

    return attack


def multi_member(base: str) -> str:
    """A two-member gzip chat, and a truncated one: what the backend was handed."""
    whole = chat("first half " * 100 + "second half " * 100)
    two = gzip.compress(whole[:300]) + gzip.compress(whole[300:])
    truncated = gzip.compress(whole)[:-20]
    good = post(base, two, **{"Content-Encoding": "gzip"})
    bad = post(base, truncated, **{"Content-Encoding": "gzip"})
    said = " with X-ContextPaw-Error" if "X-ContextPaw-Error" in bad.headers else ""
    return f"two members: {good.json()['choices'][0]['message']['content']} of {len(whole)}; truncated: {bad.text[:60]}{said}"


def lone_surrogate(base: str) -> str:
    """An old turn holding a lone surrogate (valid ASCII JSON) is evicted; is it served as UTF-8?"""
    old = '{"role": "user", "content": "\\ud800 ' + "old words " * 2000 + '"}'
    body = ('{"model": "m", "messages": [' + old + ', {"role": "assistant", "content": "ok"}, '
            '{"role": "user", "content": "and now?"}]}').encode()  # fmt: skip
    answer = post(base, body)
    try:
        markers = answer.json()["contextpaw"]["markers"]
    except (ValueError, KeyError, TypeError):
        return f"{answer.status_code}, nothing evicted"
    served = httpx.get(f"{base}/contextpaw/evicted/{markers[0]}", trust_env=False, timeout=30)
    try:
        served.content.decode("utf-8")
    except UnicodeDecodeError:
        return f"evicted {markers[0]}: served as invalid UTF-8"
    return f"evicted {markers[0]}: {served.status_code}, valid UTF-8 ({len(served.content):,} bytes)"


def unknown_encoding(base: str) -> str:
    rot = post(base, chat("hi"), **{"Content-Encoding": "rot13"})
    digits = post(base, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": ' + b"9" * 5000 + b"}")
    return f"rot13: {described(rot)}; 5,000-digit integer: {described(digits)}"


def host_rebinding(base: str) -> str:
    response = httpx.get(base + "/v1/models", headers={"Host": "attacker.example"}, trust_env=False, timeout=30)
    return described(response) if response.status_code >= 400 else f"{response.status_code}: served to a foreign Host"


def slowloris(connections: int, hold_s: float) -> Attack:
    """`connections` clients that send their headers a byte a second; how many are still open after `hold_s`."""

    def attack(base: str) -> str:
        port = int(base.rsplit(":", 1)[1])
        socks = [socket.create_connection((LOOPBACK, port), timeout=5) for _ in range(connections)]
        for s in socks:
            s.sendall(b"POST " + ROUTE.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        open_, started = set(socks), time.monotonic()
        while open_ and time.monotonic() - started < hold_s:
            readable, _, _ = select.select(list(open_), [], [], 1.0)
            for s in open_ - set(readable):
                try:
                    s.sendall(b"a")
                except OSError:
                    readable.append(s)
            for s in readable:
                try:
                    if s.recv(4096) == b"":
                        open_.discard(s)
                except OSError:
                    open_.discard(s)
        took = time.monotonic() - started
        for s in socks:
            s.close()
        return f"{connections} dribbling: {connections - len(open_)} closed within {took:.0f} s"

    return attack


# -- the table ---------------------------------------------------------------------------------


def measure(attack: Attack, proxies: dict[str, Proxy]) -> dict[str, Any]:
    """The attack on each proxy in turn, ContextPaw's last (the bare one's run warms the backend)."""
    row: dict[str, Any] = {}
    for name, proxy in proxies.items():
        told: list[str] = []
        failed: list[str] = []
        with PeakMemory(proxy.pid) as memory:
            worst = worst_latency_while(
                lambda client: ping(client, proxy.ping_url, failed), lambda: told.append(attack(proxy.url)), every=0.02
            )
        outcome = told[0] if told else "?"
        if failed:
            outcome += f"; {len(failed)} of the other client's requests failed ({', '.join(sorted(set(failed)))})"
        row[name] = {"worst_ms": round(worst, 1), "peak_mib": round(memory.peak_mib), "outcome": outcome}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of every size, one fuzz pass of 60 bodies")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--only", default="", metavar="N1,N8", help="these faults' rows only")
    ap.add_argument("--probe", type=int, default=-1, metavar="FRAMES",
                    help="load scripts/measure/heap_probe.py in both proxies (tracemalloc with FRAMES frames, 0: off) "
                         "and write what it reports after each fuzz pass to --probe-out")  # fmt: skip
    ap.add_argument("--probe-out", type=Path, default=Path("heap-probe.json"))
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="set in both proxies' environment")
    ap.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    scale = 10 if args.quick else 1
    sizes = {"record": 200 * MB // scale, "answer": 300 * MB // scale, "inflated_answer": 512 * MB // scale}
    if args.serve:
        serve(args.serve, json.loads(args.sizes))
        return 0
    fuzz = fuzz_bodies(60 if args.quick else 200)
    rows: list[tuple[str, str, Attack]] = [
        ("N1", "bz2 request bomb", bomb("bz2", bz2.compress, 400 // scale)),
        ("N1", "zlib request bomb", bomb("zlib", zlib.compress, 400 // scale)),
        ("N2", "gzip bomb on a route not handled", bomb("gzip", gzip.compress, 400 // scale, "/v1/embeddings")),
        ("N3", "stream record without a newline", stream_record),
        ("N4", "buffered JSON answer", answer_attack("big-answer")),
        ("N4", "gzip answer bomb", answer_attack("gzip-answer")),
        ("N5", "backend lies low about counts", lying_backend),
        ("N6", "concurrent many-turn chats", off_by_one(40 // max(scale // 5, 1))),
        ("N7", "one giant message", giant_message(50 // scale)),
        ("N9", "multi-member and truncated gzip", multi_member),
        ("N10", "unknown encoding, huge integer", unknown_encoding),
        ("N12", "evicted content with a lone surrogate", lone_surrogate),
        ("N13", "foreign Host on a backend route", host_rebinding),
        ("N14", "slowloris", slowloris(50, 10)),
    ]
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    rows = [row for row in rows if not only or row[0] in only]
    with tempfile.TemporaryDirectory(prefix="contextpaw-hardening-") as tmp:
        work = Path(tmp)
        with contextlib.ExitStack() as running:
            backends = []
            for name, sized in (("backend", sizes), ("ping-backend", {key: 0 for key in sizes})):
                port = free_port()
                argv = [sys.executable, __file__, "--serve", str(port), "--sizes", json.dumps(sized)]
                backends.append(
                    running.enter_context(start_process(argv, f"http://{LOOPBACK}:{port}", "/health", work / f"{name}.log", 120))
                )
            backend, ping_backend = backends
            options = [f"contextpaw_llamacpp={backend.url}", f"contextpaw_state_dir={work / 'state'}", "flow_detail=0",
                       "contextpaw_request_read_timeout=5", "contextpaw_output_reserve=128",
                       f"contextpaw_max_body_mb={MAX_BODY_MB // scale}"]  # the default, scaled as the attacks are  # fmt: skip
            stale = work / "state" / "contextpaw-calibration.json.killed.tmp"
            stale.parent.mkdir(parents=True)
            stale.write_text("{")  # what a write killed half-way leaves (N11)
            proxies: dict[str, Proxy] = {}
            env = dict(pair.split("=", 1) for pair in args.env)
            for name, opts in (("bare", None), ("contextpaw", options)):
                proxies[name] = start_mitmdump(name, backend.url, ping_backend.url, work, opts, args.probe, env)
                running.callback(proxies[name].process.stop)
            print(
                "| fault | attack | others' worst ms: ContextPaw / bare | peak RSS MiB: ContextPaw / bare | ContextPaw's outcome | bare mitmdump's |"
            )
            print("|---|---|---:|---:|---|---|")
            for fault, what, attack in rows:
                row = measure(attack, proxies)
                c, b = row["contextpaw"], row["bare"]
                print(f"| {fault} | {what} | {c['worst_ms']:,.0f} / {b['worst_ms']:,.0f} | {c['peak_mib']:,} / {b['peak_mib']:,} "
                      f"| {c['outcome']} | {b['outcome']} |", flush=True)  # fmt: skip
                if fault == "N5":
                    print(f"| N11 | a write killed half-way | | | leftover .tmp {'still there' if stale.exists() else 'removed'} "
                          f"once calibration was written | |", flush=True)  # fmt: skip
            if only and "N8" not in only:
                return 0
            rss: dict[str, list[int]] = {name: [] for name in proxies}
            cpu: dict[str, list[float]] = {name: [] for name in proxies}
            stored: list[int] = []
            reports: dict[str, list[dict[str, Any]]] = {name: [] for name in proxies}
            for n in range(args.passes):
                for name, p in proxies.items():
                    started = cpu_seconds(p.pid)
                    fuzz_pass(p.url + ROUTE, fuzz)
                    rss[name].append(round(memory_after(p.pid)))
                    cpu[name].append(cpu_seconds(p.pid) - started)
                    if args.probe >= 0:
                        reports[name].append(heap_report(p))
                        args.probe_out.write_text(json.dumps(reports, indent=1))
                        print(f"pass {n + 1} {name}: RSS {rss[name][-1]} MiB, probe: {json.dumps(reports[name][-1])[:600]}", flush=True)
                stored.append(round(evicted_store_mib(proxies["contextpaw"].url)))
            c, b = rss["contextpaw"], rss["bare"]
            print(f"| N8 | {args.passes} fuzz passes of {len(fuzz)} bodies | | | RSS after each pass {' → '.join(map(str, c))} MiB, "
                  f"of which the evicted store {' → '.join(map(str, stored))} MiB (after the first pass: at most "
                  f"{max(c) - c[0]:+} MiB from it); CPU {' + '.join(f'{s:.1f}' for s in cpu['contextpaw'])} s "
                  f"| {' → '.join(map(str, b))} MiB (at most {max(b) - b[0]:+} MiB from the first); "
                  f"CPU {' + '.join(f'{s:.1f}' for s in cpu['bare'])} s |", flush=True)  # fmt: skip
    return 0


def evicted_store_mib(base: str) -> float:
    """What the evicted store holds (bounded by contextpaw_evicted_mb): memory that is meant to stay."""
    text = httpx.get(base + "/contextpaw/metrics", trust_env=False, timeout=30).text
    line = next(line for line in text.splitlines() if line.startswith("contextpaw_evicted_store_bytes"))
    return float(line.split()[-1]) / MB


def memory_after(pid: int) -> float:
    """RSS once the process has been quiet long enough for the trim after its last big request."""
    time.sleep(TRIM_EVERY_S + SETTLE_S + 2)
    return memory_mib(pid)


if __name__ == "__main__":
    sys.exit(main())
