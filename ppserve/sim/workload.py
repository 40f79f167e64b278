"""Workloads: lists of `WorkloadRequest(arrival_s, prompt_len, output_len)` for the simulator and benchmarks.

A request may also name a prefix identity (`prefix_id`, `prefix_len`): requests with the same id share
their first `prefix_len` prompt tokens (a system prompt, a conversation's history), which the prefix
cache computes once; without one, a request's prompt shares nothing with any other. Or it spells its
prompt out (`content`, runs of one token id): requests then share exactly the blocks their tokens share,
which nests (a system prompt shared by conversations, each sharing its history with its next turn;
sim/conversations.py).

Sources: request-length traces (CSV with arrived_at, num_prefill_tokens, num_decode_tokens, e.g. the
Splitwise traces in ../shared/traces), synthetic lengths (uniform, zipf, log-uniform prompts, fixed
P:D ratio). Arrivals: the trace's own, Poisson at a given rate (seeded), all at once, evenly spaced, or
in bursts. Pure Python, seeded, deterministic.
"""

from __future__ import annotations

import csv
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = [
    "WorkloadRequest",
    "DEFAULT_TRACE",
    "default_trace_path",
    "read_trace",
    "poisson_arrivals",
    "with_poisson_arrivals",
    "at_once",
    "uniform_lengths",
    "zipf_lengths",
    "fixed_ratio",
    "clip_to_context",
    "cut_runs",
    "expand_runs",
    "log_uniform_prompts",
    "evenly_spaced",
    "bursty_arrivals",
    "shared_prefix",
    "multi_turn",
]

DEFAULT_TRACE = "splitwise_conv.csv"


@dataclass(frozen=True)
class WorkloadRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    prefix_id: int | None = None  # requests with the same id share their first prefix_len prompt tokens
    prefix_len: int = 0
    # The prompt as runs of (token id, count), None: its prefix identity says what it shares. Runs keep
    # a long history cheap to hold and to send to the planner's processes.
    content: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"a request needs prompt_len >= 1 and output_len >= 1, got {self}")
        if self.content is not None and (self.prefix_id is not None
                                         or any(n < 1 for _, n in self.content)
                                         or sum(n for _, n in self.content) != self.prompt_len):
            raise ValueError("content must be runs of >= 1 tokens summing to prompt_len, without a "
                             f"prefix_id, got {self}")
        if not 0 <= self.prefix_len <= self.prompt_len or (self.prefix_len > 0 and self.prefix_id is None):
            raise ValueError(f"prefix_len must be in [0, prompt_len] and needs a prefix_id, got {self}")
        if not (self.arrival_s >= 0 and math.isfinite(self.arrival_s)):
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s!r}")


def default_trace_path(name: str = DEFAULT_TRACE) -> Path:
    """The trace in ../shared/traces relative to the repository root (the CI layout), else /work/shared."""
    repo = Path(__file__).resolve().parents[2]
    for base in (repo.parent / "shared" / "traces", Path("/work/shared/traces")):
        if (base / name).exists():
            return base / name
    raise FileNotFoundError(f"trace {name} not found in {repo.parent / 'shared' / 'traces'}; pass a path")


def read_trace(
    path: str | os.PathLike[str],
    limit: int | None = None,
    prefill_scale: float = 1.0,
    decode_scale: float = 1.0,
    start: int = 0,
    need_arrivals: bool = True,
) -> list[WorkloadRequest]:
    """Rows `start .. start+limit` of a trace CSV, lengths scaled (rounded, at least 1), arrivals
    shifted so the first selected request arrives at 0. A trace of token counts only (no `arrived_at`
    column, like Vidur's arxiv-summarization and BWB traces) is read with every arrival at 0 when
    `need_arrivals` is false (the caller puts synthetic arrivals on it: Poisson, at once)."""
    if prefill_scale <= 0 or decode_scale <= 0:
        raise ValueError(f"scale factors must be > 0, got prefill {prefill_scale} decode {decode_scale}")
    out: list[WorkloadRequest] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        need = {"num_prefill_tokens", "num_decode_tokens"}
        if not reader.fieldnames or not need <= set(reader.fieldnames):
            raise ValueError(f"{path}: expected columns {sorted(need)} (and arrived_at), got "
                             f"{reader.fieldnames}")
        timed = "arrived_at" in reader.fieldnames
        if need_arrivals and not timed:
            raise ValueError(f"{path} has no arrived_at column: give the requests synthetic arrivals "
                             "(a Poisson rate, or all at once)")
        t0: float | None = None
        for i, row in enumerate(reader):
            if i < start:
                continue
            if limit is not None and len(out) >= limit:
                break
            t = float(row["arrived_at"]) if timed else 0.0
            t0 = t if t0 is None else t0
            out.append(
                WorkloadRequest(
                    arrival_s=max(0.0, t - t0),
                    prompt_len=max(1, round(int(row["num_prefill_tokens"]) * prefill_scale)),
                    output_len=max(1, round(int(row["num_decode_tokens"]) * decode_scale)),
                )
            )
    return out


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """n arrival times of a Poisson process of `rate` requests/s, the first at 0."""
    if rate <= 0:
        raise ValueError(f"Poisson rate must be > 0 requests/s, got {rate!r}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def with_poisson_arrivals(reqs: Sequence[WorkloadRequest], rate: float,
                          seed: int = 0) -> list[WorkloadRequest]:
    """Keep the lengths, replace the arrivals with a seeded Poisson process."""
    return [replace(r, arrival_s=t) for r, t in zip(reqs, poisson_arrivals(len(reqs), rate, seed),
                                                    strict=True)]


def at_once(reqs: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
    """Everything arrives at 0 (offline batch throughput)."""
    return [replace(r, arrival_s=0.0) for r in reqs]


def uniform_lengths(
    n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0
) -> list[WorkloadRequest]:
    """Prompt and output lengths uniform in the inclusive ranges; all arrive at 0."""
    rng = random.Random(seed)
    return [WorkloadRequest(0.0, rng.randint(*prompt), rng.randint(*output)) for _ in range(n)]


def _zipf(rng: random.Random, lo: int, hi: int, theta: float) -> int:
    # Inverse-CDF sampling over the finite support lo..hi with P(k) ~ 1 / (k - lo + 1)^theta.
    weights = [1.0 / (k - lo + 1) ** theta for k in range(lo, hi + 1)]
    return lo + rng.choices(range(hi - lo + 1), weights=weights)[0]


def zipf_lengths(
    n: int, prompt: tuple[int, int], output: tuple[int, int], theta: float = 0.6, seed: int = 0
) -> list[WorkloadRequest]:
    """Zipf-distributed lengths (short ones most common) over the inclusive ranges; all arrive at 0."""
    rng = random.Random(seed)
    return [WorkloadRequest(0.0, _zipf(rng, *prompt, theta), _zipf(rng, *output, theta)) for _ in range(n)]


def fixed_ratio(n: int, total_tokens: int, pd_ratio: float) -> list[WorkloadRequest]:
    """n identical requests of `total_tokens` tokens with prompt:decode = pd_ratio (as in Sarathi's
    sweeps)."""
    if pd_ratio <= 0 or total_tokens < 2:
        raise ValueError(f"need pd_ratio > 0 and total_tokens >= 2, got {pd_ratio}, {total_tokens}")
    decode = max(1, round(total_tokens / (pd_ratio + 1)))
    return [WorkloadRequest(0.0, max(1, total_tokens - decode), decode) for _ in range(n)]


def clip_to_context(reqs: Sequence[WorkloadRequest], max_model_len: int) -> list[WorkloadRequest]:
    """Shorten requests so prompt + output fits the context: the prompt to at most max_model_len - 1,
    then the output to what is left."""
    out = []
    for r in reqs:
        prompt = min(r.prompt_len, max_model_len - 1)
        out.append(replace(r, prompt_len=prompt, output_len=max(1, min(r.output_len, max_model_len - prompt)),
                           prefix_len=min(r.prefix_len, prompt),
                           content=None if r.content is None else cut_runs(r.content, prompt)))
    return out


def cut_runs(runs: Sequence[tuple[int, int]], n: int) -> tuple[tuple[int, int], ...]:
    """The first `n` tokens of a run-length prompt."""
    out: list[tuple[int, int]] = []
    for token, count in runs:
        if n <= 0:
            break
        out.append((token, min(count, n)))
        n -= count
    return tuple(out)


def expand_runs(runs: Sequence[tuple[int, int]]) -> list[int]:
    """A run-length prompt's token ids."""
    out: list[int] = []
    for token, count in runs:
        out += [token] * count
    return out


def log_uniform_prompts(
    n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0
) -> list[WorkloadRequest]:
    """Prompt lengths log-uniform over the inclusive range (as many between 2k and 4k as between 8k
    and 16k), output lengths uniform over theirs; all arrive at 0."""
    lo, hi = prompt
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= prompt min <= prompt max, got {prompt}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
        out.append(WorkloadRequest(0.0, p, rng.randint(*output)))
    return out


def evenly_spaced(reqs: Sequence[WorkloadRequest], gap_s: float) -> list[WorkloadRequest]:
    """Keep the lengths; request i arrives at i * gap_s."""
    if not (gap_s >= 0 and math.isfinite(gap_s)):
        raise ValueError(f"gap_s must be finite and >= 0, got {gap_s!r}")
    return [replace(r, arrival_s=i * gap_s) for i, r in enumerate(reqs)]


def bursty_arrivals(reqs: Sequence[WorkloadRequest], burst_size: int,
                    period_s: float) -> list[WorkloadRequest]:
    """On/off arrivals: keep the lengths; requests come in bursts of `burst_size`, all of a burst at
    once, one burst every `period_s` seconds (request i at (i // burst_size) * period_s)."""
    if burst_size < 1:
        raise ValueError(f"burst_size must be >= 1, got {burst_size!r}")
    if not (period_s >= 0 and math.isfinite(period_s)):
        raise ValueError(f"period_s must be finite and >= 0, got {period_s!r}")
    return [replace(r, arrival_s=(i // burst_size) * period_s) for i, r in enumerate(reqs)]


def shared_prefix(num_groups: int, per_group: int, prefix_len: int, question_len: int,
                  output_len: int) -> list[WorkloadRequest]:
    """`num_groups` system prompts of `prefix_len` tokens, each followed by `per_group` distinct
    questions of `question_len` tokens; all arrive at 0, the groups interleaved (request i is in
    group i % num_groups), so every group's first request runs beside the others' first ones."""
    if num_groups < 1 or per_group < 1 or prefix_len < 1 or question_len < 1:
        raise ValueError(f"need groups, per_group, prefix_len and question_len >= 1, got "
                         f"{num_groups}, {per_group}, {prefix_len}, {question_len}")
    return [WorkloadRequest(0.0, prefix_len + question_len, output_len, prefix_id=i % num_groups,
                            prefix_len=prefix_len)
            for i in range(num_groups * per_group)]


def multi_turn(num_conversations: int, turns: int, system_len: int, user_len: int, output_len: int,
               gap_s: float = 0.0) -> list[WorkloadRequest]:
    """Chat replays: turn t of a conversation re-sends its whole history (the system prompt, every
    earlier user message and answer) and a new `user_len`-token message. The whole prompt is the
    conversation's (prefix_len = prompt_len): turn t shares turn t-1's prompt and answer. Turn t of
    every conversation arrives at t * gap_s (with gap_s 0, all at once: the harness replays turns in
    order)."""
    if num_conversations < 1 or turns < 1 or system_len < 0 or user_len < 1:
        raise ValueError(f"need conversations, turns, user_len >= 1 and system_len >= 0, got "
                         f"{num_conversations}, {turns}, {system_len}, {user_len}")
    out = []
    for t in range(turns):
        prompt = system_len + t * (user_len + output_len) + user_len
        for c in range(num_conversations):
            out.append(WorkloadRequest(t * gap_s, prompt, output_len, prefix_id=c, prefix_len=prompt))
    return out
