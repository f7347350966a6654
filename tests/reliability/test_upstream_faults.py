"""Upstream faults through a real mitmdump: refused, reset, hanging and misbehaving backends.

For each fault: the client gets a well-formed answer in its API's convention within a bounded time
(the proxy runs with 2 s header and idle timeouts), the proxy stays up and serves the next request
normally, the backend received the request as the client sent it (fail open), and the event is
counted in /contextpaw/health and logged.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

import httpx
import pytest

from contextpaw.fitting.fitter import MAX_RESCUES
from contextpaw.wire import openai

BOUND_S = 2 + 4.0
"""The proxy's header/idle timeout plus slack: no fault may hold a client longer."""
OK_STATS = {"requests", "original_tokens", "compacted", "evicted_tokens"}
"""Counts every request moves; any other count moving means the event was counted."""


def chat(stream: bool = False, words: int = 5) -> dict[str, Any]:
    return {"model": "fault", "messages": [{"role": "user", "content": "hi " * words}], "stream": stream, "max_tokens": 8}


def call(
    url: str, fault: str, body: dict[str, Any], path: str = "/v1/chat/completions", extra: dict[str, str] | None = None
) -> tuple[int | None, dict[str, str], bytes, str | None, float, str, bytes]:
    """POST through the proxy with `X-Fault`; returns status, headers, body, transport error, seconds, id, sent bytes."""
    req_id = uuid.uuid4().hex
    raw = json.dumps(body).encode()
    headers = {
        "X-Fault": fault,
        "X-Req-Id": req_id,
        "Authorization": "Bearer sk-client",
        "Content-Type": "application/json",
        **(extra or {}),
    }
    started = time.monotonic()
    status, got_headers, data, error = None, {}, b"", None
    try:
        with httpx.stream("POST", url + path, content=raw, headers=headers, timeout=BOUND_S + 5) as response:
            status, got_headers = response.status_code, dict(response.headers)
            try:
                for chunk in response.iter_bytes():
                    data += chunk
            except httpx.HTTPError as e:
                error = f"{type(e).__name__}: {e}"
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    return status, got_headers, data, error, time.monotonic() - started, req_id, raw


def stats_of(proxy: Any, kit: Any) -> dict[str, int]:
    return kit.health(proxy["fault"])["stats"]


def assert_still_serving(proxy: Any, fault_server: Any) -> None:
    """The proxy answers its own endpoint and the next normal request, right after the fault."""
    status, _, body, error, elapsed, req_id, raw = call(proxy["fault"], "ok", chat())
    assert (status, error) == (200, None) and elapsed < 2, (status, error, elapsed)
    answer = json.loads(body)
    assert answer["choices"][0]["message"]["content"] == "fine" and answer["echo"]["bytes"] == len(raw)
    assert "contextpaw" in answer
    [seen] = fault_server.hits(req_id)
    assert seen.body == raw


def assert_received_whole(fault_server: Any, req_id: str, raw: bytes) -> None:
    """Nothing of the original request was lost: the backend got the client's bytes (a streamed
    chat with the usage option ContextPaw asks for in the client's stead, and nothing else)."""
    hits = fault_server.hits(req_id)
    assert hits and hits[0].body in (raw, openai.asking_usage(raw, {})) and hits[0].headers.get("Authorization") == "Bearer sk-client"


# -- connection refused -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/api/chat", "ollama"), ("/api/generate", "ollama"), ("/v1/chat/completions", "openai"), ("/completion", "llamacpp")],
)
def test_connection_refused_is_a_json_502_in_the_api_convention(
    proxy: Any, fault_server: Any, kit: Any, cases: Any, path: str, shape: str
) -> None:
    before = stats_of(proxy, kit)
    started = time.monotonic()
    response = httpx.post(proxy["dead"] + path, json=chat(), timeout=BOUND_S + 5)
    assert time.monotonic() - started < BOUND_S
    assert response.status_code == 502 and response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    if shape == "ollama":
        assert isinstance(error, str) and "does not answer" in error
    elif shape == "openai":
        assert error["code"] == "backend_unreachable" and "does not answer" in error["message"]
    else:
        assert error["code"] == 502 and error["type"] == "unavailable_error"
    assert stats_of(proxy, kit)["unreachable"] == before["unreachable"] + 1
    assert_still_serving(proxy, fault_server)
    cases["faults.e2e"] += 1


def test_a_dead_backend_gets_a_json_502_on_routes_the_relay_does_not_carry(proxy: Any, fault_server: Any, kit: Any, cases: Any) -> None:
    before = stats_of(proxy, kit)
    response = httpx.get(proxy["dead"] + "/api/tags", timeout=BOUND_S + 5)
    assert response.status_code == 502 and "does not answer" in response.json()["error"]
    assert stats_of(proxy, kit)["unreachable"] == before["unreachable"] + 1
    assert_still_serving(proxy, fault_server)
    cases["faults.e2e"] += 1


# -- faults after the connection is open ------------------------------------------------------------

FAULTS = {
    # fault: (stream?, what the client should get)
    "reset-before": (False, "json-502"),
    "reset-mid-body": (False, "json-502"),
    "hang-before": (False, "json-504"),
    "reset-mid-stream": (True, "error-record"),
    "hang-mid-stream": (True, "error-record"),
    "non-json": (False, "as-sent"),
    "truncated-json": (False, "as-sent"),
    "500": (False, "backend-error"),
}
SEEN: dict[str, tuple[dict[str, int], dict[str, int], int]] = {}
"""fault -> (stats before, stats after, log size before), from the answer test (hangs are slow to repeat)."""


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_gets_a_well_formed_answer_in_bounded_time(proxy: Any, fault_server: Any, kit: Any, cases: Any, fault: str) -> None:
    stream, expected = FAULTS[fault]
    before, log_size = stats_of(proxy, kit), proxy.process.log.stat().st_size
    status, headers, body, error, elapsed, req_id, raw = call(proxy["fault"], fault, chat(stream))
    SEEN[fault] = (before, stats_of(proxy, kit), log_size)
    cases["faults.e2e"] += 1
    assert elapsed < BOUND_S, f"{fault}: the client waited {elapsed:.1f}s"
    assert_received_whole(fault_server, req_id, raw)
    assert_still_serving(proxy, fault_server)
    if expected in ("json-502", "json-504"):
        assert error is None and status == int(expected[-3:]), (status, body[:200], error)
        assert headers.get("content-type", "").startswith("application/json"), headers
        assert headers.get("x-contextpaw-upstream-error", "").startswith("ContextPaw: the backend")
        answer = json.loads(body)
        assert answer["error"]["code"] == ("backend_timeout" if expected == "json-504" else "backend_unreachable")
        assert answer["error"]["message"] == headers["x-contextpaw-upstream-error"]
        known = {b["url"]: b["last_error"] for b in kit.health(proxy["fault"])["backends"]}
        assert known[fault_server.url] and known[fault_server.url] in answer["error"]["message"]
    elif expected == "error-record":
        # After the headers the stream itself says what happened, in the record OpenAI clients raise from.
        assert status == 200 and error is None, (status, error)
        *tokens, last = [json.loads(line[6:]) for line in body.decode().split("\n") if line.startswith("data: {")]
        assert [t["choices"][0]["delta"]["content"] for t in tokens] == ["to", "to"]
        assert last["error"]["code"] == ("backend_timeout" if fault.startswith("hang") else "backend_unreachable")
    elif expected == "as-sent":
        assert status == 200 and error is None and body == fault_server_body(fault)
    else:
        assert status == 500 and json.loads(body)["error"]["message"] == "backend exploded"


def fault_server_body(fault: str) -> bytes:
    return {"non-json": b"<html>Internal oops</html>", "truncated-json": b'{"choices":[{"message":{"content":"tru'}[fault]


OVERFLOW = {"X-Fault-Prompt-Tokens": "1100"}
"""The backend's count, a little over its 1024-token window: enough for the proxy to compact and retry."""


def test_a_repeated_overflow_400_is_retried_a_bounded_number_of_times(proxy: Any, fault_server: Any, kit: Any, cases: Any) -> None:
    """The backend says 'too long' to the request and to every compacted retry: each retry is
    smaller than the last, there are at most MAX_RESCUES, and the client gets an answer in its API's
    shape: OpenAI's 400 `context_length_exceeded` once the rounds run out, never the backend's raw
    error on an OpenAI route."""
    before = stats_of(proxy, kit)
    body = {"model": "fault", "messages": [{"role": "system", "content": "Be brief."}]
            + [{"role": "user" if i % 2 else "assistant", "content": f"turn {i} " + "a " * 60} for i in range(12)]
            + [{"role": "user", "content": "and?"}], "max_tokens": 8}  # fmt: skip
    status, headers, data, error, elapsed, req_id, raw = call(proxy["fault"], "overflow-400", body, extra=OVERFLOW)
    cases["faults.e2e"] += 1
    assert elapsed < BOUND_S and error is None
    hits = fault_server.hits(req_id)
    assert 2 <= len(hits) <= 1 + MAX_RESCUES, f"{len(hits)} requests reached the backend"
    assert hits[0].body == raw and all(h.headers.get("Authorization") == "Bearer sk-client" for h in hits)
    sizes = [len(h.body) for h in hits]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes), "each retry is smaller"
    answer = json.loads(data)
    # 400, not 413: OpenAI's own answer to an overlong prompt, the code its clients trim on (a 413 reads as a size limit)
    assert status == 400 and (answer["error"]["type"], answer["error"]["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert answer["contextpaw"]["recovered_from_upstream_400"] is False
    after = stats_of(proxy, kit)
    assert after["retried_400"] == before["retried_400"] + len(hits) - 1
    assert after["recovered_400"] == before["recovered_400"]
    assert_still_serving(proxy, fault_server)


# -- counted and logged -----------------------------------------------------------------------------

COUNTED_FAULTS = [*FAULTS, "overflow-400"]


@pytest.mark.parametrize("fault", COUNTED_FAULTS)
def test_a_fault_is_counted_and_logged(proxy: Any, fault_server: Any, kit: Any, cases: Any, fault: str) -> None:
    if fault in SEEN:
        before, after, log_size = SEEN[fault]
    else:
        stream = FAULTS.get(fault, (False, ""))[0]
        before, log_size = stats_of(proxy, kit), proxy.process.log.stat().st_size
        call(proxy["fault"], fault, chat(stream, words=400 if fault == "overflow-400" else 5), extra=OVERFLOW)
        cases["faults.e2e"] += 1
        after = stats_of(proxy, kit)
    moved = {k: after[k] - before.get(k, 0) for k in after if k not in OK_STATS and after[k] != before.get(k, 0)}
    assert moved, f"{fault}: no count moved in /contextpaw/health"
    if fault.startswith("hang"):
        assert moved.get("upstream_timeouts") == 1, moved
    assert moved.get("upstream_errors", 0) <= 1, f"{fault}: counted twice: {moved}"
    assert kit.wait_until(lambda: fault_logged(proxy, log_size), 2), f"{fault}: nothing logged"


ADDON_LINE = re.compile(r"^\[[\d:.]+\] (?!\[)(.*)$", re.M)
"""A log line of the addon's own (mitmproxy's per-connection lines carry a second [client] prefix)."""


def fault_logged(proxy: Any, since: int) -> bool:
    with proxy.process.log.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    lines = [m.lower() for m in ADDON_LINE.findall(text)]
    return any(word in line for line in lines for word in ("warn", "error", "fail", "does not answer", "502", "504", "retry", "400"))


def test_unreachable_is_logged(proxy: Any, kit: Any, cases: Any) -> None:
    log_size = proxy.process.log.stat().st_size
    httpx.post(proxy["dead"] + "/api/chat", json=chat(), timeout=BOUND_S + 5)
    cases["faults.e2e"] += 1
    assert kit.wait_until(lambda: fault_logged(proxy, log_size), 2), "the 502 for an unreachable backend is not logged"


# -- the addon's own calls --------------------------------------------------------------------------


def test_a_probe_of_a_silent_backend_is_bounded(proxy: Any, fault_server: Any, kit: Any, cases: Any) -> None:
    """A reverse target that accepts and never says a byte: the kind probe gives up after
    PROBE_TIMEOUT_S, the request is forwarded as is, and tcp_timeout ends it; meanwhile the proxy
    keeps answering everything else."""
    from contextpaw.calls.session import PROBE_TIMEOUT_S

    started = time.monotonic()
    with httpx.Client(timeout=BOUND_S + PROBE_TIMEOUT_S + 5) as client:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(lambda: client.post(proxy["silent"] + "/v1/chat/completions", json=chat()))
            time.sleep(0.3)
            assert_still_serving(proxy, fault_server)  # not blocked by the hanging probe
            try:
                pending.result().status_code
            except httpx.HTTPError:
                pass
    cases["faults.e2e"] += 1
    assert time.monotonic() - started < BOUND_S + PROBE_TIMEOUT_S


def overflowing_chat(turns: int = 12) -> dict[str, Any]:
    """Near or over the 1024-token window, so the proxy counts it with the backend and compacts it."""
    return {"model": "fault", "messages": [{"role": "system", "content": "Be brief."}]
            + [{"role": "user" if i % 2 else "assistant", "content": f"turn {i} " + "a " * 60} for i in range(turns)]
            + [{"role": "user", "content": "and?"}], "max_tokens": 8}  # fmt: skip


def test_a_token_count_endpoint_that_hangs_costs_one_timeout_and_the_request_goes_on(
    proxy: Any, fault_server: Any, kit: Any, cases: Any
) -> None:
    """llama-server's /tokenize hangs: the request is compacted with the calibrated estimate after the
    count's timeout, answered, counted and logged; the next request does not wait again."""
    from contextpaw.calls.server_counts import CALL_TIMEOUT_S as call_timeout

    before, log_size = kit.health(proxy["fault"])["counter"]["backend"], proxy.process.log.stat().st_size
    fault_server.counting_hangs = True
    try:
        waits = []
        for turns in (14, 16):
            status, _, data, error, elapsed, req_id, raw = call(proxy["fault"], "ok", overflowing_chat(turns))
            cases["faults.e2e"] += 1
            waits.append(elapsed)
            assert (status, error) == (200, None), data[:300]
            report = json.loads(data)["contextpaw"]
            assert report["counter"] == "calibrated" and report["final_tokens"] <= report["budget"]
            assert fault_server.hits(req_id)
    finally:
        fault_server.counting_hangs = False
    assert waits[0] < call_timeout + BOUND_S and waits[1] < 2, waits
    after = kit.health(proxy["fault"])["counter"]["backend"]
    assert after["failures"] == before["failures"] + 1
    assert kit.wait_until(lambda: fault_logged(proxy, log_size), 2), "the failed count is not logged"


def test_a_summarizer_that_hangs_costs_one_timeout_and_leaves_the_plain_marker(summarizer_silent: Any, kit: Any, cases: Any) -> None:
    """The summarizer accepts and never answers: the digest is given up after its timeout, the request is
    answered with the plain marker and the reason, and the next request does not wait again."""
    url = summarizer_silent["llamacpp"] + "/v1/chat/completions"
    log_size = summarizer_silent.process.log.stat().st_size
    body = {"model": "fake", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Keep notes."}]
            + [{"role": "user" if i % 2 else "assistant", "content": f"turn {i}: " + "word " * 400} for i in range(14)]
            + [{"role": "user", "content": "and?"}], "max_tokens": 8}  # fmt: skip
    reasons, waits = [], []
    for _ in range(2):
        started = time.monotonic()
        response = httpx.post(url, json=body, timeout=BOUND_S + 10)
        waits.append(time.monotonic() - started)
        cases["faults.e2e"] += 1
        assert response.status_code == 200, response.text[:300]
        report = response.json()["contextpaw"]
        assert report["compacted"] and not report["summarized"]
        reasons.append(report["summary_reason"])
    assert "no answer within 1s" in reasons[0] and "not tried" in reasons[1], reasons
    assert waits[0] < 1 + BOUND_S and waits[1] < 2, waits
    assert kit.health(summarizer_silent["llamacpp"])["summarizer"]["failures"] >= 1
    assert kit.wait_until(lambda: fault_logged(summarizer_silent, log_size), 2), "the lost digest is not logged"
