"""Window use in real tokens, end to end through ContextPaw (issue 29: no window wasted by the estimate).

    PYTHONPATH=tests .venv/bin/python scripts/bench/measure_window_use.py [--out bench-results/window_use.json] [--quick]
        [--windows 1024 2048 4096] [--overflow 4] [--shapes scaled fixed] [--chats 1] [--warmups 5]

scripts/bench/bench.py's `real_window_use` measures the engine alone (`compact_chat` with a counter). This
measures what users get: agent chats (scripts/bench/bench_compact.py's `agent_conversation`, with tool dumps
scaled to an eighth of the window, and in its own shape, dumps of about 1,200 tokens) about
`--overflow` times the window in llama-server's tokens, sent through mitmdump with
contextpaw_addon.py to a real llama-server with the SmolLM2-135M model, whose window is the server's
own `-c WINDOW` (one slot), so every step the proxy takes is in the number: the whole-request count, the verification refits, the calibration
and its bound per content kind, the rescue of a 400. Per window, one llama-server serves:

- path "llama-server": ContextPaw in front of it (`contextpaw_llamacpp`), /v1/chat/completions with
  `max_tokens: 1`. Real tokens are the answer's `usage.prompt_tokens` (what the server evaluated).
  Goal: at least 97% of the budget, never over 100%.
- paths "ollama /api/chat" and "ollama /v1": the Ollama simulator (tests/support/ollama_sim.py) over
  the same llama-server, with ContextPaw in front (`contextpaw_ollama`). Its /api/show names no model
  file, so ContextPaw counts with the calibrated estimate (the case of an Ollama whose blobs this
  machine cannot read). First `--warmups` earlier turns of an agent chat of the same kind (from 256
  tokens to 80% of the window), sent whole on /api/chat, so calibration learns from whole
  evaluations; then the overflowing chat on /api/chat (`options.num_ctx` = window,
  `num_predict: 1`) and on /v1/chat/completions (`max_tokens: 1`; the simulator's default window is
  the window). Real tokens are the answer's `prompt_eval_count` (`usage.prompt_tokens` on /v1): the
  server's `cache_n + prompt_n`. A prompt the simulator cut (its /_fake/last) fails the row.
  Goal: at least 92% of the budget, never over 100%.
- path "ollama /v1, model file read": the same on /v1, with /api/show naming SmolLM2's GGUF file, so
  ContextPaw counts with the tokenizer it rebuilds from that file (the case of a local Ollama whose
  model's vocabulary it knows: Qwen 2 and 3, Llama 3, DeepSeek Coder, StarCoder and their kin).
  No warm-ups (nothing is calibrated). Goal: at least 92% of the budget, never over 100%.

Each measured chat is a conversation of its own (a tag in its first user message): ContextPaw fits a
conversation it saw before as its next turn, cutting deeper for headroom, which is not the first
overflow measured here. "ContextPaw's count" is the report's `final_tokens`: llama-server's count on
the first path, the calibrated estimate on the next two (by shape on /api/chat, where `truncate: false`
makes an overshoot a rescued 400; by bytes on /v1), the tokenizer's on the last.

The budget is the one the window gives (window - answer reserve - margin, contextpaw/fitting/windows.py), which
is the report's `contextpaw.budget` (X-ContextPaw-Budget) on a plain fit, checked per row. Where the fit
was held to less (the guard's note "budget X of Y" on a route that cannot forbid a cut, or the
retry's budget after a rescued 400), that is the "fitted to" column, and what it held back counts as
window not used: use = real tokens / the window's budget.

Prints a table and a summary per path; writes the JSON. Exit status: 0 when every row was measured,
1 when a row failed or overflowed, 2 when llama-server or the model is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_compact
import httpx

from contextpaw.core.tokens import EstimateCounter

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import Backend, free_port, locate_llama_server, locate_smollm2, start_process, start_proxy
from support.common import LOOPBACK, running
from support.fake_ollama import ModelCard, OllamaSettings, ollama_app
from support.ollama_sim import LlamaServerEngine

WINDOWS = (1024, 2048, 4096)
QUICK_WINDOWS = (1024,)
OVERFLOW = 4.0
"""How many times the window each measured chat is, in llama-server's tokens."""
WARMUPS = 5
WARMUP_SPAN = (256, 0.8)
"""Warm-ups are earlier turns of one agent chat, from this many tokens (calibration learns from
nothing under 200 estimated) to this share of the window: sent whole, so calibration learns."""
DUMPS_PER_WINDOW = 8
"""In the `SCALED` chats a tool dump averages 1/8 of the window (by the estimate)."""
SCALED, FIXED = "scaled", "fixed"
SHAPES = (SCALED, FIXED)
"""The chats' shapes: tool dumps scaled to the window, or bench_compact's own (about 780 estimated
tokens, 1,200 of SmolLM2's, whatever the window)."""
MODEL = "smollm2:135m"
LLAMACPP = "llama-server"
OLLAMA_CHAT = "ollama /api/chat"
OLLAMA_V1 = "ollama /v1"
OLLAMA_V1_GGUF = "ollama /v1, model file read"
PATHS = (LLAMACPP, OLLAMA_CHAT, OLLAMA_V1, OLLAMA_V1_GGUF)
GOALS = {LLAMACPP: 0.97, OLLAMA_CHAT: 0.92, OLLAMA_V1: 0.92, OLLAMA_V1_GGUF: 0.92}
"""The least use of the budget each path should reach; none may go over 1.0."""
COUNTER_KIND = {
    LLAMACPP: "llama-server's counts",
    OLLAMA_CHAT: "calibrated shape count",
    OLLAMA_V1: "calibrated estimate",
    OLLAMA_V1_GGUF: "the model's tokenizer, from the GGUF file Ollama names",
}
GUARD_NOTE = re.compile(r"budget (\d+) of (\d+)")
HELD_BY = re.compile(r"cannot ask Ollama to refuse instead of cutting \((.+)\)$")
"""What held a guarded fit under its budget, as the report's note says."""


class Failed(RuntimeError):
    """A row that could not be measured: said in the row, and the run goes on."""


# -- the servers ---------------------------------------------------------------------------------


def llama_server(binary: Path, model: Path, window: int, threads: int, log: Path) -> Backend:
    """llama-server with one slot of `window` tokens: the window a request gets is the whole `-c`."""
    port = free_port()
    argv = [str(binary), "-m", str(model), "-c", str(window), "-np", "1", "-t", str(threads),
            "--host", LOOPBACK, "--port", str(port), "--no-webui"]  # fmt: skip
    return start_process(argv, f"http://{LOOPBACK}:{port}", "/health", log, 180)


class NoBlobEngine(LlamaServerEngine):
    """The simulator's engine, with /api/show naming the model instead of its GGUF file: ContextPaw
    cannot load the tokenizer and counts with the calibrated estimate."""

    async def open(self) -> ModelCard:
        return dataclasses.replace(await super().open(), blob="")


def proxy(upstream: str, kind: str, work: Path, name: str) -> Backend:
    """mitmdump with ContextPaw in front of `upstream`, its own confdir (a fresh calibration)."""
    return start_proxy(upstream, work / f"{name}-conf", work / f"{name}.log",
                       options=[f"contextpaw_{kind}={upstream}"], timeout=90)  # fmt: skip


# -- the chats -----------------------------------------------------------------------------------


def whole_count(client: httpx.Client, server: str, messages: list[dict]) -> int:
    """llama-server's count of a chat as its template renders it: what /v1/chat/completions evaluates."""
    rendered = client.post(server + "/apply-template", json={"messages": messages})
    rendered.raise_for_status()
    tokens = client.post(server + "/tokenize", json={"content": rendered.json()["prompt"], "add_special": True,
                                                      "parse_special": True})  # fmt: skip
    tokens.raise_for_status()
    return len(tokens.json()["tokens"])


def agent_chat(size: int, window: int, seed: int, shape: str = SCALED) -> list[dict]:
    """scripts/bench/bench_compact.py's agent chat of `size` estimated tokens: in its own turns (`FIXED`:
    tool dumps of about 780 estimated tokens whatever the window, so a small window holds one or
    none), or in turns whose dumps average an eighth of the window (`SCALED`: the window holds
    several turns, as a chat's turns before it overflowed were sent whole)."""
    if shape == FIXED:
        return bench_compact.agent_conversation(size, EstimateCounter(), seed=seed)
    turns = max(1, math.ceil(size / (window / DUMPS_PER_WINDOW)))
    return bench_compact.agent_conversation(size, EstimateCounter(), messages=3 * turns, seed=seed)


def sized_chat(client: httpx.Client, server: str, target: int, window: int, seed: int, shape: str = SCALED
               ) -> tuple[list[dict], int]:  # fmt: skip
    """An agent chat of about `target` real tokens: sized by the estimate, then scaled by the ratio
    llama-server's count shows (again, since the template's share changes with the size)."""
    size = target
    for _ in range(3):
        messages = agent_chat(size, window, seed, shape)
        real = whole_count(client, server, messages)
        if abs(real - target) <= 0.05 * target:
            break
        size = max(200, round(size * target / real))
    return messages, real


def earlier_turns(client: httpx.Client, server: str, messages: list[dict], window: int, n: int) -> list[tuple[list[dict], int]]:
    """`n` prefixes of `messages` (each ending after a tool's answer or a remark, as an agent's turn
    does) spread evenly over `WARMUP_SPAN`: the turns of one chat before it overflowed."""
    low, high = WARMUP_SPAN[0], WARMUP_SPAN[1] * window
    turns = []
    for end in range(3, len(messages) + 1):
        if messages[end - 1].get("tool_calls"):
            continue
        count = whole_count(client, server, messages[:end])
        if count > high:
            break
        if count >= low:
            turns.append((messages[:end], count))
    if n <= 0 or not turns:
        return []
    picks = sorted({round(i * (len(turns) - 1) / max(n - 1, 1)) for i in range(n)})
    return [turns[i] for i in picks]


def session(messages: list[dict], tag: str) -> list[dict]:
    """The chat with `tag` in its first user message: ContextPaw knows a conversation by its system
    prompt and first user message (`wire.Chat.key`), and a chat it saw before is fitted as its next
    turn (last turn's cuts again, with headroom). Each measured chat is a conversation of its own."""
    out, tagged = [], False
    for m in messages:
        if m["role"] == "user" and not tagged:
            m, tagged = {**m, "content": f"{m['content']} (session {tag})"}, True
        out.append(m)
    return out


def ollama_messages(messages: list[dict]) -> list[dict]:
    """An OpenAI chat in Ollama's /api/chat form: tool arguments as objects, no null content."""
    out = []
    for m in messages:
        converted: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            converted["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                                     "arguments": json.loads(c["function"]["arguments"] or "{}")}}
                                       for c in m["tool_calls"]]  # fmt: skip
        out.append(converted)
    return out


# -- one request, one row ------------------------------------------------------------------------


def post(client: httpx.Client, url: str, body: dict) -> tuple[dict, dict[str, str], float]:
    started = time.perf_counter()
    answer = client.post(url, json=body)
    seconds = time.perf_counter() - started
    try:
        data = answer.json()
    except ValueError:
        data = {}
    if answer.status_code != 200:
        raise Failed(f"HTTP {answer.status_code}: {answer.text[:400]}")
    headers = {k.lower(): v for k, v in answer.headers.items() if k.lower().startswith("x-contextpaw-")}
    return data, headers, seconds


def send(client: httpx.Client, path: str, proxy_url: str, messages: list[dict], window: int) -> dict[str, Any]:
    """One chat through the proxy on `path`: the answer's count of what was evaluated, and the report."""
    if path == OLLAMA_CHAT:
        body = {"model": MODEL, "messages": ollama_messages(messages), "stream": False,
                "options": {"num_ctx": window, "num_predict": 1, "temperature": 0}}  # fmt: skip
        data, headers, seconds = post(client, proxy_url + "/api/chat", body)
        real = data.get("prompt_eval_count")
    else:
        body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0, "stream": False}
        data, headers, seconds = post(client, proxy_url + "/v1/chat/completions", body)
        real = (data.get("usage") or {}).get("prompt_tokens")
    if not isinstance(real, int):
        raise Failed(f"the answer carries no prompt count: {json.dumps(data)[:400]}")
    return {"real_tokens": real, "report": data.get("contextpaw"), "headers": headers, "seconds": seconds}


def window_budget(window: int, max_tokens: int = 1) -> int:
    """The budget the window gives a request that caps its answer at `max_tokens`, with ContextPaw's
    default options (output_reserve 1024, margin 64): contextpaw/fitting/windows.py's `Budgeter.for_window`
    and `Budget.tokens`, the prompt tokens a request that must be cut is cut to."""
    return window - min(max_tokens, 1024, window // 2) - min(64, window // 8)


def fitted_to(report: dict[str, Any] | None, headers: dict[str, str]) -> int | None:
    """The budget the fit was held to: the report's (X-ContextPaw-Budget), or the guard's "budget X
    of Y" note when it fitted to less. After a rescued 400 the report's budget is the retry's, in
    the counter's units (`Budgeter.after_upstream_overflow`), not the window's."""
    for note in (report or {}).get("notes", []):
        if m := GUARD_NOTE.match(note):
            return int(m.group(1))
    budget = (report or {}).get("budget")
    return int(headers["x-contextpaw-budget"]) if budget is None and "x-contextpaw-budget" in headers else budget


def row(path: str, window: int, shape: str, chat_tokens: int, sent: dict[str, Any], cut: dict[str, Any] | None = None,
        factor: float | None = None) -> dict[str, Any]:  # fmt: skip
    report = sent["report"] or {}
    budget, real = window_budget(window), sent["real_tokens"]
    out: dict[str, Any] = {
        "path": path, "window": window, "shape": shape, "chat_tokens": chat_tokens, "budget": budget,
        "report_budget": report.get("budget"), "fitted_to": fitted_to(sent["report"], sent["headers"]),
        "real_tokens": real, "use": real / budget, "window_use": real / window,
        "final_tokens": report.get("final_tokens"), "counter": report.get("counter"), "exact": report.get("exact"),
        "strategy": report.get("strategy"), "compacted": report.get("compacted"),
        "recovered_400": report.get("recovered_from_upstream_400"), "notes": report.get("notes", []),
        "upstream_truncated": report.get("upstream_truncated"), "seconds": round(sent["seconds"], 2),
        "calibration_factor": factor, "error": None,
        "smallest_removed": min((int(r["tokens"]) for r in report.get("removals", []) if r.get("action") == "dropped"), default=None),
    }  # fmt: skip
    plain = not report.get("recovered_from_upstream_400") and not any(GUARD_NOTE.match(n) for n in out["notes"])
    if plain and report.get("budget") is not None and report["budget"] != budget:
        out["notes"] = [*out["notes"], f"the report's budget {report['budget']} is not the window's {budget}"]
    if not report:
        out["error"] = "no ContextPaw report in the answer"
    elif not report.get("compacted"):
        out["error"] = f"not compacted (strategy {report.get('strategy')}): the chat did not overflow"
    elif cut is not None and cut.get("cut"):
        out["error"] = f"the simulator cut the prompt: kept {cut['kept_tokens']} of {cut['sent_tokens']} (num_ctx {cut['num_ctx']})"
    elif report.get("upstream_truncated"):
        out["error"] = f"ContextPaw reports a cut: {report['upstream_truncated']}"
    if cut is not None:
        out["simulator"] = cut
    return out


def shortfall(r: dict[str, Any]) -> str | None:
    """Why a measured row used less of the budget than its path's goal, in numbers: the fit held to
    less than the budget (the guard of a route that cannot refuse a cut), ContextPaw's count of what
    it sent running over the server's, the fit ending under its budget in its own count (next to
    the smallest message it removed, which did not fit in what was left). None for a row at its goal."""
    if r.get("error") or r.get("use") is None or r["use"] >= GOALS[r["path"]]:
        return None
    budget, final, real = r["budget"], r.get("final_tokens"), r["real_tokens"]
    fitted = r.get("fitted_to") or budget
    reasons = []
    if fitted < budget:
        said = next((m.group(1) for note in r.get("notes") or () if (m := HELD_BY.search(note))), "the guard's bound")
        reasons.append(f"held to {fitted} of {budget} ({fitted / budget:.1%}), where a cut cannot be refused: {said}")
    if final and real and final > real:
        reasons.append(f"ContextPaw's count ran {final / real - 1:.1%} over the server's")
    if final is not None and final < fitted:
        smallest = r.get("smallest_removed")
        reasons.append(f"the fit ends {fitted - final} tokens under its budget in its own count"
                       + (f" (the smallest message it removed: {smallest})" if smallest else ""))  # fmt: skip
    return "; ".join(reasons) or None


def failed_row(path: str, window: int, shape: str, chat_tokens: int, error: str) -> dict[str, Any]:
    return {"path": path, "window": window, "shape": shape, "chat_tokens": chat_tokens, "budget": window_budget(window), "fitted_to": None,
            "real_tokens": None, "use": None, "window_use": None, "error": error}  # fmt: skip


def calibration_factor(client: httpx.Client, proxy_url: str) -> float | None:
    """The learned factor /contextpaw/health shows for the model (None before any sample)."""
    try:
        factors = client.get(proxy_url + "/contextpaw/health").json().get("calibration", {}).get("factors", {})
    except (httpx.HTTPError, ValueError):
        return None
    return next((v for k, v in factors.items() if k.endswith("/" + MODEL)), None)


# -- the run -------------------------------------------------------------------------------------


def measure_window(binary: Path, model: Path, window: int, args: argparse.Namespace, work: Path,
                   client: httpx.Client, say: Any) -> dict[str, Any]:  # fmt: skip
    """Every path at one window, with one llama-server serving them all."""
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"window": window, "rows": rows, "warmups": []}
    with llama_server(binary, model, window, args.threads, work / f"llama-{window}.log") as server:
        chats = [(f"{shape} {7 + i}", shape, sized_chat(client, server.url, round(args.overflow * window), window, 7 + i, shape)[0])
                 for shape in args.shapes for i in range(args.chats)]  # fmt: skip
        warm_chat, _ = sized_chat(client, server.url, window, window, seed=100)
        warmups = earlier_turns(client, server.url, session(warm_chat, "warm-up"), window, args.warmups)

        def tagged(path: str, name: str, messages: list[dict]) -> tuple[list[dict], int]:
            chat = session(messages, f"{path} {name}")
            return chat, whole_count(client, server.url, chat)

        def simulated(path: str, sim: str, front: str, name: str, shape: str, untagged: list[dict]) -> None:
            """One chat through ContextPaw to the simulator; the row says whether the simulator cut it."""
            messages, tokens = tagged(path, name, untagged)
            say(f"window {window}: {path}, a {tokens}-token {shape} chat")
            try:
                sent = send(client, path, front, messages, window)
                cut = client.get(sim + "/_fake/last").json()
                rows.append(row(path, window, shape, tokens, sent, cut, calibration_factor(client, front)))
            except (Failed, httpx.HTTPError) as e:
                rows.append(failed_row(path, window, shape, tokens, str(e)))

        if LLAMACPP in args.paths:
            with proxy(server.url, "llamacpp", work, f"llamacpp-{window}") as front:
                for name, shape, untagged in chats:
                    messages, tokens = tagged(LLAMACPP, name, untagged)
                    say(f"window {window}: {LLAMACPP}, a {tokens}-token {shape} chat")
                    try:
                        rows.append(row(LLAMACPP, window, shape, tokens, send(client, LLAMACPP, front.url, messages, window)))
                    except (Failed, httpx.HTTPError) as e:
                        rows.append(failed_row(LLAMACPP, window, shape, tokens, str(e)))

        ollama_paths = [p for p in (OLLAMA_CHAT, OLLAMA_V1) if p in args.paths]
        if ollama_paths:
            app = ollama_app(OllamaSettings(model=MODEL, num_ctx=window), NoBlobEngine(server.url))
            with running(app, timeout=60) as sim, proxy(sim, "ollama", work, f"ollama-{window}") as front:
                for messages, tokens in warmups:
                    say(f"window {window}: warm-up, a {tokens}-token chat")
                    try:
                        sent = send(client, OLLAMA_CHAT, front.url, messages, window)
                        report = sent["report"] or {}
                        out["warmups"].append({"chat_tokens": tokens, "real_tokens": sent["real_tokens"],
                                               "compacted": report.get("compacted", False),
                                               "factor_after": calibration_factor(client, front.url)})  # fmt: skip
                    except (Failed, httpx.HTTPError) as e:
                        out["warmups"].append({"chat_tokens": tokens, "error": str(e)})
                out["factor_after_warmups"] = calibration_factor(client, front.url)
                for name, shape, untagged in chats:
                    for path in ollama_paths:
                        simulated(path, sim, front.url, name, shape, untagged)
        if OLLAMA_V1_GGUF in args.paths:  # /api/show names SmolLM2's GGUF: ContextPaw counts with its tokenizer
            app = ollama_app(OllamaSettings(model=MODEL, num_ctx=window), LlamaServerEngine(server.url))
            with running(app, timeout=60) as sim, proxy(sim, "ollama", work, f"ollama-gguf-{window}") as front:
                for name, shape, untagged in chats:
                    simulated(OLLAMA_V1_GGUF, sim, front.url, name, shape, untagged)
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for path in PATHS:
        mine = [r for r in rows if r["path"] == path]
        if not mine:
            continue
        uses = [r["use"] for r in mine if r.get("use") is not None and not r.get("error")]
        goal = GOALS[path]
        out[path] = {
            "counter": COUNTER_KIND[path], "goal": goal, "rows": len(mine), "measured": len(uses),
            "failed": sum(1 for r in mine if r.get("error")),
            "min": min(uses, default=None), "mean": statistics.fmean(uses) if uses else None, "max": max(uses, default=None),
            "over_100": sum(1 for u in uses if u > 1.0), "below_goal": sum(1 for u in uses if u < goal),
            "counters": sorted({str(r.get("counter")) for r in mine if r.get("counter")}),
        }  # fmt: skip
        out[path]["shortfalls"] = [f"-c {r['window']} {r['shape']}: {why}" for r in mine if (why := shortfall(r))]
        out[path]["met"] = bool(uses) and out[path]["below_goal"] == 0 and out[path]["over_100"] == 0 and not out[path]["failed"]
    return out


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def table(result: dict[str, Any]) -> str:
    lines = ["| path | window | chat | chat tokens | budget | fitted to | ContextPaw's count | real tokens | use | counter | strategy | note |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        note = r.get("error") or "; ".join(r.get("notes") or []) or ("recovered a 400" if r.get("recovered_400") else "")
        note = "; ".join(n for n in (note, shortfall(r)) if n)
        fitted = "" if r.get("fitted_to") in (None, r.get("budget")) else str(r.get("fitted_to"))
        lines.append(f"| {r['path']} | {r['window']} | {r.get('shape')} | {r['chat_tokens']} | {r.get('budget') or '-'} | {fitted} | "
                     f"{r.get('final_tokens') or '-'} | {r.get('real_tokens') or '-'} | {pct(r.get('use'))} | {r.get('counter') or '-'} | "
                     f"{r.get('strategy') or '-'} | {note[:240]} |")  # fmt: skip
    lines += ["", "| path | counted by | goal | min | mean | max | over 100% | below goal | failed | met |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for path, s in result["summary"].items():
        lines.append(f"| {path} | {s['counter']} ({', '.join(s['counters']) or '-'}) | {s['goal']:.0%} | {pct(s['min'])} | "
                     f"{pct(s['mean'])} | {pct(s['max'])} | {s['over_100']} | {s['below_goal']} | {s['failed']} | "
                     f"{'yes' if s['met'] else 'no'} |")  # fmt: skip
    for w in result["windows"]:
        if "factor_after_warmups" in w:
            lines.append(f"\nwindow {w['window']}: calibration factor after {len(w['warmups'])} warm-ups: "
                         f"{w['factor_after_warmups']}")  # fmt: skip
    return "\n".join(lines)


def terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the with-blocks: every server is stopped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-results/window_use.json"))
    ap.add_argument("--quick", action="store_true", help=f"a smoke run: window {QUICK_WINDOWS[0]}, one scaled chat, 3 warm-ups")
    ap.add_argument("--windows", type=int, nargs="+", help=f"windows to measure (default {' '.join(map(str, WINDOWS))}; "
                    "SmolLM2 was trained to 8192)")  # fmt: skip
    ap.add_argument("--overflow", type=float, default=OVERFLOW, help="chat size / window (default 4)")
    ap.add_argument("--chats", type=int, default=1, help="chats per window and shape (seeds 7, 8, ...)")
    ap.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES),
                    help="tool dumps scaled to the window (scaled), bench_compact's own (fixed); default both")  # fmt: skip
    ap.add_argument("--warmups", type=int, default=WARMUPS, help=f"warm-up chats on the Ollama paths (default {WARMUPS})")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), metavar="PATH",
                    help=f"which of {', '.join(repr(p) for p in PATHS)} (default all)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="llama-server's -t")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one request may take")
    args = ap.parse_args(argv)
    windows = args.windows or (QUICK_WINDOWS if args.quick else WINDOWS)
    if args.quick:
        args.chats, args.warmups, args.shapes = 1, min(args.warmups, 3), [SCALED]
    binary, model = locate_llama_server(), locate_smollm2()
    for located, what in ((binary, "llama-server"), (model, "the SmolLM2 model")):
        if located.path is None:
            print(f"measure_window_use: no {what}: {located.reason}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, terminate)
    started = time.monotonic()
    say = lambda text: print(f"[{time.monotonic() - started:6.0f}s] {text}", file=sys.stderr, flush=True)  # noqa: E731
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "llama_server": str(binary.path),
                    "model": model.path.name, "threads": args.threads,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S")},  # fmt: skip
        "quick": args.quick, "overflow": args.overflow, "goals": GOALS, "windows": [],
    }  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="contextpaw-window-use-") as tmp,
        httpx.Client(timeout=httpx.Timeout(args.timeout, connect=10), trust_env=False) as client,
    ):
        work = Path(tmp)
        for window in windows:
            try:
                result["windows"].append(measure_window(binary.path, model.path, window, args, work, client, say))
            except (RuntimeError, httpx.HTTPError) as e:  # a server that would not start (its log's tail is in the message), or failed
                say(f"window {window}: {e}")
                result["windows"].append({"window": window, "error": str(e), "rows": []})
    result["rows"] = [r for w in result["windows"] for r in w["rows"]]
    result["summary"] = summary(result["rows"])
    result["seconds"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"\n{len(result['rows'])} rows in {result['seconds']:.0f} s; JSON: {args.out}")
    broken = any(w.get("error") for w in result["windows"]) or any(r.get("error") for r in result["rows"])
    over = any((r.get("use") or 0) > 1.0 for r in result["rows"])
    return 1 if broken or over or not result["rows"] else 0


if __name__ == "__main__":
    sys.exit(main())
