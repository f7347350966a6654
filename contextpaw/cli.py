"""`contextpaw`: mitmdump (or mitmweb with `--web`) with ContextPaw, its reverse modes and safe options.

    contextpaw --ollama http://127.0.0.1:11435 --port 11434 \\
               --llamacpp http://127.0.0.1:8091 --llamacpp-port 8092 [--policy strict] [--web]

The earlier proxy's flags (`--keep-recent 8`, `--summarize`, ...) are options of their own, each
setting its `contextpaw_*` option. mitmproxy's own arguments pass through as they are
(`--set contextpaw_output_reserve=512`, `-w flows`); anything neither knows is a usage error.
The safe options: listen on loopback only, connect upstream only when a request needs it (so the
proxy's own endpoints work while a backend is down), wait an hour for a slow prompt instead of nine
minutes (the relay's timeouts, under mitmproxy's idle timeout so the client gets the 504), no
onboarding app (it would serve mitmproxy's CA), and a config dir of its own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SAFE_OPTIONS = (
    "connection_strategy=lazy",
    "contextpaw_header_timeout=3600",
    "contextpaw_idle_timeout=3600",
    "tcp_timeout=7200",
    "onboarding=false",
)
WEB_COLUMNS = ("icon", "path", "method", "status", "size", "time", "comment")
"""mitmweb's flow list with the comment column, where compacted flows say what they lost."""


OLD_FLAGS: dict[str, tuple[str, type | None, str]] = {
    "--keep-recent": ("contextpaw_keep_recent", int, "most recent messages that are never evicted"),
    "--default-ctx": ("contextpaw_default_ctx", int, "window when neither the request nor the backend says"),
    "--margin": ("contextpaw_margin", int, "tokens kept for the chat template and counting error"),
    "--tokenizer": ("contextpaw_tokenizer", str, "a tokenizer.json or GGUF file to count with"),
    "--summarize": ("contextpaw_summarize", None, "put a digest of what was evicted where its marker goes"),
    "--summarizer-model": ("contextpaw_summarizer_model", str, "the model that writes digests"),
    "--summarizer-url": ("contextpaw_summarizer_url", str, "the server that writes digests"),
    "--arbitrate": ("contextpaw_arbitrate", None, "give the GPU to one runtime at a time"),
    "--llamacpp-cmd": ("contextpaw_llamacpp_cmd", str, "command that starts llama-server (for --arbitrate)"),
    "--min-hold": ("contextpaw_min_hold", int, "seconds a runtime keeps the GPU once it has won it (for --arbitrate)"),
}
"""The earlier proxy's flags: flag -> (the option it sets, its value's type or None for a switch, help)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="contextpaw", description=__doc__.split("\n\n")[0])
    p.add_argument("--ollama", metavar="URL", help="the Ollama server to front, e.g. http://127.0.0.1:11435")
    p.add_argument("--port", type=int, default=11434, help="where clients reach Ollama (default 11434)")
    p.add_argument("--llamacpp", metavar="URL", help="the llama-server to front, e.g. http://127.0.0.1:8091")
    p.add_argument("--llamacpp-port", type=int, default=8092, help="where clients reach llama-server (default 8092)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1: loopback only)")
    p.add_argument("--policy", choices=("compact", "strict", "off"), default="compact")
    p.add_argument("--confdir", type=Path, default=Path.home() / ".contextpaw", help="mitmproxy state (its CA)")
    p.add_argument("--web", action="store_true", help="run mitmweb to inspect flows, instead of mitmdump")
    old = p.add_argument_group("the earlier proxy's flags", "each sets the contextpaw_* option it names")
    for flag, (option, kind, text) in OLD_FLAGS.items():
        if kind is None:
            old.add_argument(flag, dest=option, action="store_true", default=None, help=f"{text} ({option})")
        else:
            old.add_argument(flag, dest=option, type=kind, metavar=flag.strip("-").split("-")[-1].upper(),
                             help=f"{text} ({option})")  # fmt: skip
    return p


def mitmproxy_args(ns: argparse.Namespace, passthrough: Sequence[str]) -> list[str]:
    """The mitmproxy command line for the parsed `contextpaw` arguments."""
    args: list[str] = []
    fronted = (("ollama", ns.ollama, ns.port), ("llamacpp", ns.llamacpp, ns.llamacpp_port))
    for kind, url, port in fronted:
        if url:
            args += ["--mode", f"reverse:{url}@{ns.host}:{port}", "--set", f"contextpaw_{kind}={url}"]
    chosen = [f"{option}={_value(getattr(ns, option))}" for option, _, _ in OLD_FLAGS.values()
              if getattr(ns, option) is not None]  # fmt: skip
    for option in (*SAFE_OPTIONS, f"confdir={ns.confdir}", f"contextpaw_policy={ns.policy}", *chosen):
        args += ["--set", option]
    if ns.web:
        args += [a for column in WEB_COLUMNS for a in ("--set", f"web_columns={column}")]
    return args + list(passthrough)


def _value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _unknown_to_mitmproxy(make_parser: Callable[[Any], argparse.ArgumentParser], args: Sequence[str]) -> list[str]:
    """The arguments mitmproxy's own parser does not know either."""
    from mitmproxy import options

    return make_parser(options.Options()).parse_known_args(args)[1]


def main(argv: Sequence[str] | None = None) -> None:
    ns, passthrough = parser().parse_known_args(argv)
    if not ns.ollama and not ns.llamacpp:
        parser().error("give --ollama URL, --llamacpp URL, or both")
    from mitmproxy.tools import cmdline
    from mitmproxy.tools.main import run

    from contextpaw.compose import make_addons

    if ns.web:
        from mitmproxy.tools.web.master import WebMaster as Base

        make_parser = cmdline.mitmweb
    else:
        from mitmproxy.tools.dump import DumpMaster as Base

        make_parser = cmdline.mitmdump
    if unknown := _unknown_to_mitmproxy(make_parser, passthrough):
        parser().error(f"unrecognized arguments: {' '.join(unknown)}")

    class WithContextPaw(Base):  # type: ignore[valid-type,misc]
        """The mitmproxy master with ContextPaw's addons, so `--set contextpaw_*` parses."""

        def __init__(self, opts, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(opts, **kwargs)
            self.addons.add(*make_addons())

    run(WithContextPaw, make_parser, mitmproxy_args(ns, passthrough))


if __name__ == "__main__":
    sys.exit(main())
