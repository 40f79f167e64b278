"""Structured outputs' figures: the /metrics series, the stats window and bench reports, and the
`grammar_mask` spans in the Chrome trace and the timeline (nested inside prepare, outside the bubble math)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ppserve.bench.harness import RunResult, replay
from ppserve.bench.report import grammar_table, policy_table, write_json
from ppserve.engine.messages import TokenDelta
from ppserve.engine.stats import (
    EngineCounts,
    EngineStats,
    GrammarStats,
    StatsWindow,
    process_grammar_caches,
)
from ppserve.metrics.bubbles import bubble_report
from ppserve.metrics.latency import RequestTiming
from ppserve.metrics.spans import Span, WorkTracker
from ppserve.metrics.trace import load_chrome_trace, save_chrome_trace, to_chrome_trace, validate_chrome_trace
from ppserve.sched.output import SchedulerOutput, StepResult
from ppserve.server.metrics import ServerMetrics
from ppserve.sim.workload import WorkloadRequest
from ppserve.structured import grammars
from ppserve.structured.grammars import GrammarCache
from ppserve.structured.spec import GrammarError, StructuredOutputs
from ppserve.timeline import render, render_html, render_png, summary_text
from tests.server_helpers import metric_samples

MS = 1_000_000


class FakeBackend:
    """Compiles instantly; a regex "(" fails, as a bad pattern does in a real backend."""

    name = "fake"
    vocab_size = 8

    def compile(self, spec: StructuredOutputs) -> object:
        if spec.regex == "(":
            raise GrammarError("bad regex")
        return spec.key


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[GrammarCache]:
    """A grammar cache registered as the process's shared one for a made-up model (removed after)."""
    c = GrammarCache(FakeBackend)  # type: ignore[arg-type]
    monkeypatch.setattr(grammars, "_shared", {("fake-model", 8, (1,)): c})
    yield c
    c.shutdown()


def compile_some(c: GrammarCache) -> None:
    """Two compiles, one hit, one failure."""
    c.get(StructuredOutputs(regex="a+"))
    c.get(StructuredOutputs(choice=("x", "y")))
    c.get(StructuredOutputs(regex="a+"))
    with pytest.raises(GrammarError):
        c.get(StructuredOutputs(regex="("))


def microbatch(step: int) -> SchedulerOutput:
    return SchedulerOutput(step_id=step, order=("a",), num_scheduled_tokens=(1,), num_computed_tokens=(4,),
                           new_requests=(), cached_requests=(), sample_request_ids=("a",))


# ---- /metrics ---------------------------------------------------------------------------------------
def test_grammar_series_exist_at_zero_without_any_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammars, "_shared", {})
    m = ServerMetrics("m")
    m.refresh(EngineStats())
    s = metric_samples(m)
    for name in ("ppserve:grammar_compiles_total", "ppserve:grammar_cache_hits_total",
                 "ppserve:grammar_compile_failures_total", "ppserve:grammar_compile_seconds_count",
                 "ppserve:grammar_mask_seconds_count"):
        assert s[name + "{}"] == 0, name


def test_metrics_count_compiles_and_masked_microbatches(cache: GrammarCache) -> None:
    m = ServerMetrics("m")
    compile_some(cache)
    m.on_step(microbatch(0), StepResult(0, {"a": 1}, grammar_mask_s=0.002))
    m.on_step(microbatch(1), StepResult(1, {"a": 2}))  # no mask: not in the mask histogram
    m.on_step(microbatch(2), StepResult(2, {"a": 3}, grammar_mask_s=0.004))
    m.refresh(EngineStats())
    s = metric_samples(m)
    assert s["ppserve:grammar_compiles_total{}"] == 2
    assert s["ppserve:grammar_cache_hits_total{}"] == 1
    assert s["ppserve:grammar_compile_failures_total{}"] == 1
    assert s["ppserve:grammar_compile_seconds_count{}"] == 2
    assert s["ppserve:grammar_mask_seconds_count{}"] == 2
    assert s["ppserve:grammar_mask_seconds_sum{}"] == pytest.approx(0.006)
    # A second scrape adds nothing; a new compile adds one of each.
    m.refresh(EngineStats())
    assert metric_samples(m)["ppserve:grammar_compile_seconds_count{}"] == 2
    cache.get(StructuredOutputs(regex="b+"))
    m.refresh(EngineStats())
    s = metric_samples(m)
    assert s["ppserve:grammar_compiles_total{}"] == 3 and s["ppserve:grammar_compile_seconds_count{}"] == 3


def test_no_cache_is_built_or_imported_to_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "ppserve.structured.grammars")
    assert process_grammar_caches() == []


# ---- engine stats -------------------------------------------------------------------------------------
def test_stats_window_sums_mask_time_and_reads_compiles(cache: GrammarCache) -> None:
    window = StatsWindow(list, time.perf_counter, window_s=5.0)
    window.publish(EngineCounts())
    assert window.latest is not None and not window.latest.grammar_stats().nonzero
    compile_some(cache)
    for step, seconds in enumerate((0.001, 0.0, 0.003)):
        window.on_step(microbatch(step), StepResult(step, {"a": 1}, grammar_mask_s=seconds))
    window.publish(EngineCounts())
    g = window.latest.grammar_stats()
    assert (g.compiles, g.cache_hits, g.compile_failures, g.masked_steps) == (2, 1, 1, 2)
    assert g.mask_s == pytest.approx(0.004) and g.mask_mean_s == pytest.approx(0.002)
    assert g.compile_s == pytest.approx(cache.stats.compile_s)
    d = g.to_dict()
    assert d["mask_mean_s"] == pytest.approx(0.002) and d["compiles"] == 2
    assert g.since(g) == GrammarStats() and not GrammarStats().nonzero


# ---- bench reports -------------------------------------------------------------------------------------
class ReplayEngine:
    """Enough of LLMEngine for `replay`: one token per request per step; each step's result carries a
    grammar mask time, and the first step compiles a grammar in the shared cache."""

    def __init__(self, c: GrammarCache) -> None:
        self.cache = c
        self.clock = time.perf_counter
        self.core = SimpleNamespace(intake=None, step_observers=[])
        self.work = WorkTracker()
        self.config = SimpleNamespace(parallel=SimpleNamespace(pipeline_parallel_size=1))
        self.left: dict[str, int] = {}
        self.states: dict[str, Any] = {}
        self.steps = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.left)

    def reset_observations(self) -> None:
        pass

    def stats(self) -> EngineCounts:
        return EngineCounts()

    def add_request(self, prompt: list[int], sampling: Any, request_id: str, arrival_time: float) -> None:
        self.left[request_id] = sampling.max_tokens
        self.states[request_id] = SimpleNamespace(request=SimpleNamespace(first_scheduled_time=arrival_time))

    def request_state(self, rid: str) -> Any:
        return self.states[rid]

    def step(self) -> list[TokenDelta]:
        if self.steps == 0:
            self.cache.get(StructuredOutputs(regex="c+"))
        self.steps += 1
        out = []
        for obs in self.core.step_observers:
            obs(microbatch(self.steps), StepResult(self.steps, {}, grammar_mask_s=0.001))
        now = self.clock()
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            out.append(TokenDelta(rid, (7,), "a", (now,), done, "length" if done else None))
            if done:
                del self.left[rid]
        return out

    def collect_spans(self) -> list[Span]:
        return []


def test_replay_reports_the_runs_grammar_figures(cache: GrammarCache, tmp_path: Path) -> None:
    compile_some(cache)  # before the run: not the run's
    eng = ReplayEngine(cache)
    run = replay(eng, [WorkloadRequest(0.0, 4, 3)], [[1, 2, 3, 4]], progress=False)
    assert eng.core.step_observers == []  # the run's observer is gone after it
    g = run.meta["grammar"]
    assert (g["compiles"], g["cache_hits"], g["masked_steps"]) == (1, 0, 3)
    assert g["mask_s"] == pytest.approx(0.003) and g["mask_mean_s"] == pytest.approx(0.001)
    summary = run.summary()
    assert summary["grammar"] == g
    table = policy_table([summary])
    assert "| grammar compiles |" in table and "| run | 1 | 0 | 0 |" in table
    data = json.loads(write_json(tmp_path / "r.json", {"summaries": {"run": summary}}).read_text())
    assert data["summaries"]["run"]["grammar"]["masked_steps"] == 3


def test_reports_leave_grammar_out_when_no_run_used_it() -> None:
    timing = RequestTiming(0.0, 0.0, [0.1, 0.2])
    summary = RunResult("plain", {"r": timing}, [], [], 1).summary()
    assert "grammar" not in summary
    assert grammar_table([summary]) == "" and "grammar" not in policy_table([summary])


# ---- trace and timeline ---------------------------------------------------------------------------------
def masked_pipeline(p: int = 2, m: int = 3, d: int = 10 * MS) -> list[Span]:
    """GPipe-like: each stage prepares then computes each microbatch; the last stage fills a grammar
    mask inside each of its prepares."""
    spans = []
    for j in range(m):
        for s in range(p):
            start = (s + j) * d
            spans.append(Span("prepare", start, start + 2 * MS, s, 0, j))
            if s == p - 1:
                spans.append(Span("grammar_mask", start + MS // 2, start + MS, s, 0, j))
            spans.append(Span("compute", start + 2 * MS, start + d, s, 0, j, 0, 2, (f"r{j}",)))
    return spans


def test_trace_nests_grammar_mask_slices_inside_prepare_on_the_stage_track() -> None:
    spans = masked_pipeline()
    trace = to_chrome_trace(spans, [(0, 40 * MS)])
    assert validate_chrome_trace(trace) == []
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert not any("overlap" in n for n in names.values())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    masks = [e for e in xs if e["name"] == "grammar_mask"]
    assert len(masks) == 3 and {names[e["tid"]] for e in masks} == {"stage 1 / tp 0"}
    prepares = [e for e in xs if e["name"] == "prepare" and e["tid"] == masks[0]["tid"]]
    for mk in masks:
        assert any(p["ts"] <= mk["ts"] and mk["ts"] + mk["dur"] <= p["ts"] + p["dur"] for p in prepares)
        assert mk["cat"] == "grammar_mask" and mk["args"]["span"]["kind"] == "grammar_mask"


def test_a_grammar_mask_outside_any_prepare_goes_to_an_overflow_track() -> None:
    spans = [Span("compute", 0, 10 * MS, 0, 0, 0), Span("grammar_mask", 12 * MS, 13 * MS, 0, 0, 1),
             Span("compute", 20 * MS, 30 * MS, 0, 0, 1)]
    trace = to_chrome_trace(spans, [(0, 30 * MS)])  # 10..20 ms is a bubble on the stage's own track
    assert validate_chrome_trace(trace) == []
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    mask = next(e for e in trace["traceEvents"] if e.get("name") == "grammar_mask")
    assert names[mask["tid"]] == "stage 0 / tp 0 (overlap 1)"


def test_grammar_masks_leave_the_bubble_math_unchanged(tmp_path: Path) -> None:
    spans = masked_pipeline()
    plain = [s for s in spans if s.kind != "grammar_mask"]
    work = [(0, 40 * MS)]
    with_masks = bubble_report(spans, work, "all")
    assert with_masks == bubble_report(plain, work, "all")
    path = tmp_path / "t.json"
    save_chrome_trace(path, spans, work)
    back, back_work = load_chrome_trace(path)
    assert back == spans and bubble_report(back, back_work, "all") == with_masks


def test_timeline_draws_grammar_masks(tmp_path: Path) -> None:
    path = tmp_path / "masked.json"
    save_chrome_trace(path, masked_pipeline(), [(0, 40 * MS)])
    png = render_png(path, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = render_html(path, tmp_path / "t.html").read_text()
    assert page.count('data-kind="grammar_mask"') == 3 and "grammar mask for microbatch 2" in page
    assert "grammar mask" in page.split("<svg", 1)[0]  # named in the legend line
    assert "grammar masks: 3 on stage(s) 1; mean 0.500 ms" in summary_text(path, "all")
    # The PNG's legend names them.
    run = render.load_run(path)
    fig, axes = render._figure(1, [2])
    render._draw_run(axes[0][0], axes[0][1], run, "all", "t")
    assert "grammar mask" in [t.get_text() for t in axes[0][0].get_legend().get_texts()]
    render._plt().close(fig)


def test_timeline_without_grammar_masks_has_no_legend_entry(tmp_path: Path) -> None:
    path = tmp_path / "plain.json"
    save_chrome_trace(path, [s for s in masked_pipeline() if s.kind != "grammar_mask"], [(0, 40 * MS)])
    page = render_html(path, tmp_path / "t.html").read_text()
    assert "grammar_mask" not in page and "grammar mask" not in page
    run = render.load_run(path)
    fig, axes = render._figure(1, [2])
    render._draw_run(axes[0][0], axes[0][1], run, "all", "t")
    assert "grammar mask" not in [t.get_text() for t in axes[0][0].get_legend().get_texts()]
    render._plt().close(fig)


def test_engine_stats_keep_the_wire_fields() -> None:
    """The grammar figures ride beside EngineStats (the wire message has no field for them)."""
    assert "grammar" not in {f.name for f in dataclasses.fields(EngineStats)}
