#!/usr/bin/env bash
# Provide the real agent CLIs the test suite drives, at pinned versions, and print their paths.
#
# Each one is installed once into its own folder of the per-user cache (npm install --prefix, never
# -g; aider into its own venv made with a Python 3.12) and then reused. The folder's name holds a
# hash of its recipe, so an install made by an earlier recipe is never reused. Every binary must
# prove it runs (`--version` exits 0) before it is printed; a cached one that fails is removed and
# installed again, once.
#
# stdout: one `name=path` line per agent (claude, opencode, codex, aider, qwen: Qwen Code's command).
# stderr: progress, errors. Exit 0: all printed. Exit 3: a registry could not be reached (the reason
# is on stderr, and callers may skip on it). Exit 1: anything else (a broken install, no Python 3.12).
#
#   get_agents.sh [NAME...]    only these agents (default: all five)
#   --no-install               print only what is cached and proven; never install (exit 1 otherwise)
#   --where                    print where each agent's cache folder is, and nothing else
set -euo pipefail

CACHE="${CONTEXTPAW_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/contextpaw}"
CLAUDE_CODE="@anthropic-ai/claude-code@2.1.332"
OPENCODE="opencode-ai@1.18.33"
CODEX="@openai/codex@0.171.0"
AIDER="aider-chat==0.86.2"
QWEN_CODE="@qwen-code/qwen-code@0.24.4" # its command is `qwen`
ALL=(claude opencode codex aider qwen)
UNREACHABLE=3

INSTALL=1 WHERE=0 WANTED=()
for arg in "$@"; do
  case "$arg" in
    --no-install) INSTALL=0 ;;
    --where) WHERE=1 ;;
    claude|opencode|codex|aider|qwen) WANTED+=("$arg") ;;
    *) echo "usage: get_agents.sh [--no-install | --where] [claude] [opencode] [codex] [aider] [qwen]" >&2; exit 2 ;;
  esac
done
(( ${#WANTED[@]} )) || WANTED=("${ALL[@]}")

pick_python312() { # a Python 3.12 (aider 0.86 does not support 3.13), as setup.sh's pick_python finds one
  for candidate in "${AIDER_PYTHON:-}" python3.12 python3; do
    [[ -n "$candidate" ]] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$candidate"; return
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    local v; v=$(pyenv versions --bare | grep -E '^3\.12' | head -n1 || true)
    [[ -n "$v" ]] && { echo "$(pyenv root)/versions/$v/bin/python3"; return; }
  fi
  return 1
}

key() { printf '%s' "$*" | sha256sum | cut -c1-12; }
ARCH="$(uname -m)"
NODE_MAJOR="$(node --version 2>/dev/null | sed -E 's/^v([0-9]+).*/\1/' || true)"

# Per agent: the recipe, the folder it makes and the binary in it.
recipe() {
  case "$1" in
    claude) echo "npm $CLAUDE_CODE node$NODE_MAJOR --omit=dev --no-audit --no-fund" ;;
    opencode) echo "npm $OPENCODE node$NODE_MAJOR --omit=dev --no-audit --no-fund" ;;
    codex) echo "npm $CODEX node$NODE_MAJOR --omit=dev --no-audit --no-fund" ;;
    qwen) echo "npm $QWEN_CODE node$NODE_MAJOR --omit=dev --no-audit --no-fund" ;;
    aider) echo "pip $AIDER $PY_VERSION venv" ;;
  esac
}
spec() { case "$1" in claude) echo "$CLAUDE_CODE" ;; opencode) echo "$OPENCODE" ;; codex) echo "$CODEX" ;; aider) echo "$AIDER" ;; qwen) echo "$QWEN_CODE" ;; esac; }
prefix() { local s; s="$(spec "$1")"; echo "$CACHE/agent-$1-${s##*[@=]}-$ARCH-$(key "$(recipe "$1")")"; }
binary() { case "$1" in aider) echo "$(prefix "$1")/venv/bin/aider" ;; *) echo "$(prefix "$1")/node_modules/.bin/$1" ;; esac; }

PY_VERSION="" PY312=""
for name in "${WANTED[@]}"; do
  if [[ $name == aider ]]; then
    if PY312="$(pick_python312)"; then
      PY_VERSION="$("$PY312" -c 'import platform; print(platform.python_version())')"
    elif (( ! WHERE )); then
      echo "aider needs a Python 3.12 (set AIDER_PYTHON, or install one with pyenv); none found" >&2; exit 1
    fi
  elif [[ -z $NODE_MAJOR ]] && (( ! WHERE )); then
    echo "$name needs node and npm on PATH; none found" >&2; exit 1
  fi
done

if (( WHERE )); then
  for name in "${WANTED[@]}"; do echo "$name=$(prefix "$name")"; done
  exit 0
fi

proves() { # $1: a binary; true when `--version` exits 0 within 60 s (its output goes to stderr)
  [[ -x "$1" && -f "$(dirname "$1")/../../recipe" ]] || return 1 # no recipe file: an install cut short
  local out code=0 home
  home="$(mktemp -d "${TMPDIR:-/tmp}/agent-proof.XXXXXX")" # whatever it writes at start goes there
  out="$(HOME="$home" XDG_CONFIG_HOME="$home" XDG_DATA_HOME="$home" XDG_CACHE_HOME="$home" DISABLE_AUTOUPDATER=1 \
    timeout 60 "$1" --version </dev/null 2>&1)" || code=$?
  rm -rf "$home"
  if (( code )); then echo "$1 --version exited $code: ${out: -500}" >&2; return 1; fi
  echo "${1##*/} --version: ${out##*$'\n'}" >&2
}

registry_reachable() { # $1: npm or pip; prints why not on stderr
  local out
  case "$1" in
    npm)
      out="$(timeout 30 npm ping --fetch-retries=0 --fetch-timeout=20000 2>&1)" && return 0
      out="$(tr -s ' \n' ' ' <<<"$out")"
      echo "the npm registry ($(npm config get registry 2>/dev/null)) cannot be reached: ${out:0:300}" >&2
      [[ -n $out ]] || echo "(npm ping got no answer in 30 s)" >&2 ;;
    pip)
      out="$(timeout 60 "$PY312" -m pip index versions aider-chat --disable-pip-version-check 2>&1)" && return 0
      out="$(tr -s ' \n' ' ' <<<"$out")"
      echo "PyPI cannot be reached (pip index versions aider-chat failed): ${out: -300}" >&2 ;;
  esac
  return 1
}

install() { # $1: agent name; installs into its folder, stamped complete only at the end
  local name="$1" dir started=$SECONDS log
  dir="$(prefix "$name")"
  rm -rf "$dir" && mkdir -p "$dir"
  log="$dir/install.log"
  echo "installing $(spec "$name") into $dir" >&2
  case "$name" in
    aider)
      registry_reachable pip || return $UNREACHABLE
      "$PY312" -m venv "$dir/venv" >"$log" 2>&1 &&
      "$dir/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$AIDER" >>"$log" 2>&1 || {
        tail -n 30 "$log" >&2; registry_reachable pip || return $UNREACHABLE; return 1; } ;;
    *)
      registry_reachable npm || return $UNREACHABLE
      # --prefix: a package.json and node_modules/ of this folder's own; no -g, nothing else touched
      printf '{"name":"contextpaw-agent-%s","private":true}\n' "$name" >"$dir/package.json"
      npm install --prefix "$dir" --omit=dev --no-audit --no-fund --loglevel=error "$(spec "$name")" >"$log" 2>&1 || {
        tail -n 30 "$log" >&2; registry_reachable npm || return $UNREACHABLE; return 1; } ;;
  esac
  recipe "$name" >"$dir/recipe"
  echo "installed $(spec "$name") in $((SECONDS - started)) s" >&2
}

provide() { # $1: agent name; install it (twice at most) until it proves itself. 3: unreachable
  local name="$1" attempt code
  for attempt in 1 2; do
    code=0; install "$name" || code=$?
    if (( code == UNREACHABLE )); then rm -rf "$(prefix "$name")"; return $UNREACHABLE; fi
    if (( code == 0 )) && proves "$(binary "$name")"; then return 0; fi
    rm -rf "$(prefix "$name")"
    (( attempt == 1 )) && echo "the fresh install of $name fails; installing once more" >&2
  done
  echo "$(spec "$name") could not be made to run here (see above)" >&2
  return 1
}

# Prove what is cached, all at once (each `--version` takes a second or two).
declare -A jobs
for name in "${WANTED[@]}"; do
  ( proves "$(binary "$name")" ) & jobs[$name]=$!
done
NEEDED=()
for name in "${WANTED[@]}"; do
  wait "${jobs[$name]}" && continue
  NEEDED+=("$name")
  [[ -e "$(prefix "$name")" ]] && echo "the cached $name at $(prefix "$name") fails --version; reinstalling" >&2
done
status=0
if (( ${#NEEDED[@]} )); then
  if (( ! INSTALL )); then
    echo "no cached install of ${NEEDED[*]} passes --version; run scripts/install/get_agents.sh" >&2; exit 1
  fi
  started=$SECONDS
  for name in "${NEEDED[@]}"; do ( provide "$name" ) & jobs[$name]=$!; done # npm and pip side by side
  for name in "${NEEDED[@]}"; do
    code=0; wait "${jobs[$name]}" || code=$?
    if (( code == UNREACHABLE )); then status=$UNREACHABLE; elif (( code && status != UNREACHABLE )); then status=1; fi
  done
  (( status )) || echo "installed ${NEEDED[*]} in $((SECONDS - started)) s" >&2
fi
(( status == 0 )) || exit $status
for name in "${WANTED[@]}"; do echo "$name=$(binary "$name")"; done
