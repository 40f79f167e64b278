#!/usr/bin/env bash
# The one-shot GPU check (ppserve/gpu_check.py): gpu tests, the default model at pp=1 and pp=2 with CUDA
# graphs against transformers in bf16, start-up memory, decode steps by CUDA events, and throughput on a
# Llama-3-8B-shaped random model. Needs only torch (with its Triton) and this package: no Ray, no
# flash-attn, no network. Usage: benchmarks/gpu_check.sh [OUT_DIR] [--device cpu] [more options]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check_out}"
shift || true
exec python -m ppserve.gpu_check --out "$out" "$@"
