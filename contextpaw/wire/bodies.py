"""HTTP bodies and headers as ContextPaw relays them: the header names more than one part needs,
and compressed request bodies, inflated with a limit on what they inflate to.

A 1.8 MB gzip body can inflate to 400 MB: the limit (`contextpaw_max_body_mb`) is on the inflated
size, enforced while inflating, so a bomb stops at the limit instead of filling memory. Every
encoding mitmproxy decodes is handled: gzip (every member of a multi-member one), zlib, deflate
(with or without its zlib header), br, zstd and bz2. A body that ends before its encoding says it
does is not valid. Pure and blocking: the shell runs it in a worker thread (the decompressors
release the GIL while they work).
"""

from __future__ import annotations

import bz2
import io
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import brotli

try:
    from compression import zstd  # Python 3.14
except ImportError:  # pragma: no cover - mitmproxy depends on the backport below 3.14
    from backports import zstd

JSON_TYPE = "application/json; charset=utf-8"
CONNECTION_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
"""They frame and keep one connection: an answer relayed onto another is framed anew."""
HOP_HEADERS = CONNECTION_HEADERS | {"host", "content-encoding", "accept-encoding"}
"""Not copied onto a retry or its answer: they describe one connection or one encoding."""

STEP = 1 << 20
"""Output produced per step, so the limit is checked every megabyte."""
UPLOAD_IN_CHUNKS = 1 << 20
"""A body ContextPaw sends longer than this goes to its HTTP client as a file (`as_upload`)."""


def as_upload(data: bytes) -> bytes | io.BytesIO:
    """A body for aiohttp to send: a long one as a file, which it writes a chunk at a time. A bytes
    body it writes in one step of the event loop, and over 1 MiB it says so in a ResourceWarning (a
    text of megabytes counted by llama-server's /tokenize, a rescue's retry of a wide window)."""
    return io.BytesIO(data) if len(data) > UPLOAD_IN_CHUNKS else data


ENCODINGS = ("gzip", "x-gzip", "deflate", "deflateraw", "zlib", "br", "zstd", "bz2")
"""The `Content-Encoding`s inflated here (the keys of `_STEPS`): all that mitmproxy decodes."""


class TooLarge(Exception):
    """The body inflates to more than the limit."""


def inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    """`raw` decoded from `encoding` (one of `ENCODINGS`); `TooLarge` past `limit` bytes, ValueError
    when it is not what its encoding says."""
    out = bytearray()
    try:
        for piece in _STEPS[encoding](raw):
            out += piece
            if len(out) > limit:
                raise TooLarge(f"the body inflates to more than {limit:,} bytes")
    except (zlib.error, brotli.error, zstd.ZstdError, EOFError, OSError) as e:
        raise ValueError(f"the body is not valid {encoding}: {e}") from None
    return bytes(out)


def _zlib(raw: bytes, wbits: int, members: bool = False) -> Iterator[bytes]:
    """One zlib stream, or with `members` every gzip member in a row (RFC 1952 allows several)."""
    data = raw
    while True:
        d = zlib.decompressobj(wbits)
        while data and not d.eof:
            yield d.decompress(data, STEP)
            data = d.unconsumed_tail
        if not d.eof:
            raise ValueError("the body ends before its compressed stream does")
        yield d.flush()
        data = d.unused_data
        if not members or not data:
            return


def _gzip(raw: bytes) -> Iterator[bytes]:
    return _zlib(raw, 47, members=True)  # gzip or zlib header, detected


def _deflate(raw: bytes) -> Iterator[bytes]:
    """With its zlib header, or raw (servers send both)."""
    return _zlib(raw, 15 if raw[:1] and (raw[0] & 0x0F) == 8 and int.from_bytes(raw[:2]) % 31 == 0 else -15)


def _brotli(raw: bytes) -> Iterator[bytes]:
    d = brotli.Decompressor()
    piece = d.process(raw, output_buffer_limit=STEP)
    while True:
        yield piece
        if d.is_finished() or (not piece and d.can_accept_more_data()):
            return
        piece = d.process(b"", output_buffer_limit=STEP)


def _frames(raw: bytes, decompressor: Callable[[], Any], name: str) -> Iterator[bytes]:
    """Frame after frame (zstd) or stream after stream (bz2), a new decompressor for each."""
    data = raw
    while data:
        d = decompressor()
        piece = d.decompress(data, STEP)
        while True:
            yield piece
            if d.eof or d.needs_input:
                break
            piece = d.decompress(b"", STEP)
        if not d.eof:
            raise ValueError(f"the {name} body ends inside a frame")
        data = d.unused_data


def _zstd(raw: bytes) -> Iterator[bytes]:
    return _frames(raw, zstd.ZstdDecompressor, "zstd")


def _bz2(raw: bytes) -> Iterator[bytes]:
    return _frames(raw, bz2.BZ2Decompressor, "bz2")


_STEPS: dict[str, Callable[[bytes], Iterator[bytes]]] = {
    "gzip": _gzip,
    "x-gzip": _gzip,
    "deflate": _deflate,
    "deflateraw": _deflate,
    "zlib": lambda raw: _zlib(raw, 15),
    "br": _brotli,
    "zstd": _zstd,
    "bz2": _bz2,
}
