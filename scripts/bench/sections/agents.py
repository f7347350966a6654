"""4. The real-backend runs: the agent loop on llama-server and the agent CLIs' sessions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import bench_agent_loop
from rich.progress import Progress

from sections.common import script_json


def agent_sessions(work: Path, args: argparse.Namespace, skip_real: str | None) -> dict[str, Any]:
    """The real agent CLIs through file-reading sessions on a scripted model that cuts like Ollama
    or refuses like llama-server, direct and through ContextPaw (scripts/bench/agent_sessions.py, issue
    38), or the JSON --agent-sessions names."""
    if args.agent_sessions:
        runs = json.loads(args.agent_sessions.read_text())
    elif skip_real:
        return {"skipped": skip_real}
    else:
        out = work / "agent_sessions.json"
        script_json("bench/agent_sessions.py", out, ["--files", "4"] if args.quick else [])
        if not out.exists():
            return {"skipped": "scripts/bench/agent_sessions.py wrote nothing"}
        runs = json.loads(out.read_text())
    return {"rows": [run["row"] for run in runs]}


def agent_loops(work: Path, args: argparse.Namespace, binary: Any, model: Any, skip_real: str | None,
                progress: Progress) -> list[dict[str, Any]]:  # fmt: skip
    """The agent loop at -c 2048 and 8192 (512 with --quick), or the JSONs --agent-loop names."""
    if args.agent_loop:
        return [json.loads(p.read_text()) | {"reused_from": str(p)} for p in args.agent_loop]
    if skip_real:
        return [{"skipped": skip_real}]
    loops = []
    for n_ctx in (512,) if args.quick else (2048, 8192):
        turns = 4 if args.quick else 30
        task = progress.add_task(f"agent loop -c {n_ctx}", total=turns)
        loops.append(bench_agent_loop.run(binary.path, model.path, work, turns, n_ctx, lambda task=task: progress.advance(task)))
    return loops
