"""Benchmark workloads: a small spec (source, scales, arrivals) turned into `WorkloadRequest`s.

Glue over `ppserve.sim.workload` (the readers live there and are shared with the simulator):
- source `trace:<name or path>`: rows of a request-length trace (../shared/traces), lengths scaled by
  `prefill_scale` / `decode_scale`;
- `uniform` / `zipf`: synthetic lengths in [prompt_min, prompt_max] x [output_min, output_max];
- `fixed`: identical requests of `total_tokens` tokens at prompt:decode = `pd_ratio`;
- `shared-prefix`: `prefix_groups` system prompts of `prefix_len` tokens, each followed by
  num_requests / prefix_groups distinct `question_len`-token questions (output_max tokens out);
- `multi-turn`: num_requests / `turns` conversations of `turns` turns, each re-sending its history
  (a `prefix_len`-token system prompt, the earlier questions and answers) and a new question.
Arrivals: `poisson` at `rate` req/s (seeded), `trace` (the trace's own, sped up by `time_scale`), or
`at-once`. Lengths are clipped to the served context.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ppserve.sim.workload import (
    WorkloadRequest,
    at_once,
    clip_to_context,
    default_trace_path,
    fixed_ratio,
    multi_turn,
    read_trace,
    shared_prefix,
    uniform_lengths,
    with_poisson_arrivals,
    zipf_lengths,
)

__all__ = ["WorkloadSpec", "build_workload", "workload_stats"]

ARRIVALS = ("poisson", "trace", "at-once")
SYNTHETIC = ("uniform", "zipf", "fixed", "shared-prefix", "multi-turn")


@dataclass(frozen=True)
class WorkloadSpec:
    # trace:<name|path> | uniform | zipf | fixed | shared-prefix | multi-turn
    source: str = "trace:splitwise_conv.csv"
    num_requests: int = 48
    start: int = 0  # first trace row (a held-out workload uses other rows)
    prefill_scale: float = 0.15
    decode_scale: float = 0.15
    arrival: str = "poisson"  # poisson | trace | at-once
    rate: float = 1.0  # Poisson requests/s
    time_scale: float = 1.0  # trace arrivals: divide inter-arrival times by this
    seed: int = 0
    prompt_min: int = 16
    prompt_max: int = 256
    output_min: int = 8
    output_max: int = 64
    zipf_theta: float = 0.6
    total_tokens: int = 256
    pd_ratio: float = 4.0
    max_model_len: int = 2048
    prefix_groups: int = 8  # shared-prefix: how many system prompts
    prefix_len: int = 1024  # shared-prefix / multi-turn: the system prompt's tokens
    question_len: int = 64  # shared-prefix / multi-turn: each question's tokens
    turns: int = 4  # multi-turn: turns per conversation

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"workload arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.num_requests < 1:
            raise ValueError(f"workload num_requests must be >= 1, got {self.num_requests!r}")
        if self.arrival == "poisson" and self.rate <= 0:
            raise ValueError(f"workload rate must be > 0 requests/s, got {self.rate!r}")
        if not (self.source.startswith("trace:") or self.source in SYNTHETIC):
            raise ValueError(f"workload source must be trace:<file> or one of {SYNTHETIC}, got "
                             f"{self.source!r}")

    def with_rate(self, rate: float) -> WorkloadSpec:
        return replace(self, rate=rate)

    def label(self) -> str:
        """A short, file-name-safe description: source, size, scales, arrivals."""
        src = Path(self.source.split(":", 1)[1]).stem if self.source.startswith("trace:") else self.source
        parts = [src, f"n{self.num_requests}"]
        if self.source.startswith("trace:"):
            parts.append(f"p{self.prefill_scale:g}d{self.decode_scale:g}")
        parts.append(f"r{self.rate:g}" if self.arrival == "poisson" else self.arrival)
        return "-".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _trace_path(name: str) -> Path:
    p = Path(name)
    return p if p.exists() else default_trace_path(name)


def build_workload(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """The requests of a spec, sorted by arrival, clipped to the context."""
    n = spec.num_requests
    if spec.source.startswith("trace:"):
        reqs = read_trace(_trace_path(spec.source.split(":", 1)[1]), limit=n, start=spec.start,
                          prefill_scale=spec.prefill_scale, decode_scale=spec.decode_scale,
                          need_arrivals=spec.arrival == "trace")
        if len(reqs) < n:
            raise ValueError(f"trace {spec.source} has only {len(reqs)} rows from row {spec.start}; asked "
                             f"for {n}")
    elif spec.source == "uniform":
        reqs = uniform_lengths(n, (spec.prompt_min, spec.prompt_max), (spec.output_min, spec.output_max),
                               spec.seed)
    elif spec.source == "zipf":
        reqs = zipf_lengths(n, (spec.prompt_min, spec.prompt_max), (spec.output_min, spec.output_max),
                            spec.zipf_theta, spec.seed)
    elif spec.source == "shared-prefix":
        reqs = shared_prefix(spec.prefix_groups, max(1, n // spec.prefix_groups), spec.prefix_len,
                             spec.question_len, spec.output_max)
    elif spec.source == "multi-turn":
        reqs = multi_turn(max(1, n // spec.turns), spec.turns, spec.prefix_len, spec.question_len,
                          spec.output_max)
    else:
        reqs = fixed_ratio(n, spec.total_tokens, spec.pd_ratio)
    if spec.arrival == "poisson":
        reqs = with_poisson_arrivals(reqs, spec.rate, spec.seed)
    elif spec.arrival == "at-once":
        reqs = at_once(reqs)
    elif spec.time_scale != 1.0:
        reqs = [replace(r, arrival_s=r.arrival_s / spec.time_scale) for r in reqs]
    reqs = clip_to_context(reqs, spec.max_model_len)
    return sorted(reqs, key=lambda r: r.arrival_s)


def workload_stats(reqs: list[WorkloadRequest]) -> dict[str, Any]:
    """Sizes of a workload, for reports."""
    from ppserve.metrics.latency import stats

    dur = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
    return {
        "num_requests": len(reqs),
        "prompt_tokens": stats([float(r.prompt_len) for r in reqs]),
        "output_tokens": stats([float(r.output_len) for r in reqs]),
        "total_prompt_tokens": sum(r.prompt_len for r in reqs),
        "total_output_tokens": sum(r.output_len for r in reqs),
        "arrival_span_s": dur,
        "offered_rate": (len(reqs) - 1) / dur if dur > 0 else None,
    }
