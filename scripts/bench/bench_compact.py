"""Compaction cost and window use, measured (not asserted): time and peak memory per size, final/budget.

    .venv/bin/python scripts/bench/bench_compact.py [--out bench-results] [--quick]

Builds agent conversations (system prompt, task, tool calls with dumps of varied size, chatter) from
1k to 200k tokens, compacts each into a budget of a quarter of its size (at least 1k), and records the
time, the peak traced memory and the window use. The headline case is the issue's: 160,000 tokens in
600 messages into a 32k window.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time
import tracemalloc

from contextpaw.core.compact import compact_chat
from contextpaw.core.conversation import Conversation, Message
from contextpaw.core.prompt import compact_prompt
from contextpaw.core.tokens import Counter, EstimateCounter


def agent_conversation(target_tokens: int, counter: Counter, messages: int | None = None, seed: int = 7) -> list[dict]:
    """A coding-agent history of about `target_tokens`, most of it in tool output, as real ones are."""
    rng = random.Random(seed)
    msgs: list[dict] = [
        {"role": "system", "content": "You are a careful coding agent. Use tools; never guess file contents."},
        {"role": "user", "content": "Find why test_parser fails and fix it. The secret build flag is ZEBRA-42."},
    ]
    turns = max(1, (messages or target_tokens // 260) // 3)
    per_dump = max(8, target_tokens // turns)
    for t in range(turns):
        call_id = f"call_{t}"
        msgs.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/m{t}.py"})},
                    }
                ],
            }
        )
        size = max(4, int(per_dump * rng.uniform(0.2, 1.8)))
        lines = [f"{n:5d}  def f_{t}_{n}(x): return x * {rng.randint(0, 999)}" for n in range(max(1, size // 14))]
        msgs.append({"role": "tool", "tool_call_id": call_id, "content": "\n".join(lines)})
        msgs.append({"role": "assistant", "content": f"Read src/m{t}.py; nothing suspicious in it yet."})
    msgs.append({"role": "user", "content": "What did you find so far?"})
    return msgs


def tokens_of(msgs: list[dict], counter: Counter) -> int:
    return sum(counter.message(Message.from_wire(m)) for m in msgs)


def median_seconds(fn, repeat: int) -> tuple[float, object]:
    """Median seconds of `fn` over `repeat` runs, and what the last run returned."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def measure(fn, repeat: int) -> tuple[float, float, object]:
    """Median seconds over `repeat` runs and peak traced MiB of one run."""
    seconds, result = median_seconds(fn, repeat)
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return seconds, peak, result


def run(sizes: list[int], repeat: int, counter: Counter) -> list[dict]:
    rows = []
    for size in sizes:
        msgs = agent_conversation(size, counter)
        original = tokens_of(msgs, counter)
        budget = max(1000, original // 4)
        conv = Conversation.from_wire(msgs)
        seconds, peak, result = measure(lambda: compact_chat(conv, budget, counter), repeat)
        rows.append(
            {
                "kind": "chat",
                "tokens": original,
                "messages": len(msgs),
                "budget": budget,
                "final": result.report.final_tokens,
                "use": result.report.final_tokens / budget,
                "ms": seconds * 1000,
                "peak_mib": peak,
            }
        )
        prompt = "\n".join(m["content"] or "" for m in msgs)
        ptokens = counter.text(prompt)
        pbudget = max(1000, ptokens // 4)
        seconds, peak, presult = measure(lambda: compact_prompt(prompt, pbudget, counter), repeat)
        rows.append(
            {
                "kind": "prompt",
                "tokens": ptokens,
                "messages": 1,
                "budget": pbudget,
                "final": presult.report.final_tokens,
                "use": presult.report.final_tokens / pbudget,
                "ms": seconds * 1000,
                "peak_mib": peak,
            }
        )
    return rows


def headline(counter: Counter, repeat: int) -> dict:
    msgs = agent_conversation(160_000, counter, messages=600)
    conv = Conversation.from_wire(msgs)
    seconds, peak, result = measure(lambda: compact_chat(conv, 32_000, counter), repeat)
    return {
        "tokens": tokens_of(msgs, counter),
        "messages": len(msgs),
        "budget": 32_000,
        "final": result.report.final_tokens,
        "use": result.report.final_tokens / 32_000,
        "ms": seconds * 1000,
        "peak_mib": peak,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = ap.parse_args(argv)
    counter = EstimateCounter()
    sizes = [1000, 5000] if args.quick else [1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000, 160_000, 200_000]
    repeat = 1 if args.quick else 5
    head = headline(counter, repeat)
    rows = run(sizes, repeat, counter)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compaction.json").write_text(json.dumps({"headline": head, "sweep": rows}, indent=2))
    print(
        f"headline: {head['tokens']:,} tokens / {head['messages']} messages -> {head['final']:,} "
        f"(budget {head['budget']:,}, use {head['use']:.1%}) in {head['ms']:.1f} ms, peak {head['peak_mib']:.1f} MiB"
    )
    print("| kind | tokens | budget | final | use | ms | peak MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['kind']} | {r['tokens']:,} | {r['budget']:,} | {r['final']:,} | {r['use']:.1%} | {r['ms']:.1f} | {r['peak_mib']:.1f} |"
        )
    low = [r for r in rows if r["use"] < 0.95]
    return 1 if low and not args.quick else 0


if __name__ == "__main__":
    sys.exit(main())
