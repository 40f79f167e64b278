"""The import graph, read from the source: the layer order of ARCHITECTURE.md#layers holds and no module
imports itself back."""

from __future__ import annotations

import ast
from pathlib import Path

import ppserve

ROOT = Path(ppserve.__file__).parent

# Lowest first. A module may import its own package and any package of a lower layer, nothing else
# (packages sharing a layer are independent of each other). The base is importable from anywhere.
LAYERS: list[set[str]] = [
    {"structured"},  # what a request's output must match (pure Python) and the grammar library behind it
    {"config", "request", "cache", "metrics"},  # the base: pure Python
    {"sched", "comm", "model"},  # the scheduler (pure), stage-to-stage transport, the model
    {"worker", "route"},  # one stage: model + transport + the scheduler's output types; routing policies
    {"engine"},  # the step loop, executors, control planes, the asyncio bridge
    {"sim"},  # the simulator
    {"timeline"},
    {"server"},  # gRPC and HTTP front doors, the demo
    {"deploy"},  # replicas on Ray Serve behind the front doors; KubeRay manifests
    {"bench", "plan"},  # measurement tools, the planner
    {"gpu_check"},  # the one-shot GPU check (its serving phase replays through the bench harness)
    {"cli", "tools"},  # the command line; developer tools (the configuration reference writer)
]
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
# The one allowed upward import: ppserve.LLM, resolved lazily (ppserve/__init__.py's __getattr__).
# And `ppserve serve --replicas N`, whose command line lives with the single server's, hands off to the
# Serve application (resolved when that flag is given).
ALLOWED = {("ppserve", "ppserve.engine.llm"), ("ppserve.server.cli", "ppserve.deploy.local")}


def module_name(path: Path) -> str:
    parts = ("ppserve", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every module's ppserve imports, module level and inside functions alike."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        if "gen" in path.relative_to(ROOT).parts:
            continue  # generated protobuf code
        mod = module_name(path)
        deps = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ppserve"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("ppserve"))
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "ppserve"


def test_every_package_has_a_layer():
    assert {package(m) for m in import_graph()} - {"ppserve"} <= set(LEVEL)


def test_imports_follow_the_layer_order():
    bad = []
    for mod, deps in import_graph().items():
        for dep in deps:
            a, b = package(mod), package(dep)
            if a == b or (mod, dep) in ALLOWED:
                continue
            # the root re-exports the base
            if (LEVEL[b] > LEVEL["request"] if a == "ppserve" else LEVEL[b] >= LEVEL[a]):
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports against the layer order (ARCHITECTURE.md#layers):\n" + "\n".join(sorted(bad))


def test_no_import_cycle():
    graph = import_graph()
    # A package's __init__ re-exports its own modules; the edge from a module to its package's
    # __init__ is an import of a sibling, which is what the cycle would be through.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(d):], d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
