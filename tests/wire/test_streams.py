"""The report inside buffered bodies and streams, byte for byte around it."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpaw.core.report import Report
from contextpaw.wire import anthropic, llamacpp, ollama, openai, read_json, responses
from contextpaw.wire.streams import StreamReport, Unasked, own_bytes, report_bytes, splice

REPORT = b'{"compacted":true}'

OLLAMA_STREAM = (
    b'{"model":"m","created_at":"t","message":{"role":"assistant","content":"Hel"},"done":false}\n'
    b'{"model":"m","created_at":"t","message":{"role":"assistant","content":"\\u003cb\\u003e"},"done":false}\n'
    b'{"model":"m","created_at":"t","message":{"role":"assistant","content":""},"done":true,"done_reason":"stop"}\n'
)
OPENAI_STREAM = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3}}\n\n'
    b"data: [DONE]\n\n"
)
LLAMA_STREAM = (
    b'data: {"index":0,"content":"Hel","stop":false}\n\n: ping\n\ndata: {"index":0,"content":"","stop":true,"tokens_evaluated":9}\n\n'
)


def records(framing: str, body: bytes) -> list[bytes]:
    separator = b"\n" if framing == "ndjson" else b"\n\n"
    return [r for r in body.split(separator) if r]


def run(transformer: StreamReport, body: bytes, size: int) -> tuple[list[bytes], bytes]:
    pieces: list[bytes] = []
    for i in range(0, len(body), size):
        pieces += transformer(body[i : i + size])
    pieces += transformer(b"")
    return pieces, b"".join(pieces)


@pytest.mark.parametrize(
    ("route", "body", "carrier"),
    [
        (ollama.CHAT, OLLAMA_STREAM, 2),
        (openai.CHAT, OPENAI_STREAM, 3),
        (llamacpp.COMPLETION, LLAMA_STREAM, 2),
    ],
)
@pytest.mark.parametrize("size", [1, 7, 10_000])
def test_report_lands_in_the_final_record_and_nothing_else_changes(route, body: bytes, carrier: int, size: int) -> None:
    pieces, out = run(StreamReport(route.framing, route.is_final, REPORT), body, size)
    assert b"" not in pieces
    got, sent = records(route.framing, out), records(route.framing, body)
    assert len(got) == len(sent)
    for i, (a, b) in enumerate(zip(got, sent, strict=True)):
        if i == carrier:
            payload = a.removeprefix(b"data: ")
            assert json.loads(payload)["contextpaw"] == {"compacted": True}
            assert a.startswith(b.removesuffix(b"}"))
        else:
            assert a == b


def test_token_events_are_not_held_back() -> None:
    transformer = StreamReport("sse", openai.CHAT.is_final, REPORT)
    first = OPENAI_STREAM.split(b"\n\n")[0] + b"\n\n"
    assert transformer(first) == [first]


def test_a_partial_record_waits_for_its_end_without_an_empty_chunk() -> None:
    transformer = StreamReport("ndjson", ollama.CHAT.is_final, REPORT)
    assert transformer(b'{"done":fa') == []
    assert transformer(b"lse}\n") == [b'{"done":false}\n']


def test_a_stream_cut_short_is_passed_on_as_it_is() -> None:
    transformer = StreamReport("sse", openai.CHAT.is_final, REPORT)
    body = OPENAI_STREAM.split(b"\n\n")[0] + b'\n\ndata: {"trunc'
    assert b"".join(transformer(body) + transformer(b"")) == body


def test_mid_stream_errors_pass_through() -> None:
    body = b'{"message":{"content":"a"},"done":false}\n{"error":"runner died"}\n'
    assert StreamReport("ndjson", ollama.CHAT.is_final, REPORT).transform(body) == body


def test_buffered_json_keeps_its_bytes() -> None:
    raw = b'{"a":"\\u003c","b":[1, 2]}\n'
    assert splice(raw, REPORT) == b'{"a":"\\u003c","b":[1, 2],"contextpaw":{"compacted":true}}\n'
    assert splice(b"{}", REPORT) == b'{"contextpaw":{"compacted":true}}'
    assert splice(b"[1]", REPORT) is None
    assert splice(b"404 page not found", REPORT) is None


@given(st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5)), max_size=4))
def test_splice_adds_exactly_the_report(obj: dict) -> None:
    raw = json.dumps(obj).encode()
    assert json.loads(splice(raw, REPORT)) == {**obj, "contextpaw": {"compacted": True}}


def test_a_giant_record_in_many_small_chunks_comes_out_whole_with_the_report_after_it() -> None:
    """A record without a separator for megabytes: each chunk is searched from where the last
    search stopped (the probe's 200 MB record was rescanned on every chunk), and a separator that
    straddles two chunks is still found."""
    giant = b'{"model":"m","message":{"role":"assistant","content":"' + b"x" * (4 << 20) + b'"},"done":false}\n'
    body = giant + OLLAMA_STREAM
    stream = StreamReport("ndjson", ollama.CHAT.is_final, REPORT)
    out = b"".join(piece for i in range(0, len(body), 4093) for piece in stream(body[i : i + 4093])) + b"".join(stream(b""))
    assert out.startswith(giant) and b'"contextpaw":{"compacted":true}' in out
    assert out.replace(b',"contextpaw":{"compacted":true}', b"") == body


def test_a_record_over_the_limit_goes_on_as_it_comes_without_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    from contextpaw.wire import streams

    monkeypatch.setattr(streams, "MAX_RECORD", 1 << 16)
    body = b'{"message":{"content":"' + b"y" * (1 << 18) + b'"},"done":false}\n' + OLLAMA_STREAM
    stream = StreamReport("ndjson", ollama.CHAT.is_final, REPORT)
    out = b"".join(piece for i in range(0, len(body), 8192) for piece in stream(body[i : i + 8192])) + b"".join(stream(b""))
    assert out == body


# -- the usage chunk asked for in the client's stead ------------------------------------------------

LLAMA_CHAT_WITH_USAGE = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hel"}}],"id":"c","object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"id":"c","object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[],"id":"c","object":"chat.completion.chunk","usage":{"prompt_tokens":7},"timings":{"prompt_n":7}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("size", [1, 7, 4096])
def test_a_usage_chunk_the_client_did_not_ask_for_is_read_for_its_count_and_taken_out(size: int) -> None:
    seen: list[tuple[dict, int | None]] = []

    def report(final: dict, counted: int | None) -> bytes:
        seen.append((final, counted))
        return REPORT

    transformer = StreamReport("sse", openai.CHAT.is_final, report, openai.CHAT.evaluated, unasked=Unasked(openai.is_usage_chunk))
    _, out = run(transformer, OPENAI_STREAM, size)
    assert b'"usage"' not in out and transformer.taken == 1
    assert seen == [({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, 3)]
    finish = b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"contextpaw":' + REPORT + b"}\n\n"
    assert out == OPENAI_STREAM.replace(b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3}}\n\n', b"").replace(
        b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n', finish
    )


def test_llama_servers_timings_go_back_onto_the_finish_chunk_where_they_ride_without_usage() -> None:
    transformer = StreamReport(
        "sse", openai.CHAT.is_final, lambda final, counted: None, openai.CHAT.evaluated, unasked=Unasked(openai.is_usage_chunk)
    )
    out = transformer.transform(LLAMA_CHAT_WITH_USAGE)
    assert out == (
        b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hel"}}],"id":"c","object":"chat.completion.chunk"}\n\n'
        b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"id":"c","object":"chat.completion.chunk","timings":{"prompt_n":7}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert transformer.counted == 7


OLLAMA_TEXT_WITH_USAGE = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"choices":[{"text":"\\u003cb","index":0,"finish_reason":null}],"model":"m","system_fingerprint":"fp_ollama","usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}}\n\n'
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"choices":[{"text":"","index":0,"finish_reason":"stop"}],"model":"m","system_fingerprint":"fp_ollama","usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}}\n\n'
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"choices":[],"model":"m","system_fingerprint":"fp_ollama","usage":{"prompt_tokens":2048,"completion_tokens":2,"total_tokens":2050}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("size", [1, 9, 4096])
def test_the_zero_usage_ollama_puts_on_each_text_chunk_once_asked_is_taken_out_and_never_read_as_the_count(size: int) -> None:
    """Asked for usage, Ollama's `/v1/completions` stream puts a zero `usage` on every chunk: the
    client that did not ask gets its chunks without it, the rest of their bytes as they came, and
    the verdict reads the usage chunk's count, not the zeros."""
    seen: list[tuple[dict, int | None]] = []

    def report(final: dict, counted: int | None) -> bytes:
        seen.append((final, counted))
        return REPORT

    transformer = StreamReport(
        "sse", openai.COMPLETIONS.is_final, report, openai.COMPLETIONS.evaluated, unasked=Unasked(openai.is_usage_chunk, "usage")
    )
    _, out = run(transformer, OLLAMA_TEXT_WITH_USAGE, size)
    zero = b',"usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}'
    first, finish, _, done = OLLAMA_TEXT_WITH_USAGE.split(b"\n\n")[:4]
    assert (
        out == first.replace(zero, b"") + b"\n\n" + finish.replace(zero, b"")[:-1] + b',"contextpaw":' + REPORT + b"}\n\n" + done + b"\n\n"
    )
    assert seen[0][1] == 2048 and openai.COMPLETIONS.evaluated(seen[0][0]) is None and transformer.taken == 1


def test_a_client_that_asked_for_usage_keeps_its_chunk_and_the_report_goes_into_it() -> None:
    transformer = StreamReport("sse", openai.CHAT.is_final, REPORT, openai.CHAT.evaluated)
    out = transformer.transform(OPENAI_STREAM)
    assert b'"choices":[],"usage":{"prompt_tokens":3},"contextpaw":{"compacted":true}}' in out and transformer.taken == 0


def test_asking_for_usage_adds_the_option_and_leaves_every_other_byte() -> None:
    raw = b'{"model": "m",  "stream": true, "messages": [{"role": "user", "content": "\\u003c 1e400"}]}'
    asked = openai.asking_usage(raw, {})
    assert (
        asked
        == b'{"stream_options":{"include_usage":true},"model": "m",  "stream": true, "messages": [{"role": "user", "content": "\\u003c 1e400"}]}'
    )
    beside = openai.asking_usage(b'{"stream":true,"stream_options":{"x":1}}', {"stream_options": {"x": 1}})
    assert json.loads(beside)["stream_options"] == {"x": 1, "include_usage": True}
    assert openai.usage_asked({"stream_options": {"include_usage": True}}) and not openai.usage_asked({"stream_options": None})


def test_asking_for_usage_beside_the_clients_own_options_keeps_its_numbers_as_written() -> None:
    """The body is written again there: a `1e400` stays `1e400` (not `Infinity`, which is not JSON)."""
    raw = b'{"stream":true,"stream_options":{"x":1.50},"seed":1e400,"n":-0}'
    asked = openai.asking_usage(raw, {"stream_options": {"x": 1.5}})
    assert asked == b'{"stream":true,"stream_options":{"x":1.50,"include_usage":true},"seed":1e400,"n":-0}'


# -- records passed on unparsed --------------------------------------------------------------------

TELLING_ROUTES = [
    ollama.CHAT,
    ollama.GENERATE,
    openai.CHAT,
    openai.COMPLETIONS,
    llamacpp.COMPLETION,
    anthropic.MESSAGES,
    responses.RESPONSES,
]
KEYS = st.sampled_from(
    ["choices", "finish_reason", "usage", "prompt_tokens", "prompt_eval_count", "tokens_evaluated", "done", "stop", "type",
     "message", "response", "input_tokens", "cache_read_input_tokens", "delta", "content", "timings"]
) | st.text(max_size=6)  # fmt: skip
WORDS = st.sampled_from(["message_delta", "message_start", "response.completed", "response.failed", "stop", "done"]) | st.text(max_size=8)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**6) | WORDS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=10,
)


@st.composite
def stream_bodies(draw: st.DrawFn, framing: str) -> bytes:
    """Records of any shape the route's words may appear in, spaced and escaped as servers differ."""
    body = b""
    for obj in draw(st.lists(st.dictionaries(KEYS, JSON, max_size=5), max_size=8)):
        spaced, ascii_only = draw(st.booleans()), draw(st.booleans())
        text = json.dumps(obj, separators=(", ", ": ") if spaced else (",", ":"), ensure_ascii=ascii_only).encode()
        if framing == "ndjson":
            body += text + b"\n"
        else:
            body += (b"event: x\n" if draw(st.booleans()) else b"") + b"data: " + text + b"\n\n"
    return body + (b"data: [DONE]\n\n" if framing == "sse" and draw(st.booleans()) else b"")


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_a_record_passed_on_unparsed_never_changes_what_the_client_gets(data: st.DataObject) -> None:
    """Against the same stream with every record parsed: the same bytes out, the same count read."""
    route = data.draw(st.sampled_from(TELLING_ROUTES))
    body = data.draw(stream_bodies(route.framing))
    unasked = Unasked(openai.is_usage_chunk, "usage") if route in (openai.CHAT, openai.COMPLETIONS) and data.draw(st.booleans()) else None

    def transformed(telling: re.Pattern[bytes] | None) -> tuple[bytes, int | None, int]:
        stream = StreamReport(
            route.framing, route.is_final, lambda _final, counted: json.dumps({"counted": counted}).encode(), route.evaluated,
            unasked=unasked, telling=telling,
        )  # fmt: skip
        return stream.transform(body), stream.counted, stream.taken

    assert transformed(route.telling) == transformed(None)


class Counting(StreamReport):
    parsed = 0

    def _object(self, record: bytes):  # type: ignore[no-untyped-def]
        self.parsed += 1
        return super()._object(record)


@pytest.mark.parametrize(
    ("route", "token", "ends"),
    [
        (openai.CHAT, OPENAI_STREAM.split(b"\n\n")[1] + b"\n\n", OPENAI_STREAM.split(b"\n\n", 2)[2]),  # finish, usage, [DONE]
        (ollama.CHAT, OLLAMA_STREAM.splitlines(keepends=True)[0], OLLAMA_STREAM.splitlines(keepends=True)[2]),
        (llamacpp.COMPLETION, LLAMA_STREAM.split(b"\n\n")[0] + b"\n\n", LLAMA_STREAM.split(b"\n\n", 1)[1]),  # a comment, the stop
    ],
)
def test_token_records_are_passed_on_unparsed_and_the_report_still_lands(route, token: bytes, ends: bytes) -> None:
    stream = Counting(route.framing, route.is_final, REPORT, route.evaluated, telling=route.telling)
    out = stream.transform(token * 200 + ends)
    assert stream.parsed <= 2, "only the final records are read"
    assert out.startswith(token * 200) and b'"contextpaw":{"compacted":true}' in out[len(token) * 200 :]


# -- the report written, the answer read: orjson where it gives json's result -------------------

_TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
_NUMBERS = st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
_JSON = st.recursive(
    st.none() | st.booleans() | _NUMBERS | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(value=_JSON, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]))
def test_an_answer_is_read_as_json_reads_it(value: object, ascii_only: bool, indent: int | None) -> None:
    data = json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode()
    assert read_json(data) == json.loads(data)


@pytest.mark.parametrize(
    "data", [b"NaN", b'{"n": -Infinity}', b"1e400", b'\xef\xbb\xbf{"a": 1}', '{"a": 1}'.encode("utf-16"), b'"\\ud800"']
)
def test_what_orjson_refuses_is_read_by_json(data: bytes) -> None:
    assert repr(read_json(data)) == repr(json.loads(data))


@pytest.mark.parametrize("data", [b"", b"{", b'{"a": 1,}', b"[1] x", b"\xff"])
def test_what_is_not_json_is_a_value_error_as_jsons(data: bytes) -> None:
    with pytest.raises(ValueError):
        read_json(data)


def test_the_report_is_written_as_report_bytes_writes_it_and_what_orjson_refuses_goes_that_way() -> None:
    report = Report(True, "evict", 9000, 1900, 2000, counter="tokenizer", exact=True, window=2048, headroom=0.25,
                    markers=("cp-1",), notes=("kept the task: h\u00e9llo \u2028 \"quoted\" \\\\ \x01",))  # fmt: skip
    value = report.to_json()
    assert own_bytes(value) == report_bytes(value)
    odd = {**value, "notes": ["a lone \ud800 surrogate"]}
    assert own_bytes(odd) == report_bytes(odd)
