"""`contextpaw launch` registers `contextpaw mcp` with the real agent CLIs: each agent starts the
server, lists its tools and offers them to the model.

Each session: the scripted model (tests/support/scripted_model.py) as llama-server, ContextPaw in
front of it, and the agent started by ``contextpaw launch AGENT --url ... -- <its headless
arguments>`` in a scratch HOME with nothing of its own that names an MCP server; the task reads one
file. The model's log holds each request's body: the tools the agent offered it.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from support import agents as cli
from support.backends import start_module
from support.recorder import read_log

FILES = 12
"""Files the task reads, one a turn: a session long enough for an agent that starts its MCP servers
beside the first turn (Codex) to have them by the last."""


def tool_names(body: dict[str, Any]) -> set[str]:
    """The tools a request offers, in any of the three APIs' shapes (Codex's MCP tools come in a
    Responses `namespace` of their own: `mcp__contextpaw`.`contextpaw_retrieve`)."""
    names = set()
    for tool in body.get("tools") or []:
        if isinstance(tool, dict):
            names.add(str(tool.get("name") or (tool.get("function") or {}).get("name") or ""))
            names |= tool_names(tool) if tool.get("type") == "namespace" else set()
    return names


def offered(agent: str, binary: Path, work: Path) -> tuple[list[set[str]], str]:
    """The tool names of each request the model received, and what the agent printed."""
    project = work / "project"
    project.mkdir(parents=True)
    notes = [project / f"file-{n:02d}.txt" for n in range(1, FILES + 1)]
    for n, note in enumerate(notes, 1):
        note.write_text(f"FACT-{n:02d}: the key is amber\n")
    log = work / "model.jsonl"
    home = work / "home"
    with ExitStack() as exits:
        args = ["--n-ctx", "32768", "--behaviour", "llamacpp", "--log", str(log)]
        model = exits.enter_context(start_module("support.scripted_model", args, "/", work / "model.out", timeout=180))
        stack, stops = cli.start_contextpaw_stack(work / "stack", model.url)
        exits.enter_context(stops)
        listed = "".join(f"{n}. {note}\n" for n, note in enumerate(notes, 1))
        prompt = f"Read these files in this order, one per turn, with your file-reading tool, then list every FACT line:\n{listed}"
        # --force: the tools are the question, not the window (Claude Code and Qwen Code live from 65,536)
        run = cli.run_launched(agent, binary, stack.front, prompt, home=home, cwd=project, state=work / "state", timeout=300, force=True)
    return [tool_names(entry.get("body") or {}) for entry in read_log(log)], run.describe()


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode", "qwen"])
def test_the_launched_agent_offers_the_models_the_retrieval_tools(agent: str, tmp_path: Path) -> None:
    binary = cli.require_agents(agent)[agent]
    tools, about = offered(agent, binary, tmp_path)
    with_tools = [names for names in tools if names]
    assert with_tools, about
    for kind in ("contextpaw_retrieve", "contextpaw_search"):
        assert any(any(name.endswith(kind) for name in names) for names in with_tools), f"{kind} not offered: {tools}\n{about}"
