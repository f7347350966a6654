"""The real agent CLIs (Claude Code, Codex, opencode, aider, Qwen Code) through ContextPaw on the fakes.

Each test starts its own fake backend, ContextPaw (mitmdump with the addon in reverse mode, as the
README runs it) and a recorder on each side of it, so it can compare byte for byte what the client
sent with what ContextPaw forwarded. The CLIs come from scripts/install/get_agents.sh (pinned versions,
cached per user; about 2 minutes to install once, seconds after that). Without them the tests skip
with the script's reason; under CI only an unreachable registry may skip.

Every CLI run has a timeout; a CLI that hangs fails its test instead of stalling the suite.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

import pytest

from support.agents import Stack, StartStack, require_agents, start_contextpaw_stack
from support.backends import start_module


@pytest.fixture(scope="session")
def claude_code() -> Path:
    return require_agents("claude")["claude"]


@pytest.fixture(scope="session")
def opencode() -> Path:
    return require_agents("opencode")["opencode"]


@pytest.fixture(scope="session")
def aider() -> Path:
    return require_agents("aider")["aider"]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[StartStack]:
    """``stack("llamacpp" | "ollama", fake_args, options)``: a fake backend started with
    ``fake_args``, ContextPaw in front of it with the extra ``--set`` ``options``, the recorders
    around it; all stopped when the test ends."""
    exits = ExitStack()

    def start(kind: str, fake_args: Sequence[str] = (), options: Sequence[str] = ()) -> Stack:
        module, health = {"llamacpp": ("support.fake_llamacpp", "/health"), "ollama": ("support.fake_ollama", "/")}[kind]
        work = tmp_path / f"stack-{len(list(tmp_path.glob('stack-*')))}"
        fake = exits.enter_context(start_module(module, list(fake_args), health, work / f"fake-{kind}.log"))
        running, stops = start_contextpaw_stack(work, fake.url, options)
        exits.enter_context(stops)
        return running

    with exits:
        yield start


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """The scratch HOME of the test's CLI runs (one per test: a resumed session lives there)."""
    path = tmp_path / "home"
    path.mkdir()
    return path
