# Shared settings for launch/*.sh (sourced, not run). Every value can be overridden from the environment.
#
# Ports are fixed (not random) so a firewall between the nodes can allow exactly these:
#   RAY_PORT (GCS), OBJECT_MANAGER_PORT, NODE_MANAGER_PORT, the worker port range, and the
#   torch.distributed ports the stages pick themselves (open the ephemeral range between nodes,
#   or run the nodes in one trusted network).

RAY_PORT="${RAY_PORT:-6379}"
OBJECT_MANAGER_PORT="${OBJECT_MANAGER_PORT:-8076}"
NODE_MANAGER_PORT="${NODE_MANAGER_PORT:-8077}"
MIN_WORKER_PORT="${MIN_WORKER_PORT:-10002}"
MAX_WORKER_PORT="${MAX_WORKER_PORT:-10999}"
# This node's address as the other nodes reach it (first address of `hostname -I` by default).
NODE_IP="${NODE_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}"
NODE_IP="${NODE_IP:-127.0.0.1}"
# Logical CPUs/GPUs offered to Ray; ppserve asks for parallel.cpus_per_worker / gpus_per_worker per actor.
NUM_CPUS="${NUM_CPUS:-$(nproc)}"
NUM_GPUS="${NUM_GPUS:-}"
# Pipeline stages this node may host, as custom resources: "stage0" or "stage0,stage1".
# ppserve pins stage s to nodes carrying parallel.stage_resources[s] (it asks for 0.01 of it per actor,
# so one label of 1 admits all TP ranks of the stage).
STAGES="${STAGES:-}"

# Token authentication (Ray 2.60: on by default). Keep it on for real clusters.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

stage_resources_json() {
  # "stage0,stage1" -> {"stage0": 1, "stage1": 1}
  local out="" name
  IFS=',' read -ra names <<< "$STAGES"
  for name in "${names[@]}"; do
    [ -n "$name" ] || continue
    out="${out:+$out, }\"$name\": 1"
  done
  echo "{${out}}"
}

gpu_args() {
  if [ -n "$NUM_GPUS" ]; then echo "--num-gpus=$NUM_GPUS"; fi
}
