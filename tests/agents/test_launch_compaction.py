"""`contextpaw launch` with the real agent CLIs: the agent's own compaction fires before the window.

Each session: the scripted model (tests/support/scripted_model.py) behaving as llama-server with a
window of ``SESSIONS[agent]`` (and Codex's as Ollama too), ContextPaw in front of it with a recorder on each side, and the agent
started by ``contextpaw launch AGENT --url ... -- <its headless arguments>`` in a scratch HOME, with
nothing of its own that names a window or a provider. The task reads small files (about
2,500 tokens each) one per turn, so the history outgrows the window halfway. Told the served window,
the agent compacts its history with a summary request (the scripted model answers one naming the
files read) before any request reaches the window: ContextPaw cuts nothing, the server refuses
nothing, and the session finishes.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from contextpaw.fitting.sizing import ANCHOR_MARGIN
from support import agents as cli
from support.backends import start_module
from support.recorder import read_log

SESSIONS = {"claude": (65536, 16), "codex": (32768, 12), "opencode": (32768, 12), "qwen": (32768, 12)}
"""agent -> (window, files). Claude Code keeps 13,000 tokens for its summary besides its answer's
room, and after a compaction it reads the last five files again: at 49,152 its 12k-token head, the
summary and those files came back over its threshold, and it stopped (`autocompact_thrashing`)."""
WORDS = "amber basil cedar delta ember falcon garnet harbor indigo juniper kettle lantern meadow nectar".split()


def make_files(folder: Path, count: int) -> list[Path]:
    """``count`` files of 8-10 KB (about 2,500 tokens), numbered as the scripted model reads them."""
    rng = random.Random(40)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for number in range(1, count + 1):
        lines = [f"note {number:02d}.{i:03d}: " + " ".join(rng.choice(WORDS) for _ in range(10)) for i in range(rng.randint(100, 125))]
        lines.insert(len(lines) // 2, f"FACT-{number:02d}: the key is {rng.choice(WORDS)}")
        path = folder / f"file-{number:02d}.txt"
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths


def task(paths: list[Path]) -> str:
    listed = "\n".join(f"{i}. {p}" for i, p in enumerate(paths, 1))
    return f"Read these {len(paths)} files in this order, one per turn, with your file-reading tool, then list every FACT line:\n{listed}\n"


def headless(agent: str, home: Path, prompt: str) -> tuple[list[str], dict[str, str], str | None]:
    """The agent's own arguments for one non-interactive run, the environment that keeps it offline
    and in ``home``, and its stdin: nothing that names a window, a model or a provider."""
    if agent == "claude":
        env = {k: v for k, v in cli.CLAUDE_ENV.items() if k != "ANTHROPIC_AUTH_TOKEN"}
        return ["-p", "--output-format", "json"], {**env, "CLAUDE_CONFIG_DIR": str(home / ".claude")}, prompt
    if agent == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        # Codex keeps ~2,500 tokens of a command's output by default; the files are read whole
        (codex_home / "config.toml").write_text("tool_output_token_limit = 50000\n\n[analytics]\nenabled = false\n")
        return ["exec", "--json", "--skip-git-repo-check", "-"], {"CODEX_HOME": str(codex_home)}, prompt
    if agent == "opencode":
        return ["run", prompt, "--format", "json"], dict(cli.OPENCODE_ENV), None
    if agent == "qwen":
        settings = home / ".qwen" / "settings.json"
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(json.dumps(cli.qwen_settings(None)))
        return ["--yolo", "-o", "json"], dict(cli.QWEN_ENV), prompt
    raise ValueError(agent)


@dataclass
class Session:
    agent: str
    window: int
    run: cli.AgentRun
    model_log: list[dict[str, Any]]
    sent: list[dict[str, Any]]

    def compactions(self) -> list[dict[str, Any]]:
        """The agent's own summary requests, as the model received them."""
        return [e for e in self.model_log if (e.get("reply") or {}).get("kind") == "summary"]

    def cut(self) -> list[dict[str, Any]]:
        """Requests ContextPaw answered with a cut, or the server refused or cut."""
        cut = [e for e in self.sent if (e.get("response") or {}).get("headers", {}).get("x-contextpaw-compacted") == "true"]
        return cut + [e for e in self.model_log if e["status"] != 200 or e.get("cut")]

    def about(self) -> str:
        sizes = [(e["n"], e["prompt_tokens"], (e.get("reply") or {}).get("kind")) for e in self.model_log]
        return f"{self.agent} in {self.window}: (request, prompt tokens, reply) {sizes}\n{self.run.describe()}"


def launch_session(agent: str, behaviour: str, binary: Path, work: Path) -> Session:
    window, files = SESSIONS[agent]
    project = work / "project"
    paths = make_files(project / "notes", files)
    log = work / "model.jsonl"
    home = work / "home"
    with ExitStack() as exits:
        args = ["--n-ctx", str(window), "--behaviour", behaviour, "--log", str(log)]
        model = exits.enter_context(start_module("support.scripted_model", args, "/", work / "model.out", timeout=180))
        stack, stops = cli.start_contextpaw_stack(work / "stack", model.url)
        exits.enter_context(stops)
        own, env, stdin = headless(agent, home, task(paths))
        env = cli.scratch_env(home, {**env, "PATH": f"{binary.parent}:{cli.scratch_env(home)['PATH']}"})
        argv = [
            sys.executable,
            "-m",
            "contextpaw.command.cli",
            "launch",
            agent,
            "--url",
            stack.front,
            "--state-dir",
            str(work / "state"),
            "--",
            *own,
        ]
        code, out, err, seconds = cli.run_process(argv, env, project, 300, stdin=stdin)
        run = cli.AgentRun(argv, code, out, err, None, seconds, home)
        (work / "agent.out").write_text(run.describe())
    return Session(agent, window, run, read_log(log), read_log(stack.front_log))


_sessions: dict[tuple[str, str], Session] = {}


@pytest.fixture
def session(tmp_path_factory: pytest.TempPathFactory, agent: str, behaviour: str) -> Session:
    if (agent, behaviour) not in _sessions:
        binary = cli.require_agents(agent)[agent]
        work = tmp_path_factory.mktemp(f"launch-{agent}-{behaviour}")
        _sessions[agent, behaviour] = launch_session(agent, behaviour, binary, work)
    return _sessions[agent, behaviour]


CASES = [pytest.param(agent, behaviour, id=f"{agent}-{behaviour}") for agent in sorted(SESSIONS) for behaviour in ("llamacpp", "ollama")]
"""Every agent on llama-server (a 400 past the window) and on Ollama (a silent cut past it), where
ContextPaw learns the window from the Modelfile's `num_ctx` and has no tokenizer for the model: it
counts each turn at the rate the server counted its conversation (or the text it repeats, after
the agent's own compaction), and tells the agent the window less that count's margin."""
AGENTS = pytest.mark.parametrize(("agent", "behaviour"), CASES)


@AGENTS
def test_the_agent_compacts_itself_before_the_window(session: Session) -> None:
    compactions = session.compactions()
    assert compactions, "the agent never compacted: " + session.about()
    first = compactions[0]["n"]
    before = [e for e in session.model_log if e["n"] < first]
    assert max(e["prompt_tokens"] for e in before) < session.window, session.about()
    assert not session.cut(), f"cut or refused: {[e.get('n', e.get('path')) for e in session.cut()]}\n" + session.about()


@AGENTS
def test_the_session_finishes_after_its_compaction(session: Session) -> None:
    final = [e for e in session.model_log if (e.get("reply") or {}).get("kind") == "final"]
    assert session.run.returncode == 0 and final, session.about()


def printed(tmp_path: Path, behaviour: str, agent: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`contextpaw launch AGENT --print` against ContextPaw in front of the scripted model (a
    24,576-token window) behaving as `behaviour`; and the state directory it names."""
    log = tmp_path / "model.jsonl"
    with ExitStack() as exits:
        args = ["--n-ctx", "24576", "--behaviour", behaviour, "--log", str(log)]
        model = exits.enter_context(start_module("support.scripted_model", args, "/", tmp_path / "model.out", timeout=180))
        stack, stops = cli.start_contextpaw_stack(tmp_path / "stack", model.url)
        exits.enter_context(stops)
        state = tmp_path / "state"
        argv = [
            sys.executable,
            "-m",
            "contextpaw.command.cli",
            "launch",
            agent,
            "--url",
            stack.proxy.url,
            "--state-dir",
            str(state),
            "--print",
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert not state.exists() and not log.exists(), "--print starts nothing and writes nothing"
    return done, state


def opencode_context(done: subprocess.CompletedProcess[str]) -> int:
    config = done.stdout.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    return int(json.loads(config)["provider"]["contextpaw"]["models"]["scripted"]["limit"]["context"])


def test_print_shows_what_launch_sets_and_starts_nothing(tmp_path: Path) -> None:
    """`--print` against a running ContextPaw: the served window in the agent's own setting, the
    generated file's text, and nothing written."""
    done, state = printed(tmp_path, "llamacpp", "opencode")
    assert opencode_context(done) == 24576
    assert f"export OPENCODE_CONFIG={state}/launch/opencode-scripted.json" in done.stdout
    assert done.stdout.rstrip().endswith("exec opencode")


def test_on_ollama_without_a_tokenizer_the_agent_is_told_the_window_less_the_counts_margin(tmp_path: Path) -> None:
    """Without the model's tokenizer ContextPaw sends a turn unchanged only while its count, with
    6% for the count's error, fits: told the whole window, opencode compacted after ContextPaw had
    cut. The agent is told the window less that margin, Ollama is still asked for the whole one,
    and the user is told why."""
    done, _ = printed(tmp_path, "ollama", "opencode")
    assert opencode_context(done) == math.floor((24576 - 64) / ANCHOR_MARGIN) < 24576
    assert "not the 24576 served" in done.stderr and "no tokenizer" in done.stderr
    aider, _ = printed(tmp_path / "aider", "ollama", "aider")
    assert '"num_ctx": 24576' in aider.stdout and f'"max_input_tokens": {math.floor((24576 - 64) / ANCHOR_MARGIN)}' in aider.stdout


def test_aider_asks_ollama_for_the_served_window(stack: cli.StartStack, home: Path) -> None:
    """aider asks Ollama for `num_ctx` = 1.25 times its prompt + 8,192 (about 9,300 for "say hi"),
    which would load the model again at that size; launched, it asks for the window served."""
    running = stack("ollama", ["--model", "fake:latest", "--n-ctx", "6144"])
    own = ["--no-git", "--yes-always", "--no-check-update", "--no-show-release-notes", "--no-stream", "--no-analytics",
           "--no-pretty", "--no-fancy-input", "--no-detect-urls", "--map-tokens", "0", "--message", "say hi"]  # fmt: skip
    binary = cli.require_agents("aider")["aider"]
    env = cli.scratch_env(home, {**cli.AIDER_ENV, "PATH": f"{binary.parent}:{cli.scratch_env(home)['PATH']}"})
    argv = [sys.executable, "-m", "contextpaw.command.cli", "launch", "aider", "--url", running.front, "--model", "fake:latest",
            "--state-dir", str(home / "state"), "--", *own]  # fmt: skip
    code, out, err, _ = cli.run_process(argv, env, home, 180)
    chats = running.sent("/api/chat")
    assert code == 0 and chats, f"exit {code}\n{out[-2000:]}\n{err[-2000:]}"
    assert [c["body"]["options"]["num_ctx"] for c in chats] == [6144] * len(chats)
    assert "Unknown context window" not in out
