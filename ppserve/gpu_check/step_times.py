"""Phase `step_times`: stage times come from CUDA events read late, and the hot loop never waits for them.

The SmolLM2-135M-shaped checkpoint, pp 2 on the in-process executor, a short run of decodes and
prefills. On CUDA every stage's forward ends with a `torch.cuda._sleep` of about a millisecond of
device time, so no step's end event can be done when its step ends: a timer that waited for it would
report every step at once (lag 0), and one that timed the host's launches would report less than the
sleep. Every `synchronize` (torch.cuda's, an Event's, a Stream's) made while the engine steps is counted
by the module that called it. Passes when:
- the step timer (worker/step_timer.py) never synchronized in a step (its one wait, for the first
  anchor, is when the worker is built);
- every result's time is for a step already collected and not timed before (none twice, none unknown);
- on CUDA the times come back late (the median lag, step id minus timed step id, at least 1) but not
  far behind (at most MAX_LAG), and every stage time covers its sleep; on a CPU dry run at once (lag 0);
- no stage's step read its device back to the host but the last stage's sampled ids: every step runs
  under the host-sync guard (worker/host_sync.py; torch's sync debug mode set to error on CUDA, which
  sees implicit syncs too), so one such read fails the run with the stage, step and call named.
Other synchronize calls in the loop are reported by module (the staging buffers wait only when a copy
two steps old has not finished).
"""

from __future__ import annotations

import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ppserve.gpu_check.models import checkpoint, shape_for
from ppserve.gpu_check.phase import Context

MAX_LAG = 6  # steps; pp 2 on one GPU reads most one step late, a few more after a step that samples nothing
SLEEP_CYCLES = 2_000_000  # torch.cuda._sleep per stage step: ~1-1.4 ms at an H200's 1.4-2 GHz clock
MIN_SLEEP_S = 0.5e-3  # what every stage time must cover on CUDA: the sleep, at any plausible clock
TIMER_MODULE = "ppserve.worker.step_timer"


def workload(cuda: bool) -> dict[str, Any]:
    if cuda:
        return dict(requests=16, prompt=(16, 256), output=(16, 48))
    return dict(requests=3, prompt=(4, 16), output=(2, 4))


@contextmanager
def counting_synchronize(calls: Counter[str]) -> Iterator[None]:
    """Every torch.cuda synchronize made in the block, by the calling module's name."""
    import torch

    targets: list[tuple[Any, str]] = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                                      (torch.cuda.Stream, "synchronize")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in targets]

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[sys._getframe(1).f_globals.get("__name__", "?")] += 1
            return fn(*args, **kwargs)
        return wrapper

    for owner, name, fn in saved:
        setattr(owner, name, counted(fn))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@contextmanager
def strict_host_sync() -> Iterator[None]:
    """Every stage step of engines built in the block runs under the host-sync guard (read at build)."""
    from ppserve.worker.host_sync import STRICT_ENV

    before = os.environ.get(STRICT_ENV)
    os.environ[STRICT_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[STRICT_ENV]
        else:
            os.environ[STRICT_ENV] = before


def lag_report(results: list[Any], cuda: bool) -> dict[str, Any]:
    """What the results' timed step ids say: lags, and any time that was unknown or came twice."""
    collected: set[int] = set()
    timed: list[int] = []
    lags: list[int] = []
    problems: list[str] = []
    for r in results:
        collected.add(r.step_id)
        if r.timed_step_id is None:
            continue
        if r.timed_step_id not in collected:
            problems.append(f"step {r.step_id} reports the time of step {r.timed_step_id}, never collected")
        if r.timed_step_id in timed:
            problems.append(f"step {r.timed_step_id} timed twice")
        timed.append(r.timed_step_id)
        lags.append(r.step_id - r.timed_step_id)
    if not lags:
        problems.append("no result carried a stage time")
    else:
        median, worst = statistics.median(lags), max(lags)
        if cuda and median < 1:
            problems.append(f"median lag {median} steps: not read late (was something waiting for the "
                            "device?)")
        if cuda and worst > MAX_LAG:
            problems.append(f"lags up to {worst} steps, more than {MAX_LAG}")
        if not cuda and worst != 0:
            problems.append(f"lags up to {worst} steps on the host clock, which times a step when it ends")
    return {"steps": len(results), "timed": len(timed), "untimed_at_end": len(collected) - len(timed),
            "lag_counts": dict(sorted(Counter(lags).items())), "problems": problems}


@contextmanager
def busy_device(cuda: bool) -> Iterator[None]:
    """On CUDA, every stage's forward keeps the device busy SLEEP_CYCLES longer (inside its timed span)."""
    if not cuda:
        yield
        return
    import torch

    from ppserve.worker.stage_worker import StageWorker

    forward = StageWorker._forward

    def sleeping_forward(self: StageWorker, inp: Any, hidden_in: Any) -> Any:
        hidden = forward(self, inp, hidden_in)
        torch.cuda._sleep(SLEEP_CYCLES)
        return hidden

    StageWorker._forward = sleeping_forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        StageWorker._forward = forward  # type: ignore[method-assign]


def run(ctx: Context) -> dict[str, Any]:
    import random

    from ppserve.engine.llm import LLM
    from ppserve.request import SamplingParams

    shape = shape_for("smollm2", ctx.cuda)
    model_dir = checkpoint(ctx.models_dir, "smollm2", shape, "float32", ctx.device)
    w = workload(ctx.cuda)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(rng.randint(*w["prompt"]))]
               for _ in range(w["requests"])]
    params = [SamplingParams(max_tokens=rng.randint(*w["output"]), ignore_eos=True) for _ in prompts]
    calls: Counter[str] = Counter()
    with strict_host_sync(), LLM(str(model_dir), executor="inproc", pipeline_parallel_size=2,
                                 max_model_len=512,
                                 cuda_graphs="auto" if ctx.cuda else "eager") as llm:
        timer = type(llm.engine.executor.workers[0].timer).__name__
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up: Triton compiles
        results: list[Any] = []
        llm.engine.core.step_observers.append(lambda out, result: results.append(result))
        with busy_device(ctx.cuda), counting_synchronize(calls):
            llm.generate(prompts, params)
        spans = [s for s in llm.engine.collect_spans() if s.kind == "compute"]
    report = lag_report(results, ctx.cuda)
    shortest = min((t for r in results for t in r.stage_seconds), default=None)
    if ctx.cuda and shortest is not None and shortest < MIN_SLEEP_S:
        report["problems"].append(f"a stage time of {shortest * 1e3:.3f} ms is shorter than the device's "
                                  "sleep in it: not the device's time")
    if calls[TIMER_MODULE]:
        report["problems"].append(f"the step timer synchronized {calls[TIMER_MODULE]} times in the loop")
    expected_timer = "EventStepTimer" if ctx.cuda else "HostStepTimer"
    if timer != expected_timer:
        report["problems"].append(f"the stages time with {timer}, not {expected_timer}")
    guard = "torch.cuda sync debug mode: error" if ctx.cuda else "the CPU torch-function guard"
    return {"ok": not report["problems"], "timer": timer, "workload": w, **report, "host_sync_guard": guard,
            "shortest_stage_ms": None if shortest is None else round(shortest * 1e3, 4),
            "synchronize_calls_in_loop": dict(calls), "compute_spans": len(spans)}


def headline(r: dict[str, Any]) -> str:
    syncs = r["synchronize_calls_in_loop"]
    return (f"{r['timer']} under {r.get('host_sync_guard')}: {r['timed']}/{r['steps']} steps timed, "
            f"lags {r['lag_counts']}, timer syncs in the loop "
            f"{syncs.get(TIMER_MODULE, 0)}, other syncs {sum(syncs.values()) - syncs.get(TIMER_MODULE, 0)}"
            + (f"; {'; '.join(r['problems'])}" if r["problems"] else ""))
