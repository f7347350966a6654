"""The neutral conversation model: what compaction needs to know about a chat, and nothing it may lose.

Ollama `/api/chat` and OpenAI `/v1/chat/completions` messages share one shape with a few dialects
(content parts vs `images`, `tool_call_id` vs `tool_name`, `thinking` vs `reasoning_content`).
Anthropic's `/v1/messages` puts everything in content blocks: a `tool_use` block in an assistant
message is a call, and the user message after it answers with `tool_result` blocks; such a message is
read as a tool result (role `tool`), so pairing and markers treat it as the other dialects' tool
messages. OpenAI's Responses API (`/v1/responses`) sends typed items instead of messages: a
`function_call` (or `custom_tool_call`) item is read as an assistant's call, its `*_output` item as
the tool result that answers it by `call_id`, a `reasoning` item as part of the turn it precedes,
and an item of a type not known here as something to keep as it is (never evicted, never cut).
A `Message` keeps the wire object it came from untouched in `raw`; a kept message is
written back from `raw`, so nothing unknown is lost. The derived fields exist only so the engine can
count and pair.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from contextpaw.core.canonical import canonical

KEPT_ITEM = "item"
"""The role given to a Responses item of a type not known here: kept as sent."""
PINNED_ROLES = frozenset({"system", "developer", KEPT_ITEM})
"""Roles that are never touched: the operator's instructions, and items not understood."""
AGENT_CONTEXT = re.compile(r"\A\s*(?:<([\w-]+)>.*</\1>|# AGENTS\.md instructions for .*)\s*\Z", re.DOTALL)
"""A user message that is only an agent's own context, not the user's words: one wrapped element
(Codex's `<environment_context>`), or Codex's AGENTS.md message."""
REASONING = "reasoning"
"""A Responses `reasoning` item: it belongs to the turn it precedes, and goes with it."""
CALL_ITEMS = frozenset({"function_call", "custom_tool_call"})
OUTPUT_ITEMS = frozenset({"function_call_output", "custom_tool_call_output"})
"""Responses items that call a tool, and those that carry its output (in `output`), paired by `call_id`."""

_REASONING_FIELDS = ("thinking", "reasoning_content", "reasoning")
CALL_BLOCKS = frozenset({"tool_use", "server_tool_use"})
"""Anthropic content blocks that call a tool; their `id` is answered by a `tool_use_id`."""
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})


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
        kind = raw.get("type")
        if isinstance(kind, str) and kind != "message":
            return _item(raw, kind)
        role = raw.get("role")
        if not isinstance(role, str):
            raise ValueError(f"a message role must be a string, not {role!r}")
        parts: list[str] = []
        content = raw.get("content")
        images = _collect_content(content, parts)
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
        if isinstance(content, list):  # Anthropic: calls and results are content blocks
            blocks = [b for b in content if isinstance(b, Mapping)]
            call_ids += [str(b.get("id", f"#{n}")) for n, b in enumerate(blocks) if b.get("type") in CALL_BLOCKS]
            results = [b.get("tool_use_id") for b in blocks if _is_result(b)]
            if results and role == "user":
                role, answers = "tool", results[0]
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

    @property
    def speaker(self) -> str:
        """The role as the wire spells it, which templates and APIs check alternation on: an
        Anthropic tool result is a user message there, though compaction reads it as a tool result.
        A Responses item without a role speaks as what it is read as."""
        return str(self.raw.get("role") or ("assistant" if self.role == REASONING else self.role))

    @property
    def foldable(self) -> bool:
        """Whether a marker can be put at the start of this message's text (a call item has none)."""
        return "content" in self.raw or self.raw.get("type") in OUTPUT_ITEMS

    def with_content(self, text: str) -> Message:
        """A copy whose main text is replaced (used by shrinking and marker folding).

        A content list keeps its other parts (images, tool calls) and order: the largest text, at
        the top level or inside a tool result, is replaced and other texts are kept, so only what
        was shrunk changes. A list without text gets a text part: first, or after the tool results
        (Anthropic refuses text before them).
        """
        raw = dict(self.raw)
        field = "output" if raw.get("type") in OUTPUT_ITEMS else "content"
        content = raw.get(field)
        if isinstance(content, list):
            content = list(content)
            slots = _text_slots(content)
            if slots:
                part, inner, _ = max(slots, key=lambda slot: len(slot[2]))
                content[part] = _replaced(content[part], inner, text)
            elif any(_is_result(p) for p in content):
                content.append({"type": "text", "text": text})
            else:
                content.insert(0, {"type": "text", "text": text})
            raw[field] = content
        else:
            raw[field] = text
        return Message.from_wire(raw)

    @property
    def content_text(self) -> str:
        """The text that shrinking may cut: string content, or the largest text in a content list
        (a Responses tool output's `output`)."""
        content = self.raw.get("output" if self.raw.get("type") in OUTPUT_ITEMS else "content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return max((text for _, _, text in _text_slots(content)), key=len, default="")
        return ""


Slot = tuple[int, int | None, str]
"""Where a text lies in a content list: (part, None) for a text part; (part, -1) for a tool result
whose content is a string; (part, k) for the k-th text part of a tool result's content list."""


def _is_result(part: Any) -> bool:
    """An Anthropic block that answers a tool call (`tool_result`, and server tools' results)."""
    return isinstance(part, Mapping) and "tool_use_id" in part


def _text_slots(content: list[Any]) -> list[Slot]:
    slots: list[Slot] = []
    for i, part in enumerate(content):
        text = _part_text(part)
        if text is not None:
            slots.append((i, None, text))
        elif _is_result(part):
            inner = part.get("content")
            if isinstance(inner, str):
                slots.append((i, -1, inner))
            elif isinstance(inner, list):
                slots += [(i, k, t) for k, sub in enumerate(inner) if (t := _part_text(sub)) is not None]
    return slots


def _replaced(part: Mapping[str, Any], inner: int | None, text: str) -> dict[str, Any]:
    """A content part with the text at `inner` (see `Slot`) replaced; its other keys (an Anthropic
    `cache_control`, a tool result's `is_error`) are kept."""
    if inner is None:
        return {**part, "text": text}
    if inner == -1:
        return {**part, "content": text}
    subs = list(part["content"])
    subs[inner] = {**subs[inner], "text": text}
    return {**part, "content": subs}


def _item(raw: Mapping[str, Any], kind: str) -> Message:
    """A Responses input item that is not a message, read as the message it stands for."""
    call_id = raw.get("call_id")
    call_id = call_id if isinstance(call_id, str) else None
    if kind in CALL_ITEMS:
        arguments = raw.get("arguments", raw.get("input"))
        text = f"{raw.get('name', '')} {arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}"
        return Message(raw, "assistant", text, 0, (call_id or "#0",))
    if kind in OUTPUT_ITEMS:
        parts: list[str] = []
        images = _collect_content(raw.get("output"), parts)
        return Message(raw, "tool", "\n".join(parts), images, answers=call_id)
    if kind == REASONING:
        return Message(raw, REASONING, json.dumps(raw, ensure_ascii=False), 0)
    return Message(raw, KEPT_ITEM, json.dumps(raw, ensure_ascii=False), 0)


def _part_text(part: Any) -> str | None:
    if isinstance(part, Mapping) and part.get("type") in ("text", "input_text", "output_text"):
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
            elif isinstance(part, Mapping) and part.get("type") in IMAGE_PARTS:
                images += 1
            elif isinstance(part, Mapping) and part.get("type") in _BLOCK_TEXT:
                images += _BLOCK_TEXT[part["type"]](part, parts)
            elif isinstance(part, str):
                parts.append(part)
            elif part is not None:
                parts.append(json.dumps(part, ensure_ascii=False))
    elif content is not None:
        parts.append(json.dumps(content, ensure_ascii=False))
    return images


def _result_text(block: Mapping[str, Any], parts: list[str]) -> int:
    return _collect_content(block.get("content"), parts)


def _field_text(name: str) -> Callable[[Mapping[str, Any], list[str]], int]:
    def read(block: Mapping[str, Any], parts: list[str]) -> int:
        value = block.get(name)
        parts.append(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
        return 0

    return read


def _document_text(block: Mapping[str, Any], parts: list[str]) -> int:
    source = block.get("source")
    if isinstance(source, Mapping) and isinstance(source.get("data"), str) and source.get("type") == "text":
        parts.append(source["data"])
    else:
        parts.append(json.dumps(block, ensure_ascii=False))
    return 0


def _use_text(block: Mapping[str, Any], parts: list[str]) -> int:
    parts.append(_call_text(block))
    return 0


_BLOCK_TEXT: dict[str, Callable[[Mapping[str, Any], list[str]], int]] = {
    "tool_result": _result_text,
    "tool_use": _use_text,
    "server_tool_use": _use_text,
    "thinking": _field_text("thinking"),
    "redacted_thinking": _field_text("data"),
    "document": _document_text,
}
"""How the model's text is read out of Anthropic content blocks (returning the images inside);
a block of any other type is counted as its JSON."""


def _call_text(call: Any) -> str:
    if not isinstance(call, Mapping):
        return json.dumps(call, ensure_ascii=False)
    fn: Mapping[str, Any] = call["function"] if isinstance(call.get("function"), Mapping) else call
    args = fn.get("arguments", fn.get("input"))
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

    def task_index(self) -> int:
        """The index of the message that holds the task, -1 where there is no user message: the first
        user message, or the first after it that is more than an agent's wrapped context, while the
        model has not answered yet. Codex sends its environment as a user message of its own
        (`<environment_context>…</environment_context>`, and AGENTS.md as `# AGENTS.md instructions`)
        before the task's; Claude Code and Qwen Code send the context and the task as one message."""
        first = next((i for i, m in enumerate(self.messages) if m.role == "user"), -1)
        if first < 0:
            return -1
        for i, m in enumerate(self.messages[first:], first):
            if m.role != "user" and not m.pinned:
                break
            if m.role == "user" and not AGENT_CONTEXT.match(m.text):
                return i
        return first

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
        following: int | None = None  # a reasoning item joins the unit of the item after it
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == REASONING:
                if following is not None:
                    owner[i] = owner[following]
            else:
                following = i
        grouped: dict[int, list[int]] = {}
        for i in range(len(self.messages)):
            grouped.setdefault(owner[i], []).append(i)
        return [Unit(tuple(idx), _digest(self.messages[i].raw for i in idx)) for _, idx in sorted(grouped.items())]


def _digest(raws: Iterable[Mapping[str, Any]]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for raw in raws:
        h.update(canonical(raw))
        h.update(b"\x00")
    return h.hexdigest()
