"""mitmweb's `contextpaw` content view: what the client sent against what the backend got.

Shown on compacted requests (the original body is in the flow's metadata); it is a unified diff of
the two bodies, pretty-printed, so evictions and shrinks read as removed lines and markers as added
ones.
"""

from __future__ import annotations

import difflib
import json

from mitmproxy import contentviews, http

ORIGINAL = "contextpaw.original"
"""The flow metadata key under which the addon keeps the request body as the client sent it."""


def _pretty(body: bytes) -> list[str]:
    try:
        return json.dumps(json.loads(body), indent=2, ensure_ascii=False).splitlines()
    except ValueError:
        return body.decode("utf-8", "replace").splitlines()


class ContextPawView(contentviews.Contentview):
    name = "contextpaw"
    syntax_highlight = "none"

    def prettify(self, data: bytes, metadata: contentviews.Metadata) -> str:
        original = metadata.flow.metadata.get(ORIGINAL) if metadata.flow else None
        if original is None:
            raise ValueError("this request was not compacted")
        diff = difflib.unified_diff(
            _pretty(original), _pretty(data), "sent by the client", "sent to the backend", lineterm="", n=2
        )
        return "\n".join(diff)

    def render_priority(self, data: bytes, metadata: contentviews.Metadata) -> float:
        compacted = (
            metadata.flow is not None
            and ORIGINAL in metadata.flow.metadata
            and isinstance(metadata.http_message, http.Request)
        )
        return 2 if compacted else -1
