#!/usr/bin/env bash
# The one-shot GPU check (ppserve/gpu_check/): environment, kernels, correctness at pp 1 and 2 against
# transformers, a serving run, decode/prefill rooflines and the gpu-marked tests, each phase in its own
# process under a time limit, the whole inside 8 minutes. Needs only torch (with its Triton),
# transformers and this checkout: no Ray, flash-attn, gguf or network. Models are built on the device
# from configs. Usage: benchmarks/gpu_check.sh [OUT_DIR] [--device cpu] [--phases a,b] [more options]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check_out}"
shift || true
exec python -m ppserve.gpu_check --out "$out" "$@"
