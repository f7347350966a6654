"""The mitmproxy shell with taddons/tflow: options, hooks, local answers, failing open.

Each addon's unit tests load that addon alone on taddons' master (`alone`), as mitmproxy's own
addon tests do: only its options and hooks run, so no test passes or fails by another addon or by
the hook order. The composition tests at the end load all of them (`make_addons`) on purpose: the
hook order, and what only the addons together do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import connection, exceptions, hooks, http
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import mode_specs
from mitmproxy.proxy.layers.http import HttpRequestHeadersHook, HttpRequestHook, HttpResponseHeadersHook, HttpResponseHook
from mitmproxy.proxy.server_hooks import ServerConnectedHook, ServerConnectionHookData, ServerDisconnectedHook
from mitmproxy.test import taddons

from contextpaw import wire
from contextpaw.proxy.arbitration import Arbitration
from contextpaw.proxy.backends import BACKEND_HEADER, Backends
from contextpaw.proxy.compactor import Compactor
from contextpaw.proxy.compose import make_addons
from contextpaw.proxy.endpoints import AdminEndpoints
from contextpaw.proxy.replies import COMPACTED_MARK, REFUSED_MARK
from contextpaw.proxy.upstream import Upstream
from contextpaw.proxy.views import ORIGINAL
from contextpaw.relay.loopback import FLOW_HEADER
from contextpaw.settings import FitSettings
from contextpaw.wire.streams import StreamReport
from support.flows import CLOSED_PORT, LLAMACPP, OLLAMA, get, long_chat, ok_json, post, reverse, streamed, to_ollama
from support.inprocess import Proxy


@dataclass
class Alone[A]:
    """One addon loaded alone on taddons' master, with its hooks run as mitmproxy runs them."""

    tctx: taddons.context
    addon: A

    def configure(self, **options: Any) -> None:
        self.tctx.configure(self.addon, **options)

    async def run(self, *events: hooks.Hook) -> None:
        for event in events:
            await self.tctx.master.addons.invoke_addon(self.addon, event)

    async def send(self, flow: http.HTTPFlow) -> None:
        await self.run(HttpRequestHeadersHook(flow), HttpRequestHook(flow))

    async def answer(self, flow: http.HTTPFlow, response: http.Response | None = None) -> http.Response:
        if response is not None:
            flow.response = response
        await self.run(HttpResponseHeadersHook(flow), HttpResponseHook(flow))
        assert flow.response is not None
        return flow.response


@contextlib.contextmanager
def alone[A](kind: type[A]) -> Iterator[Alone[A]]:
    """The addon of class `kind`, wired to what it shares as `make_addons` wires it; the other
    addons are built but not loaded."""
    addon = next(a for a in make_addons() if isinstance(a, kind))
    with taddons.context(addon) as tctx:
        yield Alone(tctx, addon)


@pytest.fixture
async def compactor() -> AsyncIterator[Alone[Compactor]]:
    """The compactor alone; its flows name their backend (`to_ollama`), as a client may."""
    with alone(Compactor) as loaded:
        yield loaded
        loaded.addon.session.close()  # not left for the collector to find in another test
        await asyncio.sleep(0)


@pytest.fixture
async def backends() -> AsyncIterator[Alone[Backends]]:
    with alone(Backends) as loaded:
        loaded.configure(contextpaw_ollama=[OLLAMA], contextpaw_llamacpp=[LLAMACPP])
        yield loaded


@pytest.fixture
async def admin() -> AsyncIterator[Alone[AdminEndpoints]]:
    """The endpoints alone; its flows come through a reverse-mode listener (`reverse`), which serves
    every path without a configured backend."""
    with alone(AdminEndpoints) as loaded:
        yield loaded


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    """Every addon, in hook order: for the composition tests only."""
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        proxy = Proxy(tctx, addons)
        tctx.configure(proxy.backends, contextpaw_ollama=[OLLAMA], contextpaw_llamacpp=[LLAMACPP])
        yield proxy
        await proxy.close()


# -- options ----------------------------------------------------------------------------------------


async def test_a_misspelt_option_stops_mitmdump_with_the_script_naming_the_nearest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`mitmdump -s contextpaw_addon.py --set contextpaw_polcy=strict`: mitmproxy keeps the unknown
    option aside without a word; loading the script logs the error that stops mitmdump at start.
    Another script's options are left to mitmproxy."""
    from mitmproxy.addons import script

    loader = script.ScriptLoader()
    with taddons.context(loader) as tctx:
        tctx.options.set(f"confdir={tmp_path}", "contextpaw_polcy=strict", "someone_elses=1", defer=True)
        tctx.configure(loader, scripts=[str(Path(__file__).resolve().parents[2] / "contextpaw_addon.py")])
        for _ in range(3):  # mitmdump loads scripts in a task, before its first check for errors
            await asyncio.sleep(0)
        assert "contextpaw_policy" in tctx.options
        for loaded in loader.addons:
            loaded.done()  # its watcher
    errors = [r.getMessage() + str(r.exc_info and r.exc_info[1]) for r in caplog.records if r.levelname == "ERROR"]
    assert any("unknown option contextpaw_polcy (did you mean contextpaw_policy?)" in e for e in errors), errors
    assert not any("someone_elses" in e for e in errors)


def test_the_compactor_declares_one_option_per_fit_setting_defaulting_to_it(compactor: Alone[Compactor]) -> None:
    options = compactor.tctx.options
    declared = {name for name in options.keys() if name.startswith("contextpaw_")}
    assert declared == {f"contextpaw_{field.name}" for field in dataclasses.fields(FitSettings)}
    assert FitSettings.parse(options) == dataclasses.replace(FitSettings(), state_dir=Path(options.confdir).expanduser())


def test_fit_options_are_validated_with_a_clear_message(compactor: Alone[Compactor]) -> None:
    with pytest.raises(exceptions.OptionsError, match="contextpaw_policy"):
        compactor.configure(contextpaw_policy="lenient")
    with pytest.raises(exceptions.OptionsError, match="leave no room"):
        compactor.configure(contextpaw_default_ctx=1000)
    with pytest.raises(exceptions.OptionsError, match="contextpaw_keep_recent must be at least 0"):
        compactor.configure(contextpaw_keep_recent=-1)
    with pytest.raises(exceptions.OptionsError, match="contextpaw_evicted_ttl must be at most 315360000"):
        compactor.configure(contextpaw_evicted_ttl=10**30)  # Redis refused every write with it


def test_a_backend_url_is_validated_with_a_clear_message(backends: Alone[Backends]) -> None:
    with pytest.raises(exceptions.OptionsError, match="contextpaw_ollama"):
        backends.configure(contextpaw_ollama=["ftp://nope"])


def test_options_change_live(compactor: Alone[Compactor]) -> None:
    compactor.configure(contextpaw_default_ctx=32768, contextpaw_evicted_items=5)
    assert compactor.addon.fitter.budgeter.default_ctx == 32768
    assert compactor.addon.fitter.store.max_items == 5


# -- compaction (the compactor alone) ---------------------------------------------------------------


async def test_overflowing_chat_is_compacted_and_reported_everywhere(compactor: Alone[Compactor]) -> None:
    body = long_chat()
    flow = to_ollama("/api/chat", body)
    await compactor.send(flow)
    sent = json.loads(flow.request.content)
    assert len(sent["messages"]) < len(body["messages"])
    assert sent["options"] == body["options"]
    assert json.loads(flow.metadata[ORIGINAL]) == body
    assert flow.marked == COMPACTED_MARK

    response = await compactor.answer(flow, ok_json({"message": {"role": "assistant", "content": "ok"}, "done": True}))
    assert response.headers["X-ContextPaw-Compacted"] == "true"
    assert int(response.headers["X-ContextPaw-Final-Tokens"]) <= int(response.headers["X-ContextPaw-Budget"])
    report = json.loads(response.content)["contextpaw"]
    assert report["compacted"] and report["window"] == 2048 and report["evicted_tokens"] > 0
    for marker_id in report["markers"]:
        assert compactor.addon.fitter.store.get(marker_id.split(".")[0]) is not None  # kept by its id, never its capability
    assert compactor.addon.fitter.stats.counts["compacted"] == 1


async def test_the_next_turn_keeps_the_last_turns_evictions(compactor: Alone[Compactor]) -> None:
    body = long_chat()
    first = to_ollama("/api/chat", body)
    await compactor.send(first)
    assert len(compactor.addon.fitter.plans) == 1
    body["messages"] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    second = to_ollama("/api/chat", body)
    await compactor.send(second)
    assert len(compactor.addon.fitter.plans) == 1
    dropped = [{r.index for r in compactor.addon.states[f].report.removals if r.action == "dropped"} for f in (first, second)]
    assert dropped[0] and dropped[0] <= dropped[1]


async def test_a_chat_that_fits_is_forwarded_byte_for_byte(compactor: Alone[Compactor]) -> None:
    raw = b'{"model": "m",  "messages": [{"role": "user", "content": "hi \\u003c"}]}'
    flow = to_ollama("/api/chat", None, raw=raw)
    await compactor.send(flow)
    assert flow.request.content == raw and ORIGINAL not in flow.metadata
    response = await compactor.answer(flow, ok_json({"done": True}))
    assert response.headers["X-ContextPaw-Compacted"] == "false"


@pytest.mark.parametrize("raw", [b"{broken", b'{"messages": [{"content": "no role"}]}'])
async def test_malformed_client_json_is_forwarded_for_the_backend_to_answer(compactor: Alone[Compactor], raw: bytes) -> None:
    flow = to_ollama("/api/chat", None, raw=raw)
    await compactor.send(flow)
    assert flow.request.content == raw and flow.response is None
    assert compactor.addon.fitter.stats.counts["errors"] == 0


async def test_policy_off_changes_nothing_on_the_wire(compactor: Alone[Compactor]) -> None:
    compactor.configure(contextpaw_policy="off")
    body = long_chat()
    flow = to_ollama("/api/chat", body)
    await compactor.send(flow)
    assert json.loads(flow.request.content) == body
    answer = {"done": True, "prompt_eval_count": 100_000}  # more than the window: evaluated whole
    response = await compactor.answer(flow, ok_json(answer))
    assert json.loads(response.content) == answer and "X-ContextPaw-Compacted" not in response.headers
    assert flow.comment.startswith("ollama.chat: policy off, unchanged; would cut ")


async def test_strict_refuses_with_ollamas_error_shape(compactor: Alone[Compactor]) -> None:
    compactor.configure(contextpaw_policy="strict")
    flow = to_ollama("/api/chat", long_chat())
    await compactor.send(flow)
    assert flow.response is not None and flow.response.status_code == 400
    body = json.loads(flow.response.content)
    assert "policy strict" in body["error"] and "2048-token" in body["error"]
    assert body["contextpaw"]["strategy"] == "refused"
    response = await compactor.answer(flow)
    assert response.headers["X-ContextPaw-Compacted"] == "false"
    assert compactor.addon.fitter.stats.counts["refused"] == 1


async def test_strict_refuses_with_openais_error_shape(compactor: Alone[Compactor]) -> None:
    compactor.configure(contextpaw_policy="strict", contextpaw_default_ctx=2048)
    chat = long_chat()
    flow = to_ollama("/v1/chat/completions", {"model": "m", "messages": chat["messages"], "max_tokens": 100})
    await compactor.send(flow)
    error = json.loads(flow.response.content)["error"]
    assert error["code"] == "context_length_exceeded" and error["num_ctx"] == 2048
    assert error["budget"] == 2048 - 64 < error["n_prompt_tokens"]  # what llama-server would admit, max_tokens aside


async def test_what_must_be_kept_but_cannot_fit_is_refused_even_when_compacting(compactor: Alone[Compactor]) -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": "rule " * 4000}, {"role": "user", "content": "hi"}]}
    flow = to_ollama("/api/chat", body)
    await compactor.send(flow)
    assert flow.response.status_code == 400
    assert "system prompt" in json.loads(flow.response.content)["error"]


async def test_an_internal_error_fails_open(compactor: Alone[Compactor], monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("bug")

    monkeypatch.setattr("contextpaw.fitting.sizing.fit_chat", broken)
    body = long_chat()
    flow = to_ollama("/api/chat", body)
    await compactor.send(flow)
    assert json.loads(flow.request.content) == body and flow.response is None
    response = await compactor.answer(flow, ok_json({"done": True}))
    assert response.headers["X-ContextPaw-Error"].startswith("KeyError")
    assert response.status_code == 200
    assert compactor.addon.fitter.stats.counts["errors"] == 1


async def test_a_refused_flow_is_marked_and_commented(compactor: Alone[Compactor]) -> None:
    compactor.configure(contextpaw_policy="strict")
    flow = to_ollama("/api/chat", long_chat())
    await compactor.send(flow)
    assert flow.response.status_code == 400
    assert flow.marked == REFUSED_MARK and flow.comment.startswith("ollama.chat refused; fix: ")


async def test_a_compacted_flows_comment_leads_with_the_route_and_the_cut(compactor: Alone[Compactor]) -> None:
    flow = to_ollama("/api/chat", long_chat())
    await compactor.send(flow)
    report = compactor.addon.states[flow].report
    dropped = sum(1 for r in report.removals if r.action == "dropped")
    lead = f"ollama.chat: {report.original_tokens:,}→{report.final_tokens:,} tok, {dropped} dropped"
    assert dropped and flow.comment.startswith(lead) and len(lead) <= 60  # what mitmweb's narrow column shows first


async def test_a_strict_refusals_comment_says_the_fix(compactor: Alone[Compactor]) -> None:
    compactor.configure(contextpaw_policy="strict")
    flow = to_ollama("/api/chat", long_chat())
    await compactor.send(flow)
    report = compactor.addon.states[flow].report
    room = report.window - report.budget
    least = report.required_tokens + room  # the window that admits it whole
    assert flow.comment == (
        f"ollama.chat refused; fix: policy compact, or window ≥ {least:,} (contextpaw_policy=compact; "
        f"OLLAMA_CONTEXT_LENGTH={least} or num_ctx); {report.required_tokens:,} tok > {report.budget:,} budget"
    )


async def test_a_head_over_the_window_is_refused_with_the_least_window_as_the_fix(compactor: Alone[Compactor]) -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": "rule " * 4000}, {"role": "user", "content": "hi"}]}
    flow = to_ollama("/api/chat", body)
    await compactor.send(flow)
    overflow = compactor.addon.states[flow].overflow
    assert overflow is not None and overflow.least_window is not None
    fix = f"ollama.chat refused; fix: window ≥ {overflow.least_window:,} (OLLAMA_CONTEXT_LENGTH={overflow.least_window} or num_ctx)"
    assert flow.marked == REFUSED_MARK and flow.comment.startswith(fix)
    assert flow.comment.endswith(f"; {overflow.required:,} tok > {overflow.budget:,} budget")


async def test_an_upstream_cut_goes_into_the_flows_comment(compactor: Alone[Compactor]) -> None:
    compactor.configure(contextpaw_output_reserve=0, contextpaw_forbid_truncation=False)
    flow = to_ollama("/api/chat", long_chat(num_ctx=2048))
    await compactor.send(flow)
    sent = compactor.addon.states[flow].report.final_tokens
    answer = ok_json(
        {"model": "m", "message": {"role": "assistant", "content": "?"}, "done": True, "prompt_eval_count": 1024, "eval_count": 1}
    )  # Ollama's cut of a 2048 window
    await compactor.answer(flow, answer)
    assert flow.marked == ":warning:"
    assert flow.comment.startswith("ollama.chat: ")  # the compaction's line stays, the cut's follows
    assert f"the server cut the prompt: 1024 of {sent} tokens evaluated" in flow.comment


def gzipped_answer(body: bytes) -> http.Response:
    """An answer whose raw bytes are `body` gzipped (mitmproxy encodes what `make` is given)."""
    return http.Response.make(200, body, {"Content-Type": "application/json", "Content-Encoding": "gzip"})


async def test_a_compressed_answer_is_inflated_off_the_loop_and_carries_the_report(compactor: Alone[Compactor]) -> None:
    flow = to_ollama("/api/chat", long_chat())
    await compactor.send(flow)
    response = await compactor.answer(flow, gzipped_answer(json.dumps({"done": True, "prompt_eval_count": 900}).encode()))
    assert "content-encoding" not in response.headers
    assert json.loads(response.raw_content)["contextpaw"]["compacted"] is True


async def test_an_answer_that_inflates_past_the_limit_is_passed_on_as_it_came(compactor: Alone[Compactor]) -> None:
    """A 0.5 MB gzip that inflates to 512 MB stalled every client while mitmproxy decoded it on
    the event loop; now it is inflated in a thread, stopped at the limit, and passed on untouched."""
    shared = compactor.addon.backends  # the limit is contextpaw_max_body_mb, as the backends addon read it
    shared.settings = dataclasses.replace(shared.settings, max_body_bytes=1 << 20)
    flow = to_ollama("/api/chat", long_chat())
    await compactor.send(flow)
    bomb = gzipped_answer(b'{"done": true, "pad": "' + b" " * (4 << 20) + b'"}')
    sent = bomb.raw_content
    response = await compactor.answer(flow, bomb)
    assert response.raw_content == sent and response.headers["content-encoding"] == "gzip"
    assert response.headers["X-ContextPaw-Compacted"] == "true", "the headers still tell what was done"


# -- streams (the compactor alone) ------------------------------------------------------------------


async def test_streams_get_the_report_transformer_and_chunked_framing(compactor: Alone[Compactor]) -> None:
    flow = to_ollama("/api/chat", long_chat() | {"stream": True})
    await compactor.send(flow)
    flow.response = streamed("application/x-ndjson", content_length="100")
    await compactor.run(HttpResponseHeadersHook(flow))
    assert isinstance(flow.response.stream, StreamReport)
    assert "content-length" not in flow.response.headers
    assert flow.response.headers["transfer-encoding"] == "chunked"
    assert flow.response.headers["X-ContextPaw-Compacted"] == "true"


async def test_encoded_and_unhandled_streams_are_streamed_untouched(compactor: Alone[Compactor]) -> None:
    flow = to_ollama("/api/chat", long_chat() | {"stream": True})
    await compactor.send(flow)
    flow.response = streamed("application/x-ndjson", content_encoding="gzip")
    await compactor.run(HttpResponseHeadersHook(flow))
    assert flow.response.stream is True
    pull = get("/api/pull")
    pull.response = streamed("application/x-ndjson")
    await compactor.run(HttpResponseHeadersHook(pull))
    assert pull.response.stream is True


# -- backends (the backends addon alone) ------------------------------------------------------------


async def test_an_unreachable_backend_gets_a_json_502_in_the_callers_convention(backends: Alone[Backends]) -> None:
    backends.configure(contextpaw_llamacpp=[f"http://127.0.0.1:{CLOSED_PORT}"])
    flow = post("/v1/chat/completions", {"messages": []}, port=CLOSED_PORT)
    flow.server_conn.state = ConnectionState.CLOSED
    await backends.send(flow)
    assert flow.response.status_code == 502
    assert json.loads(flow.response.content)["error"]["code"] == "backend_unreachable"
    assert backends.addon.ledger.stats.counts["unreachable"] == 1


async def test_a_backend_connection_mitmproxy_holds_open_for_the_client_is_not_probed_again(
    backends: Alone[Backends], monkeypatch: pytest.MonkeyPatch
) -> None:
    probed, up = [], [True]

    async def answers(host: str, port: int) -> bool:
        probed.append((host, port))
        return up[0]

    monkeypatch.setattr(backends.addon, "answers", answers)
    backends.configure(contextpaw_llamacpp=[LLAMACPP, "http://10.0.0.7:8091"])

    async def sent(client: Any = None, host: str = "127.0.0.1") -> http.HTTPFlow:
        flow = post("/v1/chat/completions", {"messages": []}, port=8091)
        flow.request.host = host
        flow.client_conn = client or flow.client_conn
        flow.server_conn.state = ConnectionState.CLOSED  # lazily opened: not connected yet at the request hook
        await backends.send(flow)
        return flow

    async def held(flow: http.HTTPFlow, hook: type[hooks.Hook] = ServerConnectedHook) -> None:
        opened = connection.Server(address=(flow.request.host, 8091))
        await backends.run(hook(ServerConnectionHookData(opened, flow.client_conn)))

    first = await sent()
    assert first.response is None and len(probed) == 1, "a backend whose state is unknown is probed"
    await held(first)
    kept = await sent(first.client_conn)
    assert kept.response is None and len(probed) == 1, "the client's next request goes out on the open connection"
    await sent()
    assert len(probed) == 2, "another client's request opens a connection of its own: probed"
    multiplexed = await sent()
    multiplexed.client_conn.alpn = b"h2"
    await held(multiplexed)
    await sent(multiplexed.client_conn)
    assert len(probed) == 4, "mitmproxy opens a connection per stream for an HTTP/2 client: each is probed"
    remote = await sent(host="10.0.0.7")
    await held(remote)
    await sent(remote.client_conn, host="10.0.0.7")
    assert len(probed) == 6, "a remote host can vanish without closing the connection: probed"
    await held(first, ServerDisconnectedHook)
    up[0] = False
    closed = await sent(first.client_conn)
    assert closed.response is not None and closed.response.status_code == 502, "once it is closed, a dead backend gets the JSON 502"


async def test_regular_mode_handles_only_configured_destinations(backends: Alone[Backends]) -> None:
    flow = post("/api/chat", long_chat(), port=9999)
    await backends.send(flow)
    assert await backends.addon.backend_of(flow) is None
    named = post("/api/chat", long_chat(), port=9999)
    named.request.headers[BACKEND_HEADER] = "ollama"
    await backends.send(named)
    assert await backends.addon.backend_of(named) == wire.Backend.parse(wire.Kind.OLLAMA, "http://127.0.0.1:9999")


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1", "127.0.0.2", "LOCALHOST."])
async def test_regular_mode_matches_a_backend_by_address_whatever_loopback_name_is_used(backends: Alone[Backends], host: str) -> None:
    flow = post("/api/chat", long_chat())
    flow.request.host = host
    await backends.send(flow)
    assert await backends.addon.backend_of(flow) == wire.Backend.parse(wire.Kind.OLLAMA, OLLAMA)


async def test_regular_mode_does_not_take_another_host_for_a_loopback_backend(backends: Alone[Backends]) -> None:
    flow = post("/api/chat", long_chat())
    flow.request.host = "10.0.0.7"
    await backends.send(flow)
    assert await backends.addon.backend_of(flow) is None


async def test_health_lists_a_reverse_target_that_never_answered(backends: Alone[Backends]) -> None:
    backends.tctx.options.update(mode=[f"reverse:http://127.0.0.1:{CLOSED_PORT}@127.0.0.1:0"])
    rows = {row["url"]: row for row in await backends.addon.health()}
    assert rows[f"http://127.0.0.1:{CLOSED_PORT}"] == {
        "kind": None,
        "url": f"http://127.0.0.1:{CLOSED_PORT}",
        "answers": False,
        "last_error": None,
    }


async def test_reverse_mode_destinations_are_served(backends: Alone[Backends]) -> None:
    flow = get("/contextpaw/health", port=12345)
    flow.client_conn.proxy_mode = mode_specs.ProxyMode.parse("reverse:http://127.0.0.1:12345@127.0.0.1:0")
    assert backends.addon.serves(flow)


async def test_a_body_over_the_limit_is_marked_and_commented(backends: Alone[Backends]) -> None:
    backends.configure(contextpaw_max_body_mb=1)
    flow = post("/api/chat", None, raw=b'{"messages": [], "x": "' + b"a" * (2 << 20) + b'"}')
    await backends.send(flow)
    assert flow.response.status_code == 413
    assert flow.marked == REFUSED_MARK
    size = len(flow.request.raw_content)
    assert flow.comment == f"ollama.chat refused; fix: raise contextpaw_max_body_mb; body {size:,} B > 1,048,576 B limit"


# -- endpoints (the admin endpoints alone) ----------------------------------------------------------


async def test_endpoints_are_loopback_only_unless_a_token_is_given(admin: Alone[AdminEndpoints]) -> None:
    flow = reverse(get("/contextpaw/health", peer="192.168.1.20"))
    await admin.send(flow)
    assert flow.response.status_code == 403
    admin.tctx.options.update(contextpaw_admin_token="s3cret")
    allowed = reverse(get("/contextpaw/health", peer="192.168.1.20"))
    allowed.request.headers["X-ContextPaw-Token"] = "s3cret"
    await admin.send(allowed)
    assert allowed.response.status_code == 200
    mapped = reverse(get("/contextpaw/health", peer="::ffff:127.0.0.1"))
    await admin.send(mapped)
    assert mapped.response.status_code == 200


def test_a_listener_off_the_loopback_is_warned_about_at_start(admin: Alone[AdminEndpoints], caplog: pytest.LogCaptureFixture) -> None:
    admin.tctx.options.update(mode=["reverse:http://127.0.0.1:11435@127.0.0.1:11434", "reverse:http://127.0.0.1:8091@0.0.0.0:8092"])
    with caplog.at_level("WARNING", logger="contextpaw"):
        admin.addon.running()
    warned = [r.getMessage() for r in caplog.records if "not on the loopback" in r.getMessage()]
    assert len(warned) == 1 and "0.0.0.0" in warned[0]


async def test_reverse_mode_still_gives_the_backend_its_own_host(admin: Alone[AdminEndpoints]) -> None:
    admin.addon.rewrites_host = True
    flow = reverse(get("/api/tags"))
    flow.request.headers["Host"] = "attacker.example"
    await admin.send(flow)
    assert flow.request.host_header == "127.0.0.1:11435"


async def test_an_admin_endpoint_that_fails_answers_500_and_is_never_forwarded(
    admin: Alone[AdminEndpoints], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(method: str, path: str, backend: object, **access: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(admin.addon.admin, "answer", broken)
    flow = reverse(get("/contextpaw/health"))
    await admin.send(flow)
    assert flow.response is not None and flow.response.status_code == 500
    assert "RuntimeError" in json.loads(flow.response.content)["error"]


@pytest.mark.parametrize(
    ("host", "client", "refused"),
    [
        ("attacker.example", "127.0.0.1", True),  # a page whose name resolves to the loopback
        ("attacker.example:11434", "::1", True),
        ("localhost:11434", "127.0.0.1", False),
        ("127.0.0.1:11434", "127.0.0.1", False),
        ("printer.local", "127.0.0.1", False),
        (socket.gethostname(), "127.0.0.1", False),
        ("attacker.example", "192.168.1.20", False),  # a listener the operator opened: their call
    ],
)
async def test_a_backend_route_keeps_the_backends_own_host_check(
    admin: Alone[AdminEndpoints], host: str, client: str, refused: bool
) -> None:
    """Reverse mode gives the backend its own Host, so Ollama's DNS-rebinding check would always
    pass: a loopback client naming a Host Ollama would refuse is answered 403 here instead."""
    admin.addon.rewrites_host = True
    flow = reverse(get("/api/tags"))
    flow.request.headers["Host"] = host
    flow.client_conn.peername = (client, 50000)
    await admin.send(flow)
    assert (flow.response is not None and flow.response.status_code == 403) is refused
    if refused:
        assert "does not name this machine" in json.loads(flow.response.content)["error"]
        assert flow.comment.startswith("/api/tags refused; fix: call it by localhost, 127.0.0.1 or this machine's name; Host ")


def test_report_headers_replace_any_the_backend_sent_and_keep_the_rest() -> None:
    from contextpaw.proxy.replies import put_headers

    response = http.Response.make(200, b"{}", {"Content-Type": "application/json", "x-contextpaw-budget": "9", "Server": "s"})
    put_headers(response.headers, {"X-ContextPaw-Budget": "100", "X-ContextPaw-Compacted": "true"})
    assert response.headers.get_all("X-ContextPaw-Budget") == ["100"]
    assert response.headers["X-ContextPaw-Compacted"] == "true"
    assert response.headers["Server"] == "s" and response.headers["content-length"] == "2"


# -- start-up ---------------------------------------------------------------------------------------


def test_what_start_up_made_is_left_out_of_later_full_collections() -> None:
    import gc

    import contextpaw.proxy.heap
    from contextpaw.proxy.heap import StartupHeap

    frozen, contextpaw.proxy.heap._frozen = contextpaw.proxy.heap._frozen, False
    try:
        StartupHeap().running()
        assert gc.get_freeze_count() > 1000
        before = gc.get_freeze_count()
        StartupHeap().running()  # a reloaded script
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()
        contextpaw.proxy.heap._frozen = frozen


async def test_the_relay_starts_and_stops_with_sync_hooks_as_a_reloaded_script_calls_them() -> None:
    """mitmproxy calls a reloaded script's `running` and `done` synchronously: they must not be async."""
    import asyncio

    with alone(Upstream) as upstream:
        upstream.tctx.master.addons.invoke_addon_sync(upstream.addon, hooks.RunningHook())
        relay = upstream.addon.relay
        for _ in range(100):
            if relay.address is not None:
                break
            await asyncio.sleep(0.01)
        assert relay.address is not None and relay.address[0] == "127.0.0.1"
        upstream.tctx.master.addons.invoke_addon_sync(upstream.addon, hooks.DoneHook())
        assert relay.address is None


# -- composition: every addon, as make_addons orders them (on purpose) ------------------------------


def test_composed_addons_are_in_hook_order_and_exported_for_embedding() -> None:
    from contextpaw.proxy.deadlines import RequestDeadlines
    from contextpaw.proxy.heap import ReturnedMemory, StartupHeap
    from contextpaw.proxy.model_routes import ModelRoutes
    from contextpaw.proxy.request_log import RequestLog

    assert [type(a) for a in make_addons()] == [
        StartupHeap,
        ReturnedMemory,
        RequestDeadlines,
        Arbitration,
        AdminEndpoints,
        Backends,
        Compactor,
        ModelRoutes,
        Upstream,
        RequestLog,
    ]


async def test_composed_proxy_passes_unhandled_routes_through_untouched(proxy: Proxy) -> None:
    """Untouched but for ContextPaw's loop mark (X-ContextPaw-Hop), which goes to the backend and is
    taken off again when the answer comes, so saved flows show the client's request."""
    flow = get("/api/tags")
    before = flow.request.get_state()
    await proxy.send(flow)
    assert flow.request.headers["X-ContextPaw-Hop"] == proxy.backends.mark and not flow.metadata
    response = await proxy.answer(flow, ok_json({"models": []}))
    assert flow.request.get_state() == before
    assert "X-ContextPaw-Compacted" not in response.headers


async def test_composed_proxy_answers_health_locally_with_every_backend(proxy: Proxy) -> None:
    flow = get("/contextpaw/health")
    await proxy.send(flow)
    health = json.loads(flow.response.content)
    assert health["policy"] == "compact" and {"requests", "compacted", "errors"} <= set(health["stats"])
    assert {b["kind"] for b in health["backends"]} == {"ollama", "llamacpp"}
    response = await proxy.answer(flow)
    assert "X-ContextPaw-Compacted" not in response.headers


async def test_composed_proxy_counts_its_own_compactions_in_prometheus_text(proxy: Proxy) -> None:
    await proxy.send(post("/api/chat", long_chat()))
    flow = get("/contextpaw/metrics")
    await proxy.send(flow)
    text = flow.response.text
    assert flow.response.headers["content-type"].startswith("text/plain")
    where = 'backend="ollama",model="m",route="ollama.chat"'
    assert f"contextpaw_compacted_total{{{where}}} 1.0" in text and f"contextpaw_requests_total{{{where}}} 1.0" in text
    assert next(a for a in make_addons() if isinstance(a, Compactor)).fitter.stats.counts["compacted"] == 0  # no global registry


async def test_composed_proxy_serves_evicted_content_again(proxy: Proxy) -> None:
    body = long_chat()
    flow = post("/api/chat", body)
    await proxy.send(flow)
    await proxy.answer(flow, ok_json({"done": True}))
    removals = json.loads(flow.response.content)["contextpaw"]["removals"]
    marker_id = next(r["marker_id"] for r in removals if r["action"] == "dropped")
    fetch = get(f"/contextpaw/evicted/{marker_id}")
    await proxy.send(fetch)
    got = json.loads(fetch.response.content)
    dropped = [body["messages"][r["index"]] for r in removals if r["marker_id"] == marker_id]
    assert got == {"id": marker_id, "content": dropped}
    missing = get("/contextpaw/evicted/cp-000000000000")
    await proxy.send(missing)
    assert missing.response.status_code == 404


async def test_composed_proxy_inflates_a_compressed_request_once_and_carries_and_rescues_it_decoded(proxy: Proxy) -> None:
    """A gzip request is inflated off the loop (backends) and goes on decoded, fitted (compactor)
    and carried (upstream); when it comes back 400, the relay's retry is the compacted body, smaller."""
    from support.common import context_overflow_error

    chat = {**long_chat(turns=6, num_ctx=8192), "stream": True}  # it may stream: the relay carries it
    flow = post("/api/chat", chat)
    flow.request.headers["content-encoding"] = "gzip"
    flow.request.content = json.dumps(chat).encode()  # mitmproxy encodes it
    assert flow.request.raw_content != flow.request.content
    flow.request.headers[FLOW_HEADER] = "forged by the client"
    flow.live = True
    proxy.upstream.relay.address = ("127.0.0.1", CLOSED_PORT)  # as if it listened: the flow is relayed
    await proxy.send(flow)
    assert flow.server_conn.via == ("http", ("127.0.0.1", CLOSED_PORT))
    assert "content-encoding" not in flow.request.headers
    carried = flow.request.raw_content
    sent = len(json.loads(carried)["messages"])
    answer = json.dumps({"error": json.dumps(context_overflow_error(3000, 2048))}).encode()
    assert flow.request.headers[FLOW_HEADER] == flow.id, "the key is ours, never the client's"
    decide = proxy.upstream.relay.rescue(flow.id)
    assert decide is not None and proxy.upstream.relay.rescue("another flow") is None
    retry = await decide(400, answer)
    assert isinstance(retry, bytes) and len(json.loads(retry)["messages"]) < sent
    assert flow.request.raw_content == carried, "the live flow is not changed"
    flow.response = http.Response.make(200, b"{}")
    proxy.upstream.response(flow)
    assert proxy.upstream.relay.rescue(flow.id) is None and FLOW_HEADER not in flow.request.headers, "forgotten once answered"


async def test_an_answer_over_the_limit_is_passed_on_unread_and_says_so(
    compactor: Alone[Compactor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsing holds the interpreter's lock even in a worker thread: a 300 MB answer stalled every
    other client for seconds. One over the limit is not parsed at all."""
    shared = compactor.addon.backends
    shared.settings = dataclasses.replace(shared.settings, max_body_bytes=1 << 20)
    flow = to_ollama("/api/chat", long_chat())
    await compactor.send(flow)
    huge = b'{"done": true, "prompt_eval_count": 900, "pad": "' + b" " * (2 << 20) + b'"}'
    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("an answer over the limit was parsed"))
    response = await compactor.answer(flow, http.Response.make(200, huge, {"Content-Type": "application/json"}))
    assert response.raw_content == huge and "passed on unread" in response.headers["X-ContextPaw-Error"]


def test_the_options_page_lists_every_option_with_its_default_as_the_addons_declare_it() -> None:
    """docs/options.md is checked against what the addons load, so it cannot drift from them."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "options.md").read_text()
    documented = {
        m["name"]: m["default"].strip()
        for m in re.finditer(r"^\| `(?P<name>contextpaw_\w+)` \| [^|]+ \| (?P<default>[^|]+) \|", page, re.M)
    }
    with taddons.context(*make_addons()) as tctx:
        declared = {name: tctx.options._options[name].default for name in tctx.options.keys() if name.startswith("contextpaw_")}
    assert documented.keys() == declared.keys()
    for name, default in declared.items():  # an empty default may be shown as what it comes to
        assert default in (None, "", []) or documented[name] == str(default), name
