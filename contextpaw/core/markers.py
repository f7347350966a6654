"""What the model is told about a hole, and where the telling goes without breaking a template.

Strict chat templates (Mistral, Gemma and others) raise on a system message after the first position
and on two consecutive messages of the same role. A marker therefore never uses the system role: it
becomes a message of its own whose role differs from both neighbours, and where no role can (a user
message before the hole and an assistant message after it), it is folded into the start of the next
message instead.

A standalone marker is written by the engine as a `Marker`, `{"role", "content": text}`; where the
engine meets the wire (`fitting`), each API writes it in its own shape (`wire.Chat.marker`: a typed
Responses item, for one). A Responses item without a role (a call, reasoning) joins the assistant
message before it, so a marker before one may speak as the assistant. A folded marker is a text part
of the type the message's API and role take, after an Anthropic turn's thinking.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from contextpaw.core.conversation import OUTPUT_ITEMS, REASONING, Message
from contextpaw.core.refs import EVICTED_PATH, kept

MARKER_PREFIX = "[ContextPaw:"


def kind_of(role: str) -> str:
    """How a marker names a message of this role."""
    return "tool result" if role == "tool" else f"{role} message"


LEGEND_OPENING = "Do not guess or invent removed text."
"""The legend's first words, which a request's markers say once (`legend`): a marker's own words
are its size and its reference only."""


def legend(url: str, shown: bool = True) -> str:
    """What a request's first marker says for all of them: that the text is gone, and, where markers
    name a reference (`shown`), how a model reads one back: with an MCP tool, or with a shell tool,
    the command (quoted: `?` is a shell's wildcard), which prints the first part of the content and
    says how to ask for the next (`contextpaw.core.parts`)."""
    if not shown:
        return f" {LEGEND_OPENING}"
    command = f", or curl -s '{url}{EVICTED_PATH}<ref>?part=1'" if url else ""
    return f" {LEGEND_OPENING} Read it back by its ref: the contextpaw_retrieve tool{command}."


def hole_text(kinds: Mapping[str, int], tokens: int, marker_id: str, digest: str | None = None, url: str = "", told: bool = True) -> str:
    """The note standing in for evicted messages: how many, how much, and the reference that reads
    them back ("" where the window is too small to carry one); where the request says nothing yet
    of how to read it back (`told` False), the legend too.

    Short on purpose: a long session carries many such notes, and the model must read the
    conversation, not ContextPaw's bookkeeping. `kinds` counts the removed messages by `kind_of`
    their role. With a digest, the note carries it, labelled as a summary so the model does not
    take it for the original text.
    """
    count = sum(kinds.values())
    what = f"{count} earlier message{'s' if count > 1 else ''}" if len(kinds) > 1 else _counted(kinds)
    note = f"{MARKER_PREFIX} {what} ({tokens:,} tokens) removed{_telling(marker_id, url, told)}]"
    return note + (f"\n[ContextPaw summary of the removed messages (a digest, not the original text):\n{digest}\n]" if digest else "")


def _counted(kinds: Mapping[str, int]) -> str:
    ((kind, n),) = kinds.items()
    return f"{n} earlier {kind}{'s' if n > 1 else ''}"


def elision_text(tokens: int, lines: int, marker_id: str, url: str = "", told: bool = True) -> str:
    """The note left inside a message shrunk middle-out: what was cut and its reference (with the
    legend where the request says nothing yet of how to read it back)."""
    span = f"{tokens:,} tokens" + (f" ({lines:,} lines)" if lines and marker_id else "")
    return f"\n{MARKER_PREFIX} {span} cut{_telling(marker_id, url, told)}]\n"


def _telling(marker_id: str, url: str, told: bool) -> str:
    """A marker's reference ("": a window too small to carry one; a bare id: content too big for the
    archive, said so instead), and the legend where the request has not said it yet."""
    ref = (f"; ref {marker_id}" if kept(marker_id) else "; too big to keep") if marker_id else ""
    return f"{ref}.{'' if told else legend(url, bool(marker_id))}"


def marker_role(before: str | None, after: str | None) -> str | None:
    """The role a standalone marker can take between two kept messages, or None to fold it."""
    if before != "user" and after not in ("user", "tool"):
        return "user"
    if before in ("user", "tool") and after not in ("assistant", "tool"):
        return "assistant"
    return None


class Marker(dict[str, Any]):
    """A marker that stands as a message of its own, as the engine writes it (`{"role", "content"}`).

    Its own type so that the seam (`fitting`) finds it and writes it in the API's shape."""


def standalone(role: str, note: str) -> Marker:
    return Marker(role=role, content=note)


def speaker_after(message: Message) -> str | None:
    """The role a marker before `message` must differ from: its speaker, or None for a Responses item
    without a role that joins the assistant message before it (a call, reasoning)."""
    if "role" not in message.raw and message.role in ("assistant", REASONING):
        return None
    return message.speaker


def can_fold(message: Message) -> bool:
    """Whether a marker can go at the start of this message's text: not into a call item (no text),
    nor into reasoning (templates drop it from the history, and the marker with it)."""
    return message.foldable and message.role != REASONING


TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
LEADING_BLOCKS = frozenset({"thinking", "redacted_thinking"})
"""Anthropic blocks that open an assistant turn: a text part goes after them."""


def fold(message: Message, note: str) -> Message:
    """Put a marker at the start of a kept message's text; a content list with no text to put it in
    gets a text part of its API's type for the role, after the turn's thinking."""
    raw = message.raw
    field = "output" if raw.get("type") in OUTPUT_ITEMS else "content"
    parts = raw.get(field)
    if not isinstance(parts, list) or any(_holds_text(p) for p in parts):
        return message.with_content(f"{note}\n\n{message.content_text}" if message.content_text else note)
    at = 0
    while at < len(parts) and isinstance(parts[at], Mapping) and parts[at].get("type") in LEADING_BLOCKS:
        at += 1
    part = {"type": text_part(message.speaker) if _responses(raw, parts) else "text", "text": note}
    return Message.from_wire({**raw, field: [*parts[:at], part, *parts[at:]]})


def text_part(role: str) -> str:
    """The Responses API's text part for a role: the assistant's output, anyone else's input."""
    return "output_text" if role == "assistant" else "input_text"


def _holds_text(part: Any) -> bool:
    """A text part, or an Anthropic tool result (its text is where `with_content` puts a marker)."""
    return isinstance(part, Mapping) and (part.get("type") in TEXT_PARTS or "tool_use_id" in part)


def _responses(raw: Mapping[str, Any], parts: list[Any]) -> bool:
    """Whether a message is a Responses item: typed as one, or with its API's part types."""
    if raw.get("type") == "message" or raw.get("type") in OUTPUT_ITEMS:
        return True
    return any(isinstance(p, Mapping) and str(p.get("type", "")).startswith(("input_", "output_")) for p in parts)
