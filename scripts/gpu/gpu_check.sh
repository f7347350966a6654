#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: NVML readings, llama-server with -ngl 99 on the bundled model,
# readings while it is loaded and after it stops, and ContextPaw's estimate beside the measured use.
# Set LLAMA_SERVER to a CUDA build of llama-server (the bundled build is CPU-only and portable).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/install/setup.sh
# gpu_check.py reuses the test support (tests/support/, imported as `support`): not part of the
# package, so it comes from PYTHONPATH, as under pytest (pyproject's pythonpath)
PYTHONPATH="$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" timeout 300 .venv/bin/python scripts/gpu/gpu_check.py "$@"
