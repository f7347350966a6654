"""One serialization for what is hashed: a message's digest, an evicted payload's id. Pure.

The same content must give the same bytes on every turn and after a restart, and the bytes are read
by nothing but a hash, so they need not be the client's own. orjson writes them in a tenth of the
time `json.dumps` takes (a 4 MB chat was hashed in about 0.1 s of held interpreter lock per request
with `json`); what orjson refuses (a lone surrogate, an integer past 64 bits) goes through `json`,
the same way every time for the same content.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS


def canonical(value: Any) -> bytes:
    """`value` as sorted-key JSON bytes; a number kept as written (`literal`) as its literal, anything
    else not JSON as its `str`."""
    try:
        return orjson.dumps(value, option=_OPTIONS, default=_other)
    except TypeError:  # orjson.JSONEncodeError is one
        return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass")


def _other(value: Any) -> str:
    literal = getattr(value, "literal", None)
    return "\x00number:" + literal if isinstance(literal, str) else str(value)
