"""Balanced microbatch formation (sched/balance.py): pipeline depth, equal microbatches, pipelined chunks.

Driven like the real engine: fill the pipeline, complete the oldest microbatch, fill again. No torch.
"""

from __future__ import annotations

import math
import random

import pytest

from ppserve.sched import StepResult
from ppserve.sched.balance import ArrivalWatch, decode_quota, fair_share, fill_microbatches, min_chunk_tokens
from ppserve.sched.budget import TimeBudgetMode
from ppserve.sched.cost import BatchShape, PipelineCost, StepCost
from tests.unit.sched_helpers import fake_result, make_request, make_scheduler


def run(s, steps, arrivals=None):
    """Engine-style loop for `steps` collects; returns (depth after each fill, microbatches formed).
    `arrivals(i)` may add requests before collect i."""
    depths, formed = [], []
    for i in range(steps):
        if arrivals is not None:
            arrivals(i)
        while (out := s.schedule()) is not None:
            formed.append(out)
            s.check_invariants()
        if not s.in_flight:
            break
        depths.append((len(s.in_flight), len(s.running)))
        done = s.in_flight[0]
        s.update_from_output(done, fake_result(done))
        s.check_invariants()
    return depths, formed


def test_decode_quota_spreads_over_the_free_slots():
    # 9 decodes ready at once on 4 empty slots: 3, 2, 2, 2 - never an empty fourth slot.
    ready, in_flight, sizes = 9, 0, []
    while ready:
        q = decode_quota(9, ready, 4, 4 - in_flight)
        sizes.append(q)
        ready -= q
        in_flight += 1
    assert sizes == [3, 2, 2, 2]
    # Steady state: a group of 3 comes back while 6 ride in the other three microbatches.
    assert decode_quota(9, 3, 4, 1) == 3
    # A surplus moves on: 5 ready with 8 decoding over 4 slots takes 2, the rest join the next one.
    assert decode_quota(8, 5, 4, 1) == 2
    assert decode_quota(8, 0, 4, 2) == 0
    assert fair_share(1000, 4, 512) == 250 and fair_share(4096, 4, 512) == 512


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_steady_state_depth_is_p_with_decodes_only(pp):
    """8 decoding requests at budget 512 keep pp microbatches in flight (unbalanced: one); pp + 1 with the
    token ring (its extra microbatch: the oldest group's next step)."""
    for balance, ring, expect_depth in ((True, False, pp), (False, False, 1), (True, True, pp + 1)):
        s = make_scheduler("sarathi", token_budget=512, pp=pp, max_num_seqs=64, balance=balance,
                           token_ring=ring)
        for i in range(8):
            s.add_request(make_request(f"r{i}", 16, max_tokens=400))
        depths, _ = run(s, 200)
        steady = depths[20:]
        assert sum(d == expect_depth for d, _ in steady) == len(steady), (balance, ring, steady[:10])


def test_depth_is_p_for_90_percent_of_collects_with_arrivals():
    """64 requests arriving one every 3 collects (the issue's trace): once 2p or more run, the pipeline
    holds p microbatches for at least 90 % of the collects (no token ring: its extra one would make p + 1)."""
    pp = 4
    s = make_scheduler("sarathi", token_budget=512, pp=pp, max_num_seqs=64, num_blocks=20_000,
                       token_ring=False)
    rng = random.Random(3)
    pending = [make_request(f"r{i}", rng.randint(8, 300), max_tokens=rng.randint(20, 120)) for i in range(64)]

    def arrive(i):
        if i % 3 == 0 and pending:
            s.add_request(pending.pop(0))

    depths, _ = run(s, 5000, arrive)
    busy = [d for d, running in depths if running >= 2 * pp]
    assert len(busy) > 200
    assert sum(d == pp for d in busy) >= 0.9 * len(busy)


def test_consecutive_microbatches_hold_equal_decodes():
    pp = 4
    s = make_scheduler("sarathi", token_budget=512, pp=pp, max_num_seqs=64)
    for i in range(64):
        s.add_request(make_request(f"r{i}", 8, max_tokens=300))
    _, formed = run(s, 120)
    decode_only = [o for o in formed[40:] if o.num_prefill_tokens == 0]
    assert len(decode_only) > 50
    counts = [o.num_decode_tokens for o in decode_only]
    assert max(counts) <= math.ceil(64 / pp) * 1.1 and min(counts) >= 64 / pp * 0.9, counts[:20]
    # Every request still gets a token every round: no decode is left behind by the quota.
    for o in decode_only[:pp]:
        assert len(set(o.order)) == o.num_decode_tokens
    assert len({rid for o in decode_only[:pp] for rid in o.order}) == 64


def test_consecutive_microbatches_cost_the_same_predicted_time():
    """With a cost model, decodes plus prefill chunks fill each microbatch to the same predicted time."""
    pp = 2
    stage = StepCost(2e-3, 1e-4, 1e-8, 2e-7)
    cost = PipelineCost((stage, stage.plus(StepCost(sample_s=5e-5))))  # the last stage pays for sampling
    # Prefix caching off: under this KV pressure a preempted prompt comes back with most of its blocks
    # cached, computes only its tail, and the next prompt cannot get blocks: a short microbatch that says
    # nothing about the formation this test checks.
    s = make_scheduler("sarathi", token_budget=512, pp=pp, max_num_seqs=64, budget_mode="time",
                       prefix_caching=False)
    s.cost.reset(cost)  # the scheduler's cost model starts calibrated at this prior
    s.budget_mode = TimeBudgetMode(token_budget=512, time_budget_s=0.03, cost=s.cost)
    for i in range(16):
        s.add_request(make_request(f"d{i}", 4, max_tokens=500))
    for i in range(6):
        s.add_request(make_request(f"p{i}", 2000, max_tokens=4))
    _, formed = run(s, 60)
    mixed = [o for o in formed[10:40] if o.num_prefill_tokens and o.num_decode_tokens]
    assert len(mixed) >= 10
    times = [cost.pace(BatchShape.of(o)) for o in mixed]
    assert max(times) <= 1.1 * min(times), times
    decodes = [o.num_decode_tokens for o in mixed]  # 16 chatting plus a prompt that just got its token
    assert max(decodes) - min(decodes) <= 1, decodes  # an odd count splits no better than n and n + 1


def test_long_prompt_chunks_ride_in_consecutive_in_flight_microbatches():
    """One 4096-token prompt at pp=4, budget 512: eight chunks, each following the previous one down the
    pipeline, four in flight at a time (five with the token ring, not asked for here); only the last
    samples."""
    pp = 4
    s = make_scheduler("sarathi", token_budget=512, pp=pp, num_blocks=2000, block_size=16, max_model_len=8192,
                       token_ring=False)
    s.add_request(make_request("long", 4096, max_tokens=2))
    first = [s.schedule() for _ in range(pp)]
    assert [o.num_scheduled_tokens for o in first] == [(512,)] * pp
    assert [o.num_computed_tokens for o in first] == [(0,), (512,), (1024,), (1536,)]
    assert s.schedule() is None
    chunks = list(first)
    while s.in_flight:
        s.update_from_output(s.in_flight[0], fake_result(s.in_flight[0]))
        while (out := s.schedule()) is not None:
            chunks.append(out)
        s.check_invariants()
    prefill = [o for o in chunks if o.num_prefill_tokens]
    assert [o.num_computed_tokens[0] for o in prefill] == [512 * k for k in range(8)]
    assert [bool(o.sample_request_ids) for o in prefill] == [False] * 7 + [True]
    assert [o.step_id for o in prefill] == list(range(8))  # consecutive microbatches


def test_lone_prompt_is_cut_into_p_chunks():
    """Little work: a 600-token prompt on 4 stages becomes four chunks of 150, not 512 + 88."""
    s = make_scheduler("sarathi", token_budget=512, pp=4, num_blocks=500)
    s.add_request(make_request("p", 600, max_tokens=2))
    outs = [s.schedule() for _ in range(4)]
    assert [o.total_tokens for o in outs] == [150, 150, 150, 150]


def test_arrival_watch_tells_a_stream_from_a_batch():
    watch = ArrivalWatch()
    assert not watch.streaming(0.0)
    watch.arrived(0.0)
    assert not watch.streaming(0.0)  # one arrival: no gap seen yet
    for _ in range(10):
        watch.arrived(0.0)
    assert not watch.streaming(0.0)  # a batch given at one instant is no stream
    stream = ArrivalWatch()
    for t in range(5):
        stream.arrived(float(t))
    assert stream.mean_gap_s == pytest.approx(1.0)
    assert stream.streaming(4.0) and stream.streaming(6.9)
    assert not stream.streaming(7.0)  # silent for three mean gaps: the arrivals stopped
    stream.arrived(100.0)  # a long gap moves the mean by a tenth of the difference
    assert stream.mean_gap_s == pytest.approx(1.0 + 0.1 * 95.0)
    assert stream.streaming(100.0)


@pytest.mark.parametrize("arrivals, now, rounds, first", [
    ((0.0, 1.0, 2.0), 2.0, 4, 375),   # arriving: 3000 tokens over 4 rounds of 2 microbatches
    ((0.0, 1.0, 2.0), 10.0, 4, 512),  # silent for 8 mean gaps: one round, saturated, the whole budget
    ((0.0, 0.0, 0.0), 0.0, 4, 512),   # a batch at one instant is no stream
    ((0.0, 1.0, 2.0), 2.0, 1, 512),   # balance_rounds=1: one round
])
def test_rounds_share_the_work_only_while_requests_keep_arriving(arrivals, now, rounds, first):
    """`scheduler.balance_rounds`: three 1000-token prompts at pp=2, budget 512. One round of two
    microbatches cannot hold 3000 tokens (saturated: the whole budget); four rounds share them 8 ways,
    but only while requests keep arriving (when they stop, thinner chunks would only delay the last
    prompts). The first microbatch fills an empty pipeline, which takes one round whatever k (the whole
    budget here); `first` is the second one's."""
    clock = [0.0]
    s = make_scheduler("sarathi", token_budget=512, pp=2, num_blocks=2000, balance_rounds=rounds)
    s.clock = lambda: clock[0]
    for i, t in enumerate(arrivals):
        clock[0] = t
        s.add_request(make_request(f"r{i}", 1000, max_tokens=2))
    clock[0] = now
    assert s.schedule().total_tokens == 512
    assert s.schedule().total_tokens == first


def _first_mixed_microbatch(prompt: int, rounds: int, min_chunks: float) -> tuple[int, int]:
    """(prefill, decode) tokens of the first microbatch that takes a prompt, at pp=2, budget 512, on a
    calibrated cost whose step floor is worth 100 tokens (the minimum chunk): four decodes under way, then
    three prompts arriving a second apart (a stream)."""
    from unittest import mock

    import ppserve.sched.balance as balance_module

    with mock.patch.object(balance_module, "ROUNDS_MIN_CHUNKS", min_chunks):
        clock = [0.0]
        s = make_scheduler("sarathi", token_budget=512, pp=2, num_blocks=2000, balance_rounds=rounds)
        stage = StepCost(1e-3, 1e-5)
        s.cost.reset(PipelineCost((stage, stage)))
        s.clock = lambda: clock[0]
        for i in range(4):
            s.add_request(make_request(f"d{i}", 4, max_tokens=500))
        run(s, 4)
        for i in range(3):
            clock[0] = 10.0 + i
            s.add_request(make_request(f"r{i}", prompt, max_tokens=2))
        mixed = next(o for o in run(s, 2)[1] if o.num_prefill_tokens)
        return mixed.num_prefill_tokens, mixed.num_decode_tokens


def test_a_chunk_shared_over_rounds_is_at_least_two_minimum_chunks():
    """Four rounds cut 3 x 300 tokens into ~100-token chunks beside the decodes, each about what a step's
    floor costs: they barely shorten a microbatch and only add steps to their prompt. With the floor of
    two minimum chunks (`ROUNDS_MIN_CHUNKS`) the microbatch holds ~200 tokens; where four rounds' share
    is thicker anyway (3 x 1,200) the floor changes nothing; and it never makes a chunk thicker than
    one round's share (3 x 100 tokens)."""
    prefill, decodes = _first_mixed_microbatch(300, 4, 2.0)
    thin_prefill, thin_decodes = _first_mixed_microbatch(300, 4, 1.0)
    assert abs(prefill + decodes - 200) <= 2  # two minimum chunks, decodes included
    assert 100 <= thin_prefill + thin_decodes <= 120  # without it: ~900 / 8 tokens of work a share
    assert _first_mixed_microbatch(1200, 4, 2.0) == _first_mixed_microbatch(1200, 4, 1.0)
    assert _first_mixed_microbatch(1200, 4, 2.0)[0] < _first_mixed_microbatch(1200, 1, 2.0)[0]
    # 3 x 100 tokens: one round's share (150) is below two minimum chunks, and the chunk is that share.
    assert _first_mixed_microbatch(100, 4, 2.0) == _first_mixed_microbatch(100, 1, 2.0)
    assert _first_mixed_microbatch(100, 4, 2.0)[0] > _first_mixed_microbatch(100, 4, 1.0)[0]


def test_prompts_filling_an_empty_pipeline_split_evenly():
    """The demo's start: eight short chat prompts (194 tokens) into an empty pp=2 pipeline with a budget
    of 512. The quarter-budget floor would make the first microbatch 128+ tokens and the second the
    rest, and the second stage would wait for all of the first; filling, the two are even. A lone short
    prompt keeps the floor: cut below it, each chunk would pay the step's floor."""
    s = make_scheduler("sarathi", token_budget=512, pp=2, num_blocks=500)
    for i, n in enumerate([23, 25, 24, 22, 26, 25, 24, 25]):
        s.add_request(make_request(f"r{i}", n, max_tokens=2))
    first, second = s.schedule(), s.schedule()
    assert first.total_tokens + second.total_tokens == 194
    assert abs(first.total_tokens - second.total_tokens) <= 2, (first.total_tokens, second.total_tokens)
    # The same prompts arriving as a stream, four rounds: filling an empty pipeline takes one round (with
    # no decodes to keep level, thinner chunks would only delay the prompts).
    clock = [0.0]
    streamed = make_scheduler("sarathi", token_budget=512, pp=2, num_blocks=500, balance_rounds=4)
    streamed.clock = lambda: clock[0]
    for i, n in enumerate([23, 25, 24, 22, 26, 25, 24, 25]):
        clock[0] = 0.01 * i
        streamed.add_request(make_request(f"r{i}", n, max_tokens=2))
    assert ([streamed.schedule().total_tokens, streamed.schedule().total_tokens]
            == [first.total_tokens, second.total_tokens])
    lone = make_scheduler("sarathi", token_budget=512, pp=2, num_blocks=500)
    lone.add_request(make_request("p", 200, max_tokens=2))
    assert [lone.schedule().total_tokens, lone.schedule().total_tokens] == [128, 72]


def test_a_fill_takes_the_number_of_microbatches_that_ends_it_soonest():
    """(m + p - 1)(f + W / m) is least at m = sqrt((p - 1) W / f), rounded down; the stage that wants the
    most decides; a stage fitted with no floor asks for one round (p)."""
    assert fill_microbatches([(1e-3, 20.48e-3)] * 4, 4) == 7  # sqrt(3 x 20.48) = 7.8
    # the demo's fill: as one round
    assert fill_microbatches([(4.65e-3, 35.9e-3), (5.05e-3, 27.6e-3)], 2) == 2
    assert fill_microbatches([(1e-3, 0.5e-3)] * 4, 4) == 1  # little work beside the floor: one microbatch
    assert fill_microbatches([(1e-3, 20.48e-3), (2e-3, 20.48e-3)], 2) == 4  # sqrt(20.48) beats sqrt(10.24)
    assert fill_microbatches([(0.0, 5e-3)] * 4, 4) == 4


def test_a_burst_into_an_empty_pipeline_is_cut_into_equal_microbatches_by_its_own_rule():
    """The regime suite's multi-turn bursts: 32 prompts of 64 tokens (2048) into an empty pp=4 pipeline,
    budget 512, on a calibrated cost whose floor is worth 100 tokens. One round found them saturated
    (2048 = p x 512) and took the whole budget, and the microbatches after it, shared over four rounds
    while requests arrive, ~200 tokens: every later stage waited for the long first one (simulator:
    stage 0 idle 52 ms a burst). The fill is cut into `fill_microbatches` equal parts: sqrt(3 x 20.48) ->
    7 of ~293 tokens (whole prompts of 64), the ones after the first too (the fill keeps its share), a
    stream or a batch alike."""
    for streaming in (True, False):
        clock = [0.0]
        s = make_scheduler("sarathi", token_budget=512, pp=4, num_blocks=4000, balance_rounds=4,
                           max_num_seqs=64)
        stage = StepCost(1e-3, 1e-5)
        s.cost.reset(PipelineCost((stage,) * 4))
        s.clock = lambda clock=clock: clock[0]
        for i in range(32):
            clock[0] = 0.001 * i if streaming else 0.0
            s.add_request(make_request(f"r{i}", 64, max_tokens=2))
        sizes = [s.schedule().num_prefill_tokens for _ in range(4)]
        assert all(abs(n - 2048 / 7) <= 64 for n in sizes), (streaming, sizes)


@pytest.mark.parametrize("seed", range(6))
def test_fills_keep_the_invariants_and_finish_every_request(seed):
    """Random bursts into an empty pipeline on a calibrated cost (pp 2-4, the token ring or not): the fill's
    kept share never breaks an invariant (no microbatch over the budget, no decode left behind a prefill),
    and every request finishes."""
    rng = random.Random(seed)
    pp = rng.choice([2, 3, 4])
    s = make_scheduler("sarathi", token_budget=rng.choice([64, 256, 512]), pp=pp, num_blocks=4000,
                       block_size=16, max_num_seqs=rng.choice([8, 64]), token_ring=rng.choice([True, False]))
    floor = rng.choice([1e-4, 1e-3, 5e-3])
    s.cost.reset(PipelineCost(tuple(StepCost(floor, rng.choice([1e-6, 1e-5, 2e-4])) for _ in range(pp))))
    fills = 0
    for b in range(6):  # each burst into an empty pipeline, or into one still at work
        fills += not s.in_flight
        for k in range(rng.randint(2, 24)):
            s.add_request(make_request(f"b{b}-{k}", rng.randint(1, 300), max_tokens=rng.randint(1, 12)))
        run(s, rng.randint(1, 30))
    while s.in_flight or s.waiting or s.running:
        run(s, 50)
    assert fills >= 1 and not s.running and not s.waiting and not s.in_flight


def test_the_demos_fill_stays_level_on_its_measured_costs():
    """The demo's eight prompts (194 tokens) on the two CPU stages' measured costs (floors 4.65 / 5.05 ms,
    241 / 185 us a token): sqrt(46.7 / 4.65) -> 3 microbatches of ~65 tokens, cut at whole prompts (none
    leaves a rest of 32 tokens or less). Kept for the first microbatch only, the fill went as 81 + 113."""
    s = make_scheduler("sarathi", token_budget=512, pp=2, num_blocks=500, max_num_seqs=8, block_size=16)
    s.cost.reset(PipelineCost((StepCost(4.65e-3, 240.9e-6), StepCost(5.05e-3, 185.3e-6))))
    for i, n in enumerate([37, 21, 23, 19, 24, 25, 22, 23]):
        s.add_request(make_request(f"r{i}", n, max_tokens=4))
    sizes = [s.schedule().num_prefill_tokens for _ in range(3)]  # the third: the token ring's slot
    assert sum(sizes) == 194 and max(sizes) <= 81 and min(sizes) >= 37, sizes


def test_a_shared_prefix_counts_once_in_the_work_in_reach():
    """Eight chat prompts behind one 32-token system prompt (two blocks of 16): the first request
    computes the prefix, the other seven hit it (keyed as it is scheduled), so the work in reach is
    32 + 8 x 24 tokens, not 8 x 56, and the pipeline's first two microbatches split it evenly. Counted
    eight times (the demo: 153 + 41 computed tokens), the first microbatch took nearly all of it."""
    s = make_scheduler("sarathi", token_budget=512, pp=2, num_blocks=500, block_size=16)
    system = list(range(5, 37))
    for i in range(8):
        s.add_request(make_request(f"r{i}", 56, max_tokens=2, prefix=system))
    first, second = s.schedule(), s.schedule()
    assert first.total_tokens + second.total_tokens == 32 + 8 * 24
    assert abs(first.total_tokens - second.total_tokens) <= 24, (first.total_tokens, second.total_tokens)


def test_decodes_left_out_by_the_quota_go_first_next_time():
    """A request that becomes a decode joins a full group; the surplus decode waits at most one
    microbatch and is then the first served (oldest ready first)."""
    pp = 2
    s = make_scheduler("sarathi", token_budget=512, pp=pp, max_num_seqs=64)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 4, max_tokens=200))
    run(s, 40)
    waits: dict[str, int] = {}
    last_seen: dict[str, int] = {}
    for step in range(200):
        while (out := s.schedule()) is not None:
            for rid in out.order:
                if rid in last_seen:
                    waits[rid] = max(waits.get(rid, 0), out.step_id - last_seen[rid])
                last_seen[rid] = out.step_id
        if step == 50:
            s.add_request(make_request("late", 4, max_tokens=100))
        done = s.in_flight[0]
        s.update_from_output(done, StepResult(done.step_id, {rid: 7 for rid in done.sample_request_ids}))
    # Every decode comes back within p + 1 microbatches of its last one: none is starved.
    assert max(waits.values()) <= pp + 1, waits


@pytest.mark.parametrize("policy", ["vllm", "orca", "static"])
def test_baselines_keep_one_microbatch_per_request(policy):
    s = make_scheduler(policy, token_budget=512, pp=4, max_num_seqs=64)
    assert not s.balanced
    for i in range(8):
        s.add_request(make_request(f"r{i}", 16, max_tokens=50))
    depths, _ = run(s, 60)
    assert all(d == 1 for d, _ in depths[5:])  # all eight ride in one microbatch: the unbalanced pipeline


@pytest.mark.parametrize("waiting_beyond_seats", [False, True])
def test_requests_waiting_for_seats_keep_the_budget_whole(waiting_beyond_seats):
    """The fair share shrinks a microbatch only while the pipeline has slack. Requests waiting beyond
    the free seats mean it has none (max_num_seqs bounds the work in reach, not demand): the budget
    stays whole, as in plain Sarathi-Serve."""
    s = make_scheduler("sarathi", token_budget=64, pp=4, max_num_seqs=1)
    s.add_request(make_request("a", 70, max_tokens=4))
    if waiting_beyond_seats:
        s.add_request(make_request("b", 70, max_tokens=4))
    first = s.schedule()
    assert first is not None and first.chunks() == [(64 if waiting_beyond_seats else math.ceil(70 / 4), 0)]
    s.check_invariants()


def test_min_chunk_is_the_chunk_that_costs_the_step_floor():
    """The smallest chunk a time share cuts a prompt to: what costs a stage its per-step floor, at most a
    quarter of the budget. A stage whose floor is worth 1,000 tokens keeps the quarter budget; one whose
    floor is worth 10 tokens cuts to 10; a stage with no floor to 0."""
    gpu = StepCost(10e-3, 10e-6)
    cpu = StepCost(1e-3, 1e-4)
    assert min_chunk_tokens(PipelineCost((gpu, gpu)), 512) == 128
    assert min_chunk_tokens(PipelineCost((cpu, cpu)), 512) == 10
    assert min_chunk_tokens(PipelineCost((cpu, gpu)), 512) == 128  # the stage where it is longest
    assert min_chunk_tokens(PipelineCost((StepCost(0.0, 1e-4),) * 2), 512) == 0


@pytest.mark.parametrize(("stage", "kept_whole"),
                         [(StepCost(1e-3, 1e-4), False), (StepCost(10e-3, 10e-6), True)])
def test_a_short_prompt_beside_decodes_is_cut_where_the_floor_is_cheap(stage, kept_whole):
    """A 113-token prompt arriving beside 8 decodes on a calibrated pp=2 pipeline, budget 512. Where a
    step's floor is worth ~10 tokens the prompt is shared out like any other work, so no
    microbatch is long for the other stage to wait behind; where it is worth ~1,000 a chunk below a
    quarter budget balances nothing, and the prompt goes whole."""
    s = make_scheduler("sarathi", token_budget=512, pp=2, num_blocks=500)
    s.cost.reset(PipelineCost((stage, stage)))
    for i in range(8):
        s.add_request(make_request(f"d{i}", 8, max_tokens=50))
    run(s, 6)  # the decodes are under way, in two groups of four
    s.add_request(make_request("late", 113, max_tokens=4))
    formed = run(s, 4)[1]
    chunks = [o.num_scheduled_tokens[o.order.index("late")] for o in formed if "late" in o.order][:2]
    if kept_whole:
        assert chunks[0] == 113
    else:
        assert chunks[0] < 113 and sum(chunks) <= 113
        # The two microbatches in flight together cost the same (kept whole: 12.7 ms next to 1.4 ms).
        first, second = (stage.predict(BatchShape.of(o)) for o in formed[:2])
        assert max(first, second) < 1.2 * min(first, second), (first, second)
