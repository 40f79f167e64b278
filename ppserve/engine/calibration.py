"""`parallel.partition_mode: calibrated`: split the layers by measured, not assumed, costs.

The pipeline starts with the even split. A saved profile (`parallel.partition_profile`) gives the
per-layer and LM-head costs at once; without one, a short calibration run measures them: synthetic
requests at the configured token budget and request cap go through the real engine, and every
microbatch's per-stage compute seconds (the same `StepResult.stage_seconds` the scheduler learns
from) are fitted by `fit_stage_costs`. The exact cost partition then minimizes the slowest stage, and
the pipeline is rebuilt with it when it differs. The calibration's requests, spans and work intervals
are discarded, so what a user measures afterwards is the real run alone.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ppserve.request import SamplingParams
from ppserve.sched.partition import MeasuredStageCosts, fit_stage_costs, partition_layers

if TYPE_CHECKING:
    from ppserve.config import EngineConfig
    from ppserve.engine.core import EngineCore
    from ppserve.engine.executor import Executor
    from ppserve.engine.messages import TokenDelta
    from ppserve.model.arch import ModelArch

logger = logging.getLogger(__name__)


class CalibratedEngine(Protocol):
    """What calibration uses of the engine (LLMEngine is one). A protocol rather than the class: the
    engine imports this module."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def arch(self) -> ModelArch: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def core(self) -> EngineCore: ...
    @property
    def executor(self) -> Executor: ...
    @property
    def has_unfinished(self) -> bool: ...

    def add_request(self, prompt: list[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None) -> str: ...

    def step(self) -> list[TokenDelta]: ...

    def reset_observations(self) -> None: ...

CALIBRATION_REQUESTS = 16  # at most; fewer when scheduler.max_num_seqs is lower
CALIBRATION_PROMPT = 128  # tokens, at most the token budget
CALIBRATION_OUTPUT = 32  # tokens per request: a decode phase as long as the prefill phase, roughly


def calibrated_ranges(engine: CalibratedEngine) -> list[tuple[int, int]]:
    """The layer ranges for `engine`'s pipeline from a saved profile or a calibration run."""
    par = engine.config.parallel
    path = Path(par.partition_profile) if par.partition_profile else None
    if path is not None and path.exists():
        costs = MeasuredStageCosts.from_json(json.loads(path.read_text()))
        logger.info("stage costs from %s: layer %.3f ms, LM head %.3f ms per microbatch", path,
                    costs.layer_s * 1e3, costs.head_s * 1e3)
    else:
        costs = measure_stage_costs(engine)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(costs.to_json(), indent=2) + "\n")
    ranges = partition_layers(engine.arch.num_layers, par.pipeline_parallel_size, mode="cost",
                              cost=costs.cost_model())
    logger.info("calibrated partition: LM head = %.2f layers per microbatch -> layers %s",
                costs.cost_model().lm_head, [e - s for s, e in ranges])
    return ranges


def measure_stage_costs(engine: CalibratedEngine) -> MeasuredStageCosts:
    """Run the calibration workload through `engine` and fit per-layer and head costs from its stage times."""
    sc = engine.config.scheduler
    n = max(2 * engine.config.parallel.pipeline_parallel_size, min(sc.max_num_seqs, CALIBRATION_REQUESTS))
    n = min(n, sc.max_num_seqs)
    prompt_len = max(1, min(sc.token_budget, CALIBRATION_PROMPT, engine.max_model_len // 2))
    out_len = max(1, min(CALIBRATION_OUTPUT, engine.max_model_len - prompt_len))
    vocab = engine.arch.vocab_size
    t0 = time.perf_counter()
    log: list[tuple[float, ...]] = []
    engine.core.stage_seconds_log = log
    try:
        for i in range(n):
            prompt = [(17 + 31 * i + 7 * j) % (vocab - 3) + 3 for j in range(prompt_len)]
            engine.add_request(prompt, SamplingParams(max_tokens=out_len, ignore_eos=True),
                               request_id=f"calibration-{i}")
        while engine.has_unfinished:
            engine.step()
    finally:
        engine.core.stage_seconds_log = None
    engine.reset_observations()
    costs = fit_stage_costs(log, engine.executor.ranges,
                            source=f"calibration run: {n} requests of {prompt_len}+{out_len} tokens, "
                                   f"token budget {sc.token_budget}")
    logger.info("calibration run: %d microbatches in %.1f s; layer %.3f ms, LM head %.3f ms per microbatch",
                costs.num_microbatches, time.perf_counter() - t0, costs.layer_s * 1e3, costs.head_s * 1e3)
    return costs
