"""The null-model pipeline behind benchmarks/bench_host_overhead.py: the layers never run, everything
else does, and the benchmark's figures come out of the spans."""

from __future__ import annotations

import pytest

from ppserve.model.stage_model import StageModel
from ppserve.worker.startup_cost import REPEATS
from tests.bench_scripts import load_benchmark


def test_null_model_runs_the_host_path_only(tiny_llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("bench_host_overhead")
    calls = []
    real = StageModel.forward

    def counting(self, *args, **kwargs):
        calls.append(1)  # the KV sizing profile and warm-up run the real layers once at start-up
        return real(self, *args, **kwargs)

    monkeypatch.setattr(StageModel, "forward", counting)
    # Four warm steps, two rounds: groups that the prompts' chunks left uneven (5 / 3) are even again
    # after one round of the decode quota, whatever the chunking the start-up timing's shares chose.
    row = bench.measure(tiny_llama_dir, requests=8, pp=2, steps=4, warm_steps=4)
    startup = len(calls)
    # Per stage, none while serving: three warm-up forwards (largest microbatch, chunk, decodes), then the
    # start-up step-cost timing's shapes (worker/startup_cost.py), REPEATS runs each: four to eight, as
    # the mixed one and those after a long context fit the KV cache.
    assert startup in {2 * (3 + k * REPEATS) for k in range(4, 9)}, startup
    # 8 decodes over 2 in flight
    assert row["microbatches"] == 4 and row["decodes_per_microbatch"] == 4, row["decodes_per_step"]
    assert set(row["stage_parts_ms"]) == {"0", "1"} and "prepare" in row["stage_parts_ms"]["0"]
    assert row["worst_stage_host_ms"] > 0 and row["engine_host_ms_per_microbatch"] is not None
