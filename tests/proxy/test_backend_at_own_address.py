"""A backend that is ContextPaw's own address: refused at start with the fix, and a request that
comes back round anyway (a port forward, a name only DNS knows) answered 508, never sent again."""

from __future__ import annotations

import json

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons

from contextpaw.proxy.backends import HOP_HEADER, Backends, own_address
from contextpaw.proxy.compose import make_addons
from support.flows import OLLAMA, post


def backends_alone() -> tuple[Backends, taddons.context]:
    addon = next(a for a in make_addons() if isinstance(a, Backends))
    return addon, taddons.context(addon)


@pytest.mark.parametrize(
    "options",
    [
        {"contextpaw_ollama": ["http://127.0.0.1:11434"], "mode": ["reverse:http://127.0.0.1:11434@127.0.0.1:11434"]},
        {"contextpaw_ollama": ["http://localhost:11434"], "mode": ["regular@127.0.0.1:11434"]},
        {"contextpaw_ollama": ["http://[::1]:11434"], "mode": ["regular"], "listen_port": 11434, "listen_host": ""},
        {"contextpaw_llamacpp": ["http://127.0.0.1:8080"], "mode": ["regular"], "listen_host": "0.0.0.0"},
        {"mode": ["reverse:http://localhost:9000@9000"]},
    ],
)
def test_a_backend_at_contextpaws_own_listen_address_is_refused_at_start_with_the_fix(options: dict) -> None:
    addon, context = backends_alone()
    with context as tctx, pytest.raises(exceptions.OptionsError) as refused:
        tctx.configure(addon, **options)
    said = str(refused.value)
    assert "ContextPaw's own listen address" in said and "OLLAMA_HOST=127.0.0.1:11435" in said


@pytest.mark.parametrize(
    "options",
    [
        {"contextpaw_ollama": ["http://127.0.0.1:11435"], "mode": ["reverse:http://127.0.0.1:11435@127.0.0.1:11434"]},
        {"contextpaw_ollama": ["http://10.1.2.3:11434"], "mode": ["regular@127.0.0.1:11434"]},
    ],
)
def test_a_backend_elsewhere_is_not_a_loop(options: dict) -> None:
    addon, context = backends_alone()
    with context as tctx:
        tctx.configure(addon, **options)


def test_loopback_aliases_are_one_address() -> None:
    assert own_address("localhost", 1, [("127.0.0.1", 1)]) == ("127.0.0.1", 1)
    assert own_address("0.0.0.0", 1, [("::1", 1)]) == ("::1", 1)
    assert own_address("192.168.1.9", 1, [("", 1)]) is None
    assert own_address("127.0.0.1", 2, [("", 1)]) is None


async def _answers(host: str, port: int) -> bool:
    return True


async def test_a_request_carrying_contextpaws_own_mark_is_answered_508_in_the_callers_shape() -> None:
    addon, context = backends_alone()
    addon.answers = _answers  # type: ignore[method-assign]
    with context as tctx:
        tctx.configure(addon, contextpaw_ollama=[OLLAMA])
        first = post("/v1/chat/completions", {"model": "m", "messages": []})
        await tctx.master.addons.invoke_addon(addon, _request(first))
        mark = first.request.headers[HOP_HEADER]
        assert first.response is None and addon.mark in mark
        back = post("/v1/chat/completions", {"model": "m", "messages": []})
        back.request.headers[HOP_HEADER] = mark
        await tctx.master.addons.invoke_addon(addon, _request(back))
        assert back.response is not None and back.response.status_code == 508
        assert "came back to ContextPaw from itself" in json.loads(back.response.content)["error"]["message"]


async def test_another_contextpaws_mark_goes_on_with_this_ones_added() -> None:
    addon, context = backends_alone()
    addon.answers = _answers  # type: ignore[method-assign]
    with context as tctx:
        tctx.configure(addon, contextpaw_ollama=[OLLAMA])
        flow = post("/api/chat", {"model": "m", "messages": []})
        flow.request.headers[HOP_HEADER] = "someone-else"
        await tctx.master.addons.invoke_addon(addon, _request(flow))
        assert flow.response is None
        assert flow.request.headers[HOP_HEADER] == f"someone-else, {addon.mark}"


def _request(flow):  # type: ignore[no-untyped-def]
    from mitmproxy.proxy.layers.http import HttpRequestHook

    return HttpRequestHook(flow)
