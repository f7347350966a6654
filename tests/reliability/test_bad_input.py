"""Bad input: the proxy never answers with an error of its own making.

What it cannot understand it forwards byte for byte (the backend answers); what it compacts still
parses and keeps every key besides `messages`/`prompt`, in the body's own content encoding. Driven
through the addons with taddons (property-based with hypothesis, plus named cases), and a few
through a real mitmdump in front of the fakes, one of them a ~100 MB body.
"""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.net import encoding

from contextpaw import wire
from contextpaw.proxy.views import ORIGINAL
from contextpaw.wire import bodies

OLLAMA_PORT, LLAMACPP_PORT = 11435, 8091
ROUTES = [
    (OLLAMA_PORT, "/api/chat"),
    (OLLAMA_PORT, "/api/generate"),
    (OLLAMA_PORT, "/v1/chat/completions"),
    (OLLAMA_PORT, "/v1/completions"),
    (LLAMACPP_PORT, "/v1/chat/completions"),
    (LLAMACPP_PORT, "/chat/completions"),
    (LLAMACPP_PORT, "/completion"),
    (LLAMACPP_PORT, "/v1/completions"),
]
CHAT_ROUTES = [r for r in ROUTES if "chat" in r[1]]
PROMPT_ROUTES = [r for r in ROUTES if "chat" not in r[1]]
ENCODINGS = ["identity", "gzip", "deflate", "br", "zstd"]
OUTCOMES: collections.Counter[str] = collections.Counter()
ADDED = {"truncate"}
"""Keys a compacted body may gain or change: Ollama's `truncate: false` (the proxy already made it fit)."""


def big_text(words: int = 400) -> str:
    return "log line " * words


def long_chat(turns: int = 12, **extra: Any) -> dict[str, Any]:
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Summarise."}]
    for i in range(turns):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": f"part {i} " + big_text(300)})
    messages.append({"role": "user", "content": "And now?"})
    return {"model": "m", "messages": messages, "options": {"num_ctx": 2048}, "stream": False, **extra}


def encoded(raw: bytes, name: str) -> tuple[bytes, dict[str, str]]:
    if name == "identity":
        return raw, {}
    return encoding.encode(raw, name), {"content-encoding": name}


def check(runner: Any, kit: Any, port: int, path: str, raw: bytes, headers: dict[str, str] | None = None) -> str:
    """Send one body through the addons and check the invariant; returns the outcome's name."""
    h = runner.harness
    before = dict(h.stats)
    flow = kit.flow_for(path, raw, port=port, headers=headers)
    runner.send(flow)
    state = h.compactor.states.get(flow)
    said = state.headers if state is not None else {}
    assert h.stats["errors"] == before["errors"], f"internal error on {raw[:200]!r}: {said}"
    assert "X-ContextPaw-Error" not in said
    if flow.response is not None and flow.response.status_code == 415:
        # an encoding nobody can read: refused in the caller's shape, never decoded on the loop
        assert (headers or {}).get("content-encoding", "").lower() not in ("", "identity", *bodies.ENCODINGS)
        assert "error" in json.loads(flow.response.content)
        return "refused"
    if flow.response is not None:
        # The only answer of its own allowed under the compact policy: a refusal for a request whose
        # pinned part alone exceeds the window, in the API's own shape and status (not an error).
        route = wire.route_for(wire.Kind.OLLAMA, "POST", path) or wire.route_for(wire.Kind.LLAMACPP, "POST", path)
        assert route is not None and flow.response.status_code == wire.REFUSAL_STATUS, flow.response.content[:300]
        assert "error" in json.loads(flow.response.content)
        return "refused"
    if flow.request.raw_content == raw:
        return "forwarded"
    claimed = (headers or {}).get("content-encoding")
    if claimed in ENCODINGS:  # a compressed model request is inflated once, and carried decoded
        assert "content-encoding" not in flow.request.headers
        if flow.request.raw_content == encoding.decode(raw, claimed):
            return "forwarded"
    # Compacted: valid JSON, the same keys, only messages/prompt changed.
    original = json.loads(flow.metadata[ORIGINAL])
    sent = json.loads(flow.request.raw_content)
    assert isinstance(sent, dict) and sent.keys() - ADDED == original.keys() - ADDED
    for key in original.keys() - {"messages", "prompt"} - ADDED:
        assert sent[key] == original[key], key
    if "chat" in path:
        assert isinstance(sent["messages"], list) and all(isinstance(m, dict) for m in sent["messages"])
    else:
        assert isinstance(sent["prompt"], str)
    return "compacted"


@pytest.fixture(scope="module")
def runner(kit: Any) -> Any:
    r = kit.sync_harness()
    yield r
    r.close()


# -- hypothesis -------------------------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)  # fmt: skip
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
texts = st.one_of(st.text(max_size=50), st.just(""), st.just(big_text(2000)), st.just("é\u2028😀\x00" * 200))
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": st.just("data:image/png;base64,AAAA")})}),
    st.fixed_dictionaries({"type": st.text(max_size=10), "data": json_values}),
    json_values,
)  # fmt: skip
contents = st.one_of(texts, st.lists(parts, max_size=4), json_values)
roles = st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "wizard", ""]), json_values)
messages = st.one_of(
    st.fixed_dictionaries(
        {"role": roles, "content": contents},
        optional={
            "images": st.one_of(st.lists(st.just("AAAA"), max_size=2), json_values),
            "tool_calls": st.one_of(
                st.lists(st.fixed_dictionaries({"id": json_values, "function": st.fixed_dictionaries({"name": st.text(max_size=8), "arguments": json_values})}), max_size=2),
                json_values,
            ),
            "tool_call_id": json_values,
            "thinking": json_values,
            "name": json_values,
        },
    ),
    json_values,
)  # fmt: skip
options = st.one_of(
    st.fixed_dictionaries({}, optional={"num_ctx": st.one_of(st.integers(-10, 100_000), json_values), "num_predict": st.one_of(st.integers(-2, 5000), json_values)}),
    json_values,
)  # fmt: skip
chat_bodies = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(messages, max_size=12), json_values)},
    optional={
        "model": json_values, "options": options, "stream": json_values, "max_tokens": json_values,
        "tools": json_values, "unknown_field": json_values,
    },
)  # fmt: skip
prompt_bodies = st.fixed_dictionaries(
    {"prompt": st.one_of(texts, st.lists(st.text(max_size=10), max_size=3), json_values)},
    optional={"model": json_values, "options": options, "system": json_values, "suffix": json_values,
              "images": json_values, "n_predict": json_values, "max_tokens": json_values, "stream": json_values},
)  # fmt: skip
documents = st.one_of(chat_bodies, prompt_bodies, json_values)


def dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()


raw_bodies = st.one_of(
    documents.map(dumps),
    st.binary(max_size=200),
    documents.map(dumps).flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),  # truncated JSON
    documents.map(lambda d: json.dumps(d).encode("utf-16")),
)


def test_any_body_on_any_route_is_forwarded_or_validly_compacted(runner: Any, kit: Any, cases: Any) -> None:
    @given(route=st.sampled_from(ROUTES), raw=raw_bodies, enc=st.sampled_from(ENCODINGS))
    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(route: tuple[int, str], raw: bytes, enc: str) -> None:
        body, headers = encoded(raw, enc)
        OUTCOMES[check(runner, kit, *route, body, headers)] += 1
        cases["bad_input.hypothesis.request"] += 1

    run()
    print("outcomes:", dict(OUTCOMES))


def test_overflowing_chats_with_odd_fields_are_compacted_validly(runner: Any, kit: Any, cases: Any) -> None:
    """Overflowing chats whose other fields are anything: compaction keeps them all as they were."""
    seen: collections.Counter[str] = collections.Counter()

    @given(
        route=st.sampled_from(CHAT_ROUTES),
        extra=st.dictionaries(st.text(max_size=6).filter(lambda k: k != "messages"), json_values, max_size=5),
        odd=st.lists(messages, max_size=3),
        enc=st.sampled_from(ENCODINGS),
    )
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(route: tuple[int, str], extra: dict[str, Any], odd: list[Any], enc: str) -> None:
        body = {**long_chat(), **extra}
        body["messages"][2:2] = odd
        raw, headers = encoded(dumps(body), enc)
        seen[check(runner, kit, *route, raw, headers)] += 1
        cases["bad_input.hypothesis.overflowing"] += 1

    run()
    print("outcomes:", dict(seen))
    assert seen["compacted"] > 0


RESPONSE_TYPES = ["application/json", "application/x-ndjson", "text/event-stream", "text/plain", "text/event-stream; charset=utf-8"]


def test_any_backend_answer_reaches_the_client_whole(runner: Any, kit: Any, cases: Any) -> None:
    """Whatever the backend answers to a handled request, every byte of it reaches the client."""

    @given(
        route=st.sampled_from(ROUTES), status=st.sampled_from([200, 400, 404, 500, 503]),
        ctype=st.sampled_from(RESPONSE_TYPES),
        body=st.one_of(st.binary(max_size=300), json_values.map(dumps), st.lists(json_values.map(dumps), max_size=5).map(b"\n".join),
                       st.lists(json_values.map(lambda v: b"data: " + dumps(v)), max_size=5).map(b"\n\n".join)),
        cut=st.integers(1, 50),
    )  # fmt: skip
    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(route: tuple[int, str], status: int, ctype: str, body: bytes, cut: int) -> None:
        h = runner.harness
        errors = h.stats["errors"]
        flow = kit.flow_for(route[1], dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}), port=route[0])
        runner.send(flow)
        response = http.Response.make(status, body, {"Content-Type": ctype})
        out = runner.answer(flow, response)
        if callable(out.stream):
            chunks = [body[i : i + cut] for i in range(0, len(body), cut)]
            data = b"".join(b"".join(out.stream(c)) for c in chunks) + b"".join(out.stream(b""))
        else:
            data = out.content or b""
        it = iter(data)
        assert all(b in it for b in body), "bytes of the backend's answer were lost"
        assert h.stats["errors"] == errors
        cases["bad_input.hypothesis.response"] += 1

    run()


# -- named cases ------------------------------------------------------------------------------------

NAMED: dict[str, tuple[list[tuple[int, str]], bytes, dict[str, str]]] = {}


def named(name: str, raw: bytes, routes: list[tuple[int, str]] = ROUTES, headers: dict[str, str] | None = None) -> None:
    NAMED[name] = (routes, raw, headers or {})


named("empty body", b"")
named("malformed JSON", b'{"model": "m", "messages": [')
named("JSON array", b'[{"role": "user", "content": "hi"}]')
named("JSON string", b'"hello"')
named("JSON number", b"42")
named("no messages and a negative num_ctx (found by hypothesis)", b'{"":"","options":{"num_ctx":-1}}')
named("JSON null", b"null")
named("messages null", b'{"model": "m", "messages": null}', CHAT_ROUTES)
named("messages a string", b'{"model": "m", "messages": "hi"}', CHAT_ROUTES)
named("messages an object", b'{"model": "m", "messages": {"role": "user"}}', CHAT_ROUTES)
named("messages missing", b'{"model": "m"}')
named("num_ctx a string", dumps(long_chat(options={"num_ctx": "4096"})), CHAT_ROUTES)
named("num_ctx negative", dumps(long_chat(options={"num_ctx": -1})), CHAT_ROUTES)
named("num_ctx a float", dumps(long_chat(options={"num_ctx": 2048.5})), CHAT_ROUTES)
named("num_ctx huge", dumps(long_chat(options={"num_ctx": 10**30})), CHAT_ROUTES)
named("options a list", dumps(long_chat(options=[1, 2])), CHAT_ROUTES)
named("max_tokens a string", dumps(long_chat(max_tokens="16")), CHAT_ROUTES)
named("model a number", dumps(long_chat(model=7)), CHAT_ROUTES)
named("content a number", b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', CHAT_ROUTES)
named("content null", b'{"model": "m", "messages": [{"role": "assistant", "content": null}]}', CHAT_ROUTES)
named("role missing", b'{"model": "m", "messages": [{"content": "hi"}]}', CHAT_ROUTES)
named("role a number", b'{"model": "m", "messages": [{"role": 1, "content": "hi"}]}', CHAT_ROUTES)
named(
    "unknown role",
    dumps({"model": "m", "messages": [{"role": "wizard", "content": big_text(3000)}, {"role": "user", "content": "hi"}]}),
    CHAT_ROUTES,
)
named("message a string", b'{"model": "m", "messages": ["hi", "there"]}', CHAT_ROUTES)
named(
    "content parts with images and unknown types",
    dumps(long_chat() | {"messages": [{"role": "user", "content": [
        {"type": "text", "text": big_text(2000)}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, {"type": "hologram"}, "bare string", 7,
    ]} for _ in range(4)] + [{"role": "user", "content": "hi"}]}),
    CHAT_ROUTES,
)  # fmt: skip
named("tool_calls not a list", b'{"model": "m", "messages": [{"role": "assistant", "content": "", "tool_calls": {"a": 1}}]}', CHAT_ROUTES)
named(
    "tool_calls with junk",
    b'{"model": "m", "messages": [{"role": "assistant", "content": "", "tool_calls": [1, null, {"function": 3}]}]}',
    CHAT_ROUTES,
)
named("ollama images not a list", b'{"model": "m", "messages": [{"role": "user", "content": "x", "images": "AAAA"}]}', CHAT_ROUTES)
named("empty messages", b'{"model": "m", "messages": []}', CHAT_ROUTES)
named("empty content", b'{"model": "m", "messages": [{"role": "user", "content": ""}]}', CHAT_ROUTES)
named("enormous single message", dumps({"model": "m", "messages": [{"role": "user", "content": "word " * 400_000}]}), CHAT_ROUTES)
named(
    "enormous system prompt",
    dumps({"model": "m", "messages": [{"role": "system", "content": "rule " * 100_000}, {"role": "user", "content": "hi"}]}),
    CHAT_ROUTES,
)
named("a thousand messages", dumps({"model": "m", "messages": [{"role": "user", "content": f"m{i}"} for i in range(1000)]}), CHAT_ROUTES)
named("prompt a list (batch)", b'{"model": "m", "prompt": ["a", "b"]}', PROMPT_ROUTES)
named("prompt a number", b'{"model": "m", "prompt": 3}', PROMPT_ROUTES)
named("prompt null", b'{"model": "m", "prompt": null}', PROMPT_ROUTES)
named("enormous prompt", dumps({"model": "m", "prompt": "word " * 400_000}), PROMPT_ROUTES)
named("non-UTF-8 bytes", b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe\xc3"}], "prompt": "\xff"}')
named("UTF-16 JSON", json.dumps(long_chat()).encode("utf-16"), CHAT_ROUTES)
named("UTF-8 BOM", b"\xef\xbb\xbf" + dumps(long_chat()), CHAT_ROUTES)
named("NUL bytes in strings", dumps({"model": "m", "messages": [{"role": "user", "content": "a\x00b" * 3000}]}), CHAT_ROUTES)
named("duplicate keys", b'{"model": "m", "messages": [], "messages": [{"role": "user", "content": "hi"}]}', CHAT_ROUTES)
named("gzip overflowing chat", dumps(long_chat()), CHAT_ROUTES, {"content-encoding": "gzip"})
named("zstd overflowing chat", dumps(long_chat()), CHAT_ROUTES, {"content-encoding": "zstd"})
named("br overflowing prompt", dumps({"model": "m", "prompt": big_text(3000)}), PROMPT_ROUTES, {"content-encoding": "br"})
named("gzip header on a plain body", dumps({"model": "m", "messages": "x"}), CHAT_ROUTES, {"content-encoding-raw": "gzip"})
named("gzip header on garbage", b"\x1f\x8b\x08garbage", ROUTES, {"content-encoding-raw": "gzip"})
named("unknown encoding", dumps(long_chat()), CHAT_ROUTES, {"content-encoding-raw": "snappy"})


@pytest.mark.parametrize("name", list(NAMED))
def test_named_bad_input(runner: Any, kit: Any, cases: Any, name: str) -> None:
    routes, raw, headers = NAMED[name]
    outcomes = collections.Counter()
    for port, path in routes:
        if "content-encoding-raw" in headers:  # a header that lies about the body
            body, sent = raw, {"content-encoding": headers["content-encoding-raw"]}
        elif "content-encoding" in headers:
            body, sent = encoded(raw, headers["content-encoding"])
        else:
            body, sent = raw, {}
        outcomes[check(runner, kit, port, path, body, sent)] += 1
        cases["bad_input.named"] += 1
    print(name, dict(outcomes))


def test_a_lone_surrogate_escape_is_compacted_not_an_internal_error(runner: Any, kit: Any, cases: Any) -> None:
    body = long_chat()
    raw = dumps(body).replace(b"part 3 ", b"part 3 \\ud83d ")
    cases["bad_input.named"] += 1
    assert check(runner, kit, OLLAMA_PORT, "/api/chat", raw) == "compacted"


def test_deeply_nested_json_is_forwarded_unjudged_and_said_rather_than_an_internal_error(runner: Any, kit: Any, cases: Any) -> None:
    """Deeper than Python's parser goes: it goes as it came, and the client is told it went unjudged
    (`test_unreadable_bodies.py` has the case on every route)."""
    raw = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    cases["bad_input.named"] += 1
    errors = runner.harness.stats["errors"]
    flow = kit.flow_for("/api/chat", raw, port=OLLAMA_PORT)
    runner.send(flow)
    state = runner.harness.compactor.states[flow]
    assert flow.response is None and flow.request.raw_content == raw and runner.harness.stats["errors"] == errors
    assert state.headers["X-ContextPaw-Error"].startswith("not judged") and state.report is not None


def test_many_small_messages_compact_in_time_that_grows_with_their_number_not_its_square(runner: Any, kit: Any, cases: Any) -> None:
    """2,000 messages against 200, timed in one run (a ratio, not a wall-clock bound a loaded
    machine would break): ten times the messages may take at most thirty times as long, where a
    cost that grows with the square would take a hundred."""

    def timed(count: int, run: int) -> tuple[str, float]:
        messages = [{"role": "user", "content": f"run {run}, m{i}"} for i in range(count)]  # a new conversation each run
        raw = dumps({"model": "m", "messages": messages, "options": {"num_ctx": 1024}})
        started = time.perf_counter()
        outcome = check(runner, kit, OLLAMA_PORT, "/api/chat", raw)
        return outcome, time.perf_counter() - started

    runs = [(timed(200, 2 * n), timed(2000, 2 * n + 1)) for n in range(3)]  # interleaved
    cases["bad_input.named"] += 1
    assert all(small[0] == big[0] == "compacted" for small, big in runs), runs
    small, big = min(s[1] for s, _ in runs), min(b[1] for _, b in runs)
    assert big < 30 * small, f"2,000 messages took {big:.3f} s, 200 took {small:.3f} s"


# -- through a real mitmdump ------------------------------------------------------------------------


E2E_CASES = [
    ("/api/chat", b'{"model": "m", "messages": ['),
    ("/api/chat", b"[1, 2]"),
    ("/api/chat", b'{"model": "fake", "messages": null}'),
    ("/api/chat", b'{"model": "fake", "messages": [{"role": "user", "content": 5}], "stream": false}'),
    ("/api/generate", b'{"model": "fake", "prompt": ["a"], "stream": false}'),
    ("/v1/chat/completions", b'{"model": "fake", "messages": "hi"}'),
    ("/v1/chat/completions", b"\xff\xfe not json"),
]


def comparable(response: httpx.Response) -> Any:
    """The answer without what differs per call (the time) or what the proxy adds (its report)."""
    try:
        body = response.json()
    except ValueError:
        return response.content
    if isinstance(body, dict):
        body.pop("created_at", None)
        body.pop("contextpaw", None)
    return body


def test_through_mitmdump_bad_bodies_reach_the_backend_unchanged(proxy: Any, ollama: Any, kit: Any, cases: Any) -> None:
    """Through mitmdump, the backend's own answer to each bad body is what the client gets."""
    for path, raw in E2E_CASES:
        direct = httpx.post(ollama.url + path, content=raw, headers={"content-type": "application/json"}, timeout=10)
        proxied = httpx.post(proxy["ollama"] + path, content=raw, headers={"content-type": "application/json"}, timeout=10)
        assert proxied.headers.get("server") != "mitmproxy", proxied.text
        assert "X-ContextPaw-Error" not in proxied.headers
        assert (proxied.status_code, comparable(proxied)) == (direct.status_code, comparable(direct)), path
        cases["bad_input.e2e"] += 1


def test_through_mitmdump_a_gzip_overflowing_chat_is_compacted(proxy: Any, kit: Any, cases: Any) -> None:
    body = long_chat(model="fake", options={"num_ctx": kit.n_ctx, "num_predict": 8})
    raw, headers = encoded(dumps(body), "gzip")
    response = httpx.post(proxy["ollama"] + "/api/chat", content=raw, headers={**headers, "content-type": "application/json"}, timeout=20)
    assert response.status_code == 200, response.text
    assert response.headers["X-ContextPaw-Compacted"] == "true" and response.json()["done"] is True
    cases["bad_input.e2e"] += 1


def test_through_mitmdump_a_100_mb_body_stays_sane(roomy_proxy: Any, kit: Any, cases: Any) -> None:
    proxy = roomy_proxy
    """~100 MB of chat through mitmdump in front of the fake: answered, in bounded time and memory."""
    chunk = {"role": "user", "content": "x" * (1 << 20)}
    body = {"model": "fake", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read the logs."}] + [chunk] * 100 + [{"role": "user", "content": "hi"}],
            "options": {"num_ctx": kit.n_ctx, "num_predict": 8}, "stream": False}  # fmt: skip
    raw = dumps(body)
    assert len(raw) > 100 * 10**6
    rss_before = kit.rss_kib(proxy.pid)
    started = time.monotonic()
    response = httpx.post(proxy["ollama"] + "/api/chat", content=raw, headers={"content-type": "application/json"}, timeout=60)
    elapsed = time.monotonic() - started
    rss_after = kit.rss_kib(proxy.pid)
    print(f"100 MB: {response.status_code} in {elapsed:.1f}s, mitmdump RSS {rss_before // 1024} -> {rss_after // 1024} MiB")
    assert response.status_code == 200, response.text[:500]
    assert response.headers["X-ContextPaw-Compacted"] == "true"
    assert elapsed < 30
    assert rss_after - rss_before < 2_000_000, "mitmdump grew by more than 2 GB for a 100 MB body"
    assert kit.health(proxy["ollama"])["stats"]["errors"] == 0
    cases["bad_input.e2e"] += 1
