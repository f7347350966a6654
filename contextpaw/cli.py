"""`contextpaw`: mitmdump (or mitmweb with `--web`) with ContextPaw, its reverse modes and safe options.

    contextpaw --ollama http://127.0.0.1:11435 --port 11434 \\
               --llamacpp http://127.0.0.1:8091 --llamacpp-port 8092 [--policy strict] [--web]

Arguments it does not know go to mitmproxy as they are (`--set contextpaw_keep_recent=8`, `-w flows`).
The safe options: listen on loopback only, connect upstream only when a request needs it (so the
proxy's own endpoints work while a backend is down), wait an hour for a slow prompt instead of nine
minutes (the relay's timeouts, under mitmproxy's idle timeout so the client gets the 504), no
onboarding app (it would serve mitmproxy's CA), and a config dir of its own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

SAFE_OPTIONS = (
    "connection_strategy=lazy",
    "contextpaw_header_timeout=3600",
    "contextpaw_idle_timeout=3600",
    "tcp_timeout=7200",
    "onboarding=false",
)
WEB_COLUMNS = ("icon", "path", "method", "status", "size", "time", "comment")
"""mitmweb's flow list with the comment column, where compacted flows say what they lost."""


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
    return p


def mitmproxy_args(ns: argparse.Namespace, passthrough: Sequence[str]) -> list[str]:
    """The mitmproxy command line for the parsed `contextpaw` arguments."""
    args: list[str] = []
    fronted = (("ollama", ns.ollama, ns.port), ("llamacpp", ns.llamacpp, ns.llamacpp_port))
    for kind, url, port in fronted:
        if url:
            args += ["--mode", f"reverse:{url}@{ns.host}:{port}", "--set", f"contextpaw_{kind}={url}"]
    for option in (*SAFE_OPTIONS, f"confdir={ns.confdir}", f"contextpaw_policy={ns.policy}"):
        args += ["--set", option]
    if ns.web:
        args += [a for column in WEB_COLUMNS for a in ("--set", f"web_columns={column}")]
    return args + list(passthrough)


def main(argv: Sequence[str] | None = None) -> None:
    ns, passthrough = parser().parse_known_args(argv)
    if not ns.ollama and not ns.llamacpp:
        parser().error("give --ollama URL, --llamacpp URL, or both")
    from mitmproxy.tools import cmdline
    from mitmproxy.tools.main import run

    from contextpaw.addon import make_addons

    if ns.web:
        from mitmproxy.tools.web.master import WebMaster as Base

        make_parser = cmdline.mitmweb
    else:
        from mitmproxy.tools.dump import DumpMaster as Base

        make_parser = cmdline.mitmdump

    class WithContextPaw(Base):  # type: ignore[valid-type,misc]
        """The mitmproxy master with ContextPaw's addons, so `--set contextpaw_*` parses."""

        def __init__(self, opts, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(opts, **kwargs)
            self.addons.add(*make_addons())

    run(WithContextPaw, make_parser, mitmproxy_args(ns, passthrough))


if __name__ == "__main__":
    sys.exit(main())
