"""Routing: the policies of ppserve/route on their own, and N simulated replicas behind them
(ppserve/sim/replicas.py) on multi-turn conversations (ppserve/sim/conversations.py) and in the planner."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict

import pytest

from ppserve.config import SchedulerConfig
from ppserve.metrics.capacity import SLO
from ppserve.plan import inputs
from ppserve.plan.search import PlanContext, is_routed, probe, routing_note
from ppserve.plan.space import Cluster, Deployment
from ppserve.request import Request, SamplingParams
from ppserve.route import PowerOfTwo, PrefixAffinity, RoundRobin, make_policy, prefix_keys
from ppserve.sched.block_manager import BlockManager
from ppserve.sim import ConstantCostModel, SimConfig, WorkloadRequest, load_hardware, simulate
from ppserve.sim.conversations import (
    USER_TOKEN_BASE,
    ConversationArrivals,
    ConversationSpec,
    conversation_requests,
)
from ppserve.sim.replicas import RoutedResult, has_prefix_content, simulate_replicas
from ppserve.sim.slo_watch import SloStop
from ppserve.sim.workload import (
    clip_to_context,
    multi_turn,
    shared_prefix,
    uniform_lengths,
    with_poisson_arrivals,
)

K = [bytes([i]) * 32 for i in range(8)]  # stand-in block keys


# ---- the policies ------------------------------------------------------------------------------------


def test_round_robin_cycles_through_the_replicas_in_name_order():
    rr = RoundRobin()
    loads = {"b": 5.0, "a": 0.0, "c": 1.0}
    assert [rr.choose([], loads) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_power_of_two_picks_the_less_loaded_of_the_two_it_draws():
    p2 = PowerOfTwo(seed=3)
    assert all(p2.choose([], {"a": 4.0, "b": 1.0}) == "b" for _ in range(20))  # two replicas: both drawn
    picks = Counter(p2.choose([], {"a": 0.0, "b": 5.0, "c": 9.0}) for _ in range(300))
    assert picks["c"] == 0 and picks["a"] > picks["b"] > 0  # the most loaded never wins a pair


def test_prefix_affinity_follows_the_deepest_known_key():
    pa = PrefixAffinity()
    loads = {"r0": 0.0, "r1": 0.0, "r2": 0.0}
    pa.record(K[:2], "r0")
    pa.record(K[:4], "r1")  # a longer prompt with the same start went to r1 later
    assert pa.choose(K[:5], loads) == "r1"
    assert pa.choose(K[:3], loads) == "r1"  # K[2]'s owner is r1 now
    pa.record([K[0], K[6]], "r2")
    assert pa.choose([K[0], K[6], K[7]], loads) == "r2"
    assert pa.num_affine == 3


def test_prefix_affinity_passes_over_an_overloaded_owner():
    pa = PrefixAffinity(abs_slack=2, rel_slack=1.5)
    pa.record(K[:3], "r0")
    assert pa.choose(K[:3], {"r0": 3.0, "r1": 1.0}) == "r0"  # 2 over the least: within the slack
    assert pa.choose(K[:3], {"r0": 10.0, "r1": 1.0}) == "r1"  # beyond both slacks: power of two
    assert pa.num_overloaded == 1
    assert pa.choose(K[:3], {"r0": 10.0, "r1": 8.0}) == "r0"  # 2 over, 1.25x: within the relative slack


def test_forget_drops_a_replica_and_unknown_prefixes_fall_back_to_load():
    pa = PrefixAffinity()
    pa.record(K[:3], "r0")
    pa.forget("r0")
    assert pa.owner(K[:3], {"r0": 0.0, "r1": 0.0}) is None
    assert pa.choose(K[:3], {"r0": 3.0, "r1": 0.0}) == "r1"
    pa.record(K[:3], "r2")
    assert pa.choose(K[:3], {"r0": 0.0, "r1": 0.0}) in ("r0", "r1")  # r2 is gone from the loads
    with pytest.raises(ValueError, match="no replica"):
        pa.choose(K[:1], {})
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def test_prefix_keys_are_the_block_managers_and_a_salt_separates_them():
    tokens = list(range(100, 139))  # 9 full blocks of 4 and 3 tokens over
    for salt in (None, "tenant-a"):
        bm = BlockManager(64, 4)
        req = Request("q", tokens, SamplingParams(max_tokens=1), cache_salt=salt)
        bm.allocate(req, len(tokens))
        bm.cache_full_blocks(req, len(tokens))
        assert prefix_keys(tokens, 4, salt) == req.block_keys and len(req.block_keys) == 9
    assert prefix_keys(tokens, 4, max_blocks=3) == prefix_keys(tokens, 4)[:3]
    assert set(prefix_keys(tokens, 4, "a")).isdisjoint(prefix_keys(tokens, 4, "b"))
    assert prefix_keys(tokens[:3], 4) == []
    with pytest.raises(ValueError):
        prefix_keys(tokens, 0)


# ---- N replicas behind the router --------------------------------------------------------------------


def _cfg(**kw) -> SimConfig:
    return SimConfig(SchedulerConfig(token_budget=128), num_blocks=4000, block_size=16, **kw)


@pytest.mark.parametrize("case", ["plain", "shared-prefix", "stopped"])
def test_one_replica_behind_the_router_is_simulate_bit_for_bit(case):
    cost = ConstantCostModel(2, 0.004, 0.0005)
    if case == "shared-prefix":
        work = with_poisson_arrivals(shared_prefix(3, 12, 100, 20, 12), 30.0, seed=1)
        cfg = _cfg(schedule_overhead_s=3e-4, dispatch_latency_s=2e-4)
    else:
        work = with_poisson_arrivals(uniform_lengths(80, (20, 300), (4, 40), seed=2), 40.0, seed=2)
        cfg = _cfg(stop_on_slo_fail=SloStop(0.006, 0.1) if case == "stopped" else None)
    alone = simulate(work, cost, cfg)
    routed = simulate_replicas(work, cost, cfg, replicas=1, policy="prefix")
    one = routed.replicas["replica-0"]
    assert one.spans == alone.spans and one.timings == alone.timings
    assert one.work_intervals == alone.work_intervals and one.end_s == alone.end_s
    assert (one.stopped_early, routed.stopped_early) == (alone.stopped_early, alone.stopped_early)
    assert (case == "stopped") == (alone.stopped_early is not None)
    assert routed.merged().timings == alone.timings
    assert routed.prefix_hit_rate == alone.prefix_hit_rate


def _rows(n: int = 60, seed: int = 0) -> list[WorkloadRequest]:
    return uniform_lengths(n, (40, 120), (8, 24), seed=seed)


def _conversation_of(w: WorkloadRequest) -> int:
    assert w.content is not None
    return next(t for t, _ in w.content if t >= USER_TOKEN_BASE) - USER_TOKEN_BASE


def _turns(arrivals: ConversationArrivals, res: RoutedResult) -> dict[int, list[str]]:
    """Each conversation's requests in order, from the prompts the run admitted."""
    convs: dict[int, list[str]] = defaultdict(list)
    for rid in sorted(res.routed, key=lambda r: int(r[1:])):
        convs[arrivals.conversation[rid]].append(rid)
    return convs


class _Recorded(ConversationArrivals):
    """ConversationArrivals that remembers each request's conversation (the test's view only)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.conversation: dict[str, int] = {}
        self.requests: dict[str, WorkloadRequest] = {}

    def request(self, i, finished_ns):
        k, w = super().request(i, finished_ns)
        self.conversation[f"r{k}"] = _conversation_of(w)
        self.requests[f"r{k}"] = w
        return k, w


def test_conversations_stick_to_the_replica_of_their_first_turn_under_prefix_routing():
    # Spaced multi-turn chats (every answer back before the next turn): loads stay balanced.
    work = multi_turn(6, 4, 32, 16, 8, gap_s=2.0)
    res = simulate_replicas(work, ConstantCostModel(2, 0.002), _cfg(), replicas=3, policy="prefix")
    by_conv = defaultdict(set)
    for k, w in enumerate(work):
        by_conv[w.prefix_id].add(res.routed[f"r{k}"])
    assert all(len(r) == 1 for r in by_conv.values())
    assert len(set().union(*by_conv.values())) > 1  # first turns spread by load
    # The same on the conversation workload, whose turns are chosen as the run goes.
    arr = _Recorded(_rows(), 60, 6.0, ConversationSpec(mean_turns=4, think_s=0.5), 2048)
    res = simulate_replicas(arr, ConstantCostModel(2, 0.002), _cfg(), replicas=2, policy="prefix")
    convs = _turns(arr, res)
    assert arr.num_continued > 20
    assert all(len({res.routed[r] for r in rids}) == 1 for rids in convs.values())
    assert res.policy_stats["num_affine"] == arr.num_continued


def test_a_turn_re_sends_its_history_and_waits_for_the_answer_it_follows():
    spec = ConversationSpec(mean_turns=3, think_s=0.25, num_system_prompts=2, system_len=48)
    arr = _Recorded(_rows(), 60, 8.0, spec, 2048)
    res = simulate_replicas(arr, ConstantCostModel(2, 0.002), _cfg(), replicas=2, policy="round-robin")
    finished = {rid: ns for r in res.replicas.values() for rid, ns in zip(
        r.timings, [round(t.token_times_s[-1] * 1e9) for t in r.timings.values()], strict=True)}
    for rids in _turns(arr, res).values():
        for prev, nxt in zip(rids, rids[1:], strict=False):
            a, b = arr.requests[prev], arr.requests[nxt]
            assert b.content[:len(a.content)] == a.content  # the previous prompt, then its answer
            assert b.content[len(a.content)][1] == a.output_len
            assert b.arrival_s * 1e9 >= finished[prev] + 0.25e9 - 1
    systems = {arr.requests[rids[0]].content[0] for rids in _turns(arr, res).values()}
    assert len(systems) == 2 and all(n == 48 for _, n in systems)


def test_prefix_aware_routing_hits_the_cache_more_than_round_robin():
    rates = {}
    for policy in ("prefix", "round-robin", "power-of-two"):
        arr = ConversationArrivals(_rows(80, seed=1), 120, 12.0, ConversationSpec(think_s=0.2), 2048)
        res = simulate_replicas(arr, ConstantCostModel(2, 0.002), _cfg(), replicas=3, policy=policy)
        rates[policy] = res.prefix_hit_rate
        assert res.merged().num_finished == 120
    assert rates["prefix"] > rates["round-robin"] + 0.1
    assert rates["prefix"] > rates["power-of-two"] + 0.1


def test_round_robin_spreads_requests_evenly_in_arrival_order():
    work = with_poisson_arrivals(uniform_lengths(40, (20, 60), (4, 8), seed=4), 50.0, seed=4)
    res = simulate_replicas(work, ConstantCostModel(1, 0.002), _cfg(), replicas=4, policy="round-robin")
    assert res.requests_per_replica() == dict.fromkeys(res.replicas, 10)
    order = sorted(range(40), key=lambda k: (work[k].arrival_s, k))
    names = sorted(res.replicas)
    assert [res.routed[f"r{k}"] for k in order] == [names[i % 4] for i in range(40)]


def test_loads_are_the_routed_unfinished_requests_at_the_arrival():
    seen = []

    class Spy(RoundRobin):
        def choose(self, keys, loads):
            seen.append(dict(loads))
            return super().choose(keys, loads)

    # One stage, 10 ms a step whatever it holds: request k (arriving at 20 k ms, alternately on each
    # replica) samples its 5 tokens in 5 steps and finishes 50 ms after it arrives. So at each arrival
    # from the third on, exactly the two requests before it are unfinished; the one before them is done.
    work = [WorkloadRequest(0.02 * k, 4, 5) for k in range(6)]
    simulate_replicas(work, ConstantCostModel(1, 0.01), _cfg(), replicas=2, policy=Spy())
    assert [sum(x.values()) for x in seen] == [0, 1, 2, 2, 2, 2]


def test_a_failing_replica_raises_and_leaves_no_thread_behind():
    class Broken(ConstantCostModel):
        calls = 0

        def stage_time(self, stage, shape):
            Broken.calls += 1
            if Broken.calls > 30:
                raise RuntimeError("stage died")
            return self.step_s

    before = threading.active_count()
    work = with_poisson_arrivals(uniform_lengths(40, (20, 60), (4, 8)), 20.0)
    with pytest.raises(RuntimeError, match="stage died"):
        simulate_replicas(work, Broken(1, 0.002), _cfg(), replicas=3)
    assert threading.active_count() == before


def test_run_length_prompts_validate_and_clip():
    w = WorkloadRequest(0.0, 10, 4, content=((1, 6), (2, 4)))
    assert has_prefix_content([w]) and not has_prefix_content(uniform_lengths(3, (5, 9), (1, 2)))
    assert clip_to_context([w], 8)[0].content == ((1, 6), (2, 1))
    with pytest.raises(ValueError):
        WorkloadRequest(0.0, 9, 4, content=((1, 6), (2, 4)))
    with pytest.raises(ValueError):
        WorkloadRequest(0.0, 10, 4, prefix_id=1, content=((1, 10),))
    turns = conversation_requests(_rows(30), ConversationSpec(mean_turns=3), 256)
    assert all(t.prompt_len + t.output_len <= 256 for t in turns)
    assert any(t.prompt_len > 150 for t in turns)  # later turns carry their history


# ---- the planner ----------------------------------------------------------------------------------------


def test_the_planner_probes_conversations_behind_its_router():
    model, _ = inputs.model_spec("llama3-8b")
    clu = Cluster(load_hardware("h100"), 2, 1)
    _, pool, desc = inputs.workload(inputs.CONVERSATIONS, 100, model.max_model_len)
    assert "conversations" in desc
    d = Deployment(1, 1, 2, "sarathi", 512, 64, (model.num_layers,), num_blocks=20000)
    ctx = PlanContext(model, clu, tuple(pool[:200]), SLO(0.1), duration_s=8.0, min_requests=10,
                      conversations=inputs.conversation_spec(inputs.CONVERSATIONS))
    assert is_routed(ctx, d) and "prefix" in routing_note(ctx)
    p = probe(ctx, d, 2.0)
    assert p.extra["routing"] == "prefix" and sum(p.extra["requests_per_replica"]) == 16
    assert p.extra["prefix_hit_rate"] is not None
    plain = PlanContext(model, clu, tuple(uniform_lengths(20, (50, 60), (4, 8))), SLO(0.1))
    assert not is_routed(plain, d) and "not simulated" in routing_note(plain)
