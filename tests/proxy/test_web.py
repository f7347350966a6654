"""mitmweb's flow list laid out for ContextPaw's comments: mitmweb's stylesheet, served with the
comment column widened, through a tornado app like mitmweb's (the browser check is
scripts/demo/screenshot_mitmweb.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import tornado.httpserver
import tornado.netutil
import tornado.web

from contextpaw.proxy.web import COMMENT_RULE, widen_comments

CSS = b".flow-table .col-comment{width:150px}"


@pytest.fixture
async def web(tmp_path: Path) -> AsyncIterator[tuple[tornado.web.Application, str]]:
    """A tornado app that serves `tmp_path` as its static files, as mitmweb's does, and its URL."""
    (tmp_path / "index-Bg4_x-9.css").write_bytes(CSS)
    app = tornado.web.Application([], static_path=str(tmp_path))
    sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
    server = tornado.httpserver.HTTPServer(app)
    server.add_sockets(sockets)
    yield app, f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
    server.stop()


async def fetch(url: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.get(url) as answer:
        return answer.status, await answer.read()


async def test_mitmwebs_stylesheet_is_served_with_the_comment_column_widened(web: tuple[tornado.web.Application, str]) -> None:
    app, url = web
    assert widen_comments(SimpleNamespace(app=app))
    status, css = await fetch(f"{url}/static/index-Bg4_x-9.css")
    assert status == 200 and css == CSS + COMMENT_RULE  # after mitmweb's own rule, so it wins
    assert b".flow-table .col-comment{width:50%}" in css


async def test_only_a_stylesheet_that_is_there_is_served(web: tuple[tornado.web.Application, str]) -> None:
    app, url = web
    widen_comments(SimpleNamespace(app=app))
    assert (await fetch(f"{url}/static/index-missing.css"))[0] == 404
    assert (await fetch(f"{url}/static/index-..%2Fsecret.css"))[0] == 404


def test_mitmdump_has_no_web_app_to_change() -> None:
    assert not widen_comments(SimpleNamespace())
    assert not widen_comments(SimpleNamespace(app=None))
