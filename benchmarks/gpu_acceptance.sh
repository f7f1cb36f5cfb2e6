#!/usr/bin/env bash
# Acceptance on real GPUs, one command: every demo at PP 1/2/4 with NCCL, lossless against the CPU, acceptance
# per position and tokens/s as JSON (benchmarks/gpu_acceptance.py says what and how). Exits 2 without a GPU;
# --device cpu runs the same path on the CPU.
# Relative paths (--json) are taken from where it is run; $PYTHON: the interpreter (default: python).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python}" -m benchmarks.gpu_acceptance "$@"
