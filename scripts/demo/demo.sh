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
# each demo says on stderr, before each request, which it is ([i/N]), the time so far and what is left
say() { printf 'demo [%s/5]: %s\n' "$1" "$2" >&2; }
say 1 "the needle over Ollama's /api/chat (demo_needle.py)"
.venv/bin/python scripts/demo/demo_needle.py "$@"
say 2 "the 400 on llama-server (demo_400.py)"
.venv/bin/python scripts/demo/demo_400.py "$@"
say 3 "Claude Code's /v1/messages (demo_messages.py)"
.venv/bin/python scripts/demo/demo_messages.py --trials 2
say 4 "Codex's /v1/responses, one request (demo_responses.py)"
.venv/bin/python scripts/demo/demo_responses.py --trials 2
say 5 "Codex's /v1/responses, a session of tool calls (demo_responses.py --shape codex)"
.venv/bin/python scripts/demo/demo_responses.py --trials 2 --shape codex --num-ctx 1024
