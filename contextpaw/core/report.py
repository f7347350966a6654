"""The report: what compaction did, told the same way to the client, the operator and the model.

It travels as response headers, as a `contextpaw` object in the body (or the stream's final record),
as one log line, and as metrics. The evicted content rides along for retrieval and summarizing but is
never put on the wire to the client by `to_json`.

A report is a value: frozen, with tuples for its lists. Whoever adds to it (the engine's rendering,
the sizer, llama-server's check, the digests, the answer's verdict, the rescue) makes the next one
with `dataclasses.replace`; no one patches one that another holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from contextpaw.core.truncation import Truncation

Action = Literal["dropped", "shrunk", "summarized"]
SIZE_BOUND = "size"
"""The counter of a request proved to fit by its byte length: its sizes are upper bounds."""


@dataclass(slots=True, frozen=True)
class Removal:
    """One place where content left the model's view."""

    index: int
    """Position of the message in the original request (-1 for a raw prompt)."""
    role: str
    tokens: int
    """Tokens removed (for a shrink: what was elided, not the whole message)."""
    action: Action
    marker_id: str


@dataclass(frozen=True, slots=True)
class Report:
    compacted: bool
    strategy: str
    """none | evict | shrink | evict+shrink | head_tail | refused"""
    original_tokens: int
    final_tokens: int
    """What was sent (0 for a refusal: nothing was)."""
    budget: int
    counter: str = "estimate"
    exact: bool = False
    window: int | None = None
    headroom: float = 0.0
    """The share of the budget a cut left free so that the next turns append (0: no cut)."""
    removals: tuple[Removal, ...] = ()
    markers: tuple[str, ...] = ()
    recovered_from_upstream_400: bool = False
    summarized: bool = False
    summary_reason: str | None = None
    notes: tuple[str, ...] = ()
    upstream_truncated: Truncation | None = None
    """Set when the server evaluated less than it was sent: it cut the prompt anyway."""
    upstream_truncation_possible: Truncation | None = None
    """Set when the numbers cannot tell whether the server cut the prompt (an estimated count of a
    request ContextPaw did not change, near the window): said, never claimed."""
    required_tokens: int | None = None
    """For a refusal: what the least that may be sent would need (the whole request under strict)."""
    evicted: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """marker id -> the content removed under it (messages or text), verbatim."""
    _rows: tuple[tuple[Removal, ...], list[dict[str, Any]]] | None = field(default=None, repr=False, compare=False)
    """The removals' JSON rows, kept: a report of thousands of removals is told more than once (a
    report made from this one by `dataclasses.replace` keeps them while its removals are the same)."""

    @property
    def evicted_tokens(self) -> int:
        return sum(r.tokens for r in self.removals)

    @property
    def target(self) -> int:
        """What a cut was aimed at: the budget less the headroom."""
        return self.budget - int(self.budget * self.headroom)

    @property
    def upper_bound(self) -> bool:
        """The sizes are what the body's length allows at most (`counter: size`), not a count: a
        request proved to fit by its size alone is never counted."""
        return self.counter == SIZE_BOUND

    def to_json(self) -> dict[str, Any]:
        """The client-facing form: numbers and ids, never the evicted content itself. Built by hand
        rather than with `asdict`, which deep-copies: this runs for every handled response."""
        out: dict[str, Any] = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if name == "removals":
                value = list(self.removal_rows())
            elif name in ("markers", "notes"):
                value = list(value)
            elif name in ("upstream_truncated", "upstream_truncation_possible", "required_tokens"):
                if value is None:
                    continue
                value = asdict(value) if isinstance(value, Truncation) else value
            out[name] = value
        out["evicted_tokens"] = self.evicted_tokens
        if self.headroom:
            out["target"] = self.target
        if self.upper_bound:
            out["upper_bound"] = True
        return out

    def removal_rows(self) -> list[dict[str, Any]]:
        """The removals as JSON rows, built once per tuple of removals: the one field a frozen
        report sets after it is made, a cache of what its removals say."""
        rows = self._rows
        if rows is None or rows[0] is not self.removals:
            rows = (self.removals, [{key: getattr(r, key) for key in _REMOVAL} for r in self.removals])
            object.__setattr__(self, "_rows", rows)
        return rows[1]

    def headers(self) -> dict[str, str]:
        """The numbers as headers, each named for what it is: a bound is `Tokens-At-Most`, never an
        `Original-Tokens` that a small request would read as its size."""
        out = {"X-ContextPaw-Compacted": "true" if self.compacted else "false"}
        if self.upper_bound:
            out |= {"X-ContextPaw-Tokens-At-Most": str(self.original_tokens), "X-ContextPaw-Budget": str(self.budget)}
        elif self.original_tokens:
            out |= {
                "X-ContextPaw-Original-Tokens": str(self.original_tokens),
                "X-ContextPaw-Final-Tokens": str(self.final_tokens),
                "X-ContextPaw-Evicted-Tokens": str(self.evicted_tokens),
                "X-ContextPaw-Budget": str(self.budget),
            }
            if self.headroom:
                out["X-ContextPaw-Target"] = str(self.target)
        if self.required_tokens is not None:
            out["X-ContextPaw-Required-Tokens"] = str(self.required_tokens)
        if self.recovered_from_upstream_400:
            out["X-ContextPaw-Recovered"] = "upstream-400"
        return out

    def summary(self) -> str:
        """One line for logs; no prompt text (mitmweb's shorter comment is `proxy.replies.cut_comment`)."""
        dropped = sum(1 for r in self.removals if r.action == "dropped")
        shrunk = sum(1 for r in self.removals if r.action == "shrunk")
        return (
            f"compacted {self.original_tokens}→{self.final_tokens} tokens "
            f"(budget {self.budget}, {self.evicted_tokens} evicted: {dropped} dropped, {shrunk} shrunk; "
            f"strategy {self.strategy}, counter {self.counter})"
        )


_REMOVAL = tuple(f.name for f in fields(Removal))
_FIELDS = tuple(f.name for f in fields(Report) if f.name not in ("evicted", "_rows"))
