"""Statistics are published by the engine thread and read anywhere: a reader never waits for a step,
never drains spans itself, and sees what a finished request's client saw (engine/stats.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.messages import PromptInput, TokenDelta
from ppserve.engine.stats import EngineCounts, ServingConfig, StatsWindow
from ppserve.metrics.spans import Span
from ppserve.request import SamplingParams
from tests.fake_engine import FakeEngine


class CountingEngine(FakeEngine):
    """The fake engine, counting span drains and the threads that ask it for its counts; a step can be
    held (`hold` cleared) to show that stats() does not wait for the engine thread."""

    def __init__(self) -> None:
        super().__init__(max_waiting=8)
        self.drains = 0
        self.stats_threads: set[str] = set()
        self.hold = threading.Event()
        self.hold.set()
        self.in_step = threading.Event()

    def step(self):  # type: ignore[no-untyped-def]
        self.in_step.set()
        self.hold.wait()
        return super().step()

    def stats(self) -> EngineCounts:
        self.stats_threads.add(threading.current_thread().name)
        return super().stats()

    def collect_spans(self) -> list[Span]:
        self.drains += 1
        now = time.perf_counter_ns()
        return [Span("compute", now - 1_000_000, now, 0, 0, 0)]


def _run(main: Callable[[AsyncEngine, CountingEngine], Any]) -> Any:
    async def outer() -> Any:
        fake = CountingEngine()
        eng = AsyncEngine(fake)
        eng.start()
        try:
            return await main(eng, fake)
        finally:
            fake.hold.set()
            await asyncio.get_running_loop().run_in_executor(None, eng.stop)

    return asyncio.run(outer())


def test_stats_answer_while_the_engine_thread_is_busy_in_a_step() -> None:
    async def main(eng: AsyncEngine, fake: CountingEngine) -> None:
        fake.hold.clear()
        stream = await eng.add_request(PromptInput(token_ids=(1, 2)), SamplingParams(max_tokens=3))
        await asyncio.get_running_loop().run_in_executor(None, fake.in_step.wait, 5.0)
        # The engine thread is stuck in step(): a stats call that needed it would time out here.
        s = await asyncio.wait_for(eng.stats(), timeout=1.0)
        assert s.workers and s.config.block_size == 16
        fake.hold.set()
        assert sum([len(c.token_ids) async for c in stream]) == 3

    _run(main)


def test_many_reads_cost_the_engine_no_drains_and_see_finished_requests() -> None:
    async def main(eng: AsyncEngine, fake: CountingEngine) -> None:
        for i in range(3):
            stream = await eng.add_request(PromptInput(token_ids=(1,)), SamplingParams(max_tokens=5))
            assert sum([len(c.token_ids) async for c in stream]) == 5
            # Published before the last token was delivered: the client's finished request is counted,
            # and the idle engine drained its spans once (so the stage figures are current).
            s = await eng.stats()
            assert (s.tokens_generated, s.requests_finished, s.running) == (5 * (i + 1), i + 1, 0)
            assert [st.stage for st in s.stages] == [0]
        drains = fake.drains
        for _ in range(200):
            await eng.stats()
        assert fake.drains == drains  # reads never drain
        assert fake.stats_threads == {"MainThread", "ppserve-engine"}  # start(), then the engine thread only

    _run(main)


def test_a_snapshot_is_immutable_and_its_bubble_report_computed_once() -> None:
    window = StatsWindow(lambda: [Span("compute", start_ns, time.perf_counter_ns(), 0, 0, 0)],
                         time.perf_counter, window_s=5.0)
    start_ns = time.perf_counter_ns()
    window.record([TokenDelta("r", (1, 2), "ab", (0.0, 0.0), True, "length")])
    window.drain(lambda now_ns, since_ns: [(since_ns, now_ns)], [], ServingConfig(model="m"))
    window.publish(EngineCounts(running=1))
    snap = window.latest
    assert snap is not None and not snap.ready
    first = snap.stats()
    assert snap.ready and snap.stats() == first
    assert (first.running, first.tokens_generated, first.requests_finished,
            first.config.model) == (1, 2, 1, "m")
    assert [st.stage for st in first.stages] == [0] and first.tokens_per_s > 0
    # A new publish replaces the snapshot; the old one a reader holds does not change.
    window.record([TokenDelta("s", (3,), "c", (0.0,), False, None)])
    window.publish(EngineCounts(running=2))
    assert window.latest is not snap and window.latest.stats().tokens_generated == 3
    assert snap.stats() == first
    with pytest.raises(AttributeError):
        snap.counts = EngineCounts()  # type: ignore[misc]


def test_spans_outside_the_window_are_not_read_even_when_all_are_kept() -> None:
    """With keep_all_spans (a trace file), the window's copy still holds only its last window_s seconds."""
    spans: list[Span] = []

    def drain() -> list[Span]:
        out = list(spans)
        spans.clear()
        return out

    window = StatsWindow(drain, time.perf_counter, window_s=5.0, keep_all_spans=True)
    now = time.perf_counter_ns()
    # Spans from long ago (as after hours of serving with a trace file), then one of the last moment.
    old = [Span("compute", now - int(100e9) + i, now - int(100e9) + i + 1, 0, 0, 0) for i in range(1000)]
    recent = [Span("compute", now, time.perf_counter_ns(), 0, 0, 0)]
    spans.extend(old + recent)
    window.drain(lambda now_ns, since_ns: [], [], ServingConfig())
    window.publish(EngineCounts())
    assert window.latest is not None and window.latest.spans.spans == tuple(recent)
    assert len(window.all_spans()) == 1001  # kept for the trace
