"""`ppserve serve --replicas N`: the Serve application on this Ray cluster (or an embedded one), until
SIGINT or SIGTERM; then the application is deleted, which drains every replica (Serve lets each finish
its requests for up to server.grace_seconds) before the pipelines are torn down.

It prints the same ready lines as one server, so scripts that wait for them work unchanged.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Any

from ppserve.config import load_config

APP_NAME = "ppserve"


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def run_replicas(args: dict[str, Any]) -> int:
    import ray
    from ray import serve

    from ppserve.deploy.app import build_app, read_args, replica_config
    from ppserve.engine.ray_executor import ray_single_machine_mode

    settings = read_args(args)
    config, overrides = replica_config(settings)
    cfg = load_config(extra=config, overrides=overrides)
    host = cfg.server.host
    http_host = cfg.server.http_host or host
    if settings["grpc_port"] == 0:
        args = {**args, "grpc_port": free_port(host)}
    grpc_port = int(args.get("grpc_port", cfg.server.port))
    http_port = cfg.server.http_port if cfg.server.http_port != 0 else free_port(http_host)
    owns_ray = not ray.is_initialized()
    if owns_ray:
        if cfg.parallel.ray_address:
            ray.init(address=cfg.parallel.ray_address)
        else:
            count = settings.get("replicas") or settings["autoscaling"]["max_replicas"]
            need = int(count * cfg.parallel.world_size * max(cfg.parallel.cpus_per_worker, 1.0))
            with ray_single_machine_mode():
                ray.init(address="local", num_cpus=max(need, os.cpu_count() or 1), include_dashboard=False,
                         _node_ip_address="127.0.0.1")
    http_options: dict[str, Any] = {"host": http_host, "port": max(http_port, 0)}
    if cfg.server.tls_cert and cfg.server.tls_key:
        http_options.update(ssl_certfile=cfg.server.tls_cert, ssl_keyfile=cfg.server.tls_key)
    serve.start(http_options=http_options, proxy_location="Disabled" if http_port < 0 else "HeadOnly")
    try:
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
        if http_port >= 0:
            scheme = "https" if "ssl_certfile" in http_options else "http"
            print(f"ppserve OpenAI API on {scheme}://{http_host}:{http_port}/v1", flush=True)
        if grpc_port >= 0:
            print(f"ppserve serving on {host}:{grpc_port}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        serve.delete(APP_NAME)  # drains: each replica finishes its requests first
    finally:
        serve.shutdown()
        if owns_ray:
            ray.shutdown()
        print("ppserve stopped", file=sys.stderr, flush=True)
    return 0
