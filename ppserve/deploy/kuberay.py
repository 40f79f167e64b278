"""KubeRay RayService manifests for the Serve application: build one for a plan's winner, check one.

The fields are those of KubeRay v1.4's `ray.io/v1` RayService CRD (the v1.4.2 release), a subset ppserve
uses; each of them is also in later releases. The check is an allow-list because the API server prunes
fields its schema does not know without a word: a misspelt `minReplica` or `rayStartParam` would be
dropped and the cluster started without it. The PodTemplateSpec part lists only the Kubernetes fields
these manifests use; add a field here (checked against the CRD) before a manifest may use it.

Pure Python (yaml and ppserve.config): no Ray import, so `ppserve plan` and the tests use it anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from ppserve.config import load_config

__all__ = ["KUBERAY_VERSION", "RAY_VERSION", "INGRESS_RESOURCE", "check_rayservice", "embedded_configs",
           "rayservice_manifest", "serve_config", "dump_manifest"]

KUBERAY_VERSION = "v1.4"  # the CRD these fields follow
RAY_VERSION = "2.60.0"  # the Ray the images install; KubeRay reads it as rayClusterConfig.rayVersion
API_VERSION = "ray.io/v1"
IMPORT_PATH = "ppserve.deploy:build_app"
HTTP_PORT = 8000  # Serve's proxy: KubeRay's <name>-serve-svc exposes the head container's port named "serve"
GRPC_PORT = 50051  # ppserve's own gRPC API, served by the ingress replica
# A custom Ray resource only the head pod offers: the ingress asks for it, so the gRPC port is on the head
# and the RayService's <name>-head-svc (every named port of the head container) reaches it.
INGRESS_RESOURCE = "ppserve_ingress"
MAX_NAME = 47  # KubeRay: its cluster takes the name plus 6 characters, and that plus "-serve-svc" fits 63
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
UPGRADE_TYPES = ("NewCluster", "None")  # v1.4's RayService upgrade strategies
HOST_CPUS_PER_GPU, HOST_GI_PER_GPU = 8.0, 32  # a GPU pod's CPUs and memory (GiB) per GPU


ANY = "any"  # a value not checked further (a scalar, a list of strings, a quantity)
STRINGS = "strings"  # map[string]string: any keys, string values (labels, rayStartParams)


@dataclass(frozen=True)
class Obj:
    """An object's allowed fields (name: spec), those the CRD requires, and deprecated ones."""

    fields: Mapping[str, Spec]
    required: frozenset[str] = frozenset()
    deprecated: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ListOf:
    item: Spec


Spec = Obj | ListOf | str


def _obj(*names: str, required: tuple[str, ...] = (), deprecated: Mapping[str, str] | None = None,
         **nested: Spec) -> Obj:
    """An Obj whose plain fields are ANY and whose `nested` ones have their own spec."""
    return Obj({**dict.fromkeys(names, ANY), **nested}, frozenset(required), deprecated or {})


RESOURCES = _obj("limits", "requests")
CONTAINER = _obj(
    "name", "image", "imagePullPolicy", "command", "args", "workingDir", required=("name",),
    env=ListOf(_obj("name", "value", required=("name",))),
    ports=ListOf(_obj("name", "containerPort", "protocol", required=("containerPort",))),
    resources=RESOURCES,
    volumeMounts=ListOf(_obj("name", "mountPath", "readOnly", "subPath", required=("name", "mountPath"))),
    securityContext=_obj("runAsUser", "runAsGroup", "runAsNonRoot", "allowPrivilegeEscalation"),
)
VOLUME = _obj("name", required=("name",), emptyDir=_obj("medium", "sizeLimit"),
              persistentVolumeClaim=_obj("claimName", "readOnly", required=("claimName",)),
              secret=_obj("secretName", "optional"))
POD_TEMPLATE = _obj(
    metadata=_obj(labels=STRINGS, annotations=STRINGS),
    spec=_obj("serviceAccountName", "terminationGracePeriodSeconds", "priorityClassName",
              required=("containers",),
              containers=ListOf(CONTAINER), volumes=ListOf(VOLUME), nodeSelector=STRINGS,
              tolerations=ListOf(_obj("key", "operator", "value", "effect", "tolerationSeconds")),
              securityContext=_obj("runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup")),
)
HEAD_GROUP = _obj("serviceType", required=("template",), rayStartParams=STRINGS, template=POD_TEMPLATE)
WORKER_GROUP = _obj("groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts", "idleTimeoutSeconds",
                    required=("groupName", "minReplicas", "maxReplicas", "template"),
                    rayStartParams=STRINGS, template=POD_TEMPLATE)
RAYCLUSTER_SPEC = _obj(
    "rayVersion", "enableInTreeAutoscaling", required=("headGroupSpec",),
    autoscalerOptions=_obj("upscalingMode", "idleTimeoutSeconds", "version", resources=RESOURCES),
    headGroupSpec=HEAD_GROUP, workerGroupSpecs=ListOf(WORKER_GROUP),
)
_UNUSED = "deprecated in KubeRay and not read by the operator"
RAYSERVICE = _obj(
    "apiVersion", "kind", required=("apiVersion", "kind", "metadata", "spec"),
    metadata=_obj("name", "namespace", required=("name",), labels=STRINGS, annotations=STRINGS),
    spec=_obj("serveConfigV2", "excludeHeadPodFromServeSvc", required=("rayClusterConfig",),
              deprecated={"serviceUnhealthySecondThreshold": _UNUSED,
                          "deploymentUnhealthySecondThreshold": _UNUSED},
              upgradeStrategy=_obj("type"), rayClusterConfig=RAYCLUSTER_SPEC),
)


def _walk(value: Any, spec: Spec, path: str, problems: list[str]) -> None:
    if isinstance(spec, Obj):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return
        for key, sub in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key in spec.deprecated:
                problems.append(f"{where}: {spec.deprecated[key]}")
            elif key not in spec.fields:
                problems.append(f"{where}: unknown field (not in ppserve's allow-list of the KubeRay "
                                f"{KUBERAY_VERSION} RayService CRD)")
            else:
                _walk(sub, spec.fields[key], where, problems)
        problems.extend(f"{path}.{key}: required" if path else f"{key}: required"
                        for key in sorted(spec.required - set(value)))
    elif isinstance(spec, ListOf):
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            _walk(item, spec.item, f"{path}[{i}]", problems)
    elif spec == STRINGS:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping of strings, got {type(value).__name__}")
            return
        problems.extend(f"{path}.{k}: must be a string (quote it), got {type(v).__name__}"
                        for k, v in value.items() if not isinstance(v, str))


def _serve_problems(text: Any) -> list[str]:
    where = "spec.serveConfigV2"
    if not isinstance(text, str):
        return [f"{where}: must be a YAML string (a block scalar, `serveConfigV2: |`), got "
                f"{type(text).__name__}"]
    try:
        serve = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return [f"{where}: not valid YAML: {e}"]
    apps = serve.get("applications") if isinstance(serve, dict) else None
    if not isinstance(apps, list) or not apps:
        return [f"{where}: needs a non-empty `applications` list"]
    problems = []
    for i, app in enumerate(apps):
        if not isinstance(app, dict):
            problems.append(f"{where}.applications[{i}]: expected a mapping")
            continue
        if not isinstance(app.get("import_path"), str) or not app["import_path"]:
            problems.append(f"{where}.applications[{i}].import_path: required (module:attribute)")
        if not isinstance(app.get("args", {}), dict):
            problems.append(f"{where}.applications[{i}].args: expected a mapping")
    return problems


def _templates(spec: Mapping[str, Any]) -> list[tuple[str, Any]]:
    cluster = spec.get("rayClusterConfig") or {}
    found = [("spec.rayClusterConfig.headGroupSpec", (cluster.get("headGroupSpec") or {}))]
    groups = cluster.get("workerGroupSpecs") or []
    found += [(f"spec.rayClusterConfig.workerGroupSpecs[{i}]", g) for i, g in enumerate(groups)]
    return [(p, g) for p, g in found if isinstance(g, dict)]


def check_rayservice(doc: Any) -> list[str]:
    """The problems of a RayService manifest, each with its field's path; [] when there is none."""
    if not isinstance(doc, dict):
        return [f"expected a mapping (one RayService document), got {type(doc).__name__}"]
    problems: list[str] = []
    if doc.get("apiVersion") != API_VERSION:
        problems.append(f"apiVersion: must be {API_VERSION}, got {doc.get('apiVersion')!r}")
    if doc.get("kind") != "RayService":
        problems.append(f"kind: must be RayService, got {doc.get('kind')!r}")
    _walk(doc, RAYSERVICE, "", problems)
    name = (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), dict) else None
    if isinstance(name, str) and (len(name) > MAX_NAME or not DNS1035.fullmatch(name)):
        problems.append(f"metadata.name: {name!r} must be a DNS-1035 label of at most {MAX_NAME} characters")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return problems
    problems += _serve_problems(spec.get("serveConfigV2"))
    upgrade = spec.get("upgradeStrategy")
    if isinstance(upgrade, dict) and upgrade.get("type") not in (None, *UPGRADE_TYPES):
        problems.append(f"spec.upgradeStrategy.type: one of {', '.join(UPGRADE_TYPES)}, "
                        f"got {upgrade['type']!r}")
    for path, group in _templates(spec):
        pod = (group.get("template") or {}).get("spec") if isinstance(group.get("template"), dict) else None
        containers = pod.get("containers") if isinstance(pod, dict) else None
        if not isinstance(containers, list) or not containers:
            problems.append(f"{path}.template.spec.containers: needs at least one container (the Ray one)")
            continue
        if path.endswith("headGroupSpec"):
            ports = containers[0].get("ports") if isinstance(containers[0], dict) else None
            if not any(isinstance(p, dict) and p.get("name") == "serve" for p in ports or []):
                problems.append(f"{path}.template.spec.containers[0].ports: needs a port named 'serve' "
                                "(KubeRay builds the serve service from it)")
        else:
            counts = [group.get(k) for k in ("minReplicas", "replicas", "maxReplicas")]
            if all(isinstance(c, int) for c in counts) and not counts[0] <= counts[1] <= counts[2]:
                problems.append(f"{path}: needs minReplicas <= replicas <= maxReplicas, got {counts}")
    return problems


def embedded_configs(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each Serve application's `args` in the manifest's serveConfigV2 (ppserve's: config, replicas, ...)."""
    text = (doc.get("spec") or {}).get("serveConfigV2")
    if not isinstance(text, str):
        raise ValueError("spec.serveConfigV2 is not a YAML string")
    serve = yaml.safe_load(text)
    if not isinstance(serve, dict) or not isinstance(serve.get("applications"), list):
        raise ValueError("spec.serveConfigV2 has no `applications` list")
    return [dict(app.get("args") or {}) for app in serve["applications"]]


def serve_config(engine_config: Mapping[str, Any], replicas: int, routing: str = "prefix",
                 grpc_port: int = GRPC_PORT) -> dict[str, Any]:
    """The Ray Serve config (serveConfigV2) of one ppserve application with this engine config.

    The ingress's ray_actor_options here replace the code's whole (Serve's rule for config overrides), so
    they restate its num_cpus 0 next to the head-only resource. The gRPC server binds all addresses in the
    pod (server.host) unless the config says otherwise."""
    config = {section: dict(values) if isinstance(values, Mapping) else values
              for section, values in engine_config.items()}
    config.setdefault("server", {}).setdefault("host", "0.0.0.0")
    app = {"name": "ppserve", "import_path": IMPORT_PATH, "route_prefix": "/",
           "args": {"config": config, "replicas": replicas, "routing": routing, "grpc_port": grpc_port},
           "deployments": [{"name": "PPServeIngress",
                            "ray_actor_options": {"num_cpus": 0, "resources": {INGRESS_RESOURCE: 1}}}]}
    return {"proxy_location": "EveryNode", "http_options": {"host": "0.0.0.0", "port": HTTP_PORT},
            "applications": [app]}


def worker_shape(pp: int, tp: int, replicas: int, gpus_per_node: int, nodes: int) -> tuple[int, int]:
    """(devices per worker pod, worker pods) for `replicas` pipelines of pp x tp devices.

    A pod is one Ray node and lives on one machine, and a stage's TP ranks share a Ray node, so a pod
    holds whole stages: tp x k devices, k the largest divisor of pp that fits a machine. A pipeline that
    fits a machine is then one pod (k = pp), and one that does not spans pp / k pods with no device left
    idle. Pods, not replicas, are the unit Kubernetes places, so each machine takes gpus_per_node // size
    of them; the plan's count must fit that."""
    if min(pp, tp, replicas, gpus_per_node, nodes) < 1:
        raise ValueError(f"pp, tp, replicas, gpus_per_node and nodes must be >= 1, got "
                         f"{pp}, {tp}, {replicas}, {gpus_per_node}, {nodes}")
    if tp > gpus_per_node:
        raise ValueError(f"tp {tp} does not fit a machine of {gpus_per_node} devices "
                         "(a stage's ranks share one)")
    k = max(d for d in range(1, pp + 1) if pp % d == 0 and tp * d <= gpus_per_node)
    size, pods = tp * k, replicas * (pp // k)
    room = nodes * (gpus_per_node // size)
    if pods > room:
        raise ValueError(f"{pods} worker pods of {size} devices do not fit {nodes} machines of "
                         f"{gpus_per_node} ({room} at most)")
    return size, pods


def _container(name: str, image: str, ports: Mapping[str, int], cpu: float, memory_gi: int,
               devices: Mapping[str, int]) -> dict[str, Any]:
    amounts = {"cpu": f"{cpu:g}", "memory": f"{memory_gi}Gi", **{k: v for k, v in devices.items()}}
    return {"name": name, "image": image, "imagePullPolicy": "IfNotPresent",
            "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
            "resources": {"limits": dict(amounts), "requests": dict(amounts)},
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}


def _template(container: dict[str, Any], tolerate: str | None) -> dict[str, Any]:
    # /dev/shm as memory: Ray's object store lives there and a container's default is small.
    spec: dict[str, Any] = {"containers": [container],
                            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}
    if tolerate:  # machines with accelerators are often tainted with the resource's name
        spec["tolerations"] = [{"key": tolerate, "operator": "Exists", "effect": "NoSchedule"}]
    return {"spec": spec}


def rayservice_manifest(name: str, image: str, engine_config: dict[str, Any], replicas: int, pp: int, tp: int,
                        gpus_per_node: int, nodes: int, routing: str = "prefix", *,
                        accelerator: str | None = "nvidia.com/gpu") -> dict[str, Any]:
    """A RayService running `replicas` pipelines of `engine_config` (pp x tp, its layer split kept).

    Worker pods are sized by `worker_shape`; each asks `accelerator` devices (None: the devices are CPU
    cores, as the planner's cpu hardware counts them, and the pod asks parallel.cpus_per_worker CPUs for
    each). Requests equal limits, so the pods get the Guaranteed QoS class; the CPU and memory beside each
    accelerator are a starting point to fit to the machines. The head runs no stage (num-cpus 0) and
    offers the ingress its resource. The result passes `check_rayservice` (or this raises ValueError)."""
    cfg = load_config(extra=engine_config)
    if (cfg.parallel.pipeline_parallel_size, cfg.parallel.tensor_parallel_size) != (pp, tp):
        raise ValueError(f"the engine config is pp {cfg.parallel.pipeline_parallel_size} x tp "
                         f"{cfg.parallel.tensor_parallel_size}, the manifest was asked for pp {pp} x tp {tp}")
    size, pods = worker_shape(pp, tp, replicas, gpus_per_node, nodes)
    if accelerator:
        head_cpu, head_mem, devices = 4.0, 16, {accelerator: size}
        cpu, mem = size * max(HOST_CPUS_PER_GPU, cfg.parallel.cpus_per_worker), HOST_GI_PER_GPU * size
    else:
        head_cpu, head_mem, devices = 2.0, 4, {}
        cpu, mem = size * cfg.parallel.cpus_per_worker + 1, 2 * size + 2
    head_ports = {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": HTTP_PORT,
                  "ppserve-grpc": GRPC_PORT}
    head = {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0",
                               "resources": f'"{{\\"{INGRESS_RESOURCE}\\": 1}}"'},
            "template": _template(_container("ray-head", image, head_ports, head_cpu, head_mem, {}), None)}
    worker = {"groupName": "pipelines", "replicas": pods, "minReplicas": pods, "maxReplicas": pods,
              "rayStartParams": {},
              "template": _template(_container("ray-worker", image, {"serve": HTTP_PORT}, cpu, mem, devices),
                                    accelerator)}
    doc = {"apiVersion": API_VERSION, "kind": "RayService", "metadata": {"name": name},
           "spec": {"upgradeStrategy": {"type": "NewCluster"},
                    "serveConfigV2": yaml.safe_dump(serve_config(engine_config, replicas, routing),
                                                    sort_keys=False),
                    "rayClusterConfig": {"rayVersion": RAY_VERSION, "headGroupSpec": head,
                                         "workerGroupSpecs": [worker]}}}
    problems = check_rayservice(doc)
    if problems:
        raise ValueError("the manifest does not check: " + "; ".join(problems))
    return doc


def _str(dumper: Any, text: str) -> Any:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


# Multi-line strings (serveConfigV2) as `|` blocks, the way people write and read them.
_BlockDumper: Any = type("_BlockDumper", (yaml.SafeDumper,), {})
_BlockDumper.add_representer(str, _str)


def dump_manifest(doc: Mapping[str, Any]) -> str:
    return str(yaml.dump(dict(doc), Dumper=_BlockDumper, sort_keys=False))
