"""A pass-through HTTP recorder: it sits between a client and its target, forwards every request
unchanged, streams every response back unchanged, and appends one JSON line per exchange to a file.

Each line holds the request (method, path with query, headers with credentials redacted, the body's
size and SHA-256, and the body parsed as JSON when it is JSON) and, once the response has been
streamed through, its status, headers and the first :data:`RESPONSE_KEPT` bytes of its body. Two
recorders, one in front of ContextPaw and one behind it, show byte for byte what the client sent and
what ContextPaw forwarded.

In a test: ``with running(recorder_app(target, log)) as url: ...`` (:func:`support.common.running`).
As a process: ``PYTHONPATH=tests python -m support.recorder --port P --target URL --out FILE``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from .common import serve

REDACTED = "<redacted>"
SECRET_HEADERS = frozenset({"authorization", "x-api-key", "proxy-authorization", "cookie", "api-key"})
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host"})
RESPONSE_KEPT = 256 * 1024
"""How much of each response body is kept in the log (all of it is streamed through)."""
SETTLE_SECONDS = 10.0
"""How long :func:`read_log` waits for exchanges still in flight to be written."""

_RECORDERS: dict[Path, Recorder] = {}
"""The recorders serving in this process, by the log they append to (see :func:`read_log`)."""


def redacted(headers: Any) -> dict[str, str]:
    """Headers as a dict of lower-case names (repeated ones joined by ``, ``), credentials replaced."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        name = name.lower()
        value = REDACTED if name in SECRET_HEADERS else value
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


def parse_body(raw: bytes) -> Any:
    """The body as JSON, or None when it is empty or not JSON."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


class Recorder:
    """The forwarding handler and the log it appends to (one writer lock: lines never interleave)."""

    def __init__(self, target: str, log: Path) -> None:
        self.target = target.rstrip("/")
        self.log = log
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._in_flight = 0
        self._session: aiohttp.ClientSession | None = None

    def settle(self, timeout: float) -> bool:
        """Wait until no exchange is in flight. A client can have its whole answer, and exit, before
        the upstream's end reaches the recorder and its line is written: a test that reads the log
        the moment the agent exits would miss that exchange. False when ``timeout`` ran out."""
        with self._settled:
            return self._settled.wait_for(lambda: self._in_flight == 0, timeout)

    async def lifetime(self, app: web.Application) -> Any:
        # no decompression, no cookie jar, no timeout: the bytes and the pace are the target's own
        self._session = aiohttp.ClientSession(
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        _RECORDERS[self.log.resolve()] = self
        yield
        if _RECORDERS.get(self.log.resolve()) is self:
            del _RECORDERS[self.log.resolve()]
        await self._session.close()

    def write(self, entry: dict[str, Any]) -> None:
        """Append the exchange's line; it is no longer in flight."""
        line = json.dumps(entry, ensure_ascii=False)
        with self._settled:
            with self.log.open("a", encoding="utf-8") as sink:
                sink.write(line + "\n")
            self._in_flight -= 1
            self._settled.notify_all()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        raw = await request.read()
        entry: dict[str, Any] = {
            "method": request.method,
            "path": request.path_qs,
            "headers": redacted(request.headers),
            "body_bytes": len(raw),
            "body_sha256": hashlib.sha256(raw).hexdigest(),
            "body": parse_body(raw),
        }
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | {"content-length"}}
        kept = bytearray()
        response: web.StreamResponse | None = None
        with self._settled:
            self._in_flight += 1
        try:
            async with self._session.request(
                request.method, self.target + request.path_qs, headers=headers, data=raw or None,
                allow_redirects=False,
            ) as upstream:  # fmt: skip
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for name, value in upstream.headers.items():
                    if name.lower() not in HOP_BY_HOP | {"content-length"}:
                        response.headers.add(name, value)
                if "Content-Length" in upstream.headers and upstream.headers.get("Transfer-Encoding") is None:
                    response.content_length = int(upstream.headers["Content-Length"])
                entry["response"] = {"status": upstream.status, "headers": redacted(upstream.headers)}
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    if len(kept) < RESPONSE_KEPT:
                        kept += chunk[: RESPONSE_KEPT - len(kept)]
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, ConnectionError) as error:
            # the target failed, or the client went away: say so in the log
            entry.setdefault("response", {"status": 502})["error"] = repr(error)
            if response is not None and response.prepared:
                if request.transport is None or request.transport.is_closing():
                    return response  # the client hung up (Codex does once it has its last event): nothing to end
                raise  # part of the answer went out: end the connection rather than pass a cut answer as whole
            return web.Response(status=502, text=f"recorder: {self.target} failed: {error!r}")
        finally:
            if "response" in entry:
                entry["response"]["body"] = kept.decode("utf-8", errors="replace")
            self.write(entry)


def recorder_app(target: str, log: Path) -> web.Application:
    """An app that forwards everything to ``target`` and records each exchange in ``log`` (JSONL)."""
    recorder = Recorder(target, Path(log))
    app = web.Application(client_max_size=1 << 30)
    app.cleanup_ctx.append(recorder.lifetime)
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    return app


def read_log(log: Path) -> list[dict[str, Any]]:
    """Every recorded exchange, oldest first ([] when nothing was recorded). When this process serves
    the recorder, exchanges still in flight are waited for first (up to :data:`SETTLE_SECONDS`)."""
    recorder = _RECORDERS.get(Path(log).resolve())
    if recorder is not None:
        recorder.settle(SETTLE_SECONDS)
    if not Path(log).exists():
        return []
    return [json.loads(line) for line in Path(log).read_text(encoding="utf-8").splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Forward HTTP to a target and record each request as JSONL.")
    parser.add_argument("--port", type=int, required=True, help="loopback port to listen on")
    parser.add_argument("--target", required=True, help="base URL to forward to, e.g. http://127.0.0.1:8080")
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to append to")
    args = parser.parse_args(argv)
    serve(recorder_app(args.target, args.out), args.port)


if __name__ == "__main__":
    main()


def reported_prompt_tokens(entry: dict[str, Any]) -> int | None:
    """The prompt size the server reported in a recorded response: OpenAI ``usage.prompt_tokens``,
    Anthropic ``usage.input_tokens`` (+ cache reads) on ``message_start``, Ollama
    ``prompt_eval_count``; streamed or not. None when the response names none."""
    body = (entry.get("response") or {}).get("body") or ""
    records: list[Any] = []
    for line in body.splitlines():
        line = line.strip()
        if line.startswith("data:"):
            line = line[5:].strip()
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    found = None
    for record in records:
        if not isinstance(record, dict):
            continue
        if isinstance(record.get("usage"), dict) and "prompt_tokens" in record["usage"]:
            found = record["usage"]["prompt_tokens"]
        message = record.get("message")
        usage = message.get("usage") if isinstance(message, dict) else None
        if record.get("type") == "message_start" and isinstance(usage, dict):
            found = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
        if "prompt_eval_count" in record:
            found = record["prompt_eval_count"]
    return found
