"""What the model is told about a hole, and where the telling goes without breaking a template.

Strict chat templates (Mistral, Gemma and others) raise on a system message after the first position
and on two consecutive messages of the same role. A marker therefore never uses the system role: it
becomes a message of its own whose role differs from both neighbours, and where no role can (a user
message before the hole and an assistant message after it), it is folded into the start of the next
message instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from contextpaw.conversation import Message

MARKER_PREFIX = "[ContextPaw:"


def kind_of(role: str) -> str:
    """How a marker names a message of this role."""
    return "tool result" if role == "tool" else f"{role} message"


def hole_text(kinds: Mapping[str, int], tokens: int, marker_id: str, digest: str | None = None) -> str:
    """The note standing in for evicted messages: what, how much, that it is gone, and how to get it back.

    `kinds` counts the removed messages by `kind_of` their role. With a digest, the note carries it,
    labelled as a summary so the model does not take it for the original text.
    """
    count = sum(kinds.values())
    what = ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in sorted(kinds.items()))
    return (
        f"{MARKER_PREFIX} {count} earlier message{'s' if count > 1 else ''} ({what}, "
        f"{tokens:,} tokens) {'were' if count > 1 else 'was'} removed here to fit the context window. That content is no "
        f"longer visible to you: do not guess or invent what it said. If you need it, run the tool "
        f"again or ask for it (retrieval id {marker_id}).]"
    ) + (f"\n[ContextPaw summary of the removed messages (a digest, not the original text):\n{digest}\n]" if digest else "")


def elision_text(tokens: int, lines: int, marker_id: str) -> str:
    """The note left inside a message shrunk middle-out."""
    span = f"{tokens:,} tokens" + (f" ({lines:,} lines)" if lines else "")
    return (
        f"\n{MARKER_PREFIX} {span} were cut from the middle here to fit the context window; that part "
        f"is no longer visible to you, do not guess it (retrieval id {marker_id}).]\n"
    )


def marker_role(before: str | None, after: str | None) -> str | None:
    """The role a standalone marker can take between two kept messages, or None to fold it."""
    if before != "user" and after not in ("user", "tool"):
        return "user"
    if before in ("user", "tool") and after not in ("assistant", "tool"):
        return "assistant"
    return None


def fold(message: Message, note: str) -> Message:
    """Put a marker at the start of a kept message's text."""
    return message.with_content(f"{note}\n\n{message.content_text}" if message.content_text else note)
