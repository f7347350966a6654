"""The report inside response bodies: buffered JSON, NDJSON streams and SSE streams.

The report is spliced into the bytes the backend sent, just before the object's closing brace, so
everything else reaches the client byte for byte (Go's `\\u003c` escapes, key order, spacing).

Streams are passed through record by record as they arrive. In NDJSON the report joins the
`done: true` object, which is always last. In SSE the final-looking event (OpenAI's finish or usage
chunk, Anthropic's `message_delta`) is held back until the next event shows whether another
final-looking one follows: the report goes into the last of them. Token events are never held, so
the client's first token is not delayed. The prompt size a server reports early in a stream
(Anthropic's `message_start`) is remembered for the final record's check. A record the client did
not ask for (the usage chunk ContextPaw asked for in its stead: `Unasked`) is read for its count and
taken out, and what it carried that the client would have had without it (llama-server's `timings`)
goes onto the record before it; a field it did not ask for (the zero `usage` Ollama then puts on
every text-completion chunk) is taken out of each record that has it, its other bytes as they came,
so that the client gets the stream it asked for. A record whose bytes cannot tell anything (none of
the route's `telling` words, no escaped ASCII character, not the unasked field) is passed on
unparsed: a token record, nearly every record of a stream. The transformer is a
mitmproxy stream callable: called per chunk and once with b"" at the end, it never returns b"" before
that (an empty chunk would end a chunked body). A chunk is scanned for the record separator from
where the last scan stopped, so a giant record costs its length once, not once per chunk; one past
`MAX_RECORD` bytes is passed on as it comes, and the stream carries no report after it (said in the
log).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from contextpaw.core import logs
from contextpaw.wire.base import ESCAPED_ASCII

logger = logs.get(__name__)

REPORT_KEY = b"contextpaw"
MAX_RECORD = 64 << 20
"""A stream record longer than this is not held back to be read: it and the rest go on as they come."""
KEPT_STREAM = 16 << 20
"""A stream up to this long is kept whole as it went to the client, for mitmweb and saved flows
(mitmproxy keeps no streamed body); a longer one is not kept."""
DONE = b"data: [DONE]"
STREAM_TYPES = ("text/event-stream", "application/x-ndjson")
DECODER = json.JSONDecoder()


def report_bytes(report: Mapping[str, Any]) -> bytes:
    return json.dumps(report, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


def own_bytes(value: Mapping[str, Any]) -> bytes:
    """What ContextPaw writes of its own (a report, an error of its own: numbers, text, flags, never
    a NaN), by orjson in a tenth of `report_bytes`' time and in its spelling (a small float aside:
    0.00001, not 1e-05); `report_bytes` takes what orjson refuses (a lone surrogate in a model's
    name). It runs for every handled answer."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is one
        return report_bytes(value)


def record_bytes(framing: Literal["ndjson", "sse"], value: Mapping[str, Any]) -> bytes:
    """One record of a stream in its framing: an NDJSON line or an SSE `data:` event, named after
    the object's `type` where it has one (Anthropic's streams name every event)."""
    line = report_bytes(value)
    if framing == "ndjson":
        return line + b"\n"
    kind = value.get("type")
    named = b"event: " + str(kind).encode() + b"\n" if isinstance(kind, str) and kind.isidentifier() else b""
    return named + b"data: " + line + b"\n\n"


def splice(obj: bytes, value: bytes, key: bytes = REPORT_KEY) -> bytes | None:
    """`obj` (the bytes of one JSON object) with `"key": value` added last; None if not an object."""
    body = obj.rstrip()
    if not body.lstrip().startswith(b"{") or not body.endswith(b"}"):
        return None
    head = body[:-1].rstrip()
    comma = b"" if head.lstrip() == b"{" else b","
    return head + comma + b'"' + key + b'":' + value + b"}" + obj[len(body) :]


Amend = Callable[[Mapping[str, Any], int | None], bytes | None]
"""(the final record, the prompt size an earlier record reported) -> the report to put into it, or
None to add nothing (what the server says, e.g. the count it evaluated, can change the report)."""
Count = Callable[[Mapping[str, Any]], int | None]


@dataclass(frozen=True, slots=True)
class Unasked:
    """What a stream carries that its client did not ask for."""

    record: Callable[[Mapping[str, Any]], bool]
    """Records taken out whole, once read for their count."""
    key: str | None = None
    """A field taken out of every other record that has it."""


class StreamReport:
    """A stream callable that passes records through and puts the report into the final one."""

    def __init__(
        self,
        framing: Literal["ndjson", "sse"],
        is_final: Callable[[Mapping[str, Any]], bool],
        report: bytes | Amend,
        count: Count | None = None,
        keep: int = 0,
        unasked: Unasked | None = None,
        telling: re.Pattern[bytes] | None = None,
        retold: Callable[[], Mapping[str, Any] | None] | None = None,
    ) -> None:
        self._retold = retold
        """After the report is made for the final record: that record as the client is to read it
        (its prompt size told whole), or None to keep its bytes."""
        self._separator = b"\n" if framing == "ndjson" else b"\n\n"
        self._sse = framing == "sse"
        self._is_final = is_final
        self._report = report
        self._pending = bytearray()
        self._scanned = 0
        """How much of `_pending` holds no separator start (it is not searched again)."""
        self._held: bytes | None = None
        self._placed = False
        self._count = count
        self.counted: int | None = None
        """The last prompt size a record before the final one reported."""
        self._keep = keep
        self.kept: bytearray | None = bytearray() if keep else None
        """What went on so far, while it is at most `keep` bytes (None: not kept)."""
        self._unasked = unasked
        """Records the client did not ask for: read for their count, then taken out."""
        self.taken = 0
        """How many records were taken out."""
        self._telling = telling
        """What a record that tells something holds (`wire.Route.telling`); None: every record is read."""
        self._unasked_key = b'"' + unasked.key.encode() + b'"' if unasked is not None and unasked.key else None

    def __call__(self, data: bytes) -> list[bytes]:
        out = self._passed(data)
        if self.kept is not None:
            for piece in out:
                self.kept += piece
            if len(self.kept) > self._keep:
                self.kept = None
        return out

    def _passed(self, data: bytes) -> list[bytes]:
        if not data:
            return self._joined(self._finish())
        if self._placed and not self._pending:
            return [data]
        self._pending += data
        if self._pending.find(self._separator, self._scanned) == -1:
            self._scanned = max(len(self._pending) - len(self._separator) + 1, 0)
            if len(self._pending) <= MAX_RECORD:
                return []
            logger.warning("a stream record over %d bytes: passed on as it comes, without the report", MAX_RECORD)
            out, self._placed = self._finish(), True
            return self._joined(out)
        *records, rest = bytes(self._pending).split(self._separator)
        self._pending, self._scanned = bytearray(rest), 0
        out = []
        for record in records:
            out += self._record(record + self._separator)
        return self._joined(out)

    def transform(self, body: bytes) -> bytes:
        """The whole of a buffered stream, transformed at once (a retried request's answer)."""
        return b"".join(self(body) + self(b""))

    @staticmethod
    def _joined(pieces: list[bytes]) -> list[bytes]:
        data = b"".join(pieces)
        return [data] if data else []

    def _record(self, record: bytes) -> list[bytes]:
        if self._placed:
            return [record]
        obj = self._object(record) if self._tells(record) else None
        if obj is not None and self._unasked is not None:
            if self._unasked.record(obj):
                self._take(obj)
                return []
            if self._unasked.key in obj:
                record, obj = self._without(record, obj, self._unasked.key)
        final = self._final(obj)
        out: list[bytes] = []
        if self._held is not None:
            held, self._held = self._held, None
            if not final:  # `[DONE]`, `message_stop` or a token: the held one was the last final
                return [self._merge(held), record]
            out.append(held)
        if final:
            if self._sse:
                self._held = record
                return out
            return [*out, self._merge(record)]
        return [*out, record]

    def _tells(self, record: bytes) -> bool:
        """Whether the record may be final, carry a count, or hold what the client did not ask for."""
        if self._telling is None or ESCAPED_ASCII.search(record):
            return True
        return self._telling.search(record) is not None or (self._unasked_key is not None and self._unasked_key in record)

    def _take(self, obj: Mapping[str, Any]) -> None:
        """Take out a record the client did not ask for: its count is read, and the fields the
        record before it would have carried without it (llama-server puts `timings` on the last
        event) go there."""
        self.taken += 1
        if self._count is not None and (counted := self._count(obj)) is not None:
            self.counted = counted
        timings = obj.get("timings")
        if timings is None or self._held is None or (span := self._span(self._held)) is None:
            return
        start, end = span
        try:
            held = json.loads(self._held[start:end])
        except ValueError:
            return
        if isinstance(held, dict) and "timings" not in held:
            merged = splice(self._held[start:end], report_bytes(timings), b"timings")
            if merged is not None:
                self._held = self._held[:start] + merged + self._held[end:]

    def _without(self, record: bytes, obj: dict[str, Any], key: str) -> tuple[bytes, dict[str, Any]]:
        """The record without `key`, every other byte as it came (as it was, when no cut of its
        bytes reads as the object without it)."""
        span = self._span(record)
        assert span is not None, "only a record with a JSON payload has keys"
        start, end = span
        text, kept = record[start:end].decode(), {k: v for k, v in obj.items() if k != key}
        name, at = json.dumps(key), -1
        while (at := text.find(name, at + 1)) != -1:
            colon = len(text) - len(text[at + len(name) :].lstrip())
            if text[colon : colon + 1] != ":":
                continue
            value = len(text) - len(text[colon + 1 :].lstrip())
            try:
                _, after = DECODER.raw_decode(text, value)
            except ValueError:
                continue
            before = text.rfind(",", 0, at)
            following = len(text) - len(text[after:].lstrip())
            for cut in (text[:before] + text[after:], text[:at] + text[following + 1 :]):
                try:
                    if json.loads(cut) == kept:
                        return record[:start] + cut.encode() + record[end:], kept
                except ValueError:
                    pass
        return record, obj

    def _finish(self) -> list[bytes]:
        out = [self._merge(self._held)] if self._held is not None else []
        self._held = None
        rest, self._pending, self._scanned = bytes(self._pending), bytearray(), 0
        return out + ([rest] if rest else [])

    def _span(self, record: bytes) -> tuple[int, int] | None:
        """Where the JSON payload of a record lies: the whole NDJSON line, or an SSE `data:` line."""
        if not self._sse:
            return 0, len(record)
        if record.startswith(b"data:"):
            start = 0
        elif (found := record.find(b"\ndata:")) != -1:
            start = found + 1
        else:
            return None
        end = record.find(b"\n", start)
        return start + len(b"data:"), end if end != -1 else len(record)

    def _object(self, record: bytes) -> dict[str, Any] | None:
        """The JSON object a record carries, or None."""
        span = self._span(record)
        if span is None:
            return None
        try:
            obj = json.loads(record[span[0] : span[1]])
        except ValueError:
            return None
        return obj if isinstance(obj, dict) else None

    def _final(self, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        if self._is_final(obj):
            return True
        if self._count is not None and (counted := self._count(obj)) is not None:
            self.counted = counted
        return False

    def _merge(self, record: bytes) -> bytes:
        span = self._span(record)
        assert span is not None, "only records with a JSON payload are merged"
        start, end = span
        report = self._report
        if callable(report):
            try:
                said = report(json.loads(record[start:end]), self.counted)
            except ValueError:
                return record
            if said is None:  # only watched, nothing to add (policy off)
                return record
            report = said
        retold = self._retold() if self._retold is not None else None
        merged = splice(own_bytes(retold) if retold is not None else record[start:end], report)
        if merged is None:
            return record
        self._placed = True
        return record[:start] + merged + record[end:]
