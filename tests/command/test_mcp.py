"""`contextpaw mcp`: the real server, started as the agent starts it (`contextpaw mcp` on stdio) and
driven by the MCP SDK's own client, against a fake ContextPaw that answers the archive's endpoints
(`/contextpaw/evicted/<ref>`, `/contextpaw/search`) as the proxy does."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from contextpaw.core import parts

REPO = Path(__file__).parents[2]
TOKEN = "t" * 43
CAPPED = "cp-0123456789ab.0011223344556677"
"""A reference as the marker shows it: the id and its capability."""
SECRET_ONLY = "cp-ba9876543210"
"""An id without capability: readable by a token holder only."""
LONG = "cp-00000000000a.0000000000000001"
"""A text past one result's size: many lines, then one line longer than a part."""
KEPT: dict[str, Any] = {
    CAPPED: [{"role": "tool", "content": "DB_PASSWORD=hunter2\nline two ✓"}],
    SECRET_ONLY: "the whole build log\n",
    LONG: "".join(f"line {i:05d} é\n" for i in range(3000)) + "x✓" * 9000,
}


class FakeContextPaw:
    """The proxy's archive endpoints, per the contract: a reference with its capability reads
    without a token, a bare id only with the operator's token, search only with a token; unknown and
    forbidden are the same 404."""

    def __init__(self) -> None:
        self.tokens: list[str | None] = []
        self.queries: list[dict[str, str]] = []
        self.sessions: list[str | None] = []
        self.app = web.Application()
        self.app.router.add_get("/contextpaw/health", self.health)
        self.app.router.add_get("/contextpaw/evicted/{ref}", self.evicted)
        self.app.router.add_get("/contextpaw/search", self.search)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "fake"})

    async def evicted(self, request: web.Request) -> web.Response:
        ref = request.match_info["ref"]
        token = request.headers.get("X-ContextPaw-Token")
        self.tokens.append(token)
        allowed = "." in ref or token == TOKEN
        if ref not in KEPT or not allowed:
            return web.json_response({"error": "nothing is kept under this reference"}, status=404)
        return web.json_response({"id": ref, "content": KEPT[ref]})

    async def search(self, request: web.Request) -> web.Response:
        self.queries.append(dict(request.query))
        self.sessions.append(request.headers.get("X-ContextPaw-Session"))
        if request.headers.get("X-ContextPaw-Token") != TOKEN:
            return web.json_response({"error": "searching the archive needs X-ContextPaw-Token"}, status=403)
        words = request.query.get("q", "").lower().split()
        results = [
            {"ref": ref, "snippet": str(content)[:60]} for ref, content in KEPT.items() if all(w in str(content).lower() for w in words)
        ]
        return web.json_response({"results": results[: int(request.query.get("limit", "10"))]})


@pytest.fixture
async def proxy() -> AsyncIterator[tuple[FakeContextPaw, str]]:
    fake = FakeContextPaw()
    server = TestServer(fake.app, host="127.0.0.1")
    await server.start_server()
    try:
        yield fake, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@asynccontextmanager
async def mcp_session(*args: str) -> AsyncIterator[ClientSession]:
    """`contextpaw mcp ARGS` as a subprocess, initialized."""
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "contextpaw.command.cli", "mcp", *args], cwd=REPO, env={"PYTHONPATH": str(REPO)}
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


def text(result: Any) -> str:
    return "".join(block.text for block in result.content if getattr(block, "type", "") == "text")


async def test_the_server_offers_retrieve_and_search_with_descriptions_a_model_follows(
    proxy: tuple[FakeContextPaw, str], tmp_path: Path
) -> None:
    _, url = proxy
    async with mcp_session("--url", url, "--state-dir", str(tmp_path)) as session:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
    assert set(tools) == {"contextpaw_retrieve", "contextpaw_search"}
    assert "[ContextPaw: " in tools["contextpaw_retrieve"].description and "verbatim" in tools["contextpaw_retrieve"].description
    assert tools["contextpaw_retrieve"].input_schema["required"] == ["ref"]
    assert tools["contextpaw_search"].input_schema["required"] == ["query"]


async def test_a_marker_reference_comes_back_verbatim_with_the_token_sent(proxy: tuple[FakeContextPaw, str], tmp_path: Path) -> None:
    fake, url = proxy
    (tmp_path / "contextpaw-token").write_text(TOKEN + "\n")
    async with mcp_session("--url", url, "--state-dir", str(tmp_path)) as session:
        messages = await session.call_tool("contextpaw_retrieve", {"ref": CAPPED})
        bare = await session.call_tool("contextpaw_retrieve", {"ref": f"(retrieval id {SECRET_ONLY})"})
    assert not messages.is_error and not bare.is_error
    assert parts.rendered(KEPT[CAPPED]) == text(messages) and "DB_PASSWORD=hunter2\\nline two ✓" in text(messages)
    assert text(bare) == KEPT[SECRET_ONLY]
    assert fake.tokens == [TOKEN, TOKEN]


async def test_without_a_token_a_capability_still_reads_and_no_header_is_sent(proxy: tuple[FakeContextPaw, str], tmp_path: Path) -> None:
    fake, url = proxy
    async with mcp_session("--url", url, "--state-dir", str(tmp_path)) as session:
        result = await session.call_tool("contextpaw_retrieve", {"ref": CAPPED})
        searched = await session.call_tool("contextpaw_search", {"query": "password"})
    assert not result.is_error and "hunter2" in text(result)
    assert fake.tokens == [None]
    assert searched.is_error and "needs its token" in text(searched) and fake.queries == []


async def test_an_unknown_or_forbidden_reference_is_a_tool_error_in_words(proxy: tuple[FakeContextPaw, str], tmp_path: Path) -> None:
    _, url = proxy
    async with mcp_session("--url", url, "--state-dir", str(tmp_path)) as session:
        unknown = await session.call_tool("contextpaw_retrieve", {"ref": "cp-ffffffffffff.ffffffffffffffff"})
        forbidden = await session.call_tool("contextpaw_retrieve", {"ref": SECRET_ONLY})
        garbage = await session.call_tool("contextpaw_retrieve", {"ref": "the file from before"})
    assert unknown.is_error and "keeps nothing under cp-ffffffffffff.ffffffffffffffff" in text(unknown)
    assert forbidden.is_error and text(forbidden) == text(unknown).replace("cp-ffffffffffff.ffffffffffffffff", SECRET_ONLY)
    assert garbage.is_error and "not a ContextPaw reference" in text(garbage)


async def test_search_with_the_token_lists_references_and_snippets(proxy: tuple[FakeContextPaw, str], tmp_path: Path) -> None:
    fake, url = proxy
    async with mcp_session("--url", url, "--state-dir", str(tmp_path), "--token", TOKEN) as session:
        found = await session.call_tool("contextpaw_search", {"query": "hunter2"})
        none = await session.call_tool("contextpaw_search", {"query": "nowhere"})
    assert not found.is_error and f"- {CAPPED}: " in text(found) and "DB_PASSWORD=hunter2" in text(found)
    assert SECRET_ONLY not in text(found) and "contextpaw_retrieve" in text(found)
    assert not none.is_error and "Nothing ContextPaw removed matches 'nowhere'" in text(none)
    assert fake.queries[0] == {"q": "hunter2", "limit": "10"}


async def test_the_server_searches_as_the_session_launch_named(proxy: tuple[FakeContextPaw, str], tmp_path: Path) -> None:
    """`contextpaw launch` gives the agent's requests and this server one session: its searches say it,
    and the proxy answers the local token with that session's evictions only."""
    fake, url = proxy
    async with mcp_session("--url", url, "--state-dir", str(tmp_path), "--token", TOKEN, "--session=run-7f3a") as session:
        await session.call_tool("contextpaw_search", {"query": "hunter2"})
    async with mcp_session("--url", url, "--state-dir", str(tmp_path), "--token", TOKEN) as session:
        await session.call_tool("contextpaw_search", {"query": "hunter2"})
    assert fake.sessions == ["run-7f3a", None]


async def test_a_proxy_that_is_not_running_is_a_tool_error_that_says_so(tmp_path: Path, unused_tcp_port: int) -> None:
    url = f"http://127.0.0.1:{unused_tcp_port}"
    async with mcp_session("--url", url, "--state-dir", str(tmp_path)) as session:
        result = await session.call_tool("contextpaw_retrieve", {"ref": CAPPED})
    assert result.is_error and f"ContextPaw is not running: nothing answers at {url}" in text(result)


async def test_content_past_one_result_comes_in_parts_that_join_back_byte_for_byte(
    proxy: tuple[FakeContextPaw, str], tmp_path: Path
) -> None:
    _, url = proxy
    whole = parts.rendered(KEPT[LONG])
    pieces: list[str] = []
    async with mcp_session("--url", url, "--state-dir", str(tmp_path)) as session:
        first = text(await session.call_tool("contextpaw_retrieve", {"ref": LONG}))
        header = parts.PART_HEADER.match(first)
        assert header and header[1] == "1" and header[3] == LONG and "part=2" in header[0]
        for part in range(1, int(header[2]) + 1):
            got = text(await session.call_tool("contextpaw_retrieve", {"ref": LONG, "part": part}))
            head = parts.PART_HEADER.match(got)
            assert head and (head[1], head[2]) == (str(part), header[2])
            pieces.append(got[head.end() :])
        past = await session.call_tool("contextpaw_retrieve", {"ref": LONG, "part": int(header[2]) + 1})
    assert "".join(pieces) == whole and len(pieces) > 2
    assert all(len(p.encode()) <= parts.PART_BYTES and p.count("\n") <= parts.PART_LINES for p in pieces)
    assert all(p.endswith("\n") for p in pieces[:-2]), "a part is cut after a line where one falls in it"
    assert past.is_error and f"comes in {header[2]} part(s)" in text(past)
