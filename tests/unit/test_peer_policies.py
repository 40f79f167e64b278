"""Today's peers as baselines: each keeps its own published rules, not ppserve's balance or ring."""

from __future__ import annotations

from tests.unit.sched_helpers import fake_result, make_request, make_scheduler


def _fill(s):
    formed = []
    while (out := s.schedule()) is not None:
        formed.append(out)
        s.check_invariants()
    return formed


def _collect(s):
    done = s.in_flight[0]
    s.update_from_output(done, fake_result(done))
    s.check_invariants()
    return done


def test_vllm_v1_pipelines_a_prompts_chunks_without_sharing_the_work():
    """A lone 1,000-token prompt at pp 4, budget 128: vLLM v1 counts a chunk's tokens as computed when
    it schedules them, so the next full-budget chunk follows at once; ppserve's balanced formation would
    instead cut the prompt into p equal chunks."""
    s = make_scheduler("vllm-v1", token_budget=128, pp=4, max_num_seqs=8)
    assert not s.balanced and s.ring is None
    s.add_request(make_request("long", 1000, max_tokens=4))
    formed = _fill(s)
    assert [out.num_scheduled_tokens for out in formed] == [(128,)] * 4
    assert not any(out.sample_request_ids for out in formed)  # only the last chunk samples


def test_vllm_v1_has_no_per_microbatch_share_of_the_seats():
    """`max_num_seqs` bounds the running requests over all microbatches in flight (#41682): a burst of
    short prompts fills one microbatch, even with `per_microbatch_seq_cap` set (ppserve's own)."""
    s = make_scheduler("vllm-v1", token_budget=512, pp=4, max_num_seqs=16, per_microbatch_seq_cap=True)
    for i in range(16):
        s.add_request(make_request(f"r{i}", 8, max_tokens=20))
    formed = _fill(s)
    assert len(formed[0].order) == 16
    # Their decodes then ride together: one full microbatch, the other slots empty.
    for _ in range(6):
        _collect(s)
        _fill(s)
    sizes = sorted(len(out.order) for out in s.in_flight)
    assert sizes == [16]


def test_vllm_v1_serves_running_requests_in_admission_order_decodes_first_only_by_age():
    """Running requests in admission order: an older prompt's next chunk goes before a younger
    request's decode, which vLLM v1 does not favour (Sarathi-Serve's rule would)."""
    s = make_scheduler("vllm-v1", token_budget=64, pp=1, max_num_seqs=8)
    s.add_request(make_request("old", 200, max_tokens=8))
    s.add_request(make_request("young", 4, max_tokens=8))
    out = _fill(s)[0]
    assert out.order == ("old",)  # the whole budget to the oldest prompt
    _collect(s)
    out = _fill(s)[0]
    assert out.order[0] == "old" and out.num_scheduled_tokens[0] == 64


def test_vllm_v1_admits_nothing_in_a_formation_that_preempted():
    """vLLM v1 admits waiting requests only when serving the running ones preempted none."""
    from ppserve.sched.budget import TokenBudget
    from ppserve.sched.policies import VllmV1Policy

    class Builder:  # what VllmV1Policy.fill reads and does, recorded
        def __init__(self, preempts: bool) -> None:
            self.budget = TokenBudget(64)
            self.num_preempted = 0
            self.preempts = preempts
            self.admitted: list[str] = []
            self.running = [make_request("run", 4)]
            self.running[0].num_computed_tokens = 3  # its last prompt token left
            self.waiting = [make_request("wait", 4)]

        def schedulable_in_order(self):
            yield from self.running

        def add(self, req, n, may_preempt):
            self.budget.spend(n)
            self.num_preempted += self.preempts
            return True

        def waiting_head(self):
            return self.waiting[0] if self.waiting else None

        def admit(self, req, n):
            self.admitted.append(self.waiting.pop(0).request_id)
            return True

    for preempts, admitted in ((False, ["wait"]), (True, [])):
        b = Builder(preempts)
        VllmV1Policy().fill(b)  # type: ignore[arg-type]
        assert b.admitted == admitted


def test_sglang_pp_binds_each_request_to_the_slot_of_its_last_prefill_chunk():
    """Eight short prompts at pp 4 with `max_num_seqs` 8: each slot admits at most 8 // 4 = 2, and from
    then on a request decodes only in its slot, the slot's decodes together."""
    s = make_scheduler("sglang-pp", token_budget=512, pp=4, max_num_seqs=8)
    for i in range(8):
        s.add_request(make_request(f"r{i}", 8, max_tokens=30))
    formed = _fill(s)
    assert [len(out.order) for out in formed] == [2, 2, 2, 2]
    groups = {frozenset(out.order) for out in formed}
    for _ in range(20):
        _collect(s)
        formed += _fill(s)
    for out in formed[4:]:
        assert frozenset(out.order) in groups  # a slot's group decodes together, nobody moves


def test_sglang_pp_runs_a_slots_prefill_instead_of_its_decodes():
    """A slot that runs a prefill skips its own decodes that round (`enable_mixed_chunk` off)."""
    s = make_scheduler("sglang-pp", token_budget=64, pp=2, max_num_seqs=8)
    s.add_request(make_request("a", 8, max_tokens=40))
    _fill(s)  # slot 0: a's prompt
    _collect(s)
    s.add_request(make_request("b", 8, max_tokens=40))
    outs = _fill(s)
    slot_of_a = outs[0]
    assert "a" not in slot_of_a.order or "b" not in slot_of_a.order


def test_sglang_pp_chunks_one_prompt_at_a_time_down_the_pipeline():
    s = make_scheduler("sglang-pp", token_budget=128, pp=4, max_num_seqs=8)
    s.add_request(make_request("long", 1000, max_tokens=4))
    s.add_request(make_request("next", 100, max_tokens=4))
    formed = _fill(s)
    # Without a calibrated step cost the chunks stay at the chunk size; "next" waits its turn.
    assert [out.order for out in formed] == [("long",)] * 4
    assert [out.num_scheduled_tokens for out in formed] == [(128,)] * 4


def test_sglang_pp_dynamic_chunks_shrink_as_the_prefix_grows():
    """With a step cost whose per-key term is large, each later chunk is smaller, by SGLang's rule."""
    from ppserve.sched.cost import PipelineCost, StepCost

    s = make_scheduler("sglang-pp", token_budget=512, pp=2, max_num_seqs=8, block_size=16,
                       num_blocks=4000, max_model_len=16384)
    stage = StepCost(floor_s=1e-3, token_s=1e-5, prefill_key_s=1e-7)
    s.cost.reset(PipelineCost((stage, stage)))
    assert s.cost.calibrated
    s.add_request(make_request("long", 8000, max_tokens=2))
    sizes = []
    for _ in range(12):
        for out in _fill(s):
            sizes.extend(out.num_scheduled_tokens)
        if not s.in_flight:
            break
        _collect(s)
    assert sizes[0] == 512 and sizes[1] < 512
    assert all(a >= b for a, b in zip(sizes[1:-2], sizes[2:-1], strict=False))
    assert all(n % 64 == 0 or n == sizes[-1] for n in sizes) and min(sizes[:-1]) >= 512 // 4


def test_vllm_v1_async_schedules_decodes_on_pending_tokens_at_once():
    """Async scheduling: up to p + 1 microbatches, a decode scheduled again on the token the oldest
    in-flight microbatch is still computing, formed at once and with every seat taken. With no
    per-microbatch share the burst's eight requests ride together: two microbatches in flight, the
    cohort and its next step on pending tokens, the other slots empty (#41682 again)."""
    s = make_scheduler("vllm-v1-async", token_budget=512, pp=4, max_num_seqs=8, per_microbatch_seq_cap=True)
    assert s.ring is not None and s.max_in_flight == 5
    for i in range(8):
        s.add_request(make_request(f"r{i}", 8, max_tokens=40))
    first = _fill(s)
    assert [len(out.order) for out in first] == [8, 8]  # the prompts, then their first decodes at once
    assert first[1].ring_request_ids == first[0].order
    for _ in range(12):
        _collect(s)
        (out,) = _fill(s)
        assert len(out.ring_request_ids) == 8 and len(s.in_flight) == 2
    # Without async scheduling the cohort waits for its token: one microbatch in flight.
    s = make_scheduler("vllm-v1", token_budget=512, pp=4, max_num_seqs=8)
    assert s.ring is None and s.max_in_flight == 4
    for i in range(8):
        s.add_request(make_request(f"r{i}", 8, max_tokens=40))
    assert len(_fill(s)) == 1
