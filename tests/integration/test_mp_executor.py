"""The multi-process executor (engine/mp_executor.py): the pipeline as one process per rank, no Ray.

Greedy float32 output equals transformers at pp 2 and 3 and with TP 2 inside a stage, under the
rendezvous link (NCCL's strictest rules on CPU) with the token ring on, and on the default links; a
killed stage process is rebuilt with the output unchanged; with Ray not installed in any process,
`parallel.executor: auto` runs the pipeline on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ppserve import LLM
from tests.fault_helpers import run_with_kill, stage_pid
from tests.oracle import ppserve_greedy, random_prompts, reference_greedy

ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 12


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, (2, 9, 21, 40, 70))


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts):
    return reference_greedy(tiny_llama_dir, prompts, MAX_NEW)


@pytest.mark.parametrize("pp,tp,link", [(2, 1, "rendezvous"), (3, 1, "rendezvous"), (2, 2, "rendezvous"),
                                        (2, 1, "auto")])
def test_mp_pipeline_equals_transformers(tiny_llama_dir, prompts, expected, pp, tp, link):
    got, _ = ppserve_greedy(tiny_llama_dir, prompts, MAX_NEW, executor="mp", pipeline_parallel_size=pp,
                            tensor_parallel_size=tp, token_budget=16, block_size=4,
                            overrides=[f"parallel.stage_link={link}", "scheduler.token_ring=true"])
    assert got == expected


def test_mp_stage_killed_mid_run_is_rebuilt(tiny_llama_dir, prompts):
    want = reference_greedy(tiny_llama_dir, prompts, 24)
    with LLM(str(tiny_llama_dir), dtype="float32", executor="mp", pipeline_parallel_size=2, token_budget=16,
             block_size=4, overrides=["parallel.stage_link=rendezvous"]) as llm:
        old = {stage_pid(llm, s) for s in range(2)}
        got, reasons, _ = run_with_kill(llm, prompts, kill_stage=1, kill_after_steps=8)
        stats = llm.engine.stats()
        assert got == want and reasons == ["length"] * len(prompts)
        assert stats.num_restarts == 1 and not old & {stage_pid(llm, s) for s in range(2)}


def test_mp_executor_refuses_more_gpu_ranks_than_gpus(tiny_llama_dir):
    with pytest.raises(ValueError, match="one GPU of this machine"):
        LLM(str(tiny_llama_dir), executor="mp", pipeline_parallel_size=2,
            overrides=["parallel.gpus_per_worker=1"])


def test_auto_without_ray_runs_the_pipeline_on_processes(tiny_llama_dir, prompts, expected, tmp_path):
    """Ray hidden from the engine and from every process it starts (a sitecustomize on PYTHONPATH)."""
    site = tmp_path / "no_ray"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None\n")
    script = textwrap.dedent(f"""
        import json, sys
        from ppserve import LLM, SamplingParams
        if __name__ == "__main__":
            with LLM({str(tiny_llama_dir)!r}, dtype="float32", pipeline_parallel_size=2, token_budget=16,
                     block_size=4) as llm:
                outs = llm.generate({prompts!r}, SamplingParams(max_tokens={MAX_NEW}, ignore_eos=True))
                print(json.dumps({{"executor": type(llm.engine.executor).__name__,
                                   "tokens": [o.token_ids for o in outs], "ray": "ray" in sys.modules
                                   and sys.modules["ray"] is not None}}))
        """)
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"executor": "MultiprocExecutor", "tokens": expected, "ray": False}
