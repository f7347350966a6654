"""The operator's line for each handled request (`RequestLog`), composed (`make_addons`) on mitmproxy's
test master, with the two options of mitmproxy's that decide it declared as mitmdump declares them:
a request that was changed is always told at INFO; one that went on unchanged is told at INFO only
where no flow line of mitmproxy's names it, at DEBUG beside one, and not made at all where the
terminal would not show it (a line costs the same under mitmproxy, shown or not).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
from mitmproxy.test import taddons

from contextpaw.proxy.compose import make_addons
from contextpaw.proxy.request_log import RequestLog
from support.flows import LLAMACPP, OLLAMA, long_chat, ok_json, post
from support.inprocess import Proxy

LOGGER = "contextpaw.proxy.request_log"
SMALL = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": False}


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        tctx.options.add_option("flow_detail", int, 1, "mitmdump's flow lines")
        tctx.options.add_option("termlog_verbosity", str, "info", "what mitmproxy's terminal log shows")
        proxy = Proxy(tctx, addons)
        tctx.configure(proxy.backends, contextpaw_ollama=[OLLAMA], contextpaw_llamacpp=[LLAMACPP])
        yield proxy


def shown(proxy: Proxy, **options: object) -> None:
    log = next(a for a in proxy.addons if isinstance(a, RequestLog))
    proxy.tctx.configure(log, **options)


async def lines(proxy: Proxy, body: dict, caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The request log's records for one request to Ollama's chat, answered 200."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, LOGGER):
        flow = post("/api/chat", body)
        await proxy.send(flow)
        await proxy.answer(flow, ok_json({"message": {"role": "assistant", "content": "hi"}, "done": True}))
    return [r for r in caplog.records if r.name == LOGGER]


async def test_an_unchanged_request_is_told_at_info_where_no_flow_line_of_mitmproxys_names_it(
    proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """The `contextpaw` command's default (`flow_detail` 0): its line is the only one a request gets."""
    shown(proxy, flow_detail=0)
    [record] = await lines(proxy, SMALL, caplog)
    assert record.levelno == logging.INFO and record.getMessage().startswith("POST /api/chat ollama.chat m: unchanged")


async def test_beside_mitmproxys_flow_line_an_unchanged_request_is_told_only_where_debug_is_shown(
    proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    assert await lines(proxy, SMALL, caplog) == [], "mitmdump's default: the flow line names it, no record is made"
    shown(proxy, termlog_verbosity="debug")
    [record] = await lines(proxy, SMALL, caplog)
    assert record.levelno == logging.DEBUG and "unchanged" in record.getMessage()


async def test_under_q_no_record_is_made_for_an_unchanged_request(proxy: Proxy, caplog: pytest.LogCaptureFixture) -> None:
    shown(proxy, flow_detail=0, termlog_verbosity="error")
    assert await lines(proxy, SMALL, caplog) == []


async def test_a_compacted_request_is_told_at_info_whatever_mitmproxy_shows(proxy: Proxy, caplog: pytest.LogCaptureFixture) -> None:
    """Mitmweb's event log and an embedder's handlers get it too: a cut is always told."""
    shown(proxy, termlog_verbosity="error")
    [record] = await lines(proxy, long_chat(), caplog)
    assert record.levelno == logging.INFO and "compacted" in record.getMessage()


async def test_a_refusal_is_told_with_its_reason_and_the_fix(proxy: Proxy, caplog: pytest.LogCaptureFixture) -> None:
    """The line said the numbers alone ("refused: 9,000 tokens, 9,000 needed"): not why, nor what to do."""
    proxy.tctx.configure(proxy.compactor, contextpaw_policy="strict")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, LOGGER):
        flow = post("/api/chat", long_chat())
        await proxy.send(flow)
        await proxy.answer(flow)
    [record] = [r for r in caplog.records if r.name == LOGGER]
    said = record.getMessage()
    assert ": refused: " in said and "policy strict refuses to compact it" in said, said
