"""Never silent, measured: route × policy × counter × cold/warm × stream, over requests of varied
shapes (dense text, code, logs, multilingual text, tool calls) and sizes, each judged against the
backend's own record of whether it cut the prompt. Only what the CLIENT received counts: prints the
matrix of told (the cut, in a header, the body or the stream's final record) / possible-told (that a
cut is possible, the same ways) / missed (cut, and the client told neither) / false alarms (told of a
cut the backend did not make), beside ContextPaw's own counter (flagged), and the recall of a fact
planted at the start, direct and through ContextPaw. Streamed policy-off cases run on every route,
with clients that did not ask for usage and one that did, and the verdict's word floor is tried with
a chat whose words alone exceed the window.

    PYTHONPATH=tests .venv/bin/python scripts/measure/measure_truncation.py [--quick] [--json out.json]

Counters: "estimate" is the fast fake Ollama, whose tokenizer ContextPaw cannot read (it counts
with its calibrated byte estimate); "exact" is the Ollama simulator on the real llama-server and
SmolLM2, whose GGUF ContextPaw finds through /api/show and counts with. Both servers default to a
2,048-token window, which ContextPaw is not told (its own default is 4,096): cold requests must
learn it.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support import truncation_matrix as matrix  # noqa: E402
from support.backends import locate_llama_server, locate_smollm2, start_llama_server, start_module  # noqa: E402

SERVER_DEFAULT = 2048


def table(outcomes: list[matrix.Outcome], counter: str) -> list[str]:
    cells: dict[tuple, list[matrix.Outcome]] = collections.defaultdict(list)
    for o in outcomes:
        cells[(o.case.route, o.case.policy, "cold" if o.case.cold else "warm", "stream" if o.case.stream else "buffered")].append(o)
    rows = [f"| {counter} | route | policy | start | answer | requests | cut by Ollama | told | possible-told (cut) | missed | false | flagged (counter) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, group in sorted(cells.items()):
        t = totals(group)
        rows.append(
            f"| {counter} | {' | '.join(key)} | {t['requests']} | {t['cut']} | {t['told']} | {t['possible_told']} ({t['possible_cut']}) "
            f"| {t['missed']} | {t['false']} | {t['flagged']} |"
        )
    return rows


def totals(outcomes: list[matrix.Outcome]) -> dict[str, int]:
    return {
        "requests": len(outcomes),
        "cut": sum(o.cut for o in outcomes),
        "told": sum(o.told for o in outcomes),
        "possible_told": sum(o.possible_told and not o.told for o in outcomes),
        "possible_cut": sum(o.possible_told and not o.told and o.cut for o in outcomes),
        "missed": sum(o.missed for o in outcomes),
        "false": sum(o.false_alarm for o in outcomes),
        "flagged": sum(o.flagged for o in outcomes),
        "usage_wrong": sum(o.usage_wrong for o in outcomes),
        "refused": sum(o.status != 200 for o in outcomes),
    }


def direct_recall(backend: str, model: str, cases: list[matrix.Case]) -> tuple[int, int]:
    """The same requests straight to the server: how often the planted fact survives."""
    hits = 0
    for case in cases:
        response = matrix.httpx.post(backend + case.route, json=matrix.body(case, model), timeout=600)
        hits += response.status_code == 200 and matrix.SECRET in matrix.answer_text(case.route, case.stream, response.text).lower()
    return hits, len(cases)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller matrix (one size per shape)")
    parser.add_argument("--no-exact", action="store_true", help="skip the simulator on the real model")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    args = parser.parse_args()
    sizes = (300, 3000) if args.quick else (300, 1500, 4000)
    all_outcomes: dict[str, list[matrix.Outcome]] = {}
    recall: dict[str, tuple[int, int, int, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fake_args = ["--n-ctx", str(SERVER_DEFAULT), "--model", "fake"]
        with start_module("support.fake_ollama", fake_args, "/", work / "fake.log") as fake:
            cases = list(matrix.cases(sizes=sizes)) + list(matrix.told_cases(starts=(True, False)))
            all_outcomes["estimate"] = matrix.measure(fake.url, "fake", work, cases, ["contextpaw_calibrate=true"],
                                                      progress=lambda o: print(".", end="", flush=True))  # fmt: skip
        print()
        binary, model = locate_llama_server(), locate_smollm2()
        if not args.no_exact and binary.path and model.path:
            with start_llama_server(binary.path, model.path, SERVER_DEFAULT, work / "llama.log") as llama:
                sim_args = ["--upstream", llama.url, "--n-ctx", str(SERVER_DEFAULT), "--model", "smollm2:135m"]
                with start_module("support.ollama_sim", sim_args, "/", work / "sim.log") as sim:
                    # the real model prefills slowly on 2 cores: every route and policy, warm, buffered
                    cases = [c for c in matrix.cases(sizes=(2500,), shapes=("dense", "tools"), streams=(False,)) if not c.cold]
                    outcomes = matrix.measure(sim.url, "smollm2:135m", work, cases, [],
                                              progress=lambda o: print(".", end="", flush=True))  # fmt: skip
                    all_outcomes["exact"] = outcomes
                    chats = [c for c in cases if c.policy == "compact"]
                    direct = direct_recall(sim.url, "smollm2:135m", chats)
                    through = [o for o in outcomes if o.case in chats]
                    recall["exact"] = (*direct, sum(o.recalled for o in through), len(through))
            print()
        elif not args.no_exact:
            print(f"no exact row: {binary.reason or model.reason}")
    print("\n## Never silent: every Ollama route\n")
    for counter, outcomes in all_outcomes.items():
        print("\n".join(table(outcomes, counter)))
        print()
    print(
        "| counter | requests | cut by Ollama | told | possible-told (of them cut) | missed | false alarms | flagged (counter) | usage not as asked | refused (400) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for counter, outcomes in all_outcomes.items():
        t = totals(outcomes)
        print(f"| {counter} | {t['requests']} | {t['cut']} | {t['told']} | {t['possible_told']} ({t['possible_cut']}) | {t['missed']} "
              f"| {t['false']} | {t['flagged']} | {t['usage_wrong']} | {t['refused']} |")  # fmt: skip
    for counter, (direct_hits, direct_n, through_hits, through_n) in recall.items():
        print(f"\nrecall of the planted fact ({counter}, compact, warm, overflowing): direct {direct_hits}/{direct_n}, "
              f"through ContextPaw {through_hits}/{through_n}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({k: [asdict(o) for o in v] for k, v in all_outcomes.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
