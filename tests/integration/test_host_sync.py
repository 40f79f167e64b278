"""No stage step reads its device back to the host but the last stage's sampled ids (worker/host_sync.py).

On CPU nothing syncs, so the guard is a torch-function mode that fails on every call that would make a
GPU's host wait (`.tolist()`, `.item()`, `int(t)`, `nonzero`, a boolean mask, ...) outside the one
allowed read. Pipelines run whole under it (`PPSERVE_STRICT_HOST_SYNC=1`), the token ring on, with
penalties, sampling and logprobs, and still equal transformers; a read planted in a stage's forward
fails with the stage and step named.
"""

from __future__ import annotations

import pytest
import torch

from ppserve import LLM, SamplingParams
from ppserve.worker.host_sync import STRICT_ENV, HostSyncError
from ppserve.worker.stage_worker import StageWorker
from tests.oracle import ppserve_greedy, random_prompts, reference_greedy

MAX_NEW = 10


@pytest.fixture(autouse=True)
def _strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "1")  # read by each StageActor when it is built (in process here)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, (3, 11, 26, 47))


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_greedy_pipelines_run_without_a_host_read_and_equal_transformers(tiny_llama_dir, prompts, pp):
    expected = reference_greedy(tiny_llama_dir, prompts, MAX_NEW)
    got, _ = ppserve_greedy(tiny_llama_dir, prompts, MAX_NEW, executor="inproc", pipeline_parallel_size=pp,
                            token_budget=24, block_size=4)
    assert got == expected


def test_penalties_sampling_and_logprobs_stay_inside_the_one_read(tiny_llama_dir, prompts):
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_p=0.9, top_k=20, seed=3,
                             presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, logprobs=2,
                             ignore_eos=True),
              SamplingParams(max_tokens=MAX_NEW, temperature=0.0, min_tokens=4, ignore_eos=True)]
    with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2,
             token_budget=24, block_size=4) as llm:
        outs = [llm.generate(prompts, p) for p in params]
    assert all(len(o.token_ids) == MAX_NEW for run in outs for o in run)


def test_a_read_inside_a_stage_step_fails_with_the_stage_and_step_named(tiny_llama_dir, prompts, monkeypatch):
    forward = StageWorker._forward

    def reading_forward(self: StageWorker, inp, hidden_in):  # type: ignore[no-untyped-def]
        hidden = forward(self, inp, hidden_in)
        if self.spec.stage == 1:
            float(hidden.sum())  # an implicit sync on a GPU
        return hidden

    monkeypatch.setattr(StageWorker, "_forward", reading_forward)
    with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2,
             token_budget=24, block_size=4) as llm:
        with pytest.raises(HostSyncError, match=r"stage 1 tp 0 step \d+: .*__float__"):
            llm.generate(prompts[:1], SamplingParams(max_tokens=2))


def test_the_guard_is_off_unless_asked(tiny_llama_dir, prompts, monkeypatch):
    monkeypatch.delenv(STRICT_ENV)
    with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2) as llm:
        assert not any(a._strict for a in llm.engine.executor.actors)
        assert torch.is_tensor(torch.zeros(1)) and float(torch.ones(1).sum()) == 1.0
