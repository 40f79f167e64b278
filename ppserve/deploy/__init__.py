"""Many pipelines behind one endpoint, on Ray Serve (app.py builds the application).

app.py reads the arguments and binds the deployments; replica.py is one pipeline; ingress.py is the
one front door (HTTP through Serve's proxy, gRPC on its own port); router.py chooses a replica by
prefix (ppserve/route); merge.py folds the replicas' metrics and stats into the service's; kuberay.py
writes and checks KubeRay RayService manifests. Ray Serve is imported only when an application is
built, so the manifest tools need none of it.
"""

from __future__ import annotations

from typing import Any


def build_app(args: dict[str, Any] | None = None) -> Any:
    from ppserve.deploy.app import build_app as build

    return build(args)


def __getattr__(name: str) -> Any:
    if name == "app":  # `serve run ppserve.deploy:app`: the default config, one replica
        return build_app({})
    raise AttributeError(name)
