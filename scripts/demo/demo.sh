#!/usr/bin/env bash
# Install everything, then run the proof on the bundled real backend: a llama-server with
# SmolLM2-135M and the Ollama simulator, direct and through ContextPaw (needle, then the 400, then
# both over Anthropic's /v1/messages, then both over OpenAI's /v1/responses, as one request and as
# a Codex session of tool calls).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/demo_needle.py "$@"
.venv/bin/python scripts/demo_400.py "$@"
.venv/bin/python scripts/demo_messages.py --trials 2
.venv/bin/python scripts/demo_responses.py --trials 2
.venv/bin/python scripts/demo_responses.py --trials 2 --shape codex --num-ctx 1024
