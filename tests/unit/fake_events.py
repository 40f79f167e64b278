"""A fake CUDA event backend for the step timer (worker/step_timer.py): deterministic, torch-free.

`FakeDevice` keeps a device clock in milliseconds that only the test advances (`run(ms)`: the device
computes that long). An event records the clock when it is recorded and is done only when the test
says so: `complete_through(n)` marks the first n events done, or `lag` (events recorded after it
before it is done) does it automatically. `synchronize()` marks an event done, with every event
before it (one stream runs in order), and counts the call, so a test can assert that the hot loop
never waits.
"""

from __future__ import annotations


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.index = -1
        self.at_ms = 0.0

    def record(self) -> None:
        self.index = self.device.num_records
        self.at_ms = self.device.now_ms
        self.device.num_records += 1
        self.device.recorded.append(self)

    def query(self) -> bool:
        self.device.num_queries += 1
        return self.index < self.device.done_through()

    def elapsed_time(self, end: FakeEvent, /) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time on an event the device has not reached")  # as CUDA refuses
        return end.at_ms - self.at_ms

    def synchronize(self) -> None:
        self.device.num_syncs += 1
        self.device.complete_through(self.index + 1)  # a stream runs in order: all before it is done too


class FakeDevice:
    def __init__(self, lag: int | None = None) -> None:
        self.now_ms = 0.0
        self.num_records = 0
        self.num_syncs = 0
        self.num_queries = 0
        self.lag = lag  # None: only complete_through marks events done
        self.recorded: list[FakeEvent] = []
        self._done_through = 0

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    def run(self, ms: float) -> None:
        self.now_ms += ms

    def complete_through(self, n: int) -> None:
        self._done_through = max(self._done_through, n)

    def done_through(self) -> int:
        auto = self.num_records - self.lag if self.lag is not None else 0
        return max(self._done_through, auto)
