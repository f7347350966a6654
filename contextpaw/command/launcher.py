"""`contextpaw launch AGENT [--print] [-- AGENT ARGS]`: the shell around `launch`. It asks the running
ContextPaw which model and window it serves (`/contextpaw/window`), writes the generated files
into ContextPaw's state directory and starts the agent in this process's place; `--print` shows
all of it as a shell script instead and starts nothing."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from contextpaw import wire
from contextpaw.command import launch

DEFAULT_PROXIES = ("http://127.0.0.1:11434", "http://127.0.0.1:8092")
"""Where `contextpaw` listens by default: in front of Ollama, then of llama-server."""


def proxies(environ: Mapping[str, str]) -> tuple[str, ...]:
    """Where ContextPaw listens, read from the environment the rest of the command reads:
    `CONTEXTPAW_URL`, else `CONTEXTPAW_HOST` with `CONTEXTPAW_PORT` and `CONTEXTPAW_LLAMACPP_PORT`
    (each defaulting as `contextpaw` does)."""
    if environ.get("CONTEXTPAW_URL"):
        return (environ["CONTEXTPAW_URL"].rstrip("/"),)
    host = environ.get("CONTEXTPAW_HOST") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    ports = (environ.get("CONTEXTPAW_PORT") or "11434", environ.get("CONTEXTPAW_LLAMACPP_PORT") or "8092")
    return tuple(f"http://{host}:{port.strip()}" for port in ports)


DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""What asks ContextPaw: straight to it, never through `http_proxy` (ContextPaw is on this machine,
and `contextpaw mcp` sends the local token with what it asks)."""

DEFAULT_STATE_DIR = "~/.contextpaw"
ASK_TIMEOUT_S = 120.0
"""Learning an Ollama model's window may load it, as the agent's first request would."""


class LaunchError(Exception):
    """What to tell the user instead of starting the agent."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="contextpaw launch",
        description="Start an agent pointed at a running ContextPaw and told the window it serves the model at, in "
        "the agent's own setting, so that the agent compacts its own history before the window. "
        "No config file of yours is changed; --print shows what is set.",
        epilog="Everything after -- goes to the agent: contextpaw launch codex -- exec 'fix the tests'",
    )
    p.add_argument("agent", choices=sorted(launch.PLANS), help="the agent to start")
    p.add_argument(
        "--url",
        help=f"where ContextPaw listens (default: CONTEXTPAW_URL, else the first of {', '.join(DEFAULT_PROXIES)} "
        "that answers, its ports as CONTEXTPAW_PORT and CONTEXTPAW_LLAMACPP_PORT say)",
    )
    p.add_argument("--model", help="the model (default: the one the backend lists, when it lists one)")
    p.add_argument("--window", type=int, metavar="N", help="tell the agent this window instead of the one ContextPaw serves")
    p.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="ContextPaw's state directory: the generated files go under launch/, and `contextpaw mcp` reads the "
        "proxy's token there (default ~/.contextpaw, ContextPaw's own)",
    )
    p.add_argument("--print", action="store_true", help="show what would be set and written, as a shell script; start nothing")
    p.add_argument(
        "--force",
        action="store_true",
        help="start the agent even where the window served is less than it needs to live on its own compaction",
    )
    return p


def ask(url: str) -> tuple[int, Any]:
    """GET `url`: (status, JSON body or None); status 0 when nothing answers."""
    try:
        with DIRECT.open(url, timeout=ASK_TIMEOUT_S) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"null")
        except ValueError:
            return e.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


def proxy_url(given: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The first address where ContextPaw answers its health check. A 503 is ContextPaw too, with a
    backend that does not answer: it is named, and the launch goes on (the agent may use the other)."""
    candidates = [given] if given else proxies(os.environ if environ is None else environ)
    for url in candidates:
        status, health = ask(url.rstrip("/") + "/contextpaw/health")
        if status == 200 or (status == 503 and isinstance(health, dict) and "backends" in health):
            for down in [b for b in health["backends"] if isinstance(b, dict) and not b.get("answers")]:
                why = f" ({down['last_error']})" if down.get("last_error") else ""
                print(
                    f"contextpaw launch: ContextPaw at {url.rstrip('/')} answers, but its backend {down.get('kind') or ''} "
                    f"at {down.get('url')} does not{why}",
                    file=sys.stderr,
                )
            return url.rstrip("/")
    where = " or ".join(candidates)
    raise LaunchError(f"no ContextPaw answers at {where}: start `contextpaw --ollama URL` or `--llamacpp URL`, or give --url")


def listed_models(proxy: str) -> list[str] | None:
    """The models the backend behind `proxy` lists (None: it did not answer a listing)."""
    status, listing = ask(proxy + "/v1/models")
    if status != 200 or not isinstance(listing, dict):
        return None
    return [str(m["id"]) for m in listing.get("data") or [] if isinstance(m, dict) and m.get("id")]


def chosen_model(proxy: str, given: str | None) -> str:
    """The model to launch with: the one given, which the backend must list where it lists any
    (Ollama's `name` and `name:latest` are one), else the one it lists."""
    names = listed_models(proxy)
    if given is None:
        if names is not None and len(names) == 1:
            return names[0]
        raise LaunchError(f"name the model with --model: the backend lists {', '.join(names or []) or 'none'}")
    if names and given not in names and f"{given}:latest" not in names and given.removesuffix(":latest") not in names:
        raise LaunchError(f"the backend has no model {given}: it lists {', '.join(names)}")
    return given


def target(ns: argparse.Namespace) -> launch.Target:
    proxy = proxy_url(ns.url)
    model = chosen_model(proxy, ns.model)
    print(
        f"contextpaw launch: asking ContextPaw at {proxy} for the window of {model} (a model not loaded yet may take up "
        f"to {ASK_TIMEOUT_S:.0f} s to load)",
        file=sys.stderr,
    )
    status, served = ask(f"{proxy}/contextpaw/window?model={quote(model, safe='')}")
    if status != 200 or not isinstance(served, dict):
        reason = served.get("error") if isinstance(served, dict) else f"status {status}"
        raise LaunchError(f"ContextPaw at {proxy} did not say the window of {model}: {reason}")
    if served["source"] != "backend" and ns.window is None:
        print(
            f"contextpaw launch: the backend did not say the window of {model}; ContextPaw fits to its default "
            f"({served['window']}, contextpaw_default_ctx); give --window N to tell the agent another",
            file=sys.stderr,
        )
    told = int(served["agent_window"] if "agent_window" in served else served["window"])
    if ns.window is None and told != served["window"]:
        print(
            f"contextpaw launch: the agent is told a window of {told}, not the {served['window']} served: {served.get('note', '')}",
            file=sys.stderr,
        )
    window = ns.window or told
    kind = wire.Kind(served["backend"]["kind"])
    state_dir = (ns.state_dir or Path(DEFAULT_STATE_DIR)).expanduser()
    return launch.Target(
        proxy,
        model,
        window,
        kind,
        state_dir,
        served=int(served["window"]) if window != served["window"] else None,
        contextpaw=contextpaw_command(),
        token_dir=state_dir if ns.state_dir else None,
        session=secrets.token_hex(8),
    )


def contextpaw_command() -> tuple[str, ...]:
    """How the agent starts ContextPaw again (for `contextpaw mcp`): the `contextpaw` that runs now,
    by its full path, else this Python with the module."""
    running = Path(sys.argv[0])
    if running.name == "contextpaw" and running.is_file():
        return (str(running.resolve()),)
    return (sys.executable, "-m", "contextpaw.command.cli")


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    ours, agent_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ns = parser().parse_args(ours)
    try:
        aimed = target(ns)
        short = launch.too_small(ns.agent, aimed)
        if short is not None and not ns.force:
            raise LaunchError(f"{short}; or start it anyway with --force")
        chosen = launch.plan(ns.agent, aimed)
    except LaunchError as e:
        print(f"contextpaw launch: {e}", file=sys.stderr)
        return 2
    if short is not None:
        print(f"contextpaw launch: started anyway (--force): {short}", file=sys.stderr)
    if ns.print:
        sys.stdout.write(chosen.script(tuple(agent_args)))
        return 0
    binary = shutil.which(chosen.argv[0])
    if binary is None:
        print(
            f"contextpaw launch: {chosen.argv[0]} is not on PATH: install it with `{launch.INSTALL[ns.agent]}` "
            "(--print shows what it would be started with)",
            file=sys.stderr,
        )
        return 2
    for path, text in chosen.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for note in chosen.notes:
        print(f"contextpaw launch: {note}", file=sys.stderr)
    env = {**os.environ, **{k: v for k, v in chosen.defaults.items() if not os.environ.get(k)}, **chosen.env}
    os.execve(binary, [binary, *chosen.argv[1:], *agent_args], env)
