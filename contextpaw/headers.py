"""The header names and values more than one module needs, once (no mitmproxy here)."""

JSON_TYPE = "application/json; charset=utf-8"
CONNECTION_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
"""They frame and keep one connection: an answer relayed onto another is framed anew."""
HOP_HEADERS = CONNECTION_HEADERS | {"host", "content-encoding", "accept-encoding"}
"""Not copied onto a retry or its answer: they describe one connection or one encoding."""
