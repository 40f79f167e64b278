"""Bubble spans stay true over a transport whose receive does not block the host, like NCCL's.

On NCCL `irecv(...).wait()` only orders the current stream after the transfer: the host goes on, and
the first kernel that reads the data waits on the device. A stage that timed its wait on the host
would see none, and a host stream sync to see it would stall every step (no stage could run ahead of
its GPU). So the wait is timed on the device, like the compute: `timer.waiting(step)` records an event
as the wait is ordered, and the span runs from it to the step's start event (worker/step_timer.py).

This models that under `TorchP2PChannel` on CPU with fake CUDA events (tests/unit/fake_events.py): a
fake `irecv` whose work handle returns at once, a device whose stream stands still until the data
lands `DELAY_MS` after the receive is posted, and the stage's compute. The host never waits.
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
from ppserve.worker.step_timer import EventStepTimer
from tests.unit.fake_events import FakeDevice

DELAY_MS = 80.0  # the transfer: the data lands this long after the receive is posted
COMPUTE_MS = 20.0  # the stage's own work on the data
STEPS = 4


class FakeWork:
    """NCCL-like: `wait` orders the stream after the transfer; the device stands still until the data
    lands."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device

    def wait(self) -> None:
        self.device.run(DELAY_MS / 2)  # two receives (hidden states, step times) per message


class EventWorker:
    """A stage's worker timed by (fake) CUDA events: its layers run COMPUTE_MS on the device."""

    def __init__(self, fake: FakeDevice) -> None:
        self.fake = fake
        self.host_ns = 0
        self.recorder = SpanRecorder(stage=1, tp_rank=0, enabled=True, clock=lambda: self.host_ns)
        self.timer = EventStepTimer(self.recorder, fake.new_event, clock_ns=lambda: self.host_ns)
        self.arch = SimpleNamespace(hidden_size=8)
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.spec = SimpleNamespace(stage=1, tp_rank=0, token_ring=False, num_stages=3)
        self.tp = TPContext()  # one rank: no broadcast after the receive
        self.model = SimpleNamespace(is_last=False)  # a middle stage: it sends on
        self.times = SimpleNamespace(relay=lambda upstream: None)  # no step times in this model

    def prepare(self, out: Any, ring_tokens: Any = None) -> None:
        return None

    def execute(self, out: Any, hidden_in: torch.Tensor, inp: None = None) -> tuple[torch.Tensor, None]:
        self.timer.begin(out.step_id)
        self.fake.run(COMPUTE_MS)
        self.timer.end_compute()
        self.timer.finish(0.0)
        return hidden_in, None


def _run(monkeypatch: pytest.MonkeyPatch, timed_wait: bool) -> tuple[list[Span], FakeDevice]:
    device = FakeDevice()
    monkeypatch.setattr(p2p.dist, "irecv", lambda tensor, src, group=None: FakeWork(device))
    channel = TorchP2PChannel(peer=0, device=torch.device("cpu"))
    worker = EventWorker(device)
    syncs_at_start = device.num_syncs
    actor = StageActor.local(worker, channel, SimpleNamespace(send=lambda hidden, values, step: None))
    if not timed_wait:  # the wait left untimed: what a host span around a non-blocking receive would give
        monkeypatch.setattr(worker.timer, "waiting", lambda step: _nothing())
    for step in range(STEPS):
        actor.execute(SimpleNamespace(step_id=step, total_tokens=3))
    assert device.num_syncs == syncs_at_start  # the host never waited for the device
    device.complete_through(device.num_records)
    worker.timer.poll()
    return [Span.from_dict(s.to_dict()) for s in worker.recorder.drain()], device


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _per_step_ms(spans: list[Span], kind: str) -> float:
    return sum(s.end_ns - s.start_ns for s in spans if s.kind == kind) / 1e6 / STEPS


def test_the_device_wait_for_the_data_is_booked_as_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    spans, _ = _run(monkeypatch, timed_wait=True)
    assert _per_step_ms(spans, "compute") == pytest.approx(COMPUTE_MS, abs=1e-6)
    assert _per_step_ms(spans, "recv_wait") == pytest.approx(DELAY_MS, abs=1e-6)
    for step in range(STEPS):  # each wait ends where its step's compute starts
        by_kind = {s.kind: s for s in spans if s.step_id == step}
        assert by_kind["recv_wait"].end_ns == by_kind["compute"].start_ns
    work = [(min(s.start_ns for s in spans), max(s.end_ns for s in spans))]  # the engine had work throughout
    stage = bubble_report(spans, work).stages[0]
    assert stage.bubble_fraction == pytest.approx(DELAY_MS / (DELAY_MS + COMPUTE_MS), abs=1e-6)


def test_compute_never_swallows_the_wait_even_untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compute starts on the device when the data is there, so the transfer never counts as busy; left
    untimed, the wait is only unattributed idle time (no recv_wait span)."""
    spans, _ = _run(monkeypatch, timed_wait=False)
    assert _per_step_ms(spans, "compute") == pytest.approx(COMPUTE_MS, abs=1e-6)
    assert _per_step_ms(spans, "recv_wait") == 0
