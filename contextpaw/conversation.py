"""The neutral conversation model: what compaction needs to know about a chat, and nothing it may lose.

Ollama `/api/chat` and OpenAI `/v1/chat/completions` messages share one shape with a few dialects
(content parts vs `images`, `tool_call_id` vs `tool_name`, `thinking` vs `reasoning_content`). A
`Message` keeps the wire object it came from untouched in `raw`; a kept message is written back from
`raw`, so nothing unknown is lost. The derived fields exist only so the engine can count and pair.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PINNED_ROLES = frozenset({"system", "developer"})
"""Roles that are never touched: the operator's instructions."""

_REASONING_FIELDS = ("thinking", "reasoning_content", "reasoning")


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message: the wire object plus what compaction reads from it."""

    raw: Mapping[str, Any]
    role: str
    text: str
    """Everything the model reads as text: content, reasoning, tool-call names and arguments."""
    images: int
    call_ids: tuple[str, ...] = ()
    """Ids of the tool calls this assistant message makes (synthetic where the API has none)."""
    answers: str | None = None
    """For a tool result: the id of the call it answers, when the wire says so."""

    @classmethod
    def from_wire(cls, raw: Mapping[str, Any]) -> Message:
        if not isinstance(raw, Mapping):
            raise ValueError(f"a message must be a JSON object, not {type(raw).__name__}")
        role = raw.get("role")
        if not isinstance(role, str):
            raise ValueError(f"a message role must be a string, not {role!r}")
        parts: list[str] = []
        images = _collect_content(raw.get("content"), parts)
        for name in _REASONING_FIELDS:
            if isinstance(raw.get(name), str):
                parts.append(raw[name])
        ollama_images = raw.get("images")
        if isinstance(ollama_images, list):
            images += len(ollama_images)
        calls = raw.get("tool_calls")
        call_ids: list[str] = []
        if isinstance(calls, list):
            for n, call in enumerate(calls):
                parts.append(_call_text(call))
                call_id = call.get("id") if isinstance(call, Mapping) else None
                call_ids.append(call_id if isinstance(call_id, str) else f"#{n}")
        answers = raw.get("tool_call_id")
        return cls(
            raw=raw,
            role=role,
            text="\n".join(parts),
            images=images,
            call_ids=tuple(call_ids),
            answers=answers if isinstance(answers, str) else None,
        )

    @property
    def pinned(self) -> bool:
        return self.role in PINNED_ROLES

    def with_content(self, text: str) -> Message:
        """A copy whose main text is replaced (used by shrinking and marker folding).

        A content-part list keeps its non-text parts (images) and order: the largest text part is
        replaced and other text parts are kept, so only what was shrunk changes.
        """
        raw = dict(self.raw)
        content = raw.get("content")
        if isinstance(content, list):
            texts = [i for i, p in enumerate(content) if _part_text(p) is not None]
            if texts:
                biggest = max(texts, key=lambda i: len(_part_text(content[i]) or ""))
                content = list(content)
                content[biggest] = {**content[biggest], "text": text}
            else:
                content = [{"type": "text", "text": text}, *content]
            raw["content"] = content
        else:
            raw["content"] = text
        return Message.from_wire(raw)

    @property
    def content_text(self) -> str:
        """The text that shrinking may cut: string content, or the largest text part."""
        content = self.raw.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            texts = [t for p in content if (t := _part_text(p)) is not None]
            return max(texts, key=len, default="")
        return ""


def _part_text(part: Any) -> str | None:
    if isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
        text = part.get("text")
        return text if isinstance(text, str) else None
    return None


def _collect_content(content: Any, parts: list[str]) -> int:
    """Append the readable text of `content` to `parts`; return how many images it holds."""
    if isinstance(content, str):
        parts.append(content)
        return 0
    images = 0
    if isinstance(content, list):
        for part in content:
            text = _part_text(part)
            if text is not None:
                parts.append(text)
            elif isinstance(part, Mapping) and part.get("type") in ("image_url", "input_image", "image"):
                images += 1
            elif isinstance(part, str):
                parts.append(part)
            elif part is not None:
                parts.append(json.dumps(part, ensure_ascii=False))
    elif content is not None:
        parts.append(json.dumps(content, ensure_ascii=False))
    return images


def _call_text(call: Any) -> str:
    if not isinstance(call, Mapping):
        return json.dumps(call, ensure_ascii=False)
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
    args = fn.get("arguments")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return f"{fn.get('name', '')} {args}"


@dataclass(frozen=True, slots=True)
class Unit:
    """Messages that live or die together: one message, or a tool call with all of its results."""

    indices: tuple[int, ...]
    key: str = field(compare=False)
    """A content hash, stable across turns, so a decision about this unit can be remembered."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat request's messages and tool definitions, in the neutral form."""

    messages: tuple[Message, ...]
    tools: Any = None

    @classmethod
    def from_wire(cls, messages: Iterable[Mapping[str, Any]], tools: Any = None) -> Conversation:
        return cls(tuple(Message.from_wire(m) for m in messages), tools)

    def to_wire(self) -> list[Mapping[str, Any]]:
        return [m.raw for m in self.messages]

    def units(self) -> list[Unit]:
        """Group messages into units, pairing tool results with the call that produced them.

        Results are paired by `tool_call_id` where the API has ids (OpenAI), and by position where it
        has none (Ollama: the tool messages straight after an assistant's calls). A result that
        answers no call stays glued to the message before it, so compaction never makes an orphan
        that was not already one.
        """
        owner: dict[int, int] = {}  # message index -> index of the message that heads its unit
        open_calls: dict[str, int] = {}
        positional_head: int | None = None
        for i, m in enumerate(self.messages):
            if m.call_ids:
                for cid in m.call_ids:
                    open_calls[cid] = i
                positional_head = i
                owner[i] = i
            elif m.role == "tool":
                head = open_calls.pop(m.answers, None) if m.answers is not None else None
                if head is None:
                    head = positional_head if positional_head is not None else (i - 1 if i else 0)
                owner[i] = owner.get(head, head)
            else:
                owner[i] = i
                positional_head = None
        grouped: dict[int, list[int]] = {}
        for i in range(len(self.messages)):
            grouped.setdefault(owner[i], []).append(i)
        return [
            Unit(tuple(idx), _digest(self.messages[i].raw for i in idx))
            for _, idx in sorted(grouped.items())
        ]


def _digest(raws: Iterable[Mapping[str, Any]]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for raw in raws:
        h.update(json.dumps(raw, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


def content_id(payload: Sequence[Any] | str) -> str:
    """A short stable id for evicted content: the same hole gets the same id turn after turn."""
    data = payload if isinstance(payload, str) else json.dumps(payload, sort_keys=True, default=str)
    return "cp-" + hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()
