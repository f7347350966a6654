"""Prefix-cache reuse in an agent loop: ContextPaw's sticky plan vs re-deciding from scratch each turn.

    .venv/bin/python scripts/bench_agent_loop.py [--turns 30] [--n-ctx 2048]

A scripted agent conversation (OpenAI format: tool calls, tool results of varied size, now and then
a user follow-up) grows every turn until it overflows a real llama-server's window. Each turn is
sent three times, to three servers (one slot each, so no path spoils another's cache): through
mitmdump with ContextPaw, which remembers the conversation's plan (sticky evictions); a baseline
that calls `compact_chat` itself without `previous`, with the same counter and the budget the proxy
reported for that turn; and, uncut, to a server whose window holds the whole conversation. The
uncut server evaluates exactly what each turn adds, which every path must evaluate: so no
compaction into this window can serve more of a turn from the cache than ContextPaw's prompt less
those tokens (the `ceiling` of the summary). Per turn it records llama-server's `timings.cache_n` (served
from the KV cache) and `timings.prompt_n` (evaluated again). Used by scripts/bench.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from contextpaw.compact import compact_chat
from contextpaw.conversation import Conversation
from contextpaw.counting import LlamaCppCounting
from contextpaw.tokens import EstimateCounter
from contextpaw.wire import Chat, Params

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: tests/support/ as `support`
from support.backends import start_llama_server, start_proxy

KEEP_RECENT = 4
"""The proxy's default `contextpaw_keep_recent`; the baseline keeps as many."""
MAX_TOKENS = 8
CACHE_GOAL = 0.9
"""The mean share of a turn's prompt served from the cache, over the turns after the first compaction."""
TURN_FLOOR = 0.75
"""No turn after the first compaction below this share."""
UNCUT_CTX = 16384
"""The uncut server's window: the whole 30-turn conversation fits."""
PATHS = ("contextpaw", "baseline", "uncut")
WORDS = ("alpha beta gamma delta epsilon parser token window budget cache slot prompt build test "
         "module import return value error warning config").split()


def agent_turns(turns: int, seed: int = 11) -> list[list[dict[str, Any]]]:
    """The request of every turn: the history so far, ending with the newest tool result."""
    rng = random.Random(seed)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools to inspect the workspace."},
        {"role": "user", "content": "The nightly build fails. Find out why; the release tag is ORCHID-77."},
    ]
    requests = []
    for t in range(turns):
        if t and t % 6 == 0:
            history += [{"role": "assistant", "content": f"Checked {t} files so far; nothing conclusive yet."},
                        {"role": "user", "content": f"Keep going, look at more files (round {t // 6})."}]
        call = {"id": f"call_{t}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/mod_{t}.py"})}}
        lines = [f"{n:4d} " + " ".join(rng.choices(WORDS, k=rng.randint(4, 10))) for n in range(rng.randint(3, 40))]
        history += [{"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{t}", "content": "\n".join(lines)}]
        requests.append([dict(m) for m in history])
    return requests


def body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "smollm2", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}


async def post(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> dict[str, Any]:
    async with session.post(f"{url}/v1/chat/completions", json=payload) as resp:
        answer = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {json.dumps(answer)[:300]}")
        return answer


def row(answer: dict[str, Any], compacted: bool, final_tokens: int | None) -> dict[str, Any]:
    timings = answer.get("timings") or {}
    cached, evaluated = timings.get("cache_n", 0), timings.get("prompt_n", 0)
    return {"cache_n": cached, "prompt_n": evaluated, "cached": cached / max(1, cached + evaluated),
            "compacted": compacted, "final_tokens": final_tokens}


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


async def loop(proxy: str, baseline: str, uncut: str, turns: int, tick: Callable[[], None]) -> list[dict[str, Any]]:
    """Every turn through ContextPaw, then by the baseline, then uncut; one record per turn."""
    rows = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(trust_env=False, timeout=timeout) as session:
        counting = LlamaCppCounting(session)
        for n, messages in enumerate(agent_turns(turns)):
            answer = await post(session, proxy, body(messages))
            report = answer.get("contextpaw") or {}
            budget = report.get("budget")
            if budget is None:
                raise RuntimeError(f"turn {n}: the proxied answer carries no contextpaw report")
            sent, compacted, total = await from_scratch(counting, baseline, messages, budget)
            rows.append({"turn": n + 1, "messages": len(messages), "budget": budget,
                         "contextpaw": row(answer, bool(report.get("compacted")), report.get("final_tokens")),
                         "baseline": row(await post(session, baseline, body(sent)), compacted, total),
                         "uncut": row(await post(session, uncut, body(messages)), False, None)})
            tick()
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per path: cache fraction over the turns after ContextPaw's first compaction, against the goals
    (the uncut path over the same turns, as the ceiling)."""
    out = {}
    first_cut = next((i for i, r in enumerate(rows) if r["contextpaw"]["compacted"]), None)
    for path in PATHS:
        first = next((i for i, r in enumerate(rows) if r[path]["compacted"]), None) if path != "uncut" else first_cut
        after = [r[path]["cached"] for r in rows[first + 1:]] if first is not None else []
        out[path] = {"first_compacted_turn": None if first is None else first + 1, "turns_after": len(after),
                     "mean_cached": sum(after) / len(after) if after else None,
                     "min_cached": min(after) if after else None,
                     "turns_at_goal": sum(f >= CACHE_GOAL for f in after),
                     "turns_under_floor": sum(f < TURN_FLOOR for f in after),
                     "evaluated_tokens": sum(r[path]["prompt_n"] for r in rows),
                     "cached_tokens": sum(r[path]["cache_n"] for r in rows)}
    if first_cut is not None and all("uncut" in r for r in rows):
        ceiling = [window_ceiling(r) for r in rows[first_cut + 1:]]
        out["ceiling"] = {"mean_cached": sum(ceiling) / len(ceiling), "min_cached": min(ceiling),
                          "turns_at_goal": sum(f >= CACHE_GOAL for f in ceiling),
                          "turns_under_floor": sum(f < TURN_FLOOR for f in ceiling)}
    return out


def window_ceiling(row: dict[str, Any]) -> float:
    """The most of ContextPaw's prompt any compaction could have served from the cache this turn:
    all of it but what the turn adds (the uncut server evaluates exactly that)."""
    ours = row["contextpaw"]
    return 1 - row["uncut"]["prompt_n"] / max(1, ours["cache_n"] + ours["prompt_n"])


def run(binary: Path, model: Path, work: Path, turns: int, n_ctx: int, tick: Callable[[], None]) -> dict[str, Any]:
    """Start two servers and the proxy, run the loop, stop them; the section of the report."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(start_llama_server(binary, model, ctx, work / f"llama-{name}.log"))
                   for name, ctx in (("proxied", n_ctx), ("baseline", n_ctx), ("uncut", UNCUT_CTX))]
        proxy = stack.enter_context(start_proxy(
            servers[0].url, work / "mitm-loop", work / "mitmdump-loop.log",
            options=[f"contextpaw_llamacpp={servers[0].url}", "contextpaw_calibrate=false"]))
        rows = asyncio.run(loop(proxy.url, servers[1].url, servers[2].url, turns, tick))
    return {"n_ctx": n_ctx, "uncut_ctx": UNCUT_CTX, "turns": rows, "summary": summarize(rows), "goal": CACHE_GOAL,
            "turn_floor": TURN_FLOOR}


def main(argv: list[str] | None = None) -> int:
    from support.backends import locate_llama_server, locate_smollm2

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--out", default="bench-results/agent_loop.json", help="where the section is written as JSON")
    args = ap.parse_args(argv)
    binary, model = locate_llama_server(), locate_smollm2()
    if binary.path is None or model.path is None:
        print(binary.reason or model.reason, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="contextpaw-loop-") as work:
        result = run(binary.path, model.path, Path(work), args.turns, args.n_ctx, lambda: print(".", end="", flush=True))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
