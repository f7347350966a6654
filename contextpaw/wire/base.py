"""What every API's wire format is made of: the parsed request (`Chat`, `Prompt`), its parameters,
the route that reads and writes it, the refusal numbers, and the backend behind a port. The API
modules build their routes from these; the package puts the routes together. Pure: bytes and
dicts in, bytes and dicts out, no mitmproxy, no I/O and no compaction."""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import math
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Self
from urllib.parse import urlsplit

import orjson

from contextpaw.core.conversation import Conversation
from contextpaw.core.tokens import Counter


class Kind(StrEnum):
    """The server behind a port; it decides which routes exist there."""

    OLLAMA = "ollama"
    LLAMACPP = "llamacpp"


class NotCompactable(ValueError):
    """A body ContextPaw does not understand (bad JSON, a batch prompt): forward it untouched.

    Not an error of ours: the backend answers it in its own words.
    """


class NotFittable(NotCompactable):
    """A request ContextPaw understands but may not fit (its history lives on the server): it is
    forwarded untouched, and the report says why."""


class Unreadable(NotCompactable):
    """A body that may be valid JSON but that ContextPaw cannot read (nested deeper than Python's
    parser goes): it goes as it came, unjudged, and the client is told so (a header and a report)."""


# -- the client's JSON, read and written back as it was written ----------------------------------------


class Number(float):
    """A number kept as the client wrote it, where Python would not write it back the same: `1e400`
    (which it reads as infinity and writes as `Infinity`, not JSON), `1.50`, `-0`, an integer of
    more digits than `int` reads (4,300). The engine sees its value (infinite where it has none);
    `write` writes the literal."""

    __slots__ = ("literal",)
    literal: str

    def __new__(cls, literal: str) -> Self:
        number = super().__new__(cls, float(literal))
        number.literal = literal
        return number


class Body(dict[str, Any]):
    """A request body as read, and whether it holds a `Number` (only then is it walked to write)."""

    __slots__ = ("numbers",)

    def __init__(self, value: Mapping[str, Any], numbers: bool) -> None:
        super().__init__(value)
        self.numbers = numbers


_NONCE = secrets.token_hex(8)
"""A literal is written as this string first, then put in its place: no client string can be one."""
_LITERAL = re.compile(r'"\\u0000' + _NONCE + r':([^"\\]*)\\u0000"')


def read_json(data: bytes) -> Any:
    """JSON bytes as `json.loads` reads them (an answer's body, a kept hole), by orjson in a
    quarter of the time; by `json` where orjson refuses them (NaN, a number past a double, a
    byte-order mark, UTF-16), so that the ValueError is json's. One difference is left: orjson reads
    an integer past 64 bits as a float (no count is that big, and what is read here is never written
    back). It runs for every handled answer."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def load(raw: bytes) -> Any:
    """JSON bytes as `json.loads` reads them (UTF-8, -16 or -32), every number that Python would not
    write back as written read as a `Number`; an object comes back as a `Body`. A float that orjson
    would write otherwise (`1e-05` as `0.00001`) is a `Number` too, so that what orjson writes of
    what was read here is what was sent."""
    numbers = False

    def kept(literal: str) -> Number:
        nonlocal numbers
        numbers = True
        return Number(literal)

    def real(literal: str) -> float | Number:
        value = float(literal)
        written = math.isfinite(value) and repr(value) == literal and orjson.dumps(value) == literal.encode()
        return value if written else kept(literal)

    def integer(literal: str) -> int | Number:
        if literal != "-0":
            try:
                return int(literal)
            except ValueError:  # more digits than int reads (sys.get_int_max_str_digits)
                pass
        return kept(literal)

    decoder = json.JSONDecoder(parse_float=real, parse_int=integer, parse_constant=kept, object_hook=_handed_over)
    value = decoder.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    return Body(value, numbers) if isinstance(value, dict) else value


def _handed_over(value: dict[str, Any]) -> dict[str, Any]:
    """Each object as `json` built it. Being Python, the call lets the interpreter hand its lock to
    another thread, as the C scanner never does: a 9 MB body read in a worker thread kept the event
    loop waiting up to 32-41 ms at a time without it, 6.5 ms with it, in the same total time."""
    return value


def _placeholders(value: Any) -> Any:
    """`value` with each `Number` as the string `write` replaces by its literal."""
    if isinstance(value, Number):
        return f"\x00{_NONCE}:{value.literal}\x00"
    if isinstance(value, Mapping):
        return {k: _placeholders(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_placeholders(v) for v in value]
    return value


# -- a body in another charset -----------------------------------------------------------------------

_CHARSET = re.compile(r';\s*charset\s*=\s*"?([^\s;"]+)"?', re.IGNORECASE)


def as_utf8(raw: bytes, content_type: str) -> bytes | None:
    """A body whose Content-Type declares a charset other than UTF-8 (`charset=iso-8859-1`), decoded
    by it and in UTF-8, as JSON is read; None where nothing needs doing (no charset, UTF-8, a body that
    is ASCII) or the charset is not known or does not decode the body."""
    found = _CHARSET.search(content_type)
    if found is None:
        return None
    try:
        codec = codecs.lookup(found.group(1)).name
    except LookupError:
        return None
    if codec in ("utf-8", "ascii") or raw.isascii() and not codec.startswith(("utf-16", "utf-32")):
        return None
    try:
        return raw.decode(codec).encode("utf-8", "surrogatepass")
    except (UnicodeError, ValueError):
        return None


def utf8_type(content_type: str) -> str:
    """The Content-Type of a body now in UTF-8: the declared charset replaced."""
    return _CHARSET.sub("; charset=utf-8", content_type, count=1)


def int_field(container: Any, *names: str) -> int | None:
    """The first of `names` in `container` that holds an integer (bools are not integers)."""
    if not isinstance(container, Mapping):
        return None
    for name in names:
        value = container.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def positive(value: Any) -> int | None:
    """A window or answer length the request or server set, or None: zero and negative values (the
    'unlimited' spellings -1, -2, 0 of an answer length; a window of none) and what is not a whole
    number say nothing, the backend decides."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


EVALUATED_KEYS = rb'"(?:prompt_eval_count|tokens_evaluated|usage)"'
"""The keys `evaluated_tokens` reads, as a route's `telling` pattern spells them."""


def evaluated_tokens(record: Mapping[str, Any]) -> int | None:
    """The prompt size a server reports in a final record: Ollama's `prompt_eval_count`, the OpenAI
    `usage.prompt_tokens`, or llama.cpp's native `tokens_evaluated`."""
    usage = record.get("usage")
    return int_field(record, "prompt_eval_count", "tokens_evaluated") or int_field(usage, "prompt_tokens")


@dataclass(frozen=True, slots=True)
class Params:
    """What a request says about its own window and answer length."""

    model: str
    stream: bool
    num_ctx: int | None = None
    """The window the request asks for (Ollama `options.num_ctx`); None when it cannot say."""
    max_output: int | None = None
    """The answer length asked for (`num_predict`, `max_tokens`, ...); None when unbounded or absent."""


def answer_params(body: Mapping[str, Any], *max_output_fields: str) -> Params:
    """The `Params` of an API whose request cannot name its window, only the answer's length (in
    the first of `max_output_fields` it sets), and whose `stream` defaults to false: OpenAI's,
    llama-server's native one, Anthropic's."""
    return Params(
        model=str(body.get("model", "")),
        stream=body.get("stream") is True,
        max_output=positive(int_field(body, *max_output_fields)),
    )


def plain_marker(role: str, text: str) -> dict[str, Any]:
    """A marker as a message of its own where content may be a string (Ollama, OpenAI chat, Anthropic)."""
    return {"role": role, "content": text}


FINGERPRINTED = 32
"""Characters a line needs before its digest is kept: "}" and "ok" say nothing of which
conversation a request repeats."""


@dataclass(frozen=True, slots=True)
class Chat:
    body: dict[str, Any]
    conversation: Conversation
    params: Params
    fixed_text: str = ""
    """A system prompt sent beside the messages (Anthropic's `system`): counted, never cut."""
    exact_count: tuple[str, tuple[str, ...]] = ("/v1/chat/completions/input_tokens", ("messages", "tools"))
    """Where llama-server counts a whole request in this API, and the fields it reads."""
    field: str = "messages"
    """The body's field that holds the conversation (the Responses API's is `input`)."""
    marker: Callable[[str, str], dict[str, Any]] = plain_marker
    """(role, text) -> a marker that stands as a message of its own, in this API's shape."""
    secret: bytes = b""
    """The key the conversation's `key` is made with (the proxy's secret, passed in by `keyed`)."""
    read_lines: list[tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=list, compare=False, repr=False)
    """`fingerprints`, once read (a big body's are read in the worker thread that parsed it)."""
    made_key: list[str] = dataclasses.field(default_factory=list, init=False, compare=False, repr=False)
    """`key`, once made: it writes the first user message, megabytes at times, and is asked for
    several times a request (not shared by `keyed`'s copy, whose secret differs)."""

    def counted(self, sent: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """(path, body) that asks llama-server for the exact size of `sent`, a body in this API."""
        path, fields = self.exact_count
        return path, {k: sent[k] for k in fields if sent.get(k) is not None}

    @property
    def key(self) -> str:
        """Who this conversation is across turns: model, system prompt and first user message.

        Those stay the same while the history after them grows, and differ between conversations.
        They are read as the model reads them (role, text, images), not as spelled: Claude Code
        sends its environment message as text blocks on the first turn and as a string after it,
        and moves `cache_control` between blocks, in one conversation.
        Keyed with the proxy's secret (`keyed`): nobody who lacks it can name another's conversation.
        """
        if not self.made_key:
            messages = self.conversation.messages
            anchor = [self.fixed_text] + [(m.role, m.text, m.images) for m in messages if m.pinned]
            anchor += [(m.role, m.text, m.images) for m in messages if m.role == "user"][:1]
            data = json.dumps([self.params.model, anchor], sort_keys=True, ensure_ascii=False, default=str)
            self.made_key.append(hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=12, key=self.secret[:64]).hexdigest())
        return self.made_key[0]

    def fingerprints(self) -> tuple[tuple[int, int], ...]:
        """(digest, characters) of each line of the messages long enough to say something, read as
        the model reads it. An agent that compacts its own history starts a new conversation that
        repeats what the server has counted: the history under a summary request's own system
        prompt, the files it reads again after its summary, the turns it keeps. The digests are
        Python's own string hash: kept in memory only, within one process."""
        if not self.read_lines:
            self.read_lines.append(
                tuple(
                    (hash(line), len(line)) for m in self.conversation.messages for line in m.text.split("\n") if len(line) >= FINGERPRINTED
                )
            )
        return self.read_lines[0]

    @property
    def characters(self) -> int:
        """The characters the model reads as text: the system prompt beside the messages and theirs."""
        return len(self.fixed_text) + sum(len(m.text) for m in self.conversation.messages)

    @property
    def texts(self) -> list[str]:
        """Every text a counter will be asked about, so an exact count can be fetched beforehand."""
        texts = [self.fixed_text] + [t for m in self.conversation.messages for t in (m.text, m.content_text)]
        if self.conversation.tools:
            texts.append(json.dumps(self.conversation.tools, ensure_ascii=False, separators=(",", ":")))
        return texts

    @property
    def has_system(self) -> bool:
        return bool(self.fixed_text) or (bool(self.conversation.messages) and self.conversation.messages[0].role == "system")

    def tokens(self, counter: Counter, fixed_tokens: int = 0) -> int:
        """The whole request as `counter` counts it, as `fit` does before cutting anything."""
        return self.fixed_cost(counter, fixed_tokens) + sum(counter.message(m) for m in self.conversation.messages)

    def fixed_cost(self, counter: Counter, fixed_tokens: int = 0) -> int:
        """What the request costs besides its messages: the template's tokens, the text never cut
        and the tool definitions."""
        return fixed_tokens + (counter.text(self.fixed_text) if self.fixed_text else 0) + counter.tools(self.conversation.tools)


def keyed(parsed: Chat | Prompt, secret: bytes) -> Chat | Prompt:
    """`parsed` with its conversation keyed by `secret` (a prompt has no conversation)."""
    return dataclasses.replace(parsed, secret=secret) if isinstance(parsed, Chat) and secret else parsed


@dataclass(frozen=True, slots=True)
class Prompt:
    body: dict[str, Any]
    prompt: str
    params: Params
    fixed_text: str = ""
    """Text that is sent with the prompt but never cut (Ollama's `system`, `suffix`)."""
    images: int = 0

    key = None
    """Prompts have no turns to remember."""
    has_system = False

    @property
    def texts(self) -> list[str]:
        return [self.prompt, self.fixed_text]


@dataclass(frozen=True, slots=True)
class Overflow:
    """The numbers a refusal states: what the request needs and what fits."""

    required: int
    budget: int
    window: int
    cause: str
    """A sentence with the numbers: why the request cannot be sent as it is."""
    original: int | None = None
    """The whole request's size, when it was counted (for a strict refusal it is `required`)."""
    head: int | None = None
    """The tokens of what is never cut (an agent's tools and instructions), when they alone are over
    the budget: no compaction helps, only a bigger window."""
    least_window: int | None = None
    """The least window that holds the head with room for an answer and the headroom."""
    strict: bool = False
    """Refused by policy strict: compacting it (policy compact) would have sent it."""

    @property
    def fixed_part(self) -> str:
        """The sentence that tells the user to raise the window; empty when the head fits."""
        if self.head is None or self.least_window is None:
            return ""
        return f"the agent's tools and instructions need {self.head} tokens; raise the window to at least {self.least_window}"

    @property
    def message(self) -> str:
        said = (
            f"ContextPaw: {self.cause} (the budget is a {self.window}-token context window minus "
            f"{self.window - self.budget} tokens kept for the answer and the template)"
        )
        return f"{said}; {self.fixed_part}" if self.fixed_part else said


@dataclass(frozen=True, slots=True)
class UpstreamOverflow:
    """A backend's own context overflow (llama-server's `exceed_context_size_error`)."""

    n_prompt_tokens: int
    n_ctx: int


STREAM_FIELD = re.compile(rb'"stream"\s*:\s*(true|false)?')
ESCAPED_LETTER = re.compile(rb"\\u00[67]", re.IGNORECASE)
"""A JSON escape of a lower-case ASCII letter (`\\u0073`): no encoder writes one, but a key may be
spelled so (`"stream"` is all such letters)."""
ESCAPED_ASCII = re.compile(rb"\\u00[2-7]", re.IGNORECASE)
"""A JSON escape of any printable ASCII character: what a stream record's telling words (`Route.telling`:
underscores, dots, `true`) could be spelled with. Wider than `ESCAPED_LETTER`, so Go's `\\u003c` for
`<` counts too, and such a record is parsed."""

REFUSAL_STATUS = 400
"""Every API's own answer to a prompt over the window is a 400 (Ollama's, llama-server's, OpenAI's,
Anthropic's), and their clients tell an overflow by it and its words; a 413 reads to them as a limit
on the body's size (Anthropic's `request_too_large`)."""


def prompt_cache(record: Mapping[str, Any]) -> tuple[int, int] | None:
    """(reused, evaluated): the prompt tokens llama-server took from its cache and those it
    evaluated anew (`timings.cache_n`, `timings.prompt_n`, in a whole answer and a stream's last
    record); None where the record says neither."""
    timings = record.get("timings")
    if not isinstance(timings, Mapping):
        return None
    reused, evaluated = timings.get("cache_n"), timings.get("prompt_n")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (reused, evaluated)):
        return None
    return reused, evaluated  # type: ignore[return-value]


USAGE_HEADER = "X-ContextPaw-Usage"
"""A client's word on the usage it is told after a cut: `whole` (its whole history's size) or
`served` (the server's count), over the `contextpaw_usage_whole` option. `contextpaw launch` has each
agent send `whole`: an agent that compacts from usage then learns, on the turn ContextPaw cut, that
its history is over the window."""


def usage_whole(option: bool, header: str | None) -> bool:
    """Whether the usage told after a cut is the whole history's: the request's `USAGE_HEADER`
    where it says `whole` or `served`, else the option."""
    said = (header or "").strip().lower()
    return said == "whole" if said in ("whole", "served") else option


SESSION_HEADER = "X-ContextPaw-Session"
"""The session a request belongs to, named by the client: `contextpaw launch` gives an agent's
requests and its `contextpaw mcp` the same one, so that the local token searches what that session
evicted and no other's. Requests that name none are one session together ("")."""
_SESSION = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def session_of(header: str | None) -> str:
    """The session a `SESSION_HEADER` names ("" for none, or for anything not a plain name)."""
    said = (header or "").strip()
    return said if _SESSION.fullmatch(said) else ""


def told_usage(record: Mapping[str, Any], added: int, paths: tuple[tuple[str, ...], ...]) -> dict[str, Any] | None:
    """`record` with `added` tokens added to each integer count at `paths` (the answer's prompt
    size, as the client reads it), or None where it has none of them."""
    out = dict(record)
    told = False
    for path in paths:
        node = out
        for key in path[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                break
            node[key] = copy = dict(child)  # copied on the way down: the answer as read stays as it came
            node = copy
        else:
            value = node.get(path[-1])
            if isinstance(value, int) and not isinstance(value, bool):
                node[path[-1]] = value + added
                told = True
    return out if told else None


@dataclass(frozen=True, slots=True)
class Route:
    """One handled endpoint: how to read, rewrite and answer it in its API's convention."""

    name: str
    parse: Callable[[dict[str, Any]], Chat | Prompt]
    refusal: Callable[[Overflow, dict[str, Any]], dict[str, Any]]
    """(numbers, report JSON) -> the body of the refusal (`REFUSAL_STATUS`)."""
    proxy_error: Callable[[str, int], dict[str, Any]]
    """(reason, status) -> the body of an answer of the proxy's own: 413 (too big), 502 (the backend
    does not answer), 503 (not available now), 504 (the backend fell silent)."""
    framing: Literal["ndjson", "sse"]
    is_final: Callable[[Mapping[str, Any]], bool]
    """Whether a stream record is the last one that carries data (the report goes into it)."""
    evaluated: Callable[[Mapping[str, Any]], int | None] = evaluated_tokens
    """The prompt size the server reports in an answer or a stream record, or None."""
    streams_unless_told: bool = False
    """Whether a request that does not say `"stream": true|false` is answered in a stream (Ollama's
    native routes); every route reads any other value as this default."""
    prompt_counts: tuple[tuple[str, ...], ...] = ()
    """Where the final record (or the whole answer) says the prompt's size to the client, each a
    path of keys: what `told_usage` adds ContextPaw's cut to, so that an agent that compacts from
    usage learns its history overflowed."""
    telling: re.Pattern[bytes] | None = None
    """What the bytes of every stream record that `is_final` or `evaluated` tells something of hold
    (a key, or a key and its value): a record without it, and without an escaped ASCII character
    that could spell one (`ESCAPED_ASCII`), is passed on unparsed. Token records are
    nearly all of a stream, and parsing each one was most of what a stream cost the proxy. None:
    every record is parsed."""

    def streams(self, raw: bytes) -> bool | None:
        """Whether a request body asks for a stream, read without parsing it; None when the bytes
        alone cannot say. A `"stream"` key cannot be spelled inside a string (its quotes would be
        escaped), but it may be another object's (a tool call's arguments); so each occurrence is
        read as the request's own in turn, and so is none at all, and every reading must agree. A
        key spelled with escaped letters is not seen, so a body with any is not read."""
        if ESCAPED_LETTER.search(raw):
            return None
        readings = {self.streams_unless_told}
        for found in STREAM_FIELD.finditer(raw):
            value = found.group(1)
            readings.add(value == b"true" if value else self.streams_unless_told)
        return readings.pop() if len(readings) == 1 else None

    def read(self, raw: bytes) -> Chat | Prompt:
        try:
            body = load(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise NotCompactable(f"body is not JSON: {e}") from None
        except RecursionError:
            raise Unreadable("the body is nested deeper than ContextPaw reads JSON") from None
        if not isinstance(body, dict):
            raise NotCompactable("body is not a JSON object")
        try:
            return self.parse(body)
        except NotCompactable:
            raise
        except (ValueError, TypeError, AttributeError) as e:
            raise NotCompactable(str(e)) from None


def write(body: Mapping[str, Any], **changes: Any) -> bytes:
    """The request body with one field replaced; everything else is kept as the client sent it.

    A lone surrogate (a JavaScript string cut inside an emoji) is written back as the JSON escape it
    came in as, not as bytes no UTF-8 decoder accepts. A number Python would not write back as it
    was written (`1e400`) goes as the client wrote it (`Number`, where `load` read the body).
    """
    merged = {**body, **changes}
    if not getattr(body, "numbers", False):
        return json.dumps(merged, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")
    return dumps(merged, separators=(",", ":")).encode("utf-8", "backslashreplace")


def dumps(value: Any, **options: Any) -> str:
    """`json.dumps(value, ensure_ascii=False, **options)`, each `Number` in it as the client wrote it.

    A list (an evicted hole's messages) is written an item at a time, joined as `json` joins them:
    the same text, but the interpreter's lock is let go between items; one call for a hole of
    several megabytes held every other client for 0.2-0.4 s."""
    if isinstance(value, list) and value and options.keys() <= {"separators"}:
        comma: str = options.get("separators", (", ", ": "))[0]
        return "[" + comma.join(dumps(item, **options) for item in value) + "]"
    text = json.dumps(_placeholders(value), ensure_ascii=False, **options)
    return _LITERAL.sub(lambda found: str(found.group(1)), text)


MODEL_FIELD = re.compile(rb'"model"\s*:\s*"([A-Za-z0-9._:/@+-]{1,256})"')


def model_of(raw: bytes) -> str | None:
    """The model a request body names, read without parsing it: only when `"model"` occurs once (so
    it cannot be another field's) and the name needs no unescaping."""
    if raw.count(b'"model"') != 1 or (found := MODEL_FIELD.search(raw)) is None:
        return None
    return found.group(1).decode()


def upstream_overflow(status: int, raw: bytes) -> UpstreamOverflow | None:
    """Recognise llama-server's overflow error: bare, or as Ollama passes it on, as the string in its
    native `error` or in its OpenAI envelope's `error.message`."""
    if status not in (400, 500):
        return None
    try:
        error = json.loads(raw).get("error")
        if isinstance(error, Mapping) and str(error.get("message", "")).startswith("{"):
            error = error["message"]
        if isinstance(error, str):
            error = json.loads(error).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, Mapping) or error.get("type") != "exceed_context_size_error":
        return None
    n_prompt, n_ctx = int_field(error, "n_prompt_tokens"), int_field(error, "n_ctx")
    if n_prompt is None or n_ctx is None:
        return None
    return UpstreamOverflow(n_prompt, n_ctx)


@dataclass(frozen=True, slots=True)
class Backend:
    """A configured backend: its kind and where it listens."""

    kind: Kind
    url: str
    host: str
    port: int

    @classmethod
    def parse(cls, kind: Kind, url: str) -> Backend:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{kind} backend {url!r} is not an http(s) URL")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return cls(kind, f"{parts.scheme}://{host}:{port}", parts.hostname, port)


def identify(root_text: str | None, props_status: int | None) -> Kind | None:
    """A backend's kind from its answers: Ollama says so on `GET /`, llama-server serves `/props`."""
    if root_text is not None and root_text.strip() == "Ollama is running":
        return Kind.OLLAMA
    if props_status == 200:
        return Kind.LLAMACPP
    return None
