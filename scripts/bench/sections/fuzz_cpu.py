"""9. CPU per fuzz pass, beside bare mitmdump in the same run (issue 44): the proxy process's own CPU
seconds (from /proc) to handle the seeded fuzz bodies of tests/support/fuzz.py once (chats of 1 KB to
8 MB, gzip, cut-short JSON, streams; the N8 row of scripts/measure/measure_hardening.py), in front of
that script's llama-server look-alike (a 1,024-token window, so most chats overflow), through the
proxies of stage.py."""

from __future__ import annotations

import statistics
from typing import Any

from rich.progress import Progress

from sections.pressure import ROUTE, paw_stats
from sections.stage import NAMES, Stage, turns

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.fuzz import fuzz_bodies, fuzz_pass
from support.measure import cpu_seconds

FUZZ_BODIES = 200
"""The N8 row's pass (docs/reliability.md)."""


def fuzz_cpu(stage: Stage, quick: bool, bodies: int | None, progress: Progress) -> dict[str, Any]:
    """One pass per path and round (1 round of 8 bodies with --quick, else 2), the paths taking turns."""
    count = bodies or (8 if quick else FUZZ_BODIES)
    rounds = 1 if quick else 2
    corpus = fuzz_bodies(count)
    task = progress.add_task("CPU per fuzz pass", total=rounds * len(NAMES))
    result: dict[str, Any] = {"bodies": count, "mb": sum(len(b) for b, _ in corpus) / 2**20, "rounds": rounds}
    cpu: dict[str, list[float]] = {name: [] for name in NAMES}
    before = paw_stats(stage)
    for name in turns(rounds):
        pid = stage.process(name).process.pid
        started = cpu_seconds(pid)
        fuzz_pass(stage.url(name, "hardening") + ROUTE, corpus)
        cpu[name].append(cpu_seconds(pid) - started)
        progress.advance(task)
    after = paw_stats(stage)
    keys = ("requests", "compacted", "refused", "too_large", "bad_request", "errors")
    result["contextpaw_stats"] = {k: (after[k] - before[k]) / rounds for k in keys}  # a pass's: one pass of ContextPaw's a round
    return result | {name: {"cpu_s": statistics.median(cpu[name]), "passes": cpu[name]} for name in NAMES}


def goals(f: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """The goals-table row: ContextPaw's CPU per pass at most 1.5x bare mitmdump's."""
    bare, paw = f["mitmdump"]["cpu_s"], f["ContextPaw"]["cpu_s"]
    ratio = paw / bare if bare else float("inf")
    s = f.get("contextpaw_stats") or {}
    why = (
        f"not met: {paw - bare:.1f} s more; of {f['bodies']} bodies ({f['mb']:.0f} MB) a pass, ContextPaw fitted {s.get('requests', 0):.0f} "
        f"({s.get('compacted', 0):.0f} compacted, {s.get('refused', 0):.0f} refused: what must be kept exceeds the 1,024-token window) "
        f"where bare mitmdump parses none: {(paw - bare) / max(s.get('requests') or 1, 1) * 1000:.0f} ms of CPU a fitted body"
    )
    return [
        (
            f"CPU per fuzz pass of {f['bodies']} bodies ({f['mb']:.0f} MB)",
            f"{bare:.1f} s",
            f"{paw:.1f} s ({ratio:.1f}x)",
            "≤ 1.5x bare",
            "met" if ratio <= 1.5 else why,
        )
    ]


def markdown(f: dict[str, Any]) -> list[str]:
    return [
        "## 9. CPU per fuzz pass",
        "",
        f"The seeded fuzz bodies of tests/support/fuzz.py ({f['bodies']} bodies, {f['mb']:.0f} MB: chats of 1 KB to 8 MB, gzip, "
        "cut-short JSON, streams) from 4 threads, in front of scripts/measure/measure_hardening.py's llama-server look-alike "
        f"(a 1,024-token window); the proxy's own CPU seconds per pass, {f['rounds']} passes each, the paths taking turns.",
        "",
        "| path | CPU s per pass (median) | passes |",
        "|---|---:|---|",
        *(f"| {name} | {f[name]['cpu_s']:.1f} | {', '.join(f'{c:.1f}' for c in f[name]['passes'])} |" for name in NAMES),
        "",
        f"ContextPaw's counts a pass: {', '.join(f'{k} {v:g}' for k, v in (f.get('contextpaw_stats') or {}).items())}.",
        "",
    ]
