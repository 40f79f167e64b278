"""A stage whose layers do nothing: what is left of a step is its host work, the floor under any GPU step.

`install_null_model(worker)` replaces the worker's forward with a view of a zero buffer of the right shape
and, on the last stage, its logits with zeros (the sampler still runs on them: greedy sampling of a
whole batch is part of the step's host work on any device). Everything else is the real code: the
engine's scheduling and bookkeeping, the stage's diff and input tensors, the actor, the channels. So
`benchmarks/bench_host_overhead.py` reads the engine's and a stage's host time per microbatch off the
same spans a real run records.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ppserve.sched.output import SchedulerOutput, StepResult
from ppserve.worker.input_batch import ModelInput
from ppserve.worker.stage_worker import StageWorker


class NullForward:
    """The worker's `_forward` and its model's `logits_for_sampling`, doing nothing but shape the output;
    it also times the worker's sampling (`sample_ns` by step id), which the compute span includes: on a
    CPU that is the sampler's own compute, on a GPU a device op, so a reader can take it out."""

    def __init__(self, worker: StageWorker) -> None:
        self.hidden = torch.zeros(0, worker.arch.hidden_size, dtype=worker.dtype, device=worker.device)
        self.logits = torch.zeros(0, worker.arch.vocab_size, dtype=torch.float32, device=worker.device)
        self.sample_ns: dict[int, int] = {}
        self._sample = worker._sample

    def sample(self, out: SchedulerOutput, inp: ModelInput, logits: Tensor | None) -> StepResult:
        start = time.perf_counter_ns()
        try:
            return self._sample(out, inp, logits)
        finally:
            self.sample_ns[out.step_id] = time.perf_counter_ns() - start

    def forward(self, inp: ModelInput, hidden_in: Tensor | None) -> Tensor:
        n = int(inp.positions.shape[0])
        if self.hidden.shape[0] < n:  # grown once to the largest microbatch, then reused
            self.hidden = torch.zeros(n, self.hidden.shape[1], dtype=self.hidden.dtype,
                                      device=self.hidden.device)
        return self.hidden[:n]

    def logits_for_sampling(self, hidden: Tensor) -> Tensor:
        n = int(hidden.shape[0])
        if self.logits.shape[0] < n:
            self.logits = torch.zeros(n, self.logits.shape[1], dtype=self.logits.dtype,
                                      device=self.logits.device)
        return self.logits[:n]


def install_null_model(worker: StageWorker) -> NullForward:
    """Make `worker`'s layers (and LM head) do nothing from now on; returns the stand-in."""
    null = NullForward(worker)
    worker._forward = null.forward  # type: ignore[method-assign]
    worker.graphs = None  # a captured graph would replay the real layers
    if worker.model.is_last:
        worker.model.logits_for_sampling = null.logits_for_sampling  # type: ignore[method-assign]
        worker._sample = null.sample  # type: ignore[method-assign]
    return null
