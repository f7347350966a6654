#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: NVML readings, llama-server with -ngl 99 on the bundled model,
# readings while it is loaded and after it stops, and ContextPaw's estimate beside the measured use.
# Set LLAMA_SERVER to a CUDA build of llama-server (the bundled build is CPU-only and portable).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
timeout 300 .venv/bin/python scripts/gpu_check.py "$@"
