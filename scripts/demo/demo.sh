#!/usr/bin/env bash
# Install everything, then run the proof on the bundled real backend: a llama-server with
# SmolLM2-135M and the Ollama simulator, direct and through ContextPaw (needle, then the 400, then
# both over Anthropic's /v1/messages, then both over OpenAI's /v1/responses, as one request and as
# a Codex session of tool calls).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/install/setup.sh
# the demos reuse the test support (fakes, process helpers: tests/support/, imported as `support`);
# it is not part of the package, so it comes from PYTHONPATH, as under pytest (pyproject's pythonpath)
export PYTHONPATH="$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
.venv/bin/python scripts/demo/demo_needle.py "$@"
.venv/bin/python scripts/demo/demo_400.py "$@"
.venv/bin/python scripts/demo/demo_messages.py --trials 2
.venv/bin/python scripts/demo/demo_responses.py --trials 2
.venv/bin/python scripts/demo/demo_responses.py --trials 2 --shape codex --num-ctx 1024
