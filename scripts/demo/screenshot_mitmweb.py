"""Screenshots of mitmweb's `contextpaw` views, taken with headless Chromium, to look at once.

    PYTHONPATH=tests .venv/bin/python scripts/demo/screenshot_mitmweb.py [--out docs/img] [--chromium chromium] [--width 1280] [--height 1100]

It starts the fake Ollama (a 2048-token window) and `contextpaw --web` in front of it, and sends a
chat that overflows the window (a long tool result, so one message is shrunk and others dropped),
the same chat streamed, a chat whose system prompt alone is over the window (refused: 400), and a
`/contextpaw/health`. Then it drives headless Chromium over the DevTools protocol: it opens each
flow by its mitmweb URL (`#/flows/<id>/request` or `/response`), waits for the content view, saves
a screenshot, and measures the view's `<pre>`: how wide its text is against how wide it is shown,
so "no horizontal scrolling" is a number, not only a look. Then it reads the flow list as a person
sees it, with the detail pane closed and open: for each chat, the characters laid out inside its path
and comment cells and inside the list (the DOM's text has what the ellipsis hides too), and checks
that the route (`ollama.chat`), the cut's numbers (`9,759→860`, from the answer's X-ContextPaw
headers) and a refusal's fix are among them. It saves into `--out`:

    mitmweb-request.png    the compacted request: summary, holes, markers, the shrunk message
    mitmweb-response.png   its answer beside the report
    mitmweb-streamed.png   the streamed flow's answer and report
    mitmweb-refused.png    the refusal's sentence
    mitmweb-flows.png      the flow list alone: marks and comments

(the first four beside the flow list, with its marks and comments).

Chromium comes from Debian's `chromium` package (`apt-get install chromium`). Exits non-zero if a
view is not ContextPaw's, or its text is wider than the pane, or the flow list hides a chat's route,
its cut or a refusal's fix (a line NOT SHOWN says which).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import secrets
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[2]
# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import free_port, start_module, start_process  # noqa: E402
from support.demo_runs import run_demo  # noqa: E402

N_CTX = 2048
PRE = "document.querySelector('.contentview pre')"
ROUTE = "ollama.chat"
FLOW_LIST = """(() => {
  // Each row of mitmweb's flow list: the whole text of its path and comment cells, and the part a
  // person sees: the characters laid out inside the cell and inside the list's visible width, less
  // the room of the ellipsis where the text is cut (innerText has the cut part too).
  const table = document.querySelector('.flow-table');
  const edge = table.getBoundingClientRect().left + table.clientWidth;
  const seen = (td) => {
    if (!td) return '';
    const box = td.getBoundingClientRect();
    const right = Math.min(box.right - (parseFloat(getComputedStyle(td).paddingRight) || 0), edge);
    const cut = td.scrollWidth > td.clientWidth || box.right > edge ? 12 : 0;  // the ellipsis, at the end of the cell's own text
    let out = '';
    const walk = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
    const range = document.createRange();
    for (let node; (node = walk.nextNode());) {
      const end = right - (node.parentNode === td ? cut : 0);  // a mark floats beside it, whole
      for (let i = 0; i < node.length; i++) {
        range.setStart(node, i); range.setEnd(node, i + 1);
        const r = range.getBoundingClientRect();
        if (r.width > 0 && r.left >= box.left && r.right <= end + 0.5) out += node.data[i];
      }
    }
    return out;
  };
  return [...document.querySelectorAll('.flow-table tbody tr')].filter(tr => tr.querySelector('td.col-path')).map(tr => ({
    path: tr.querySelector('td.col-path').textContent, comment: tr.querySelector('td.col-comment')?.textContent || '',
    seen: seen(tr.querySelector('td.col-path')) + ' | ' + seen(tr.querySelector('td.col-comment')),
  }));
})()"""


def chat(stream: bool) -> dict:
    """A chat over the window: a long tool result early on, turns after it, and a question."""
    rows = "\n".join(f"{i:04d} | 2026-05-0{i % 9 + 1} | order {i * 37 % 1000:03d} | shipped" for i in range(600))
    messages = [
        {"role": "system", "content": "You are a careful analyst. Answer briefly."},
        {"role": "user", "content": "Read the orders table and tell me what stands out."},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "read_table", "arguments": {"name": "orders"}}}]},
        {"role": "tool", "content": rows},
    ]
    for turn in range(6):
        messages.append({"role": "assistant" if turn % 2 == 0 else "user", "content": f"Turn {turn}: " + "notes on the table " * 60})
    messages.append({"role": "user", "content": "SECRET=kiwi. What is the SECRET?"})
    return {"model": "fake", "messages": messages, "stream": stream, "options": {"num_ctx": N_CTX}}


def post(url: str, body: dict) -> int:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()
            return answer.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def flows(web: str, token: str) -> list[dict]:
    with urllib.request.urlopen(f"{web}/flows?token={token}", timeout=10) as answer:
        return json.load(answer)


class Browser:
    """One headless Chromium page, driven over the DevTools protocol."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self.socket = socket
        self.ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        sent = next(self.ids)
        await self.socket.send_json({"id": sent, "method": method, "params": params})
        async for message in self.socket:
            reply = json.loads(message.data)
            if reply.get("id") == sent:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
        raise RuntimeError("Chromium closed the DevTools connection")

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def open(self, url: str, ready: str, timeout: float = 20.0) -> None:
        """Navigate to `url` and wait until the expression `ready` is true."""
        await self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while not await self.evaluate(ready):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: not ready in {timeout:.0f}s ({ready})")
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)  # fonts and layout settle

    async def screenshot(self, png: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        png.write_bytes(base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def page(chromium_url: str, width: int, height: int) -> AsyncIterator[Browser]:
    """Chromium's page, at `width` x `height`."""
    with urllib.request.urlopen(f"{chromium_url}/json/list", timeout=10) as answer:
        target = next(t for t in json.load(answer) if t["type"] == "page")
    async with aiohttp.ClientSession() as session, session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as socket:
        browser = Browser(socket)
        await browser.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        yield browser


async def take(chromium_url: str, web: str, token: str, pages: dict[str, str], out: Path, width: int, height: int) -> bool:
    """Each page's screenshot and measurement; whether every view was ContextPaw's and fit."""
    fine = True
    async with page(chromium_url, width, height) as browser:
        for name, fragment in pages.items():
            await browser.open(f"{web}/?token={token}{fragment}", f"!!{PRE} && !/^Loading/.test({PRE}.innerText)")
            await browser.screenshot(out / name)
            shown = await browser.evaluate(
                f"({{text: {PRE}.scrollWidth, pane: {PRE}.clientWidth, page: document.documentElement.scrollWidth,"
                f" view: document.querySelector('.contentview h5')?.innerText, first: {PRE}.innerText.split('\\n')[0]}})"
            )
            fits = shown["text"] <= shown["pane"] and shown["page"] <= width
            fine &= fits and str(shown["view"]).startswith("contextpaw")
            print(f"{name}: view {shown['view']!r}, text {shown['text']} px in a {shown['pane']} px pane "
                  f"({'fits' if fits else 'SCROLLS SIDEWAYS'}); first line: {shown['first']}")  # fmt: skip
    return fine


def must_see(flow: dict) -> list[str]:
    """What a person must see of a flow in the list: the route and the cut's numbers (from the
    answer's X-ContextPaw headers), or a refusal's fix (from its comment)."""
    headers = {k.lower(): v for k, v in flow["response"]["headers"]}
    if "fix: " in flow.get("comment", ""):
        fix = flow["comment"].split("fix: ", 1)[1].split(" (")[0]
        return [f"{ROUTE} refused", f"fix: {fix}"]
    before, after = headers.get("x-contextpaw-original-tokens"), headers.get("x-contextpaw-final-tokens")
    return [ROUTE, f"{int(before):,}→{int(after):,}"] if before and after else [ROUTE]


async def flow_list(chromium_url: str, web: str, token: str, chats: list[dict], out: Path, width: int, height: int) -> bool:
    """Read the flow list as it is shown, with the detail pane closed and open, and check that each
    chat flow's route, cut and fix are on screen; prints what each row shows."""
    fine = True
    async with page(chromium_url, width, height) as browser:
        for pane, fragment in (("closed", "#/flows"), ("open", f"#/flows/{chats[0]['id']}/request")):
            ready = "document.querySelectorAll('.flow-table td.col-comment').length > 0"
            if pane == "open":
                ready += f" && !!{PRE}"
            await browser.call("Page.navigate", url="about:blank")  # a fresh load: a new fragment alone is not followed
            await browser.open(f"{web}/?token={token}{fragment}", ready)
            rows = await browser.evaluate(FLOW_LIST)
            if pane == "closed":
                await browser.screenshot(out / "mitmweb-flows.png")
            print(f"flow list, detail pane {pane} ({width}x{height}):")
            for flow in chats:
                row = next((r for r in rows if r["comment"] == flow.get("comment")), None)
                if row is None:
                    print(f"  MISSING: no row with the comment {flow.get('comment')!r}")
                    fine = False
                    continue
                missing = [text for text in must_see(flow) if text not in row["seen"]]
                fine &= not missing
                print(f"  shown: {row['seen']!r}" + (f"  NOT SHOWN: {missing}" if missing else "  (route, cut, fix: shown)"))
    return fine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=1100)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="contextpaw-screenshot-")))
        ollama = stack.enter_context(start_module("support.fake_ollama", ["--n-ctx", str(N_CTX)], "/", work / "ollama.log"))
        port, web_port, devtools = free_port(), free_port(), free_port()
        argv = [sys.executable, "-m", "contextpaw.command.cli", "--web", "--ollama", ollama.url, "--port", str(port),
                "--confdir", str(work / "conf"), "--set", f"web_port={web_port}", "--set", f"web_password={token}",
                "--set", "web_open_browser=false"]  # fmt: skip
        proxy, web = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{web_port}"
        stack.enter_context(start_process(argv, proxy, "/contextpaw/health", work / "mitmweb.log", 60))
        refused = chat(stream=False)
        refused["messages"][0]["content"] = "Follow every rule below. " + "Rule: be exact. " * 3000
        statuses = [post(f"{proxy}/api/chat", body) for body in (chat(stream=False), chat(stream=True), refused)]
        print("answered:", statuses)
        time.sleep(1)  # mitmweb has the last flow
        chats = [f for f in flows(web, token) if f["request"]["path"] == "/api/chat"]
        browser = [args.chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                   f"--remote-debugging-port={devtools}", f"--user-data-dir={work / 'chromium'}", "about:blank"]  # fmt: skip
        chromium = f"http://127.0.0.1:{devtools}"
        stack.enter_context(start_process(browser, chromium, "/json/version", work / "chromium.log", 60))
        pages = {
            "mitmweb-request.png": f"#/flows/{chats[0]['id']}/request",
            "mitmweb-response.png": f"#/flows/{chats[0]['id']}/response",
            "mitmweb-streamed.png": f"#/flows/{chats[1]['id']}/response",
            "mitmweb-refused.png": f"#/flows/{chats[2]['id']}/response",
        }
        fine = asyncio.run(take(chromium, web, token, pages, args.out, args.width, args.height))
        chats = [f for f in flows(web, token) if f["request"]["path"] == "/api/chat"]  # with their comments
        listed = asyncio.run(flow_list(chromium, web, token, chats, args.out, args.width, args.height))
        if not listed:
            print("FAILED: the flow list hides a chat's route, its cut or a refusal's fix (NOT SHOWN above)")
        fine &= listed
        for flow in flows(web, token):
            print(
                f"  {flow['marked'] or ' '} {flow['request']['path']:<22} {flow['response']['status_code']}  {flow.get('comment', '')[:90]}"
            )
    sys.exit(0 if fine else 1)


def _run(_: list[str] | None) -> int:
    main()
    return 0


if __name__ == "__main__":  # Ctrl-C or kill stops what it started, in one line
    sys.exit(run_demo(_run, name="screenshot_mitmweb", servers="the fake Ollama, mitmweb and Chromium"))
