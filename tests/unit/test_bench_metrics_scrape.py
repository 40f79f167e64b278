"""benchmarks/bench_metrics_scrape.py's own accounting (no engine, no clock figures checked): the
engine-thread timer counts that thread only and nested calls once; the summary's per-scrape figure."""

from __future__ import annotations

import threading

import pytest

from tests.bench_scripts import load_benchmark


class Window:
    def drain_spans(self) -> int:
        return 1

    def snapshot(self) -> int:
        return self.drain_spans() + 1  # nested: timed once


def test_timer_counts_the_engine_thread_only_and_outermost_calls() -> None:
    bench = load_benchmark("bench_metrics_scrape")
    timer = bench.EngineThreadTimer()
    w = Window()
    timer.wrap(w, bench.WINDOW_METHODS)  # names the object lacks are skipped
    assert w.snapshot() == 2 and timer.calls == 0  # not the engine thread
    t = threading.Thread(target=lambda: [w.snapshot(), w.drain_spans()], name=bench.ENGINE_THREAD)
    t.start()
    t.join()
    assert timer.calls == 2 and timer.seconds > 0


def test_summary_per_scrape_is_the_growth_over_the_unscraped_rounds() -> None:
    bench = load_benchmark("bench_metrics_scrape")
    rounds = [
        {"hz": 0.0, "output_tok_s": 100.0, "wall_s": 10.0, "engine_stats_s": 0.01, "scrapes": 0,
         "scrape_latency_ms_mean": 0.0},
        {"hz": 10.0, "output_tok_s": 90.0, "wall_s": 20.0, "engine_stats_s": 0.22, "scrapes": 200,
         "scrape_latency_ms_mean": 5.0},
    ]
    s = bench.summarize(rounds, 10.0)
    assert s["tok_s_ratio"] == pytest.approx(0.9)
    assert s["engine_ms_per_scrape"] == pytest.approx(1e3 * (0.22 - 0.02) / 200)  # 0 Hz cost scaled to 20 s
    assert s["engine_stats_ms_per_s_hz"] == pytest.approx(11.0)
