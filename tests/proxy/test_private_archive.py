"""The archive through the composed proxy: a marker carries its reference and the command that
reads it back at the address the client used; only that reference, or a token, reads it; a page
on another site gets nothing; the plan is the conversation's under this proxy's secret."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from mitmproxy import http
from mitmproxy.test import taddons

from contextpaw import wire
from contextpaw.core import parts
from contextpaw.ops import keys
from contextpaw.proxy.compose import make_addons
from support.flows import LLAMACPP, OLLAMA, get, long_chat, ok_json, post, reverse
from support.inprocess import Proxy

LEGEND = re.compile(r"curl -s '(http://[^/\s]+)/contextpaw/evicted/<ref>\?part=1'")
REF = re.compile(r"earlier [^\]]*?; ref (cp-[0-9a-f]{12}\.[0-9a-f]{16})")
"""A hole's reference (what it reads back is the messages that went)."""


class COMMAND:
    """The commands a model is told: the legend's, said once, with each marker's reference in it."""

    @staticmethod
    def findall(text: str) -> list[tuple[str, str]]:
        urls = LEGEND.findall(text)
        assert len(urls) <= 1, "the legend is said once a request"
        return [(url, ref) for url in urls for ref in REF.findall(text)]


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[Proxy]:
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        proxy = Proxy(tctx, addons)
        tctx.options.update(contextpaw_state_dir=str(tmp_path))
        tctx.configure(proxy.backends, contextpaw_ollama=[OLLAMA], contextpaw_llamacpp=[LLAMACPP])
        yield proxy
        proxy.compactor.done()


async def compacted(proxy: Proxy, body: dict | None = None, **headers: str) -> tuple[dict, http.HTTPFlow]:
    flow = reverse(post("/api/chat", body or long_chat(turns=40, num_ctx=8192)))
    flow.request.headers["Host"] = "127.0.0.1:11435"  # as every HTTP/1.1 client sends it
    flow.request.headers.update(headers)
    flow.client_conn.timestamp_tls_setup = None  # plain HTTP, as agents reach a local proxy
    await proxy.send(flow)
    sent = json.loads(flow.request.content or b"{}")
    await proxy.answer(flow, ok_json({"done": True}))
    return sent, flow


async def read(proxy: Proxy, path: str, peer: str = "", **headers: str) -> http.Response:
    flow = reverse(get(path))
    flow.request.headers.update(headers)
    if peer:
        flow.client_conn.peername = (peer, 40000)
    await proxy.send(flow)
    assert flow.response is not None
    return flow.response


async def test_the_marker_names_the_command_that_reads_it_back_at_the_address_the_client_used(proxy: Proxy, tmp_path: Path) -> None:
    sent, _ = await compacted(proxy)
    commands = COMMAND.findall(json.dumps(sent))
    assert commands and {url for url, _ in commands} == {"http://127.0.0.1:11435"}  # the Host of `get`/`post`
    answer = await read(proxy, f"/contextpaw/evicted/{commands[0][1]}")
    assert answer.status_code == 200 and json.loads(answer.content)["content"][0]["content"].startswith("part ")
    assert (tmp_path / "contextpaw-archive.sqlite3").exists() and (tmp_path / keys.SECRET_FILE).exists()


async def test_the_markers_command_prints_the_content_as_text_in_parts_that_join_back(proxy: Proxy) -> None:
    """What a shell tool prints stays under every agent's own limit: the command asks for part 1,
    and each part says how to ask for the next."""
    sent, _ = await compacted(proxy, long_chat(turns=80, num_ctx=8192))
    url, ref = COMMAND.findall(json.dumps(sent))[0]
    whole = parts.rendered(json.loads((await read(proxy, f"/contextpaw/evicted/{ref}")).content)["content"])
    first = await read(proxy, f"/contextpaw/evicted/{ref}?part=1")
    header = parts.PART_HEADER.match(first.text)
    assert first.status_code == 200 and first.headers["content-type"].startswith("text/plain") and header
    assert header[3] == ref and "run the same command with part=2" in header[0]
    pieces = [first.text[header.end() :]]
    for n in range(2, int(header[2]) + 1):
        got = (await read(proxy, f"/contextpaw/evicted/{ref}?part={n}")).text
        pieces.append(got[parts.PART_HEADER.match(got).end() :])  # type: ignore[union-attr]
    assert "".join(pieces) == whole and all(len(p.encode()) <= parts.PART_BYTES for p in pieces)
    past, odd = await read(proxy, f"/contextpaw/evicted/{ref}?part=99"), await read(proxy, f"/contextpaw/evicted/{ref}?part=²")
    assert past.status_code == odd.status_code == 400 and f"comes in {header[2]} part(s)" in past.text and "a number" in odd.text
    huge, padded = (
        await read(proxy, f"/contextpaw/evicted/{ref}?part={'9' * 5000}"),
        await read(proxy, f"/contextpaw/evicted/{ref}?part=0002"),
    )
    assert huge.status_code == 400 and "a number" in huge.text, "5,000 digits: no int is read (a 500 before)"
    assert padded.text == (await read(proxy, f"/contextpaw/evicted/{ref}?part=2")).text, "0002 is part 2"
    forged = await read(proxy, f"/contextpaw/evicted/{ref[:-4]}0000?part=1")
    assert forged.status_code == 404, "a part is read with the capability only"


async def test_without_the_capability_the_answer_is_the_unknown_ids(proxy: Proxy, tmp_path: Path) -> None:
    sent, _ = await compacted(proxy)
    ref = COMMAND.findall(json.dumps(sent))[0][1]
    bare, unknown = await read(proxy, f"/contextpaw/evicted/{ref.split('.')[0]}"), await read(proxy, "/contextpaw/evicted/cp-0")
    assert (bare.status_code, bare.content) == (unknown.status_code, unknown.content) and bare.status_code == 404
    token = keys.local_token(tmp_path)
    # the local token (what `contextpaw mcp` sends) is a capability too: it reads no bare id (issue 56)
    assert (await read(proxy, f"/contextpaw/evicted/{ref.split('.')[0]}", **{"X-ContextPaw-Token": token})).status_code == 404
    assert (await read(proxy, f"/contextpaw/evicted/{ref}", **{"X-ContextPaw-Token": token})).status_code == 200
    found = await read(proxy, "/contextpaw/search?q=log+line&limit=3", **{"X-ContextPaw-Token": token})
    results = json.loads(found.content)["results"]
    assert found.status_code == 200 and 1 <= len(results) <= 3 and all(r["ref"].startswith("cp-") for r in results)
    assert (await read(proxy, "/contextpaw/search?q=log")).status_code == 403  # loopback, but no token


async def test_the_local_token_searches_only_its_own_session(proxy: Proxy, tmp_path: Path) -> None:
    """A session is what a request's X-ContextPaw-Session names (`contextpaw launch` gives the agent's
    requests and its `contextpaw mcp` the same one): the local token finds that session's evictions,
    and no other's; requests that name none are one session together."""
    await compacted(proxy, **{wire.SESSION_HEADER: "run-a"})
    token = {"X-ContextPaw-Token": keys.local_token(tmp_path)}

    async def found(session: str | None) -> list[str]:
        headers = {**token, **({wire.SESSION_HEADER: session} if session else {})}
        answer = await read(proxy, "/contextpaw/search?q=log+line&limit=10", **headers)
        assert answer.status_code == 200
        return [r["ref"] for r in json.loads(answer.content)["results"]]

    mine = await found("run-a")
    assert mine and await found("run-b") == [] and not set(mine) & set(await found(None))


async def test_the_local_token_opens_nothing_from_another_machine(proxy: Proxy, tmp_path: Path) -> None:
    """The state dir's token is what `contextpaw mcp` on this machine sends: from a peer elsewhere it
    is no token at all (the operator's contextpaw_admin_token is the one for other machines)."""
    sent, _ = await compacted(proxy)
    ref = COMMAND.findall(json.dumps(sent))[0][1]
    token = {"X-ContextPaw-Token": keys.local_token(tmp_path), "Host": "127.0.0.1:11435"}
    assert (await read(proxy, "/contextpaw/search?q=log", **token)).status_code == 200
    assert (await read(proxy, "/contextpaw/search?q=log", peer="192.0.2.7", **token)).status_code == 403
    assert (await read(proxy, f"/contextpaw/evicted/{ref.split('.')[0]}", peer="192.0.2.7", **token)).status_code == 403


@pytest.mark.parametrize(
    "headers",
    [{"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"}, {"Sec-Fetch-Site": "same-site"}],
)
async def test_a_page_on_another_site_gets_nothing_even_with_the_reference(proxy: Proxy, headers: dict[str, str]) -> None:
    sent, _ = await compacted(proxy)
    ref = COMMAND.findall(json.dumps(sent))[0][1]
    answer = await read(proxy, f"/contextpaw/evicted/{ref}", **headers)
    assert answer.status_code == 403 and b"part " not in answer.content
    own = await read(proxy, f"/contextpaw/evicted/{ref}", Origin="http://127.0.0.1:11435", **{"Sec-Fetch-Site": "same-origin"})
    assert own.status_code == 200


async def test_the_same_conversation_under_another_secret_finds_no_plan(proxy: Proxy, tmp_path: Path) -> None:
    """The plan is found by the conversation's key under this proxy's secret: the same opening
    sent to a proxy with another secret is a stranger there."""
    await compacted(proxy)
    fitter = proxy.compactor.fitter
    assert len(fitter.plans) == 1
    key = next(iter(fitter.plans))
    fitter.configure(fitter.settings, fitter.summarizer, b"another secret" * 3)
    _, flow = await compacted(proxy)
    assert len(fitter.plans) == 2 and key in fitter.plans


async def test_a_state_dir_that_cannot_hold_the_archive_still_starts_with_one_in_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        proxy = Proxy(tctx, addons)
        tctx.options.update(contextpaw_state_dir=str(blocked))
        tctx.configure(proxy.backends, contextpaw_ollama=[OLLAMA], contextpaw_llamacpp=[LLAMACPP])
        from contextpaw.ops.evicted import MemoryStore

        assert isinstance(proxy.compactor.archive.store, MemoryStore)  # type: ignore[union-attr]
        assert "kept in memory only" in caplog.text and len(proxy.compactor.fitter.secret) == 32
        sent, _ = await compacted(proxy)
        ref = COMMAND.findall(json.dumps(sent))[0][1]
        assert (await read(proxy, f"/contextpaw/evicted/{ref}")).status_code == 200


async def test_the_old_summary_cache_file_goes_at_start_and_digests_are_kept_in_the_archive(tmp_path: Path) -> None:
    old = tmp_path / "contextpaw-summaries.json"
    old.write_text('{"version": 1, "entries": {"k": "a digest of evicted content"}}')
    (tmp_path / "contextpaw-summaries.jsonab12.tmp").write_text("{")  # a write killed half-way
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        proxy = Proxy(tctx, addons)
        tctx.options.update(contextpaw_state_dir=str(tmp_path), contextpaw_summarize=True)
        summarizer = proxy.compactor.fitter.summarizer
        assert summarizer is not None and summarizer.kept is proxy.compactor.archive
        assert sorted(p.name for p in tmp_path.iterdir() if "summaries" in p.name) == []
        proxy.compactor.done()
