"""Prometheus metrics: vLLM's serving series under a `ppserve:` prefix, plus what only a pipeline can say.

One `ServerMetrics` per server, on its own registry (no process-global state). The engine thread feeds
it through the AsyncEngine's observer hooks (a request added, a step's deltas, a microbatch's stage
times); gauges of the current state (queue, KV usage, per-stage bubble fractions over the stats
window, restarts) are refreshed when /metrics is scraped, from the statistics the engine thread last
published (AsyncEngine.stats(), which does not ask that thread: a scrape never delays a step).

The series: vLLM's (requests running and waiting, KV cache usage, preemptions, prefix-cache queries and
hits, prompt and generation tokens, finished requests by reason, TTFT, inter-token and end-to-end latency
histograms, speculative decoding's drafts, draft tokens and accepted tokens in all and per draft position),
with vLLM's meaning where vLLM has one; and the pipeline's: each stage's busy, bubble and
starvation fractions over the stats window (ARCHITECTURE.md#measuring-bubbles definitions) and their mean,
tokens and each stage's compute seconds per microbatch (TP rank 0's), pipeline restarts and recovery time;
and structured outputs': grammar compiles, cache hits and failures, each compile's seconds (from the process's
grammar caches at scrape time; none is built for it) and the last stage's mask seconds per masked microbatch
(StepResult.grammar_mask_s). Each series' help text, in `ServerMetrics.__init__`, says what it counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ppserve.engine.messages import TokenDelta
from ppserve.engine.stats import EngineStats, GrammarStats, process_grammar_caches
from ppserve.sched.output import SchedulerOutput, StepResult

PREFIX = "ppserve:"
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_STEP = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
# A compile takes from milliseconds (a small schema) to the compile time limit; a mask fill, microseconds up.
_COMPILE = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_MASK = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)


class ServerMetrics:
    """The registry and its series; the `on_*` methods are the AsyncEngine's observer hooks."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, {"model_name": model_name}
        self._label = label

        def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, ["model_name", *extra], registry=r)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", *extra], registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float], extra: Sequence[str] = ()) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name", *extra], buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests holding KV blocks (prefilling or decoding).")
        self.waiting = gauge("num_requests_waiting", "Requests queued for their first (or next) schedule.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use, 0-1.")
        self.preemptions = counter("num_preemptions", "Recompute preemptions.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verifications that carried drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position (0: the first).",
                                             ["position"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests added.")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.")
        self.success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first output token.", _LATENCY)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                             _LATENCY)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last output token.", _LATENCY)
        self.busy = gauge("stage_busy_fraction", "Fraction of the stats window the stage computed or sent.",
                          ["stage"])
        self.bubble = gauge("stage_bubble_fraction", "Fraction of the stats window the stage idled while the "
                            "engine had work (a pipeline bubble).", ["stage"])
        self.starvation = gauge("stage_starvation_fraction", "Fraction of the stats window the stage idled "
                                "with no work at all.", ["stage"])
        self.mean_bubble = gauge("mean_bubble_fraction", "Bubble fraction averaged over the stages.")
        self.mb_tokens = histogram("microbatch_tokens", "Tokens per microbatch.", _TOKENS)
        self.mb_seconds = histogram("microbatch_compute_seconds", "A stage's compute time per microbatch "
                                    "(TP rank 0's, which ends with its slowest rank's).", _STEP, ["stage"])
        self.restarts = counter("pipeline_restarts", "Pipeline rebuilds after a stage died or hung.")
        self.recovery_total = counter("pipeline_recovery_seconds",
                                      "Time from a stage failure to serving again.")
        self.last_recovery = gauge("pipeline_last_recovery_seconds", "The latest rebuild's recovery time.")
        self.grammar_compiles = counter("grammar_compiles", "Structured-output grammars compiled (cache "
                                        "misses that finished).")
        self.grammar_hits = counter("grammar_cache_hits", "Structured-output requests whose grammar was "
                                    "cached or already compiling.")
        self.grammar_failures = counter("grammar_compile_failures", "Grammars that failed to compile.")
        self.grammar_compile_s = histogram("grammar_compile_seconds", "Seconds each grammar compile took.",
                                           _COMPILE)
        self.grammar_mask_s = histogram("grammar_mask_seconds", "The last stage's seconds filling grammar "
                                        "token masks, per microbatch that had one.", _MASK)
        # Every series exists from the start (at 0), so dashboards and rate() see it before its first event.
        for metric in (self.running, self.waiting, self.kv_usage, self.preemptions, self.prefix_queries,
                       self.prefix_hits, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted,
                       self.prompt_tokens,
                       self.generation_tokens, self.ttft, self.itl, self.e2e, self.mean_bubble,
                       self.mb_tokens, self.restarts, self.recovery_total, self.last_recovery,
                       self.grammar_compiles, self.grammar_hits, self.grammar_failures,
                       self.grammar_compile_s, self.grammar_mask_s):
            metric.labels(**label)
        for reason in ("stop", "length", "cancelled", "error"):
            self.success.labels(**label, finished_reason=reason)
        self._preemptions_seen = 0
        self._prefix_queries_seen = 0
        self._prefix_hits_seen = 0
        self._spec_drafts_seen = 0
        self._spec_draft_tokens_seen = 0
        self._spec_accepted_seen = 0
        self._spec_per_pos_seen: list[int] = []  # per position, as _advance's seen values
        self._restarts_seen = 0
        self._recovery_seen = 0.0
        self._grammar_seen = GrammarStats()

    # ---- engine-thread hooks -----------------------------------------------------------------------
    def on_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(**self._label).inc(num_prompt_tokens)

    def on_deltas(self, deltas: Sequence[TokenDelta]) -> None:
        for d in deltas:
            if d.token_ids:
                self.generation_tokens.labels(**self._label).inc(len(d.token_ids))
            if d.finished:
                self.success.labels(**self._label, finished_reason=d.finish_reason or "unknown").inc()
                if d.times is not None and d.times.token_times:
                    t = d.times
                    self.ttft.labels(**self._label).observe(max(0.0, t.token_times[0] - t.arrival))
                    self.e2e.labels(**self._label).observe(max(0.0, t.token_times[-1] - t.arrival))
                    itl = self.itl.labels(**self._label)
                    for a, b in zip(t.token_times, t.token_times[1:], strict=False):
                        itl.observe(max(0.0, b - a))

    def on_step(self, out: SchedulerOutput, result: StepResult) -> None:
        self.mb_tokens.labels(**self._label).observe(out.total_tokens)
        for stage, seconds in enumerate(result.stage_seconds):
            self.mb_seconds.labels(**self._label, stage=str(stage)).observe(seconds)
        if result.grammar_mask_s > 0.0:  # only microbatches that had a mask: no zeros in the histogram
            self.grammar_mask_s.labels(**self._label).observe(result.grammar_mask_s)

    # ---- at scrape time ------------------------------------------------------------------------------
    def refresh(self, stats: EngineStats) -> None:
        """Current-state gauges and the counters the engine keeps itself, from AsyncEngine.stats()."""
        lab = self._label
        self.running.labels(**lab).set(stats.running)
        self.waiting.labels(**lab).set(stats.waiting)
        total = stats.kv_blocks_total
        self.kv_usage.labels(**lab).set(stats.kv_blocks_used / total if total else 0.0)
        self._advance(self.preemptions, "_preemptions_seen", stats.num_preemptions)
        self._advance(self.prefix_queries, "_prefix_queries_seen", stats.prefix_cache_queries)
        self._advance(self.prefix_hits, "_prefix_hits_seen", stats.prefix_cache_hits)
        self._advance(self.spec_drafts, "_spec_drafts_seen", stats.spec_decode_num_drafts)
        self._advance(self.spec_draft_tokens, "_spec_draft_tokens_seen", stats.spec_decode_num_draft_tokens)
        self._advance(self.spec_accepted, "_spec_accepted_seen", stats.spec_decode_num_accepted_tokens)
        self._advance_per_pos(stats.spec_decode_num_accepted_tokens_per_pos)
        self._advance(self.restarts, "_restarts_seen", stats.num_restarts)
        self._advance(self.recovery_total, "_recovery_seen", stats.total_recovery_s)
        self.last_recovery.labels(**lab).set(stats.last_recovery_s)
        for st in stats.stages:
            stage = str(st.stage)
            self.busy.labels(**lab, stage=stage).set(st.busy_fraction)
            self.bubble.labels(**lab, stage=stage).set(st.bubble_fraction)
            self.starvation.labels(**lab, stage=stage).set(st.starvation_fraction)
        self.mean_bubble.labels(**lab).set(stats.mean_bubble_fraction)
        self.refresh_grammars()

    def refresh_grammars(self) -> None:
        """The grammar series from the process's grammar caches: their counts (totals, so only what they
        gained is added) and each compile finished since the last scrape. A process without structured
        outputs has no cache, and this reads nothing."""
        caches = process_grammar_caches()
        if not caches:
            return
        now = GrammarStats().with_compiles(caches)
        seen, lab = self._grammar_seen, self._label
        for counter, gained in ((self.grammar_compiles, now.compiles - seen.compiles),
                                (self.grammar_hits, now.cache_hits - seen.cache_hits),
                                (self.grammar_failures, now.compile_failures - seen.compile_failures)):
            if gained > 0:
                counter.labels(**lab).inc(gained)
        self._grammar_seen = now
        hist = self.grammar_compile_s.labels(**lab)
        for cache in caches:
            for seconds in cache.drain_compile_seconds():
                hist.observe(seconds)

    def _advance(self, counter: Counter, seen_attr: str, value: float) -> None:
        """Counters only go up: add what the engine's own total gained since the last scrape."""
        seen = getattr(self, seen_attr)
        if value > seen:
            counter.labels(**self._label).inc(value - seen)
            setattr(self, seen_attr, value)

    def _advance_per_pos(self, totals: Sequence[int]) -> None:
        """The per-position counter like `_advance`, each position its own series (made when first seen,
        as the positions are as many as the longest draft)."""
        seen = self._spec_per_pos_seen
        for pos, value in enumerate(totals):
            if pos == len(seen):
                seen.append(0)
                self.spec_accepted_per_pos.labels(**self._label, position=str(pos))
            if value > seen[pos]:
                self.spec_accepted_per_pos.labels(**self._label, position=str(pos)).inc(value - seen[pos])
                seen[pos] = value

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
