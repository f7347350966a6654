"""Answers ContextPaw makes itself, and what it says about a flow in mitmweb (its marks)."""

from __future__ import annotations

from mitmproxy import http

from contextpaw.headers import JSON_TYPE

COMPACTED_MARK = ":scissors:"
REFUSED_MARK = ":no_entry:"
TRUNCATED_MARK = ":warning:"
"""mitmweb marks: compacted, refused by ContextPaw (413, 502), cut by the server anyway."""


def reply(flow: http.HTTPFlow, status: int, body: bytes, content_type: str = JSON_TYPE) -> None:
    """Answer the flow here; the backend never sees it."""
    flow.response = http.Response.make(status, body, {"Content-Type": content_type})


def flag(flow: http.HTTPFlow, mark: str, comment: str, replace: bool = False) -> None:
    """Say it in mitmweb: a mark on the flow, and a line in its comment (after any earlier one,
    unless ``replace``: a rescue's report replaces the first compaction's)."""
    flow.marked = mark
    flow.comment = comment if replace or not flow.comment else f"{flow.comment}; {comment}"
