"""ContextPaw's options, read once per change into frozen settings, so hot paths read a plain field
and a bad value is refused when it is set, with the option's name, never halfway through a request.

No mitmproxy here: `FitSettings.parse` takes any object with the options as attributes (mitmproxy's
`ctx.options` in the addon, a namespace in tests) and raises `ValueError`; the addon turns that into
mitmproxy's `OptionsError`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contextpaw import wire

POLICIES = ("compact", "strict", "off")

MINIMUMS = {
    "contextpaw_default_ctx": 1,
    "contextpaw_conversations": 1,
    "contextpaw_evicted_items": 1,
    "contextpaw_evicted_mb": 1,
    "contextpaw_evicted_ttl": 1,
    "contextpaw_keep_recent": 0,
    "contextpaw_output_reserve": 0,
    "contextpaw_margin": 0,
    "contextpaw_summarizer_timeout": 1,
    "contextpaw_summary_tokens": 32,
    "contextpaw_header_timeout": 1,
    "contextpaw_idle_timeout": 1,
    "contextpaw_max_body_mb": 1,
    "contextpaw_ollama_context_length": 0,
}


def at_least(options: Any, name: str) -> int:
    """The option's value, or a ValueError that names it when it is under its minimum."""
    value = getattr(options, name)
    if value < MINIMUMS[name]:
        raise ValueError(f"{name} must be at least {MINIMUMS[name]}, not {value}")
    return value


@dataclass(frozen=True, slots=True)
class FitSettings:
    """What fitting a request into the window reads (`Compactor`'s options); the defaults here are
    the options' defaults."""

    policy: str = "compact"
    keep_recent: int = 4
    default_ctx: int = 4096
    output_reserve: int = 1024
    margin: int = 64
    conversations: int = 1024
    evicted_items: int = 10_000
    evicted_bytes: int = 256 << 20
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
    state_dir: Path = Path("~/.mitmproxy")
    ollama_context_length: int = 0
    """The Ollama server's OLLAMA_CONTEXT_LENGTH as the operator states it (0: learn it)."""

    @classmethod
    def parse(cls, o: Any) -> FitSettings:
        if o.contextpaw_policy not in POLICIES:
            raise ValueError(f"contextpaw_policy must be one of {', '.join(POLICIES)}, not {o.contextpaw_policy!r}")
        if o.contextpaw_output_reserve + o.contextpaw_margin >= o.contextpaw_default_ctx:
            raise ValueError(
                f"contextpaw_output_reserve ({o.contextpaw_output_reserve}) + contextpaw_margin "
                f"({o.contextpaw_margin}) leave no room in contextpaw_default_ctx ({o.contextpaw_default_ctx})"
            )
        tokenizer = os.path.expanduser(o.contextpaw_tokenizer) if o.contextpaw_tokenizer else ""
        if tokenizer and not os.path.isfile(tokenizer):
            raise ValueError(f"contextpaw_tokenizer: no such file {o.contextpaw_tokenizer!r}")
        if o.contextpaw_summarizer_url:
            try:
                wire.Backend.parse(wire.Kind.OLLAMA, o.contextpaw_summarizer_url)
            except ValueError as e:
                raise ValueError(f"contextpaw_summarizer_url: {e}") from None
        return cls(
            policy=o.contextpaw_policy,
            keep_recent=at_least(o, "contextpaw_keep_recent"),
            default_ctx=at_least(o, "contextpaw_default_ctx"),
            output_reserve=at_least(o, "contextpaw_output_reserve"),
            margin=at_least(o, "contextpaw_margin"),
            conversations=at_least(o, "contextpaw_conversations"),
            evicted_items=at_least(o, "contextpaw_evicted_items"),
            evicted_bytes=at_least(o, "contextpaw_evicted_mb") << 20,
            evicted_ttl=at_least(o, "contextpaw_evicted_ttl"),
            discover_window=o.contextpaw_discover_window,
            tokenizer=tokenizer,
            forbid_truncation=o.contextpaw_forbid_truncation,
            summarize=o.contextpaw_summarize,
            summarizer_url=o.contextpaw_summarizer_url,
            summarizer_model=o.contextpaw_summarizer_model,
            summarizer_timeout=at_least(o, "contextpaw_summarizer_timeout"),
            summary_tokens=at_least(o, "contextpaw_summary_tokens"),
            calibrate=o.contextpaw_calibrate,
            state_dir=Path(o.contextpaw_state_dir or o.confdir).expanduser(),
            ollama_context_length=at_least(o, "contextpaw_ollama_context_length"),
        )


@dataclass(frozen=True, slots=True)
class BackendSettings:
    """Which servers are backends, how big a model request may be, and whether the relay carries
    model requests (`Backends`' options)."""

    configured: tuple[wire.Backend, ...]
    max_body_bytes: int
    relay: bool

    @classmethod
    def parse(cls, o: Any) -> BackendSettings:
        configured = []
        for kind in wire.Kind:
            for url in getattr(o, f"contextpaw_{kind}"):
                try:
                    configured.append(wire.Backend.parse(kind, url))
                except ValueError as e:
                    raise ValueError(f"contextpaw_{kind}: {e}") from None
        return cls(tuple(configured), at_least(o, "contextpaw_max_body_mb") << 20, o.contextpaw_relay)
