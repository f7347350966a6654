"""A `Fitter` with fake services, and the flows and bodies the fitter tests share."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from contextpaw import wire
from contextpaw.core.tokens import Counter
from contextpaw.fitting.fitter import Fitter
from contextpaw.fitting.flow import FlowState
from contextpaw.fitting.services import Complete
from contextpaw.ops.evicted import MemoryStore
from contextpaw.ops.metrics import Stats
from contextpaw.settings import FitSettings

OLLAMA = wire.Backend.parse(wire.Kind.OLLAMA, "http://127.0.0.1:11435")


LLAMACPP = wire.Backend.parse(wire.Kind.LLAMACPP, "http://127.0.0.1:8091")


CHAT = wire.route_for(wire.Kind.OLLAMA, "POST", "/api/chat")


OPENAI = wire.route_for(wire.Kind.OLLAMA, "POST", "/v1/chat/completions")


class NoCounting:
    """A llama-server that cannot count: the fitter falls back to its estimate."""

    calls = 0

    async def counter(
        self, base_url: str, texts: Iterable[str], fallback: Counter, *, chat: bool, has_system: bool, big: bool = False, model: str = ""
    ) -> tuple[Counter, int] | None:
        self.calls += 1
        return None

    async def total(self, base_url: str, body: Mapping[str, Any], path: str = "", big: bool = False) -> int | None:
        return None

    async def prompt_total(self, base_url: str, prompt: str, big: bool = False, model: str = "") -> int | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}


class Asked:
    """An Ollama asked to count: `counts` answers each body in turn (an `OllamaCount`, or None for
    a failed call); each body asked is kept in `bodies`."""

    def __init__(self, *counts: Any) -> None:
        self.answers = list(counts)
        self.bodies: list[Mapping[str, Any]] = []

    async def count(self, base_url: str, body: Mapping[str, Any], big: bool = False) -> Any:
        self.bodies.append(body)
        return self.answers.pop(0) if self.answers else None

    def stats(self) -> dict[str, Any]:
        return {"calls": len(self.bodies)}


class FakeServices:
    """Discovery that knows nothing (every window is the request's own or the default), and an
    Ollama that counts nothing when asked."""

    def __init__(self) -> None:
        self.fetched: list[tuple[str, str]] = []
        self.counting = NoCounting()
        self.asking = Asked()

    async def fetch(self, method: str, url: str, body: dict[str, Any] | None) -> Any:
        self.fetched.append((method, url))
        return None

    async def tokenizer(self, path: str) -> Counter | None:
        return None

    def completions(self, url: str, model: str, timeout: float, authorization: str | None) -> Complete:
        raise AssertionError("no digests without contextpaw_summarize")


def chat(turns: int = 12, num_ctx: int = 2048, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Summarise the logs."}]
    for i in range(turns):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": f"part {i} " + "log line " * 300})
    return {"model": "m", "messages": messages, "stream": False, "options": {"num_ctx": num_ctx}, **extra}


def read_request(model: str, read: str, max_tokens: int) -> dict[str, Any]:
    """An agent's fresh conversation on OpenAI's chat API: its system prompt, its one tool, the
    task, and a file it read (`read`) as the last message."""
    call = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "h.py"}'}}
    return {
        "model": model,
        "max_tokens": max_tokens,
        "tools": [{"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {"type": "object"}}}],
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Fix the failing handler."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": read},
        ],
    }


def fitter(**settings: Any) -> Fitter:
    return Fitter(
        FakeServices(),
        Stats(store := MemoryStore(max_items=100, max_bytes=1 << 20, max_age_s=60)),
        store,
        replace(FitSettings(), **settings),
    )


def state(body: dict[str, Any], route: wire.Route = CHAT, backend: wire.Backend = OLLAMA) -> FlowState:
    return FlowState(backend, route, json.dumps(body).encode(), "/api/chat")


class ToolBlindCounting:
    """A llama-server whose chat template renders no tool definitions (SmolLM2's does not): each
    text counts a token per 4 bytes, and its count of a whole request leaves the tools out. The
    whole counts of bodies holding `costly` are `extra` tokens higher than the parts suggest (a
    text tokenizes differently inside the template)."""

    def __init__(self, costly: str = "\x00", extra: int = 0) -> None:
        self.totals = 0
        self.costly, self.extra = costly, extra

    async def counter(
        self, base_url: str, texts: Iterable[str], fallback: Counter, *, chat: bool, has_system: bool, big: bool = False, model: str = ""
    ) -> tuple[Counter, int] | None:
        from contextpaw.calls.server_counts import BackendCounter

        return BackendCounter({t: tokens_of(t) for t in texts if t}, fallback, per_message=4), 8

    async def total(self, base_url: str, body: Mapping[str, Any], path: str = "", big: bool = False) -> int | None:
        from contextpaw.core.conversation import Message
        from contextpaw.wire.anthropic import system_text

        self.totals += 1
        messages = [Message.from_wire(m) for m in body.get("messages", [])]
        whole = 8 + tokens_of(system_text(body.get("system"))) + sum(4 + tokens_of(m.text) for m in messages)
        return whole + (self.extra if self.costly in json.dumps(body) else 0)

    async def prompt_total(self, base_url: str, prompt: str, big: bool = False, model: str = "") -> int | None:
        self.totals += 1
        return tokens_of(prompt)

    def stats(self) -> dict[str, Any]:
        return {}


def with_counting(f: Fitter, counting: Any) -> Fitter:
    f.services.counting = counting
    return f


def tokens_of(text: str) -> int:
    return (len(text.encode()) + 3) // 4


async def next_turn(f: Fitter, turn: dict[str, Any]) -> tuple[Any, FlowState, list[str]]:
    """The conversation of `turn` one exchange later, fitted by `f` (another instance, or the same
    after a restart): the decision, its state, and the plan keys `f` asked its store for."""
    asked: list[str] = []
    get_plan = f.store.get_plan
    f.store.get_plan = lambda k: asked.append(k) or get_plan(k)  # type: ignore[method-assign]
    following = {**turn, "messages": [*turn["messages"], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]}
    s = state(following)
    return await f.fit(s), s, asked


def repeats_prefix(first: bytes, then: bytes | None) -> bool:
    """Whether the later request starts with what the first sent (its last message aside): the
    cut and its markers byte for byte, so the prefix the server cached stays valid."""
    before, now = json.loads(first)["messages"], json.loads(then or b"{}")["messages"]
    return bool(now[: len(before) - 1] == before[:-1])
