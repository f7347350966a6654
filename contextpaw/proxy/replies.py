"""Answers ContextPaw makes itself, its headers on answers, and what it says about a flow in
mitmweb (its marks)."""

from __future__ import annotations

from collections.abc import Mapping

from mitmproxy import http

from contextpaw.core.report import Report
from contextpaw.wire import Kind, Overflow
from contextpaw.wire.bodies import JSON_TYPE

COMPACTED_MARK = ":scissors:"
REFUSED_MARK = ":heavy_multiplication_x:"
TRUNCATED_MARK = ":warning:"
ADMIN_MARK = ":gear:"
"""mitmweb marks, by mitmproxy's names: compacted (✂), refused by ContextPaw (✖: 413, 502),
cut by the server anyway (⚠), answered by ContextPaw itself (⚙: `/contextpaw/*`). Each glyph is a
text symbol that plain fonts such as DejaVu Sans have; ⛔ (`:no_entry:`) needs an emoji font."""


def reply(flow: http.HTTPFlow, status: int, body: bytes, content_type: str = JSON_TYPE) -> None:
    """Answer the flow here; the backend never sees it."""
    flow.response = http.Response.make(status, body, {"Content-Type": content_type})


def flag(flow: http.HTTPFlow, mark: str, comment: str, replace: bool = False) -> None:
    """Say it in mitmweb: a mark on the flow, and a line in its comment (after any earlier one,
    unless ``replace``: a rescue's report replaces the first compaction's)."""
    flow.marked = mark
    flow.comment = comment if replace or not flow.comment else f"{flow.comment}; {comment}"


# -- comments: mitmweb's comment column is narrow (150 px, about 20 characters; `web.py` widens it to
# half the flow list), so each comment starts with the route, then what a person acts on: the cut's
# numbers, or a refusal's fix. The contextpaw view and the report have the rest.


def cut_comment(route: str, report: Report) -> str:
    """`ollama.chat: 10,103→955 tok, 8 dropped, 4 shrunk` (and a rescue's retry after it)."""
    told = [f"{report.original_tokens:,}→{report.final_tokens:,} tok"]
    actions = [r.action for r in report.removals]
    told += [f"{actions.count(a)} {a}" for a in ("dropped", "shrunk", "summarized") if a in actions]
    if report.recovered_from_upstream_400:
        told.append("retried after the backend's overflow")
    return f"{route}: {', '.join(told)}"


def off_comment(route: str, report: Report) -> str:
    """Under policy off: what a cut would have done, said as one."""
    return f"{route}: policy off, unchanged; would cut {cut_comment(route, report).removeprefix(route + ': ')}"


def refused_comment(route: str, fix: str, why: str) -> str:
    """`ollama.chat refused; fix: <what the user does about it>; <why, with its numbers>`."""
    return f"{route} refused; fix: {fix}; {why}"


def overflow_comment(route: str, overflow: Overflow, kind: Kind | None) -> str:
    """A refusal for the window: the fix, then what the request needs against what fits."""
    return refused_comment(route, window_fix(overflow, kind), f"{overflow.required:,} tok > {overflow.budget:,} budget")


def window_fix(overflow: Overflow, kind: Kind | None) -> str:
    """The fix, from what the refusal knows: the least window when it is known (what is never cut
    needs it); under policy strict, compacting; else the window the request would fit in, or a
    shorter request."""
    room = overflow.window - overflow.budget  # what the window keeps for the answer and the template
    if overflow.least_window is not None:
        return f"window ≥ {overflow.least_window:,} ({_window_setting(kind, overflow.least_window)})"
    least = overflow.required + room
    if overflow.strict:
        return f"policy compact, or window ≥ {least:,} (contextpaw_policy=compact; {_window_setting(kind, least)})"
    if room <= 0:  # the backend's own count against its window: the answer's room is not known
        return f"window > {overflow.required:,} ({_window_setting(kind, None)}) or a shorter request"
    return f"window ≥ {least:,} ({_window_setting(kind, least)}) or a shorter request"


def _window_setting(kind: Kind | None, tokens: int | None) -> str:
    """Where the window is set, on the server the route goes to."""
    n = str(tokens) if tokens is not None else "N"
    if kind is Kind.OLLAMA:
        return f"OLLAMA_CONTEXT_LENGTH={n} or num_ctx"
    if kind is Kind.LLAMACPP:
        return f"llama-server -c {n}"
    return f"OLLAMA_CONTEXT_LENGTH={n} / llama-server -c {n}"


def put_headers(headers: http.Headers, new: Mapping[str, str]) -> None:
    """Set `new` on `headers`, replacing any of the same names, in one rebuild of the fields (one
    `headers[k] = v` each rebuilds them all: most of a small request's header work)."""
    if not new:
        return
    encoded = [(_header_bytes(k), _header_bytes(v)) for k, v in new.items()]
    names = {name.lower() for name, _ in encoded}
    headers.fields = tuple(field for field in headers.fields if field[0].lower() not in names) + tuple(encoded)


def _header_bytes(text: str) -> bytes:
    """As mitmproxy encodes a header name or value given as str."""
    return text.encode("utf-8", "surrogateescape")
