#!/usr/bin/env bash
# The checks (scripts/check.sh), then the whole test suite (unit, end-to-end against fakes, and
# real llama-server + model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install/setup.sh
bash scripts/check.sh
export LLAMA_SERVER="${LLAMA_SERVER:-$(PYTHON=.venv/bin/python bash scripts/install/get_llama_server.sh)}"
bash scripts/install/get_agents.sh >/dev/null || echo "the agent CLIs are not installed (above); tests/agents says why it skips or fails" >&2
# coverage of the package by the tests run in-process (agents and servers run as child processes
# are not counted), summed up at the end and held at its floor (92.7% on 2026-12-06: raise it as it
# grows); sys.monitoring keeps its cost low on 3.12
export COVERAGE_CORE=sysmon
floor=0
[ "$#" -eq 0 ] && floor="${CONTEXTPAW_COVERAGE_FLOOR:-92}"  # the whole suite only: a part of it covers less
# two workers, a test file each at a time (a file's servers are started once): most of the suite's
# time is spent waiting on servers, agents and models, so the second core is what it lacked
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${CONTEXTPAW_TEST_WORKERS:-2}" --dist loadfile \
    --cov=contextpaw --cov-report=term:skip-covered --cov-fail-under="$floor" --durations=25 "$@"
