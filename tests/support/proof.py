"""The proof, as code shared by the demos and the real-backend tests: a needle in an overflowing chat.

A random secret is planted at the start of a prompt that overflows the window (a pasted log), and the
end of it asks for the secret back. Ollama cuts the front and the model invents; llama-server refuses
with a 400; through ContextPaw the middle is elided with a marker, head and tail are kept, and the
model can answer.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import anthropic
    import openai

WORDS = ["walrus", "mango", "copper", "violet", "falcon", "pepper", "glacier", "saffron", "otter", "cobalt"]
FILLER = [
    "The build log shows the compiler finished the module without warnings.",
    "The linter reported no issues in this directory.",
    "The cache directory was cleaned and recreated.",
    "All unit tests in this package passed on the last run.",
    "The configuration file uses the default values for every field.",
]


def make_secret(rng: random.Random) -> str:
    return f"{rng.choice(WORDS).upper()}-{rng.randint(1000, 9999)}"


def needle_chat(secret: str, filler_lines: int, rng: random.Random) -> list[dict[str, Any]]:
    """A chat whose one user message holds the secret first, a long pasted log, and the question last."""
    return [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": needle_prompt(secret, filler_lines, rng)},
    ]


def needle_prompt(secret: str, filler_lines: int, rng: random.Random) -> str:
    """Secret first, `filler_lines` of bland log, the question last."""
    filler = "\n".join(rng.choice(FILLER) for _ in range(filler_lines))
    return f"Remember this password: {secret}.\n{filler}\nWhat is the password I asked you to remember?"


def recalled(secret: str, answer: str | None) -> bool:
    """The answer holds the secret's distinctive number (small models mangle case and punctuation)."""
    return bool(answer) and secret.split("-")[1] in answer


@dataclass
class Trial:
    path: str
    status: int
    answer: str
    recalled: bool
    prompt_tokens: int | None = None
    report: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    """The response's X-ContextPaw-* headers (lower-case names)."""

    @property
    def compacted(self) -> bool:
        return bool(self.report and self.report.get("compacted"))

    def row(self) -> str:
        report = self.report or {}
        squeezed = (
            f"{report.get('original_tokens')}→{report.get('final_tokens')} (budget {report.get('budget')})"
            if report.get("compacted")
            else "-"
        )
        answer = self.answer.replace("\n", " ")[:60]
        return (
            f"| {self.path} | {self.status} | {self.prompt_tokens if self.prompt_tokens is not None else '-'} "
            f"| {squeezed} | {answer} | {'yes' if self.recalled else 'no'} |"
        )


TABLE_HEAD = "| path | HTTP | prompt tokens (server) | compaction | answer | recalled |\n|---|---:|---:|---|---|---|"


# -- llama-server: the 400, and what the clients see -------------------------------------------------

GREEDY_TOKENS = 24
"""Answer length for every trial: enough for "The password is WORD-1234.", and cheap."""


def overflow_lines(n_ctx: int, trial: int) -> int:
    """Filler lines for trial ``trial`` (from 0) against an ``n_ctx`` window: about 1.4x the window
    for the first trial (a log line is about 11 tokens), growing by 50 lines a trial."""
    return n_ctx // 8 + 50 * trial


def contextpaw_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("x-contextpaw-")}


def error_answer(error: Mapping[str, Any]) -> str:
    """An error body as the answer column shows it: the type and llama-server's two counts."""
    counts = f" ({error['n_prompt_tokens']} > n_ctx {error['n_ctx']})" if "n_ctx" in error else ""
    return f"{error.get('type', 'error')}{counts}"


def openai_trial(
    client: openai.OpenAI,
    path: str,
    secret: str,
    messages: list[dict[str, Any]],
    *,
    model: str = "smollm2",
    stream: bool = False,
    max_tokens: int = GREEDY_TOKENS,
    **extra: Any,
) -> Trial:
    """One chat completion with the real openai client, streamed or not.

    A 400 is the openai client's ``BadRequestError``: the row shows llama-server's error and its token
    count. The ``contextpaw`` report is read from the body (``model_extra``; in a stream, the last
    record that carries it) and the X-ContextPaw-* headers from the raw response.
    """
    import openai

    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0,  # type: ignore[arg-type]
            stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}), **extra,
        )  # fmt: skip
    except openai.APIStatusError as e:
        error = e.body if isinstance(e.body, Mapping) else {}
        return Trial(path, e.status_code, error_answer(error), False, error.get("n_prompt_tokens"))
    headers = contextpaw_headers(raw.headers)
    if not stream:
        completion = raw.parse()
        answer = completion.choices[0].message.content or ""
        usage = completion.usage.prompt_tokens if completion.usage else None
        report = (completion.model_extra or {}).get("contextpaw")
        return Trial(path, raw.status_code, answer, recalled(secret, answer), usage, report, headers=headers)
    pieces: list[str] = []
    usage, report = None, None
    for chunk in raw.parse():
        pieces += [c.delta.content for c in chunk.choices if c.delta and c.delta.content]
        usage = chunk.usage.prompt_tokens if chunk.usage else usage
        report = (chunk.model_extra or {}).get("contextpaw", report)
    answer = "".join(pieces)
    return Trial(path, raw.status_code, answer, recalled(secret, answer), usage, report, ["stream"], headers)


def anthropic_trial(
    client: anthropic.Anthropic, path: str, secret: str, messages: list[dict[str, Any]], *, model: str = "smollm2", stream: bool = False
) -> Trial:
    """One Messages API call with the real anthropic SDK, streamed or not: a chat's system message
    goes into `system`. The report comes from the message (``model_extra``) or, in a stream, from
    the ``message_delta`` event; the prompt size from ``usage`` (new plus cached tokens)."""
    import anthropic

    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = [m for m in messages if m["role"] != "system"]
    try:
        raw = client.messages.with_raw_response.create(
            model=model, max_tokens=GREEDY_TOKENS, system=system, messages=turns, stream=stream,  # type: ignore[arg-type]
            extra_body={"temperature": 0},  # greedy, as the other demos (this SDK has no parameter for it)
        )  # fmt: skip
    except anthropic.APIStatusError as e:
        body = e.body if isinstance(e.body, Mapping) else {}
        error = body.get("error") if isinstance(body.get("error"), Mapping) else {}
        return Trial(path, e.status_code, error_answer(error), False, error.get("n_prompt_tokens"), body.get("contextpaw"))
    headers = contextpaw_headers(raw.headers)

    def prompt_size(usage: Any) -> int | None:
        return None if usage is None or usage.input_tokens is None else usage.input_tokens + (usage.cache_read_input_tokens or 0)

    if not stream:
        message = raw.parse()
        answer = "".join(b.text for b in message.content if b.type == "text")
        report = (message.model_extra or {}).get("contextpaw")
        return Trial(path, raw.status_code, answer, recalled(secret, answer), prompt_size(message.usage), report, headers=headers)
    pieces: list[str] = []
    usage, report = None, None
    for event in raw.parse():
        if event.type == "message_start":
            usage = prompt_size(event.message.usage)
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            pieces.append(event.delta.text)
        elif event.type == "message_delta":
            usage = getattr(event.usage, "input_tokens", None) or usage
            report = (event.model_extra or {}).get("contextpaw")
    answer = "".join(pieces)
    return Trial(path, raw.status_code, answer, recalled(secret, answer), usage, report, ["stream"], headers)


def rendered_prompt(llama_server: str, messages: list[dict[str, Any]]) -> str:
    """``messages`` rendered by the server's own chat template (``/apply-template``): the raw prompt an
    application on ``/completion`` sends."""
    reply = httpx.post(f"{llama_server}/apply-template", json={"messages": messages}, timeout=60)
    reply.raise_for_status()
    return reply.json()["prompt"]


def completion_trial(base_url: str, path: str, secret: str, prompt: str, *, n_predict: int = GREEDY_TOKENS) -> Trial:
    """One call to llama-server's native ``/completion`` with a raw prompt, over raw HTTP."""
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0}
    reply = httpx.post(f"{base_url}/completion", json=body, timeout=600)
    data = reply.json()
    headers = contextpaw_headers(reply.headers)
    if reply.status_code != 200:
        return Trial(
            path,
            reply.status_code,
            error_answer(data.get("error") or {}),
            False,
            (data.get("error") or {}).get("n_prompt_tokens"),
            data.get("contextpaw"),
            headers=headers,
        )
    answer = data.get("content", "")
    return Trial(path, 200, answer, recalled(secret, answer), data.get("tokens_evaluated"), data.get("contextpaw"),
                 headers=headers)  # fmt: skip


# -- verdicts -----------------------------------------------------------------------------------------

RECALL_NEEDED = 0.8
"""The share of trials through ContextPaw that must recall the secret for a demo to pass."""


def recall_line(label: str, trials: Iterable[Trial]) -> str:
    trials = list(trials)
    return f"{label}: recalled {sum(t.recalled for t in trials)}/{len(trials)}"


def proof_holds(through: Iterable[Trial], recall_needed: float = RECALL_NEEDED) -> bool:
    """Every trial through ContextPaw answered 200 compacted, and enough of them recalled the secret."""
    through = list(through)
    answered = all(t.status == 200 and t.compacted for t in through)
    return bool(through) and answered and sum(t.recalled for t in through) >= len(through) * recall_needed


def start_demo_llama(stack: contextlib.ExitStack, work: Path, n_ctx: int) -> str | None:
    """The bundled llama-server with SmolLM2, for a demo: its URL, or None (said on stderr) when missing."""
    from .backends import locate_llama_server, locate_smollm2, start_llama_server

    binary, model = locate_llama_server(build=True), locate_smollm2()
    if binary.path is None or model.path is None:
        print(f"cannot start the real backend: {binary.reason or model.reason}", file=sys.stderr)
        return None
    print(f"llama-server: {binary.path} -c {n_ctx}\nmodel: {model.path}", file=sys.stderr)
    return stack.enter_context(start_llama_server(binary.path, model.path, n_ctx, work / "llama.log")).url
