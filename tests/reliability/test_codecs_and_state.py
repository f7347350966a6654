"""Bodies as they came, and state that survives a crash: the probe's N1, N2, N9-N12.

A codec mitmproxy decodes without a limit (bz2, zlib) is inflated here with one, off the event
loop; an encoding nobody can read is refused in the caller's shape (never an uncaught error); a
multi-member gzip is decoded whole; a body that does not decode goes on byte for byte with its
Content-Encoding, and the answer says why; a write killed half-way leaves nothing behind once the
file is taken up again; evicted content is valid UTF-8 whatever it held.
"""

from __future__ import annotations

import bz2
import gzip
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
from mitmproxy.test import tutils

from contextpaw.ops.evicted import encode
from contextpaw.ops.kept import KeptCalibration
from contextpaw.wire import bodies

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
LIMIT = 1 << 20


def test_a_multi_member_gzip_is_inflated_whole() -> None:
    two = gzip.compress(CHAT[:20]) + gzip.compress(CHAT[20:])
    assert bodies.inflate(two, "gzip", LIMIT) == CHAT


@pytest.mark.parametrize(("encoding", "compress"), [("bz2", bz2.compress), ("zlib", zlib.compress)])
def test_the_codecs_mitmproxy_decodes_without_a_limit_are_inflated_with_one(encoding: str, compress: Any) -> None:
    assert bodies.inflate(compress(CHAT), encoding, LIMIT) == CHAT
    bomb = compress(b"\0" * (64 << 20))
    with pytest.raises(bodies.TooLarge):
        bodies.inflate(bomb, encoding, LIMIT)


@pytest.mark.parametrize("encoding", ["gzip", "bz2", "zlib"])
def test_a_truncated_body_does_not_decode(encoding: str) -> None:
    compress = {"gzip": gzip.compress, "bz2": bz2.compress, "zlib": zlib.compress}[encoding]
    with pytest.raises(ValueError):
        bodies.inflate(compress(CHAT * 50)[:-12], encoding, LIMIT)


async def test_an_encoding_nobody_can_read_is_refused_in_the_callers_shape(harness: Any, kit: Any) -> None:
    flow = kit.flow_for("/v1/chat/completions", CHAT, headers={"content-encoding": "rot13"})
    await harness.send(flow)
    assert flow.response is not None and flow.response.status_code == 415
    error = json.loads(flow.response.content)["error"]
    assert "rot13" in error["message"] and error["type"] == "invalid_request_error"


async def test_a_bz2_bomb_is_refused_at_the_limit(harness: Any, kit: Any) -> None:
    harness.tctx.configure(harness.backends, contextpaw_max_body_mb=1)
    flow = kit.flow_for("/api/chat", bz2.compress(b" " * (64 << 20)), headers={"content-encoding": "bz2"})
    await harness.send(flow)
    assert flow.response is not None and flow.response.status_code == 413


async def test_a_body_that_does_not_decode_goes_on_as_it_came_and_the_answer_says_why(harness: Any, kit: Any) -> None:
    broken = gzip.compress(CHAT * 50)[:-12]
    flow = kit.flow_for("/api/chat", broken, headers={"content-encoding": "gzip"})
    await harness.send(flow)
    assert flow.response is None and flow.request.raw_content == broken
    assert flow.request.headers["content-encoding"] == "gzip"
    response = await harness.answer(flow, tutils.tresp(content=b'{"error": "bad gzip"}', headers=[(b"content-type", b"application/json")]))
    assert "not fitted" in response.headers["X-ContextPaw-Error"]


def test_a_write_killed_half_way_leaves_nothing_behind_once_the_file_is_taken_up(tmp_path: Path) -> None:
    kept = tmp_path / "contextpaw-calibration.json"
    for n in range(20):  # what 20 kills between mkstemp and replace leave
        (tmp_path / f"contextpaw-calibration.json{n:08x}.tmp").write_text("{")
    (tmp_path / "other.tmp").write_text("not ours")
    KeptCalibration(kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.tmp"]


def test_evicted_content_is_valid_utf8_whatever_it_held() -> None:
    content = [{"role": "tool", "content": "half an emoji: \ud83d, and after"}]
    data = encode(content)
    assert json.loads(data.decode("utf-8")) == content
