"""Prefix caching in the block manager and the scheduler: keys, reference counts, hits, eviction, salts,
and the invariants under random churn (torch-free)."""

from __future__ import annotations

import random

import pytest

from ppserve.config import POLICIES
from ppserve.request import Request, SamplingParams
from ppserve.sched.block_manager import BlockManager, block_key, root_key
from tests.unit.sched_helpers import assert_drained, drive, fake_result, make_request, make_scheduler, step

SYSTEM = list(range(500, 520))  # a 20-token shared prefix: 5 full blocks of 4


def _new(s, rid, prompt_len, **kw):
    req = make_request(rid, prompt_len, **kw)
    s.add_request(req)
    return req


def test_hit_and_query_counters_are_exact():
    """First request: 22 tokens queried, 0 hit. Second (same 20-token prefix, 26 tokens): 5 blocks = 20
    hit."""
    s = make_scheduler(token_budget=64, block_size=4)
    a = _new(s, "a", 22, max_tokens=2, prefix=SYSTEM)
    a_blocks = step(s).new_requests[0].block_ids
    assert (s.blocks.num_query_tokens, s.blocks.num_hit_tokens) == (22, 0)
    b = _new(s, "b", 26, max_tokens=2, prefix=SYSTEM)
    out = step(s)
    assert (s.blocks.num_query_tokens, s.blocks.num_hit_tokens) == (48, 20)
    assert b.num_cached_tokens == 20 and a.num_cached_tokens == 0
    new_b = next(n for n in out.new_requests if n.request_id == "b")
    assert new_b.num_computed_tokens == 20 and new_b.block_ids[:5] == a_blocks[:5]
    # only the uncached part is work
    assert dict(zip(out.order, out.num_scheduled_tokens, strict=True))["b"] == 6
    assert s.blocks.hit_rate == pytest.approx(20 / 48)


def test_cache_salt_isolates_tenants():
    s = make_scheduler(token_budget=64, block_size=4)
    _new(s, "a", 22, prefix=SYSTEM, cache_salt="tenant-1")
    step(s)
    b = _new(s, "b", 22, prefix=SYSTEM, cache_salt="tenant-2")
    c = _new(s, "c", 22, prefix=SYSTEM)  # no salt is a salt of its own
    d = _new(s, "d", 22, prefix=SYSTEM, cache_salt="tenant-1")
    step(s)
    assert b.num_cached_tokens == 0 and c.num_cached_tokens == 0 and d.num_cached_tokens == 20
    assert root_key(b) != root_key(c) != root_key(d)


def test_different_tokens_never_share_a_block():
    """Prompts that differ in one token of a block share only the blocks before it; keys chain, so a
    block equal in content but after a different prefix is not shared either."""
    s = make_scheduler(token_budget=64, block_size=4)
    a = _new(s, "a", 20, prefix=SYSTEM)
    step(s)
    other = SYSTEM[:9] + [9999] + SYSTEM[10:]  # differs in block 2 only
    b = _new(s, "b", 20, prefix=other)
    step(s)
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert not set(b.block_ids[2:]) & set(a.block_ids)
    assert block_key(root_key(a), [1, 2, 3, 4]) != block_key(block_key(root_key(a), [0] * 4), [1, 2, 3, 4])


def test_fully_cached_aligned_prompt_recomputes_its_last_block_into_a_fresh_one():
    s = make_scheduler(token_budget=64, block_size=4)
    a = _new(s, "a", 20, max_tokens=1, prefix=SYSTEM)
    out = step(s)
    a_blocks = out.new_requests[0].block_ids
    assert not s.requests and not a.block_ids  # a finished: its 5 blocks wait, cached and evictable
    b = _new(s, "b", 20, max_tokens=1, prefix=SYSTEM)
    out = step(s)
    assert b.num_cached_tokens == 16
    assert dict(zip(out.order, out.num_scheduled_tokens, strict=True))["b"] == 4  # the last block, for logits
    fresh = out.new_requests[0].block_ids
    assert fresh[4] not in a_blocks and len(fresh) == 5  # the 5th block is b's own, not a's cached copy
    assert fresh[:4] == tuple(a_blocks[:4])


def test_siblings_in_the_same_microbatch_share_the_prompt():
    """n > 1 choices are consecutive requests with one prompt: the second is scheduled in the same step
    and hits the blocks the first one's chunk fills in it (keyed when scheduled)."""
    s = make_scheduler(token_budget=64, block_size=4)
    a = _new(s, "a", 22, max_tokens=3, prefix=SYSTEM)
    b = _new(s, "b", 22, max_tokens=3, prefix=SYSTEM)
    out = s.schedule()
    assert set(out.order) == {"a", "b"}
    assert b.num_cached_tokens == 20 and b.block_ids[:5] == a.block_ids[:5]
    assert all(s.blocks.refcount(x) == 2 for x in a.block_ids[:5])
    s.check_invariants()
    s.update_from_output(out, fake_result(out))
    while s.has_unfinished:
        step(s)
    assert_drained(s)


def test_consecutive_in_flight_microbatches_share_the_prefix():
    """PP=2: the second request goes into the next microbatch while the first one's chunk (which fills
    the blocks it hits) is still in flight: the stages run that chunk first."""
    s = make_scheduler(token_budget=24, block_size=4, pp=2)
    a = _new(s, "a", 22, max_tokens=3, prefix=SYSTEM)
    first = s.schedule()
    assert first.order == ("a",)
    chunk = first.num_scheduled_tokens[0]
    b = _new(s, "b", 22, max_tokens=3, prefix=SYSTEM)
    second = s.schedule()
    assert "b" in second.order and len(s.in_flight) == 2
    assert b.num_cached_tokens == chunk // 4 * 4 > 0
    assert b.block_ids[: chunk // 4] == a.block_ids[: chunk // 4]
    s.check_invariants()
    drive(s, random.Random(0))
    assert_drained(s)


def test_decode_tokens_are_keyed_so_the_next_turn_hits_the_answer():
    s = make_scheduler(token_budget=64, block_size=4)
    a = _new(s, "a", 10, max_tokens=9)
    while s.has_unfinished:
        step(s, token=7)
    history = a.prompt_token_ids + a.output_token_ids  # 19 tokens: 4 full blocks
    turn2 = Request("t2", history + [8, 8, 8], SamplingParams(max_tokens=2))
    s.add_request(turn2)
    step(s)
    assert turn2.num_cached_tokens == 16  # the answer's first blocks included, not just the prompt's 8


def test_a_preempted_request_re_hits_its_own_blocks():
    s = make_scheduler(token_budget=64, num_blocks=6, block_size=4)
    _new(s, "a", 8, max_tokens=12)
    b = _new(s, "b", 8, max_tokens=12)
    outs = drive(s, random.Random(0))
    assert s.num_preemptions >= 1
    resent = [n for o in outs for n in o.new_requests if n.request_id == "b" and len(n.token_ids) > 8]
    assert resent and resent[0].num_computed_tokens > 0 and resent[0].num_computed_tokens % 4 == 0
    assert b.output_token_ids == [7] * 12
    assert_drained(s)


def test_eviction_forgets_keys_lru_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams())
    b = Request("b", [9, 9, 8, 8, 7], SamplingParams())
    for r in (a, b):
        bm.acquire_prefix(r, bm.lookup(r))
        bm.allocate(r, 5)  # 3 blocks for a; b will need evictions
        bm.cache_full_blocks(r, 5)
        bm.free(r)
        bm.check()
    # b needed 3 blocks with 2 never-keyed ones free: one of a's two keyed blocks was evicted, its tail.
    assert bm.num_cached == 3
    assert len(bm.lookup(Request("b2", [9, 9, 8, 8, 6], SamplingParams()))) == 2
    assert len(bm.lookup(Request("a2", [1, 2, 3, 4, 5], SamplingParams()))) == 1


def test_writing_into_a_block_filled_by_another_request_is_caught():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams())
    bm.acquire_prefix(a, [])
    bm.allocate(a, 5)
    bm.cache_full_blocks(a, 5)
    b = Request("b", [1, 2, 3, 4, 6], SamplingParams())
    bm.acquire_prefix(b, bm.lookup(b))
    assert b.num_computed_tokens == 4
    bm.allocate(b, 1)
    bm.check_writable(b, 4, 1)  # its own block
    with pytest.raises(AssertionError, match="would write into block"):
        bm.check_writable(b, 2, 3)  # a stage writing token 2 would overwrite a's block
    bm.free(a)
    bm.free(b)
    bm.check()
    with pytest.raises(AssertionError, match="held by nobody"):
        bm.free(Request("x", [1], SamplingParams(), block_ids=[0]))  # a count would go below zero


def test_rebuilt_pipeline_drops_every_key():
    s = make_scheduler(token_budget=64, block_size=4)
    _new(s, "a", 22, max_tokens=4, prefix=SYSTEM)
    step(s)
    s.requeue_all_for_recompute()
    assert s.blocks.num_cached == 0
    out = step(s)
    assert out.new_requests[0].num_computed_tokens == 0  # a's KV went with the old workers: recomputed


def test_caching_off_shares_nothing():
    s = make_scheduler(token_budget=64, block_size=4, prefix_caching=False)
    _new(s, "a", 22, prefix=SYSTEM)
    step(s)
    b = _new(s, "b", 22, prefix=SYSTEM)
    step(s)
    assert b.num_cached_tokens == 0 and s.blocks.num_cached == 0 and s.blocks.num_query_tokens == 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pp", [1, 3])
def test_churn_with_shared_prefixes_cancels_and_kv_pressure(policy, pp):
    """Random requests over a few shared prefixes (and unique ones), eos and cancels, on caches both
    roomy and smaller than the working set: the invariants hold after every change (reference counts are
    the holders' counts, never below 1; nothing written into a block another request filled), and when
    all is done every block is free or cached-and-evictable."""
    hits = 0
    for seed in range(6):
        rng = random.Random(seed * 10 + pp)
        bs = rng.choice([1, 4, 16])
        prefixes = [[rng.randrange(100, 200) for _ in range(rng.randint(1, 60))] for _ in range(3)]
        s = make_scheduler(policy, token_budget=rng.choice([7, 32, 128]), num_blocks=rng.choice([60, 400]),
                           block_size=bs, pp=pp, max_num_seqs=rng.randint(2, 16))
        for i in range(rng.randint(10, 30)):
            prefix = rng.choice(prefixes + [[]])
            total = len(prefix) + rng.randint(1, 30)
            need = -(-(total + 8) // bs)
            if need > s.blocks.num_blocks:
                continue
            s.add_request(make_request(f"r{i}", total, max_tokens=rng.randint(1, 8), ignore_eos=False,
                                       prefix=prefix))
        drive(s, rng, eos_prob=0.1, cancel_prob=0.1)
        assert_drained(s)
        assert s.blocks.num_hit_tokens <= s.blocks.num_query_tokens
        hits += s.blocks.num_hit_tokens
    assert hits > 0  # the trace did share


def _sim(workload, caching, pp=2):
    from ppserve.config import SchedulerConfig
    from ppserve.sim import ConstantCostModel, SimConfig, simulate

    cfg = SimConfig(SchedulerConfig(token_budget=64), num_blocks=4000, block_size=16, check_invariants=True,
                    enable_prefix_caching=caching)
    return simulate(workload, ConstantCostModel(pp, 0.001, 0.00001), cfg)


def test_simulator_shares_only_prefix_identities():
    """Simulated prompts are unique but for their prefix identity: a workload without one hits nothing
    (the existing figures cannot move), a shared-prefix one hits each group's prefix after its first."""
    from ppserve.sim.workload import shared_prefix, uniform_lengths

    plain = _sim(uniform_lengths(12, (20, 90), (2, 5)), caching=True)
    assert plain.num_microbatches == _sim(uniform_lengths(12, (20, 90), (2, 5)),
                                          caching=False).num_microbatches
    wl = shared_prefix(num_groups=2, per_group=4, prefix_len=64, question_len=8, output_len=3)
    on, off = _sim(wl, caching=True), _sim(wl, caching=False)
    assert on.end_s < off.end_s


def test_multi_turn_workload_hits_the_previous_turn_and_answer():
    from ppserve.config import SchedulerConfig
    from ppserve.sched import Scheduler
    from ppserve.sim.simulator import SIM_TOKEN, sim_prompt
    from ppserve.sim.workload import multi_turn

    wl = multi_turn(num_conversations=2, turns=3, system_len=30, user_len=10, output_len=6)
    assert [w.prompt_len for w in wl] == [40, 40, 56, 56, 72, 72]
    s = Scheduler(SchedulerConfig(token_budget=256), 400, 4, 4096)
    cached = []
    for k, w in enumerate(wl):  # one turn at a time, each answered before the next is sent
        tokens, salt = sim_prompt(k, w)
        req = Request(f"r{k}", tokens, SamplingParams(max_tokens=w.output_len, ignore_eos=True),
                      cache_salt=salt)
        s.add_request(req)
        while s.has_unfinished:
            step(s, token=SIM_TOKEN)
        cached.append(req.num_cached_tokens)
    # Turn 2 re-sends 40 + 6 answer tokens of history: 11 full blocks of 4 are cached (44 tokens).
    assert cached == [0, 0, 44, 44, 60, 60]


def test_the_manager_keys_blocks_as_block_key_defines():
    bm = BlockManager(num_blocks=8, block_size=2)
    r = Request("a", [5, 6, 7, 8, 9], SamplingParams())
    bm.lookup(r)
    first = block_key(root_key(r), [5, 6])
    assert r.block_keys == [first, block_key(first, [7, 8])]


def test_bench_workloads_carry_prefix_identities_into_their_prompts():
    """`ppserve bench --workload shared-prefix|multi-turn`: the prompt builder shares exactly what the
    prefix identity says, and a workload without one gets the prompts it always got."""
    from ppserve.bench.prompts import PromptBuilder
    from ppserve.bench.workloads import WorkloadSpec, build_workload

    spec = WorkloadSpec(source="shared-prefix", num_requests=8, prefix_groups=2, prefix_len=20,
                        question_len=5, output_max=3, arrival="at-once")
    reqs = build_workload(spec)
    prompts = PromptBuilder(None, 1000, seed=0).build_for(reqs)
    assert [(r.prefix_id, r.prefix_len, r.prompt_len) for r in reqs[:2]] == [(0, 20, 25), (1, 20, 25)]
    assert prompts[0][:20] == prompts[2][:20] != prompts[1][:20] and prompts[0][20:] != prompts[2][20:]
    turns = build_workload(WorkloadSpec(source="multi-turn", num_requests=4, turns=2, prefix_len=10,
                                        question_len=4, output_max=2, arrival="at-once"))
    chats = PromptBuilder(None, 1000, seed=0).build_for(turns)
    assert chats[2][:14] == chats[0] and chats[3][:14] == chats[1] != chats[0]
    plain = build_workload(WorkloadSpec(source="uniform", num_requests=3))
    assert (PromptBuilder(None, 1000, 0).build_for(plain)
            == PromptBuilder(None, 1000, 0).build([r.prompt_len for r in plain]))
