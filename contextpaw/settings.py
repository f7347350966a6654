"""ContextPaw's options, read once per change into frozen settings, so hot paths read a plain field
and a bad value is refused when it is set, with the option's name, never halfway through a request.

No mitmproxy here: `FitSettings.parse` takes any object with the options as attributes (mitmproxy's
`ctx.options` in the addon, a namespace in tests) and raises `ValueError`; the addon turns that into
mitmproxy's `OptionsError`.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from contextpaw import wire

POLICIES = ("compact", "strict", "off")

MAX_BODY_MB = 32
"""Parsing JSON holds the interpreter's lock for the whole call, worker thread or not (about 20-65 ms
a megabyte): a 256 MB limit let one request stall every client for seconds. 32 MB is eight million
tokens of text, far beyond any local window, and leaves room for a session's images."""
RELAY_TIMEOUT_S = 540
"""The relay's default header and idle timeouts: under mitmproxy's default `tcp_timeout` (600 s),
which would otherwise close the client's connection first, without an answer."""

PREFIX = "contextpaw_"
"""An option is named this and the settings field it sets: `contextpaw_keep_recent` sets `keep_recent`."""


MAX_TTL_S = 10 * 365 * 86_400
"""The longest `contextpaw_evicted_ttl`: ten years. Redis refuses an expiry past what its clock can
add (a TTL of 10**30 was taken, and every write of the archive failed)."""


class Option(NamedTuple):
    """An option: what an addon's `load` declares (`declare`) and how its settings read it."""

    type: Any
    """What mitmproxy checks the value against (a type, or `Sequence[str]`)."""
    help: str
    least: int | None = None
    """The smallest value it takes (numbers only)."""
    choices: tuple[str, ...] | None = None
    read: Callable[[Any], Any] | None = None
    """The field's value from the option's, or a ValueError that says what is wrong with it."""
    default: Any = None
    """The option's default (in the table below, None is the field's)."""
    most: int | None = None
    """The largest value it takes (numbers only)."""

    def value(self, options: Any, name: str) -> Any:
        """The field's value from the option `name` of `options`, or a ValueError that names it."""
        value = getattr(options, name)
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{name} must be one of {', '.join(self.choices)}, not {value!r}")
        if self.least is not None and value < self.least:
            raise ValueError(f"{name} must be at least {self.least}, not {value}")
        if self.most is not None and value > self.most:
            raise ValueError(f"{name} must be at most {self.most}, not {value}")
        if self.read is None:
            return value
        try:
            return self.read(value)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


def declare(loader: Any, table: Mapping[str, Option]) -> None:
    """Declare a table's options on mitmproxy's loader (any object with its `add_option`)."""
    for name, option in table.items():
        loader.add_option(name, option.type, option.default, option.help, choices=option.choices)


def unknown_options(given: Iterable[str], known: Iterable[str]) -> str | None:
    """What to say about ContextPaw options that were set (`--set`, config.yaml) but that no addon
    declares, each with the nearest declared one; None when there are none. mitmproxy keeps an
    option it does not know aside, in case an addon declares it later, and never says so: a misspelt
    `contextpaw_polcy=strict` would run with the default policy."""
    unknown = sorted(name for name in given if name.lower().startswith(PREFIX[:-1]))
    if not unknown:
        return None
    ours = {name.removeprefix(PREFIX): name for name in known if name.startswith(PREFIX)}
    said = []
    for name in unknown:
        nearest = difflib.get_close_matches(name.lower()[len(PREFIX) :], list(ours), n=1, cutoff=0)
        said.append(f"{name} (did you mean {ours[nearest[0]]}?)" if nearest else name)
    plural = "s" if len(unknown) > 1 else ""
    return f"unknown option{plural} {', '.join(said)}; --options lists every option"


def read(options: Any, table: Mapping[str, Option]) -> dict[str, Any]:
    """A table's values from `options`, by field name; a ValueError names the first option that is wrong."""
    return {name.removeprefix(PREFIX): option.value(options, name) for name, option in table.items()}


@dataclass(frozen=True, slots=True)
class FitSettings:
    """What fitting a request into the window reads (`Compactor`'s options, `FIT_OPTIONS`); the
    defaults here are the options' defaults."""

    policy: str = "compact"
    keep_recent: int = 4
    headroom: float | None = None
    """The share of the budget a cut leaves free for the next turns (None: what one turn adds)."""
    default_ctx: int = 4096
    output_reserve: int = 1024
    margin: int = 64
    conversations: int = 1024
    evicted_items: int = 10_000
    evicted_mb: int = 256
    evicted_ttl: int = 86_400
    discover_window: bool = True
    tokenizer: str = ""
    """An expanded path, or "" for: ask the backend, else estimate."""
    forbid_truncation: bool = True
    summarize: bool = False
    summarizer_url: str = ""
    summarizer_model: str = ""
    summarizer_timeout: int = 30
    summary_tokens: int = 256
    calibrate: bool = True
    usage_whole: bool = False
    """After a cut, the answer's usage tells the whole history's size (`Compactor._usage_told`)."""
    ask_ollama: bool = True
    """Where the estimate cannot tell whether a request fits, Ollama's native chat is asked to count it."""
    state_dir: Path = Path("~/.mitmproxy")
    archive: str = "sqlite"
    """Where evicted content is kept: `sqlite` (under `state_dir`), `memory`, or `redis://host:port/db`."""
    ollama_context_length: int = 0
    """The Ollama server's OLLAMA_CONTEXT_LENGTH as the operator states it (0: learn it)."""

    @property
    def evicted_bytes(self) -> int:
        return self.evicted_mb << 20

    @staticmethod
    def options() -> dict[str, Option]:
        """The options these settings are parsed from, by name (for the addon, which declares them)."""
        return FIT_OPTIONS

    @classmethod
    def parse(cls, o: Any) -> FitSettings:
        # First: a window too small for the reserve is the mistake to name, even under its minimum.
        reserve, margin, window = o.contextpaw_output_reserve, o.contextpaw_margin, o.contextpaw_default_ctx
        if reserve + margin >= window:
            raise ValueError(
                f"contextpaw_output_reserve ({reserve}) + contextpaw_margin ({margin}) leave no room in contextpaw_default_ctx ({window})"
            )
        fields = read(o, FIT_OPTIONS)
        fields["state_dir"] = Path(fields["state_dir"] or o.confdir).expanduser()
        return cls(**fields)


def _archive(spec: str) -> str:
    if spec in ("sqlite", "memory") or spec.startswith(("redis://", "rediss://", "unix://")):
        return spec
    raise ValueError(f"must be sqlite, memory or redis://host:port/db, not {spec!r}")


def _tokenizer_file(path: str) -> str:
    expanded = os.path.expanduser(path) if path else ""
    if expanded and not os.path.isfile(expanded):
        raise ValueError(f"no such file {path!r}")
    return expanded


def _headroom(value: str) -> float | None:
    """`auto`, or a percentage of the budget from 0 to 50."""
    if value == "auto":
        return None
    try:
        percent = float(value)
    except ValueError:
        raise ValueError(f"must be auto or a percentage of the budget, not {value!r}") from None
    if not 0 <= percent <= 50:
        raise ValueError(f"must be between 0 and 50 (percent of the budget), not {value!r}")
    return percent / 100


def _summarizer_url(url: str) -> str:
    if url:
        wire.Backend.parse(wire.Kind.OLLAMA, url)
    return url


def _with_field_defaults(**options: Option) -> dict[str, Option]:
    """The options by name, each defaulting to its field's default unless it says otherwise."""
    defaults = FitSettings()
    return {
        PREFIX + field: option if option.default is not None else option._replace(default=getattr(defaults, field))
        for field, option in options.items()
    }


FIT_OPTIONS = _with_field_defaults(
    policy=Option(
        str,
        "compact: fit overflowing requests and report it; strict: refuse them in the API's own overflow error; off: pass through.",
        choices=POLICIES,
    ),
    keep_recent=Option(int, "Most recent messages that are never evicted.", least=0),
    headroom=Option(
        str,
        "Room a cut leaves below the budget so the next turns append to the cached prompt: auto (what one of "
        "the latest turns adds, up to 20% of the budget; 10% for bigger turns, which cut every turn anyway) or a "
        "percentage of the budget (0-50).",
        read=_headroom,
        default="auto",
    ),
    default_ctx=Option(int, "Context window when neither the request nor the backend says.", least=1),
    output_reserve=Option(
        int,
        "Tokens left for the answer when a request must be cut anyway (the smaller of this and the request's own "
        "cap, at most half the window); a request the backend would serve whole is never cut to make this room.",
        least=0,
    ),
    margin=Option(int, "Tokens kept for the chat template and counting error.", least=0),
    conversations=Option(int, "Conversations whose eviction plan is remembered (LRU).", least=1),
    evicted_items=Option(int, "Evicted contents kept for /contextpaw/evicted/<id>.", least=1),
    evicted_mb=Option(int, "Megabytes of evicted content kept.", least=1),
    evicted_ttl=Option(int, "Seconds evicted content is kept (at most ten years).", least=1, most=MAX_TTL_S),
    discover_window=Option(bool, "Ask the backend for the model's real window (llama-server /props; Ollama /api/ps, /api/show)."),
    tokenizer=Option(
        str,
        "A tokenizer.json or GGUF file to count with, for every model (default: ask llama-server, "
        "or the GGUF Ollama names, else a calibrated estimate).",
        read=_tokenizer_file,
    ),
    forbid_truncation=Option(
        bool,
        "Send truncate:false on Ollama's native routes when a request could exceed the window given the "
        "error bounds of its count, so a residual overflow comes back as a 400 that ContextPaw rescues "
        "instead of a silent cut.",
    ),
    summarize=Option(bool, "Put a digest of what was evicted where its marker goes (map-reduce over the whole span)."),
    summarizer_url=Option(str, "The server that writes digests (default: the request's).", read=_summarizer_url),
    summarizer_model=Option(str, "The model that writes digests (default: the request's)."),
    summarizer_timeout=Option(int, "Seconds one summarizer call may take.", least=1),
    summary_tokens=Option(int, "The most tokens all digests of one request may take.", least=32),
    calibrate=Option(bool, "Learn from the prompt counts servers report how the estimate must be scaled, per backend and model."),
    usage_whole=Option(
        bool,
        "After a cut, tell the client the prompt size of its whole history in the answer's usage (the server's "
        "count plus what ContextPaw removed; the report's usage_told names both), so that an agent that compacts "
        "from usage, such as opencode, learns its history overflowed. Off: usage is the server's count.",
    ),
    ask_ollama=Option(
        bool,
        "On Ollama's /v1 and Anthropic routes, which cannot ask it to refuse instead of cutting, and without a "
        "tokenizer for the model: where the estimate cannot tell whether a request fits, ask Ollama's native "
        "/api/chat to count it (truncate:false, one token) before cutting. What fits goes out unchanged; the "
        "prompt's prefix is then in the server's cache for the request itself. Never under policy off.",
    ),
    state_dir=Option(str, "Where the calibration and the archive are kept across restarts (default: confdir).", default=""),
    archive=Option(
        str, "Where evicted content is kept: sqlite (in the state dir), memory, or redis://host:port/db (shared).", read=_archive
    ),
    ollama_context_length=Option(
        int,
        "The Ollama server's OLLAMA_CONTEXT_LENGTH, the window of requests without num_ctx (all of /v1); "
        "0: learn it from the server (by loading the model as such a request would).",
        least=0,
    ),
)
"""ContextPaw's fit options: each option's name, type, help, least value or choices, and how its
value is read, in one place; its default is its `FitSettings` field's."""


BACKEND_OPTIONS = {
    "contextpaw_ollama": Option(Sequence[str], "Ollama backend URL (repeatable).", default=[]),
    "contextpaw_llamacpp": Option(Sequence[str], "llama-server backend URL (repeatable).", default=[]),
    "contextpaw_max_body_mb": Option(
        int,
        "Model requests (chat, generate, completions) above this many megabytes are refused with a 413, "
        "and answers above it are passed on unread.",
        least=1,
        default=MAX_BODY_MB,
    ),
    "contextpaw_relay": Option(
        bool,
        "Send handled requests through ContextPaw's own exchange (from the request hook for a buffered "
        "answer, through its loopback relay for a stream), which answers a failing backend "
        "in the caller's API (JSON 502/504, or an error record in a stream).",
        default=True,
    ),
}
"""`Backends`' options."""


@dataclass(frozen=True, slots=True)
class BackendSettings:
    """Which servers are backends, how big a model request may be, and whether the relay carries
    model requests (`BACKEND_OPTIONS`)."""

    configured: tuple[wire.Backend, ...]
    max_body_bytes: int
    relay: bool

    @classmethod
    def parse(cls, o: Any) -> BackendSettings:
        values = read(o, BACKEND_OPTIONS)
        configured = []
        for kind in wire.Kind:
            for url in values[kind.value]:
                try:
                    configured.append(wire.Backend.parse(kind, url))
                except ValueError as e:
                    raise ValueError(f"{PREFIX}{kind}: {e}") from None
        return cls(tuple(configured), values["max_body_mb"] << 20, values["relay"])


RELAY_OPTIONS = {
    "contextpaw_header_timeout": Option(
        int,
        "Seconds a backend may take to start its answer (a long prompt or a long buffered "
        "answer needs this long on a slow machine); then the client gets a 504.",
        least=1,
        default=RELAY_TIMEOUT_S,
    ),
    "contextpaw_idle_timeout": Option(
        int, "Seconds a backend may fall silent in the middle of its answer.", least=1, default=RELAY_TIMEOUT_S
    ),
}
"""`Upstream`'s options: the relay's timeouts."""


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """The relay's header and idle timeouts, in seconds (`RELAY_OPTIONS`)."""

    header_timeout: int = RELAY_TIMEOUT_S
    idle_timeout: int = RELAY_TIMEOUT_S

    @classmethod
    def parse(cls, o: Any) -> RelaySettings:
        return cls(**read(o, RELAY_OPTIONS))
