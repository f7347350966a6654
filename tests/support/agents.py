"""Run the real agent CLIs non-interactively against a base URL, as the agent tests do.

The CLIs come from scripts/install/get_agents.sh (pinned versions, cached per user, each proven by
``--version`` before use): :func:`locate_agents`. Each ``run_*`` function starts one CLI in its own
process group with a scratch HOME (and the XDG folders, ``CODEX_HOME`` and config files it reads
there), telemetry, update checks and every other outbound call turned off, and stops the whole group
when ``timeout`` runs out. It returns an :class:`AgentRun`: the exit code, stdout, stderr and what
the CLI printed as JSON, parsed.

What each one sends and how it reacts to an overflow: shared/reference/agents.md, and one request per
client recorded in tests/agents/fixtures/, which the agent tests compare with what the client sends
now (:func:`check_recorded`; ``CONTEXTPAW_RECORD_AGENTS=1`` records them anew). Below the ``run_*``
functions: :func:`start_contextpaw_stack`, the client -> recorder -> ContextPaw -> recorder -> backend
chain the tests run them through (the recorder is :mod:`support.recorder`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GET_AGENTS = REPO / "scripts" / "install" / "get_agents.sh"
UNREACHABLE = 3
"""get_agents.sh's exit status when a registry cannot be reached."""

CLAUDE_CODE_VERSION = "2.1.332"
OPENCODE_VERSION = "1.18.33"
CODEX_VERSION = "0.171.0"
AIDER_VERSION = "0.86.2"
QWEN_CODE_VERSION = "0.24.4"


@dataclass(frozen=True)
class Agents:
    """The proven binaries by name, or why there are none (``unreachable``: a registry could not be
    reached, the one reason a CI run may skip on)."""

    paths: Mapping[str, Path]
    reason: str = ""
    unreachable: bool = False
    seconds: float = 0.0


def locate_agents(*names: str, install: bool = True, timeout: float = 1800) -> Agents:
    """Run scripts/install/get_agents.sh for ``names`` (default: all) and read its ``name=path`` lines."""
    argv = ["bash", str(GET_AGENTS), *([] if install else ["--no-install"]), *names]
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Agents({}, f"{GET_AGENTS.name} did not finish in {timeout:.0f} s")
    seconds = time.monotonic() - started
    paths = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    if done.returncode != 0 or not paths:
        reason = f"{GET_AGENTS.name} exited {done.returncode}: {done.stderr.strip()[-1500:]}"
        return Agents({}, reason, unreachable=done.returncode == UNREACHABLE, seconds=seconds)
    return Agents({name: Path(path) for name, path in paths.items()}, seconds=seconds)


@dataclass
class AgentRun:
    """One finished (or timed-out) CLI run."""

    argv: list[str]
    returncode: int | None
    """None when the run was stopped at its timeout."""
    stdout: str
    stderr: str
    result: Any
    """What the CLI printed as JSON, parsed: Claude Code's result object, opencode's list of events;
    None where the CLI prints none (aider) or printed something else."""
    seconds: float
    home: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def describe(self) -> str:
        """For assertion messages: how it ended and the tails of its output."""
        state = "timed out" if self.timed_out else f"exited {self.returncode}"
        return (
            f"{Path(self.argv[0]).name} {state} after {self.seconds:.1f} s\n"
            f"--- stdout (tail) ---\n{self.stdout[-3000:]}\n--- stderr (tail) ---\n{self.stderr[-3000:]}"
        )


def scratch_env(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment of its own for one CLI: a fresh HOME with the XDG folders inside it, PATH
    (node must be found) and the locale; nothing else of this process's environment, so no key, base
    URL or proxy setting of the machine's leaks in."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "TMPDIR": str(home / "tmp"),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
    }
    for name in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME", "TMPDIR"):
        Path(env[name]).mkdir(parents=True, exist_ok=True)
    return {**env, **(extra or {})}


def run_process(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    timeout: float,
    stdin: str | None = None,
    stdout_file: Path | None = None,
) -> tuple[int | None, str, str, float]:
    """Run ``argv`` in a new process group; at ``timeout`` stop the whole group (returncode None).
    With ``stdout_file`` its stdout goes to that file, not a pipe: node writes a file at once, while
    what it has not yet written to a full pipe when it exits is lost (Qwen Code's JSON, cut at 64 KiB)."""
    started = time.monotonic()
    sink = stdout_file.open("w+", encoding="utf-8", errors="replace") if stdout_file else None
    process = subprocess.Popen(
        list(argv), cwd=cwd, env=dict(env), stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=sink or subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = process.communicate(stdin, timeout=timeout)
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        code = None
    try:  # whatever it left running in its group (language servers, watchers) goes with it
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if sink is not None:
        with sink:
            sink.seek(0)
            out = sink.read()
    return code, out, err, time.monotonic() - started


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


# --- Claude Code ----------------------------------------------------------------------------------

CLAUDE_ENV = {
    "ANTHROPIC_AUTH_TOKEN": "local",  # sent as `authorization: Bearer local`
    "ANTHROPIC_API_KEY": "",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry, error reports, update checks
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
}


def run_claude(
    binary: Path, base_url: str, prompt: str, *, home: Path, model: str = "fake-model", resume: str | None = None,
    cwd: Path | None = None, timeout: float = 120, extra_args: Sequence[str] = (),
) -> AgentRun:  # fmt: skip
    """``claude -p --output-format json`` with the prompt on stdin (a long one does not fit argv
    comfortably); ``resume`` continues that session (``-r SESSION_ID``). ``result`` is Claude Code's
    result object (``result``, ``session_id``, ``terminal_reason``, ``is_error``, ``api_error_status``)."""
    cwd = cwd or home / "work"
    cwd.mkdir(parents=True, exist_ok=True)
    env = scratch_env(home, {**CLAUDE_ENV, "ANTHROPIC_BASE_URL": base_url, "CLAUDE_CONFIG_DIR": str(home / ".claude")})
    argv = [str(binary), "-p", "--output-format", "json", "--model", model, *(["-r", resume] if resume else []),
            *extra_args]  # fmt: skip
    code, out, err, seconds = run_process(argv, env, cwd, timeout, stdin=prompt)
    return AgentRun(argv, code, out, err, _json_or_none(out.strip()), seconds, home)


# --- opencode -------------------------------------------------------------------------------------

OPENCODE_ENV = {
    # no models.dev fetch, no plugin installs from npm, no update check, no LSP downloads: fully offline
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_CLAUDE_CODE": "1",  # do not read ~/.claude or CLAUDE.md
    "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
    "NPM_CONFIG_REGISTRY": "http://127.0.0.1:9/",  # were it to install anything, it would fail, not fetch
}


def opencode_config(base_url: str, model: str, context: int, output: int) -> dict[str, Any]:
    """A custom OpenAI-compatible provider ``local`` serving ``model``. ``@ai-sdk/openai-compatible``
    is bundled in the opencode binary (nothing is installed for it); the model's ``limit`` tells
    opencode the window (without it opencode assumes 0 and never compacts)."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "local": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "local",
                "options": {"baseURL": f"{base_url.rstrip('/')}/v1", "apiKey": "local"},
                "models": {model: {"name": model, "limit": {"context": context, "output": output}}},
            }
        },
        "model": f"local/{model}",
        "small_model": f"local/{model}",
        "autoupdate": False,
        "share": "disabled",
        "plugin": [],
    }


def run_opencode(
    binary: Path, base_url: str, prompt: str, *, home: Path, model: str = "fake-model", context: int = 12000,
    output: int = 1024, files: Sequence[Path] = (), session: str | None = None, cwd: Path | None = None,
    timeout: float = 120,
) -> AgentRun:  # fmt: skip
    """``opencode run --format json MESSAGE`` with the config in ``$XDG_CONFIG_HOME/opencode``;
    ``files`` are attached (``-f``), ``session`` continues one (``-s``). ``result`` is the list of
    JSON events it printed; ``extra["text"]`` the text parts joined, ``extra["session"]`` its id,
    ``extra["errors"]`` the error events."""
    cwd = cwd or home / "work"
    cwd.mkdir(parents=True, exist_ok=True)
    config = home / ".config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(opencode_config(base_url, model, context, output), indent=2))
    env = scratch_env(home, OPENCODE_ENV)
    # the message first: `-f` takes an array and would swallow a message after it
    argv = [str(binary), "run", prompt, "--format", "json", "--model", f"local/{model}",
            *(["-s", session] if session else []), *(a for f in files for a in ("-f", str(f)))]  # fmt: skip
    code, out, err, seconds = run_process(argv, env, cwd, timeout)
    events = [e for e in (_json_or_none(line) for line in out.splitlines() if line.strip()) if isinstance(e, dict)]
    text = "".join(e["part"].get("text", "") for e in events if e.get("type") == "text" and isinstance(e.get("part"), dict))
    sessions = [e.get("sessionID") for e in events if e.get("sessionID")]
    errors = [e for e in events if e.get("type") == "error"]
    extra = {"text": text, "session": sessions[0] if sessions else None, "errors": errors}
    return AgentRun(argv, code, out, err, events, seconds, home, extra)


# --- aider ----------------------------------------------------------------------------------------

AIDER_ENV = {
    "AIDER_ANALYTICS": "false",
    "AIDER_CHECK_UPDATE": "false",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # it still tries the download once (agents.md); harmless offline
    "LITELLM_TELEMETRY": "False",
    "OLLAMA_API_KEY": "",
    "PYTHONUNBUFFERED": "1",  # what it printed survives a stop at the timeout
}
_TOKENS = re.compile(r"Tokens: ([\d.]+k?) sent, ([\d.]+k?) received")


def run_aider(
    binary: Path, base_url: str, message: str, *, home: Path, model: str = "fake:latest", files: Sequence[Path] = (),
    cwd: Path | None = None, timeout: float = 180, extra_args: Sequence[str] = (),
) -> AgentRun:  # fmt: skip
    """``aider --model ollama_chat/MODEL --message MESSAGE FILES`` against Ollama at ``base_url``
    (``OLLAMA_API_BASE``): no git, no prompts, no streaming. aider prints no JSON (``result`` is None);
    ``extra["tokens"]`` is its ``Tokens: N sent, M received`` line's two numbers, as printed."""
    cwd = cwd or home / "work"
    cwd.mkdir(parents=True, exist_ok=True)
    env = scratch_env(home, {**AIDER_ENV, "OLLAMA_API_BASE": base_url.rstrip("/")})
    argv = [
        str(binary), "--model", f"ollama_chat/{model}", "--no-git", "--yes-always", "--no-check-update",
        "--no-show-model-warnings", "--no-show-release-notes", "--no-stream", "--no-analytics", "--no-pretty",
        "--no-fancy-input", "--no-detect-urls", "--map-tokens", "0", "--message", message, *extra_args,
        *(str(f) for f in files),
    ]  # fmt: skip
    code, out, err, seconds = run_process(argv, env, cwd, timeout)
    tokens = _TOKENS.findall(out)
    return AgentRun(argv, code, out, err, None, seconds, home, {"tokens": tokens[-1] if tokens else None})


# --- Codex CLI ------------------------------------------------------------------------------------


def run_codex(
    binary: Path, base_url: str, prompt: str, *, home: Path, model: str = "fake-model", cwd: Path | None = None,
    timeout: float = 120,
) -> AgentRun:  # fmt: skip
    """``codex exec --json --skip-git-repo-check -`` with the prompt on stdin (a long one does not
    fit in one argv string) and a ``local`` provider in ``$CODEX_HOME/config.toml`` (``wire_api =
    "responses"``: Codex calls only ``/v1/responses``). ``result`` is the list of JSON events it
    printed."""
    cwd = cwd or home / "work"
    cwd.mkdir(parents=True, exist_ok=True)
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "local"\n\n[model_providers.local]\nname = "local"\n'
        f'base_url = "{base_url.rstrip("/")}/v1"\nwire_api = "responses"\nenv_key = "LOCAL_KEY"\n'
        "request_max_retries = 0\nstream_max_retries = 0\n\n[analytics]\nenabled = false\n"
    )
    env = scratch_env(home, {"CODEX_HOME": str(codex_home), "LOCAL_KEY": "local"})
    argv = [str(binary), "exec", "--json", "--skip-git-repo-check", "-"]
    code, out, err, seconds = run_process(argv, env, cwd, timeout, stdin=prompt)
    events = [e for e in (_json_or_none(line) for line in out.splitlines() if line.strip()) if isinstance(e, dict)]
    return AgentRun(argv, code, out, err, events, seconds, home)


# --- Qwen Code ------------------------------------------------------------------------------------

QWEN_ENV = {
    "QWEN_USAGE_STATISTICS_ENABLED": "0",  # else each start posts usage to Aliyun's RUM service
    "QWEN_TELEMETRY_ENABLED": "0",
    "QWEN_CODE_DISABLE_PRECONNECT": "1",
    "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
    "QWEN_DEBUG_LOG_FILE": "1",  # its debug log, in $HOME/.qwen/debug: what it made of an error
    "NPM_CONFIG_REGISTRY": "http://127.0.0.1:9/",  # were it to look for an update, it would fail, not fetch
}


def qwen_settings(context: int | None) -> dict[str, Any]:
    """Qwen Code's ``~/.qwen/settings.json``: no update check, usage statistics or telemetry, and no
    background memory agents (each would be a model request of its own after the turn). ``context``
    is the window it is told (``contextWindowSize``); without it a model it does not know gets
    200,000 tokens, and every request asks for ``max_tokens`` 32,000."""
    settings: dict[str, Any] = {
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False, "enableAutoSkill": False},
    }
    if context is not None:
        settings["model"] = {"generationConfig": {"contextWindowSize": context}}
    return settings


def run_qwen(
    binary: Path, base_url: str, prompt: str, *, home: Path, model: str = "fake-model", context: int | None = None,
    settings: Mapping[str, Any] | None = None, cwd: Path | None = None, timeout: float = 120,
    extra_args: Sequence[str] = (),
) -> AgentRun:  # fmt: skip
    """``qwen --auth-type openai --yolo -o json`` with the prompt on stdin (its headless mode: no
    positional prompt, stdin not a terminal) and the OpenAI provider from ``OPENAI_BASE_URL``,
    ``OPENAI_API_KEY`` and ``OPENAI_MODEL``; the settings of :func:`qwen_settings` and the sections
    of ``settings`` in ``$HOME/.qwen``. ``result`` is the JSON array of events it printed; ``extra["text"]`` the result
    event's text, ``extra["is_error"]`` its flag, ``extra["error"]`` its error's message,
    ``extra["session"]`` the session's id (``--resume`` it) and ``extra["debug"]`` the session's debug
    log (``$HOME/.qwen/debug/SESSION.txt``: how it read an error, what it compressed)."""
    cwd = cwd or home / "work"
    cwd.mkdir(parents=True, exist_ok=True)
    settings_file = home / ".qwen" / "settings.json"
    settings_file.parent.mkdir(parents=True, exist_ok=True)
    settings_file.write_text(json.dumps({**qwen_settings(context), **(settings or {})}, indent=2))
    env = scratch_env(home, {**QWEN_ENV, "OPENAI_BASE_URL": f"{base_url.rstrip('/')}/v1", "OPENAI_API_KEY": "local",
                             "OPENAI_MODEL": model})  # fmt: skip
    argv = [str(binary), "--auth-type", "openai", "--model", model, "--yolo", "--output-format", "json", *extra_args]
    code, out, err, seconds = run_process(argv, env, cwd, timeout, stdin=prompt, stdout_file=home / "tmp" / "qwen.json")
    events = _json_or_none(out.strip())
    events = [e for e in events if isinstance(e, dict)] if isinstance(events, list) else None
    final = next((e for e in reversed(events or []) if e.get("type") == "result"), {})
    session = final.get("session_id")
    log = home / ".qwen" / "debug" / f"{session}.txt"
    extra = {"text": str(final.get("result") or ""), "is_error": final.get("is_error"), "session": session,
             "error": str((final.get("error") or {}).get("message") or ""),
             "debug": log.read_text(errors="replace") if session and log.exists() else ""}  # fmt: skip
    return AgentRun(argv, code, out, err, events, seconds, home, extra)


# --- for the tests --------------------------------------------------------------------------------

_located: dict[tuple[str, ...], Agents] = {}


CODEX_TOOL_OUTPUT_LIMIT = 50_000
"""Codex keeps about 2,500 tokens of a command's output in its history by default (its start and
end, with "Warning: truncated output"), whatever the call asked for: raised, so that a file read
reaches the model whole unless a cut shrinks it, as with the other agents."""
QWEN_TOOL_OUTPUT_LIMIT = 200_000
"""Qwen Code keeps the first 25,000 characters of what its read_file returns by default
(`tools.truncateToolOutputThreshold`): raised too."""


def launch_arguments(agent: str, home: Path, prompt: str) -> tuple[list[str], dict[str, str], str | None]:
    """For `contextpaw launch AGENT -- ARGS`: the agent's own arguments for one non-interactive run,
    the environment that keeps it offline and in ``home``, and its stdin; nothing that names a
    window, a model or a provider (launch sets those)."""
    if agent == "claude":
        env = {k: v for k, v in CLAUDE_ENV.items() if k != "ANTHROPIC_AUTH_TOKEN"}
        return ["-p", "--output-format", "json"], {**env, "CLAUDE_CONFIG_DIR": str(home / ".claude")}, prompt
    if agent == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(f"tool_output_token_limit = {CODEX_TOOL_OUTPUT_LIMIT}\n\n[analytics]\nenabled = false\n")
        return ["exec", "--json", "--skip-git-repo-check", "-"], {"CODEX_HOME": str(codex_home)}, prompt
    if agent == "opencode":
        return ["run", prompt, "--format", "json"], dict(OPENCODE_ENV), None
    if agent == "qwen":
        settings = home / ".qwen" / "settings.json"
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(json.dumps({**qwen_settings(None), "tools": {"truncateToolOutputThreshold": QWEN_TOOL_OUTPUT_LIMIT}}))
        return ["--yolo", "-o", "json"], dict(QWEN_ENV), prompt
    raise ValueError(agent)


def run_launched(
    agent: str, binary: Path, front: str, prompt: str, *, home: Path, cwd: Path, state: Path, timeout: float, force: bool = False
) -> AgentRun:
    """`contextpaw launch AGENT --url FRONT -- <launch_arguments>` in ``cwd``, the agent's binary
    first on PATH (`force`: in a window launch would refuse); ``result`` is what the agent printed,
    parsed as one JSON value or JSON lines."""
    import sys

    own, env, stdin = launch_arguments(agent, home, prompt)
    env = scratch_env(home, {**env, "PATH": f"{binary.parent}:{scratch_env(home)['PATH']}"})
    argv = [sys.executable, "-m", "contextpaw.command.cli", "launch", agent, "--url", front, "--state-dir", str(state),
            *(["--force"] if force else []), "--", *own]  # fmt: skip
    cwd.mkdir(parents=True, exist_ok=True)
    code, out, err, seconds = run_process(argv, env, cwd, timeout, stdin=stdin)
    parsed = _json_or_none(out.strip())
    if parsed is None:
        parsed = [e for e in (_json_or_none(line) for line in out.splitlines() if line.strip()) if isinstance(e, dict)]
    events = [e for e in parsed if isinstance(e, dict)] if isinstance(parsed, list) else []
    # opencode's text parts, or the result event Qwen Code ends with (Claude Code's is `result` itself)
    text = "".join(e["part"].get("text", "") for e in events if e.get("type") == "text" and isinstance(e.get("part"), dict))
    text = text or next((str(e.get("result") or "") for e in reversed(events) if e.get("type") == "result"), "")
    return AgentRun(argv, code, out, err, parsed, seconds, home, {"text": text})


def require_agents(*names: str) -> dict[str, Path]:
    """The proven binaries, installing them if need be (once per test session); otherwise the test
    skips with get_agents.sh's reason. Under CI (``$CI`` set) only an unreachable registry may skip:
    any other failure to provide them is a test failure."""
    import pytest

    if names not in _located:
        _located[names] = locate_agents(*names)
    found = _located[names]
    if found.paths:
        return dict(found.paths)
    if os.environ.get("CI") and not found.unreachable:
        pytest.fail(f"CI needs the agent CLIs {', '.join(names)}: {found.reason}")
    pytest.skip(f"agent CLIs {', '.join(names)} not available: {found.reason}")


# --- a client, ContextPaw and a backend, with a recorder on each side -----------------------------

ADDON = REPO / "contextpaw_addon.py"
COUNTING_PATHS = ("/tokenize", "/detokenize", "/apply-template", "/api/show", "/count_tokens", "/input_tokens")
"""What ContextPaw (or aider) asks a server to count or describe: not a model request."""
RECORD_ENV = "CONTEXTPAW_RECORD_AGENTS"
"""Set to 1 to write the recorded request of each client anew into tests/agents/fixtures/."""


@dataclass
class Stack:
    """client -> ``front`` recorder -> ContextPaw (mitmdump) -> ``back`` recorder -> backend.

    ``front_log`` holds what the client sent and what it got back; ``back_log`` what ContextPaw
    forwarded and what the backend answered."""

    backend: str
    proxy: Any
    front: str
    front_log: Path
    back_log: Path

    def sent(self, path: str) -> list[dict[str, Any]]:
        """The client's model requests to ``path`` (query ignored), oldest first."""
        return model_requests(self.front_log, path)

    def forwarded(self, path: str) -> list[dict[str, Any]]:
        """What ContextPaw forwarded to ``path``, oldest first."""
        return model_requests(self.back_log, path)


StartStack = Callable[..., Stack]
"""The agent tests' ``stack`` fixture: ``stack(kind, fake_args, options) -> Stack``."""


def model_requests(log: Path, path: str) -> list[dict[str, Any]]:
    from .recorder import read_log

    return [e for e in read_log(log) if e["method"] == "POST" and e["path"].split("?")[0] == path]


def start_contextpaw_stack(work: Path, backend: str, options: Sequence[str] = ()) -> tuple[Stack, Any]:
    """Start the recorders and mitmdump with the addon in reverse mode, as the README runs it
    (``connection_strategy=lazy``; the backend's kind found by probing); ``options`` are extra
    ``--set name=value`` pairs. Returns the stack and a contextlib.ExitStack that stops it all."""
    import contextlib
    import sys

    from .backends import free_port, start_process
    from .common import running
    from .recorder import recorder_app

    work.mkdir(parents=True, exist_ok=True)
    exits = contextlib.ExitStack()
    try:
        back_log, front_log = work / "forwarded.jsonl", work / "sent.jsonl"
        back = exits.enter_context(running(recorder_app(backend, back_log)))
        port = free_port()
        argv = [sys.executable, "-c", "from mitmproxy.tools.main import mitmdump; mitmdump()", "-q", "-s", str(ADDON),
                "--mode", f"reverse:{back}@127.0.0.1:{port}", "--set", f"confdir={work / 'conf'}",
                "--set", f"contextpaw_state_dir={work / 'state'}", "--set", "connection_strategy=lazy",
                "--set", "tcp_timeout=600", "--set", "contextpaw_calibrate=false"]  # fmt: skip
        for option in options:
            argv += ["--set", option]
        proxy = exits.enter_context(start_process(argv, f"http://127.0.0.1:{port}", "/contextpaw/health", work / "mitmdump.log", 60))
        front = exits.enter_context(running(recorder_app(proxy.url, front_log)))
    except BaseException:
        exits.close()
        raise
    return Stack(backend, proxy, front, front_log, back_log), exits


def contextpaw_headers(entry: Mapping[str, Any]) -> dict[str, str]:
    """The ``X-ContextPaw-*`` headers of a recorded response (lower-case names)."""
    headers = (entry.get("response") or {}).get("headers") or {}
    return {k: v for k, v in headers.items() if k.startswith("x-contextpaw-")}


def describe(entry: Mapping[str, Any]) -> str:
    """One recorded exchange in a line or two, for assertion messages."""
    response = entry.get("response") or {}
    body = (response.get("body") or "").strip().replace("\n", " ")
    return (
        f"{entry['method']} {entry['path']} ({entry['body_bytes']} bytes) -> {response.get('status')} "
        f"{contextpaw_headers(entry)} {body[:400] if response.get('status') != 200 else ''}"
    ).strip()


def body_changes(sent: Mapping[str, Any], forwarded: Mapping[str, Any]) -> dict[str, str]:
    """The top-level fields of two request bodies that differ, each as ``sent -> forwarded`` (short)."""
    a, b = sent.get("body") or {}, forwarded.get("body") or {}
    if not isinstance(a, dict) or not isinstance(b, dict):
        return {"<body>": "not JSON objects"}
    short = lambda v: json.dumps(v)[:120]  # noqa: E731
    return {k: f"{short(a.get(k))} -> {short(b.get(k))}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def request_shape(entry: Mapping[str, Any]) -> dict[str, Any]:
    """What a client's request looks like, without the values that change from run to run (ids,
    paths, dates): route, header names, body fields, tool names, roles, the output limit."""
    body = entry.get("body") if isinstance(entry.get("body"), dict) else {}
    tools = body.get("tools") or []
    names = [t.get("name") or (t.get("function") or {}).get("name") for t in tools if isinstance(t, dict)]
    messages = body.get("messages") or []
    return {
        "method": entry["method"],
        "path": entry["path"],
        "headers": sorted(entry.get("headers") or {}),
        "body_fields": sorted(body),
        "tools": names,
        "roles": [m.get("role") for m in messages if isinstance(m, dict)],
        "content_kinds": [type(m.get("content")).__name__ for m in messages if isinstance(m, dict)],
        "max_tokens": body.get("max_tokens"),
        "stream": body.get("stream"),
        "options": sorted(body.get("options") or {}),
    }


def check_recorded(entry: Mapping[str, Any], fixture: Path, client: str) -> str | None:
    """Compare a client's request with the one recorded in ``fixture``: None when its shape is the
    same, else what changed. The fixture is written when missing or when $CONTEXTPAW_RECORD_AGENTS=1."""
    shape = request_shape(entry)
    if os.environ.get(RECORD_ENV) == "1" or not fixture.exists():
        fixture.parent.mkdir(parents=True, exist_ok=True)
        recorded = {k: entry[k] for k in ("method", "path", "headers", "body")}
        fixture.write_text(json.dumps({"client": client, "shape": shape, "request": recorded}, indent=1) + "\n")
        return None
    before = json.loads(fixture.read_text())["shape"]
    changed = {k: (before.get(k), shape.get(k)) for k in sorted(set(before) | set(shape)) if before.get(k) != shape.get(k)}
    if not changed:
        return None
    lines = [f"  {k}: recorded {v[0]!r}, now {v[1]!r}" for k, v in changed.items()]
    return (
        f"{client} sent a request unlike the one recorded in {fixture.name}:\n"
        + "\n".join(lines)
        + f"\n(if the client changed on purpose, record it again with {RECORD_ENV}=1)"
    )
