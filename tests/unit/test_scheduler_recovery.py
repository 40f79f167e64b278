"""Scheduler side of stage-failure recovery: `requeue_all_for_recompute` after the pipeline is rebuilt."""

from __future__ import annotations

import random

from ppserve.request import RequestStatus
from tests.unit.sched_helpers import drive, fake_result, make_request, make_scheduler


def _fill_pipeline(s):
    outs = []
    while (out := s.schedule()) is not None:
        outs.append(out)
    return outs


def _run_then_fill(s, rounds: int, check: bool = False) -> None:
    """`rounds` times: fill the pipeline, complete its oldest microbatch; then fill it once more, so that
    requests hold output tokens and microbatches are left in flight."""
    for _ in range(rounds):
        _fill_pipeline(s)
        done = s.in_flight[0]
        s.update_from_output(done, fake_result(done, 7))
        if check:
            s.check_invariants()
    _fill_pipeline(s)


def test_requeue_clears_in_flight_frees_blocks_and_keeps_outputs():
    s = make_scheduler(token_budget=16, pp=2, block_size=4)
    reqs = [make_request(f"r{i}", 10 + i, max_tokens=20) for i in range(4)]
    for i, r in enumerate(reqs):
        r.arrival_time = float(i)
        s.add_request(r)
    # Run a while so some requests decode and hold output tokens, then leave microbatches in flight.
    _run_then_fill(s, 6, check=True)
    assert s.in_flight and s.blocks.num_used > 0
    outputs_before = {r.request_id: list(r.output_token_ids) for r in reqs}
    assert any(outputs_before.values())

    requeued = s.requeue_all_for_recompute()

    assert requeued == ["r0", "r1", "r2", "r3"]  # arrival order
    assert not s.in_flight and not s.running
    assert [r.request_id for r in s.waiting] == requeued
    assert s.blocks.num_used == 0 and s.blocks.num_free == s.blocks.num_blocks
    for r in reqs:
        assert r.status is RequestStatus.WAITING
        assert r.num_computed_tokens == 0 and r.block_ids == []
        assert not r.in_flight and not r.sent_to_workers
        assert r.output_token_ids == outputs_before[r.request_id]  # streamed tokens are kept
    s.check_invariants()


def test_requeued_requests_are_resent_in_full_and_finish():
    s = make_scheduler(token_budget=8, pp=3, block_size=4)
    for i in range(5):
        r = make_request(f"r{i}", 5 + 3 * i, max_tokens=6)
        r.arrival_time = float(i)
        s.add_request(r)
    _run_then_fill(s, 4)
    s.requeue_all_for_recompute()
    out = s.schedule()
    assert out is not None
    assert not out.cached_requests and not out.released_request_ids  # new workers hold nothing
    for nr in out.new_requests:
        req = s.requests[nr.request_id]
        assert list(nr.token_ids) == req.all_token_ids and nr.num_computed_tokens == 0
    s.update_from_output(out, fake_result(out, 7))
    drive(s, random.Random(0))
    assert not s.has_unfinished and s.blocks.num_used == 0
    s.check_invariants()


def test_request_cancelled_while_in_flight_is_forgotten_on_requeue():
    s = make_scheduler(token_budget=32, pp=2)
    s.add_request(make_request("a", 8))
    s.add_request(make_request("b", 8))
    _fill_pipeline(s)
    assert s.requests["a"].in_flight
    s.cancel("a")
    assert "a" in s.requests  # still referenced by an in-flight microbatch
    assert s.requeue_all_for_recompute() == ["b"]
    assert "a" not in s.requests and list(s.requests) == ["b"]
    s.check_invariants()
    drive(s, random.Random(1))
    assert not s.has_unfinished and s.blocks.num_used == 0


def test_requeue_at_random_moments_conserves_blocks_and_token_counts():
    rng = random.Random(7)
    for trial in range(20):
        s = make_scheduler(token_budget=rng.choice([1, 4, 16]), pp=rng.choice([1, 2, 4]), block_size=4,
                           num_blocks=rng.choice([12, 40, 200]))
        n = rng.randint(1, 8)
        for i in range(n):
            r = make_request(f"t{trial}-{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 10))
            r.arrival_time = float(i)
            s.add_request(r)
        reqs = dict(s.requests)
        for _ in range(rng.randint(0, 30)):
            if not s.has_unfinished:
                break
            _fill_pipeline(s)
            done = s.in_flight[0]
            s.update_from_output(done, fake_result(done, 7))
        s.requeue_all_for_recompute()
        s.check_invariants()
        assert s.blocks.num_used == 0
        drive(s, rng)
        assert not s.has_unfinished and s.blocks.num_used == 0
        for r in reqs.values():
            assert len(r.output_token_ids) == r.sampling.max_tokens  # nothing duplicated, nothing lost
