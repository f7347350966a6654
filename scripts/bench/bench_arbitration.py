"""The arbiter replayed against request schedules and VRAM traces (the real `Arbiter`, a fake NVML,
fake runtimes, a simulated clock): one JSON object per scenario, then a table.

    PYTHONPATH=tests .venv/bin/python scripts/bench/bench_arbitration.py [--min-hold 20]

Scenarios (tests/support/arbitration_sim.py): two clients alternating runtimes at 1 Hz for 120 s;
the earlier proxy's 24 GB card with models of 15.1 GB and 11.0 GB; an 80 GB card where both fit;
another process taking 10 GB mid-run. The first is also run without a hold, for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

# `support` is the test support (tests/support/), not the package: run with PYTHONPATH=tests (docs/development.md)
from support.arbitration_sim import replay, scenarios

COLUMNS = (
    "scenario",
    "switches",
    "dropped",
    "evicted_in_flight",
    "over_commits",
    "misplaced",
    "decisions_logged",
    "served",
    "most_resident",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-hold", type=float, default=20.0)
    args = ap.parse_args(argv)
    runs = scenarios(args.min_hold)
    runs.insert(1, replace(runs[0], name=f"{runs[0].name}, no hold", min_hold=0.0))
    outcomes = []
    for scenario in runs:
        outcome = replay(scenario)
        outcomes.append(outcome.as_json())
        print(json.dumps(outcome.as_json()), flush=True)
    print("\n| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for row in outcomes:
        print("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
