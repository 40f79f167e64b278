"""`parallel.partition_mode: calibrated`: split the layers by measured, not assumed, costs.

The pipeline starts with the even split. A saved profile gives the per-layer and LM-head costs at
once: `parallel.partition_profile` if set, else the cache (`profile_cache_path`: under
$PPSERVE_CACHE_DIR, or $XDG_CACHE_HOME/ppserve, or ~/.cache/ppserve, keyed by model, dtype, pp, tp,
token budget, max_num_seqs and machine). Without one, a short calibration run measures them: synthetic
requests at the configured token budget and request cap go through the real engine, and every
microbatch's shape and per-stage compute seconds (the same `StepResult.stage_seconds` the scheduler
learns from) are fitted by `fit_cost_profile` and saved where the profile was looked for. The exact
cost partition then minimizes the slowest stage, the pipeline is rebuilt with it when it differs, and
the scheduler's online cost model starts from the profile's costs for that split (its prior). The
calibration's requests, spans and work intervals are discarded, so what a user measures afterwards is
the real run alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ppserve.cache import cache_root
from ppserve.request import SamplingParams
from ppserve.sched.cost import BatchShape
from ppserve.sched.output import SchedulerOutput
from ppserve.sched.partition import CostProfile, fit_cost_profile

if TYPE_CHECKING:
    from ppserve.config import EngineConfig, SchedulerConfig
    from ppserve.engine.core import EngineCore
    from ppserve.engine.executor import Executor
    from ppserve.engine.messages import TokenDelta
    from ppserve.model.arch import ModelArch
    from ppserve.sched.scheduler import Scheduler

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
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def model_dir(self) -> Path: ...

    def add_request(self, prompt: list[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None) -> str: ...

    def step(self) -> list[TokenDelta]: ...

    def reset_observations(self) -> None: ...

CALIBRATION_REQUESTS = 16  # at most; fewer when scheduler.max_num_seqs is lower
CALIBRATION_PROMPT = 128  # tokens, at most the token budget
CALIBRATION_OUTPUT = 32  # tokens per request: a decode phase as long as the prefill phase, roughly


def kernels_id(native_kernels: bool) -> str:
    """The kernels stage timings were taken with: torch's version and ppserve's native library (its
    sources, flags and compiler: `library_key`), or 'off' where the config turns them off."""
    import torch

    from ppserve.model.ops.build import library_key

    return f"torch {torch.__version__}|native {library_key() if native_kernels else 'off'}"


def machine_id() -> str:
    """This machine as far as stage timings go: host, architecture, processor and core count."""
    return f"{platform.node()}|{platform.machine()}|{platform.processor()}|{os.cpu_count()}"


def profile_cache_path(engine: CalibratedEngine) -> Path:
    """The cached profile for `engine`'s model, dtype, pp, tp, token budget, max_num_seqs, machine and
    kernels: torch's version and ppserve's native kernels, since a new kernel moves the stage costs and an
    older profile would split the layers unevenly (docs/decisions.md#calibrated-profile-key)."""
    cfg = engine.config
    key = {"model": str(engine.model_dir), "dtype": cfg.model.dtype,
           "pp": cfg.parallel.pipeline_parallel_size, "tp": cfg.parallel.tensor_parallel_size,
           "token_budget": cfg.scheduler.token_budget, "max_num_seqs": cfg.scheduler.max_num_seqs,
           "machine": machine_id(), "kernels": kernels_id(cfg.model.native_kernels)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "partition" / f"{Path(engine.model_dir).name}-{digest}.json"


def calibrated_ranges(engine: CalibratedEngine) -> list[tuple[int, int]]:
    """The layer ranges for `engine`'s pipeline from a saved profile or a calibration run (then saved);
    the scheduler's cost model starts from the profile's costs for those ranges."""
    par = engine.config.parallel
    path = Path(par.partition_profile) if par.partition_profile else profile_cache_path(engine)
    profile = _read_profile(path) if path.exists() else None
    if profile is None:
        profile = measure_cost_profile(engine)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    ranges = profile.ranges(engine.arch.num_layers, par.pipeline_parallel_size)
    engine.scheduler.cost.reset(profile.costs.pipeline(ranges))
    logger.info("calibrated partition (%s): LM head = %.2f layers per microbatch -> layers %s", path,
                profile.head_in_layers, [e - s for s, e in ranges])
    return ranges


def _read_profile(path: Path) -> CostProfile | None:
    """The profile saved at `path`, or None (logged) when it is not one this version reads: measured again."""
    try:
        return CostProfile.from_json(json.loads(path.read_text()))
    except (ValueError, OSError) as e:
        logger.warning("ignoring the cost profile %s (%s): measuring again", path, e)
        return None


def calibration_workload(sc: SchedulerConfig, num_stages: int, max_model_len: int) -> tuple[int, int, int]:
    """(requests, prompt tokens, output tokens) of the calibration run; the simulator runs the same."""
    n = max(2 * num_stages, min(sc.max_num_seqs, CALIBRATION_REQUESTS))
    n = min(n, sc.max_num_seqs)
    prompt_len = max(1, min(sc.token_budget, CALIBRATION_PROMPT, max_model_len // 2))
    out_len = max(1, min(CALIBRATION_OUTPUT, max_model_len - prompt_len))
    return n, prompt_len, out_len


def measure_cost_profile(engine: CalibratedEngine) -> CostProfile:
    """Run the calibration workload through `engine` and fit per-layer and head costs from its
    microbatches' shapes and stage times."""
    sc = engine.config.scheduler
    n, prompt_len, out_len = calibration_workload(sc, engine.config.parallel.pipeline_parallel_size,
                                                  engine.max_model_len)
    vocab = engine.arch.vocab_size
    t0 = time.perf_counter()
    samples: list[tuple[BatchShape, Sequence[float]]] = []

    def record(out: SchedulerOutput, stage_seconds: tuple[float, ...]) -> None:
        samples.append((BatchShape.of(out), stage_seconds))  # the microbatch these times measure

    engine.core.timing_observers.append(record)
    try:
        for i in range(n):
            prompt = [(17 + 31 * i + 7 * j) % (vocab - 3) + 3 for j in range(prompt_len)]
            engine.add_request(prompt, SamplingParams(max_tokens=out_len, ignore_eos=True),
                               request_id=f"calibration-{i}")
        while engine.has_unfinished:
            engine.step()
    finally:
        engine.core.timing_observers.remove(record)
    engine.reset_observations()
    profile = fit_cost_profile(samples, engine.executor.ranges,
                               source=f"calibration run: {n} requests of {prompt_len}+{out_len} tokens, "
                                      f"token budget {sc.token_budget}, machine {machine_id()}")
    logger.info("calibration run: %d microbatches in %.1f s; LM head = %.2f layers per microbatch",
                profile.num_microbatches, time.perf_counter() - t0, profile.head_in_layers)
    return profile
