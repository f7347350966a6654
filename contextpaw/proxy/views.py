"""mitmweb's `contextpaw` views: a compaction at a glance, and the answer beside the report.

mitmweb shows a view's text in a `<pre>` that does not wrap, and a JSON message is one line, so
everything here is wrapped to `WIDTH` columns and long texts are shown as excerpts (the `json` view
still has them whole).

- The request view starts with the report in a few lines (sizes, budget, window, counter, one line
  per hole with its retrieval id), then lists what went to the backend, message by message, with
  each marker and each "cut from the middle" note whole and, beside a shrunk message, the part that
  was cut; then the messages that were dropped, from the client's request.
- The response view gives the report's headline, the model's answer (or, on a refusal, the error
  sentence the client got), then the rest of the report. A streamed answer is read from the stream
  the addon keeps on the flow, record by record.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from mitmproxy import contentviews, http

from contextpaw.core.conversation import Message
from contextpaw.core.markers import MARKER_PREFIX
from contextpaw.wire.streams import REPORT_KEY, STREAM_TYPES

ORIGINAL = "contextpaw.original"
"""The flow metadata key under which the addon keeps the request body as the client sent it."""
REPORT = "contextpaw.report"
"""The flow metadata key of the report as the client sees it."""

WIDTH = 76
"""Columns the views wrap to: mitmweb's flow detail pane, beside the flow list at 13 px monospace,
is about 76 columns wide in a 1280-pixel window (84 in one of 1400)."""
EXCERPT_LINES = 3
"""Wrapped lines shown of a kept or dropped message (its head), and of each end of a cut."""
EVICTED_PATH = "/contextpaw/evicted/"


# -- the report ---------------------------------------------------------------------------------


def headline(report: Mapping[str, Any]) -> str:
    """The report in one line: what happened, in tokens against the budget and the window."""
    counter = f"counter {report.get('counter', '?')}{'' if report.get('exact') else ', estimated'}"
    window = f" of a {report['window']:,}-token window" if isinstance(report.get("window"), int) else ""
    budget = f"budget {report.get('budget', 0):,}{window}"
    if report.get("strategy") == "refused":
        needed = report.get("required_tokens") or report.get("original_tokens", 0)
        return f"ContextPaw refused this request: it needs {needed:,} tokens ({budget}; {counter})"
    if report.get("compacted"):
        return (
            f"ContextPaw compacted {report.get('original_tokens', 0):,} -> {report.get('final_tokens', 0):,} tokens ({budget}; {counter})"
        )
    if report.get("upper_bound"):
        return f"ContextPaw did not change this request: at most {report.get('original_tokens', 0):,} tokens by its size ({budget})"
    return f"ContextPaw did not change this request: {report.get('final_tokens', 0):,} tokens ({budget}; {counter})"


def report_lines(report: Mapping[str, Any]) -> list[str]:
    """The report, compact: the headline, then its `details`."""
    return [*_wrap(headline(report), "", "  "), *details(report)]


def details(report: Mapping[str, Any]) -> list[str]:
    """The strategy, one line per hole with its retrieval id, any cut the server made, the notes."""
    lines: list[str] = []
    removals = [r for r in report.get("removals") or () if isinstance(r, Mapping)]
    holes = _holes(removals)
    if removals:
        dropped = sum(1 for r in removals if r.get("action") != "shrunk")
        shrunk = len(removals) - dropped
        lines.append(
            f"{report.get('strategy')}: {report.get('evicted_tokens', 0):,} tokens removed in {len(holes)} "
            f"hole{'s' if len(holes) != 1 else ''} ({dropped} message{'s' if dropped != 1 else ''} dropped, {shrunk} shrunk)"
            + ("; recovered from the backend's overflow error" if report.get("recovered_from_upstream_400") else "")
        )
        for marker_id, rows in holes.items():
            lines.append(f"  {marker_id}  {_hole(rows)}")
        lines.append(f"  (each hole's content: GET {EVICTED_PATH}<id>)")
    for key, what in (
        ("upstream_truncated", "the server cut the prompt"),
        ("upstream_truncation_possible", "the server may have cut the prompt"),
    ):
        cut = report.get(key)
        if isinstance(cut, Mapping):
            lines.append(f"{what}: {cut.get('evaluated_tokens')} of {cut.get('sent_tokens')} tokens evaluated")
    cache = report.get("prompt_cache")
    if isinstance(cache, Mapping):
        lines.append(f"prompt cache: {cache.get('reused_tokens'):,} tokens reused, {cache.get('evaluated_tokens'):,} evaluated anew")
    if report.get("summarized"):
        lines.append("the markers carry a digest of what they replace")
    elif report.get("summary_reason"):
        lines.append(f"no digest: {report['summary_reason']}")
    lines += [f"note: {note}" for note in report.get("notes") or ()]
    return [wrapped for line in lines for wrapped in _wrap(line, "", "  ")]


def _holes(removals: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Removals by the marker that stands in for them, in the order the holes come."""
    holes: dict[str, list[Mapping[str, Any]]] = {}
    for r in removals:
        holes.setdefault(str(r.get("marker_id")), []).append(r)
    return holes


def _hole(rows: Sequence[Mapping[str, Any]]) -> str:
    tokens = sum(int(r.get("tokens") or 0) for r in rows)
    if rows[0].get("action") == "shrunk":
        where = "the prompt" if rows[0].get("index") == -1 else f"#{rows[0].get('index')} {rows[0].get('role')}"
        return f"{where} shrunk: {tokens:,} tokens cut from the middle"
    roles: dict[str, int] = {}
    for r in rows:
        roles[str(r.get("role"))] = roles.get(str(r.get("role")), 0) + 1
    what = ", ".join(f"{n} {role}" for role, n in roles.items())
    action = "summarized" if rows[0].get("action") == "summarized" else "dropped"
    return f"{_span([int(r.get('index') or 0) for r in rows])} {action} ({what}): {tokens:,} tokens"


def _span(indices: Sequence[int]) -> str:
    """`#2-#4, #7` for the message positions given."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"#{run[0]}" if len(run) == 1 else f"#{run[0]}-#{run[-1]}" for run in runs)


# -- the request ----------------------------------------------------------------------------------


def request_text(original: bytes, sent: bytes, report: Mapping[str, Any] | None) -> str:
    """The request view: the report, what the backend got, and what the client's request lost."""
    lines = report_lines(report) if report else ["ContextPaw changed this request (no report was kept)"]
    before, after = _body(original), _body(sent)
    if before is None or after is None:
        return "\n".join([*lines, "", "(the bodies are not JSON objects: see the raw view)"])
    removals = [r for r in (report or {}).get("removals") or () if isinstance(r, Mapping)]
    if isinstance(after.get("prompt"), str) and isinstance(before.get("prompt"), str):
        lines += ["", _rule("the prompt, as sent to the backend"), *_changed("prompt", before["prompt"], after["prompt"])]
        return "\n".join(lines)
    old, new = _messages(before), _messages(after)
    if old is None or new is None:
        return "\n".join([*lines, "", "(no messages in these bodies: see the json view)"])
    dropped = {int(r["index"]) for r in removals if r.get("action") != "shrunk" and isinstance(r.get("index"), int)}
    if (report or {}).get("strategy") == "refused":
        lines += ["", _rule(f"the client's request, not sent: {len(old)} messages")]
    else:
        lines += ["", *_sent_title(len(old), len(new), len(dropped), removals)]
    for fixed in ("system", "instructions"):
        if isinstance(after.get(fixed), str):
            lines += _excerpt(f"{fixed} (beside the messages)", after[fixed])
    lines += _sent(old, new, dropped)
    if dropped:
        lines += ["", _rule(f"dropped from the client's request: {len(dropped)} messages")]
        for i in sorted(dropped):
            if i < len(old):
                lines += _excerpt(f"#{i} {old[i].speaker}", old[i].text, EXCERPT_LINES - 1)
    return "\n".join(lines)


def _sent_title(client: int, sent: int, dropped: int, removals: Sequence[Mapping[str, Any]]) -> list[str]:
    """`sent to the backend: 18 of the client's 27 messages (9 dropped, 4 shrunk)`, and the marker
    messages added, if any; what does not fit on the rule goes on the line under it."""
    shrunk = sum(1 for r in removals if r.get("action") == "shrunk")
    kept = client - dropped
    markers = sent - kept
    counts = [f"{dropped} dropped"] + ([f"{shrunk} shrunk"] if shrunk else [])
    if markers > 0:
        counts.append(f"{markers} marker message{'s' if markers != 1 else ''} added")
    title = f"sent to the backend: {kept} of the client's {client} messages"
    if len(whole := f"{title} ({', '.join(counts)})") <= WIDTH - 4:
        return [_rule(whole)]
    return [_rule(title), f"  ({', '.join(counts)})"]


def _sent(old: Sequence[Message], new: Sequence[Message], dropped: set[int]) -> Iterator[str]:
    """Each sent message beside the client's message it stands for. A standalone marker is a
    message of a role that differs from the next kept one's (markers.py places them so); any other
    sent message is the next kept one, whole, shrunk, or with a marker folded into its start."""
    kept = iter(i for i in range(len(old)) if i not in dropped)
    upcoming = next(kept, None)
    for message in new:
        marker = message.text.startswith(MARKER_PREFIX)
        if upcoming is None or (marker and message.speaker != old[upcoming].speaker):
            yield from _whole("marker" if marker else "not in the client's request", message.speaker, message.text)
            continue
        yield from _changed(f"#{upcoming} {message.speaker}", old[upcoming].text, message.text)
        upcoming = next(kept, None)


def _changed(label: str, before: str, after: str) -> list[str]:
    """A kept text as sent: an excerpt if unchanged; a marker folded into its start, whole; and
    for a shrunk one the ends beside the cut, the note, whole, and what was cut."""
    lines: list[str] = []
    if (resumes := _folded(before, after)) is not None:
        lines = _whole(f"{label}, a marker folded into its start", "", after[:resumes].rstrip("\n"))
        label, after = "  then, as the client sent it", after[resumes:]
    if before == after:
        return lines + _excerpt(label, after)
    head = _common_prefix(before, after)
    tail = _common_prefix(before[head:][::-1], after[head:][::-1])
    added, cut = after[head : len(after) - tail], before[head : len(before) - tail]
    lines += _wrap(f"{label} · shrunk: {len(cut):,} of {len(before):,} characters cut from the middle", "", "    ")
    lines += _ends("    kept, up to the cut:", before[:head], last=True)
    lines += _wrap(added.strip("\n"), "  » ", "    ")
    lines += _ends("    kept, after the cut:", after[len(after) - tail :], last=False)
    lines += _ends(f"    what was cut ({len(cut):,} characters), its start and end:", cut, last=None)
    return lines


def _folded(before: str, after: str) -> int | None:
    """Where the client's text resumes in `after` when a marker was folded into its start (the
    marker, and any digest, end with `]` and a blank line), or None."""
    if not after.startswith(MARKER_PREFIX) or before.startswith(MARKER_PREFIX):
        return None
    for end in re.finditer(r"\]\n\n", after):
        if _common_prefix(after[end.end() :], before) or after[end.end() :] == before:
            return end.end()
    return None


def _whole(what: str, role: str, text: str) -> list[str]:
    label = f"» {what}" + (f" ({role})" if role else "")
    return [*_wrap(label, "", "    "), *_wrap(text, "  » ", "    ")]


def _excerpt(label: str, text: str, lines: int = EXCERPT_LINES) -> list[str]:
    return [*_wrap(f"{label} · {len(text):,} characters", "", "    "), *_first(text, lines, "    ")[0]]


def _ends(label: str, text: str, last: bool | None) -> list[str]:
    """The lines of `text` beside a cut: its last few (`last`), its first few, or both ends (None)."""
    indent, text = "      ", text.strip("\n")  # the line breaks beside the note are the note's
    if not text:
        return [label, f"{indent}(nothing)"]
    if last is not None:
        return [label, *(_last if last else _first)(text, EXCERPT_LINES, indent)[0]]
    whole, more = _first(text, 2 * EXCERPT_LINES, indent)
    if not more:
        return [label, *whole]
    return [label, *_first(text, EXCERPT_LINES, indent)[0], *_last(text, EXCERPT_LINES, indent)[0][1:]]


def _first(text: str, n: int, indent: str) -> tuple[list[str], bool]:
    """The first `n` wrapped lines of `text`, then `…` if there is more (and whether there is):
    only the start is wrapped, as a message can be megabytes."""
    shown = _wrap(text[: WIDTH * (n + 1)], indent, indent)
    more = len(shown) > n or len(text) > WIDTH * (n + 1)
    return ([*shown[:n], f"{indent}…"] if more else shown), more


def _last(text: str, n: int, indent: str) -> tuple[list[str], bool]:
    """`…` if there is more, then the last `n` wrapped lines of `text` (and whether there is more)."""
    shown = _wrap(text[-WIDTH * (n + 1) :], indent, indent)
    more = len(shown) > n or len(text) > WIDTH * (n + 1)
    return ([f"{indent}…", *shown[-n:]] if more else shown), more


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix, by halving (slices compare in C: a 1 MB message
    costs a few dozen comparisons, not a million steps)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _body(raw: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def _messages(body: Mapping[str, Any]) -> list[Message] | None:
    """The conversation of a chat body in the neutral form (Responses' `input` as well), or None."""
    items = body.get("messages", body.get("input"))
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        return None
    out = []
    for item in items:
        try:
            out.append(Message.from_wire(item))
        except (ValueError, TypeError, AttributeError):
            out.append(Message({}, "?", json.dumps(item, ensure_ascii=False), 0))
    return out


# -- the response ---------------------------------------------------------------------------------


def response_text(status: int, content_type: str, body: bytes, report: Mapping[str, Any] | None) -> str:
    """The response view: the headline, the answer (or the refusal's sentence), and the report."""
    records = list(_records(body, content_type))
    report = report if report is not None else _carried_report(records)
    lines = _wrap(headline(report), "", "  ") if report else []
    streamed = content_type.startswith(STREAM_TYPES)
    how = f"streamed, {len(records)} records" if streamed else "one body"
    errors = [e for e in map(_error, records) if e]
    if status >= 400 or errors:
        lines += ["", _rule(f"the client was answered {status}: {how}")]
        lines += [w for e in errors or [body.decode("utf-8", "replace")] for w in _wrap(e, "  ", "  ")]
    else:
        answer = "".join(_answer(r, streamed) for r in records)
        lines += ["", _rule(f"the answer: {status}, {how}")]
        lines += _wrap(answer, "  ", "  ") if answer else ["  (no text in the answer: see the json or raw view)"]
    if report and (more := details(report)):
        where = "the final record's" if streamed else "the body's"
        lines += ["", _rule(f"the report (whole: {where} `contextpaw`)"), *more]
    return "\n".join(lines)


def _records(body: bytes, content_type: str) -> Iterator[Any]:
    """The JSON values of a body: one, or each record of an NDJSON or SSE stream."""
    if content_type.startswith("text/event-stream"):
        for event in body.split(b"\n\n"):
            data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if data and data != b"[DONE]":
                yield from _parsed(data)
    elif content_type.startswith("application/x-ndjson"):
        for line in body.split(b"\n"):
            yield from _parsed(line)
    else:
        yield from _parsed(body)


def _parsed(data: bytes) -> Iterator[Any]:
    if data.strip():
        try:
            yield json.loads(data)
        except (ValueError, RecursionError):
            pass


def _carried_report(records: Sequence[Any]) -> Mapping[str, Any] | None:
    """The report the answer carries itself (a flow saved before metadata kept it)."""
    for record in reversed(records):
        if isinstance(record, dict) and isinstance(report := record.get(REPORT_KEY.decode()), dict):
            return report
    return None


def _error(record: Any) -> str | None:
    """The sentence of an error body or record, in any of the APIs' shapes."""
    if not isinstance(record, dict):
        return None
    error = record.get("error")
    if isinstance(error, str):
        return error
    if isinstance(error, Mapping) and isinstance(error.get("message"), str):
        return error["message"]
    return None


def _answer(record: Any, streamed: bool) -> str:
    """The text (and tool calls) one body or stream record adds to the answer, in any of the APIs:
    Ollama's `message` and `response`, OpenAI's `choices`, Anthropic's `content` and `delta`,
    Responses' `output` and `*.delta` events, llama-server's `content`."""
    if not isinstance(record, dict):
        return ""
    if isinstance(record.get("choices"), list):
        out = []
        for choice in record["choices"]:
            if isinstance(choice, Mapping):
                out += [_said(choice[k]) for k in ("message", "delta") if isinstance(choice.get(k), Mapping)]
                out.append(choice["text"] if isinstance(choice.get("text"), str) else "")
        return "".join(out)
    if isinstance(record.get("message"), Mapping):
        return _said(record["message"])
    if isinstance(record.get("response"), str):
        return record["response"]
    delta = record.get("delta")
    if isinstance(delta, Mapping):
        return next((delta[k] for k in ("text", "partial_json") if isinstance(delta.get(k), str)), "")
    if isinstance(delta, str):
        return delta if str(record.get("type", "")).startswith(("response.output_text", "response.function_call")) else ""
    if isinstance(record.get("content_block"), Mapping) and record["content_block"].get("type") == "tool_use":
        return f"\n[tool call {record['content_block'].get('name')}] "
    if isinstance(record.get("content"), (str, list)):
        return _said(record)
    if not streamed and isinstance(record.get("output"), list):
        return "".join(_said(item) for item in record["output"] if isinstance(item, Mapping))
    return ""


def _said(message: Mapping[str, Any]) -> str:
    """A message's (or content block's, or output item's) text, with its tool calls named."""
    out: list[str] = []
    content = message.get("content")
    if isinstance(content, str):
        out.append(content)
    elif isinstance(content, list):
        out += [_said(part) if "content" in part else str(part.get("text") or "") for part in content if isinstance(part, Mapping)]
    if message.get("type") in ("tool_use", "function_call"):
        arguments = message.get("arguments", message.get("input"))
        out.append(f"\n[tool call {message.get('name')} {arguments if isinstance(arguments, str) else json.dumps(arguments)}]")
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            name = f"[tool call {function['name']}] " if function.get("name") else ""
            arguments = function.get("arguments")
            out.append(name + (arguments if isinstance(arguments, str) else json.dumps(arguments) if arguments else ""))
    return "".join(out)


# -- layout ---------------------------------------------------------------------------------------


def _rule(title: str) -> str:
    """A section's title on a line drawn across the pane."""
    return f"── {title} ".ljust(WIDTH, "─")


def _wrap(text: str, first: str, rest: str) -> list[str]:
    """`text` in lines of at most `WIDTH` columns, its own line breaks kept, `first` before the
    first line and `rest` before the others."""
    out: list[str] = []
    for line in text.splitlines() or [""]:
        prefix = first if not out else rest
        wrapped = textwrap.wrap(line, WIDTH, initial_indent=prefix, subsequent_indent=rest, break_on_hyphens=False)
        out += wrapped or [prefix.rstrip()]
    return [line.rstrip() for line in out]


# -- the mitmproxy views --------------------------------------------------------------------------


class ContextPawView(contentviews.Contentview):
    """On the request of a flow ContextPaw changed or refused, and on the response of a flow it
    reported on; other flows get mitmproxy's own views."""

    name = "contextpaw"
    syntax_highlight = "none"

    def prettify(self, data: bytes, metadata: contentviews.Metadata) -> str:
        kept = metadata.flow.metadata if metadata.flow is not None else {}
        report = kept.get(REPORT)
        message = metadata.http_message
        if isinstance(message, http.Response):
            return response_text(message.status_code, metadata.content_type or "", data, report)
        if ORIGINAL in kept:
            return request_text(kept[ORIGINAL], data, report)
        if report is not None:  # refused: what the client sent is what is shown
            return request_text(data, data, report)
        raise ValueError("ContextPaw did not change this request")

    def render_priority(self, data: bytes, metadata: contentviews.Metadata) -> float:
        kept = metadata.flow.metadata if metadata.flow is not None else {}
        message = metadata.http_message
        if isinstance(message, http.Request):
            return 2 if ORIGINAL in kept or (kept.get(REPORT) or {}).get("strategy") == "refused" else -1
        return 2 if isinstance(message, http.Response) and REPORT in kept else -1
