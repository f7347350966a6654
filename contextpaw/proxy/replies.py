"""Answers ContextPaw makes itself, its headers on answers, and what it says about a flow in
mitmweb (its marks)."""

from __future__ import annotations

from collections.abc import Mapping

from mitmproxy import http

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
