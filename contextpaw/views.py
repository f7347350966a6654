"""mitmweb's `contextpaw` content view: what the client sent against what the backend got, and
what ContextPaw reported.

On a compacted request (the original body is in the flow's metadata) it is a unified diff of the
two bodies, pretty-printed, so evictions and shrinks read as removed lines and markers as added
ones. On the response of a flow ContextPaw reported on (compacted, refused, or cut by the server)
it is that report.
"""

from __future__ import annotations

import difflib
import json

from mitmproxy import contentviews, http

ORIGINAL = "contextpaw.original"
"""The flow metadata key under which the addon keeps the request body as the client sent it."""
REPORT = "contextpaw.report"
"""The flow metadata key of the report as the client sees it."""


def _pretty(body: bytes) -> list[str]:
    try:
        return json.dumps(json.loads(body), indent=2, ensure_ascii=False).splitlines()
    except ValueError:
        return body.decode("utf-8", "replace").splitlines()


class ContextPawView(contentviews.Contentview):
    name = "contextpaw"
    syntax_highlight = "none"

    def prettify(self, data: bytes, metadata: contentviews.Metadata) -> str:
        if isinstance(metadata.http_message, http.Response):
            report = metadata.flow.metadata.get(REPORT) if metadata.flow else None
            if report is None:
                raise ValueError("ContextPaw made no report on this flow")
            return json.dumps(report, indent=2, ensure_ascii=False)
        original = metadata.flow.metadata.get(ORIGINAL) if metadata.flow else None
        if original is None:
            raise ValueError("this request was not compacted")
        diff = difflib.unified_diff(
            _pretty(original), _pretty(data), "sent by the client", "sent to the backend", lineterm="", n=2
        )
        return "\n".join(diff)

    def render_priority(self, data: bytes, metadata: contentviews.Metadata) -> float:
        kept = metadata.flow.metadata if metadata.flow is not None else {}
        if isinstance(metadata.http_message, http.Request):
            return 2 if ORIGINAL in kept else -1
        return 2 if isinstance(metadata.http_message, http.Response) and REPORT in kept else -1
