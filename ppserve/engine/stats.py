"""Engine statistics: the one typed `EngineStats` every reader shares, and the window that computes it.

GetStats (server/servicer.py, converted in server/convert.py), Prometheus `/metrics`
(server/metrics.py) and `ppserve stats` (server/cli.py, through the client) all read `EngineStats`;
its field names are those of the ppserve.v1 `Stats` message, so the conversion is field for field.
`EngineCounts` is the part LLMEngine knows itself (queue, KV blocks, restarts, speculation); `StatsWindow`,
owned by the AsyncEngine and fed on the engine thread only, adds the recent window: output tokens per second
and each stage's bubble figures (ARCHITECTURE.md#measuring-bubbles) over the last `window_s` seconds.

Readers never run on the engine thread: it publishes an immutable `StatsSnapshot` after every step
(counts and token totals: a few attribute reads) and, at a bounded rate, the spans it drained
(`SpanWindow`); a reader's `StatsSnapshot.stats()` computes the bubble report itself, once per drain.
So a `/metrics` scrape or a GetStats call costs the engine thread nothing, however often it comes.

Structured outputs' figures (`GrammarStats`) are kept beside EngineStats, not in it: EngineStats names
exactly the wire message's fields, and the wire has none for grammars yet. Compiles are read from the
process's grammar caches (never building one), mask time from each microbatch's StepResult.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ppserve.config import EngineConfig, config_to_dict
from ppserve.engine.messages import TokenDelta
from ppserve.metrics.bubbles import bubble_report
from ppserve.metrics.spans import Span, WorkInterval
from ppserve.worker.info import WorkerInfo

if TYPE_CHECKING:
    from ppserve.sched.output import SchedulerOutput, StepResult
    from ppserve.structured.grammars import GrammarCache

logger = logging.getLogger(__name__)

# Drain stage spans at least this often while the engine is busy (a drain waits for in-flight work, so it
# is rate-bounded rather than done per scrape); an engine that has just gone idle drains at once.
SPAN_DRAIN_INTERVAL_S = 10.0
STATS_WINDOW_S = 30.0  # the "recent window" of GetStats rates and bubble fractions


@dataclass(frozen=True)
class StageBubbles:
    """One stage over the stats window, as fractions of it (busy + bubble + starvation = 1)."""

    stage: int
    busy_fraction: float
    bubble_fraction: float  # idle while the engine had work
    starvation_fraction: float  # idle with no work at all


@dataclass(frozen=True)
class ServingConfig:
    """The serving settings a stats reader wants at a glance, and the whole configuration as JSON."""

    model: str = ""
    pipeline_parallel_size: int = 0
    tensor_parallel_size: int = 0
    policy: str = ""
    token_budget: int = 0
    max_num_seqs: int = 0
    max_waiting: int = 0
    block_size: int = 0
    max_model_len: int = 0
    config_json: str = ""

    @classmethod
    def of(cls, c: EngineConfig, *, block_size: int, max_model_len: int) -> ServingConfig:
        """From the engine's config and what the engine resolved at start-up (block size, context)."""
        return cls(
            model=c.model.model or "SmolLM2-135M-Instruct (default)",
            pipeline_parallel_size=c.parallel.pipeline_parallel_size,
            tensor_parallel_size=c.parallel.tensor_parallel_size,
            policy=c.scheduler.policy,
            token_budget=c.scheduler.token_budget,
            max_num_seqs=c.scheduler.max_num_seqs,
            max_waiting=c.scheduler.max_waiting,
            block_size=block_size,
            max_model_len=max_model_len,
            config_json=json.dumps(config_to_dict(c), default=str, sort_keys=True),
        )


@dataclass(frozen=True)
class EngineCounts:
    """What LLMEngine.stats() knows now: its queue, in-flight microbatches, KV blocks, restarts and the
    speculative decoding counters (vLLM's `spec_decode_*`; zeros and no positions with speculation off)."""

    running: int = 0
    waiting: int = 0
    in_flight_microbatches: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0  # blocks the prefix cache holds a key for (held or evictable)
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache since start (admissions)
    prefix_cache_hits: int = 0  # of them, tokens found cached
    prefix_cache_hit_rate: float = 0.0  # hits / queries (0 before any query)
    num_preemptions: int = 0
    num_restarts: int = 0
    last_recovery_s: float = 0.0  # failure detected -> serving again, latest rebuild; 0 before any
    total_recovery_s: float = 0.0
    spec_decode_num_drafts: int = 0  # verifications that carried drafts, since start
    spec_decode_num_draft_tokens: int = 0  # drafts proposed
    spec_decode_num_accepted_tokens: int = 0  # of them, accepted
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # accepted at each position (0: first)
    spec_decode_acceptance_rate: float = 0.0  # accepted / draft tokens (0 before any draft)
    spec_decode_mean_acceptance_length: float = 0.0  # 1 + accepted / drafts: tokens per verification

    @property
    def speculated(self) -> bool:
        """Whether any verification carried drafts (readers show the speculation figures only then)."""
        return self.spec_decode_num_drafts > 0


def acceptance_fields(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> dict[str, float]:
    """vLLM's derived speculation figures: the acceptance rate (accepted / draft tokens) and the mean
    acceptance length (1 + accepted / drafts: tokens each verification yields); zeros without drafts."""
    rate = num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0
    length = 1 + num_accepted_tokens / num_drafts if num_drafts else 0.0
    return {"spec_decode_acceptance_rate": rate, "spec_decode_mean_acceptance_length": length}


def spec_decode_since(before: EngineCounts, after: EngineCounts) -> dict[str, object] | None:
    """The speculation figures of what happened between two stats readings (a benchmark run's own), named
    as in EngineCounts without the `spec_decode_` prefix; None when no verification carried drafts."""
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    if drafts <= 0:
        return None
    tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    was = before.spec_decode_num_accepted_tokens_per_pos
    per_pos = [n - (was[i] if i < len(was) else 0)
               for i, n in enumerate(after.spec_decode_num_accepted_tokens_per_pos)]
    derived = acceptance_fields(drafts, tokens, accepted)
    return {"num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted_tokens": accepted,
            "num_accepted_tokens_per_pos": per_pos,
            "acceptance_rate": derived["spec_decode_acceptance_rate"],
            "mean_acceptance_length": derived["spec_decode_mean_acceptance_length"]}


@dataclass(frozen=True)
class EngineStats(EngineCounts):
    """The counts plus the recent window, the workers and the serving config: what GetStats answers."""

    tokens_per_s: float = 0.0  # output tokens per second over the window
    window_s: float = 0.0  # how long the window the rates and fractions cover is
    stages: tuple[StageBubbles, ...] = ()
    mean_bubble_fraction: float = 0.0
    workers: tuple[WorkerInfo, ...] = ()
    config: ServingConfig = field(default_factory=ServingConfig)
    requests_finished: int = 0
    tokens_generated: int = 0  # since start
    uptime_s: float = 0.0

    def to_dict(self) -> dict[str, object]:
        """Plain builtins (for JSON): the wire message's field names, nested records as dicts."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class GrammarStats:
    """Structured outputs' work since start: the grammar caches' compiles and the last stage's masks."""

    compiles: int = 0  # grammars compiled (cache misses that finished)
    cache_hits: int = 0  # requests whose grammar was cached or already compiling
    compile_failures: int = 0
    compile_s: float = 0.0  # seconds compiling, all compiles together
    mask_s: float = 0.0  # the last stage's seconds filling token masks, all microbatches together
    masked_steps: int = 0  # microbatches that carried a mask (a nonzero StepResult.grammar_mask_s)

    @property
    def mask_mean_s(self) -> float:
        """Mask seconds per masked microbatch (0 before any)."""
        return self.mask_s / self.masked_steps if self.masked_steps else 0.0

    @property
    def nonzero(self) -> bool:
        """Whether any structured-output work happened (reports show the figures only then)."""
        return bool(self.compiles or self.cache_hits or self.compile_failures or self.masked_steps)

    def since(self, before: GrammarStats) -> GrammarStats:
        """What happened after `before` (a run's own figures from totals taken around it)."""
        return GrammarStats(self.compiles - before.compiles, self.cache_hits - before.cache_hits,
                            self.compile_failures - before.compile_failures,
                            self.compile_s - before.compile_s, self.mask_s - before.mask_s,
                            self.masked_steps - before.masked_steps)

    def with_compiles(self, caches: Sequence[GrammarCache]) -> GrammarStats:
        """These mask figures with the compile counts of `caches` (their totals since each was built)."""
        stats = [c.stats for c in caches]
        return dataclasses.replace(
            self, compiles=sum(c.compiles for c in stats), cache_hits=sum(c.hits for c in stats),
            compile_failures=sum(c.failures for c in stats), compile_s=sum(c.compile_s for c in stats))

    def to_dict(self) -> dict[str, float]:
        """Plain numbers for JSON, the per-masked-step mean included."""
        return {**dataclasses.asdict(self), "mask_mean_s": self.mask_mean_s}


def process_grammar_caches() -> list[GrammarCache]:
    """The grammar caches this process has built (structured/grammars.py `shared_cache`), building none:
    a process that never imported the grammars module has none, and importing it would load torch."""
    mod = sys.modules.get("ppserve.structured.grammars")
    if mod is None:
        return []
    found: list[GrammarCache] = mod.caches()
    return found


class GrammarTally:
    """Mask time summed from each microbatch's StepResult; `on_step` is an engine core step observer
    (engine thread only, so no lock), `latest` the immutable figures any thread may read."""

    def __init__(self) -> None:
        self.latest = GrammarStats()  # replaced whole on each masked microbatch, never mutated

    def on_step(self, out: SchedulerOutput, result: StepResult) -> None:
        seconds = result.grammar_mask_s
        if seconds > 0.0:  # an unmasked microbatch costs one attribute read
            last = self.latest
            self.latest = dataclasses.replace(last, mask_s=last.mask_s + seconds,
                                              masked_steps=last.masked_steps + 1)

    def stats(self) -> GrammarStats:
        """The mask figures so far with the process's compile counts."""
        return self.latest.with_compiles(process_grammar_caches())


@dataclass(frozen=True)
class SpanWindow:
    """The spans of one drain over the window ending at it, and what the engine said at that drain.
    Immutable: the bubble report is computed from it by whichever thread reads it first, once."""

    spans: tuple[Span, ...]
    work: tuple[WorkInterval, ...]  # the engine's had-work intervals, the open one cut at end_ns
    t0_ns: int
    end_ns: int  # when the spans were drained: the bubble figures are as of then
    workers: tuple[WorkerInfo, ...]
    config: ServingConfig

    @functools.cached_property
    def bubbles(self) -> tuple[tuple[StageBubbles, ...], float]:
        """Each stage's fractions over (t0_ns, end_ns) and their mean; ((), 0.0) without stage spans."""
        if not self.spans:
            return (), 0.0
        try:
            rep = bubble_report(self.spans, self.work, window=(self.t0_ns, self.end_ns))
        except Exception as e:  # e.g. a window with no stage spans at all
            logger.debug("bubble report: %s", e)
            return (), 0.0
        stages = tuple(StageBubbles(st.stage, st.busy_fraction, st.bubble_fraction, st.starvation_fraction)
                       for st in rep.stages)
        return stages, rep.mean_bubble_fraction


_NO_SPANS = SpanWindow((), (), 0, 0, (), ServingConfig())


@dataclass(frozen=True)
class StatsSnapshot:
    """What the engine thread published last; any thread may read it (nothing in it changes)."""

    counts: EngineCounts
    tokens_per_s: float
    window_s: float
    tokens_generated: int
    requests_finished: int
    uptime_s: float
    spans: SpanWindow
    grammar: GrammarStats = GrammarStats()  # mask figures as of this publish (see grammar_stats)

    @property
    def ready(self) -> bool:
        """Whether stats() is cheap now (the bubble report of this drain is computed)."""
        return "bubbles" in self.spans.__dict__

    def stats(self) -> EngineStats:
        """The EngineStats of this snapshot (the bubble report is computed here, off the engine thread)."""
        stages, mean_bubble = self.spans.bubbles
        return EngineStats(
            **{f.name: getattr(self.counts, f.name) for f in dataclasses.fields(EngineCounts)},
            tokens_per_s=self.tokens_per_s,
            window_s=self.window_s,
            stages=stages,
            mean_bubble_fraction=mean_bubble,
            workers=self.spans.workers,
            config=self.spans.config,
            requests_finished=self.requests_finished,
            tokens_generated=self.tokens_generated,
            uptime_s=self.uptime_s,
        )

    def grammar_stats(self) -> GrammarStats:
        """Structured outputs' figures: this snapshot's mask time, the process's compiles as of now (read
        here, by the reader: the compile thread updates them, never the engine thread)."""
        return self.grammar.with_compiles(process_grammar_caches())


class StatsWindow:
    """Output tokens and stage spans over the last `window_s` seconds. Fed on the engine thread only;
    read by any thread through `latest`, the snapshot `publish` put there.

    `collect_spans` drains the stages' new spans (a drain waits for in-flight work, so the AsyncEngine
    calls `drain` every SPAN_DRAIN_INTERVAL_S while busy and once each time it goes idle); spans older
    than the window are dropped unless `keep_all_spans` (a trace file or the demo's timeline wants them all).
    `on_step` sums the microbatches' grammar mask time, once registered as an engine core step observer.
    """

    def __init__(self, collect_spans: Callable[[], Iterable[Span]], clock: Callable[[], float], *,
                 window_s: float = STATS_WINDOW_S, keep_all_spans: bool = False) -> None:
        self.collect_spans = collect_spans
        self.clock = clock  # the engine's clock (seconds), which stamps tokens
        self.window_s = window_s
        self.keep_all_spans = keep_all_spans
        self.tokens_total = 0
        self.finished_total = 0
        self._spans: collections.deque[Span] = collections.deque()
        self._token_log: collections.deque[tuple[float, int]] = collections.deque()  # (engine time, tokens)
        self._window_tokens = 0  # the sum over _token_log, kept as it changes (publish runs every step)
        self._last_drain = time.monotonic()
        self._start_time = clock()
        self._start_ns = time.perf_counter_ns()
        self._span_window = _NO_SPANS
        self.grammar = GrammarTally()
        self.latest: StatsSnapshot | None = None  # replaced whole (one reference store), never mutated

    def on_step(self, out: SchedulerOutput, result: StepResult) -> None:
        """An engine core step observer (engine thread): the microbatch's grammar mask time."""
        self.grammar.on_step(out, result)

    def record(self, deltas: Sequence[TokenDelta]) -> None:
        """One step's output: its tokens count towards the rate, its finished requests towards the total."""
        n = sum(len(d.token_ids) for d in deltas)
        self.finished_total += sum(d.finished for d in deltas)
        self.tokens_total += n
        self._token_log.append((self.clock(), n))
        self._window_tokens += n

    @property
    def drain_due(self) -> bool:
        return time.monotonic() - self._last_drain > SPAN_DRAIN_INTERVAL_S

    def drain_spans(self) -> None:
        self._last_drain = time.monotonic()
        try:
            self._spans.extend(self.collect_spans())
        except Exception as e:  # observability must never take serving down
            logger.warning("collecting spans failed: %s", e)
            return
        if not self.keep_all_spans:
            horizon = time.perf_counter_ns() - int(self.window_s * 1e9)
            while self._spans and self._spans[0].end_ns < horizon:
                self._spans.popleft()

    def all_spans(self) -> list[Span]:
        """Every span kept so far, freshly drained."""
        self.drain_spans()
        return list(self._spans)

    def drain(self, work_intervals: Callable[[int, int], Iterable[WorkInterval]],
              workers: Sequence[WorkerInfo], config: ServingConfig) -> None:
        """Drain the stages' spans and keep the window's as the next snapshots' SpanWindow.
        `work_intervals(now_ns, since_ns)` gives the engine's had-work intervals that end after since_ns."""
        self.drain_spans()
        now_ns = time.perf_counter_ns()
        t0_ns = max(self._start_ns, now_ns - int(self.window_s * 1e9))
        self._span_window = SpanWindow(self._recent_spans(t0_ns), tuple(work_intervals(now_ns, t0_ns)),
                                       t0_ns, now_ns, tuple(workers), config)

    def publish(self, counts: EngineCounts) -> None:
        """Put a new snapshot in `latest`: `counts`, the token rate now and the last drain's spans."""
        now_ns = time.perf_counter_ns()
        window_s = max(1e-9, (now_ns - max(self._start_ns, now_ns - int(self.window_s * 1e9))) / 1e9)
        now = self.clock()
        while self._token_log and self._token_log[0][0] < now - self.window_s:
            self._window_tokens -= self._token_log.popleft()[1]
        self.latest = StatsSnapshot(
            counts=counts,
            tokens_per_s=self._window_tokens / window_s,
            window_s=window_s,
            tokens_generated=self.tokens_total,
            requests_finished=self.finished_total,
            uptime_s=now - self._start_time,
            spans=self._span_window,
            grammar=self.grammar.latest,
        )

    def _recent_spans(self, t0_ns: int) -> tuple[Span, ...]:
        """The kept spans that end after t0_ns. Spans arrive drain by drain in time order, so the scan
        from the newest stops a whole window before t0_ns: with keep_all_spans, older ones are never read."""
        recent = []
        stop_ns = t0_ns - int(self.window_s * 1e9)
        for sp in reversed(self._spans):
            if sp.end_ns < stop_ns:
                break
            if sp.end_ns > t0_ns:
                recent.append(sp)
        recent.reverse()
        return tuple(recent)
