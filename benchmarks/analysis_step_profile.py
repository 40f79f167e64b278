"""Where a ppserve pp=1 step's time goes: used by analysis_step_time.py --profile (issue 22 analysis).

The model's building blocks are wrapped, on their classes, with a timer that adds each call's
perf_counter time to its part (inclusive; the parts never nest in one another, except `layers`, which
holds the linear / attention / norm / rope / silu parts and is reported as its remainder). A step's time
not in any part is host-side engine work: scheduling, the executor, output processing, detokenization.
A second pass of the same steps under torch.profiler gives the top aten ops by self CPU time (the
native ctypes kernels do not show there: they count under the part that calls them).
"""

from __future__ import annotations

import functools
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CHUNK, drain, prompt, run_until_decoding, timed_step  # noqa: E402

PARTS = ("linear", "attention", "norm", "rope", "silu_mul", "embed", "lm_head", "sample", "prepare", "layers")


class PartTimer:
    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, name: str, part: str) -> None:
        fn: Callable[..., Any] = getattr(owner, name)
        ns, calls = self.ns, self.calls

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                ns[part] += time.perf_counter_ns() - t0
                calls[part] += 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.ns.clear()
        self.calls.clear()


def install(timer: PartTimer) -> None:
    from ppserve.model import attention, layers, ops, stage_model
    from ppserve.worker import stage_worker

    for cls in (layers.ColumnParallelLinear, layers.MergedColumnParallelLinear, layers.QKVParallelLinear,
                layers.RowParallelLinear):
        if "forward" in vars(cls):
            timer.wrap(cls, "forward", "linear")
    for cls in vars(attention).values():
        if isinstance(cls, type) and issubclass(cls, attention.AttentionBackend) and "forward" in vars(cls):
            timer.wrap(cls, "forward", "attention")
    timer.wrap(attention, "write_kv", "attention")
    timer.wrap(layers.RMSNorm, "forward", "norm")
    timer.wrap(layers.RMSNorm, "add_and_norm", "norm")
    timer.wrap(layers.RotaryEmbedding, "cos_sin", "rope")
    timer.wrap(ops, "rope", "rope")  # RotaryEmbedding.apply looks these up on the module at each call
    timer.wrap(ops, "rope_", "rope")
    timer.wrap(ops, "silu_mul", "silu_mul")
    timer.wrap(layers.VocabParallelEmbedding, "forward", "embed")
    timer.wrap(stage_model.StageModel, "logits_for_sampling", "lm_head")
    timer.wrap(stage_worker, "sample", "sample")
    timer.wrap(stage_worker.StageWorker, "prepare", "prepare")
    timer.wrap(stage_model.StageModel, "forward", "layers")


def _steps(eng: Any, rng: random.Random, vocab: int, batch: int, context: int, n: int, mixed: bool,
           tag: str) -> list[float]:
    rids = [f"{tag}-{i}" for i in range(batch)]
    for r in rids:
        eng.add(r, prompt(rng, context, vocab), max_tokens=3 * n + 8)
    run_until_decoding(eng, rids)
    eng.step()
    walls = []
    for j in range(n):
        if mixed:
            eng.add(f"{tag}-new{j}", prompt(rng, CHUNK, vocab), max_tokens=1)
        walls.append(timed_step(eng)[0])
        if mixed:
            eng.step()  # not measured: the timer is reset around each measured step below
    drain(eng, rids)
    return walls


def attributed(eng: Any, timer: PartTimer, rng: random.Random, vocab: int, batch: int, context: int, n: int,
               mixed: bool) -> dict[str, Any]:
    """Median per-step ms of each part over n measured steps (each measured step timed alone)."""
    tag = f"p{batch}{'m' if mixed else 'd'}"
    rids = [f"{tag}-{i}" for i in range(batch)]
    for r in rids:
        eng.add(r, prompt(rng, context, vocab), max_tokens=3 * n + 8)
    run_until_decoding(eng, rids)
    eng.step()
    per: dict[str, list[float]] = defaultdict(list)
    for j in range(n):
        new = f"{tag}-new{j}"
        if mixed:
            eng.add(new, prompt(rng, CHUNK, vocab), max_tokens=1)
        for _ in range(4):  # mixed: the step that computes the new prompt (the one emitting its token)
            timer.reset()
            t0 = time.perf_counter_ns()
            gained = eng.step()
            wall = time.perf_counter_ns() - t0
            if not mixed or new in gained:
                break
        ns = dict(timer.ns)
        inner = sum(ns.get(p, 0) for p in ("linear", "attention", "norm", "rope", "silu_mul", "embed"))
        per["step_wall"].append(wall / 1e6)
        for p in ("linear", "attention", "norm", "rope", "silu_mul", "embed", "lm_head", "sample", "prepare"):
            per[p].append(ns.get(p, 0) / 1e6)
        per["layers_rest"].append((ns.get("layers", 0) - inner) / 1e6)
        outside = ns.get("layers", 0) + ns.get("lm_head", 0) + ns.get("sample", 0) + ns.get("prepare", 0)
        per["host_engine"].append((wall - outside) / 1e6)
        if mixed:
            eng.step()
    drain(eng, rids)
    row = {k: round(statistics.median(v), 2) for k, v in per.items()}
    row["what"] = f"batch {batch} decodes" + (f" + one {CHUNK}-token chunk" if mixed else "")
    return row


def aten_top(eng: Any, rng: random.Random, vocab: int, batch: int, context: int, n: int, mixed: bool,
             top: int = 10) -> list[dict[str, Any]]:
    import torch.profiler as tp

    with tp.profile(activities=[tp.ProfilerActivity.CPU]) as prof:
        _steps(eng, rng, vocab, batch, context, n, mixed, f"t{batch}{int(mixed)}")
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 1), "calls": e.count,
             "share": round(e.self_cpu_time_total / total, 3)} for e in rows]


def profile_ppserve(eng: Any, rng: random.Random, vocab: int, args: Any) -> dict[str, Any]:
    timer = PartTimer()
    install(timer)
    rows = []
    for b in args.batches:
        rows.append(attributed(eng, timer, rng, vocab, b, args.context, args.steps, mixed=False))
        rows.append(attributed(eng, timer, rng, vocab, b, args.context, args.mixed, mixed=True))
    b = max(args.batches)
    return {
        "what": "median ms per step, parts inclusive; host_engine = step wall - (layers + lm_head + sample "
        "+ prepare); layers_rest = layers - its parts (residual adds, reshapes, Python)",
        "rows": rows,
        "aten_top_decode": aten_top(eng, rng, vocab, b, args.context, 4, mixed=False),
        "aten_top_mixed_and_decode": aten_top(eng, rng, vocab, b, args.context, 3, mixed=True),
    }
