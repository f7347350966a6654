#!/usr/bin/env bash
# Run the whole test suite (unit, end-to-end against fakes, and real llama-server + model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export LLAMA_SERVER="${LLAMA_SERVER:-$(PYTHON=.venv/bin/python bash scripts/get_llama_server.sh)}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
