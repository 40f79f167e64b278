"""The Ray Serve application: `build_app(args)` is what `serve run ppserve.deploy:build_app`, a Serve
config's `import_path` and `ppserve serve --replicas N` load.

args (all optional): `config` (a ppserve YAML path or the same mapping inline), `set` (a list of
`section.key=value` overrides), `replicas` (a count, or "auto" with `min_replicas`, `max_replicas` and
`target_ongoing_requests` for Serve's autoscaler), `routing` ("prefix", "round-robin" or
"power-of-two"), `grpc_port` (-1: no gRPC) and `grpc_host`. The config is read and checked here, in
the process that builds the application, so a bad one fails before any replica starts, and replicas
need no copy of the file.

Each replica is one pipeline. `parallel.executor: auto` becomes `ray` in a replica, so its stages are
actors in placement groups of their own (as a single server places them) and the replica process holds
no device; with `inproc` the replica runs the model itself and claims the stage's CPUs (and GPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ppserve.config import EngineConfig, load_config, parse_overrides
from ppserve.route import POLICIES

ARG_KEYS = {"config", "set", "replicas", "min_replicas", "max_replicas", "target_ongoing_requests",
            "routing", "grpc_port", "grpc_host"}
DEFAULT_TARGET_ONGOING = 32  # requests per replica the autoscaler aims at


def read_args(args: dict[str, Any] | None) -> dict[str, Any]:
    """The checked settings: the config as a mapping (with replica defaults), the replica count or
    autoscaling bounds, the routing policy and the gRPC address."""
    args = dict(args or {})
    unknown = sorted(set(args) - ARG_KEYS)
    if unknown:
        raise ValueError(f"unknown ppserve.deploy argument(s) {', '.join(unknown)}; "
                         f"expected some of {', '.join(sorted(ARG_KEYS))}")
    config = args.get("config") or {}
    if isinstance(config, (str, Path)):
        loaded = yaml.safe_load(Path(config).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {config} must hold a mapping of sections")
        config = loaded
    if not isinstance(config, dict):
        raise ValueError(f"config must be a YAML path or a mapping, got {type(config).__name__}")
    overrides = args.get("set") or []
    if isinstance(overrides, str):
        overrides = [overrides]
    parse_overrides(list(overrides))
    cfg = load_config(extra=config, overrides=list(overrides))
    replicas = args.get("replicas", 1)
    if isinstance(replicas, str) and replicas.isdigit():  # `serve run ... replicas=2` passes text
        replicas = int(replicas)
    settings: dict[str, Any] = {"config": config, "set": list(overrides),
                                "routing": args.get("routing", "prefix"),
                                "grpc_port": int(args.get("grpc_port", cfg.server.port)),
                                "grpc_host": args.get("grpc_host") or cfg.server.host}
    if settings["routing"] not in POLICIES:
        raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {settings['routing']!r}")
    if replicas == "auto":
        lo, hi = int(args.get("min_replicas", 1)), int(args.get("max_replicas", 1))
        target = float(args.get("target_ongoing_requests", DEFAULT_TARGET_ONGOING))
        if not 1 <= lo <= hi or target <= 0:
            raise ValueError(f"replicas=auto needs 1 <= min_replicas <= max_replicas and "
                             f"target_ongoing_requests > 0; got {lo}, {hi}, {target}")
        settings["autoscaling"] = {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": target}
    else:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be a count >= 1 or 'auto', got {replicas!r}")
        settings["replicas"] = replicas
    return settings


def replica_actor_options(cfg: EngineConfig) -> dict[str, Any]:
    if cfg.parallel.executor == "inproc":
        return {"num_cpus": cfg.parallel.cpus_per_worker, "num_gpus": cfg.parallel.gpus_per_worker or 0}
    return {"num_cpus": 0}


def replica_config(settings: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The config and overrides each replica loads: `auto` executors become `ray`."""
    overrides = list(settings["set"])
    if load_config(extra=settings["config"], overrides=overrides).parallel.executor == "auto":
        overrides.append("parallel.executor=ray")
    return settings["config"], overrides


def build_app(args: dict[str, Any] | None = None) -> Any:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    router_config: Any = RequestRouterConfig  # pydantic: its fields confuse mypy's view of __init__
    deployment: Any = serve.deployment

    from ppserve.deploy.ingress import PPServeIngress
    from ppserve.deploy.replica import PipelineReplica
    settings = read_args(args)
    config, overrides = replica_config(settings)
    cfg = load_config(extra=config, overrides=overrides)
    sched = cfg.scheduler
    options: dict[str, Any] = {
        "name": "PipelineReplica",
        # Admission is the engine's (its running and waiting bounds); the pinned calls need room too.
        "max_ongoing_requests": sched.max_num_seqs + sched.max_waiting + 16,
        "graceful_shutdown_timeout_s": cfg.server.grace_seconds,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "ray_actor_options": replica_actor_options(cfg),
        "request_router_config": router_config(
            request_router_class="ppserve.deploy.router.PipelineRouter",
            request_router_kwargs={"policy": settings["routing"]},
            request_routing_stats_period_s=0.5, request_routing_stats_timeout_s=5.0),
    }
    if "autoscaling" in settings:
        options["autoscaling_config"] = settings["autoscaling"]
    else:
        options["num_replicas"] = settings["replicas"]
    replica = deployment(PipelineReplica).options(**options).bind(config, overrides)
    ingress = deployment(PPServeIngress).options(
        name="PPServeIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=options["max_ongoing_requests"] * 4)
    return ingress.bind(replica, settings)
