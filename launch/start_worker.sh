#!/usr/bin/env bash
# Join a worker node to the ppserve cluster (run on each worker machine).
#
#   HEAD=10.0.0.1:6379 STAGES=stage1 launch/start_worker.sh
#
# Needs the head's token: ~/.ray/auth_token copied from the head, or RAY_AUTH_TOKEN /
# RAY_AUTH_TOKEN_PATH in the environment (see launch/README.md).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$here/common.sh"

: "${HEAD:?set HEAD=host:port of the Ray head (e.g. 10.0.0.1:6379)}"
if [ -z "${RAY_AUTH_TOKEN:-}" ] && [ ! -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; then
  echo "no Ray auth token: copy ~/.ray/auth_token from the head, or set RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH" >&2
  exit 1
fi

# shellcheck disable=SC2046
ray start \
  --address="$HEAD" \
  --node-ip-address="$NODE_IP" \
  --object-manager-port="$OBJECT_MANAGER_PORT" \
  --node-manager-port="$NODE_MANAGER_PORT" \
  --min-worker-port="$MIN_WORKER_PORT" --max-worker-port="$MAX_WORKER_PORT" \
  --num-cpus="$NUM_CPUS" $(gpu_args) \
  --resources="$(stage_resources_json)" \
  --disable-usage-stats

echo "joined $HEAD as $NODE_IP with stage labels: $(stage_resources_json)"
