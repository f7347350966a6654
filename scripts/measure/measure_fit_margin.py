"""No refusal lands within a few tokens of a feasible fit: the pure engine (contextpaw/core/compact.py) on
random conversations and budgets, half of them within 20 tokens of the least the engine says the
conversation needs.

    .venv/bin/python scripts/measure/measure_fit_margin.py [--cases 1000] [--few 8] [--seed 26]

Each case is a random conversation (a system prompt, a task, turns of chat and tool calls, recent
messages of several text parts, one of them huge) and a random budget, counted either by the
estimate or by a counter under which a message costs more than its parts (joined text counts
denser), the case that made single-pass shrinking end one token short. For every refusal it asks:
- would the same request have fitted this budget, had the engine been given `--few` tokens more?
  (`compact_chat` at budget + few, judged by the real count against the original budget); and
- does the need the refusal names fit when given (the refusal is honest)?
and for every fit, whether it is within the budget. Prints the counts; the first two and the last
must be 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter as Tally

from contextpaw.core.compact import BudgetTooSmall, compact_chat
from contextpaw.core.conversation import Conversation, Message
from contextpaw.core.tokens import EstimateCounter

LINES = ["log line 42 ok", "def f(x): return x", "データ 12", '{"k": [1, 2]}', "🐾 paw", "plain words here"]


class JoinedTextCounter(EstimateCounter):
    """The estimate for texts seen whole in the request, a denser count for any other (a message's
    joined or shrunk text): a message's cost does not add up like its parts' texts."""

    def __init__(self, seen: set[str]) -> None:
        super().__init__(4.0)
        self.seen, self.dense = seen, EstimateCounter(2.5)

    def text(self, text: str) -> int:
        return super().text(text) if text in self.seen else self.dense.text(text)


def conversation(rng: random.Random) -> list[dict]:
    line = rng.choice(LINES)
    msgs: list[dict] = []
    if rng.random() < 0.8:
        msgs.append({"role": "system", "content": "You are a coding agent. " * rng.randint(1, 80)})
    msgs.append({"role": "user", "content": "TASK: " + (line + "\n") * rng.randint(1, 300)})
    calls = 0
    for _ in range(rng.randint(0, 20)):
        kind = rng.choice(["chat", "chat", "tools", "parts"])
        if kind == "tools":
            ids = [f"call_{calls + k}" for k in range(rng.randint(1, 3))]
            calls += len(ids)
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": "read", "arguments": json.dumps({"path": i})}} for i in ids]})  # fmt: skip
            msgs += [{"role": "tool", "tool_call_id": i, "content": (line + "\n") * rng.randint(1, 2000)} for i in ids]
        elif kind == "parts":
            msgs.append({"role": "user", "content": [{"type": "text", "text": (line + "\n") * rng.randint(1, 800)}
                                                     for _ in range(rng.randint(1, 3))]})  # fmt: skip
            msgs.append({"role": "assistant", "content": "ok " * rng.randint(1, 50)})
        else:
            msgs.append({"role": "user", "content": f"turn {len(msgs)} " * rng.randint(1, 300)})
            msgs.append({"role": "assistant", "content": "answer " * rng.randint(1, 300)})
    msgs.append({"role": "user", "content": [{"type": "text", "text": (line + "\n") * rng.randint(1, 3000)}]})
    return msgs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--few", type=int, default=8, help="tokens that count as 'within a few' (default 8)")
    ap.add_argument("--seed", type=int, default=26)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    tally: Tally[str] = Tally()
    margins: list[int] = []
    missed: list[tuple[int, int]] = []
    """(how far over the budget the refusal said the request was, how far its named need was over the fit found)"""
    for _ in range(args.cases):
        msgs = conversation(rng)
        conv = Conversation.from_wire(msgs)
        parsed = [Message.from_wire(m) for m in msgs]
        counter = JoinedTextCounter({t for m in parsed for t in (m.text, m.content_text)}) if rng.random() < 0.5 else EstimateCounter()
        whole = sum(counter.message(m) for m in conv.messages)
        keep_recent = rng.randint(0, 6)
        budget = max(1, int(whole * rng.uniform(0.01, 1.1)))
        if rng.random() < 0.5:  # near the edge: within 20 tokens of the least the engine says it needs
            try:
                compact_chat(conv, 1, counter, keep_recent=keep_recent)
            except BudgetTooSmall as least:
                budget = max(1, least.required + rng.randint(-20, 20))
        tally["cases"] += 1
        try:
            result = compact_chat(conv, budget, counter, keep_recent=keep_recent)
        except BudgetTooSmall as refusal:
            tally["refused"] += 1
            margins.append(refusal.required - budget)
            if refusal.required - budget <= args.few:
                tally[f"refused within {args.few} tokens of the budget"] += 1
            try:
                roomier = compact_chat(conv, budget + args.few, counter, keep_recent=keep_recent)
                if roomier.report.final_tokens <= budget:
                    tally["refused although a fit within the budget existed"] += 1
                    missed.append((refusal.required - budget, refusal.required - roomier.report.final_tokens))
            except BudgetTooSmall:
                pass
            try:
                if compact_chat(conv, refusal.required, counter, keep_recent=keep_recent).report.final_tokens > refusal.required:
                    tally["refused, and the need it named does not fit either"] += 1
            except BudgetTooSmall:
                tally["refused, and the need it named does not fit either"] += 1
            continue
        tally["fitted" if result.report.compacted else "fitted as it came"] += 1
        if result.report.final_tokens > budget and result.report.compacted:
            tally["fitted over the budget"] += 1
    for name in ("cases", "fitted as it came", "fitted", "refused", f"refused within {args.few} tokens of the budget",
                 "refused although a fit within the budget existed", "refused, and the need it named does not fit either",
                 "fitted over the budget"):  # fmt: skip
        print(f"{name:55s} {tally[name]:6d}")
    if margins:
        print(f"{'smallest shortfall a refusal named (tokens)':55s} {min(margins):6d}")
    if missed:
        print(f"{'  the most such a refusal said it was over (tokens)':55s} {max(m[0] for m in missed):6d}")
        print(f"{'  its named need over the fit found, at most (tokens)':55s} {max(m[1] for m in missed):6d}")
    bad = tally["refused although a fit within the budget existed"] + tally["refused, and the need it named does not fit either"]
    return 1 if bad or tally["fitted over the budget"] else 0


if __name__ == "__main__":
    sys.exit(main())
