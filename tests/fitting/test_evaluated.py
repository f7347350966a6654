"""Every answered request leaves its `Evaluated` sample (the server's count of the prompt, with the
route, model and conversation), on every route, streamed or not: the Compactor's hooks on
mitmproxy's test master, each answer the fake Ollama's own to what ContextPaw sent it.

Issue 38: "contextpaw-calibration.json stayed empty after 39 answered /v1/messages requests, each
carrying usage.input_tokens; the same for /v1/responses and for a client sending max_tokens: 32000
on /v1/chat/completions". And issue 39: a header never says something impossible ("2051 of 1678
tokens evaluated"): where the server counted more than we did, the server is trusted, and a note
says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy.layers.http import HttpRequestHeadersHook, HttpRequestHook, HttpResponseHeadersHook, HttpResponseHook
from mitmproxy.test import taddons, tflow, tutils

from contextpaw import wire
from contextpaw.fitting.answers import Evaluated
from contextpaw.proxy.backends import BACKEND_HEADER
from contextpaw.proxy.compactor import Compactor
from contextpaw.proxy.compose import make_addons
from contextpaw.wire.streams import StreamReport
from support.backends import Backend, start_module

WINDOW = 32768
WORDS = ("alpha", "beta", "gamma", "delta", "result", "value")


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    log = tmp_path_factory.mktemp("evaluated") / "ollama.log"
    with start_module("support.fake_ollama", ["--n-ctx", str(WINDOW), "--train-ctx", str(WINDOW), "--model", "fake"], "/", log) as backend:
        yield backend


@contextlib.asynccontextmanager
async def compactor(policy: str, state: Path) -> AsyncIterator[taddons.context]:
    addon = next(a for a in make_addons() if isinstance(a, Compactor))
    with taddons.context(addon) as tctx:
        tctx.configure(addon, contextpaw_policy=policy, contextpaw_state_dir=str(state))
        yield tctx
        addon.session.close()  # not left for the collector to find in another test
        await asyncio.sleep(0)


async def hooks(tctx: taddons.context, flow: http.HTTPFlow, *events: Any) -> None:
    addon = next(a for a in tctx.master.addons.chain if isinstance(a, Compactor))
    for event in events:
        await tctx.master.addons.invoke_addon(addon, event)


def prose(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def body(route: str, stream: bool, words: int = 12000) -> dict[str, Any]:
    """A request past the size proof (64 KB): it is parsed, and has a conversation key."""
    chat = [{"role": "user", "content": f"Note {i}: {prose(words // 4, i)}"} for i in range(4)]
    chat = [m for pair in zip(chat, [{"role": "assistant", "content": "Noted."}] * 4) for m in pair] + [
        {"role": "user", "content": "Well?"}
    ]
    if route == "/v1/messages":
        return {"model": "fake", "stream": stream, "system": "Be brief.", "messages": chat, "max_tokens": 8}
    if route == "/v1/responses":
        kind = {"user": "input_text", "assistant": "output_text"}
        items = [{"type": "message", "role": m["role"], "content": [{"type": kind[m["role"]], "text": m["content"]}]} for m in chat]
        return {"model": "fake", "stream": stream, "instructions": "Be brief.", "input": items, "max_output_tokens": 8}
    return {"model": "fake", "stream": stream, "messages": [{"role": "system", "content": "Be brief."}, *chat], "max_tokens": 32000}


def server_count(route: str, text: str) -> int:
    """The prompt count the fake's own answer carries (its last one: Anthropic's start is a guess)."""
    counts = []
    for line in text.splitlines():
        line = line.strip().removeprefix("data:").strip()
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        counted = wire.route_for(wire.Kind.OLLAMA, "POST", route).evaluated(record)  # type: ignore[union-attr]
        if counted is not None:
            counts.append(counted)
    assert counts, text[-300:]
    return counts[-1]


async def through(tctx: taddons.context, fake: Backend, route: str, sent_body: dict[str, Any]) -> tuple[http.HTTPFlow, bytes, bytes]:
    """One request through the Compactor's hooks; the answer is the fake's own to what was sent.
    Returns the flow, what the server answered, and what the client got."""
    flow = tflow.tflow(req=tutils.treq(host="127.0.0.1", port=urlsplit(fake.url).port, path=route.encode(), method=b"POST",
                                       headers=http.Headers(content_type="application/json"), content=b""))  # fmt: skip
    flow.request.content = json.dumps(sent_body).encode()
    flow.request.headers[BACKEND_HEADER] = "ollama"
    flow.server_conn.state = ConnectionState.OPEN
    await hooks(tctx, flow, HttpRequestHeadersHook(flow), HttpRequestHook(flow))
    async with httpx.AsyncClient(timeout=60) as client:
        answer = await client.post(fake.url + route, content=flow.request.content, headers={"Content-Type": "application/json"})
    flow.response = http.Response.make(answer.status_code, answer.content, {"Content-Type": answer.headers["content-type"]})
    await hooks(tctx, flow, HttpResponseHeadersHook(flow))
    stream = flow.response.stream
    if isinstance(stream, StreamReport):
        got = b"".join(stream(answer.content) + stream(b""))
        await hooks(tctx, flow, HttpResponseHook(flow))
    else:
        await hooks(tctx, flow, HttpResponseHook(flow))
        got = flow.response.content or b""
    return flow, answer.content, got


@pytest.mark.parametrize("policy", ["compact", "off"])
@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize("route", ["/v1/messages", "/v1/responses", "/v1/chat/completions"])
async def test_every_answered_request_leaves_its_evaluated_count_with_route_model_and_conversation(
    fake: Backend, tmp_path: Path, route: str, stream: bool, policy: str
) -> None:
    async with compactor(policy, tmp_path) as tctx:
        addon = next(a for a in tctx.master.addons.chain if isinstance(a, Compactor))
        request = body(route, stream)
        flow, answered, _ = await through(tctx, fake, route, request)
        assert flow.response is not None and flow.response.status_code == 200, answered[-300:]
        parsed = wire.route_for(wire.Kind.OLLAMA, "POST", route).read(json.dumps(request).encode())  # type: ignore[union-attr]
        key = wire.keyed(parsed, addon.fitter.secret).key  # type: ignore[union-attr]
        evaluated = addon.fitter.answers.evaluated(key)
        assert isinstance(evaluated, Evaluated), "no sample of the answer's count"
        assert evaluated.prompt_tokens == server_count(route, answered.decode())
        assert evaluated.route == wire.route_for(wire.Kind.OLLAMA, "POST", route).name  # type: ignore[union-attr]
        assert evaluated.model == "fake" and evaluated.conversation == key and evaluated.window == WINDOW
        assert evaluated.sent_tokens_estimate is not None and not evaluated.certain_cut
        assert addon.fitter.answers.last == evaluated


async def test_a_streamed_chat_is_sent_asking_for_usage_and_its_client_gets_none(fake: Backend, tmp_path: Path) -> None:
    async with compactor("off", tmp_path) as tctx:
        request = body("/v1/chat/completions", True)
        flow, answered, got = await through(tctx, fake, "/v1/chat/completions", request)
        assert json.loads(flow.request.content or b"")["stream_options"] == {"include_usage": True}
        assert b'"usage"' in answered and b'"usage"' not in got
        assert got.count(b"data: ") == answered.count(b"data: ") - 1 and got.rstrip().endswith(b"data: [DONE]")


async def test_a_server_count_above_ours_is_trusted_and_no_header_says_the_impossible(tmp_path: Path) -> None:
    """Twelve tool definitions our estimate undercounts: the server evaluates 2051 of a prompt we
    counted at about 1678, and 2051 is what Ollama's token-level cut of a 4096 window leaves."""
    async with compactor("off", tmp_path) as tctx:
        tools = [
            {"type": "function", "function": {"name": f"tool_{i}", "description": "d", "parameters": {"type": "object"}}} for i in range(12)
        ]
        request = {"model": "m", "stream": False, "options": {"num_ctx": 4096, "num_predict": 8}, "tools": tools,
                   "messages": [{"role": "user", "content": prose(600, 1)}]}  # fmt: skip
        flow = tflow.tflow(req=tutils.treq(host="127.0.0.1", port=9, path=b"/api/chat", method=b"POST",
                                           headers=http.Headers(content_type="application/json"), content=json.dumps(request).encode()))  # fmt: skip
        flow.request.headers[BACKEND_HEADER] = "ollama"
        flow.server_conn.state = ConnectionState.OPEN
        await hooks(tctx, flow, HttpRequestHeadersHook(flow), HttpRequestHook(flow))
        answer = {"model": "m", "message": {"role": "assistant", "content": "?"}, "done": True, "prompt_eval_count": 2051, "eval_count": 1}
        flow.response = http.Response.make(200, json.dumps(answer), {"Content-Type": "application/json; charset=utf-8"})
        await hooks(tctx, flow, HttpResponseHeadersHook(flow), HttpResponseHook(flow))
        header = (
            flow.response.headers.get("X-ContextPaw-Upstream-Truncated")
            or flow.response.headers["X-ContextPaw-Upstream-Truncation-Possible"]
        )
        numbers = [int(word) for word in header.replace(",", " ").split() if word.isdigit()]
        assert numbers[0] == 2051 and numbers[1] >= 2051, header
        report = json.loads(flow.response.content or b"")["contextpaw"]
        cut = report.get("upstream_truncated") or report["upstream_truncation_possible"]
        assert cut["sent_tokens"] >= cut["evaluated_tokens"] == 2051
        assert any("the server's count is trusted" in note for note in report["notes"]), (header, report)
