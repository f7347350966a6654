"""A parsed request through the compaction engine, and back into its own API's body.

The seam between the engine (`compact`, which knows conversations and budgets) and the wire formats
(`wire`, which know bodies): neither imports the other, and this is where they meet. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from contextpaw import wire
from contextpaw.core.compact import Plan, compact_chat
from contextpaw.core.markers import Marker
from contextpaw.core.prompt import compact_prompt
from contextpaw.core.refs import Refs
from contextpaw.core.report import Report
from contextpaw.core.tokens import Counter


@dataclass(frozen=True, slots=True)
class Fitted:
    """A request after compaction: the body to send (None: the original bytes) and what was done."""

    body: bytes | None
    report: Report
    plan: Plan | None = None
    """The chat's decisions, to hand back next turn; prompts have no turns."""
    bound: float | None = None
    """Where a cut cannot be forbidden, how many times our count the true size can be, as the
    guard sized the fit with it: the verdict's upper bound."""

    def told(self, **changes: Any) -> Fitted:
        """This fit with its report changed so: a report is frozen, and what a step adds to it
        (the sizer's notes, the server's count, a digest's reason) makes the next one."""
        return replace(self, report=replace(self.report, **changes))


def fit_chat(
    chat: wire.Chat,
    budget: int,
    counter: Counter,
    *,
    keep_recent: int,
    previous: Plan | None,
    fixed_tokens: int = 0,
    digests: Mapping[str, str] | None = None,
    admit: int | None = None,
    headroom: float | None = None,
    refs: Refs = Refs(),
) -> Fitted:
    result = compact_chat(
        chat.conversation,
        budget,
        counter,
        keep_recent=keep_recent,
        previous=previous,
        fixed_tokens=fixed_tokens + (counter.text(chat.fixed_text) if chat.fixed_text else 0),
        digests=digests,
        admit=admit,
        headroom=headroom,
        refs=refs,
    )
    body = None if result.messages is None else wire.write(chat.body, **{chat.field: _on_wire(chat, result.messages)})
    return Fitted(body, result.report, result.plan)


def _on_wire(chat: wire.Chat, messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The messages as sent, each marker that stands alone written in the chat's API's shape."""
    return [chat.marker(m["role"], m["content"]) if isinstance(m, Marker) else m for m in messages]


def forbidding_truncation(body: bytes) -> bytes:
    """A body `wire.write` wrote (one JSON object, written compact) with `truncate: false` added,
    byte for byte where `wire.write(wire.load(body), truncate=False)` would put it (the last field),
    without parsing the body or writing it again. For a body that has no `truncate` field."""
    if not body.endswith(b"}"):
        raise ValueError("not a JSON object as wire.write writes one")
    return body[:-1] + (b',"truncate":false}' if body != b"{}" else b'"truncate":false}')


def fit_prompt(
    prompt: wire.Prompt, budget: int, counter: Counter, *, fixed_tokens: int = 0, admit: int | None = None, refs: Refs = Refs()
) -> Fitted:
    fixed = fixed_tokens + counter.text(prompt.fixed_text) + prompt.images * counter.image_tokens
    result = compact_prompt(prompt.prompt, budget, counter, fixed_tokens=fixed, admit=admit, refs=refs)
    return Fitted(None if result.prompt is None else wire.write(prompt.body, prompt=result.prompt), result.report)
