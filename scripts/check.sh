#!/usr/bin/env bash
# The checks, in the order they fail fastest: lint, format, the import contract (layers point down,
# the core and wire formats pure, no circle), and the type checker. Exits non-zero on the first
# that fails. Run by scripts/test.sh before the tests (so by .ci/run too); alone: bash scripts/check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin
[[ -x $py/ruff ]] || bash scripts/install/setup.sh
step() { printf 'check: %s\n' "$1" >&2; }
step "ruff (lint)";    "$py/ruff" check --no-cache contextpaw tests scripts contextpaw_addon.py
step "ruff (format)";  "$py/ruff" format --no-cache --check contextpaw tests scripts contextpaw_addon.py
step "import contract (lint-imports)"; "$py/lint-imports" --no-cache
step "types (mypy)";   "$py/mypy"
step "all passed"
