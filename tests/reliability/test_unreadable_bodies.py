"""Bodies the engine could not read (issue 39): overflowing requests that went out whole with no
word at all, or came out as invalid JSON.

Each case is sent on every handled route through the addons (the taddons harness, as
`test_bad_input.py` does): a body in another charset than UTF-8 is read by its declared charset; a
field nested deeper than Python's parser goes is said to have gone unjudged, in a header and in the
report; a number Python would not write back as written (`1e400`, an integer of 4,301 digits)
goes to the backend as the client wrote it, in valid JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from mitmproxy import http

from contextpaw import wire

OLLAMA_PORT, LLAMACPP_PORT = 11435, 8091
ROUTES = [
    (port, path)
    for port, paths in (
        (OLLAMA_PORT, ["/api/chat", "/api/generate", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]),
        (LLAMACPP_PORT, ["/v1/chat/completions", "/chat/completions", "/completion", "/v1/completions", "/v1/responses", "/v1/messages"]),
    )
    for path in paths
]
"""Every handled route on both backends."""
IDS = [f"{'ollama' if port == OLLAMA_PORT else 'llamacpp'}{path}" for port, path in ROUTES]
SEED = "__SEED__"
"""Where a case puts its field, written as raw JSON into the body's bytes."""


def conversation(path: str, turns: int = 12) -> list[dict[str, Any]]:
    """A chat far over every window here (about 9,000 tokens), in the route's own message shape."""
    messages = [{"role": "user", "content": "Summarise the log below. Café."}]
    for i in range(turns):
        role = "assistant" if i % 2 == 0 else "user"
        messages.append({"role": role, "content": f"part {i} " + "log line " * 300})
    messages.append({"role": "user", "content": "And now?"})
    if path == "/v1/responses":
        return [
            {
                "type": "message",
                "role": m["role"],
                "content": [{"type": "output_text" if m["role"] == "assistant" else "input_text", "text": m["content"]}],
            }
            for m in messages
        ]
    if path == "/v1/messages":  # Anthropic: user first, roles alternating
        return [m for n, m in enumerate(messages) if n != len(messages) - 2]
    return messages


def overflowing(path: str, field: bytes) -> bytes:
    """An overflowing body for `path` whose `seed` is `field`, as raw JSON bytes."""
    body: dict[str, Any] = {"model": "m", "seed": SEED, "stream": False}
    if path.endswith("/completions") and "chat" not in path or path in ("/completion", "/api/generate"):
        body["prompt"] = "Summarise. Café. " + "log line " * 4000
    elif path == "/v1/responses":
        body["input"] = conversation(path)
    else:
        body["messages"] = conversation(path)
    if path == "/v1/messages":
        body["max_tokens"] = 64
    if path.startswith("/api/"):
        body["options"] = {"num_ctx": 2048}
    return json.dumps(body, ensure_ascii=False).encode().replace(json.dumps(SEED).encode(), field)


@pytest.fixture(scope="module")
def runner(kit: Any) -> Iterator[Any]:
    r = kit.sync_harness()
    yield r
    r.close()


def send(runner: Any, kit: Any, port: int, path: str, raw: bytes, headers: dict[str, str] | None = None) -> tuple[http.HTTPFlow, Any]:
    """One body through the addons: the flow (its request as forwarded) and its state."""
    errors = runner.harness.stats["errors"]
    flow = kit.flow_for(path, raw, port=port, headers=headers)
    runner.send(flow)
    assert flow.response is None, flow.response and flow.response.content[:300]
    assert runner.harness.stats["errors"] == errors, "an internal error"
    return flow, runner.harness.compactor.states.get(flow)


def strict_json(raw: bytes) -> Any:
    """JSON as a strict parser reads it: `Infinity` and `NaN` are not JSON."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(raw, parse_constant=refuse)


def answered(runner: Any, flow: http.HTTPFlow) -> http.Response:
    """The backend's plain answer, as the client gets it through the addons."""
    response = http.Response.make(200, b'{"id":"x","done":true}', {"content-type": "application/json"})
    return runner.answer(flow, response)


@pytest.mark.parametrize(("port", "path"), ROUTES, ids=IDS)
def test_a_body_in_a_declared_charset_is_read_by_it_and_compacted(runner: Any, kit: Any, cases: Any, port: int, path: str) -> None:
    raw = overflowing(path, b"7").decode().encode("iso-8859-1")
    assert b"Caf\xe9" in raw, "a raw byte no UTF-8 decoder accepts"
    flow, state = send(runner, kit, port, path, raw, {"content-type": "application/json; charset=iso-8859-1"})
    cases["bad_input.charset"] += 1
    assert state is not None and state.report is not None and state.report.compacted, state and state.headers
    sent = strict_json(flow.request.raw_content)
    assert "Café" in json.dumps(sent, ensure_ascii=False), "the text as the client meant it"
    assert flow.request.headers["content-type"] == "application/json; charset=utf-8"


@pytest.mark.parametrize(("port", "path"), ROUTES, ids=IDS)
def test_a_field_nested_deeper_than_the_parser_goes_is_said_to_go_unjudged(runner: Any, kit: Any, cases: Any, port: int, path: str) -> None:
    raw = overflowing(path, b"[" * 10_000 + b"]" * 10_000)
    flow, _ = send(runner, kit, port, path, raw)
    cases["bad_input.deep"] += 1
    assert flow.request.raw_content == raw, "it goes as it came"
    response = answered(runner, flow)
    assert "not judged" in response.headers.get("X-ContextPaw-Error", ""), dict(response.headers)
    report = json.loads(response.content)["contextpaw"]
    assert not report["compacted"] and any("not judged" in note for note in report["notes"]), report


@pytest.mark.parametrize(("port", "path"), ROUTES, ids=IDS)
@pytest.mark.parametrize("literal", [b"1e400", b"-1E+400", b"1.50", b"-0"], ids=lambda b: b.decode())
def test_a_number_python_would_not_write_back_goes_as_written(
    runner: Any, kit: Any, cases: Any, port: int, path: str, literal: bytes
) -> None:
    flow, state = send(runner, kit, port, path, overflowing(path, literal))
    cases["bad_input.numbers"] += 1
    assert state is not None and state.report is not None and state.report.compacted, state and state.headers
    sent = flow.request.raw_content
    strict_json(sent)
    assert b'"seed":' + literal + b"," in sent.replace(b'"seed": ', b'"seed":')


@pytest.mark.parametrize(("port", "path"), ROUTES, ids=IDS)
def test_an_integer_of_4301_digits_is_kept_exact_and_the_request_handled(runner: Any, kit: Any, cases: Any, port: int, path: str) -> None:
    digits = b"9" * 4301
    flow, state = send(runner, kit, port, path, overflowing(path, digits))
    cases["bad_input.numbers"] += 1
    assert state is not None and "X-ContextPaw-Error" not in state.headers, state.headers
    assert state.report is not None and state.report.compacted
    sent = flow.request.raw_content
    assert b'"seed":' + digits + b"," in sent
    assert strict_json(sent.replace(digits, b"9")).keys() - {"truncate"} == json.loads(overflowing(path, b"1")).keys()
    response = answered(runner, flow)
    assert json.loads(response.content)["contextpaw"]["compacted"] is True


def test_a_body_read_again_keeps_its_numbers_as_written() -> None:
    """`wire.load` and `wire.write`: what the fitter's `truncate: false` step reads and writes."""
    raw = b'{"a":[1e400,1.50,-0,0.1,7],"b":"x"}'
    assert wire.write(wire.load(raw), truncate=False) == b'{"a":[1e400,1.50,-0,0.1,7],"b":"x","truncate":false}'
