"""Wire formats per API, and the budget they size."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpaw import wire
from contextpaw.core.compact import BudgetTooSmall
from contextpaw.core.markers import MARKER_PREFIX
from contextpaw.core.tokens import EstimateCounter
from contextpaw.fitting.budget import Budgeter
from contextpaw.fitting.engine import fit_chat, fit_prompt
from contextpaw.wire import Kind, NotCompactable, Overflow, Params, UpstreamOverflow, anthropic, llamacpp, ollama, openai, responses

COUNTER = EstimateCounter()


def history(turns: int, words: int = 400) -> list[dict]:
    out = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "the task"}]
    for i in range(turns):
        out.append({"role": "assistant" if i % 2 == 0 else "user", "content": f"turn{i} " + "lorem " * words})
    return out


@pytest.mark.parametrize(
    ("kind", "path", "route"),
    [
        (Kind.OLLAMA, "/api/chat", ollama.CHAT),
        (Kind.OLLAMA, "/api/generate", ollama.GENERATE),
        (Kind.OLLAMA, "/v1/chat/completions", openai.CHAT),
        (Kind.OLLAMA, "/v1/completions?x=1", openai.COMPLETIONS),
        (Kind.LLAMACPP, "/v1/chat/completions", openai.CHAT),
        (Kind.LLAMACPP, "/chat/completions", openai.CHAT),
        (Kind.LLAMACPP, "/v1/completions", openai.COMPLETIONS),
        (Kind.LLAMACPP, "/completion", llamacpp.COMPLETION),
        (Kind.LLAMACPP, "/completions/", llamacpp.COMPLETION),
        (Kind.LLAMACPP, "/api/chat", None),
        (Kind.OLLAMA, "/completion", None),
        (Kind.OLLAMA, "/api/embed", None),
    ],
)
def test_routes_per_backend(kind: Kind, path: str, route: wire.Route | None) -> None:
    assert wire.route_for(kind, "POST", path) is route


def test_only_posts_are_handled() -> None:
    assert wire.route_for(Kind.OLLAMA, "GET", "/api/chat") is None


def test_ollama_chat_params() -> None:
    body = {"model": "m", "messages": [], "options": {"num_ctx": 8192, "num_predict": -1}}
    parsed = ollama.CHAT.read(json.dumps(body).encode())
    assert parsed.params == Params(model="m", stream=True, num_ctx=8192, max_output=None)
    body["options"]["num_predict"] = 300
    body["stream"] = False
    assert ollama.CHAT.read(json.dumps(body).encode()).params == Params("m", False, 8192, 300)


def test_openai_params_read_every_spelling_of_the_answer_limit() -> None:
    for field in ("max_tokens", "max_completion_tokens", "n_predict"):
        parsed = openai.CHAT.read(json.dumps({"model": "m", "messages": [], field: 77}).encode())
        assert parsed.params == Params(model="m", stream=False, num_ctx=None, max_output=77)


def test_chat_rewrite_keeps_every_other_field() -> None:
    body = {"model": "m", "messages": history(12), "options": {"num_ctx": 2048}, "tools": [], "keep_alive": "5m"}
    fitted = fit_chat(ollama.CHAT.read(json.dumps(body).encode()), 1200, COUNTER, keep_recent=2, previous=None)
    assert fitted.report.compacted and fitted.body is not None
    sent = json.loads(fitted.body)
    assert {k: v for k, v in sent.items() if k != "messages"} == {k: v for k, v in body.items() if k != "messages"}
    assert len(sent["messages"]) < len(body["messages"])
    assert fitted.plan is not None and fitted.plan.evicted


def test_a_chat_that_fits_is_sent_as_it_came() -> None:
    fitted = fit_chat(openai.CHAT.read(json.dumps({"messages": history(1)}).encode()), 100_000, COUNTER, keep_recent=4, previous=None)
    assert fitted.body is None and not fitted.report.compacted


def test_generate_keeps_system_and_suffix_whole_and_counts_them() -> None:
    body = {"model": "m", "prompt": "word " * 3000, "system": "sys " * 100, "suffix": "end"}
    parsed = ollama.GENERATE.read(json.dumps(body).encode())
    fitted = fit_prompt(parsed, 1000, COUNTER)
    sent = json.loads(fitted.body)
    assert sent["system"] == body["system"] and sent["suffix"] == "end"
    assert fitted.report.final_tokens <= 1000
    assert fitted.report.final_tokens >= COUNTER.text(parsed.fixed_text)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (openai.CHAT, b"{not json"),
        (openai.CHAT, b"[1, 2]"),
        (openai.CHAT, b'{"messages": "hi"}'),
        (ollama.CHAT, b'{"messages": [{"content": "no role"}]}'),
        (openai.COMPLETIONS, b'{"prompt": ["a", "batch"]}'),
        (llamacpp.COMPLETION, b'{"prompt": [1, 2, 3]}'),
    ],
)
def test_bodies_we_do_not_understand_are_not_compactable(route: wire.Route, body: bytes) -> None:
    with pytest.raises(NotCompactable):
        route.read(body)


def test_conversation_key_survives_new_turns_and_tells_conversations_apart() -> None:
    first = openai.CHAT.read(json.dumps({"model": "m", "messages": history(2)}).encode())
    later = openai.CHAT.read(json.dumps({"model": "m", "messages": history(6)}).encode())
    other = history(6)
    other[0] = {"role": "system", "content": "You are verbose."}
    different = openai.CHAT.read(json.dumps({"model": "m", "messages": other}).encode())
    assert first.key == later.key != different.key
    assert ollama.GENERATE.read(b'{"prompt": "x"}').key is None


OVERFLOW = Overflow(required=5000, budget=3000, window=4096, cause="the request needs 5000 tokens")


def test_ollama_refusal_is_one_sentence_with_the_numbers() -> None:
    body = ollama.CHAT.refusal(OVERFLOW, {"compacted": False})
    assert isinstance(body["error"], str) and "5000" in body["error"] and "4096" in body["error"]
    assert body["contextpaw"] == {"compacted": False}


@pytest.mark.parametrize(("route", "param"), [(openai.CHAT, "messages"), (openai.COMPLETIONS, "prompt"), (responses.RESPONSES, "input")])
def test_every_openai_route_refuses_as_openai_does_an_overlong_prompt(route: wire.Route, param: str) -> None:
    """A 400 invalid_request_error with code context_length_exceeded: what Codex and the SDKs'
    users recognise as "the context was too long" (a 413 reads to them as a size limit)."""
    error = route.refusal(OVERFLOW, {})["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded", param)
    assert (error["n_prompt_tokens"], error["budget"], error["num_ctx"]) == (5000, 3000, 4096)


def test_llamacpp_refusal_speaks_llama_server() -> None:
    """llama-server's own 400 for a prompt over its window, its sentence first: its clients (and a
    ContextPaw in front of this one) read it as the overflow it is."""
    body = llamacpp.COMPLETION.refusal(OVERFLOW, {})
    error = body["error"]
    assert (error["code"], error["type"], error["n_prompt_tokens"], error["n_ctx"]) == (400, "exceed_context_size_error", 5000, 4096)
    assert error["message"].startswith("request (5000 tokens) exceeds the available context size (3000 tokens), try increasing it; ")
    assert wire.upstream_overflow(400, json.dumps(body).encode()) == wire.UpstreamOverflow(5000, 4096)


@pytest.mark.parametrize(
    ("kind", "path", "shape"),
    [
        (Kind.OLLAMA, "/api/tags", str),
        (Kind.OLLAMA, "/v1/models", dict),
        (Kind.LLAMACPP, "/props", dict),
        (None, "/api/chat", str),
    ],
)
def test_proxy_errors_follow_the_callers_convention(kind: Kind | None, path: str, shape: type) -> None:
    assert isinstance(wire.proxy_error(kind, path, "down")["error"], shape)


LLAMA_400 = {
    "error": {
        "code": 400,
        "message": "request (4390 tokens) exceeds the available context size (4096 tokens), try increasing it",
        "type": "exceed_context_size_error",
        "n_prompt_tokens": 4390,
        "n_ctx": 4096,
    }
}


def test_upstream_overflow_from_llama_server_and_from_ollama_wrapping_it() -> None:
    expected = UpstreamOverflow(n_prompt_tokens=4390, n_ctx=4096)
    assert wire.upstream_overflow(400, json.dumps(LLAMA_400).encode()) == expected
    assert wire.upstream_overflow(400, json.dumps({"error": json.dumps(LLAMA_400)}).encode()) == expected
    envelope = {"error": {"message": json.dumps(LLAMA_400), "type": "invalid_request_error", "code": None}}
    assert wire.upstream_overflow(400, json.dumps(envelope).encode()) == expected


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (200, json.dumps(LLAMA_400).encode()),
        (400, b'{"error": "model is required"}'),
        (400, b'{"error": {"type": "invalid_request_error"}}'),
        (400, b"404 page not found"),
        (500, b'{"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}'),
    ],
)
def test_other_errors_are_not_upstream_overflows(status: int, body: bytes) -> None:
    assert wire.upstream_overflow(status, body) is None


def test_identify_backends_by_their_answers() -> None:
    assert wire.identify("Ollama is running", 404) is Kind.OLLAMA
    assert wire.identify(None, 200) is Kind.LLAMACPP
    assert wire.identify("<html>", 404) is None


def test_backend_urls_are_normalised_and_checked() -> None:
    assert wire.Backend.parse(Kind.OLLAMA, "127.0.0.1:11435").url == "http://127.0.0.1:11435"
    assert wire.Backend.parse(Kind.LLAMACPP, "http://localhost").port == 80
    with pytest.raises(ValueError, match="not an http"):
        wire.Backend.parse(Kind.OLLAMA, "ftp://x")


# -- the budget ----------------------------------------------------------------------------------

BUDGETER = Budgeter(default_ctx=4096, reserve=1024, margin=64)


def test_window_is_the_requests_num_ctx_else_the_default() -> None:
    assert BUDGETER.for_window(8192, Params("m", True, max_output=None)).tokens == 8192 - 1024 - 64
    assert BUDGETER.for_window(4096, Params("m", True, max_output=100)).tokens == 4096 - 100 - 64


async def test_budget_prefers_the_request_over_the_default() -> None:
    backend = wire.Backend.parse(Kind.OLLAMA, "http://127.0.0.1:1")
    assert (await BUDGETER.budget(backend, Params("m", True, num_ctx=16384))).window == 16384
    assert (await BUDGETER.budget(backend, Params("m", True))).window == 4096


def test_a_huge_answer_limit_reserves_no_more_than_the_configured_reserve() -> None:
    # Claude Code and opencode send max_tokens 32000: that is a cap on the answer, not a reservation
    assert BUDGETER.for_window(12000, Params("m", True, max_output=32000)).reserve == 1024
    assert BUDGETER.for_window(1024, Params("m", False, max_output=100_000)).reserve == 512


def test_a_prompt_the_backend_serves_whole_is_admitted_whatever_answer_length_it_asks_for() -> None:
    budget = BUDGETER.for_window(8192, Params("m", True, max_output=32000))
    assert budget.admits == 8192 - 64  # the backends hold nothing back for max_tokens
    assert budget.tokens == 8192 - 1024 - 64  # but a prompt that must be cut anyway leaves room for an answer


def test_retry_budget_shrinks_when_the_backend_counted_more_than_we_did() -> None:
    params = Params("m", False, max_output=100)
    plain = BUDGETER.for_window(256, params)
    same = BUDGETER.after_upstream_overflow(UpstreamOverflow(300, 256), 400, params)
    assert (same.window, same.tokens) == (plain.window, plain.tokens)
    scaled = BUDGETER.after_upstream_overflow(UpstreamOverflow(600, 256), 300, params)
    assert scaled.window == 256 and scaled.tokens == plain.tokens // 2


def test_after_the_server_refused_a_request_nothing_over_the_budget_goes_out_unchanged() -> None:
    """The window less the margin admits a request unchanged, but not one the server just refused:
    its retry is cut to the budget, whatever room the answer's reserve would leave."""
    params = Params("m", False, max_output=512)
    budget = BUDGETER.after_upstream_overflow(UpstreamOverflow(3000, 1024), 500, params)
    assert budget.admits == budget.tokens < 500


def test_refusals_carry_the_budget_numbers() -> None:
    budget = BUDGETER.for_window(4096, Params("m", False, max_output=96))
    strict = budget.refusal(9000)
    # strict refuses what the backend would not serve whole: the answer's reserve is not held back
    assert (strict.required, strict.budget, strict.window) == (9000, 4096 - 64, 4096)
    assert "policy strict" in strict.message
    impossible = budget.impossible(BudgetTooSmall(5000, budget.tokens, "the system prompt"))
    assert impossible.required == 5000 and "the system prompt need 5000" in impossible.message


@pytest.mark.parametrize("num_ctx", [0, -1, -4096])
def test_a_window_of_zero_or_less_is_no_window(num_ctx: int) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "options": {"num_ctx": num_ctx}}
    assert wire.route_for(wire.Kind.OLLAMA, "POST", "/api/chat").read(json.dumps(body).encode()).params.num_ctx is None


# -- the Responses API -----------------------------------------------------------------------------

RESPONSES = responses.RESPONSES


def codex_session(calls: int = 12) -> dict[str, Any]:
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the test."}]},
    ]
    for i in range(calls):
        items.append(
            {"type": "reasoning", "id": f"rs_{i}", "summary": [], "content": [{"type": "reasoning_text", "text": f"I should read f{i}."}]}
        )
        items.append({"type": "function_call", "call_id": f"call_{i}", "name": "shell", "arguments": json.dumps({"cmd": f"cat f{i}"})})
        items.append(
            {"type": "function_call_output", "call_id": f"call_{i}", "output": f"file {i}\n" + "line of output\n" * (40 + 30 * (i % 3))}
        )
    items.append({"type": "web_search_call", "id": "ws_1", "status": "completed"})
    items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Status?"}]})
    return {"model": "m", "instructions": "Be brief.", "input": items, "tools": [{"type": "function", "name": "shell"}], "stream": True}


def test_a_responses_session_is_cut_by_whole_turns_and_what_it_does_not_know_is_kept() -> None:
    body = codex_session()
    parsed = RESPONSES.read(json.dumps(body).encode())
    fitted = fit_chat(parsed, 1500, EstimateCounter(), keep_recent=2, previous=None)
    assert fitted.body is not None and fitted.report.compacted
    sent = json.loads(fitted.body)
    assert sent["instructions"] == "Be brief." and sent["tools"] == body["tools"]
    items = sent["input"]
    assert items[:2] == body["input"][:2], "the developer message and the task stay at the head"
    calls = {i["call_id"] for i in items if i.get("type") == "function_call"}
    outputs = {i["call_id"] for i in items if i.get("type") == "function_call_output"}
    assert calls == outputs and len(calls) < 12, "a call and its output go together"
    for a, b in zip(items, items[1:]):
        if a.get("type") == "reasoning":
            assert b.get("type") == "function_call" and b["call_id"] == a["id"].replace("rs_", "call_"), "reasoning stays with its turn"
    assert body["input"][-2] in items, "an item of a type not known here is kept as sent"
    assert any(MARKER_PREFIX in json.dumps(i) for i in items if i.get("role") in ("user", "assistant"))


def test_a_huge_recent_tool_output_is_shrunk_inside_its_output() -> None:
    body = codex_session(calls=2)
    body["input"][-3]["output"] = "".join(f"row {n}\n" for n in range(20_000))
    fitted = fit_chat(RESPONSES.read(json.dumps(body).encode()), 3000, EstimateCounter(), keep_recent=4, previous=None)
    assert fitted.body is not None
    output = next(i for i in json.loads(fitted.body)["input"] if i.get("call_id") == "call_1" and i["type"] == "function_call_output")
    assert output["output"].startswith("row 0\n") and output["output"].endswith("row 19999\n") and MARKER_PREFIX in output["output"]
    assert any(r.action == "shrunk" for r in fitted.report.removals)


def test_a_responses_input_given_as_a_string_is_the_users_message() -> None:
    parsed = RESPONSES.read(json.dumps({"model": "m", "input": "hello " * 4000, "max_output_tokens": 50}).encode())
    assert [m.role for m in parsed.conversation.messages] == ["user"] and parsed.params.max_output == 50
    fitted = fit_chat(parsed, 500, EstimateCounter(), keep_recent=4, previous=None)
    assert fitted.body is not None and json.loads(fitted.body)["input"][0]["role"] == "user"


def test_the_prompt_size_is_read_from_the_response_and_from_response_completed() -> None:
    assert RESPONSES.evaluated({"object": "response", "usage": {"input_tokens": 812, "output_tokens": 3}}) == 812
    completed = {"type": "response.completed", "response": {"usage": {"input_tokens": 900}}}
    assert RESPONSES.is_final(completed) and RESPONSES.evaluated(completed) == 900
    assert not RESPONSES.is_final({"type": "response.output_text.delta", "delta": "x"})


def test_conversation_key_is_what_the_model_reads_not_how_the_client_spells_it() -> None:
    """Claude Code 2.1.332 sends its environment message as text blocks on the first turn and as a
    string on every later one (recorded in tests/agents/fixtures): one conversation, one key, so
    the first answer's count tells the second turn the conversation's rate."""
    task = {"role": "user", "content": [{"type": "text", "text": "Read the files.", "cache_control": {"type": "ephemeral"}}]}
    environment = "# Environment\nPrimary working directory: /work"
    first = anthropic.MESSAGES.read(json.dumps({"model": "m", "max_tokens": 10, "messages": [
        task, {"role": "system", "content": [{"type": "text", "text": environment}]}]}).encode())  # fmt: skip
    later = anthropic.MESSAGES.read(json.dumps({"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Read the files."}]},
        {"role": "system", "content": environment},
        {"role": "assistant", "content": "Reading."},
        {"role": "user", "content": "go on"}]}).encode())  # fmt: skip
    other = anthropic.MESSAGES.read(json.dumps({"model": "m", "max_tokens": 10, "messages": [
        task, {"role": "system", "content": environment + " (another project)"}]}).encode())  # fmt: skip
    assert first.key == later.key != other.key


def test_a_conversation_key_is_made_once_and_each_secret_keys_its_own() -> None:
    """The key writes the first user message (megabytes at times) and is asked for several times
    a request: made once; a copy keyed with another secret makes its own."""
    parsed = openai.CHAT.read(json.dumps({"model": "m", "messages": history(4)}).encode())
    assert isinstance(parsed, wire.Chat)
    mine, theirs = wire.keyed(parsed, b"mine"), wire.keyed(parsed, b"theirs")
    assert parsed.key is parsed.key and mine.key is mine.key
    assert len({parsed.key, mine.key, theirs.key}) == 3
    assert wire.keyed(openai.CHAT.read(json.dumps({"model": "m", "messages": history(4)}).encode()), b"mine").key == mine.key


# -- whether a request asks for a stream, from its bytes --------------------------------------------

STREAM_VALUES = st.sampled_from([True, False, None, 0, "yes"])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["stream", "a", "stream_options"]), inner, max_size=3),
    max_leaves=8,
)


@given(
    top=st.one_of(st.just(None), STREAM_VALUES),
    nested=st.lists(st.tuples(st.sampled_from(["metadata", "extra"]), STREAM_VALUES), max_size=2),
    noise=st.dictionaries(st.sampled_from(["a", "b"]), JSON_VALUES, max_size=2),
    spaced=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_a_stream_read_from_the_bytes_is_never_other_than_the_parsed_reading(top, nested, noise, spaced) -> None:
    """Each route reads `stream` its own way (Ollama's native routes stream unless told false); the
    bytes are read only where every place a `"stream"` key could stand agrees, and then exactly."""
    body: dict[str, Any] = {"model": "m", **noise}
    for where, value in nested:
        body[where] = [{"arguments": {"stream": value}}]
    if top is not None:
        body["stream"] = top
    raw = json.dumps(body, separators=(", ", ": ") if spaced else (",", ":")).encode()
    for route in (ollama.CHAT, ollama.GENERATE, openai.CHAT, anthropic.MESSAGES, responses.RESPONSES, llamacpp.COMPLETION):
        read = route.streams(raw)
        parsed = route.parse({"prompt": "p", "input": "i", "messages": [], **body}).params.stream
        assert read in (None, parsed), (route.name, raw)


@pytest.mark.parametrize(
    ("route", "raw", "expected"),
    [
        (openai.CHAT, b'{"model": "m", "messages": []}', False),  # OpenAI's default, not said
        (openai.CHAT, b'{"model": "m", "stream": false}', False),
        (ollama.CHAT, b'{"model": "m", "messages": []}', True),  # Ollama's default
        (ollama.CHAT, b'{"model": "m", "stream": true}', True),
        (openai.CHAT, b'{"model": "m", "stream": true}', None),  # said, but it may be another object's
        (ollama.CHAT, b'{"model": "m", "stream": false}', None),
        (openai.CHAT, b'{"model": "m", "str\\u0065am": true}', None),  # a key spelled with an escaped letter
    ],
)
def test_a_stream_is_read_from_the_bytes_only_where_they_settle_it(route: wire.Route, raw: bytes, expected: bool | None) -> None:
    assert route.streams(raw) is expected
