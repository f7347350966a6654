"""Benchmarks: what ContextPaw costs and what it saves, side by side in one run.

    PYTHONPATH=tests .venv/bin/python scripts/bench/bench.py [--out bench-results] [--quick] [--skip-real] [--docs]
        [--reuse docs/bench.json --only SECTION ...]

Sections (each in the JSON, the markdown table and, where it helps, a PNG):
1. overhead: the same requests direct to a fake llama-server, through bare mitmdump (the floor for
   any addon) and through mitmdump with ContextPaw; small and 1 MB bodies that fit, and streams
   (time to first byte, chunk rate). Paths take turns in rounds, so machine noise hits all three.
2. compaction: time and peak memory to compact 1k-200k token chats and raw prompts (the sweep of
   scripts/bench/bench_compact.py) with each counter: estimate, calibrated, the GGUF tokenizer, and
   llama-server's own counts (first call uncached vs cached).
3. window_use: final tokens / budget across the same sweep, by each counter's own count; and
   real_window_use: what would be sent, counted by llama-server, over the budget.
   window_use_through: real-token window use through ContextPaw (scripts/bench/measure_window_use.py).
4. agent_loop: prefix-cache reuse per turn on a real llama-server (scripts/bench/bench_agent_loop.py).
5. recall: the k/N lines of demo_needle.py, demo_400.py and measure_summary.py's table.
6. loop_health: c=8 throughput and proxy CPU per request, the worst latency idle and during one
   160k-token compaction, RSS (and by import step), ContextPaw's time per hook, a process handoff's cost.
7. scaling: the engine at 1,200 to 9,600 messages.
8. burst and big_answer: a small client's worst and p99 latency while N overflowing Ollama /api/chat
   requests of 1-8 MB arrive at once (--burst, default 64), with the burst's wall time and the proxy's
   peak RSS, and its worst while one 300 MB buffered answer passes.
9. fuzz_cpu: the proxy's CPU seconds for one pass of tests/support/fuzz.py's seeded bodies (--fuzz-bodies).
10. sessions: 50 sessions of 20 turns at once, nothing overflowing (load_test.py's): requests per second.
Sections 8-10 set bare mitmdump and ContextPaw side by side in the same run, taking turns.
Each section is a module of scripts/bench/sections/; report.py there writes the tables and plots.
The goals of this round, each beside its floor, head the markdown (and, with --docs, docs/results.md).
Real-backend parts need llama-server and the SmolLM2 model; they are skipped, saying why, when
either is missing or with --skip-real. --docs copies the markdown and plots into docs/, and the JSON
to docs/bench.json; a whole run takes hours on 2 cores, so `--reuse docs/bench.json --only ...`
measures only the sections named (overhead, compaction, agent_loop, prefix, window_use_through,
recall, loop_health, scaling, agent_sessions, burst, big_answer, fuzz_cpu, sessions) and takes the rest from that run, whose date the report names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.progress import Progress

from sections import fuzz_cpu, pressure, sessions
from sections.agents import agent_loops, agent_sessions
from sections.common import console, machine, script_json
from sections.compaction import REAL_USE_SIZES, compaction, counting_server, real_window_use, window_use
from sections.loop_health import loop_health
from sections.overhead import overhead
from sections.recall import recall
from sections.report import report
from sections.scaling import scaling
from sections.stage import Stage

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.backends import locate_llama_server, locate_smollm2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-results", help="folder for bench.json, bench.md and img/*.png")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and counts, for a smoke run")
    ap.add_argument("--skip-real", action="store_true", help="skip what needs llama-server (backend counter, loop, recall)")
    ap.add_argument(
        "--agent-loop",
        type=Path,
        nargs="+",
        help="reuse these scripts/bench/bench_agent_loop.py --out JSONs (one per window) instead of running it at 2048 and 8192",
    )
    ap.add_argument("--prefix", type=Path, help="reuse this scripts/bench/bench_prefix.py --out JSON instead of running it")
    ap.add_argument("--growing-chat", type=Path, help="reuse this scripts/bench/bench_growing_chat.py --out JSON instead of running it")
    ap.add_argument(
        "--agent-sessions", type=Path, help="reuse this scripts/bench/agent_sessions.py --out JSON instead of running the matrix"
    )
    ap.add_argument(
        "--window-use",
        type=Path,
        help="reuse this scripts/bench/measure_window_use.py --out JSON (real-token window use through ContextPaw) instead of running it",
    )
    ap.add_argument("--burst", type=int, help="overflowing requests in the burst (default 64; 4 with --quick)")
    ap.add_argument("--fuzz-bodies", type=int, help="bodies in the fuzz pass (default 200, the N8 row's; 8 with --quick)")
    ap.add_argument("--recall-trials", type=int, default=3, help="--trials for each recall demo (1 with --quick)")
    ap.add_argument("--docs", action="store_true", help="copy the markdown to docs/benchmarks.md and the plots to docs/img/")
    ap.add_argument("--from-json", type=Path, help="write the report of an earlier run's bench.json, measuring nothing")
    ap.add_argument(
        "--reuse",
        type=Path,
        help="an earlier run's bench.json (--docs keeps one in docs/bench.json): the "
        "sections --only does not name are taken from it, and the report says so",
    )
    ap.add_argument(
        "--only", nargs="+", choices=MEASURED, metavar="SECTION", help=f"with --reuse, the sections to measure again: {', '.join(MEASURED)}"
    )
    args = ap.parse_args(argv)
    if args.from_json:
        return report(json.loads(args.from_json.read_text()), args.from_json.parent, args.docs)
    earlier = json.loads(args.reuse.read_text()) if args.reuse else None
    if earlier is None and args.only:
        ap.error("--only needs --reuse: the sections it does not name come from there")
    binary, model = locate_llama_server(), locate_smollm2()
    skip_real = "--skip-real" if args.skip_real else (binary.reason or model.reason or None)
    result: dict[str, Any] = {"machine": machine(binary.path), "quick": args.quick}
    wanted = set(args.only or MEASURED)
    if earlier is not None:
        kept = [name for name in MEASURED if name not in wanted]
        result |= {key: earlier[key] for name in kept for key in MEASURED[name] if key in earlier}
        result["reused"] = {"from": str(args.reuse), "date": earlier["machine"]["date"], "sections": kept}
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="contextpaw-bench-") as tmp, Progress(console=console) as progress:
        work = Path(tmp)
        measure(result, wanted, work, args, binary, model, skip_real, progress)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    return report(result, out, args.docs)


MEASURED = {
    "overhead": ("overhead",),
    "compaction": ("compaction", "real_window_use", "window_use"),
    "agent_loop": ("agent_loops", "agent_loop"),
    "prefix": ("prefix",),
    "growing_chat": ("growing_chat",),
    "window_use_through": ("window_use_through",),
    "recall": ("recall",),
    "loop_health": ("loop_health",),
    "scaling": ("scaling",),
    "agent_sessions": ("agent_sessions",),
    "burst": ("burst",),
    "big_answer": ("big_answer",),
    "fuzz_cpu": ("fuzz_cpu",),
    "sessions": ("sessions",),
}
"""The sections one run measures, by name (as --only takes them), with the keys each writes."""
STAGED = {"burst", "big_answer", "fuzz_cpu", "sessions"}
"""The sections that share one bare mitmdump and one ContextPaw (sections/stage.py)."""


def measure(result: dict[str, Any], wanted: set[str], work: Path, args: argparse.Namespace, binary: Any, model: Any,
            skip_real: str | None, progress: Progress) -> None:  # fmt: skip
    """Measure the `wanted` sections into `result`, in the order a whole run takes them."""
    if "overhead" in wanted:
        result["overhead"] = overhead(work, args.quick, progress)
    if "compaction" in wanted:
        with counting_server(None if skip_real else binary.path, model.path, work) as llama_url:
            result["compaction"] = compaction(args.quick, model.path, llama_url, progress)
            result["real_window_use"] = (
                asyncio.run(real_window_use(llama_url, REAL_USE_SIZES[:2] if args.quick else REAL_USE_SIZES))
                if llama_url
                else {"skipped": skip_real or "no llama-server"}
            )
        result["window_use"] = window_use(result["compaction"])
    if "agent_loop" in wanted:
        result["agent_loops"] = agent_loops(work, args, binary, model, skip_real, progress)
        result["agent_loop"] = result["agent_loops"][0]
    if "prefix" in wanted:
        result["prefix"] = (
            json.loads(args.prefix.read_text())
            if args.prefix
            else script_json("bench/bench_prefix.py", work / "prefix.json", ["--turns", "40", "--windows", "8192"] if args.quick else [])
        )
    if "growing_chat" in wanted:  # the chats' summaries: their turns one by one stay in the script's own JSON
        result["growing_chat"] = without_turns(
            json.loads(args.growing_chat.read_text())
            if args.growing_chat
            else script_json(
                "bench/bench_growing_chat.py",
                work / "growing_chat.json",
                ["--turns", "40", "--windows", "2048", "8192", "--shares", "0.05", "0.4"] if args.quick else [],
            )
        )

    if "window_use_through" in wanted:
        result["window_use_through"] = (
            json.loads(args.window_use.read_text()) if args.window_use else {"skipped": skip_real} if skip_real
            else script_json("bench/measure_window_use.py", work / "window_use.json", ["--quick"] if args.quick else []))  # fmt: skip
    if "recall" in wanted:
        result["recall"] = {"skipped": skip_real} if skip_real else recall(args.quick, args.recall_trials, progress)
    if "loop_health" in wanted:
        result["loop_health"] = loop_health(work, args.quick, progress)
    if "scaling" in wanted:
        result["scaling"] = scaling(args.quick, progress)
    if "agent_sessions" in wanted:
        result["agent_sessions"] = agent_sessions(work, args, skip_real)
    if wanted & STAGED:  # one pair of proxies for all four; sessions first, before anything has grown the heap
        with Stage(work, args.quick) as stage:
            if "sessions" in wanted:
                result["sessions"] = sessions.sessions(stage, args.quick, progress)
            if "burst" in wanted:
                result["burst"] = pressure.burst(stage, args.quick, args.burst, progress)
            if "big_answer" in wanted:
                result["big_answer"] = pressure.big_answer(stage, args.quick, progress)
            if "fuzz_cpu" in wanted:  # last: it leaves the evicted store full
                result["fuzz_cpu"] = fuzz_cpu.fuzz_cpu(stage, args.quick, args.fuzz_bodies, progress)


def without_turns(chats: dict[str, Any]) -> dict[str, Any]:
    return {**chats, "chats": [{k: v for k, v in c.items() if k != "per_turn"} for c in chats["chats"]]}


if __name__ == "__main__":
    sys.exit(main())
