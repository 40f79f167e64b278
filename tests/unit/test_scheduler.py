"""Scheduler unit tests: batch composition per policy, budgets, preemption, cancel, invariants. No torch."""

from __future__ import annotations

import random

import pytest

from ppserve.config import POLICIES
from ppserve.request import FinishReason, RequestStatus, SamplingParams
from ppserve.sched import StepResult
from tests.unit.imports import assert_imports_without
from tests.unit.sched_helpers import (
    EOS,
    assert_drained,
    drive,
    fake_result,
    make_request,
    make_scheduler,
    random_scheduler,
    step,
)


def composition(out):
    return dict(zip(out.order, out.num_scheduled_tokens, strict=False))


def test_sarathi_worked_example():
    """Budget 100: four decodes, a 30-token leftover chunk, prompts of 80 and 150 -> 4 + 30 + 66."""
    s = make_scheduler("sarathi", token_budget=100)
    for i in range(4):
        s.add_request(make_request(f"d{i}", 10, max_tokens=50))
    assert composition(step(s)) == {f"d{i}": 10 for i in range(4)}
    s.add_request(make_request("left", 126, max_tokens=50))
    assert composition(step(s)) == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "left": 96}
    s.add_request(make_request("p80", 80))
    s.add_request(make_request("p150", 150))
    out = s.schedule()
    assert list(out.order) == ["d0", "d1", "d2", "d3", "left", "p80"]
    assert composition(out) == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "left": 30, "p80": 66}
    assert out.total_tokens == 100
    assert out.num_decode_tokens == 4 and out.num_prefill_tokens == 96
    # Only requests whose whole known sequence is computed get a token: the decodes and `left`.
    assert set(out.sample_request_ids) == {"d0", "d1", "d2", "d3", "left"}


def test_new_requests_full_then_diffs():
    s = make_scheduler(token_budget=8, block_size=4)
    s.add_request(make_request("a", 10, max_tokens=4))
    o1 = s.schedule()
    assert [n.request_id for n in o1.new_requests] == ["a"] and not o1.cached_requests
    assert o1.new_requests[0].block_ids == (0, 1)
    s.update_from_output(o1, fake_result(o1))
    o2 = s.schedule()
    assert not o2.new_requests and o2.cached_requests[0].new_block_ids == (2,)
    assert o2.cached_requests[0].num_computed_tokens == 8
    s.update_from_output(o2, fake_result(o2, 42))
    o3 = s.schedule()
    assert o3.cached_requests[0].new_token_ids == (42,)
    assert o3.cached_requests[0].new_block_ids == ()


@pytest.mark.parametrize("budget", [1, 7, 64, 512])
def test_sarathi_budget_never_exceeded_and_decodes_never_stalled(budget):
    rng = random.Random(budget)
    s = make_scheduler("sarathi", token_budget=budget, num_blocks=400, block_size=4)
    for i in range(30):
        s.add_request(make_request(f"r{i}", rng.randint(1, 200), max_tokens=rng.randint(1, 20)))
    for out in drive(s, rng):
        assert out.total_tokens <= budget
    assert not s.requests and s.blocks.num_free == 400


def test_sarathi_decodes_first_and_never_stalled():
    s = make_scheduler("sarathi", token_budget=16)
    for i in range(3):
        s.add_request(make_request(f"d{i}", 4, max_tokens=30))
    step(s)
    s.add_request(make_request("big", 500))
    for _ in range(10):
        out = s.schedule()
        comp = composition(out)
        assert all(comp[f"d{i}"] == 1 for i in range(3)), comp
        assert list(out.order[:3]) == ["d0", "d1", "d2"]
        assert comp["big"] == 13
        s.update_from_output(out, fake_result(out))


def test_vllm_prefill_prioritizing():
    s = make_scheduler("vllm", token_budget=100)
    s.add_request(make_request("a", 30, max_tokens=5))
    s.add_request(make_request("b", 50, max_tokens=5))
    s.add_request(make_request("c", 40, max_tokens=5))
    out = step(s)
    assert composition(out) == {"a": 30, "b": 50}  # whole prompts while they fit; c does not
    out = step(s)
    assert composition(out) == {"c": 40}  # prefill-only batch: decodes wait
    out = step(s)
    assert composition(out) == {"a": 1, "b": 1, "c": 1}  # no prompt waiting: decode-only


def test_vllm_prompt_longer_than_budget_runs_alone():
    s = make_scheduler("vllm", token_budget=16)
    s.add_request(make_request("long", 40, max_tokens=2))
    s.add_request(make_request("short", 4, max_tokens=2))
    assert composition(step(s)) == {"long": 40}
    assert composition(step(s)) == {"short": 4}


def test_orca_hybrid_unchunked():
    s = make_scheduler("orca", token_budget=8)
    s.add_request(make_request("a", 5, max_tokens=5))
    step(s)
    s.add_request(make_request("b", 300))
    assert composition(step(s)) == {"a": 1, "b": 300}


def test_static_batches_run_to_completion():
    s = make_scheduler("static", max_num_seqs=2)
    s.add_request(make_request("a", 5, max_tokens=2))
    s.add_request(make_request("b", 5, max_tokens=6))
    s.add_request(make_request("c", 5, max_tokens=2))
    assert composition(step(s)) == {"a": 5, "b": 5}
    seen_c = False
    while s.has_unfinished:
        out = step(s)
        if "c" in out.order:
            seen_c = True
            assert "b" not in s.requests  # c joined only after the whole first batch finished
    assert seen_c


def test_per_microbatch_seq_cap():
    s = make_scheduler("sarathi", token_budget=100, max_num_seqs=8, per_microbatch_seq_cap=True, pp=2)
    for i in range(8):
        s.add_request(make_request(f"r{i}", 3))
    o1 = s.schedule()
    o2 = s.schedule()
    assert len(o1.order) == 4 and len(o2.order) == 4
    assert set(o1.order).isdisjoint(o2.order)
    assert s.schedule() is None  # pipeline full


def test_pipeline_in_flight_bound_and_membership_unbalanced():
    s = make_scheduler("sarathi", token_budget=6, pp=3, balance=False)
    s.add_request(make_request("a", 20, max_tokens=3))
    s.add_request(make_request("b", 4, max_tokens=3))
    o1 = s.schedule()
    assert composition(o1) == {"a": 6}
    o2 = s.schedule()  # a is in flight: unbalanced, its next chunk waits; b takes this microbatch
    assert composition(o2) == {"b": 4}
    assert s.schedule() is None  # nothing schedulable: a and b both in flight
    s.update_from_output(o1, fake_result(o1))
    o3 = s.schedule()
    assert composition(o3) == {"a": 6}
    with pytest.raises(AssertionError):
        s.update_from_output(o3, fake_result(o3))  # out of order: o2 is older


def test_prompt_chunks_follow_each_other_down_the_pipeline():
    s = make_scheduler("sarathi", token_budget=6, pp=3, token_ring=False)  # p in flight, no token ring
    s.add_request(make_request("a", 20, max_tokens=3))
    outs = [s.schedule() for _ in range(3)]
    # A lone prompt's chunks ride in consecutive in-flight microbatches (stages run them in order).
    assert [composition(o) for o in outs] == [{"a": 6}, {"a": 6}, {"a": 6}]
    assert [o.num_computed_tokens for o in outs] == [(0,), (6,), (12,)]
    assert all(not o.sample_request_ids for o in outs)  # only the last chunk samples
    assert s.requests["a"].num_in_flight == 3
    s.check_invariants()
    assert s.schedule() is None  # three in flight: the pipeline is full
    s.add_request(make_request("b", 4, max_tokens=3))
    s.update_from_output(outs[0], fake_result(outs[0]))
    o4 = s.schedule()
    assert composition(o4) == {"a": 2, "b": 4}  # a's last chunk samples; b fills the budget
    assert set(o4.sample_request_ids) == {"a", "b"}
    for o in (outs[1], outs[2]):
        s.update_from_output(o, fake_result(o))
    assert s.schedule() is None  # a and b wait for their first token
    s.check_invariants()
    with pytest.raises(AssertionError):
        s.update_from_output(o4, StepResult(o4.step_id, {}))  # no token came back for a and b


def test_a_following_chunk_takes_only_what_the_others_leave():
    """A prompt's next chunk behind its in-flight one comes last: a waiting request is admitted first,
    so under load one prompt's chunks do not take the prefill part of consecutive microbatches."""
    s = make_scheduler("sarathi", token_budget=6, pp=3)
    s.add_request(make_request("a", 20, max_tokens=3))
    s.add_request(make_request("b", 4, max_tokens=3))
    outs = [s.schedule() for _ in range(3)]
    assert [composition(o) for o in outs] == [{"a": 6}, {"b": 4, "a": 2}, {"a": 6}]
    assert [o.num_computed_tokens for o in outs] == [(0,), (0, 6), (8,)]
    assert [o.sample_request_ids for o in outs] == [(), ("b",), ()]
    s.check_invariants()


def test_preemption_by_recompute_keeps_tokens():
    # 6 blocks of 4 tokens; two requests of 8-token prompts grow until one must be preempted. (Prefix
    # caching off: with it, b would re-hit its own blocks; test_prefix_cache.py covers that.)
    s = make_scheduler("sarathi", token_budget=64, num_blocks=6, block_size=4, prefix_caching=False)
    s.add_request(make_request("a", 8, max_tokens=12))
    s.add_request(make_request("b", 8, max_tokens=12))
    rng = random.Random(0)
    outs = drive(s, rng)
    assert s.num_preemptions >= 1
    # b (the younger) is recomputed from scratch: sent again in full with its generated tokens.
    resent = [n for o in outs for n in o.new_requests if n.request_id == "b" and len(n.token_ids) > 8]
    assert resent and resent[0].num_computed_tokens == 0
    assert any("b" in o.released_request_ids for o in outs)
    assert s.blocks.num_free == 6


def test_cancel_frees_blocks_at_once_even_in_flight():
    s = make_scheduler(token_budget=8, pp=2)
    s.add_request(make_request("a", 20))
    out = s.schedule()
    assert s.blocks.num_used == 2
    assert s.cancel("a")
    assert s.blocks.num_used == 0
    assert s.update_from_output(out, fake_result(out)) == []
    assert not s.has_unfinished and not s.requests
    assert not s.cancel("a") and not s.cancel("nope")


def test_cancel_waiting_and_release_sent_to_workers():
    s = make_scheduler(token_budget=4)
    s.add_request(make_request("a", 4, max_tokens=10))
    s.add_request(make_request("w", 4))
    step(s)
    s.cancel("a")
    s.cancel("w")
    assert not s.has_unfinished
    s.add_request(make_request("z", 3))
    out = s.schedule()
    assert out.released_request_ids == ("a",)  # w never reached the workers


def test_stop_rules():
    s = make_scheduler()
    s.add_request(make_request("eos", 3, max_tokens=10, ignore_eos=False))
    s.add_request(make_request("ign", 3, max_tokens=2, ignore_eos=True))
    out = s.schedule()
    ups = {u.request_id: u for u in s.update_from_output(out, fake_result(out, EOS))}
    assert ups["eos"].finished and ups["eos"].finish_reason is FinishReason.STOP
    assert not ups["ign"].finished
    out = s.schedule()
    ups = {u.request_id: u for u in s.update_from_output(out, fake_result(out, EOS))}
    assert ups["ign"].finish_reason is FinishReason.LENGTH


def test_stop_token_ids_and_context_limit():
    s = make_scheduler(max_model_len=6)
    from ppserve.request import Request

    s.add_request(Request("st", [1, 2], SamplingParams(max_tokens=3, stop_token_ids=(9,))))
    s.add_request(Request("ctx", [1, 2, 3, 4], SamplingParams(max_tokens=3)))
    out = s.schedule()
    ups = {u.request_id: u for u in s.update_from_output(out, fake_result(out, 9))}
    assert ups["st"].finish_reason is FinishReason.STOP
    out = s.schedule()
    ups = {u.request_id: u for u in s.update_from_output(out, fake_result(out, 5))}
    assert ups["ctx"].finish_reason is FinishReason.LENGTH  # 4 prompt + 2 outputs fill the 6-token context


def test_add_request_rejections():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64, max_waiting=1)
    with pytest.raises(ValueError, match="empty"):
        s.add_request(make_request("e", 0))
    with pytest.raises(ValueError, match="context"):
        s.add_request(make_request("long", 64))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(make_request("big", 10, max_tokens=20))
    s.add_request(make_request("ok", 4))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("ok", 4))
    with pytest.raises(OverflowError):
        s.add_request(make_request("full", 4))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_random_traces_hold_invariants(policy, pp):
    for seed in range(5):
        rng = random.Random(seed * 31 + pp)
        s = random_scheduler(rng, policy, pp)
        drive(s, rng, eos_prob=0.05, cancel_prob=0.02)
        assert_drained(s)


def test_sched_imports_no_torch_ray_grpc():
    assert_imports_without("ppserve.sched, ppserve.config, ppserve.request", ("torch", "ray", "grpc"))


def test_request_status_after_finish():
    s = make_scheduler()
    r = make_request("a", 3, max_tokens=1)
    s.add_request(r)
    step(s)
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.LENGTH
