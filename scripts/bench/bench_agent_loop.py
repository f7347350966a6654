"""Prefix-cache reuse in an agent loop: ContextPaw's sticky plan vs re-deciding from scratch each turn.

    PYTHONPATH=tests .venv/bin/python scripts/bench/bench_agent_loop.py [--turns 30] [--ctx 2048 8192] [--no-baseline]

A scripted agent conversation (OpenAI format: tool calls, tool results of varied size, now and then
a user follow-up; the results grow with the window, `scale` lines per 2,048 tokens of it) grows
every turn until it overflows a real llama-server's window. Each turn is sent three times, to three
servers (one slot each, so no path spoils another's cache): through mitmdump with ContextPaw, which
remembers the conversation's plan (sticky evictions); a baseline that calls `compact_chat` itself
without `previous`, with the same counter and the budget the proxy reported for that turn; and,
uncut, to a server whose window holds the whole conversation. Per turn it records llama-server's
`timings.cache_n` (served from the KV cache) and `timings.prompt_n` (evaluated again); `cached`
is the reuse, cache_n / (cache_n + prompt_n).

The ceiling of a turn (`ceiling` in each turn's row, `window_ceiling`): the uncut server evaluates
exactly what the turn adds, which every path must evaluate, so no compaction into this window can
serve more of the turn from the cache than ContextPaw's prompt less those tokens:
1 - uncut prompt_n / (ContextPaw's cache_n + prompt_n). (It can be beaten only on a turn whose
newest message ContextPaw shrank, so that it evaluates less than the turn added.)

mitmdump saves every flow (`save_stream_file`), so after the loop the script knows each turn's
prompt as ContextPaw sent it; the uncut server renders it with the model's template
(`/apply-template`) and tokenizes it (`/tokenize`), as it does a chat. Each ContextPaw row then
also holds `prompt_tokens` (that token count) and `shared_prefix` (how many of them are a token
prefix of the previous turn's prompt, what a one-slot prefix cache can serve). A turn re-cut when its
prompt does not start with the previous turn's messages; its `recut` names the first message that
differs, its role, what it was and is (length and head of its text) and why (`bench_prefix.REASONS`:
a marker's text when a hole grew, a new hole, a shrink or a deeper one, a re-admitted unit), whether
that is before the last turn's last marker, and ContextPaw's notes for the turn.

Each turn's request as sent, and its tokens, go to `--out`'s name with `.sent` added. With several
windows each gets its own JSON (`--out`'s name with `-N` added) and plot
(`--img-dir`/agent-loop-N.png: reuse per turn against the ceiling); a summary table (`table`)
covers the turns after ContextPaw's first compaction. Used by scripts/bench/bench.py (one window).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import statistics
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

# a script beside this one: Python puts the running script's folder first on sys.path
from bench_prefix import first_difference, shared

from contextpaw.calls.server_counts import LlamaCppCounting
from contextpaw.core.compact import EARLIER_CUT, compact_chat
from contextpaw.core.conversation import Conversation
from contextpaw.core.markers import MARKER_PREFIX
from contextpaw.core.tokens import EstimateCounter
from contextpaw.ops import keys
from contextpaw.wire import Chat, Params

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import Backend, start_llama_server, start_process, start_proxy
from support.common import LOOPBACK, free_port

KEEP_RECENT = 4
"""The proxy's default `contextpaw_keep_recent`; the baseline keeps as many."""
MAX_TOKENS = 8
CACHE_GOAL = 0.9
"""The mean share of a turn's prompt served from the cache, over the turns after the first compaction."""
TURN_FLOOR = 0.75
"""No turn after the first compaction below this share."""
UNCUT_CTX = 16384
"""The uncut server's least window (4 windows for bigger ones): the whole 30-turn conversation fits."""
TRAIN_CTX = 8192
"""SmolLM2's training window: llama-server caps a slot at it (silently, but for a log line) unless
RoPE is scaled, so the uncut server gets YaRN scaling for a bigger one. Scaling changes the logits,
not what is tokenized or cached, and the uncut path is only asked what each turn adds."""
SCALE_CTX = 2048
"""Tool results have `window // SCALE_CTX` times as many lines (at least the 2,048-token loop's)."""
CHAT = "/v1/chat/completions"
BENCH_SECRET = hashlib.blake2b(b"contextpaw agent-loop bench", digest_size=keys.SECRET_BYTES).digest()
"""The proxy's secret in every run, written to its state dir before it starts. The secret names
the markers' references, and their hex tokenizes to a few more or fewer tokens from one secret to
another; near the budget that moves the fit's choice. With a random secret a run's cuts differ from
the last run's (the first cut landed at 1,407-1,411, 1,540-1,548 or 1,626-1,630 tokens across 14
runs of one commit), and two commits cannot be compared turn by turn."""
PATHS = ("contextpaw", "baseline", "uncut")
WORDS = (
    "alpha beta gamma delta epsilon parser token window budget cache slot prompt build test module import return value error warning config"
).split()


def agent_turns(turns: int, seed: int = 11, scale: int = 1) -> list[list[dict[str, Any]]]:
    """The request of every turn: the history so far, ending with the newest tool result (of
    3-40 lines, times `scale`)."""
    rng = random.Random(seed)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools to inspect the workspace."},
        {"role": "user", "content": "The nightly build fails. Find out why; the release tag is ORCHID-77."},
    ]
    requests = []
    for t in range(turns):
        if t and t % 6 == 0:
            history += [
                {"role": "assistant", "content": f"Checked {t} files so far; nothing conclusive yet."},
                {"role": "user", "content": f"Keep going, look at more files (round {t // 6})."},
            ]
        call = {
            "id": f"call_{t}",
            "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/mod_{t}.py"})},
        }
        lines = [f"{n:4d} " + " ".join(rng.choices(WORDS, k=rng.randint(4, 10))) for n in range(rng.randint(3 * scale, 40 * scale))]
        history += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{t}", "content": "\n".join(lines)},
        ]
        requests.append([dict(m) for m in history])
    return requests


def scale_of(n_ctx: int) -> int:
    return max(1, n_ctx // SCALE_CTX)


def uncut_ctx(n_ctx: int) -> int:
    return max(UNCUT_CTX, 4 * n_ctx)


def start_uncut(binary: Path, model: Path, n_ctx: int, log: Path) -> Backend:
    """A one-slot llama-server whose slot really holds `n_ctx` tokens (checked in `/props`)."""
    port = free_port()
    rope = (
        [] if n_ctx <= TRAIN_CTX else ["--rope-scaling", "yarn", "--rope-scale", str(n_ctx / TRAIN_CTX), "--yarn-orig-ctx", str(TRAIN_CTX)]
    )
    argv = [str(binary), "-m", str(model), "-c", str(n_ctx), "-np", "1", "--host", LOOPBACK, "--port", str(port), *rope]
    server = start_process(argv, f"http://{LOOPBACK}:{port}", "/health", log, 120.0)
    with urllib.request.urlopen(f"{server.url}/props", timeout=10) as resp:
        slot = json.load(resp).get("default_generation_settings", {}).get("n_ctx")
    if slot is not None and slot < n_ctx:
        server.stop()
        raise RuntimeError(f"the uncut server's slot holds {slot} tokens, not {n_ctx}")
    return server


def body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "smollm2", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}


async def post(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], fail: bool = True) -> dict[str, Any]:
    """The answer; without `fail` an error answer too, with its status and ContextPaw's headers in
    `failed`."""
    async with session.post(f"{url}{CHAT}", json=payload) as resp:
        answer = await resp.json(content_type=None)
        if resp.status != 200:
            if fail:
                raise RuntimeError(f"{url}: HTTP {resp.status}: {json.dumps(answer)[:300]}")
            headers = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-contextpaw")}
            return {
                "contextpaw": answer.get("contextpaw") if isinstance(answer, dict) else None,
                "failed": {"status": resp.status, "headers": headers, "answer": json.dumps(answer)[:1000]},
            }
        return answer


def row(answer: dict[str, Any], compacted: bool, final_tokens: int | None) -> dict[str, Any]:
    timings = answer.get("timings") or {}
    cached, evaluated = timings.get("cache_n", 0), timings.get("prompt_n", 0)
    return {
        "cache_n": cached,
        "prompt_n": evaluated,
        "cached": cached / max(1, cached + evaluated),
        "prompt_ms": timings.get("prompt_ms"),
        "usage_prompt_tokens": (answer.get("usage") or {}).get("prompt_tokens"),
        "compacted": compacted,
        "final_tokens": final_tokens,
    }


async def from_scratch(counting: LlamaCppCounting, url: str, messages: list[dict[str, Any]], budget: int) -> tuple[list, bool, int | None]:
    """The baseline's turn: the proxy's counter and check against the server's total, but no plan."""
    chat = Chat(body(messages), Conversation.from_wire(messages), Params("smollm2", False, None, MAX_TOKENS))
    counted = await counting.counter(url, chat.texts, EstimateCounter(), chat=True, has_system=chat.has_system)
    if counted is None:
        raise RuntimeError(f"{url} does not count tokens")
    counter, fixed = counted
    tighter = budget
    for _ in range(2):  # the proxy refits once when the server's exact total is over
        result = compact_chat(chat.conversation, tighter, counter, keep_recent=KEEP_RECENT, fixed_tokens=fixed)
        sent = list(result.messages) if result.messages is not None else messages
        total = await counting.total(url, {"messages": sent})
        if total is None or total <= budget:
            break
        tighter -= total - budget
    return sent, result.messages is not None, total


async def loop(
    proxy: str, baseline: str | None, uncut: str, turns: list[list[dict[str, Any]]], tick: Callable[[], None]
) -> list[dict[str, Any]]:
    """Every turn through ContextPaw, then by the baseline (unless None), then uncut; one record per turn."""
    rows = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(trust_env=False, timeout=timeout) as session:
        counting = LlamaCppCounting(session)
        budget = None
        for n, messages in enumerate(turns):
            answer = await post(session, proxy, body(messages), fail=False)
            report = answer.get("contextpaw") or {}
            budget = report.get("budget") or (answer.get("failed") and budget)  # a failed turn: the last turn's
            if budget is None:
                raise RuntimeError(f"turn {n + 1}: the proxied answer carries no contextpaw report: {answer.get('failed')}")
            r: dict[str, Any] = {
                "turn": n + 1,
                "messages": len(messages),
                "budget": budget,
                "contextpaw": row(answer, bool(report.get("compacted")), report.get("final_tokens"))
                | {
                    "notes": report.get("notes") or [],
                    "strategy": report.get("strategy"),
                    **({"failed": answer["failed"]} if "failed" in answer else {}),
                },
            }
            if baseline is not None:
                sent, compacted, total = await from_scratch(counting, baseline, messages, budget)
                r["baseline"] = row(await post(session, baseline, body(sent)), compacted, total)
            r["uncut"] = row(await post(session, uncut, body(messages)), False, None)
            r["ceiling"] = window_ceiling(r)
            rows.append(r)
            tick()
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per path: cache fraction over the turns after ContextPaw's first compaction, against the goals
    (the uncut path over the same turns, as the ceiling)."""
    out = {}
    first_cut = next((i for i, r in enumerate(rows) if r["contextpaw"]["compacted"]), None)
    for path in PATHS:
        if path not in rows[0]:
            continue
        first = next((i for i, r in enumerate(rows) if r[path]["compacted"]), None) if path != "uncut" else first_cut
        after = [r[path]["cached"] for r in rows[first + 1 :]] if first is not None else []
        out[path] = {
            "first_compacted_turn": None if first is None else first + 1,
            "turns_after": len(after),
            "mean_cached": sum(after) / len(after) if after else None,
            "min_cached": min(after) if after else None,
            "turns_at_goal": sum(f >= CACHE_GOAL for f in after),
            "turns_under_floor": sum(f < TURN_FLOOR for f in after),
            "evaluated_tokens": sum(r[path]["prompt_n"] for r in rows),
            "cached_tokens": sum(r[path]["cache_n"] for r in rows),
        }
    if first_cut is not None and first_cut + 1 < len(rows) and all("uncut" in r for r in rows):
        ceiling = [window_ceiling(r) for r in rows[first_cut + 1 :]]
        out["ceiling"] = {
            "mean_cached": sum(ceiling) / len(ceiling),
            "min_cached": min(ceiling),
            "turns_at_goal": sum(f >= CACHE_GOAL for f in ceiling),
            "turns_under_floor": sum(f < TURN_FLOOR for f in ceiling),
        }
    return out


def window_ceiling(row: dict[str, Any]) -> float:
    """The most of ContextPaw's prompt any compaction could have served from the cache this turn:
    all of it but what the turn adds (the uncut server evaluates exactly that)."""
    ours = row["contextpaw"]
    return max(0.0, 1 - row["uncut"]["prompt_n"] / max(1, ours["cache_n"] + ours["prompt_n"]))


def sent_bodies(flows: Path) -> list[dict[str, Any]]:
    """The chat requests mitmdump saved, in order, as ContextPaw sent them on."""
    from mitmproxy import http, io

    with flows.open("rb") as f:
        saved = [fl for fl in io.FlowReader(f).stream() if isinstance(fl, http.HTTPFlow) and fl.request.path.split("?")[0].endswith(CHAT)]
    saved.sort(key=lambda fl: fl.timestamp_created)
    return [json.loads(fl.request.content or b"{}") for fl in saved]


async def server_tokens(url: str, bodies: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Each body's prompt as the server makes it of a chat: its template, then its tokenizer."""
    out = []
    async with aiohttp.ClientSession(trust_env=False, timeout=aiohttp.ClientTimeout(total=600)) as session:
        for b in bodies:
            async with session.post(f"{url}/apply-template", json={k: b[k] for k in ("messages", "tools") if k in b}) as resp:
                prompt = (await resp.json(content_type=None))["prompt"]
            async with session.post(f"{url}/tokenize", json={"content": prompt, "add_special": True, "parse_special": True}) as resp:
                out.append((await resp.json(content_type=None))["tokens"])
    return out


def describe(message: dict[str, Any] | None) -> dict[str, Any] | None:
    """A message in a re-cut's record: its role, and its text's length and head (a marker's whole)."""
    if message is None:
        return None
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    head = 240 if text.startswith(MARKER_PREFIX) else 80
    return {
        "role": message.get("role"),
        "chars": len(text),
        "head": text[:head],
        "marker": MARKER_PREFIX in text,
        **({"tool_calls": len(message["tool_calls"])} if message.get("tool_calls") else {}),
    }


def layout(messages: Sequence[dict[str, Any]]) -> str:
    """A prompt's shape in one line: each message's role's initial and its length in characters,
    `*` after a marker (a hole) or a message that holds one (a shrink, a fold)."""
    out = []
    for m in messages:
        content = m.get("content")
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        out.append(f"{str(m.get('role', '?'))[:1]}{len(text)}{'*' if MARKER_PREFIX in text else ''}")
    return " ".join(out)


def trace(rows: list[dict[str, Any]], bodies: Sequence[dict[str, Any]], tokens: Sequence[Sequence[int]]) -> None:
    """Adds to each turn what its prompt shared with the previous turn's: `prompt_tokens` and
    `shared_prefix` (tokens) in its ContextPaw row, `recut` (bool), and for a re-cut its first
    differing message (`recut_detail`). A turn that failed is compared with the last served one (the
    server evaluated nothing of it), and the next turn too."""
    if not len(rows) == len(bodies) == len(tokens):
        raise RuntimeError(f"{len(rows)} turns but {len(bodies)} saved requests and {len(tokens)} tokenized")
    before: list[dict[str, Any]] | None = None
    before_tokens: Sequence[int] = ()
    for r, b, toks in zip(rows, bodies, tokens):
        now = b.get("messages") or []
        ours = r["contextpaw"]
        ours["prompt_tokens"] = len(toks)
        ours["layout"] = layout(now)
        ours["shared_prefix"] = shared(list(before_tokens), list(toks)) if before is not None else 0
        if "failed" in ours:
            r["recut"] = False
            continue
        r["recut"] = before is not None and now[: len(before)] != before
        if r["recut"]:
            assert before is not None
            k, why = first_difference(before, now)
            last = max((i for i, m in enumerate(before) if MARKER_PREFIX in json.dumps(m, ensure_ascii=False)), default=None)
            r["recut_detail"] = {
                "first_difference": k,
                "why": why,
                "was": describe(before[k] if k < len(before) else None),
                "is": describe(now[k] if k < len(now) else None),
                "last_marker": last,
                "before_last_marker": last is not None and k < last,
                "earlier_cut_noted": any(EARLIER_CUT in n for n in ours.get("notes", [])),
                "lost_tokens": max(0, round(r["ceiling"] * ours["prompt_tokens"]) - ours["cache_n"]),
            }
        before, before_tokens = now, toks


def table(n_ctx: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary row of one window: over the turns after ContextPaw's first compaction that it
    served (a failed turn is listed in `failed_turns`, not averaged)."""
    first = next((i for i, r in enumerate(rows) if r["contextpaw"]["compacted"]), None)
    failed = [r["turn"] for r in rows if "failed" in r["contextpaw"]]
    after = [r for r in rows[first + 1 :] if "failed" not in r["contextpaw"]] if first is not None else []
    recuts = [r for r in after if r.get("recut")]
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    reuse = [r["contextpaw"]["cached"] for r in after]
    ceiling = [r["ceiling"] for r in after]
    worst = min(after, key=lambda r: r["contextpaw"]["cached"], default=None)
    return {
        "window": n_ctx,
        "turns": len(rows),
        "first_compacted_turn": None if first is None else first + 1,
        "failed_turns": failed,
        "turns_after_first_cut": len(after),
        "reuse_mean": mean(reuse),
        "reuse_worst": min(reuse, default=None),
        "reuse_worst_turn": worst and worst["turn"],
        "ceiling_mean": mean(ceiling),
        "ceiling_worst": min(ceiling, default=None),
        "recut_turns": len(recuts),
        "recut_reuse_mean": mean([r["contextpaw"]["cached"] for r in recuts]),
        "recut_ceiling_mean": mean([r["ceiling"] for r in recuts]),
        "recuts": [
            {
                "turn": r["turn"],
                "reuse": r["contextpaw"]["cached"],
                "ceiling": r["ceiling"],
                **{k: v for k, v in r.get("recut_detail", {}).items() if k in ("first_difference", "why", "before_last_marker")},
            }
            for r in (rows[first:] if first is not None else [])
            if r.get("recut")
        ],
    }


def fix_secret(state_dir: Path, secret: bytes) -> None:
    """Give the proxy whose state dir this is `secret`: it reads the file there, and makes one only
    where none is."""
    if len(secret) != keys.SECRET_BYTES:
        raise ValueError(f"the secret must be {keys.SECRET_BYTES} bytes, not {len(secret)}")
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = state_dir / keys.SECRET_FILE
    path.write_bytes(secret)
    path.chmod(0o600)


def run(
    binary: Path,
    model: Path,
    work: Path,
    turns: int,
    n_ctx: int,
    tick: Callable[[], None],
    baseline: bool = True,
    sent_to: Path | None = None,
    secret: bytes = BENCH_SECRET,
) -> dict[str, Any]:
    """Start the servers and the proxy (with `secret` as its own), run the loop, stop them; the
    section of the report. With `sent_to`, each turn's request as ContextPaw sent it, and its tokens,
    are written there."""
    big, measured = uncut_ctx(n_ctx), tree()  # what mitmdump loads now
    flows = work / f"flows-{n_ctx}.mitm"
    conversation = agent_turns(turns, scale=scale_of(n_ctx))
    with contextlib.ExitStack() as stack:
        names = [("proxied", n_ctx), *([("baseline", n_ctx)] if baseline else []), ("uncut", big)]
        servers = {
            name: stack.enter_context(
                (start_uncut if name == "uncut" else start_llama_server)(binary, model, ctx, work / f"llama-{name}-{n_ctx}.log")
            )
            for name, ctx in names
        }
        confdir = work / f"mitm-loop-{n_ctx}"
        fix_secret(confdir, secret)
        with start_proxy(
            servers["proxied"].url,
            confdir,
            work / f"mitmdump-loop-{n_ctx}.log",
            options=[f"contextpaw_llamacpp={servers['proxied'].url}", "contextpaw_calibrate=false", f"save_stream_file={flows}"],
        ) as proxy:
            rows = asyncio.run(loop(proxy.url, servers["baseline"].url if baseline else None, servers["uncut"].url, conversation, tick))
        bodies = sent_bodies(flows)  # mitmdump has stopped: the file is whole
        tokens = asyncio.run(server_tokens(servers["uncut"].url, bodies))
        trace(rows, bodies, tokens)
    if sent_to is not None:
        sent_to.parent.mkdir(parents=True, exist_ok=True)
        sent_to.write_text(json.dumps([{"turn": r["turn"], "body": b, "tokens": t} for r, b, t in zip(rows, bodies, tokens)]))
    return {
        "n_ctx": n_ctx,
        "uncut_ctx": big,
        "tree": measured,
        "scale": scale_of(n_ctx),
        "max_tokens": MAX_TOKENS,
        "turns": rows,
        "summary": summarize(rows),
        "table": table(n_ctx, rows),
        "goal": CACHE_GOAL,
        "turn_floor": TURN_FLOOR,
    }


def tree() -> dict[str, Any]:
    """The commit measured, and the files of contextpaw/ changed in the working tree since."""
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=repo).stdout.strip()  # noqa: E731
    return {"commit": git("rev-parse", "HEAD"), "changed": git("status", "--porcelain", "--", "contextpaw").splitlines()}


def plot(section: dict[str, Any], path: Path) -> None:
    """Reuse per turn against the ceiling, re-cut turns marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = section["turns"]
    x = [r["turn"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(x, [r["ceiling"] for r in rows], color="grey", lw=2.5, alpha=0.5, label="ceiling (all but what the turn adds)")
    ax.plot(x, [r["contextpaw"]["cached"] for r in rows], marker=".", color="C0", label="ContextPaw (sticky plan)")
    if "baseline" in rows[0]:
        ax.plot(x, [r["baseline"]["cached"] for r in rows], ls="--", lw=0.9, color="C1", label="from scratch each turn")
    recut = [r for r in rows if r.get("recut")]
    ax.scatter(
        [r["turn"] for r in recut], [r["contextpaw"]["cached"] for r in recut], marker="x", color="C3", zorder=3, label="re-cut turn"
    )
    if failed := [r["turn"] for r in rows if "failed" in r["contextpaw"]]:
        ax.scatter(failed, [0] * len(failed), marker="v", color="black", zorder=3, label="failed through ContextPaw")
    if (first := section["table"]["first_compacted_turn"]) is not None:
        ax.axvline(first, color="C3", lw=0.6, ls=":")
    ax.axhline(section["goal"], color="grey", lw=0.6)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt served from cache")
    ax.set_title(f"agent loop, llama-server -c {section['n_ctx']} (SmolLM2-135M), first cut at turn {first}", fontsize=9)
    fig.legend(fontsize=7, loc="lower center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def print_table(tables: Sequence[dict[str, Any]]) -> None:
    print("| window | turns | 1st cut | reuse mean | reuse worst | ceiling mean | ceiling worst | re-cut turns | re-cut reuse / ceiling |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for t in tables:
        print(
            f"| {t['window']:,} | {t['turns']} | {t['first_compacted_turn'] or '-'} | {percent(t['reuse_mean'])} | "
            f"{percent(t['reuse_worst'])} (turn {t['reuse_worst_turn']}) | {percent(t['ceiling_mean'])} | "
            f"{percent(t['ceiling_worst'])} | {t['recut_turns']} of {t['turns_after_first_cut']} | "
            f"{percent(t['recut_reuse_mean'])} / {percent(t['recut_ceiling_mean'])} |"
        )
    for t in tables:
        if t.get("failed_turns"):
            print(f"  {t['window']}: turns {', '.join(map(str, t['failed_turns']))} FAILED through ContextPaw (see each turn's `failed`)")
    for t in tables:
        for c in t["recuts"]:
            print(
                f"  {t['window']} turn {c['turn']}{' (first cut)' if c['turn'] == t['first_compacted_turn'] else ''}: "
                f"reuse {percent(c['reuse'])} of ceiling {percent(c['ceiling'])}; message {c.get('first_difference')} "
                f"first differs: {c.get('why')}{' (before the last marker)' if c.get('before_last_marker') else ''}"
            )


def main(argv: list[str] | None = None) -> int:
    from support.backends import locate_llama_server, locate_smollm2

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--ctx", "--n-ctx", dest="ctx", type=int, nargs="+", default=[2048], help="llama-server windows, each a run")
    ap.add_argument("--no-baseline", action="store_true", help="skip the from-scratch path (its server and its turns)")
    ap.add_argument(
        "--out",
        default="bench-results/agent_loop.json",
        help="where the section is written as JSON (with several windows: this name with -N added, one per window)",
    )
    ap.add_argument("--img-dir", default="docs/img", help="where agent-loop-N.png goes, one per window ('' for none)")
    ap.add_argument(
        "--secret",
        type=bytes.fromhex,
        default=BENCH_SECRET,
        help=f"the proxy's secret, {keys.SECRET_BYTES * 2} hex digits (default: the same in every run, so that two runs cut alike)",
    )
    args = ap.parse_args(argv)
    if len(args.secret) != keys.SECRET_BYTES:
        ap.error(f"--secret takes {keys.SECRET_BYTES * 2} hex digits")
    binary, model = locate_llama_server(), locate_smollm2()
    if binary.path is None or model.path is None:
        print(binary.reason or model.reason, file=sys.stderr)
        return 2
    out, tables = Path(args.out), []
    for n_ctx in args.ctx:
        print(f"-c {n_ctx}: ", end="", flush=True)
        with tempfile.TemporaryDirectory(prefix="contextpaw-loop-") as work:
            where = out if len(args.ctx) == 1 else out.with_name(f"{out.stem}-{n_ctx}{out.suffix}")
            result = run(
                binary.path,
                model.path,
                Path(work),
                args.turns,
                n_ctx,
                lambda: print(".", end="", flush=True),
                baseline=not args.no_baseline,
                sent_to=where.with_name(f"{where.stem}.sent.json"),
                secret=args.secret,
            )
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(json.dumps(result, indent=2))
        print(f" wrote {where}")
        if args.img_dir:
            plot(result, Path(args.img_dir) / f"agent-loop-{n_ctx}.png")
            print(f"  plotted {Path(args.img_dir) / f'agent-loop-{n_ctx}.png'}")
        tables.append(result["table"])
    print_table(tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
