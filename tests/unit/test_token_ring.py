"""The token ring (scheduler.token_ring): a decode scheduled before its last token comes back, its
input token handed from the last stage to stage 0. Torch-free: the scheduler's side and the simulator's."""

from __future__ import annotations

import random
import warnings

import pytest

from ppserve.config import SchedulerConfig
from ppserve.request import FinishReason
from ppserve.sched import StepResult
from ppserve.sim import ConstantCostModel, SimConfig, WorkloadRequest, simulate
from tests.unit.sched_helpers import (
    EOS,
    assert_drained,
    drive,
    fake_result,
    make_request,
    make_scheduler,
    random_scheduler,
)


def _decoding(s, n: int, prompt: int = 3, max_tokens: int = 20):
    """n requests whose prompts fit one microbatch each, scheduled and back: all decoding, nothing in
    flight."""
    for i in range(n):
        s.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens))
    while s.schedule() is not None:
        pass
    while s.in_flight:
        s.update_from_output(s.in_flight[0], fake_result(s.in_flight[0]))
    s.check_invariants()


def test_without_the_ring_a_full_pipeline_waits_for_a_result():
    s = make_scheduler(pp=2, token_budget=8, token_ring=False)
    _decoding(s, 4)
    a, b = s.schedule(), s.schedule()
    assert a is not None and b is not None and s.schedule() is None
    assert not a.ring_request_ids and a.ring_step_id is None


def test_the_ring_forms_the_oldest_groups_next_microbatch_before_it_returns():
    s = make_scheduler(pp=2, token_budget=8, token_ring=True)
    _decoding(s, 4)
    a, b = s.schedule(), s.schedule()
    c = s.schedule()  # one more than the stages: a's decodes again, their tokens from a's ring message
    assert c is not None and s.schedule() is None
    assert set(c.order) == set(a.sample_request_ids) == set(c.ring_request_ids)
    assert c.ring_step_id == a.step_id
    assert c.num_decode_tokens == len(c.order) and c.sample_request_ids == c.order
    # No diff carries the ring token: the workers had every earlier token already.
    assert all(d.new_token_ids == () for d in c.cached_requests)
    s.check_invariants()
    s.update_from_output(a, fake_result(a, 11))
    s.check_invariants()
    d = s.schedule()  # b's group, with b still in flight
    assert d is not None and d.ring_step_id == b.step_id
    s.update_from_output(b, fake_result(b, 12))
    s.update_from_output(c, fake_result(c, 13))
    e = s.schedule()  # a's group again: c is not the oldest (d is), so c's tokens come in the diff
    assert e is not None
    for rid in c.order:
        assert s.requests[rid].output_token_ids[-2:] == [11, 13]
    ring_rows = set(e.ring_request_ids)
    for diff in e.cached_requests:
        if diff.request_id in c.order and diff.request_id not in ring_rows:
            assert diff.new_token_ids == (13,)


def test_the_extra_slot_takes_work_that_waits_for_no_token():
    """With nothing on the ring (a prompt's chunks, no decode yet), a full pipeline's extra slot takes the
    prompt's next chunk: its round trip (every stage, every hop) is longer than p stage times, and a
    prefill-only pipeline held to p microbatches idles stage 0 for the difference each round (Sarathi's
    GPT-3 case with the ring: bubble 5.84 -> 5.28 %)."""
    s = make_scheduler(pp=2, token_budget=8, token_ring=True)
    s.add_request(make_request("p", 40, max_tokens=4))
    a, b = s.schedule(), s.schedule()
    c = s.schedule()
    assert a is not None and b is not None and c is not None and s.schedule() is None
    assert a.order == b.order == c.order == ("p",)
    assert not c.ring_request_ids and c.ring_step_id is None and not c.sample_request_ids
    s.check_invariants()
    for out in (a, b, c):
        s.update_from_output(out, fake_result(out))
        s.check_invariants()
    assert s.requests["p"].num_computed_tokens == sum(a.num_scheduled_tokens + b.num_scheduled_tokens
                                                      + c.num_scheduled_tokens)
    # Without the ring the pipeline holds p.
    s = make_scheduler(pp=2, token_budget=8, token_ring=False)
    s.add_request(make_request("p", 40, max_tokens=4))
    assert s.schedule() is not None and s.schedule() is not None and s.schedule() is None


def test_the_extra_slot_stays_closed_while_the_seats_bound_the_work():
    """Requests waiting beyond the free seats, or every seat taken under a per-microbatch sequence cap: the
    pipeline holds p microbatches, as plain Sarathi-Serve, and the engine is told to form now (nothing to
    wait for). Every seat taken without a cap, nobody waiting, keeps the slot; so does a free seat with
    every waiting request seated."""
    # Under the cap (4 seats, 2 a microbatch): the two decode groups fill the seats.
    s = make_scheduler(pp=2, token_budget=8, token_ring=True, max_num_seqs=4, per_microbatch_seq_cap=True)
    _decoding(s, 4)
    a, b = s.schedule(), s.schedule()
    assert a is not None and b is not None and s.schedule() is None
    assert s.formation_due() is None
    s.add_request(make_request("late", 3, max_tokens=4))
    assert s.schedule() is None
    s.check_invariants()
    s.cancel("r0")  # a seat frees and the waiting request fits it: the ring's slot opens
    c = s.schedule()
    assert c is not None and "late" in c.order and s.schedule() is None
    s.check_invariants()
    # No cap, every seat taken, nobody waiting: the ring's slot takes the oldest group's next step.
    s = make_scheduler(pp=2, token_budget=8, token_ring=True, max_num_seqs=4)
    _decoding(s, 4)
    a, b = s.schedule(), s.schedule()
    c = s.schedule()
    assert c is not None and c.ring_step_id == a.step_id and s.schedule() is None
    # ... but not with a request waiting for a seat.
    s = make_scheduler(pp=2, token_budget=8, token_ring=True, max_num_seqs=4)
    _decoding(s, 4)
    s.schedule(), s.schedule()
    s.add_request(make_request("w", 3, max_tokens=4))
    assert len(s.in_flight) == 2 and s.schedule() is None and s.formation_due() is None
    # A free seat but more requests waiting than seats: closed.
    s = make_scheduler(pp=2, token_budget=8, token_ring=True, max_num_seqs=5)
    _decoding(s, 4)
    s.schedule(), s.schedule()
    s.add_request(make_request("w1", 3, max_tokens=4))
    s.add_request(make_request("w2", 3, max_tokens=4))
    assert len(s.in_flight) == 2 and s.schedule() is None


def test_a_stop_token_on_the_ring_wastes_one_token_and_loses_nothing():
    s = make_scheduler(pp=2, token_budget=8, token_ring=True)
    s.add_request(make_request("x", 3, max_tokens=20, ignore_eos=False))
    s.add_request(make_request("y", 3, max_tokens=20, ignore_eos=False))
    a = s.schedule()
    b = s.schedule()
    s.update_from_output(a, fake_result(a))
    s.update_from_output(b, fake_result(b))
    a, b = s.schedule(), s.schedule()
    c = s.schedule()
    assert c is not None and set(c.ring_request_ids) == set(a.sample_request_ids)
    rid = c.ring_request_ids[0]
    updates = s.update_from_output(a, fake_result(a, EOS))  # the ring already computes the next token
    assert {u.request_id for u in updates if u.finished} == set(a.sample_request_ids)
    s.check_invariants()
    assert s.requests[rid].finish_reason is FinishReason.STOP
    s.update_from_output(b, fake_result(b))
    outputs_before = list(s.requests[rid].output_token_ids)
    late = s.update_from_output(c, fake_result(c, 99))  # its token is thrown away
    assert all(u.request_id not in c.order for u in late)
    assert rid not in s.requests and outputs_before[-1] == EOS
    s.check_invariants()


def test_a_request_whose_token_in_flight_is_its_last_is_not_put_on_the_ring():
    s = make_scheduler(pp=2, token_budget=8, token_ring=True)
    s.add_request(make_request("short", 3, max_tokens=2))
    s.add_request(make_request("long", 3, max_tokens=9))
    a, b = s.schedule(), s.schedule()
    s.update_from_output(a, fake_result(a))
    s.update_from_output(b, fake_result(b))
    a, b = s.schedule(), s.schedule()  # each request's second token: "short" finishes with it
    c = s.schedule()
    assert "short" not in (c.order if c is not None else ())


def test_cancel_with_a_ring_decode_in_flight_keys_only_known_tokens():
    s = make_scheduler(pp=2, token_budget=8, block_size=4, token_ring=True)
    _decoding(s, 2, prompt=3)
    a, b = s.schedule(), s.schedule()
    c = s.schedule()
    rid = c.ring_request_ids[0]
    req = s.requests[rid]
    assert req.num_computed_tokens == req.num_tokens + 1  # one token computed that is not known yet
    s.cancel(rid)
    s.check_invariants()
    for out in (a, b, c):
        s.update_from_output(out, fake_result(out))
        s.check_invariants()
    while s.has_unfinished:
        while s.schedule() is not None:
            s.check_invariants()
        done = s.in_flight[0]
        s.update_from_output(done, fake_result(done))
        s.check_invariants()
    assert_drained(s)


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "vllm-v1", "vllm-v1-async", "sglang-pp"])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_random_traces_hold_invariants_with_the_ring(policy, pp):
    for seed in range(5):
        rng = random.Random(seed * 17 + pp)
        s = random_scheduler(rng, policy, pp, token_ring=True)
        outs = drive(s, rng, eos_prob=0.05, cancel_prob=0.02)
        assert_drained(s)
        assert any(o.ring_request_ids for o in outs) or policy != "sarathi"


def test_the_ring_gives_every_request_the_same_tokens_and_counts():
    """Same trace with the ring on and off: every request gets as many tokens, and a decode is never
    computed past its max_tokens (the ring's only waste is a token after a stop token)."""
    def run(ring: bool) -> dict[str, int]:
        rng = random.Random(5)
        s = random_scheduler(rng, "sarathi", 3, token_ring=ring)
        lengths: dict[str, int] = {}

        def complete(done, result):
            for u in s.update_from_output(done, result):
                lengths[u.request_id] = lengths.get(u.request_id, 0) + len(u.new_token_ids)
        drive(s, rng, complete=complete)
        return lengths
    assert run(True) == run(False)


def test_pp1_has_no_ring():
    s = make_scheduler(pp=1, token_ring=True)
    assert s.ring is None and s.max_in_flight == 1


def test_the_simulated_ring_takes_the_engine_off_the_decode_cycle():
    """Two decoding requests on two equal stages with 1 ms of turnaround and 2 ms of dispatch: without the
    ring every token waits for both; with it stage 0 waits only for the last stage's tokens."""
    wl = [WorkloadRequest(0.0, 4, 40), WorkloadRequest(0.0, 4, 40)]

    def tbt(ring: bool) -> float:
        cfg = SchedulerConfig(policy="sarathi", token_budget=64, token_ring=ring)
        res = simulate(wl, ConstantCostModel(2, 0.010), SimConfig(cfg, 64, 16, 512, 0.001, 0.002,
                                                                  check_invariants=True))
        return res.latency()["tbt_s"]["p50"]
    assert tbt(False) == pytest.approx(0.023)  # two stages + turnaround + dispatch per token
    assert tbt(True) == pytest.approx(0.020)  # two stages: the ring costs no time on a ConstantCostModel


def test_step_result_tokens_reach_the_ring_request_in_order():
    s = make_scheduler(pp=3, token_budget=8, token_ring=True)
    _decoding(s, 3, max_tokens=12)
    before = {rid: len(req.output_token_ids) for rid, req in s.requests.items()}
    got: dict[str, list[int]] = {}
    token = 100
    while s.has_unfinished:
        while s.schedule() is not None:
            s.check_invariants()
        done = s.in_flight[0]
        result = StepResult(done.step_id, {rid: token + i for i, rid in enumerate(done.sample_request_ids)})
        token += 10
        for u in s.update_from_output(done, result):
            got.setdefault(u.request_id, []).extend(u.new_token_ids)
        s.check_invariants()
    assert set(got) == set(before)
    for rid, toks in got.items():
        assert before[rid] + len(toks) == 12
        assert toks == sorted(toks)  # in the order they were sampled


def test_a_following_chunk_keeps_a_seat_under_the_sequence_cap():
    """pp=2, two seats a microbatch (max_num_seqs 5, per-microbatch cap), three requests decoding (groups of
    two and one), then a 40-token prompt: its first chunk takes the small group's free seat. With the ring,
    the other group's next microbatch holds its two decodes on the ring; without a seat kept for it, the
    prompt's next chunk waited for the round after, so its chunks rode every other microbatch (its first
    token a round late per chunk). One decode is left out instead and goes first next time."""
    s = make_scheduler(pp=2, token_budget=8, token_ring=True, per_microbatch_seq_cap=True, max_num_seqs=5)
    _decoding(s, 3, max_tokens=40)
    s.add_request(make_request("p", 40, max_tokens=2))
    chunks: list[int] = []  # step ids of the microbatches that carry a chunk of the prompt
    for _ in range(30):
        while (out := s.schedule()) is not None:
            s.check_invariants()
            if "p" in out.order and out.num_prefill_tokens:
                chunks.append(out.step_id)
        if not s.in_flight:
            break
        s.update_from_output(s.in_flight[0], fake_result(s.in_flight[0]))
        s.check_invariants()
    assert len(chunks) >= 3
    assert chunks == list(range(chunks[0], chunks[0] + len(chunks))), chunks  # consecutive microbatches


def test_the_ring_is_on_by_default_with_sarathi_and_off_for_the_baselines():
    """`token_ring` None (the default): the ring with the sarathi policy; vllm, orca and static are
    measured as published. An explicit setting wins either way."""
    assert SchedulerConfig().token_ring is None and SchedulerConfig().token_ring_on
    for policy in ("vllm", "orca", "static"):
        assert not SchedulerConfig(policy=policy).token_ring_on
        assert SchedulerConfig(policy=policy, token_ring=True).token_ring_on
    assert not SchedulerConfig(token_ring=False).token_ring_on
    assert make_scheduler(pp=2).max_in_flight == 3 and make_scheduler("vllm", pp=2).max_in_flight == 2


def test_async_scheduling_is_a_deprecated_spelling_of_token_ring():
    """The old name still works, warns once per process, and lands on `token_ring` (so that
    dataclasses.replace carries it); both names set apart is an error."""
    import dataclasses

    import ppserve.config as config_module

    config_module._WARNED.discard("scheduler.async_scheduling")
    with pytest.warns(FutureWarning, match="scheduler.token_ring"):
        cfg = SchedulerConfig(async_scheduling=False)
    assert cfg.token_ring is False and cfg.async_scheduling is None and not cfg.token_ring_on
    assert not dataclasses.replace(cfg, token_budget=64).token_ring_on
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SchedulerConfig(async_scheduling=True)  # once per process: no second warning
    with pytest.raises(ValueError, match="disagree"):
        SchedulerConfig(token_ring=True, async_scheduling=False)
