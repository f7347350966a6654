"""The recorder's log: what a test reads once its client is done holds every exchange."""

import asyncio
from pathlib import Path

import httpx
from aiohttp import web

from support.common import running
from support.recorder import read_log, recorder_app

LAST_RECORD = b"data: [DONE]\n\n"


def lingering_app(linger: float) -> web.Application:
    """A target that streams its whole answer, then holds the stream open ``linger`` seconds before
    ending it, as a server does while it finishes its own bookkeeping."""

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(LAST_RECORD)
        await asyncio.sleep(linger)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    return app


def test_an_exchange_the_client_has_finished_is_in_the_log_even_before_its_stream_ends(tmp_path: Path) -> None:
    """A client can have its last record, and exit, before the target's stream ends; an agent test
    that reads the log right then must still see that request (CI once missed Claude Code's turn)."""
    log = tmp_path / "sent.jsonl"
    with running(lingering_app(0.5)) as target, running(recorder_app(target, log)) as front:
        with httpx.Client() as client, client.stream("POST", f"{front}/v1/chat/completions", json={"n": 1}) as reply:
            for chunk in reply.iter_raw():
                if LAST_RECORD in chunk:
                    break
        exchanges = read_log(log)
    assert [e["body"] for e in exchanges] == [{"n": 1}]
    assert exchanges[0]["response"]["status"] == 200
    assert LAST_RECORD.decode() in exchanges[0]["response"]["body"]
