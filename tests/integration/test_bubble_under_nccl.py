"""Bubble spans stay true over a transport whose receive does not block, like NCCL's.

NCCL's `irecv(...).wait()` returns once the receive is ordered on the stream, before the data is
there; the first kernel that reads the tensor waits for it. A stage that ended its `recv_wait` span at
`wait()` would book the transfer as compute and its bubbles would read near zero. This model puts
that behaviour under `TorchP2PChannel` on CPU: a fake `irecv` whose work handle returns at once, a
"stream" whose data lands `DELAY_S` after the receive is posted, and a stage whose compute first
touches the data (and so waits for it, as a kernel would). The channel's `_data_ready` (a stream
synchronize on CUDA) is what moves the wait back into `recv_wait`.

Time here is a fake clock that only the model advances (the transfer, the stage's own work), so every
span length is exact and the figures do not depend on how loaded the machine is.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ppserve.comm import p2p
from ppserve.comm.p2p import TorchP2PChannel
from ppserve.metrics.bubbles import bubble_report
from ppserve.metrics.spans import Span, SpanRecorder
from ppserve.model.parallel import TPContext
from ppserve.worker.stage_actor import StageActor

DELAY_S = 0.08  # the transfer: the data lands this long after the receive is posted
COMPUTE_S = 0.02  # the stage's own work on the data
PREPARE_S = 0.005  # building the step's inputs, before the receive is posted
STEPS = 4


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


class FakeClock:
    """Nanoseconds that pass only when the model spends them (`spend`); the stage's spans read it."""

    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns

    def spend(self, ns: int) -> None:
        self.now_ns += max(0, ns)


class FakeStream:
    """When the data lands; `synchronize` waits until then (a kernel reading it would too)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.lands_at_ns = 0

    def synchronize(self) -> None:
        self.clock.spend(self.lands_at_ns - self.clock.now_ns)


class FakeWork:
    def wait(self) -> None:  # NCCL-like: the receive is ordered, nothing has arrived
        pass


class TouchingWorker:
    """A stage's worker: its compute span starts, reads the input (waiting for it like a kernel would),
    then computes for COMPUTE_S."""

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.recorder = SpanRecorder(stage=1, tp_rank=0, enabled=True, clock=stream.clock)
        self.arch = SimpleNamespace(hidden_size=8)
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.spec = SimpleNamespace(stage=1, tp_rank=0, token_ring=False)
        self.tp = TPContext()  # one rank: no broadcast after the receive
        self.model = SimpleNamespace(is_last=False)  # a middle stage: it sends on
        self.times = SimpleNamespace(relay=lambda upstream: None)  # no step times in this model

    def prepare(self, out: Any, ring_tokens: dict[str, int] | None = None) -> None:
        with self.recorder.span("prepare", out.step_id):
            self.stream.clock.spend(_ns(PREPARE_S))  # host work on the step's inputs

    def execute(self, out: Any, hidden_in: torch.Tensor, inp: None = None) -> tuple[torch.Tensor, None]:
        with self.recorder.span("compute", out.step_id):
            self.stream.synchronize()  # the first read of the received tensor
            self.stream.clock.spend(_ns(COMPUTE_S))
        return hidden_in, None


def _run(monkeypatch: pytest.MonkeyPatch, data_ready: bool) -> list[Span]:
    stream = FakeStream(FakeClock())

    def fake_irecv(tensor: torch.Tensor, src: int) -> FakeWork:
        stream.lands_at_ns = stream.clock.now_ns + _ns(DELAY_S)
        return FakeWork()

    monkeypatch.setattr(p2p.dist, "irecv", fake_irecv)
    channel = TorchP2PChannel(peer=0, device=torch.device("cpu"))
    if data_ready:
        monkeypatch.setattr(channel, "_data_ready", lambda hidden: stream.synchronize())  # CUDA: stream sync
    else:
        monkeypatch.setattr(channel, "_data_ready", lambda hidden: None)  # the old bug: trust wait()
    worker = TouchingWorker(stream)
    actor = StageActor.local(worker, channel, SimpleNamespace(send=lambda hidden, seconds: None))
    for step in range(STEPS):
        actor.execute(SimpleNamespace(step_id=step, total_tokens=3))
    return [Span.from_dict(s.to_dict()) for s in worker.recorder.drain()]


def _busy_and_wait(spans: list[Span]) -> tuple[float, float]:
    compute = sum(s.end_ns - s.start_ns for s in spans if s.kind == "compute") / 1e9 / STEPS
    wait = sum(s.end_ns - s.start_ns for s in spans if s.kind == "recv_wait") / 1e9 / STEPS
    return compute, wait


def test_the_wait_for_the_data_is_booked_as_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    spans = _run(monkeypatch, data_ready=True)
    compute, wait = _busy_and_wait(spans)
    assert compute == pytest.approx(COMPUTE_S, abs=1e-9)
    assert wait == pytest.approx(DELAY_S, abs=1e-9)
    work = [(spans[0].start_ns, spans[-1].end_ns)]  # the engine had work throughout
    stage = bubble_report(spans, work).stages[0]
    # 80 ms of every 105 ms is waiting for the previous stage
    assert stage.bubble_fraction == pytest.approx(DELAY_S / (PREPARE_S + DELAY_S + COMPUTE_S), abs=1e-6)


def test_inputs_are_prepared_before_the_wait_and_count_as_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage builds step k's inputs before it waits for step k's hidden states, so that host work
    overlaps the previous stage instead of following it, and the time is the stage's work, not a bubble."""
    spans = _run(monkeypatch, data_ready=True)
    for step in range(STEPS):
        by_kind = {s.kind: s for s in spans if s.step_id == step}
        assert by_kind["prepare"].end_ns <= by_kind["recv_wait"].start_ns <= by_kind["compute"].start_ns
    work = [(spans[0].start_ns, spans[-1].end_ns)]
    stage = bubble_report(spans, work).stages[0]
    prepare = sum(s.end_ns - s.start_ns for s in spans if s.kind == "prepare")
    compute = sum(s.end_ns - s.start_ns for s in spans if s.kind == "compute")
    assert prepare == STEPS * _ns(PREPARE_S) and compute == STEPS * _ns(COMPUTE_S)
    assert stage.busy_fraction == pytest.approx((prepare + compute) / (work[0][1] - work[0][0]), abs=1e-6)


def test_trusting_the_work_handle_would_book_it_as_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure the channel prevents, shown by the same model: the transfer lands in compute."""
    compute, wait = _busy_and_wait(_run(monkeypatch, data_ready=False))
    assert wait == 0 and compute == pytest.approx(DELAY_S + COMPUTE_S, abs=1e-9)
