"""The Prometheus exporter: hooks, scrape-time gauges, counters that only go up, and the Grafana
dashboard plotting only series that exist."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from ppserve.engine.messages import RequestTimes, TokenDelta
from ppserve.engine.stats import EngineStats, StageBubbles
from ppserve.sched.output import SchedulerOutput, StepResult
from ppserve.server.metrics import ServerMetrics
from tests.server_helpers import metric_samples

DASHBOARD = Path(__file__).resolve().parents[2] / "launch" / "grafana" / "ppserve-dashboard.json"


def _stats(**kw: Any) -> EngineStats:
    base = EngineStats(running=2, waiting=1, kv_blocks_used=3, kv_blocks_total=12, mean_bubble_fraction=0.1,
                       stages=(StageBubbles(stage=0, busy_fraction=0.8, bubble_fraction=0.1,
                                            starvation_fraction=0.1),
                               StageBubbles(stage=1, busy_fraction=0.7, bubble_fraction=0.2,
                                            starvation_fraction=0.1)))
    return dataclasses.replace(base, **kw)


def test_hooks_feed_counters_and_latency_histograms() -> None:
    m = ServerMetrics("m")
    m.on_added(10)
    m.on_deltas([TokenDelta("a", (1, 2), "xy", (1.0, 1.0), False)])
    m.on_deltas([TokenDelta("a", (3,), "z", (1.5,), True, "stop", RequestTimes(0.5, 0.6, [1.0, 1.0, 1.5]))])
    out = SchedulerOutput(step_id=0, order=("a",), num_scheduled_tokens=(5,), num_computed_tokens=(0,),
                          new_requests=(), cached_requests=(), sample_request_ids=("a",))
    m.on_step(out, StepResult(0, {"a": 1}, (0.01, 0.02), timed_step_id=0))
    s = metric_samples(m)
    assert s["ppserve:prompt_tokens_total{}"] == 10
    assert s["ppserve:generation_tokens_total{}"] == 3
    assert s["ppserve:request_success_total{finished_reason=stop}"] == 1
    assert s["ppserve:time_to_first_token_seconds_sum{}"] == 0.5
    assert s["ppserve:e2e_request_latency_seconds_sum{}"] == 1.0
    assert s["ppserve:inter_token_latency_seconds_count{}"] == 2
    assert s["ppserve:microbatch_tokens_sum{}"] == 5
    assert s["ppserve:microbatch_compute_seconds_sum{stage=1}"] == 0.02


def test_refresh_sets_gauges_and_counters_only_grow() -> None:
    m = ServerMetrics("m")
    m.refresh(_stats(num_preemptions=4, num_restarts=1, total_recovery_s=2.5, last_recovery_s=2.5))
    s = metric_samples(m)
    assert s["ppserve:num_requests_running{}"] == 2 and s["ppserve:num_requests_waiting{}"] == 1
    assert s["ppserve:kv_cache_usage_perc{}"] == 0.25
    assert (s["ppserve:stage_bubble_fraction{stage=1}"] == 0.2
            and s["ppserve:stage_busy_fraction{stage=0}"] == 0.8)
    assert s["ppserve:num_preemptions_total{}"] == 4 and s["ppserve:pipeline_restarts_total{}"] == 1
    m.refresh(_stats(num_preemptions=6, num_restarts=1, total_recovery_s=2.5, last_recovery_s=2.5))
    assert metric_samples(m)["ppserve:num_preemptions_total{}"] == 6  # the engine's totals, not their sum


def test_the_dashboard_plots_only_series_the_exporter_has() -> None:
    dash = json.loads(DASHBOARD.read_text())
    names = {fam.name for fam in ServerMetrics("m").registry.collect()}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count|total)$", "", n) for e in exprs
            for n in re.findall(r"ppserve:[a-z0-9_]+", e)}
    assert used and used <= names, used - names
    assert {"ppserve:stage_bubble_fraction", "ppserve:time_to_first_token_seconds"} <= used


def test_speculation_counters_follow_the_engine_totals_per_position() -> None:
    m = ServerMetrics("m")
    s = metric_samples(m)
    assert s["ppserve:spec_decode_num_drafts_total{}"] == 0  # the series exist before any draft
    assert s["ppserve:spec_decode_num_accepted_tokens_total{}"] == 0
    assert not any(k.startswith("ppserve:spec_decode_num_accepted_tokens_per_pos_total") for k in s)
    m.refresh(_stats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=9,
                     spec_decode_num_accepted_tokens=4, spec_decode_num_accepted_tokens_per_pos=(3, 1, 0)))
    m.refresh(_stats(spec_decode_num_drafts=5, spec_decode_num_draft_tokens=15,
                     spec_decode_num_accepted_tokens=7, spec_decode_num_accepted_tokens_per_pos=(4, 2, 1, 0)))
    s = metric_samples(m)
    assert (s["ppserve:spec_decode_num_drafts_total{}"], s["ppserve:spec_decode_num_draft_tokens_total{}"],
            s["ppserve:spec_decode_num_accepted_tokens_total{}"]) == (5, 15, 7)
    per_pos = [s[f"ppserve:spec_decode_num_accepted_tokens_per_pos_total{{position={p}}}"] for p in range(4)]
    assert per_pos == [4, 2, 1, 0]  # the engine's totals, each position its own series
