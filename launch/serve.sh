#!/usr/bin/env bash
# Serve the ppserve gRPC API and the OpenAI-compatible HTTP API (with /metrics) on an existing Ray
# cluster (run on the head node).
#
#   PP=2 STAGE_RESOURCES=stage0,stage1 launch/serve.sh [--config configs/x.yaml] [--set k=v ...]
#
# Binds 127.0.0.1 unless HOST says otherwise: expose the API deliberately (HOST=0.0.0.0 behind a
# firewall or a TLS-terminating proxy). Extra arguments go to `ppserve serve`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$here/common.sh"

HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-50051}"
HTTP_PORT="${HTTP_PORT:-8000}"  # -1 turns the HTTP API off
PP="${PP:-2}"
TP="${TP:-1}"
RAY_ADDRESS="${RAY_ADDRESS:-auto}"

args=(--host "$HOST" --port "$PORT" --http-port "$HTTP_PORT" --ray-address "$RAY_ADDRESS"
      --set "parallel.pipeline_parallel_size=$PP" --set "parallel.tensor_parallel_size=$TP")
if [ -n "${STAGE_RESOURCES:-}" ]; then
  args+=(--set "parallel.stage_resources=[$STAGE_RESOURCES]")
fi
if [ -n "$NUM_GPUS" ] && [ "$NUM_GPUS" != "0" ]; then
  args+=(--set "parallel.gpus_per_worker=1")
fi
exec ppserve serve "${args[@]}" "$@"
