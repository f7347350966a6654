"""The never-silent invariant, measured: requests of varied shapes through ContextPaw in front of
an Ollama (the fake, or the simulator on a real llama-server), each checked against the backend's
own record of whether it cut the prompt (`GET /_fake/last`).

Only what the CLIENT received counts. A response is *told* when the client received the cut (the
`X-ContextPaw-Upstream-Truncated` header, or `upstream_truncated` in the body or the stream's
final record), *possible-told* when it received that a cut is possible (the
`X-ContextPaw-Upstream-Truncation-Possible` header, or `upstream_truncation_possible` in the body
or the final record); *missed* when the backend cut it and the client was told neither; *false*
when the client was told of a cut and the backend evaluated it whole. ContextPaw's own counters
(*flagged*: `upstream_truncated` went up; *warned*: `upstream_truncation_possible` went up) are
kept beside, never counted as telling anyone. A case may ask for a window above the model's
trained length (`num_ctx`, on the native routes), as aider does: the server caps it, and so must
the verdict. A streamed `/v1/chat/completions` or `/v1/completions` client may ask for usage itself
(`usage`) or not: either way it gets exactly what it asked for (`usage_wrong`; Ollama puts a zero
usage on every text-completion chunk when asked). The `notes` shape is the issue's
chat (user notes of plain words): its word count alone proves a cut of the big size. Used by
`scripts/measure/measure_truncation.py` (the whole matrix) and by the tests (a slice of it).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from .backends import Backend, start_proxy

ROUTES = ("/api/chat", "/api/generate", "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
POLICIES = ("compact", "strict", "off")
SHAPES = ("dense", "code", "logs", "multilingual", "tools", "notes")
SECRET = "kiwi"
SYSTEM = f"The SECRET is {SECRET}. Answer in one short sentence."
QUESTION = "What is the SECRET? Answer with the word only."
TASK = "Keep the notes that follow."
"""The conversation's opening, as an agent's task opens it: the head ContextPaw never cuts, short,
so what may be cut is the notes after it."""


@dataclass(frozen=True)
class Case:
    route: str
    policy: str
    cold: bool
    stream: bool
    shape: str
    words: int
    num_ctx: int | None = None
    """The window the client asks for (`options.num_ctx`, native routes only), or None."""
    usage: bool = False
    """The client asks for the stream's usage itself (`stream_options.include_usage`)."""


@dataclass(frozen=True)
class Outcome:
    case: Case
    status: int
    cut: bool
    """The backend cut what reached it."""
    flagged: bool
    warned: bool
    recalled: bool
    told: bool = False
    """The client received the cut, in a header, the body or the stream's final record."""
    possible_told: bool = False
    """The client received that a cut is possible, in a header, the body or the final record."""
    usage_wrong: bool = False
    """A streamed OpenAI chat or text completion whose client got usage it did not ask for, or no
    usage chunk it asked for."""

    @property
    def missed(self) -> bool:
        return self.cut and not self.told and not self.possible_told

    @property
    def false_alarm(self) -> bool:
        return self.told and not self.cut


def filler(shape: str, words: int, rng: random.Random) -> str:
    """Text of one kind, about `words` words long."""
    if shape == "dense":
        return " ".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(words))
    if shape == "code":
        lines = [f"    value_{i} = compute(items[{i}], limit={rng.randint(1, 99)})  # step {i}" for i in range(words // 8)]
        return "def run(items):\n" + "\n".join(lines)
    if shape == "logs":
        return "\n".join(
            f"2026-12-01T08:{i % 60:02d}:{rng.randint(0, 59):02d}Z INFO worker-{rng.randint(1, 9)} job={i} ok latency_ms={rng.randint(1, 999)}"
            for i in range(words // 7)
        )
    if shape == "notes":
        return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "result", "value", "note", "the"]) for _ in range(words))
    if shape == "multilingual":
        pieces = ["日本語のテキスト", "Überprüfung läuft", "ошибка сети", "naïve café", "数据已保存", "¿qué tal?"]
        return " ".join(rng.choice(pieces) for _ in range(words // 2))
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "result", "value"]) for _ in range(words))


def anthropic_body(chunks: list[str], tools: bool) -> dict:
    """The case in Anthropic's shape: `system` beside the messages, tool calls as `tool_use` blocks
    answered by `tool_result` blocks, roles alternating."""
    messages: list[dict] = []
    for i, chunk in enumerate(chunks):
        if tools:
            ask = {"type": "text", "text": f"Look up part {i}."}
            if messages:
                messages[-1]["content"].append(ask)
            else:
                messages.append({"role": "user", "content": [ask]})
            use = {"type": "tool_use", "id": f"toolu_{i}", "name": "search", "input": {"q": f"part {i}"}}
            messages += [{"role": "assistant", "content": [use]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": chunk}]}]  # fmt: skip
        else:
            messages += [{"role": "user", "content": f"Note {i}: {chunk}"}, {"role": "assistant", "content": "Noted."}]
    if not tools:
        messages = [{"role": "user", "content": TASK}, {"role": "assistant", "content": "Ready."}, *messages]
    if tools and messages:
        messages[-1]["content"].append({"type": "text", "text": QUESTION})
    else:
        messages.append({"role": "user", "content": QUESTION})
    return {"system": SYSTEM, "messages": messages, "max_tokens": 8}


def responses_body(chunks: list[str], tools: bool) -> dict:
    """The case in the Responses API's shape, as Codex sends it: `instructions` beside the input,
    message items with `input_text`, tool calls as `function_call` items answered by
    `function_call_output` items."""

    def said(role: str, text: str) -> dict:
        return {"type": "message", "role": role, "content": [{"type": "input_text" if role == "user" else "output_text", "text": text}]}

    items: list[dict] = []
    for i, chunk in enumerate(chunks):
        if tools:
            items += [said("user", f"Look up part {i}."),
                      {"type": "function_call", "call_id": f"call_{i}", "name": "search", "arguments": json.dumps({"q": f"part {i}"})},
                      {"type": "function_call_output", "call_id": f"call_{i}", "output": chunk}]  # fmt: skip
        else:
            items += [said("user", f"Note {i}: {chunk}"), said("assistant", "Noted.")]
    if not tools:
        items = [said("user", TASK), said("assistant", "Ready."), *items]
    items.append(said("user", QUESTION))
    return {"instructions": SYSTEM, "input": items, "max_output_tokens": 8}


def body(case: Case, model: str, seed: int = 0) -> dict:
    """The request for a case: the fact up front, filler in the middle, the question last."""
    rng = random.Random(f"{case}-{seed}")
    middle = filler(case.shape, case.words, rng)
    common = {"model": model, "stream": case.stream} | ({"stream_options": {"include_usage": True}} if case.usage else {})
    step = max(len(middle) // 4, 1)
    chunks = [middle[i : i + step] for i in range(0, len(middle), step)]
    if case.route == "/v1/messages":
        return common | anthropic_body(chunks, case.shape == "tools")
    if case.route == "/v1/responses":
        return common | responses_body(chunks, case.shape == "tools")
    if case.route in ("/api/generate", "/v1/completions"):
        prompt = f"{SYSTEM}\n\n{middle}\n\n{QUESTION}"
        return common | (
            {"prompt": prompt, "max_tokens": 8} if case.route.startswith("/v1") else {"prompt": prompt, "options": options(case)}
        )
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    if case.shape != "tools":
        messages += [{"role": "user", "content": TASK}, {"role": "assistant", "content": "Ready."}]
    for i, chunk in enumerate(chunks):
        if case.shape == "tools":
            call = {"id": f"call_{i}", "type": "function", "function": {"name": "search", "arguments": json.dumps({"q": f"part {i}"})}}
            messages += [
                {"role": "user", "content": f"Look up part {i}."},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [call if case.route.startswith("/v1") else {"function": call["function"]}],
                },
                {"role": "tool", "content": chunk, **({"tool_call_id": call["id"]} if case.route.startswith("/v1") else {})},
            ]
        else:
            messages += [{"role": "user", "content": f"Note {i}: {chunk}"}, {"role": "assistant", "content": "Noted."}]
    messages.append({"role": "user", "content": QUESTION})
    extra = {"max_tokens": 8} if case.route.startswith("/v1") else {"options": options(case)}
    return common | {"messages": messages} | extra


def options(case: Case) -> dict:
    return {"num_predict": 8} | ({"num_ctx": case.num_ctx} if case.num_ctx else {})


def answer_text(route: str, stream: bool, text: str) -> str:
    """What the model said, from a buffered or streamed answer of any of the routes."""
    records = [json.loads(line.removeprefix("data: ")) for line in text.splitlines()
               if line.strip() and line.strip() != "data: [DONE]" and line.strip().startswith(("{", "data: {"))]  # fmt: skip
    said = []
    for record in records if stream or not records else records[:1]:
        if record.get("type") == "content_block_delta":  # Anthropic's
            said.append(record["delta"].get("text") or "")
        elif record.get("type") == "response.output_text.delta":  # the Responses API's stream
            said.append(record.get("delta") or "")
        elif record.get("object") == "response":  # a buffered Responses answer
            said += [part.get("text") or "" for item in record.get("output") or [] for part in item.get("content") or []]
        elif record.get("type") == "message":
            said += [block.get("text") or "" for block in record.get("content") or []]
        elif isinstance(record.get("message"), dict) and "role" in record["message"]:
            said.append(record["message"].get("content") or "")
        elif isinstance(record.get("response"), str):  # Ollama's /api/generate
            said.append(record["response"])
        for choice in record.get("choices") or []:
            said.append((choice.get("message") or choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(said)


def truncation_counts(proxy: str) -> tuple[int, int]:
    stats = httpx.get(f"{proxy}/contextpaw/health", timeout=10).json()["stats"]
    return stats["upstream_truncated"], stats["upstream_truncation_possible"]


def run(case: Case, proxy: str, backend: str, model: str, seed: int = 0) -> Outcome:
    """Send one case through the proxy and judge it against the backend's record."""
    before = truncation_counts(proxy)
    response = httpx.post(proxy + case.route, json=body(case, model, seed), timeout=600)
    last = httpx.get(f"{backend}/_fake/last", timeout=10).json() if response.status_code == 200 else None
    cut = bool(last and last["cut"])
    after = truncation_counts(proxy)
    recalled = response.status_code == 200 and SECRET in answer_text(case.route, case.stream, response.text).lower()
    told = "X-ContextPaw-Upstream-Truncated" in response.headers or '"upstream_truncated"' in response.text
    possible = "X-ContextPaw-Upstream-Truncation-Possible" in response.headers or '"upstream_truncation_possible"' in response.text
    usage_wrong = (
        case.stream and case.route in USAGE_ROUTES and response.status_code == 200 and usage_seen(response.text) != (case.usage, case.usage)
    )
    return Outcome(case, response.status_code, cut, after[0] > before[0], after[1] > before[1], recalled, told, possible, usage_wrong)


USAGE_ROUTES = ("/v1/chat/completions", "/v1/completions")
"""Where a stream carries usage only when the client asks for it (`stream_options.include_usage`)."""


def usage_seen(text: str) -> tuple[bool, bool]:
    """Whether an OpenAI stream carried one usage chunk (no choices, the usage), and whether any
    of its records carried usage at all."""
    records = [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: {")]
    chunks = sum(1 for r in records if r.get("choices") == [] and isinstance(r.get("usage"), dict))
    return chunks == 1, any("usage" in r for r in records)


def unload(backend: str, model: str) -> None:
    """The model leaves memory: the next request loads it cold."""
    httpx.post(f"{backend}/api/generate", json={"model": model, "keep_alive": 0}, timeout=60)


def cases(
    routes=ROUTES, policies=POLICIES, shapes=SHAPES, sizes=(300, 1500, 4000), streams=(False, True), windows=(None,), starts=(True, False)
) -> Iterator[Case]:
    """Every combination; a window of the client's own (`windows` other than None) only where the
    route can carry one."""
    for route, policy, cold, stream, shape, words, num_ctx in itertools.product(routes, policies, starts, streams, shapes, sizes, windows):
        if num_ctx is None or route.startswith("/api/"):
            yield Case(route, policy, cold, stream, shape, words, num_ctx)


def told_cases(policies=("off",), starts=(False,)) -> Iterator[Case]:
    """What only the client's own hearing checks: streamed and buffered on every route, the
    issue's chat of plain words far over the window (its word count alone proves the cut), and a
    streamed OpenAI chat or text completion whose client asks for usage beside the one that does not."""
    yield from cases(policies=policies, shapes=("notes",), sizes=(5800,), starts=starts)
    for policy, cold, route in itertools.product(policies, starts, USAGE_ROUTES):
        for shape, words in (("notes", 5800), ("tools", 3000)):
            yield Case(route, policy, cold, True, shape, words, usage=True)


def measure(
    backend: str, model: str, work: Path, matrix: list[Case], options: list[str], progress: Callable[[Outcome], None] = lambda o: None
) -> list[Outcome]:
    """Every case through its policy's proxy. A cold case gets a fresh proxy (nothing learned) in
    front of an unloaded model; a warm one follows on a proxy that has served the model already."""
    outcomes = []
    for policy in sorted({c.policy for c in matrix}):
        settings = [f"contextpaw_ollama={backend}", f"contextpaw_policy={policy}", *options]
        fresh_state = lambda name: f"contextpaw_state_dir={work / name}"  # noqa: E731
        warm: Backend | None = None
        try:
            for case in (c for c in matrix if c.policy == policy):
                if case.cold:
                    unload(backend, model)
                    state = fresh_state(f"cold-{policy}-{len(outcomes)}")
                    with start_proxy(backend, work / "conf", work / f"cold-{policy}.log", options=[*settings, state]) as fresh:
                        outcome = run(case, fresh.url, backend, model)
                else:
                    if warm is None:
                        state = fresh_state(f"warm-{policy}")
                        warm = start_proxy(backend, work / "conf", work / f"warm-{policy}.log", options=[*settings, state])
                    outcome = run(case, warm.url, backend, model)
                outcomes.append(outcome)
                progress(outcome)
        finally:
            if warm is not None:
                warm.stop()
    return outcomes
