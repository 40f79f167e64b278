#!/usr/bin/env bash
# Start the Ray head node of a ppserve cluster (run on the head machine).
#
#   STAGES=stage0 launch/start_head.sh
#
# Creates the cluster's authentication token (~/.ray/auth_token) if none exists and prints how
# workers get it. Environment overrides: see launch/common.sh.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$here/common.sh"

# The token must exist before `ray start`: every node and driver presents it.
ray get-auth-token --generate > /dev/null

# shellcheck disable=SC2046
ray start --head \
  --node-ip-address="$NODE_IP" \
  --port="$RAY_PORT" \
  --object-manager-port="$OBJECT_MANAGER_PORT" \
  --node-manager-port="$NODE_MANAGER_PORT" \
  --min-worker-port="$MIN_WORKER_PORT" --max-worker-port="$MAX_WORKER_PORT" \
  --num-cpus="$NUM_CPUS" $(gpu_args) \
  --resources="$(stage_resources_json)" \
  --include-dashboard=false \
  --disable-usage-stats

cat <<MSG

Ray head is up at $NODE_IP:$RAY_PORT with stage labels: $(stage_resources_json)
Workers need this cluster's token (file ~/.ray/auth_token on this machine). Copy it over a
channel you trust, for example:
    scp ~/.ray/auth_token WORKER:~/.ray/auth_token && ssh WORKER chmod 600 ~/.ray/auth_token
or export it in the worker's environment:  RAY_AUTH_TOKEN="\$(cat token)"  (or RAY_AUTH_TOKEN_PATH=FILE).
Then on each worker:  HEAD=$NODE_IP:$RAY_PORT STAGES=stage1 launch/start_worker.sh
MSG
