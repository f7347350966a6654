"""`contextpaw mcp`: an MCP server (stdio) that gives an agent back what ContextPaw evicted.

    contextpaw mcp [--url URL] [--state-dir DIR] [--token T]

Two tools, for agents that speak MCP (Claude Code, Codex, opencode, Qwen Code; `contextpaw launch`
registers the server with each):

- `contextpaw_retrieve(ref, part=1)`: the content a `[ContextPaw: …]` marker stands for, verbatim, from
  the proxy's `GET /contextpaw/evicted/<ref>`; long content comes in parts (`contextpaw.core.parts`:
  every agent cuts a tool result past a limit of its own);
- `contextpaw_search(query)`: references and snippets of kept content that holds every word, from
  `GET /contextpaw/search` (needs the token), of this server's session only (`--session`, which
  `contextpaw launch` gives the agent's requests too): the local token reads no other session's.

The token (`X-ContextPaw-Token`) is `--token`, else `CONTEXTPAW_TOKEN`, else the file
`contextpaw-token` the proxy makes in its state directory (`--state-dir`; by default ~/.contextpaw,
where `contextpaw` keeps it, then ~/.mitmproxy, mitmproxy's own), read at each call, so that the
proxy may start after the agent. Without one, a reference with its capability (`cp-<id>.<cap>`, as
the marker shows it) is still read back; searching says it needs the token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from contextpaw.command.launcher import DEFAULT_PROXIES, DIRECT, proxies
from contextpaw.core import parts, refs
from contextpaw.wire import SESSION_HEADER, session_of

ANSWERING = (200, 503)
"""Health statuses of a running ContextPaw: 503 says a backend does not answer, and what it
evicted is read back all the same."""
STATE_DIRS = (Path("~/.contextpaw"), Path("~/.mitmproxy"))
"""Where the proxy keeps its token: `contextpaw`'s confdir, then mitmproxy's (`mitmdump -s`)."""
TOKEN_FILE = "contextpaw-token"
TOKEN_MAX_BYTES = 1024
TIMEOUT_S = 30.0
SEARCH_LIMIT = 10

RETRIEVE_HELP = (
    "ContextPaw removed old messages from your context to fit the model's window and left a marker in their place, "
    "'[ContextPaw: … ref cp-….]'. Pass the reference from such a marker (cp-<id>.<capability>, copied whole) "
    "to get the removed messages or text back verbatim. Use it when you need something that was removed: a file's "
    "content, a tool's output, an earlier instruction. Long content comes in parts: the first line says which part "
    "you have and how many there are; call again with the same ref and part=N for the next."
)
SEARCH_HELP = (
    "ContextPaw removed old messages from your context to fit the model's window. Search what it removed: give words "
    "that the removed content holds (every word must occur); the answer lists references with a snippet each. Pass a "
    "reference to contextpaw_retrieve to get that content back verbatim."
)
INSTRUCTIONS = (
    "ContextPaw sits between this agent and its model and, when the conversation outgrows the window, replaces old "
    "messages with a [ContextPaw: …] marker that names a reference (cp-…). contextpaw_retrieve gives the removed "
    "content back from that reference; contextpaw_search finds references by the words of the removed content."
)


class Unanswered(Exception):
    """What the tool tells the model instead of a result (a tool error, in words)."""


@dataclass
class Proxy:
    """Where the running ContextPaw is and how to prove the right to read from it."""

    url: str | None = None
    """`--url`; None: the first of `launcher.proxies` that answers, found at the first call."""
    state_dirs: tuple[Path, ...] = STATE_DIRS
    token: str | None = None
    """`--token` or `CONTEXTPAW_TOKEN`; None: the state directory's token file."""
    session: str = ""
    """`--session` or `CONTEXTPAW_SESSION`: the session whose evictions a search finds (`wire.SESSION_HEADER`;
    `contextpaw launch` names one per agent run; "": the requests that named none)."""
    timeout: float = TIMEOUT_S
    _found: str | None = field(default=None, repr=False)

    def current_token(self) -> str | None:
        if self.token:
            return self.token
        for state_dir in self.state_dirs:
            path = state_dir.expanduser() / TOKEN_FILE
            try:
                if path.is_file() and path.stat().st_size <= TOKEN_MAX_BYTES:
                    if text := path.read_text(encoding="utf-8", errors="replace").strip():
                        return text
            except OSError:
                continue
        return None

    def get(self, url: str, token: str | None = None) -> tuple[int, Any]:
        """GET `url`: (status, JSON body or None); status 0 when nothing answers."""
        request = urllib.request.Request(url, headers={"Accept": "application/json"})
        if token:
            request.add_header("X-ContextPaw-Token", token)
        if self.session:
            request.add_header(SESSION_HEADER, self.session)
        try:
            with DIRECT.open(request, timeout=self.timeout) as answer:
                return answer.status, json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read() or b"null")
            except ValueError:
                return e.code, None
        except (urllib.error.URLError, OSError, ValueError):
            return 0, None

    def base(self) -> str:
        """The proxy's address (Unanswered: nothing answers there)."""
        if self.url:
            return self.url.rstrip("/")
        if self._found and self.get(self._found + "/contextpaw/health")[0] in ANSWERING:
            return self._found
        candidates = proxies(os.environ)
        for url in candidates:
            if self.get(url + "/contextpaw/health")[0] in ANSWERING:
                self._found = url
                return url
        raise Unanswered(
            f"ContextPaw is not running: nothing answers at {' or '.join(candidates)}. "
            "Start it (`contextpaw --ollama URL` or `--llamacpp URL`), or give `contextpaw mcp --url URL`."
        )

    def ask(self, path: str) -> Any:
        """The JSON of a 200 from the proxy at `path`, with the token where one is known."""
        base = self.base()
        status, body = self.get(base + path, self.current_token())
        if status == 0:
            raise Unanswered(f"ContextPaw is not running: nothing answers at {base}. Start it, or give `contextpaw mcp --url URL`.")
        if status != 200:
            raise Answered(status, body.get("error") if isinstance(body, dict) else None)
        return body


class Answered(Unanswered):
    """The proxy answered something other than 200."""

    def __init__(self, status: int, error: str | None) -> None:
        super().__init__(f"ContextPaw answered {status}" + (f": {error}" if error else ""))
        self.status, self.error = status, error


def reference(text: str) -> str:
    """The reference in what the model passed: a bare `cp-…`, or a marker or URL that holds one."""
    found = refs.REF.search(text or "")
    if found is None:
        raise Unanswered(
            f"{text!r} is not a ContextPaw reference: pass the one a [ContextPaw: …] marker names, "
            "cp- and 12 hex digits, with its capability (.16 hex digits) as the marker shows it."
        )
    return found[0]


def asking(part: int) -> str:
    return f"call contextpaw_retrieve again with part={part}"


def retrieve(proxy: Proxy, ref: str, part: int = 1) -> str:
    chosen = reference(ref)
    try:
        body = proxy.ask(refs.EVICTED_PATH + quote(chosen, safe=""))
    except Answered as e:
        if e.status != 404:
            raise
        raise Unanswered(
            f"ContextPaw keeps nothing under {chosen} that this reader may read: the reference is unknown, has left "
            "the archive, or lacks its capability (copy it whole from the marker: cp-<id>.<capability>)."
        ) from None
    if not isinstance(body, dict) or "content" not in body:
        raise Unanswered(f"ContextPaw's answer for {chosen} holds no content")
    try:
        return parts.paged(parts.rendered(body["content"]), chosen, part, asking)
    except parts.NoSuchPart as e:
        raise Unanswered(str(e)) from None


def search(proxy: Proxy, query: str, limit: int = SEARCH_LIMIT) -> str:
    if not (query or "").strip():
        raise Unanswered("give the words to search for")
    if proxy.current_token() is None:
        raise Unanswered(
            "searching ContextPaw's archive needs its token, and none was found (the file contextpaw-token in "
            f"{' or '.join(str(d) for d in proxy.state_dirs)}, CONTEXTPAW_TOKEN, or `contextpaw mcp --token`). "
            "contextpaw_retrieve still reads a reference copied from a marker."
        )
    try:
        body = proxy.ask("/contextpaw/search?" + urlencode({"q": query, "limit": max(1, min(int(limit), 50))}))
    except Answered as e:
        if e.status != 403:
            raise
        raise Unanswered(f"ContextPaw refused the search: {e.error or 'the token is not its own'}") from None
    results = [r for r in (body or {}).get("results") or [] if isinstance(r, dict) and r.get("ref")]
    if not results:
        return f"Nothing ContextPaw removed matches {query!r}."
    lines = [f"{len(results)} match(es); pass a reference to contextpaw_retrieve to read it whole:"]
    lines += [f"- {r['ref']}: {' '.join(str(r.get('snippet', '')).split())}" for r in results]
    return "\n".join(lines)


def server(proxy: Proxy) -> Any:
    """The MCP server with the two tools (the SDK is imported here: only `contextpaw mcp` needs it)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    from contextpaw.ops.admin import package_version

    app: Any = MCPServer("contextpaw", instructions=INSTRUCTIONS, version=package_version(), log_level="WARNING")

    async def contextpaw_retrieve(ref: str, part: int = 1) -> str:
        try:
            return await asyncio.to_thread(retrieve, proxy, ref, part)
        except Unanswered as e:
            raise ToolError(str(e)) from None

    async def contextpaw_search(query: str, limit: int = SEARCH_LIMIT) -> str:
        try:
            return await asyncio.to_thread(search, proxy, query, limit)
        except Unanswered as e:
            raise ToolError(str(e)) from None

    app.add_tool(contextpaw_retrieve, description=RETRIEVE_HELP, structured_output=False)
    app.add_tool(contextpaw_search, description=SEARCH_HELP, structured_output=False)
    return app


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="contextpaw mcp",
        description="An MCP server on stdin and stdout that gives an agent back what ContextPaw evicted from its "
        "context: contextpaw_retrieve(ref, part) and contextpaw_search(query). `contextpaw launch` registers it.",
    )
    p.add_argument(
        "--url",
        default=os.environ.get("CONTEXTPAW_URL") or None,
        help=f"where ContextPaw listens (default: CONTEXTPAW_URL, else the first of {', '.join(DEFAULT_PROXIES)} that answers, as for contextpaw launch)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help=f"the proxy's state directory, where it keeps {TOKEN_FILE} (default {' then '.join(map(str, STATE_DIRS))})",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("CONTEXTPAW_TOKEN") or None,
        help="the token to send as X-ContextPaw-Token (default: CONTEXTPAW_TOKEN, else the state directory's file)",
    )
    p.add_argument(
        "--session",
        default=os.environ.get("CONTEXTPAW_SESSION", ""),
        help=f"the session whose evictions contextpaw_search finds, the {SESSION_HEADER} its agent's requests send "
        "(default: CONTEXTPAW_SESSION; none: the requests that name none)",
    )
    return p


def main(argv: Sequence[str]) -> int:
    ns = parser().parse_args(list(argv))
    proxy = Proxy(url=ns.url, state_dirs=(ns.state_dir,) if ns.state_dir else STATE_DIRS, token=ns.token, session=session_of(ns.session))
    server(proxy).run("stdio")
    return 0
