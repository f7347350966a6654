"""`contextpaw doctor`: what a newcomer's set-up gets wrong, and how to fix it.

The checks are pure: each takes readings (what a server said, what the command line says) and
returns findings, each with the fix. The readings are taken at the end of this module, by a thin
layer over ContextPaw's own probing (`Session`, `windows.BackendWindows`, `TokenizerCounter`), so
the doctor sees a backend as the proxy sees it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from contextpaw import wire
from contextpaw.command import launch
from contextpaw.ops.admin import loopback_address

Level = Literal["ok", "note", "problem", "unchecked"]
"""`unchecked`: what the doctor could not learn (exit status 3 when nothing is a problem)."""
SMALL_SLOT = 4096
"""A per-request window below this is a problem whatever -c asked: no agent works in it."""
EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_UNCHECKED = 0, 1, 2, 3

FAR_BELOW = 4
"""A window this many times smaller than the trained length is worth fixing (4096 of 131072 is 32)."""
SUGGESTED_WINDOW = 32768
"""The window a fix suggests when the model was trained on more (memory grows with the window); a
window this large is not worth a finding."""
SLOT_PADDING = 256
"""llama-server rounds each slot's window up to a multiple of this."""
VOCAB_TOLERANCE = 0.02
"""A tokenizer file's vocabulary may differ from the model's by this fraction (GGUF pads its
vocabulary: Qwen2.5's 151,665 tokens are 151,936 there)."""


@dataclass(frozen=True, slots=True)
class Finding:
    level: Level
    subject: str
    what: str
    fix: str = ""
    facts: Mapping[str, Any] = field(default_factory=dict)
    """What a script reads in `--json` instead of the sentence: the window, the kind, the model."""


def render(findings: Sequence[Finding]) -> str:
    """One line per finding, its fix indented under it; plain ASCII, for any terminal."""
    marks = {"ok": "ok     ", "note": "note   ", "problem": "PROBLEM", "unchecked": "UNCHECKED"}
    lines = []
    for f in findings:
        lines.append(f"{marks[f.level]} {f.subject}: {f.what}")
        if f.fix:
            lines.append(f"        fix: {f.fix}")
    problems = sum(f.level == "problem" for f in findings)
    unchecked = sum(f.level == "unchecked" for f in findings)
    if problems:
        lines.append(f"{problems} problem{'s' * (problems != 1)} found")
    elif unchecked:
        lines.append(f"no problems found, but {unchecked} thing{'s' * (unchecked != 1)} could not be checked")
    else:
        lines.append("no problems found")
    return "\n".join(lines)


def exit_status(findings: Sequence[Finding]) -> int:
    """0 no problems, 1 problems found, 3 something could not be checked (and nothing is a problem)."""
    if any(f.level == "problem" for f in findings):
        return EXIT_PROBLEMS
    return EXIT_UNCHECKED if any(f.level == "unchecked" for f in findings) else EXIT_OK


def as_json(findings: Sequence[Finding]) -> str:
    return json.dumps({"status": exit_status(findings), "findings": [asdict(f) for f in findings]}, indent=2)


# --- the checks ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """Whether a backend answered, and what it is."""

    kind: wire.Kind | None
    url: str
    answers: bool
    plain_http: bool = False
    """An https URL whose server answers plain HTTP instead."""
    found: wire.Kind | None = None
    """What the server says it is, where that differs from the kind the command line gave it."""


def check_answer(a: Answer) -> list[Finding]:
    if a.answers and a.found and a.kind and a.found != a.kind:
        name = {wire.Kind.OLLAMA: "an Ollama", wire.Kind.LLAMACPP: "a llama-server"}[a.found]
        return [
            Finding(
                "problem",
                a.url,
                f"--{a.kind} points at {name}: ContextPaw would read its window the wrong way and fall back to a default one",
                f"give it as --{a.found} {a.url}",
            )
        ]
    if a.answers:
        return [Finding("ok", a.url, f"answers ({a.kind or 'kind unknown'})", facts={"answers": True, "kind": a.kind})]
    if a.plain_http:
        plain = "http://" + a.url.removeprefix("https://")
        return [
            Finding(
                "problem",
                a.url,
                "the server speaks plain HTTP, not TLS",
                f"write {plain} (mitmproxy would send it TLS, and every request would get a 502)",
            )
        ]
    flag = f"--{a.kind}" if a.kind else "--mode reverse:"
    return [
        Finding(
            "problem",
            a.url,
            "does not answer",
            f"start the server, or point {flag} at where it listens (ContextPaw answers 502 meanwhile)",
            {"answers": False, "kind": a.kind},
        )
    ]


@dataclass(frozen=True, slots=True)
class OllamaModel:
    """What Ollama says of one model."""

    url: str
    name: str
    window: int | None
    """What a request without `num_ctx` (every `/v1` request) gets."""
    trained: int | None
    modelfile_ctx: int | None
    vocab: int | None = None
    available: tuple[str, ...] | None = None
    """The models Ollama has, where it has none of this name (None: it has it)."""


def check_ollama_window(m: OllamaModel) -> list[Finding]:
    subject = f"{m.url} model {m.name}"
    if m.available is not None:
        have = f"it has {', '.join(m.available)}" if m.available else "it has no models"
        return [Finding("problem", subject, f"no such model ({have})", f"ollama pull {m.name}, or name one it has with --model")]
    facts = {"kind": "ollama", "model": m.name, "window": m.window, "trained": m.trained, "modelfile_num_ctx": m.modelfile_ctx}
    if m.window is None:
        return [
            Finding(
                "unchecked",
                subject,
                "its window for /v1 requests could not be learned (the model did not load in time)",
                "run the doctor again with a longer --timeout, or check `ollama ps`",
                facts,
            )
        ]
    of = f" of the {m.trained:,} it was trained on" if m.trained else ""
    if not m.trained or m.window * FAR_BELOW > m.trained or m.window >= SUGGESTED_WINDOW:
        return [Finding("ok", subject, f"requests without num_ctx (all of /v1) get {m.window:,} tokens{of}", facts=facts)]
    want = min(m.trained, SUGGESTED_WINDOW)
    what = f"requests without num_ctx (all of /v1, so every OpenAI client) get {m.window:,} tokens{of}"
    return [Finding("problem", subject, what, _ollama_raise(m, want), facts)]


def _ollama_raise(m: OllamaModel, want: int) -> str:
    """How to give the model a window of `want` on every request: the Modelfile where it sets the
    window, else Ollama's default for every model."""
    copy = (
        f"a Modelfile with `FROM {m.name}` and `PARAMETER num_ctx {want}`, "
        f"then `ollama create {m.name.split(':')[0]}-{want // 1024}k -f Modelfile`"
    )
    if m.modelfile_ctx is not None:
        return f"its Modelfile sets num_ctx {m.modelfile_ctx}, which OLLAMA_CONTEXT_LENGTH does not override: make {copy}"
    return (
        f"start Ollama with OLLAMA_CONTEXT_LENGTH={want} (every model's default), or give this model its own: "
        f"{copy}; then tell ContextPaw with --set contextpaw_ollama_context_length={want}"
    )


@dataclass(frozen=True, slots=True)
class LlamaServer:
    """What llama-server says of its window (`/props`, `/slots`, `/v1/models`)."""

    url: str
    slot_ctx: int | None
    slots: int
    trained: int | None
    vocab: int | None = None
    slot_windows: tuple[int, ...] = ()
    """Each slot's window from `/slots` (empty where it is disabled)."""


def check_llamacpp_window(s: LlamaServer, asked: int | None) -> list[Finding]:
    """The per-slot window against what was asked with `-c` (`asked`; None: the trained length, as
    `-c 0` asks): split among `-np` slots, or lowered by `--fit` to fit the device's memory."""
    subject = f"{s.url} (llama-server)"
    if not s.slot_ctx:
        return [
            Finding(
                "problem",
                subject,
                "reports no window in /props (router mode, or no model loaded)",
                "start it with -m MODEL, or run one llama-server per model",
            )
        ]
    slots = max(s.slots, len(s.slot_windows), 1)
    uneven = [w for w in s.slot_windows if w != s.slot_ctx]
    per = min([s.slot_ctx, *s.slot_windows])
    findings = [Finding("note", subject, f"/slots shows windows {sorted(set(s.slot_windows))}, /props {s.slot_ctx:,}")] if uneven else []
    target = asked or s.trained
    if asked and s.trained and asked > s.trained:
        findings.append(
            Finding("note", subject, f"-c {asked:,} is above the {s.trained:,} the model was trained on; llama-server caps each slot there")
        )
        target = s.trained
    shape = f"{per:,} tokens per request" + (f" ({slots} slots)" if slots > 1 else "")
    facts = {"kind": "llamacpp", "window": per, "slots": slots, "trained": s.trained, "asked": asked}
    small = per < SMALL_SLOT and not asked and (not s.trained or s.trained > per + SLOT_PADDING)
    """A small window llama-server could widen (the model was trained on more, or does not say)."""
    if not small and (not target or per + SLOT_PADDING > target):
        return [*findings, Finding("ok", subject, shape + (", as -c asks" if asked else ""), facts=facts)]
    if not target or per + SLOT_PADDING > target:  # small, and the model says nothing larger
        target = SUGGESTED_WINDOW
    split = slots > 1 and (not asked or per * slots + SLOT_PADDING * slots > target)
    level: Level = "problem" if asked or small else "note"
    asked_text = f"the -c {asked:,} asked" if asked else "the context llama-server was given"
    if split:
        what = f"{shape}: -np {slots} divides {asked_text} among the slots"
        fix = (
            f"for {target:,} per request: -c {target * slots} -np {slots}, or -np 1 (one request at a time), "
            f"or --kv-unified (the slots share one pool of {target:,})"
        )
    else:
        what = f"{shape}, below {asked_text}: --fit lowered the context to fit the device's memory"
        fix = (
            "free memory (fewer layers on the GPU with -ngl, other models unloaded), quantize the KV cache "
            f"(-ctk q8_0 -ctv q8_0), or ask for what fits (-c {per * slots}); --fit off fails instead of shrinking"
        )
    if not asked:
        fix += "; if you gave llama-server -c, tell the doctor with --ctx N"
    return [*findings, Finding(level, subject, what, fix, facts)]


def agents_short_of(window: int) -> dict[str, int]:
    """The agents `contextpaw launch` knows that cannot live in `window` on their own compaction,
    each with the least window that they can (`launch.living_window`: what launch refuses by)."""
    return {agent: need for agent in launch.FIXED_TOKENS if (need := launch.living_window(agent, window)) > window}


def check_agents(subject: str, window: int | None, trained: int | None, raise_to: Callable[[int], str]) -> list[Finding]:
    """Which agents cannot live at the served `window` on their own compaction (`contextpaw launch`
    refuses to start them there): what an agent sends before any conversation is never cut, and
    its summary and the files it reads again after one need room too. `raise_to(n)` is how to serve
    this model at `n`; beyond `trained`, only another model helps."""
    if not window:
        return []
    short = agents_short_of(window)
    if not short:
        most = max(launch.FIXED_TOKENS, key=lambda agent: launch.living_window(agent, window))
        return [
            Finding(
                "ok",
                subject,
                f"{window:,} tokens are enough for every agent `contextpaw launch` starts to work on its "
                f"own compaction ({most}, the most demanding, needs {launch.living_window(most, 0):,})",
            )
        ]
    what = (
        f"{window:,} tokens are too few for {_names([f'{a} ({n:,})' for a, n in short.items()])} to keep working on "
        "their own compaction (their tools and instructions, their summary, the files they read again and an answer "
        "need that window): `contextpaw launch` refuses to start them there"
    )
    reachable = {agent: need for agent, need in short.items() if not trained or need <= trained}
    beyond = [agent for agent in short if agent not in reachable]
    fixes = []
    if reachable:
        want = max(reachable.values())
        fixes.append(f"for {'all of them' if not beyond else _names(list(reachable))}, a window of {want:,}: {raise_to(want)}")
    if beyond:
        fixes.append(
            f"{_names(beyond)} need{'s' * (len(beyond) == 1)} more than the {trained:,} tokens the model was "
            "trained on: a model trained on a longer context"
        )
    return [Finding("note", subject, what, "; ".join(fixes))]


def _names(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def check_ollama_agents(m: OllamaModel) -> list[Finding]:
    """`check_agents` at the window a request without `num_ctx` gets (what launch asks for too)."""
    return check_agents(f"{m.url} model {m.name}", m.window, m.trained, functools.partial(_ollama_raise, m))


def check_llamacpp_agents(s: LlamaServer) -> list[Finding]:
    """`check_agents` at the window of one request (the smallest slot's)."""
    slots = max(s.slots, len(s.slot_windows), 1)

    def raise_to(n: int) -> str:
        if slots == 1:
            return f"start llama-server with -c {n}"
        return f"start llama-server with -c {n * slots} -np {slots}, or -c {n} -np 1, or -c {n} --kv-unified"

    window = min([s.slot_ctx, *s.slot_windows]) if s.slot_ctx else None
    return check_agents(f"{s.url} (llama-server)", window, s.trained, raise_to)


@dataclass(frozen=True, slots=True)
class TokenizerFile:
    path: str
    vocab: int | None
    error: str = ""


def check_tokenizer(t: TokenizerFile, models: Sequence[tuple[str, int | None]]) -> list[Finding]:
    """`contextpaw_tokenizer` against each model's vocabulary size, (name, size or None) each."""
    subject = f"contextpaw_tokenizer {t.path}"
    fix = (
        "point --tokenizer at the model's own tokenizer.json or GGUF file, or leave it unset "
        "(llama-server counts with its own, and Ollama's GGUF is read where it lies)"
    )
    if t.vocab is None:
        return [Finding("problem", subject, f"cannot be used: {t.error}; ContextPaw counts with an estimate instead", fix)]
    findings = []
    for name, vocab in models:
        if vocab is None:
            findings.append(Finding("note", subject, f"{t.vocab:,} tokens; {name} does not say how many it has"))
        elif abs(vocab - t.vocab) > VOCAB_TOLERANCE * vocab:
            what = f"has {t.vocab:,} tokens, {name} has {vocab:,}: it is another model's, and every count is wrong"
            findings.append(Finding("problem", subject, what, fix))
        else:
            findings.append(Finding("ok", subject, f"{t.vocab:,} tokens, as {name} ({vocab:,})"))
    return findings


def check_listeners(listeners: Sequence[tuple[str, str]]) -> list[Finding]:
    """Each (mode, listen host): beyond the loopback, other machines reach the models (and the
    prompts in /contextpaw/evicted) through the proxy."""
    findings = []
    for spec, host in listeners:
        if loopback_address(host) or host == "localhost":
            findings.append(Finding("ok", f"listener {spec}", f"on the loopback ({host})"))
        else:
            findings.append(
                Finding(
                    "problem",
                    f"listener {spec}",
                    f"listens on {host or 'every interface'}: other machines can use your models through it",
                    "listen on the loopback (--host 127.0.0.1, or @127.0.0.1 in --mode); if others must reach it, "
                    "firewall it and set contextpaw_admin_token",
                )
            )
    return findings


def _place(url: str, default_port: int = 80) -> tuple[str, int] | None:
    """host:port of a URL (a bare "host:port", as OLLAMA_HOST, too); every loopback name is one host."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url if "://" in url else "http://" + url)
        host, port = (parts.hostname or "").lower(), parts.port
    except ValueError:
        return None
    if not host:
        return None
    if host in ("localhost", "::1", "0.0.0.0", "::") or host.startswith("127."):
        host = "loopback"
    return host, port or (443 if parts.scheme == "https" else default_port)


@dataclass(frozen=True, slots=True)
class ClientSetting:
    """Where a client is told to send its requests: an environment variable or Codex's config."""

    name: str
    url: str
    answers: bool = True


CLIENT_VARIABLES = ("ANTHROPIC_BASE_URL", "OPENAI_BASE_URL", "OLLAMA_HOST", "OLLAMA_API_BASE")
"""The clients' own settings of where the model is: Claude Code's, the OpenAI SDK's (Codex, Qwen Code,
aider on llama-server), Ollama's CLI and library's, aider's on Ollama."""
OLLAMA_SIDE = ("OLLAMA_HOST", "OLLAMA_API_BASE")
"""Settings only an Ollama-speaking client reads: their fix names the listener that fronts Ollama."""


def client_settings(env: Mapping[str, str], home: Path) -> list[ClientSetting]:
    """`CLIENT_VARIABLES` where set, and Codex's `base_url` lines in its config.toml (under
    `$CODEX_HOME`, else ~/.codex; read as text: any table that sets one)."""
    found = [ClientSetting(name, env[name]) for name in CLIENT_VARIABLES if env.get(name)]
    codex = Path(env["CODEX_HOME"]).expanduser() if env.get("CODEX_HOME") else home / ".codex"
    try:
        text = (codex / "config.toml").read_text(errors="replace")
    except OSError:
        text = ""
    shown = "$CODEX_HOME/config.toml" if env.get("CODEX_HOME") else "~/.codex/config.toml"
    for match in re.finditer(r"""^\s*base_url\s*=\s*["']([^"']+)["']""", text, re.MULTILINE):
        found.append(ClientSetting(f"{shown} base_url", match.group(1)))
    return found


def check_clients(
    settings: Sequence[ClientSetting],
    proxies: Sequence[str],
    backends: Sequence[str],
    fronts: Mapping[str, str] | None = None,
    ollama_side: str | None = None,
) -> list[Finding]:
    """Each client setting against ContextPaw's listeners (`proxies`) and the backends: one that
    points straight at a backend goes past ContextPaw, and is told the listener that fronts that
    backend (`fronts`: backend URL -> listener URL); one where nothing answers reaches nothing, and
    is told the listener that fronts Ollama (`ollama_side`) where only an Ollama client reads it."""
    fronts = fronts or {}
    mine = {p for url in proxies if (p := _place(url))}
    theirs = {p: url for url in backends if (p := _place(url))}
    first = proxies[0] if proxies else "http://127.0.0.1:PORT"
    findings = []
    for c in settings:
        place = _place(c.url, 11434 if c.name in OLLAMA_SIDE else 80)
        to = fronts.get(theirs[place], first) if place in theirs else (ollama_side or first) if c.name in OLLAMA_SIDE else first
        want = {"OLLAMA_HOST": to.removeprefix("http://"), "OPENAI_BASE_URL": to + "/v1"}.get(c.name, to)
        subject = f"{c.name}={c.url}"
        if place in mine:
            findings.append(Finding("ok", subject, "points at ContextPaw"))
        elif place in theirs:
            what = "points past ContextPaw, straight at the backend: its requests are never fitted"
            fix = f"{c.name}={want}" if not c.name.endswith("base_url") else f'base_url = "{to}/v1" in {c.name.removesuffix(" base_url")}'
            if c.name == "OLLAMA_HOST":
                fix += " for clients (the shell that runs `ollama serve` keeps the backend's address)"
            findings.append(Finding("problem" if c.name != "OLLAMA_HOST" else "note", subject, what, fix))
        elif not c.answers:
            findings.append(Finding("problem", subject, "points at nothing: no server answers there", f"{c.name}={want}"))
        else:
            findings.append(Finding("note", subject, "points at a server that is neither ContextPaw nor a backend named here"))
    return findings


def check_own_address(backends: Sequence[str], proxies: Sequence[str]) -> list[Finding]:
    """A backend at one of ContextPaw's own listen addresses: every request would go round to
    ContextPaw itself (the proxy refuses to start so)."""
    mine = {p: url for url in proxies if (p := _place(url))}
    return [
        Finding(
            "problem",
            url,
            f"is ContextPaw's own listen address ({mine[place]}): every request would be sent back to ContextPaw itself",
            "move the backend to another port (Ollama: OLLAMA_HOST=127.0.0.1:11435 ollama serve) and point ContextPaw there, "
            "or give ContextPaw another --port",
        )
        for url in backends
        if (place := _place(url)) in mine
    ]


@dataclass(frozen=True, slots=True)
class Running:
    """What answers at one of ContextPaw's listen addresses: `status` of /contextpaw/health (None:
    nothing answers), and whether its body is ContextPaw's."""

    url: str
    status: int | None
    contextpaw: bool


def check_running(r: Running) -> list[Finding]:
    subject = f"ContextPaw at {r.url}"
    if r.status is None:
        return [Finding("note", subject, "does not answer (not started yet?)", "start it: contextpaw with these same arguments")]
    if not r.contextpaw:
        return [
            Finding(
                "problem",
                subject,
                f"something else answers there (/contextpaw/health: {r.status}), perhaps the backend itself",
                "move the backend off this port (Ollama: OLLAMA_HOST=127.0.0.1:11435), or give ContextPaw another --port",
            )
        ]
    return [Finding("ok", subject, f"answers (/contextpaw/health: {r.status})")]


# --- the readings ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    """What the command line says: the backends (kind where given, URL), the listeners (mode,
    host), the tokenizer file, the Ollama models to check, what llama-server was asked with -c."""

    backends: tuple[tuple[wire.Kind | None, str], ...]
    listeners: tuple[tuple[str, str], ...] = ()
    tokenizer: str = ""
    models: tuple[str, ...] = ()
    asked_ctx: int | None = None
    timeout: float = 60.0
    proxies: tuple[str, ...] = ()
    """ContextPaw's own listen URLs."""
    fronts: tuple[tuple[str, str], ...] = ()
    """(backend URL, the listen URL that fronts it), for each backend the command line names."""
    clients: tuple[ClientSetting, ...] = ()


async def answers_of(backends: Sequence[tuple[wire.Kind | None, str]]) -> list[Answer]:
    """Whether each backend answers, and its kind (asked as the proxy asks a reverse-mode target)."""
    from contextpaw.calls.session import Session

    session = Session()
    try:
        return list(await asyncio.gather(*(_answer(session, kind, url) for kind, url in backends)))
    finally:
        await session.get().close()


DEFAULT_BACKENDS: Mapping[wire.Kind, tuple[str, str]] = {
    wire.Kind.OLLAMA: ("http://127.0.0.1:11434", "Ollama's default port"),
    wire.Kind.LLAMACPP: ("http://127.0.0.1:8080", "llama-server's default port, long-standing and the pinned build's alike"),
}
"""Where each server listens when started without a port, for a command line that names none."""


async def found_at_defaults() -> list[str]:
    """Each server that answers, as its own kind, at its default address: what a command line that
    names no backend could front (said with the port it was found on)."""
    answers = await answers_of([(None, url) for url, _ in DEFAULT_BACKENDS.values()])
    found = []
    for kind, (url, port) in DEFAULT_BACKENDS.items():
        if any(a.answers and a.kind is kind and a.url == url for a in answers):
            found.append(f"--{kind} {url} ({'Ollama' if kind is wire.Kind.OLLAMA else 'llama-server'} answers there: {port})")
    return found


async def _answer(session: Any, kind: wire.Kind | None, url: str) -> Answer:
    root, props = await asyncio.gather(session.text(url + "/"), session.text(url + "/props"))
    if root is None:
        plain = url.startswith("https://") and await session.text("http://" + url.removeprefix("https://") + "/")
        return Answer(kind, url, False, plain_http=bool(plain))
    found = wire.identify(root[1] if root[0] == 200 else None, props and props[0])
    return Answer(kind or found, url, True, found=found if kind and found and found != kind else None)


async def diagnose(setup: Setup) -> list[Finding]:
    """Every check, on what the servers say now."""
    from contextpaw.calls.session import Session
    from contextpaw.fitting.windows import BackendWindows

    answers = await answers_of(setup.backends)
    findings = [f for a in answers for f in check_answer(a)]
    session = Session()
    try:
        fetch = functools.partial(session.fetch, timeout=setup.timeout)
        windows = BackendWindows(fetch)
        vocabularies: list[tuple[str, int | None]] = []
        for a in answers:
            if not a.answers:
                continue
            kind = a.found or a.kind
            backend = wire.Backend.parse(kind, a.url) if kind else None
            if backend and backend.kind == wire.Kind.OLLAMA:
                for model in await read_ollama(fetch, windows, backend, setup.models):
                    findings += check_ollama_window(model) + check_ollama_agents(model)
                    vocabularies.append((f"{model.name} at {a.url}", model.vocab))
                if not vocabularies and await fetch("GET", backend.url + "/api/tags", None) is None:
                    findings.append(
                        Finding(
                            "unchecked",
                            a.url,
                            f"did not list its models within {setup.timeout:g} s (/api/tags)",
                            "run the doctor again with a longer --timeout (a model may be loading)",
                        )
                    )
                elif not vocabularies:
                    findings.append(Finding("note", a.url, "has no model to check", "ollama pull MODEL, or name one with --model"))
            elif backend and (router := await read_router(fetch, backend)) is not None:
                findings += check_router(router)
            elif backend:
                server = await read_llamacpp(fetch, backend)
                findings += check_llamacpp_window(server, setup.asked_ctx) + check_llamacpp_agents(server)
                vocabularies.append((f"the model at {a.url}", server.vocab))
    finally:
        await session.get().close()
    if setup.tokenizer:
        findings += check_tokenizer(await asyncio.to_thread(read_tokenizer, setup.tokenizer), vocabularies)
    findings += check_listeners(setup.listeners) + check_own_address([url for _, url in setup.backends], setup.proxies)
    findings += [f for r in await asyncio.gather(*(_running(url) for url in setup.proxies)) for f in check_running(r)]
    clients = [ClientSetting(c.name, c.url, await _reaches(c)) for c in setup.clients]
    fronts = dict(setup.fronts)
    ollama = next((fronts[a.url] for a in answers if (a.found or a.kind) is wire.Kind.OLLAMA and a.url in fronts), None)
    return findings + check_clients(clients, setup.proxies, [url for _, url in setup.backends], fronts, ollama)


async def _running(url: str) -> Running:
    from contextpaw.calls.session import Session

    session = Session()
    try:
        got = await session.text(url + "/contextpaw/health")
    finally:
        await session.get().close()
    if got is None:
        return Running(url, None, False)
    try:
        body = json.loads(got[1])
    except (ValueError, TypeError):
        body = None
    return Running(url, got[0], isinstance(body, dict) and "backends" in body)


async def _reaches(c: ClientSetting) -> bool:
    place = _place(c.url, 11434 if c.name == "OLLAMA_HOST" else 80)
    if place is None:
        return False
    host = "127.0.0.1" if place[0] == "loopback" else place[0]
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, place[1]), 2)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def read_ollama(fetch: Any, windows: Any, backend: wire.Backend, models: Sequence[str]) -> list[OllamaModel]:
    """The named models, else the loaded ones, else the first one pulled: each loads on a
    `/v1`-like request if it must, to learn its window (`BackendWindows`, as the proxy learns it)."""
    names = list(models)
    if not names:
        for route in ("/api/ps", "/api/tags"):
            listed = await fetch("GET", backend.url + route, None)
            names = [str(m.get("name")) for m in (listed or {}).get("models", []) if isinstance(m, dict)]
            if names:
                names = names if route == "/api/ps" else names[:1]
                break
    tags = await fetch("GET", backend.url + "/api/tags", None)
    have = tuple(str(m.get("name")) for m in (tags or {}).get("models", []) if isinstance(m, dict))
    found = []
    for name in names:
        if tags is not None and name not in have and f"{name}:latest" not in have:
            found.append(OllamaModel(backend.url, name, None, None, None, available=have))
            continue
        show = await windows.show(backend, name)
        window = await windows.window(backend, name)
        info = (await fetch("POST", backend.url + "/api/show", {"model": name}) or {}).get("model_info") or {}
        arch = info.get("general.architecture")
        tokens = info.get("tokenizer.ggml.tokens")
        vocab = wire.positive(wire.int_field(info, f"{arch}.vocab_size")) or (len(tokens) if isinstance(tokens, list) and tokens else None)
        found.append(OllamaModel(backend.url, name, window, show and show.trained, show and show.num_ctx, vocab))
    return found


@dataclass(frozen=True, slots=True)
class RouterModel:
    name: str
    status: str
    """`loaded`, `loading` or `unloaded`, as the router lists it."""
    window: int | None
    """What a request gets: the loaded model's own, else what its command line will give it."""


@dataclass(frozen=True, slots=True)
class Router:
    """A llama-server in router mode (`--models-dir`, `--models-preset`): many models, one each in
    a child server with its own window; at most `max_loaded` at once."""

    url: str
    max_loaded: int | None
    models: tuple[RouterModel, ...]


async def read_router(fetch: Any, backend: wire.Backend) -> Router | None:
    """The router and each model's window, as ContextPaw learns them (`BackendWindows`: a loaded
    model's `/props`, else its listed command line; nothing is loaded to find out); None for a
    llama-server of one model."""
    from contextpaw.fitting.windows import BackendWindows, is_router

    props = await fetch("GET", backend.url + "/props", None)
    if not is_router(props):
        return None
    listing = await fetch("GET", backend.url + "/models", None)
    entries = [e for e in (listing or {}).get("data") or [] if isinstance(e, dict) and e.get("id")]
    windows = BackendWindows(fetch)
    models = []
    for entry in entries:
        status = entry.get("status")
        value = status.get("value") if isinstance(status, dict) else None
        window = await windows.window(backend, str(entry["id"]))
        models.append(RouterModel(str(entry["id"]), str(value or "unknown"), window))
    return Router(backend.url, _count(props, "max_instances"), tuple(models))


def check_router(r: Router) -> list[Finding]:
    """Router mode is a llama-server ContextPaw fronts per model: each model's window, which are
    loaded, how many may be; and, per model, the agents that cannot live in its window."""
    subject = f"{r.url} (llama-server, router mode)"
    if not r.models:
        return [Finding("problem", subject, "lists no model (/models)", "give it --models-dir DIR or --models-preset FILE.ini")]
    shown = ", ".join(f"{m.name} {m.window:,} ({m.status})" if m.window else f"{m.name} ? ({m.status})" for m in r.models)
    most = f"; at most {r.max_loaded} loaded at once (--models-max)" if r.max_loaded else ""
    facts = {
        "kind": "llamacpp",
        "router": True,
        "max_loaded": r.max_loaded,
        "models": [{"model": m.name, "status": m.status, "window": m.window} for m in r.models],
    }
    findings = [Finding("ok", subject, f"{len(r.models)} model(s), each fitted to its own window: {shown}{most}", facts=facts)]
    for m in r.models:
        if m.window is None:
            findings.append(
                Finding(
                    "note",
                    f"{subject} model {m.name}",
                    "names no ctx-size: its window is known once it is loaded "
                    "(the model's own length, until then ContextPaw fits to contextpaw_default_ctx)",
                    f"set ctx-size in its [{m.name}] preset, or load it first",
                )
            )
            continue

        def raise_to(n: int, name: str = m.name) -> str:
            return f"set ctx-size = {n} (and parallel = 1) in its [{name}] preset, then restart the router"

        findings += [f for f in check_agents(f"{subject} model {m.name}", m.window, None, raise_to) if f.level != "ok"]
    return findings


async def read_llamacpp(fetch: Any, backend: wire.Backend) -> LlamaServer:
    from contextpaw.fitting.windows import llamacpp_window

    props, models, slots = await asyncio.gather(
        fetch("GET", backend.url + "/props", None),
        fetch("GET", backend.url + "/v1/models", None),
        fetch("GET", backend.url + "/slots", None),
    )
    data = (models or {}).get("data") if isinstance(models, dict) else None
    meta = data[0].get("meta", {}) if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    windows = tuple(w for s in slots if (w := _count(s, "n_ctx"))) if isinstance(slots, list) else ()
    return LlamaServer(
        backend.url,
        llamacpp_window(props),
        _count(props, "total_slots") or len(windows) or 1,
        _count(meta, "n_ctx_train"),
        _count(meta, "n_vocab"),
        windows,
    )


def _count(container: Any, name: str) -> int | None:
    return wire.positive(wire.int_field(container, name))


def read_tokenizer(path: str) -> TokenizerFile:
    """The file's vocabulary size, read as ContextPaw reads it to count."""
    from contextpaw.core.tokens import TokenizerCounter

    try:
        counter = TokenizerCounter.from_file(path)
    except Exception as e:  # any file ContextPaw cannot count with is the finding
        return TokenizerFile(path, None, f"{type(e).__name__}: {e}")
    return TokenizerFile(path, counter.tokenizer.get_vocab_size())
