"""Two Ray nodes on one machine: stages pinned to different nodes by custom resources, served over gRPC.

RUNS IN A SUBPROCESS. This test needs its own Ray cluster (`ray.cluster_utils.Cluster`, a head
labelled {"stage0": 1} and a second node labelled {"stage1": 1}), while other tests share the
session's local Ray (tests/conftest.py `ray_session`). A driver attaches to one Ray at a time, so the
cluster, the engine and the gRPC server live in a child process (`_child_main` below), which
reports JSON on its last stdout line; the parent checks placement and compares the tokens with
transformers' greedy output on the same tiny random model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MAX_TOKENS = 12
PROMPTS = [[1, 17, 42, 99, 7], [1, 200, 3, 3, 150, 8, 64, 12, 77], [5]]
REPO_ROOT = Path(__file__).resolve().parents[2]


def _child_main(model_dir: str) -> dict[str, Any]:
    import asyncio
    import dataclasses

    import ray
    from ray.cluster_utils import Cluster

    from ppserve.config import load_config
    from ppserve.engine.async_engine import AsyncEngine
    from ppserve.engine.stats import EngineStats
    from ppserve.server.client import AsyncPPServeClient
    from ppserve.server.server import start_server

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"stage0": 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"stage1": 1})
    cluster.wait_for_nodes()
    engine = None
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        labelled = {
            res: n["NodeID"]
            for n in ray.nodes()
            if n["Alive"]
            for res in ("stage0", "stage1")
            if res in n["Resources"]
        }
        config = load_config(
            None,
            [],
            {
                "model": {"model": model_dir, "dtype": "float32"},
                "parallel": {
                    "pipeline_parallel_size": 2,
                    "executor": "ray",
                    "stage_resources": ["stage0", "stage1"],
                },
                "cache": {"num_blocks": 64},
            },
        )
        engine = AsyncEngine.build(config)

        async def serve_and_query() -> tuple[list[list[int]], EngineStats]:
            running = await start_server(engine, "127.0.0.1", 0)
            try:
                async with AsyncPPServeClient(running.address) as client:
                    outs = await asyncio.gather(
                        *(client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True) for p in PROMPTS)
                    )
                    stats = await client.stats()
            finally:
                await running.stop(grace_s=2.0)
            return [o.token_ids for o in outs], stats

        tokens, stats = asyncio.run(serve_and_query())
        return {
            "tokens": tokens,
            "describe": [dataclasses.asdict(w) for w in engine.engine.executor.describe()],
            "stats_workers": [dataclasses.asdict(w) for w in stats.workers],
            "labelled": labelled,
        }
    finally:
        if engine is not None:
            engine.stop()
            engine.shutdown()
        ray.shutdown()
        cluster.shutdown()


def test_stages_on_two_nodes_match_transformers(tmp_path: Path) -> None:
    import torch

    from tests.model_helpers import hf_model, make_tiny_llama_dir

    model_dir = make_tiny_llama_dir(tmp_path / "tiny", num_layers=4, vocab=256)
    code = (
        "import json, sys; from tests.integration.test_multinode import _child_main; "
        f"print('RESULT ' + json.dumps(_child_main({str(model_dir)!r})), flush=True)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])

    # Placement: each stage runs on the node carrying its label, and those are different nodes.
    by_stage = {d["stage"]: d for d in result["describe"]}
    assert by_stage[0]["node_id"] == result["labelled"]["stage0"]
    assert by_stage[1]["node_id"] == result["labelled"]["stage1"]
    assert by_stage[0]["node_id"] != by_stage[1]["node_id"]
    # GetStats exposes the same placement.
    assert {(w["stage"], w["node_id"]) for w in result["stats_workers"]} == {
        (d["stage"], d["node_id"]) for d in result["describe"]
    }

    # Output: identical to transformers' greedy decoding.
    ref = hf_model(model_dir)
    for prompt, got in zip(PROMPTS, result["tokens"], strict=True):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )
        assert got == out[0, len(prompt) :].tolist(), f"prompt {prompt}"
