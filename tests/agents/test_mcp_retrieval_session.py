"""A real agent gets back what ContextPaw evicted through `contextpaw mcp`, in a scripted session.

Each session: the scripted model (tests/support/scripted_model.py) as llama-server with a window of
``WINDOW`` and ``--retrieve``, ContextPaw in front of it with a recorder on each side, and the agent
started by ``contextpaw launch AGENT --url ... --window TOLD -- <its headless arguments>`` in a
scratch HOME: told a window far larger than the one served, the agent does not compact its own
history, so the task's files (about 2,500 tokens each) outgrow the window and ContextPaw cuts, leaving
markers that name a reference. The model calls the agent's ``contextpaw_retrieve`` with each
marker's reference, once, between two reads; the agent runs the tool (the `contextpaw mcp` that
launch registered, which reads the proxy's archive) and sends its result back, which the model's
log records. Two sessions run one after the other through the same proxy (one secret).

The agent runs the tool on launch's grant alone (Claude Code's `--allowedTools`, Codex's
`approval_mode`, opencode's `permission`, Qwen Code's `permissions.allow`; none of them asks a
person without a terminal, each refuses instead); the second session adds the user's own grants and
rules beside it.

The state directory launch is given is not the proxy's: the MCP server has no token, so only a
reference with its capability, as the marker shows it, reads anything.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from test_launch_compaction import make_files, task

from contextpaw.core import parts, refs
from support import agents as cli
from support.backends import start_module
from support.recorder import read_log
from support.scripted_model import PARSERS, retrieved

WINDOW, FILES, TOLD = 32768, 14, 262144
"""The served window, the files a session reads, and the window the agent is told (so that its own
compaction never fires before ContextPaw's cut)."""
USERS_OWN_ARGS = {"claude": ["--allowedTools", "Read"]}
"""A grant of the user's own, passed to the second session after launch's: `claude -p` refuses an
MCP tool it was not allowed ("Claude requested permissions to use
mcp__contextpaw__contextpaw_retrieve, but you haven't granted it yet."), and launch's own
`--allowedTools` must survive the user's (Claude Code adds up the values of a flag given twice)."""
USERS_OWN_OPENCODE = {"permission": {"contextpaw_*": "ask", "bash": "ask"}}
"""The second session's user config for opencode (~/.config/opencode/opencode.json): its rules ask
for every contextpaw tool, which `opencode run` rejects ("permission requested:
contextpaw_contextpaw_retrieve (*); auto-rejecting", and the session ends); launch's grant, in the
config it merges over the user's, must win for its two tools."""
CODEX_HEADER = re.compile(r"\AWall time: [0-9.]+ seconds\nOutput:")
"""What Codex puts before every tool result it sends the model (an MCP tool's too)."""
CODEX_EXEC = re.compile(r"\AChunk ID: \w+\n(?:[^\n]*\n)*?Output:\n")
"""What Codex's `exec_command` puts before a command's output (its chunk, time, exit code, size)."""
NUMBERED = re.compile(r"^ *\d+(?:\t|\u2192|\| |: )", re.MULTILINE)
"""The line numbers an agent's read tool puts before each line of a file (Claude Code's `   12\\t` or
`   12→`, opencode's `12: `)."""


@dataclass
class Retrieval:
    ref: str
    asked_at: int
    """The request whose answer called the tool."""
    prompt_before: int
    calls: list[str] = field(default_factory=list)
    """The calls that asked for it: one, or one per part."""
    result: str | None = None
    """The text of the tool's result, as the agent sent it back (before ContextPaw, which may cut it
    on the way to the model), its parts joined; None: never sent back whole."""
    result_tokens: int | None = None
    """The tokens of its parts, as the model saw them."""
    prompt_after: int | None = None

    @property
    def cost(self) -> int | None:
        """The prompt tokens the turn that brought the result back added to the one that asked (less
        where ContextPaw cut that turn again: past the first retrievals every turn is at the window)."""
        return None if self.prompt_after is None else self.prompt_after - self.prompt_before


@dataclass
class Run:
    agent: str
    run: cli.AgentRun
    model_log: list[dict[str, Any]]
    paths: list[Path]
    sent_results: dict[str, str]
    """The text of each retrieval's result by its call, as the agent sent it to ContextPaw."""
    archived: dict[str, str] = field(default_factory=dict)
    """What the proxy keeps under each reference the model asked for, rendered as `contextpaw mcp`
    gives it, read from its archive at the end of the session."""

    def retrievals(self) -> list[Retrieval]:
        """Each reference the model asked for, with its result: the parts, as the agent sent them
        back, joined once every part came back (a result over `PART_BYTES` comes in parts)."""
        out: dict[str, Retrieval] = {}
        pieces: dict[str, dict[int, str]] = {}
        for entry in self.model_log:
            for back in entry.get("retrieved") or []:
                known = out.get(back["ref"])
                if known is None or back["call"] in known.calls:
                    continue
                known.calls.append(back["call"])
                text = self.sent_results.get(back["call"], back["text"])
                unwrapped = CODEX_HEADER.sub("", text) if self.agent == "codex" else text
                head = parts.PART_HEADER.match(unwrapped)
                number, count = (int(head[1]), int(head[2])) if head else (1, 1)
                pieces.setdefault(known.ref, {})[number] = unwrapped[head.end() :] if head else unwrapped
                known.result_tokens = (known.result_tokens or 0) + back["tokens"]
                if known.result is None and sorted(pieces[known.ref]) == list(range(1, count + 1)):
                    known.result, known.prompt_after = "".join(pieces[known.ref][n] for n in range(1, count + 1)), entry["prompt_tokens"]
            reply = entry.get("reply") or {}
            if reply.get("kind") == "retrieve":
                ref = json.loads(reply["call"]["arguments"])["ref"]
                out.setdefault(ref, Retrieval(ref, entry["n"], entry["prompt_tokens"]))
        return list(out.values())

    def marker_refs(self) -> set[str]:
        return {ref for entry in self.model_log for ref in entry.get("refs_seen") or []}

    def served(self) -> list[Retrieval]:
        """Retrievals whose result, its parts joined, is byte for byte what the proxy keeps under the
        reference (whatever the hole held: a file, the session's task, an earlier retrieval's part)."""
        return [r for r in self.retrievals() if r.result is not None and r.result == self.archived.get(r.ref)]

    def files_in(self, text: str) -> list[Path]:
        """The task's files whose whole text the retrieved content holds, byte for byte once the read
        tool's line numbers are taken off, or of which it is a part (the middle ContextPaw cut from a
        file too long to keep whole)."""
        strings = list(_strings(_loaded(text)))
        found = []
        for path in self.paths:
            disk = path.read_text()
            for s in strings:
                plain = NUMBERED.sub("", CODEX_EXEC.sub("", s))
                if disk.rstrip("\n") in plain or (len(plain) > 200 and plain in disk):
                    found.append(path)
                    break
        return found

    def about(self) -> str:
        rows = [(e["n"], e["prompt_tokens"], (e.get("reply") or {}).get("kind"), len(e.get("refs_seen") or [])) for e in self.model_log]
        return f"{self.agent}: (request, prompt tokens, reply, markers) {rows}\n{self.run.describe()[-6000:]}"


def _loaded(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _strings(value: Any) -> Any:
    """Every string in a value, and in the JSON a string holds (a hole that held an earlier
    retrieval's result holds that hole's messages as JSON text)."""
    if isinstance(value, str):
        yield value
        if value[:1] in "[{" and (inner := _loaded(value)) is not value:
            yield from _strings(inner)
    elif isinstance(value, dict):
        for inner in value.values():
            yield from _strings(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _strings(inner)


def one_session(agent: str, binary: Path, front: str, work: Path, log: Path, users_own: bool = False) -> Run:
    """One session through `contextpaw launch`; `users_own`: with the user's own grants and rules
    beside launch's (`USERS_OWN_ARGS`, `USERS_OWN_OPENCODE`)."""
    project = work / "project"
    paths = make_files(project / "notes", FILES)
    for path in paths:  # each session's own files: a reference names content, and the same content the same one
        path.write_text(f"session {work.name}\n{path.read_text()}")
    home = work / "home"
    if agent == "opencode" and users_own:
        (home / ".config" / "opencode").mkdir(parents=True, exist_ok=True)
        (home / ".config" / "opencode" / "opencode.json").write_text(json.dumps(USERS_OWN_OPENCODE))
    start = len(read_log(log)) if log.exists() else 0
    own, env, stdin = cli.launch_arguments(agent, home, task(paths))
    # no grant of the test's own (not Qwen Code's --yolo): the tool runs on the one launch gives it
    own = [*(a for a in own if a != "--yolo"), *(USERS_OWN_ARGS.get(agent, []) if users_own else [])]
    env = cli.scratch_env(home, {**env, "PATH": f"{binary.parent}:{cli.scratch_env(home)['PATH']}"})
    # --force: retrieval is the question, at a window where Claude Code and Qwen Code would not be launched
    argv = [sys.executable, "-m", "contextpaw.command.cli", "launch", agent, "--url", front, "--window", str(TOLD),
            "--state-dir", str(work / "state"), "--force", "--", *own]  # fmt: skip
    code, out, err, seconds = cli.run_process(argv, env, project, 420, stdin=stdin)
    run = cli.AgentRun(argv, code, out, err, None, seconds, home)
    (work / "agent.out").write_text(run.describe())
    return Run(agent, run, read_log(log)[start:], paths, {})


def sent_results(sent: list[dict[str, Any]]) -> dict[str, str]:
    """The retrieval results in what the agents sent to ContextPaw, by call id (the first sending)."""
    out: dict[str, str] = {}
    for entry in sent:
        api = {"/v1/messages": "anthropic", "/v1/chat/completions": "chat"}.get(entry.get("path", "").split("?")[0])
        if api and isinstance(entry.get("body"), dict):
            for back in retrieved(PARSERS[api](entry["body"])):
                out.setdefault(back["call"], back["text"])
    return out


def archived(url: str, ref: str) -> str:
    """What the proxy keeps under a reference with its capability (no token needed), as text."""
    with urllib.request.urlopen(url + refs.EVICTED_PATH + quote(ref, safe=""), timeout=30) as answer:
        return parts.rendered(json.loads(answer.read())["content"])


async def _mcp_calls(url: str, state: Path, *asked: str) -> list[tuple[bool, str]]:
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=sys.executable, args=["-m", "contextpaw.command.cli", "mcp", "--url", url, "--state-dir", str(state)]
    )
    out = []
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        for ref in asked:
            result = await session.call_tool("contextpaw_retrieve", {"ref": ref})
            out.append((bool(result.is_error), "".join(getattr(b, "text", "") for b in result.content)))
    return out


@dataclass
class Sessions:
    first: Run
    second: Run
    checks: list[tuple[bool, str]]
    """The MCP tool's answers, without a token, to: the first session's first reference, it with a
    forged capability, its bare id."""


_done: dict[str, Sessions] = {}


@pytest.fixture
def sessions(tmp_path_factory: pytest.TempPathFactory, agent: str) -> Sessions:
    if agent not in _done:
        binary = cli.require_agents(agent)[agent]
        work = tmp_path_factory.mktemp(f"retrieval-{agent}")
        log = work / "model.jsonl"
        with ExitStack() as exits:
            args = ["--n-ctx", str(WINDOW), "--behaviour", "llamacpp", "--log", str(log), "--retrieve"]
            model = exits.enter_context(start_module("support.scripted_model", args, "/", work / "model.out", timeout=180))
            stack, stops = cli.start_contextpaw_stack(work / "stack", model.url)
            exits.enter_context(stops)
            first = one_session(agent, binary, stack.front, work / "first", log)
            second = one_session(agent, binary, stack.front, work / "second", log, users_own=True)
            first.sent_results = second.sent_results = sent_results(read_log(stack.front_log))
            for run in (first, second):
                run.archived = {r.ref: archived(stack.front, r.ref) for r in run.retrievals()}
            asked = sorted(first.marker_refs())
            checks: list[tuple[bool, str]] = []
            if asked:
                marker_id, cap = asked[0].split(".")
                forged = f"{marker_id}.{'0' * len(cap) if cap != '0' * len(cap) else '1' * len(cap)}"
                checks = asyncio.run(_mcp_calls(stack.front, work / "nostate", asked[0], forged, marker_id))
        _done[agent] = Sessions(first, second, checks)
        for name, run in (("first", first), ("second", second)):
            made = run.retrievals()
            print(f"\n{agent} session {name}: {len(run.marker_refs())} references seen, retrievals asked {len(made)}, "
                  f"served {len(run.served())}; each result's tokens {[r.result_tokens for r in made]}, "
                  f"the prompt's growth over the turn that asked {[r.cost for r in made]}")  # fmt: skip
    return _done[agent]


AGENTS = pytest.mark.parametrize("agent", ["claude", "codex", "opencode", "qwen"])


@AGENTS
def test_the_model_asks_for_the_evicted_file_and_gets_it_back_byte_for_byte(sessions: Sessions) -> None:
    for run in (sessions.first, sessions.second):
        made = run.retrievals()
        assert run.marker_refs(), "ContextPaw cut nothing: " + run.about()
        assert made and all(refs.REF.fullmatch(r.ref) for r in made), run.about()
        assert all(r.result is not None for r in made), "a retrieval never came back: " + run.about()
        served = run.served()
        # in parts, no result passes an agent's own limit (Qwen Code sent a `<persisted-output>` stub
        # for a 77 KB result, Codex cut the middle of a 16,000-token one)
        assert served == made, f"served {len(served)} of {len(made)}: {[r.result[:300] for r in made if r.result]}\n" + run.about()
        # what comes back is the agent's own reading: a file, whole (which files the cuts take
        # depends on the session's sizes: with xdist's longer paths the first file stays, the
        # second and third go)
        assert any(run.files_in(r.result or "") for r in served), run.about()


@AGENTS
def test_the_session_finishes_with_retrievals_between_its_reads(sessions: Sessions) -> None:
    for run in (sessions.first, sessions.second):
        reads = {e["reply"]["file"] for e in run.model_log if (e.get("reply") or {}).get("kind") == "tool"}
        final = [e for e in run.model_log if (e.get("reply") or {}).get("kind") == "final"]
        assert run.run.returncode == 0 and final and reads == set(range(1, FILES + 1)), run.about()


@AGENTS
def test_a_reference_reads_only_with_its_capability_and_each_session_has_its_own(sessions: Sessions) -> None:
    (good, text), (forged, forged_text), (bare, bare_text) = sessions.checks
    assert not good and text
    assert forged and bare and "keeps nothing under" in forged_text and "keeps nothing under" in bare_text
    first, second = sessions.first.marker_refs(), sessions.second.marker_refs()
    assert first and second and not first & second
    assert not {r.ref for r in sessions.second.retrievals()} & first
