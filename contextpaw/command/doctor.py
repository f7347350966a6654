"""`contextpaw doctor`: what a newcomer's set-up gets wrong, and how to fix it.

The checks are pure: each takes readings (what a server said, what the command line says) and
returns findings, each with the fix. The readings are taken at the end of this module, by a thin
layer over ContextPaw's own probing (`Session`, `windows.BackendWindows`, `TokenizerCounter`), so
the doctor sees a backend as the proxy sees it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from contextpaw import wire
from contextpaw.command import launch
from contextpaw.ops.admin import loopback_address

Level = Literal["ok", "note", "problem"]

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


def render(findings: Sequence[Finding]) -> str:
    """One line per finding, its fix indented under it; plain ASCII, for any terminal."""
    marks = {"ok": "ok     ", "note": "note   ", "problem": "PROBLEM"}
    lines = []
    for f in findings:
        lines.append(f"{marks[f.level]} {f.subject}: {f.what}")
        if f.fix:
            lines.append(f"        fix: {f.fix}")
    problems = sum(f.level == "problem" for f in findings)
    lines.append(f"{problems} problem{'s' * (problems != 1)} found" if problems else "no problems found")
    return "\n".join(lines)


# --- the checks ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """Whether a backend answered, and what it is."""

    kind: wire.Kind | None
    url: str
    answers: bool
    plain_http: bool = False
    """An https URL whose server answers plain HTTP instead."""


def check_answer(a: Answer) -> list[Finding]:
    if a.answers:
        return [Finding("ok", a.url, f"answers ({a.kind or 'kind unknown'})")]
    if a.plain_http:
        plain = "http://" + a.url.removeprefix("https://")
        return [Finding("problem", a.url, "the server speaks plain HTTP, not TLS",
                        f"write {plain} (mitmproxy would send it TLS, and every request would get a 502)")]  # fmt: skip
    flag = f"--{a.kind}" if a.kind else "--mode reverse:"
    return [Finding("problem", a.url, "does not answer",
                    f"start the server, or point {flag} at where it listens (ContextPaw answers 502 meanwhile)")]  # fmt: skip


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


def check_ollama_window(m: OllamaModel) -> list[Finding]:
    subject = f"{m.url} model {m.name}"
    if m.window is None:
        return [Finding("note", subject, "its window for /v1 requests could not be learned (the model did not load in time)",
                        "run the doctor again with a longer --timeout, or check `ollama ps`")]  # fmt: skip
    of = f" of the {m.trained:,} it was trained on" if m.trained else ""
    if not m.trained or m.window * FAR_BELOW > m.trained or m.window >= SUGGESTED_WINDOW:
        return [Finding("ok", subject, f"requests without num_ctx (all of /v1) get {m.window:,} tokens{of}")]
    want = min(m.trained, SUGGESTED_WINDOW)
    what = f"requests without num_ctx (all of /v1, so every OpenAI client) get {m.window:,} tokens{of}"
    return [Finding("problem", subject, what, _ollama_raise(m, want))]


def _ollama_raise(m: OllamaModel, want: int) -> str:
    """How to give the model a window of `want` on every request: the Modelfile where it sets the
    window, else Ollama's default for every model."""
    copy = (f"a Modelfile with `FROM {m.name}` and `PARAMETER num_ctx {want}`, "
            f"then `ollama create {m.name.split(':')[0]}-{want // 1024}k -f Modelfile`")  # fmt: skip
    if m.modelfile_ctx is not None:
        return f"its Modelfile sets num_ctx {m.modelfile_ctx}, which OLLAMA_CONTEXT_LENGTH does not override: make {copy}"
    return (f"start Ollama with OLLAMA_CONTEXT_LENGTH={want} (every model's default), or give this model its own: "
            f"{copy}; then tell ContextPaw with --set contextpaw_ollama_context_length={want}")  # fmt: skip


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
        return [Finding("problem", subject, "reports no window in /props (router mode, or no model loaded)",
                        "start it with -m MODEL, or run one llama-server per model")]  # fmt: skip
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
    if not target or per + SLOT_PADDING > target:
        return [*findings, Finding("ok", subject, shape + (", as -c asks" if asked else ""))]
    split = slots > 1 and per * slots + SLOT_PADDING * slots > target
    level: Level = "problem" if asked else "note"
    asked_text = f"the -c {asked:,} asked" if asked else f"the model's trained {target:,} (what -c 0, the default, asks)"
    if split:
        what = f"{shape}: -np {slots} divides {asked_text} among the slots"
        fix = (f"for {target:,} per request: -c {target * slots} -np {slots}, or -np 1 (one request at a time), "
               f"or --kv-unified (the slots share one pool of {target:,})")  # fmt: skip
    else:
        what = f"{shape}, below {asked_text}: --fit lowered the context to fit the device's memory"
        fix = ("free memory (fewer layers on the GPU with -ngl, other models unloaded), quantize the KV cache "
               f"(-ctk q8_0 -ctv q8_0), or ask for what fits (-c {per * slots}); --fit off fails instead of shrinking")  # fmt: skip
    if not asked:
        fix += "; if you gave llama-server -c, tell the doctor with --ctx N"
    return [*findings, Finding(level, subject, what, fix)]


def agents_short_of(window: int) -> dict[str, int]:
    """The agents `contextpaw launch` knows whose fixed part (tools, instructions, environment) and
    an answer's room do not fit in `window`, each with the least window from there on that holds
    them (as `launch` decides: its numbers, its room for an answer)."""
    return {agent: need for agent in launch.FIXED_TOKENS if (need := launch.least_window(agent, window)) > window}


def check_agents(subject: str, window: int | None, trained: int | None, raise_to: Callable[[int], str]) -> list[Finding]:
    """Which agents cannot start at the served `window`: ContextPaw would refuse each of their
    requests, since what an agent sends before any conversation is never cut. `raise_to(n)` is
    how to serve this model at `n`; beyond `trained`, only another model helps."""
    if not window:
        return []
    short = agents_short_of(window)
    if not short:
        most = max(launch.FIXED_TOKENS, key=launch.FIXED_TOKENS.__getitem__)
        return [Finding("ok", subject, f"{window:,} tokens hold the tools and instructions of every agent `contextpaw launch` "
                                       f"starts, and an answer ({most}, the largest, needs {launch.least_window(most, 0):,})")]  # fmt: skip
    what = (f"{window:,} tokens are too few for {_names([f'{a} ({n:,})' for a, n in short.items()])}: the tools and "
            "instructions each sends, with room for an answer, need that window, so ContextPaw would refuse their every request")  # fmt: skip
    reachable = {agent: need for agent, need in short.items() if not trained or need <= trained}
    beyond = [agent for agent in short if agent not in reachable]
    fixes = []
    if reachable:
        want = max(reachable.values())
        fixes.append(f"for {'all of them' if not beyond else _names(list(reachable))}, a window of {want:,}: {raise_to(want)}")
    if beyond:
        fixes.append(f"{_names(beyond)} need{'s' * (len(beyond) == 1)} more than the {trained:,} tokens the model was "
                     "trained on: a model trained on a longer context")  # fmt: skip
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
    fix = ("point --tokenizer at the model's own tokenizer.json or GGUF file, or leave it unset "
           "(llama-server counts with its own, and Ollama's GGUF is read where it lies)")  # fmt: skip
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
            findings.append(Finding(
                "problem", f"listener {spec}", f"listens on {host or 'every interface'}: other machines can use your models through it",
                "listen on the loopback (--host 127.0.0.1, or @127.0.0.1 in --mode); if others must reach it, "
                "firewall it and set contextpaw_admin_token",
            ))  # fmt: skip
    return findings


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


async def answers_of(backends: Sequence[tuple[wire.Kind | None, str]]) -> list[Answer]:
    """Whether each backend answers, and its kind (asked as the proxy asks a reverse-mode target)."""
    from contextpaw.calls.session import Session

    session = Session()
    try:
        return list(await asyncio.gather(*(_answer(session, kind, url) for kind, url in backends)))
    finally:
        await session.get().close()


async def _answer(session: Any, kind: wire.Kind | None, url: str) -> Answer:
    root, props = await asyncio.gather(session.text(url + "/"), session.text(url + "/props"))
    if root is None:
        plain = url.startswith("https://") and await session.text("http://" + url.removeprefix("https://") + "/")
        return Answer(kind, url, False, plain_http=bool(plain))
    found = wire.identify(root[1] if root[0] == 200 else None, props and props[0])
    return Answer(kind or found, url, True)


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
            backend = wire.Backend.parse(a.kind, a.url) if a.kind else None
            if backend and backend.kind == wire.Kind.OLLAMA:
                for model in await read_ollama(fetch, windows, backend, setup.models):
                    findings += check_ollama_window(model) + check_ollama_agents(model)
                    vocabularies.append((f"{model.name} at {a.url}", model.vocab))
                if not vocabularies:
                    findings.append(Finding("note", a.url, "has no model to check", "ollama pull MODEL, or name one with --model"))
            elif backend:
                server = await read_llamacpp(fetch, backend)
                findings += check_llamacpp_window(server, setup.asked_ctx) + check_llamacpp_agents(server)
                vocabularies.append((f"the model at {a.url}", server.vocab))
    finally:
        await session.get().close()
    if setup.tokenizer:
        findings += check_tokenizer(await asyncio.to_thread(read_tokenizer, setup.tokenizer), vocabularies)
    return findings + check_listeners(setup.listeners)


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
    found = []
    for name in names:
        show = await windows.show(backend, name)
        window = await windows.window(backend, name)
        info = (await fetch("POST", backend.url + "/api/show", {"model": name}) or {}).get("model_info") or {}
        arch = info.get("general.architecture")
        tokens = info.get("tokenizer.ggml.tokens")
        vocab = wire.positive(wire.int_field(info, f"{arch}.vocab_size")) or (len(tokens) if isinstance(tokens, list) and tokens else None)
        found.append(OllamaModel(backend.url, name, window, show and show.trained, show and show.num_ctx, vocab))
    return found


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
        backend.url, llamacpp_window(props), _count(props, "total_slots") or len(windows) or 1,
        _count(meta, "n_ctx_train"), _count(meta, "n_vocab"), windows,
    )  # fmt: skip


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
