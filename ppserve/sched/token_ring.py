"""The token ring: one microbatch more in flight than the pipeline has stages.

With pp > 1 and `scheduler.token_ring` on, a decode may be scheduled before its last token comes back:
the last stage hands each microbatch's sampled tokens straight to stage 0, which embeds them, so the
engine's result handling and the dispatch leave the decode groups' critical path. `TokenRing` decides
which decodes ride on it (the oldest in-flight microbatch's samples), whether its extra slot is open,
and, through `RingClock`, when the extra microbatch is due
(ARCHITECTURE.md#how-a-microbatch-is-formed). Pure Python, like the rest of the scheduler.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from ppserve.request import Request, RequestStatus
from ppserve.sched.output import SchedulerOutput
from ppserve.sched.ring_clock import RingClock

__all__ = ["TokenRing"]

_RUNNING = RequestStatus.RUNNING


class TokenRing:
    def __init__(self, num_stages: int, max_num_seqs: int, seq_cap: int | None, margin_ms: float | None,
                 max_model_len: int, always_open: bool = False) -> None:
        self.num_stages = num_stages
        # The extra slot open whatever the seats (a peer's published rule: vLLM's async scheduling).
        self.always_open = always_open
        self.max_in_flight = num_stages + 1
        self.max_num_seqs = max_num_seqs
        self.seq_cap = seq_cap
        self.max_model_len = max_model_len
        # When the extra microbatch is due: just before stage 0 needs it. None: as soon as its slot frees.
        self.clock = RingClock(margin_ms * 1e-3, 2 * self.max_in_flight) if margin_ms is not None else None

    def candidates(self, in_flight: deque[SchedulerOutput],
                   requests: Mapping[str, Request]) -> dict[str, Request]:
        """The requests the oldest in-flight microbatch samples that may decode again before it comes
        back: their only microbatch in flight, that token not their last by length. Only the oldest's:
        stage 0 waits for its ring message, and it is the next microbatch to leave the last stage. A stop
        token is seen only when the result is back; such a request loses the one token computed for it."""
        if not in_flight:
            return {}
        ring: dict[str, Request] = {}
        max_len = self.max_model_len
        for rid in in_flight[0].sample_request_ids:
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING or req.num_in_flight != 1:
                continue
            outputs = len(req.output_token_ids) + 1  # with the token in flight
            if (outputs >= (req.sampling.max_tokens or max_len)
                    or len(req.prompt_token_ids) + outputs >= max_len):
                continue
            ring[rid] = req
        return ring

    def slot_open(self, num_waiting: int, num_running: int) -> bool:
        """Whether the extra slot may be used: not while requests wait beyond the free seats, nor while
        every seat is taken under a per-microbatch sequence cap. There `max_num_seqs` bounds the work:
        the extra microbatch could hold only one decode group's next step beside a prompt's chunk, the
        chunks would split unevenly over p + 1 microbatches, and every stage after the first would pay
        the difference as idle time; plain Sarathi-Serve runs instead (docs/decisions.md#token-ring).
        Without a cap a full house keeps the slot: it still takes the engine's turnaround off each
        decode group's cycle."""
        seats = self.max_num_seqs - num_running
        return self.always_open or (num_waiting <= max(0, seats) and (seats > 0 or self.seq_cap is None))

    # ---- the clock of the extra slot -------------------------------------------------------------
    def formed(self, step_id: int, at_s: float, stage0_s: float | None) -> None:
        if self.clock is not None:
            self.clock.formed(step_id, at_s, stage0_s)

    def returned(self, step_id: int, at_s: float) -> None:
        if self.clock is not None:
            self.clock.returned(step_id, at_s)

    def forget(self) -> None:
        if self.clock is not None:
            self.clock.forget()

    def due(self, in_flight: deque[SchedulerOutput], dispatch_s: float, slot_open: bool) -> float | None:
        """When only the extra slot is free: when to form the next microbatch (the scheduler's clock),
        `dispatch_s` plus the ring's margin before stage 0 is predicted to need it, so that what arrives
        meanwhile joins it. None: now (a stage slot free, the slot closed, no clock or no prediction)."""
        if self.clock is None or len(in_flight) != self.num_stages or not slot_open:
            return None
        due = self.clock.due_s(in_flight)
        return None if due is None else due - dispatch_s
