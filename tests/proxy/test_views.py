"""mitmweb's `contextpaw` views, through mitmproxy's contentview API, on flows taken through the
addons: compacted, shrunk, refused, streamed, and ContextPaw's own; and the marks in the flow list."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import AsyncIterator

import pytest
from mitmproxy import contentviews, http
from mitmproxy.test import taddons
from mitmproxy.utils.emoji import emoji

from contextpaw.proxy import replies
from contextpaw.proxy.compose import make_addons
from contextpaw.proxy.views import REPORT, WIDTH, response_text
from contextpaw.wire.streams import StreamReport
from support.backends import Backend
from support.common import scripted_reply
from support.flows import OLLAMA, get, long_chat, ok_json, post, streamed
from support.inprocess import Proxy

SECRET = "SECRET=kiwi. What is the SECRET?"


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        proxy = Proxy(tctx, addons)
        tctx.configure(proxy.backends, contextpaw_ollama=[OLLAMA])
        yield proxy
        await proxy.close()


def with_tool_result(rows: int = 1500) -> dict:
    """A long chat whose fourth message is a tool result of numbered rows, each line unique."""
    chat = long_chat(turns=8, num_ctx=4096)
    chat["messages"].insert(3, {"role": "tool", "content": "\n".join(f"row {i}: value {i * i}" for i in range(rows))})
    chat["messages"].append({"role": "user", "content": "What now?"})
    return chat


def flat(text: str) -> str:
    """The view's text with its wrapping and indentation undone, to look for a sentence in it."""
    return " ".join(line.strip(" »") for line in text.splitlines())


def section(text: str, title: str) -> list[str]:
    """The lines under the rule that starts with `title`, up to the next rule."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"── {title}"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("── ")), len(lines))
    return lines[start + 1 : end]


def view(message: http.Message, flow: http.HTTPFlow) -> contentviews.ContentviewResult:
    return contentviews.prettify_message(message, flow)


# -- the request ----------------------------------------------------------------------------------


async def test_the_request_view_starts_with_the_sizes_and_one_line_per_hole(proxy: Proxy) -> None:
    flow = post("/api/chat", with_tool_result())
    await proxy.send(flow)
    report = flow.metadata[REPORT]  # kept on the flow before any answer
    shown = view(flow.request, flow)
    assert shown.view_name == "contextpaw"
    summary = shown.text.split("\n── ")[0]
    assert f"{report['original_tokens']:,} -> {report['final_tokens']:,} tokens" in flat(summary)
    assert f"budget {report['budget']:,} of a {report['window']:,}-token window" in flat(summary)
    assert f"counter {report['counter']}" in flat(summary)
    holes = [line for line in summary.splitlines() if re.match(r"  cp-[\w.]+  ", line)]
    assert [line.split()[0] for line in holes] == report["markers"]


async def test_the_request_view_fits_the_pane_and_shows_each_marker_whole(proxy: Proxy) -> None:
    chat = with_tool_result()
    chat["messages"][4]["content"] = "x" * 50_000 + " " + "long words " * 5000  # one unbroken 50 kB word
    flow = post("/api/chat", chat)
    await proxy.send(flow)
    shown = view(flow.request, flow).text
    assert max(map(len, shown.splitlines())) <= WIDTH
    sent = json.loads(flow.request.content)["messages"]
    markers = [found for m in sent for found in re.findall(r"\[ContextPaw: [^]]*\]", m["content"])]
    assert len(markers) == len(flow.metadata[REPORT]["markers"])
    assert all(" ".join(marker.split()) in flat(shown) for marker in markers)


def shrunk_chat() -> dict:
    chat = with_tool_result()
    chat["messages"] = chat["messages"][:4] + [{"role": "user", "content": "What now?"}]  # the tool result is shrunk
    return chat


@pytest.mark.parametrize(
    ("path", "body", "text"),
    [
        ("/api/chat", shrunk_chat(), lambda body: body["messages"][3]["content"]),
        ("/api/generate", {"model": "m", "prompt": "\n".join(f"line {i} of the log" for i in range(3000)),
                           "options": {"num_ctx": 2048}}, lambda body: body["prompt"]),
    ],
    ids=["message", "prompt"],
)  # fmt: skip
async def test_a_shrunk_text_shows_the_note_and_the_part_that_was_cut(proxy: Proxy, path: str, body: dict, text) -> None:
    flow = post(path, body)
    await proxy.send(flow)
    assert any(r["action"] == "shrunk" for r in flow.metadata[REPORT]["removals"])
    shown = view(flow.request, flow).text
    sent = text(json.loads(flow.request.content))
    note = re.search(r"\[ContextPaw: [^]]* tokens[^]]* cut[.;][^]]*\]", sent)
    assert note and " ".join(note.group().split()) in flat(shown)
    lines = shown.splitlines()
    start = next(i for i, line in enumerate(lines) if "what was cut" in line)
    cut = [line.strip() for line in lines[start + 1 : start + 8] if line.startswith("      ") and line.strip() != "…"]
    assert cut and all(row in text(body) for row in cut)
    assert any(row not in sent for row in cut), "what was cut is shown, not the kept lines again"


async def test_the_dropped_messages_are_listed_from_the_clients_request(proxy: Proxy) -> None:
    chat = with_tool_result()
    flow = post("/api/chat", chat)
    await proxy.send(flow)
    dropped = [r["index"] for r in flow.metadata[REPORT]["removals"] if r["action"] == "dropped"]
    listed = section(view(flow.request, flow).text, "dropped from the client's request")
    headers = [line for line in listed if line.startswith("#")]
    assert [int(line.split()[0][1:]) for line in headers] == dropped
    for line, i in zip(headers, dropped, strict=True):
        assert line.split()[1] == chat["messages"][i]["role"]


async def test_the_sent_messages_are_counted_against_the_clients(proxy: Proxy) -> None:
    chat = with_tool_result()
    flow = post("/api/chat", chat)
    await proxy.send(flow)
    removals = flow.metadata[REPORT]["removals"]
    dropped = sum(1 for r in removals if r["action"] == "dropped")
    shrunk = sum(1 for r in removals if r["action"] == "shrunk")
    client = len(chat["messages"])
    lines = view(flow.request, flow).text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("── sent to the backend"))
    title = flat("\n".join(lines[at : at + 2]).replace("─", ""))
    counts = f"({dropped} dropped" + (f", {shrunk} shrunk" if shrunk else "")
    assert dropped and title.startswith(f"sent to the backend: {client - dropped} of the client's {client} messages {counts}")
    assert len(lines[at]) <= WIDTH


async def test_a_refused_request_is_shown_as_not_sent(proxy: Proxy) -> None:
    proxy.tctx.configure(proxy.compactor, contextpaw_policy="strict")
    flow = post("/api/chat", long_chat())
    await proxy.send(flow)
    shown = view(flow.request, flow)
    assert shown.view_name == "contextpaw"
    assert shown.text.startswith("ContextPaw refused this request") and "not sent" in shown.text


async def test_requests_contextpaw_did_not_change_get_mitmproxys_views(proxy: Proxy) -> None:
    flow = post("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    await proxy.send(flow)
    assert view(flow.request, flow).view_name != "contextpaw"


# -- the response ---------------------------------------------------------------------------------


async def test_the_response_view_shows_the_answer_then_the_holes(proxy: Proxy) -> None:
    flow = post("/api/chat", with_tool_result())
    await proxy.send(flow)
    answer = "The rows count up: " + "row after row " * 40
    await proxy.answer(flow, ok_json({"model": "m", "message": {"role": "assistant", "content": answer}, "done": True}))
    shown = view(flow.response, flow)
    assert shown.view_name == "contextpaw"
    assert max(map(len, shown.text.splitlines())) <= WIDTH
    assert " ".join(answer.split()) in flat("\n".join(section(shown.text, "the answer")))
    report = "\n".join(section(shown.text, "the report"))
    assert all(marker in report for marker in flow.metadata[REPORT]["markers"])


async def test_a_refusal_shows_the_error_sentence_the_client_got(proxy: Proxy) -> None:
    proxy.tctx.configure(proxy.compactor, contextpaw_policy="strict")
    flow = post("/api/chat", long_chat())
    await proxy.send(flow)
    assert flow.response.status_code == 400
    sentence = json.loads(flow.response.content)["error"]
    shown = view(flow.response, flow).text
    assert " ".join(sentence.split()) in flat("\n".join(section(shown, "the client was answered 400")))


async def test_a_streamed_flow_keeps_the_stream_and_shows_the_answer_and_report(proxy: Proxy) -> None:
    flow = post("/api/chat", with_tool_result() | {"stream": True})
    await proxy.send(flow)
    flow.response = streamed("application/x-ndjson")
    await proxy.hook("responseheaders", flow)
    tokens = ["The", " rows", " are", " gone."]
    records = [{"model": "m", "message": {"role": "assistant", "content": t}, "done": False} for t in tokens]
    records.append({"model": "m", "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "stop"})
    sent = b"".join(b"".join(flow.response.stream(json.dumps(r).encode() + b"\n")) for r in records)
    sent += b"".join(flow.response.stream(b""))
    await proxy.hook("response", flow)
    assert flow.response.content == sent, "the flow keeps what the client got, report and all"
    assert b'"contextpaw"' in sent.splitlines()[-1]
    shown = view(flow.response, flow)
    assert shown.view_name == "contextpaw"
    assert max(map(len, shown.text.splitlines())) <= WIDTH
    assert section(shown.text, "the answer")[0].strip() == "".join(tokens)
    assert all(marker in shown.text for marker in flow.metadata[REPORT]["markers"])


def test_a_stream_over_the_limit_is_not_kept() -> None:
    report = StreamReport("ndjson", lambda record: bool(record.get("done")), b"{}", keep=100)
    report(b'{"done": false}\n' * 5)
    assert report.kept is not None and len(report.kept) == 80
    report(b'{"done": false}\n' * 2)
    assert report.kept is None
    report(b'{"done": true}\n')
    assert report.kept is None, "once dropped, never kept again"


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize(
    ("server", "path", "body"),
    [
        ("ollama", "/api/chat", {"messages": [{"role": "user", "content": SECRET}]}),
        ("ollama", "/api/generate", {"prompt": SECRET}),
        ("ollama", "/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET}]}),
        ("ollama", "/v1/completions", {"prompt": SECRET}),
        ("ollama", "/v1/messages", {"max_tokens": 64, "messages": [{"role": "user", "content": SECRET}]}),
        ("ollama", "/v1/responses", {"input": SECRET}),
        ("llamacpp", "/completion", {"prompt": SECRET}),
        ("llamacpp", "/v1/responses", {"input": [{"role": "user", "content": SECRET}]}),
    ],
)
def test_the_answer_is_read_from_every_apis_body_and_stream(
    request: pytest.FixtureRequest, server: str, path: str, body: dict, stream: bool
) -> None:
    backend: Backend = request.getfixturevalue(server)
    data = json.dumps({"model": "fake", "stream": stream, **body}).encode()
    call = urllib.request.Request(backend.url + path, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(call, timeout=10) as answer:
        content_type, raw = answer.headers["Content-Type"], answer.read()
    shown = response_text(200, content_type, raw, None)
    assert section(shown, "the answer")[0].strip() == scripted_reply(SECRET)


# -- the flow list --------------------------------------------------------------------------------


async def test_contextpaws_own_flows_are_marked_as_answered_by_it(proxy: Proxy) -> None:
    flow = get("/contextpaw/health")
    await proxy.send(flow)
    assert flow.response.status_code == 503, "answered here: no backend runs in this test, and health says so"
    assert flow.marked == replies.ADMIN_MARK and "never forwarded" in flow.comment


@pytest.mark.skipif(shutil.which("fc-list") is None, reason="fontconfig's fc-list is not installed")
@pytest.mark.parametrize("mark", [replies.COMPACTED_MARK, replies.REFUSED_MARK, replies.TRUNCATED_MARK, replies.ADMIN_MARK])
def test_every_mark_is_a_mitmproxy_marker_whose_glyph_a_plain_font_has(mark: str) -> None:
    glyph = emoji[mark]  # mitmweb shows the glyph of a marker name it knows, else a red circle
    assert len(glyph) == 1
    fonts = subprocess.run(["fc-list", f":charset={ord(glyph):x}", "family"], capture_output=True, text=True, check=True)
    assert "DejaVu" in fonts.stdout, f"{glyph} needs a font beyond DejaVu (an emoji font)"
