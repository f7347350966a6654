"""`contextpaw mcp` against the real proxy: a request that overflows is cut, its marker names a
reference, and the MCP server (driven by the SDK's own client over stdio) reads the evicted text back
from the proxy's archive, verbatim, and finds it by search with the proxy's token.

The stack: the scripted model as llama-server (a 4,096-token window), mitmdump with the addon in
front of it (support.agents.start_contextpaw_stack), its state directory holding the token the
proxy made at its start.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from contextpaw.core import refs
from support import agents as cli
from support.backends import start_module

SECRET = "DB_PASSWORD=hunter2-4821\n" + " ".join(f"line{i}" for i in range(1500))
"""A tool's output far over the window, that the proxy must evict."""


def overflowing() -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "show the env file"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": SECRET},
    ]
    for i in range(6):
        messages += [{"role": "user", "content": f"question {i} " + "filler " * 600}, {"role": "assistant", "content": f"answer {i}"}]
    return {"model": "scripted", "messages": [*messages, {"role": "user", "content": "what was the password?"}]}


@pytest.fixture(scope="module")
def cut(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    """(the proxy's address, its state directory, the reference its marker named)."""
    work = tmp_path_factory.mktemp("mcp-retrieval")
    with ExitStack() as exits:
        args = ["--n-ctx", "8192", "--behaviour", "llamacpp", "--log", str(work / "model.jsonl")]  # markers name references
        model = exits.enter_context(start_module("support.scripted_model", args, "/", work / "model.out", timeout=180))
        stack, stops = cli.start_contextpaw_stack(work / "stack", model.url)
        exits.enter_context(stops)
        body = json.dumps(overflowing()).encode()
        request = urllib.request.Request(stack.proxy.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            assert answer.status == 200 and answer.headers["X-ContextPaw-Compacted"] == "true"
        forwarded = json.dumps([e.get("body") for e in stack.forwarded("/v1/chat/completions")])
        named = sorted({found[0] for found in refs.REF.finditer(forwarded)})
        assert len(named) == 1 and "DB_PASSWORD" not in forwarded.split("[ContextPaw:")[1][:200], named
        yield stack.proxy.url, work / "stack" / "state", named[0]


async def calls(url: str, state: Path, *requests: tuple[str, dict[str, str]]) -> list[Any]:
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "contextpaw.command.cli", "mcp", "--url", url, "--state-dir", str(state)]
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        return [await session.call_tool(name, arguments) for name, arguments in requests]


def text(result: Any) -> str:
    return "".join(block.text for block in result.content if getattr(block, "type", "") == "text")


async def test_the_marker_reference_reads_the_evicted_text_back_verbatim_and_search_finds_it(cut: tuple[str, Path, str]) -> None:
    url, state, ref = cut
    assert (state / "contextpaw-token").is_file()
    got, found = await calls(url, state, ("contextpaw_retrieve", {"ref": ref}), ("contextpaw_search", {"query": "hunter2-4821"}))
    assert not got.is_error and text(got) == SECRET
    assert not found.is_error and f"- {ref}: DB_PASSWORD=hunter2-4821" in text(found)


async def test_without_the_token_only_the_capability_reads(cut: tuple[str, Path, str], tmp_path: Path) -> None:
    url, _, ref = cut
    marker_id, cap = ref.split(".")
    forged = f"{marker_id}.{'0' * len(cap)}"
    got, bare, wrong, searched = await calls(
        url, tmp_path, ("contextpaw_retrieve", {"ref": ref}), ("contextpaw_retrieve", {"ref": marker_id}),
        ("contextpaw_retrieve", {"ref": forged}), ("contextpaw_search", {"query": "hunter2-4821"}),
    )  # fmt: skip
    assert not got.is_error and text(got) == SECRET
    assert bare.is_error and wrong.is_error and "keeps nothing under" in text(bare) and "keeps nothing under" in text(wrong)
    assert searched.is_error and "needs its token" in text(searched)
