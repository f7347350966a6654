"""`contextpaw`: mitmdump (or mitmweb with `--web`) with ContextPaw loaded, a reverse mode per
backend and safe presets; `contextpaw doctor` checks such a set-up and says how to fix it.

    contextpaw --ollama http://127.0.0.1:11435 --port 11434 \\
               --llamacpp http://127.0.0.1:8091 --llamacpp-port 8092 [--policy strict] [--web]

Every argument mitmdump (or mitmweb) takes works the same here (`-w flows`, `-r flows`, `-s script`,
a filter expression, `--set name=value`), since the command line is parsed by mitmproxy's own parser
with ContextPaw's arguments added to it. ContextPaw's presets are applied before `--set`, so the
command line always wins over them. Each of ContextPaw's flags can also come from the environment
(`CONTEXTPAW_OLLAMA`, `CONTEXTPAW_LLAMACPP_PORT`: the flag's name), and any option from mitmproxy's
`config.yaml` in the confdir; the command line wins over the environment, which wins over the file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import re
import sys
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

from contextpaw import wire
from contextpaw.command import doctor
from contextpaw.core import logs
from contextpaw.settings import POLICIES, unknown_options

logger = logs.get(__name__)

CONFDIR = "~/.contextpaw"
PRESETS: dict[str, Any] = {
    "connection_strategy": "lazy",
    "contextpaw_header_timeout": 3600,
    "contextpaw_idle_timeout": 3600,
    "tcp_timeout": 7200,
    "onboarding": False,
    "flow_detail": 0,
}
"""What `contextpaw` sets before mitmproxy reads `--set` and config.yaml (either overrides it): listen
only where clients need it, connect upstream only when a request needs it (so the proxy's own
endpoints work while a backend is down), no flow lines of mitmdump's (ContextPaw logs one line per
request that says what it did; `--flow-detail 1` or `-v` brings them back), wait an hour for a slow prompt instead of nine minutes (the
relay's timeouts, under mitmproxy's idle timeout so the client gets the 504), and no onboarding app
(it would serve mitmproxy's CA)."""
WEB_COLUMNS = ["icon", "path", "method", "status", "size", "time", "comment"]
"""mitmweb's flow list with the comment column, where compacted flows say what they lost."""

OLD_FLAGS: dict[str, tuple[str, type | None, str]] = {
    "--keep-recent": ("contextpaw_keep_recent", int, "most recent messages that are never evicted"),
    "--headroom": ("contextpaw_headroom", str, "room a cut leaves for the next turns: auto, or a percentage of the budget"),
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

EPILOG = """\
Everything else is mitmdump's (with --web, mitmweb's), spelled as there: -w FILE, -r FILE,
-s SCRIPT, a filter expression, --flow-detail, --anticache, --set NAME=VALUE. --set sets any
mitmproxy or contextpaw_* option and wins over what contextpaw presets (connection_strategy=lazy,
tcp_timeout=7200, flow_detail=0, contextpaw_header_timeout=3600, contextpaw_idle_timeout=3600, onboarding=false,
confdir=~/.contextpaw). --options lists every option.

Each flag of ContextPaw's above can be given in the environment instead, as CONTEXTPAW_ and its name
(--llamacpp-port 8092: CONTEXTPAW_LLAMACPP_PORT=8092; a switch: 1 or 0), and any option in
config.yaml in the confdir (contextpaw_llamacpp: [URL] fronts that server as --llamacpp does). The
command line (flags and --set) wins over the environment, which wins over config.yaml.

Check a running set-up at http://127.0.0.1:PORT/contextpaw/health (backends, whether they answer,
the counters). With --web, mitmweb listens on http://127.0.0.1:8081 (--web-host, --web-port); open
the address with ?token=... that it prints at start, it refuses requests without the token.

`contextpaw doctor [the same arguments]` checks the backends and the set-up and says how to fix
what is wrong (windows smaller than the model's, unreachable backends, a tokenizer of another model,
listeners beyond the loopback).

`contextpaw launch AGENT [--print] [-- AGENT ARGS]` starts claude, codex, opencode, aider or qwen
pointed at a running ContextPaw, told the window it serves (`contextpaw launch --help`).

`contextpaw mcp` is an MCP server (stdio) whose contextpaw_retrieve and contextpaw_search tools read
back what ContextPaw evicted; launch registers it with each agent (`contextpaw mcp --help`)."""


OWN_GROUPS = ("contextpaw", "the earlier proxy's flags")
"""The titles of ContextPaw's groups of arguments, which `--help` shows before mitmproxy's."""


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """ContextPaw's own arguments. Those that set an option keep its name as their `dest`, so
    mitmproxy applies them as it applies its own flags (after `--set`, as mitmdump does). Each one's
    default comes from its variable in ``environ`` (default: this process's) where that is set; a
    value that the flag would refuse stops the parser with the variable's name."""
    own = p.add_argument_group(OWN_GROUPS[0])
    own.add_argument("--ollama", metavar="URL", help="the Ollama server to front, e.g. http://127.0.0.1:11435")
    own.add_argument("--port", type=int, default=11434, help="where clients reach Ollama (default 11434)")
    own.add_argument("--llamacpp", metavar="URL", help="the llama-server to front, e.g. http://127.0.0.1:8091")
    own.add_argument("--llamacpp-port", type=int, default=8092, help="where clients reach llama-server (default 8092)")
    own.add_argument("--host", default="127.0.0.1", help="where both listen (default 127.0.0.1: loopback only)")
    own.add_argument(
        "--policy",
        dest="contextpaw_policy",
        choices=POLICIES,
        help="compact (default): cut an overflowing request to fit and report what went; strict: "
        "refuse it in the API's own overflow error; off: pass everything through (contextpaw_policy)",
    )
    own.add_argument("--confdir", metavar="DIR", help=f"mitmproxy's state, its CA and config.yaml (default {CONFDIR})")
    own.add_argument("--web", action="store_true", help="run mitmweb, to inspect flows in a browser, instead of mitmdump")
    old = p.add_argument_group(OWN_GROUPS[1], "each sets the contextpaw_* option it names")
    for flag, (option, kind, text) in OLD_FLAGS.items():
        if kind is None:
            old.add_argument(flag, dest=option, action="store_true", default=None, help=f"{text} ({option})")
        else:
            old.add_argument(flag, dest=option, type=kind, metavar=flag.strip("-").split("-")[-1].upper(), help=f"{text} ({option})")
    environ = os.environ if environ is None else environ
    for action in own_actions(p):
        variable = env_name(action)
        action.help = f"{action.help} [env {variable}]"
        if variable in environ:
            try:
                action.default = env_value(action, variable, environ[variable])
            except ValueError as e:
                p.error(str(e))


def own_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """ContextPaw's arguments alone, to read them before mitmproxy starts (its parser needs a master)."""
    p = argparse.ArgumentParser(prog="contextpaw", add_help=False)
    add_arguments(p, environ)
    p.add_argument("--version", action="store_true")
    return p


ENV_PREFIX = "CONTEXTPAW_"
SWITCH_VALUES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def own_actions(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """ContextPaw's own arguments in a parser (those `add_arguments` added)."""
    return [a for g in p._action_groups if g.title in OWN_GROUPS for a in g._group_actions]


def env_name(action: argparse.Action) -> str:
    """The environment variable of one of ContextPaw's flags: CONTEXTPAW_ and the flag's long name
    (`--llamacpp-port`: `CONTEXTPAW_LLAMACPP_PORT`)."""
    flag = max(action.option_strings, key=len)
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def env_value(action: argparse.Action, variable: str, text: str) -> Any:
    """The value `text`, from the environment variable `variable`, means for `action`, checked as the
    flag's own value would be; a ValueError names the variable and says what is wrong."""
    if action.nargs == 0:  # a switch
        if text.strip().lower() not in SWITCH_VALUES:
            raise ValueError(f"environment variable {variable}: {text!r} is not a switch; write 1 or 0")
        return SWITCH_VALUES[text.strip().lower()]
    try:
        value = action.type(text) if callable(action.type) else text
    except (TypeError, ValueError):
        kind = getattr(action.type, "__name__", "")
        raise ValueError(f"environment variable {variable}: invalid {kind} value: {text!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"environment variable {variable}: invalid choice: {text!r} (choose from {choices})")
    return value


UNSET = object()


def from_environment(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Which of ContextPaw's arguments in `argv` take their value from the environment: dest ->
    variable, for each variable that is set and whose flag `argv` does not give."""
    environ = os.environ if environ is None else environ
    p = own_parser({})
    named = {a.dest: env_name(a) for a in own_actions(p) if env_name(a) in environ}
    p.set_defaults(**dict.fromkeys(named, UNSET))
    given, _ = p.parse_known_args(argv)
    return {dest: variable for dest, variable in named.items() if getattr(given, dest) is UNSET}


@dataclass(frozen=True, slots=True)
class Fronted:
    """A backend named on the command line: its kind, its URL, where clients reach it."""

    kind: wire.Kind
    url: str
    listen: tuple[str, int]


def backend_url(flag: str, text: str) -> tuple[str, str | None]:
    """The URL for a backend given as `text`, and what to say at start about it; a ValueError says
    what to write instead. A URL without a scheme means plain HTTP, as `OLLAMA_HOST` does (mitmproxy's
    reverse mode would have taken it for TLS)."""
    note = None
    if "://" not in text:
        note = f"{flag} {text} has no scheme: using http://{text} (write https:// for a backend that speaks TLS)"
        text = f"http://{text}"
    parts = urlsplit(text)
    try:
        _ = parts.port  # read for its error: a port that is not a number
    except ValueError:
        raise ValueError(f"{flag} {text!r}: the port is not a number; write http://HOST:PORT") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} {text!r} is not a backend URL; write http://HOST:PORT (https:// for TLS)")
    if parts.path.strip("/") or parts.query:
        raise ValueError(f"{flag} {text!r}: a backend is a server, not a path; write {parts.scheme}://{parts.netloc}")
    return wire.Backend.parse(wire.Kind.OLLAMA, text).url, note


def fronted(ns: argparse.Namespace, sources: Mapping[str, str] | None = None) -> tuple[list[Fronted], list[str]]:
    """The backends on the command line (or in the environment: `sources` maps a dest to the
    variable it came from), and the notes to print at start (ValueError: a bad URL, named by the
    flag or the variable that gave it)."""
    backends, notes = [], []
    for kind, flag, text, port in (
        (wire.Kind.OLLAMA, "--ollama", ns.ollama, ns.port),
        (wire.Kind.LLAMACPP, "--llamacpp", ns.llamacpp, ns.llamacpp_port),
    ):
        if text:
            url, note = backend_url((sources or {}).get(flag.lstrip("-"), flag), text)
            backends.append(Fronted(kind, url, (ns.host, port)))
            notes += [note] if note else []
    return backends, notes


class ParserDone(Exception):
    """The parser has said all there is to say (`--help`, or a usage error and its status): mitmproxy
    turns a SystemExit from its parser into exit 1, after its own advice about flags it renamed
    ("--port is deprecated", which is ContextPaw's own flag)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _parser_done(p: argparse.ArgumentParser, status: int = 0, message: str | None = None) -> NoReturn:
    if message:
        p._print_message(message, sys.stderr)
    raise ParserDone(status)


def command_parser(mitmproxy_parser: Callable[[Any], argparse.ArgumentParser], opts: Any) -> argparse.ArgumentParser:
    """mitmdump's (or mitmweb's) own parser, with ContextPaw's arguments and help added; `--help`
    exits 0 and a usage error 2, each in ContextPaw's words (`ParserDone`)."""
    p = mitmproxy_parser(opts)
    p.exit = functools.partial(_parser_done, p)  # type: ignore[method-assign]
    p.prog, p.epilog, p.formatter_class = "contextpaw", EPILOG, argparse.RawDescriptionHelpFormatter
    p.description = __doc__.split("\n\n")[0]
    p.set_defaults(filter_args=None)  # mitmweb has none; run() asks
    add_arguments(p)
    ours = [g for g in p._action_groups if g.title in OWN_GROUPS]
    p._action_groups = [*ours, *(g for g in p._action_groups if g not in ours)]  # --help shows them first
    return p


WRONG_TYPE = re.compile(r"Expected (?P<expected>.+) for (?P<option>\w+), but got <class '(?P<got>\w+)'>\.?")
TYPE_WORDS = {
    "<class 'int'>": "a whole number",
    "<class 'bool'>": "true or false",
    "<class 'str'>": "a text",
    "collections.abc.Sequence[str]": "a list ([a, b], or one '- a' a line)",
}


def wrong_type(error: str) -> str | None:
    """mitmproxy's TypeError for an option's value read from config.yaml, in a person's words
    (None: some other TypeError, which is a bug to show whole)."""
    found = WRONG_TYPE.fullmatch(error.strip())
    if found is None:
        return None
    expected = TYPE_WORDS.get(found["expected"], found["expected"])
    return f"{found['option']} must be {expected}, not a {found['got']}"


def version_text() -> str:
    """What `contextpaw --version` prints: ContextPaw's version, then mitmproxy's (and Python's,
    OpenSSL's and the platform's, as `mitmdump --version` prints them)."""
    from mitmproxy.utils import debug

    from contextpaw.ops.admin import package_version

    return f"ContextPaw: {package_version()}\n{debug.dump_system_info()}"


def mitmproxy_args(backends: Sequence[Fronted]) -> list[str]:
    """What the backends add to mitmproxy's command line: a reverse mode each, and the option that
    names its kind (both lists, so a `--mode` or `--set contextpaw_ollama=` of the user's adds to them)."""
    args: list[str] = []
    for b in backends:
        args += ["--mode", reverse_spec(b.url, *b.listen), "--set", f"contextpaw_{b.kind}={b.url}"]
    return args


def reverse_spec(url: str, host: str, port: int) -> str:
    """The reverse mode that fronts `url` on `host:port`."""
    return f"reverse:{url}@{host}:{port}"


def file_options(confdir: str) -> set[str]:
    """The options that `config.yaml` (or `config.yml`) in `confdir` sets."""
    from mitmproxy import optmanager

    names: set[str] = set()
    for name in ("config.yaml", "config.yml"):
        path = Path(confdir, name).expanduser()
        if path.is_file():
            names |= set(optmanager.parse(path.read_text(encoding="utf8")))
    return names


def command_line_wins(opts: Any, args: argparse.Namespace, touched: Collection[str], from_env: Collection[str]) -> None:
    """Put the command line back over config.yaml and the environment for the options in `touched`
    (those the file sets, and those whose flag took its value from the environment, `from_env`).
    mitmproxy reads config.yaml after `--set`, so the file won over it; and a value from the
    environment comes in as its flag's default, so it won over `--set`. `--set` is applied again for
    those options, then the flags given on the command line, as mitmproxy applied them."""
    said = [s for s in args.setoptions or [] if s.partition("=")[0] in touched]
    opts.set(*said, defer=True)
    flags = {k: v for k, v in vars(args).items() if k in touched and k not in from_env and k in opts and v is not None}
    opts.update(**flags)


def fronted_from_options(opts: Any, ns: argparse.Namespace, backends: Sequence[Fronted]) -> dict[str, Any]:
    """The options that front a backend named only by the options (config.yaml, `--set`) as
    `--ollama`/`--llamacpp` would: a reverse mode at `--host` and the kind's port, for a kind that
    neither the command line nor the environment gives a backend of, when no `--mode` (or `mode` in
    config.yaml) chooses the listeners. OptionsError: more than one such backend of a kind, or a bad URL."""
    from mitmproxy import exceptions

    flag_modes = [reverse_spec(b.url, *b.listen) for b in backends]
    if not opts.server or (opts.has_changed("mode") and opts.mode != flag_modes):
        return {}
    modes, chosen = list(flag_modes), {}
    for kind, port in ((wire.Kind.OLLAMA, ns.port), (wire.Kind.LLAMACPP, ns.llamacpp_port)):
        option, urls = f"contextpaw_{kind}", getattr(opts, f"contextpaw_{kind}")
        if not urls or any(b.kind == kind for b in backends):
            continue
        if len(urls) > 1:
            raise exceptions.OptionsError(
                f"{option} names {len(urls)} backends and contextpaw fronts one of each kind: name one, "
                f"or give each a --mode reverse:URL@PORT of its own"
            )
        try:
            url, note = backend_url(option, urls[0])
        except ValueError as e:
            raise exceptions.OptionsError(str(e)) from None
        if note:
            logger.warning(note)
        modes.append(reverse_spec(url, ns.host, port))
        chosen[option] = [url]
    return {**chosen, "mode": modes} if chosen else {}


def presets(ns: argparse.Namespace) -> dict[str, Any]:
    """The options `contextpaw` sets before mitmproxy reads the command line."""
    chosen = {**PRESETS, "confdir": ns.confdir or CONFDIR}
    if ns.web:  # mitmweb has no flow lines to turn off
        return {**{k: v for k, v in chosen.items() if k != "flow_detail"}, "web_columns": WEB_COLUMNS}
    return chosen


def web_footer(modes: Sequence[str], given: Collection[str]) -> dict[str, Any]:
    """mitmweb's status bar shows `listen_host:listen_port` (`*:8080` by default) as the proxy's
    address; where every mode names its own, the first one's is shown instead (the options are
    the default of modes that name none, so they change nothing else). Not where the user set them."""
    from mitmproxy.proxy import mode_specs

    parsed = [mode_specs.ProxyMode.parse(spec) for spec in modes]
    if not parsed or any(m.custom_listen_port is None for m in parsed) or {"listen_host", "listen_port"} & set(given):
        return {}
    return {"listen_host": parsed[0].custom_listen_host or "", "listen_port": parsed[0].custom_listen_port}


def mitmdump_filters(args: argparse.Namespace) -> dict[str, str]:
    """A filter expression on the command line, applied as mitmdump applies it."""
    if not args.filter_args:
        return {}
    expression = " ".join(args.filter_args)
    return {"save_stream_filter": expression, "readfile_filter": expression, "dumper_filter": expression}


def has_work(args: argparse.Namespace, options: Any) -> bool:
    """Whether mitmproxy has something to do: a backend, a mode of the user's, or flows to read or replay."""
    return bool(
        options.contextpaw_ollama
        or options.contextpaw_llamacpp
        or args.mode
        or args.rfile
        or args.client_replay
        or args.server_replay
        or args.server is False
    )


CHATTER = ("mitmproxy.proxy.server",)
"""The loggers of mitmproxy's connection lines (client and server connect and disconnect, the relay's
connections among them, "Streaming response from ..."), which the command keeps quiet by default."""


class QuietChatter(logging.Filter):
    """Keeps mitmproxy's connection lines out of the log unless asked for (`-v`, `--flow-detail 1`
    or more, `--set termlog_verbosity=debug`): the request lines say what happened. Warnings and
    errors always pass."""

    def __init__(self) -> None:
        super().__init__()
        self.quiet = True

    def load(self, loader: Any) -> None:
        for name in CHATTER:
            logging.getLogger(name).addFilter(self)

    def configure(self, updated: set[str]) -> None:
        from mitmproxy import ctx

        detail = ctx.options.flow_detail if "flow_detail" in ctx.options else 0
        verbosity = ctx.options.termlog_verbosity if "termlog_verbosity" in ctx.options else "info"
        self.quiet = detail == 0 and verbosity != "debug"

    def done(self) -> None:
        for name in CHATTER:
            logging.getLogger(name).removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.quiet or record.levelno > logging.INFO


class StartupLine:
    """Says once, when the proxy is up, what runs: the version, the policy, each backend with its
    kind and where clients reach it, and where mitmweb listens."""

    def __init__(self, notes: Sequence[str]) -> None:
        self.notes = list(notes)

    def running(self) -> None:
        from mitmproxy import ctx

        for note in self.notes:
            logger.warning(note)
        logger.info(startup_line(ctx.options))


def startup_line(options: Any) -> str:
    """The line from mitmproxy's options as they ended up (after `--set` and config.yaml)."""
    from mitmproxy.proxy import mode_specs

    from contextpaw.ops.admin import package_version
    from contextpaw.proxy.backends import endpoint

    kinds = {}
    for kind in wire.Kind:
        for url in getattr(options, f"contextpaw_{kind}"):
            b = wire.Backend.parse(kind, url)
            kinds[endpoint(b.host, b.port)] = kind
    served = []
    listening = "server" not in options or options.server  # -n (e.g. with -r FILE): nothing listens
    for spec in options.mode if listening else ():
        mode = mode_specs.ProxyMode.parse(spec)
        host = mode.listen_host(options.listen_host) or "0.0.0.0"
        where = f"http://{host}:{mode.listen_port(options.listen_port)}"
        if isinstance(mode, mode_specs.ReverseMode):
            named = kinds.get(endpoint(*mode.address)) or "kind found on first contact"
            served.append(f"{named} {_target(mode)} at {where}")
        else:
            served.append(f"{mode.type_name} proxy at {where}")
    line = f"contextpaw {package_version()}, policy {options.contextpaw_policy}: {'; '.join(served) or 'no proxy server (-n)'}"
    if "web_port" in options:
        line += f"; mitmweb at http://{options.web_host}:{options.web_port}/ (open it with the ?token= address mitmweb prints)"
    return line + ("; /contextpaw/health on each" if served else "")


def _target(mode: Any) -> str:
    """A reverse mode's backend URL."""
    host, port = mode.address
    return f"{mode.scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def check_tls(backends: Sequence[Fronted]) -> list[str]:
    """For each https backend that answers in plain HTTP, what to write instead (one probe each,
    only for https URLs)."""
    secure = [b for b in backends if b.url.startswith("https://")]
    if not secure:
        return []
    answers = run_probes(doctor.answers_of([(b.kind, b.url) for b in secure]))
    return [f"--{a.kind} {a.url}: {f.what}; {f.fix}" for a in answers for f in doctor.check_answer(a) if a.plain_http]


def _quiet_on_interrupt(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """CPython 3.12.1 may call back a connect that Ctrl-C has just cancelled, and the loop would print
    that callback's InvalidStateError as a traceback under the one line the command owes."""
    if not isinstance(context.get("exception"), asyncio.InvalidStateError):
        loop.default_exception_handler(context)


def run_probes[T](probes: Coroutine[Any, Any, T]) -> T:
    """Run the command's start-up or doctor probes on a loop of their own."""
    with asyncio.Runner() as runner:
        runner.get_loop().set_exception_handler(_quiet_on_interrupt)
        return runner.run(probes)


def add_where_scripts_go(manager: Any, addons: Sequence[object]) -> None:
    """Add `addons` to a master's chain where `-s` puts its scripts (the script loader's place, before
    mitmproxy's save, dump and view addons), so that `-w`, the dump and mitmweb see each flow as the
    client got it; a `-s` script of the user's comes after them, as after `-s contextpaw_addon.py`."""
    from mitmproxy.addons import script

    manager.add(*addons)
    chain = manager.chain
    added = chain[len(chain) - len(addons) :]
    del chain[len(chain) - len(addons) :]
    at = next((i for i, a in enumerate(chain) if isinstance(a, script.ScriptLoader)), len(chain))
    chain[at:at] = added


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["doctor"]:
        sys.exit(run_doctor(argv[1:]))
    if argv[:1] == ["launch"]:
        from contextpaw.command import launcher

        sys.exit(launcher.main(argv[1:]))
    if argv[:1] == ["mcp"]:
        from contextpaw.command import mcp

        sys.exit(mcp.main(argv[1:]))
    ns, _ = own_parser().parse_known_args(argv)
    sources = from_environment(argv)
    if ns.version:  # mitmproxy's own --version would name only mitmproxy
        print(version_text())
        sys.exit(0)
    try:
        backends, notes = fronted(ns, sources)
    except ValueError as e:
        own_parser().error(str(e))
    if problems := check_tls(backends):
        own_parser().error("; ".join(problems))
    from mitmproxy import exceptions
    from mitmproxy.tools import cmdline
    from mitmproxy.tools.main import run

    from contextpaw.proxy.compose import make_addons

    master: type[Any]
    if ns.web:
        from mitmproxy.tools.web.master import WebMaster

        master, mitmproxy_parser = WebMaster, cmdline.mitmweb
    else:
        from mitmproxy.tools.dump import DumpMaster

        master, mitmproxy_parser = DumpMaster, cmdline.mitmdump
    masters: list[Any] = []

    class WithContextPaw(master):
        """The mitmproxy master with ContextPaw's addons and presets (set here, so that `--set` and
        config.yaml, which mitmproxy applies after this, override them)."""

        def __init__(self, opts, **kwargs) -> None:
            super().__init__(opts, **kwargs)
            add_where_scripts_go(self.addons, [*make_addons(), StartupLine(notes), QuietChatter()])
            opts.update(**presets(ns))
            masters.append(self)

    def extra(args: argparse.Namespace) -> dict[str, Any]:
        opts = masters[0].options
        read_from = next(iter(_set_values(args.setoptions or [], "confdir")[-1:]), presets(ns)["confdir"])
        command_line_wins(opts, args, file_options(read_from) | set(sources), set(sources))
        if said := unknown_options(opts.deferred, opts.keys()):  # the compactor says it on a later configure, if any
            raise exceptions.OptionsError(said)
        served = fronted_from_options(opts, ns, backends)
        opts.update(**served)
        if not has_work(args, opts):
            raise exceptions.OptionsError("give --ollama URL, --llamacpp URL, or both (or mitmproxy's own --mode)")
        if args.server is not False and (taken := taken_ports(backends)):
            raise PortTaken(taken)
        # -q keeps warnings and errors (mitmproxy's own -q keeps errors alone)
        quiet = {"termlog_verbosity": "warn"} if args.quiet and not (args.options or args.commands) else {}
        # flows read back (-r) are shown, a line each, unless the user chose how: the preset's
        # flow_detail=0 keeps a running proxy's terminal to ContextPaw's lines, and printed nothing here
        given = {s.partition("=")[0] for s in args.setoptions or []} | file_options(read_from)
        shown = (
            {"flow_detail": 1}
            if args.rfile and not ns.web and getattr(args, "flow_detail", None) is None and "flow_detail" not in given
            else {}
        )
        listen = {"listen_host", "listen_port"} if args.listen_host is not None or args.listen_port is not None else set()
        footer = web_footer(opts.mode, given | listen) if ns.web else {}
        return {**mitmdump_filters(args), **quiet, **shown, **footer}

    try:
        run(WithContextPaw, functools.partial(command_parser, mitmproxy_parser), [*mitmproxy_args(backends), *argv], extra)
    except ParserDone as done:
        sys.exit(done.status)
    except PortTaken as e:
        print(f"contextpaw: {e}", file=sys.stderr)
        sys.exit(2)
    except TypeError as e:  # mitmproxy reads config.yaml's values unchecked: a wrong type ends in its TypeError
        said = wrong_type(str(e))
        if said is None:
            raise
        confdir = next(iter(_set_values(argv, "confdir")[-1:]), presets(ns)["confdir"])
        print(f"contextpaw: {said}, in {Path(confdir).expanduser() / 'config.yaml'}", file=sys.stderr)
        sys.exit(2)


def doctor_parser() -> argparse.ArgumentParser:
    """`contextpaw doctor`: the command line of `contextpaw` (what it does not need is ignored), and
    what the servers cannot say themselves."""
    p = argparse.ArgumentParser(prog="contextpaw doctor", description=run_doctor.__doc__, add_help=True)
    add_arguments(p)
    mitm = p.add_argument_group("mitmproxy's arguments the doctor reads")
    mitm.add_argument("--mode", "-m", action="append", default=[])
    mitm.add_argument("--listen-host", default="")
    mitm.add_argument("--listen-port", "-p", type=int, default=8080)
    mitm.add_argument("--set", dest="setoptions", action="append", default=[], metavar="NAME=VALUE")
    asked = p.add_argument_group("doctor")
    asked.add_argument(
        "--model",
        action="append",
        default=[],
        help="an Ollama model to check (repeatable; default: the loaded ones, else the first listed)",
    )
    asked.add_argument(
        "--ctx", type=int, metavar="N", help="the -c llama-server was started with (default: the model's trained length, as -c 0 asks)"
    )
    asked.add_argument(
        "--timeout", type=float, default=60.0, help="seconds a backend may take to answer, loading a model included (default 60)"
    )
    asked.add_argument("--json", action="store_true", help="print the findings as JSON (level, subject, what, fix)")
    p.epilog = "exit status: 0 no problems, 1 problems found, 2 usage, 3 could not check"
    return p


def _set_values(setoptions: Sequence[str], name: str) -> list[str]:
    return [s.partition("=")[2] for s in setoptions if s.partition("=")[0] == name]


def run_doctor(argv: Sequence[str]) -> int:
    """Checks the backends of a `contextpaw` command line, and the set-up itself, and says how to fix
    what is wrong. Exit status 0 when nothing is, 1 when something is, 2 for a wrong command line, 3
    when something could not be checked."""
    import os
    from pathlib import Path

    from mitmproxy.proxy import mode_specs

    p = doctor_parser()
    ns = p.parse_args(argv)  # an unknown flag is an error (exit 2), not silently ignored
    try:
        backends, notes = fronted(ns, from_environment(argv))
        backends += configured_backends(ns, backends)
        if not backends and not ns.mode and not any(s.startswith("contextpaw_") for s in ns.setoptions):
            found = run_probes(doctor.found_at_defaults())
            seen = f"; at the default ports: {', '.join(found)}" if found else "; nothing answers at the default ports either"
            nothing = doctor.Finding(
                "unchecked",
                "command line",
                f"names no backend, so contextpaw would not start: nothing to check{seen}",
                "give --ollama URL, --llamacpp URL or both, as to contextpaw (or contextpaw_ollama / "
                f"contextpaw_llamacpp in {Path(ns.confdir or CONFDIR).expanduser() / 'config.yaml'})",
            )
            print(doctor.as_json([nothing]) if ns.json else doctor.render([nothing]))
            return doctor.exit_status([nothing])
        specs = [*(f"reverse:{b.url}@{b.listen[0]}:{b.listen[1]}" for b in backends), *ns.mode]
        modes = [(spec, mode_specs.ProxyMode.parse(spec)) for spec in specs or ["regular"]]
    except ValueError as e:
        p.error(str(e))
    named: list[tuple[wire.Kind | None, str]] = [(b.kind, b.url) for b in backends]
    for kind in wire.Kind:
        named += [(kind, wire.Backend.parse(kind, url).url) for url in _set_values(ns.setoptions, f"contextpaw_{kind}")]
    for _, mode in modes:
        if isinstance(mode, mode_specs.ReverseMode) and mode.scheme in ("http", "https"):
            named.append((None, _target(mode)))
    tokenizer = ns.contextpaw_tokenizer or next(iter(_set_values(ns.setoptions, "contextpaw_tokenizer")[-1:]), "")
    setup = doctor.Setup(
        backends=tuple(named_first_kind(named)),
        listeners=tuple((spec, mode.listen_host(ns.listen_host)) for spec, mode in modes),
        tokenizer=tokenizer,
        models=tuple(ns.model),
        asked_ctx=ns.ctx,
        timeout=ns.timeout,
        proxies=tuple(_own_url(mode, ns) for _, mode in modes if mode.listen_port(ns.listen_port) is not None),
        fronts=tuple((b.url, _own_url(mode, ns)) for b, (_, mode) in zip(backends, modes, strict=False)),
        clients=tuple(doctor.client_settings(os.environ, Path.home())),
    )
    findings = [doctor.Finding("note", "command line", note) for note in notes]
    try:
        findings += run_probes(doctor.diagnose(setup))
    except Exception as e:  # the doctor itself failed: nothing it says could be trusted
        findings.append(doctor.Finding("unchecked", "doctor", f"could not check: {type(e).__name__}: {e}"))
    print(doctor.as_json(findings) if ns.json else doctor.render(findings))
    return doctor.exit_status(findings)


class PortTaken(Exception):
    """A port ContextPaw is to listen on is another program's (`taken_ports` says which and why)."""


def taken_ports(backends: Sequence[Fronted]) -> str | None:
    """Where a port ContextPaw is to listen on is held by another program, what to say instead of
    mitmproxy's `[Errno 98] ... address already in use`: the flag that chose the port and how to see
    who holds it (None: every port is free). Asked as a server binds (`SO_REUSEADDR`), so a port
    left in TIME_WAIT is free."""
    import socket

    for b in backends:
        host, port = b.listen
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                flag = "--port" if b.kind == wire.Kind.OLLAMA else "--llamacpp-port"
                return (
                    f"port {port} on {host} ({flag}, where clients reach {b.kind}) is taken by another program: give "
                    f"{flag} another port, or stop what holds it (`ss -ltnp 'sport = :{port}'` names it)"
                )
    return None


def configured_backends(ns: argparse.Namespace, backends: Sequence[Fronted]) -> list[Fronted]:
    """The backends `config.yaml` in the confdir fronts, as the command fronts them
    (`fronted_from_options`): one of a kind the command line does not name, at `--host` and the
    kind's port; where `mode` is set there, the command runs those modes and none is added."""
    from mitmproxy import optmanager

    path = Path(ns.confdir or CONFDIR, "config.yaml").expanduser()
    try:
        options = optmanager.parse(path.read_text(encoding="utf8")) if path.is_file() else {}
    except Exception:  # the command itself says what is wrong with the file (`wrong_type`, mitmproxy's own)
        return []
    if "mode" in options:
        return []
    found = []
    for kind, port in ((wire.Kind.OLLAMA, ns.port), (wire.Kind.LLAMACPP, ns.llamacpp_port)):
        urls = options.get(f"contextpaw_{kind}")
        if isinstance(urls, list) and len(urls) == 1 and not any(b.kind == kind for b in backends):
            with contextlib.suppress(ValueError):
                found.append(Fronted(kind, backend_url(f"contextpaw_{kind}", str(urls[0]))[0], (ns.host, port)))
    return found


def _own_url(mode: Any, ns: argparse.Namespace) -> str:
    """Where a client reaches one of ContextPaw's listeners (the loopback for every interface)."""
    host = mode.listen_host(ns.listen_host) or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{f'[{host}]' if ':' in host else host}:{mode.listen_port(ns.listen_port)}"


def named_first_kind(named: Sequence[tuple[wire.Kind | None, str]]) -> list[tuple[wire.Kind | None, str]]:
    """Each URL once, with the kind the command line gave it where it gave one."""
    kinds: dict[str, wire.Kind | None] = {}
    for kind, url in named:
        kinds[url] = kinds.get(url) or kind
    return [(kind, url) for url, kind in kinds.items()]


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # in one line, as the console script (entry.py) says it
        print("contextpaw: interrupted", file=sys.stderr)
        sys.exit(130)
