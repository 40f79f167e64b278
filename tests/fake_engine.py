"""A stand-in for Engine with no model and no Ray: enough for AsyncEngine and the front doors over it.

One token ("a", id 7) per request per step, and a bounded waiting queue (OverflowError past it).
"""

from __future__ import annotations

from ppserve.engine.messages import RequestTimes, TokenDelta
from ppserve.engine.stats import EngineCounts
from ppserve.metrics.spans import Span
from ppserve.worker.info import WorkerInfo


class FakeEngine:
    """Just enough of Engine for AsyncEngine: one token per request per step, a bounded queue."""

    def __init__(self, max_waiting: int = 2) -> None:
        import time
        from types import SimpleNamespace

        from ppserve.config import EngineConfig, SchedulerConfig
        from ppserve.metrics.spans import WorkTracker

        self.config = EngineConfig(scheduler=SchedulerConfig(max_waiting=max_waiting))
        self.arch = SimpleNamespace(vocab_size=100)
        self.tokenizer = None
        self.max_model_len = 64
        self.clock = time.perf_counter
        self.work = WorkTracker()
        self.executor = SimpleNamespace(
            describe=lambda: [WorkerInfo(stage=0, tp_rank=0, layer_start=0, layer_end=2, node_ip="local",
                                         pid=1)]
        )
        self.scheduler = SimpleNamespace(blocks=SimpleNamespace(block_size=16))
        self.core = SimpleNamespace(step_observers=[])
        self.paused = False
        self.prompt_length = 4  # tokens of a prompt given as text or messages (the fake has no tokenizer)
        self.left: dict[str, int] = {}
        self.states: dict[str, object] = {}

    def add_choices(self, prompt, sampling, request_id):  # type: ignore[no-untyped-def]
        from types import SimpleNamespace

        rids = [request_id] if sampling.n == 1 else [f"{request_id}/{i}" for i in range(sampling.n)]
        if len(self.left) + len(rids) > self.config.scheduler.max_waiting:
            raise OverflowError(f"the waiting queue is full ({self.config.scheduler.max_waiting} requests)")
        for rid in rids:
            self.left[rid] = sampling.max_tokens
            n = len(prompt.token_ids) if prompt.token_ids is not None else self.prompt_length
            req = SimpleNamespace(num_prompt_tokens=n, arrival_time=self.clock(), first_scheduled_time=None)
            self.states[rid] = SimpleNamespace(request=req, token_times=[])
        return rids

    def request_state(self, rid):  # type: ignore[no-untyped-def]
        return self.states.get(rid)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.left) and not self.paused

    def step(self):  # type: ignore[no-untyped-def]
        import time

        time.sleep(0.002)
        now, out = self.clock(), []
        for rid in list(self.left):
            self.left[rid] -= 1
            st = self.states[rid]
            st.token_times.append(now)
            done = self.left[rid] == 0
            times = self._times(rid) if done else None
            out.append(TokenDelta(rid, (7,), "a", (now,), done, "length" if done else None, times))
            if done:
                del self.left[rid]
        return out

    def _times(self, rid):  # type: ignore[no-untyped-def]
        st = self.states[rid]
        return RequestTimes(st.request.arrival_time, st.request.first_scheduled_time, list(st.token_times))

    def abort(self, rid, reason):  # type: ignore[no-untyped-def]
        if self.left.pop(rid, None) is None:
            return None
        return TokenDelta(rid, (), "", (), True, reason.value, self._times(rid))

    def unfinished_ids(self) -> list[str]:
        return list(self.left)

    def stats(self) -> EngineCounts:
        return EngineCounts(running=len(self.left), kv_blocks_total=8)

    def collect_spans(self) -> list[Span]:
        return []

    def shutdown(self) -> None:
        pass
