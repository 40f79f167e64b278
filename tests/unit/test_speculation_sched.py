"""Speculative decoding in the scheduler: drafts priced in the budget, verified outcomes applied under the
stop rules, rejected drafts' KV rolled back; output identical to decoding without drafts."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from ppserve.config import SchedulerConfig, SpeculativeConfig
from ppserve.request import Request, SamplingParams
from ppserve.sched import Scheduler, SchedulerOutput, StepResult
from ppserve.sched.proposers import Proposer
from tests.unit.sched_helpers import EOS

VOCAB = 7


def oracle(tokens: Sequence[int]) -> int:
    """A deterministic 'model': the next token is a function of the last two (so outputs repeat and
    prompt lookup finds matches)."""
    return (tokens[-1] * 3 + tokens[-2] * 5 + 1) % VOCAB + 2 if len(tokens) > 1 else 3


def verify(out: SchedulerOutput, s: Scheduler) -> StepResult:
    """The last stage: each sampled request's next token from the oracle; a speculating one keeps the
    longest prefix of its drafts the oracle agrees with, then the oracle's token."""
    sampled: dict[str, int] = {}
    accepted: dict[str, int] = {}
    for rid in out.sample_request_ids:
        req = s.requests[rid]
        seq = req.prompt_token_ids + req.output_token_ids
        drafts = out.draft_token_ids.get(rid, ())
        n = 0
        for d in drafts:
            if oracle(seq) != d:
                break
            seq = [*seq, d]
            n += 1
        sampled[rid] = oracle(seq)
        if drafts:
            accepted[rid] = n
    return StepResult(out.step_id, sampled, num_accepted=accepted)


class OracleChain(Proposer):
    """Drafts the oracle's own continuation, every other proposal with one wrong token: drafts accepted
    in full, in part and not at all."""

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, req: Request, k: int) -> list[int]:
        self.calls += 1
        seq = req.prompt_token_ids + req.output_token_ids
        drafts: list[int] = []
        for _ in range(k):
            drafts.append(oracle([*seq, *drafts]))
        if drafts and self.calls % 2:
            i = self.calls % len(drafts)
            drafts[i] = drafts[i] % VOCAB + 3
        return drafts


def run(s: Scheduler, reqs: list[Request], rng: random.Random, cancel: float = 0.0) -> dict[str, list[int]]:
    for r in reqs:
        s.add_request(r)
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for _ in range(20_000):
        if not s.has_unfinished:
            break
        while (out := s.schedule()) is not None:
            s.check_invariants()
            assert out.total_tokens <= s.budget_mode.token_cap
            if cancel and rng.random() < cancel and out.order:
                s.cancel(rng.choice(out.order))
        done = s.in_flight[0]
        for u in s.update_from_output(done, verify(done, s)):
            outs[u.request_id].extend(u.new_token_ids)
        s.check_invariants()
    assert not s.has_unfinished and s.blocks.num_used == 0
    return outs


def requests(rng: random.Random, n: int, eos: bool) -> list[Request]:
    out = []
    for i in range(n):
        prompt = [rng.randrange(2, 2 + VOCAB) for _ in range(rng.randrange(3, 40))]
        sp = SamplingParams(max_tokens=rng.randrange(1, 60), ignore_eos=not eos)
        out.append(Request(f"r{i}", prompt, sp, eos_token_ids=(EOS,)))
    return out


def scheduler(spec: bool, pp: int, budget: int, blocks: int, ring: bool | None = None,
              proposer: Proposer | None = None, k: int = 4, min_accept: float = 0.15) -> Scheduler:
    cfg = SchedulerConfig(token_budget=budget, max_num_seqs=16, token_ring=ring)
    sc = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                           min_accept_prob=min_accept) if spec else None
    return Scheduler(cfg, blocks, 4, 512, num_stages=pp, speculative=sc, proposer=proposer)


@pytest.mark.parametrize("pp", [1, 2, 3])
@pytest.mark.parametrize("budget,blocks", [(64, 1000), (16, 1000), (64, 40)])
def test_output_identical_with_drafts(pp: int, budget: int, blocks: int) -> None:
    """Every pipeline depth, tight and loose budgets, and a KV cache small enough to preempt: the tokens
    each request gets are the same with drafts as without."""
    for seed in range(4):
        eos = seed % 2 == 0
        ref = run(scheduler(False, pp, budget, blocks), requests(random.Random(seed), 10, eos),
                  random.Random(0))
        for proposer in (None, OracleChain()):  # prompt lookup, and a proposer that is often right
            s = scheduler(True, pp, budget, blocks, proposer=proposer)
            got = run(s, requests(random.Random(seed), 10, eos), random.Random(0))
            assert got == ref
            assert s.spec is not None and s.spec.counters.num_drafts > 0
            if proposer is not None:
                c = s.spec.counters
                assert 0 < c.num_accepted_tokens < c.num_draft_tokens


def test_cancels_while_speculating_lose_nothing() -> None:
    rng = random.Random(5)
    s = scheduler(True, 2, 32, 200, proposer=OracleChain())
    run(s, requests(rng, 12, eos=True), rng, cancel=0.05)  # drained: every block back


class Fixed(Proposer):
    """Always proposes `tokens` (a test's hand-picked drafts)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, req: Request, k: int) -> list[int]:
        return self.tokens[:k]


def test_rejected_drafts_roll_back_kv_and_free_their_blocks() -> None:
    s = scheduler(True, 1, 64, 100, proposer=Fixed([9] * 8), k=8, min_accept=0.01)
    r = Request("a", [3, 4, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True))
    s.add_request(r)
    first = s.schedule()
    assert first is not None and not first.draft_token_ids  # a prompt's chunk: no drafts
    s.update_from_output(first, StepResult(first.step_id, {"a": 7}))
    out = s.schedule()
    assert out is not None
    drafts = out.draft_token_ids["a"]
    assert out.num_scheduled_tokens == (1 + len(drafts),)
    held = len(r.block_ids)
    s.update_from_output(out, StepResult(out.step_id, {"a": 8}, num_accepted={"a": 1}))
    assert r.output_token_ids == [7, 9, 8]
    assert r.num_computed_tokens == r.num_tokens - 1  # the input token and one accepted draft have KV
    assert len(r.block_ids) == -(-r.num_tokens // 4) < held  # the rejected drafts' tail is given back
    nxt = s.schedule()
    assert nxt is not None
    diff = nxt.cached_requests[0]
    assert diff.new_token_ids == (9, 8) and diff.num_blocks_kept == len(r.block_ids) - len(diff.new_block_ids)
    s.check_invariants()


def test_a_stop_token_among_accepted_drafts_ends_the_output_there() -> None:
    s = scheduler(True, 1, 64, 100, proposer=Fixed([5, EOS, 6]), k=3, min_accept=0.01)
    r = Request("a", [3, 4], SamplingParams(max_tokens=20), eos_token_ids=(EOS,))
    s.add_request(r)
    first = s.schedule()
    assert first is not None
    s.update_from_output(first, StepResult(first.step_id, {"a": 4}))
    out = s.schedule()
    assert out is not None and out.draft_token_ids["a"] == (5, EOS, 6)
    (u,) = s.update_from_output(out, StepResult(out.step_id, {"a": 9}, num_accepted={"a": 3}))
    assert u.new_token_ids == (5, EOS) and u.finished
    assert r.output_token_ids == [4, 5, EOS]
    assert s.blocks.num_used == 0


def test_max_tokens_bounds_the_drafts():
    s = scheduler(True, 1, 64, 100, proposer=Fixed([5, 5, 5]), k=3, min_accept=0.01)
    r = Request("a", [3, 4], SamplingParams(max_tokens=3, ignore_eos=True))
    s.add_request(r)
    first = s.schedule()
    assert first is not None
    s.update_from_output(first, StepResult(first.step_id, {"a": 4}))
    out = s.schedule()
    assert out is not None and out.draft_token_ids["a"] == (5,)
    (u,) = s.update_from_output(out, StepResult(out.step_id, {"a": 9}, num_accepted={"a": 1}))
    assert u.new_token_ids == (5, 9) and u.finished and r.output_token_ids == [4, 5, 9]


def test_drafts_take_no_budget_a_prompt_could_use() -> None:
    """Saturated (a prompt waits for the budget): no drafts; the budget is never exceeded."""
    s = scheduler(True, 1, 16, 1000, proposer=Fixed([5] * 8), k=8)
    a = Request("a", [3, 4], SamplingParams(max_tokens=50, ignore_eos=True))
    s.add_request(a)
    out = s.schedule()
    assert out is not None
    s.update_from_output(out, StepResult(out.step_id, {"a": 4}))
    s.add_request(Request("b", list(range(2, 80)), SamplingParams(max_tokens=5)))
    out = s.schedule()
    assert out is not None and not out.draft_token_ids and out.total_tokens == 16
    s.update_from_output(out, StepResult(out.step_id, {"a": 4}))


def test_drafts_follow_acceptance() -> None:
    """A request whose drafts keep failing gets fewer, then none; decode steps bring it back to try."""
    s = scheduler(True, 1, 64, 1000, proposer=Fixed([5] * 8), k=4)
    r = Request("a", [3, 4], SamplingParams(max_tokens=200, ignore_eos=True))
    s.add_request(r)
    sizes = []
    for _ in range(60):
        out = s.schedule()
        assert out is not None
        sizes.append(len(out.draft_token_ids.get("a", ())))
        acc = {"a": 0} if out.draft_token_ids else {}
        s.update_from_output(out, StepResult(out.step_id, {"a": 6}, num_accepted=acc))
    assert sizes[1] >= 2 and 0 in sizes[2:20]
    assert any(n for n in sizes[20:]), "a request that stopped drafting tries again"
    assert sum(sizes[20:]) < sum(sizes[1:20]) + 20


def test_speculating_decodes_leave_the_ring() -> None:
    """pp 2 with the token ring: a request with drafts in flight never rides the ring."""
    s = scheduler(True, 2, 64, 1000, ring=True, proposer=Fixed([5] * 8), k=4)
    r = Request("a", [3, 4], SamplingParams(max_tokens=30, ignore_eos=True))
    s.add_request(r)
    for _ in range(40):
        while (out := s.schedule()) is not None:
            s.check_invariants()
            assert not (set(out.ring_request_ids) & set(out.draft_token_ids))
        if not s.in_flight:
            break
        done = s.in_flight[0]
        s.update_from_output(done, verify(done, s))
    assert s.spec is not None and s.spec.counters.num_drafts > 0


@pytest.mark.parametrize("floor_s,token_s,many", [(0.02, 1e-5, True), (1e-4, 1e-3, False)])
def test_drafts_follow_the_step_cost(floor_s, token_s, many):
    """Where a step costs its floor, a decode gets its full k drafts; where every token costs its share of
    the step, none (a draft would add tokens slower than the step makes them)."""
    from ppserve.sched.cost import PipelineCost, StepCost

    prior = PipelineCost((StepCost(floor_s=floor_s, token_s=token_s),))
    s = Scheduler(SchedulerConfig(token_budget=512, max_num_seqs=64), 1000, 4, 512,
                  speculative=SpeculativeConfig(method="ngram", min_accept_prob=0.05),
                  proposer=Fixed([5] * 8), cost_prior=prior)
    assert s.cost.calibrated
    for i in range(32):
        s.add_request(Request(f"r{i}", [3, 4], SamplingParams(max_tokens=50, ignore_eos=True)))
    out = s.schedule()
    assert out is not None
    s.update_from_output(out, StepResult(out.step_id, {rid: 4 for rid in out.sample_request_ids}))
    out = s.schedule()
    assert out is not None
    sizes = [len(d) for d in out.draft_token_ids.values()]
    if many:
        assert sizes and min(sizes) == 4 and len(sizes) == 32
    else:
        assert not sizes


def test_not_adaptive_drafts_k_whatever_the_acceptance():
    cfg = SchedulerConfig(token_budget=64, max_num_seqs=16)
    s = Scheduler(cfg, 1000, 4, 512, speculative=SpeculativeConfig(method="ngram", adaptive=False),
                  proposer=Fixed([5] * 8))
    s.add_request(Request("a", [3, 4], SamplingParams(max_tokens=200, ignore_eos=True)))
    sizes = []
    for _ in range(12):
        out = s.schedule()
        assert out is not None
        sizes.append(len(out.draft_token_ids.get("a", ())))
        acc = {"a": 0} if out.draft_token_ids else {}
        s.update_from_output(out, StepResult(out.step_id, {"a": 6}, num_accepted=acc))
    assert sizes[1:] == [4] * 11


def test_no_draft_past_the_last_token_a_request_may_get():
    """max_tokens and the context bound the drafts: every draft accepted ends the request exactly there."""
    cfg = SchedulerConfig(token_budget=64, max_num_seqs=16)
    s = Scheduler(cfg, 1000, 4, 12, speculative=SpeculativeConfig(method="ngram", adaptive=False,
                                                                  num_speculative_tokens=8),
                  proposer=Fixed([5] * 8))
    a = Request("a", [3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
    b = Request("b", [3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=None, ignore_eos=True))
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert out is not None
    s.update_from_output(out, StepResult(out.step_id, {"a": 6, "b": 6}))
    out = s.schedule()
    assert out is not None
    assert len(out.draft_token_ids["a"]) == 2  # 1 output, at most 3 more: the step's token and 2 drafts
    assert len(out.draft_token_ids["b"]) == 3  # 8 tokens of a context of 12: at most 4 more
    updates = s.update_from_output(out, StepResult(out.step_id, {"a": 6, "b": 6},
                                                   num_accepted={"a": 2, "b": 3}))
    assert all(u.finished for u in updates) and len(a.output_token_ids) == 4 and b.num_tokens == 12


def test_drafts_stop_where_their_measured_cost_is_high():
    """The step cost says drafts are cheap; the stage times say each costs as much as a whole step: the
    scheduler learns it from the speculated microbatches and stops drafting, though every draft is
    accepted."""
    from ppserve.sched.cost import PipelineCost, StepCost

    prior = PipelineCost((StepCost(floor_s=0.01, token_s=1e-5),))
    s = Scheduler(SchedulerConfig(token_budget=512, max_num_seqs=64), 1000, 4, 512,
                  speculative=SpeculativeConfig(method="ngram"), proposer=Fixed([5] * 8), cost_prior=prior)
    for i in range(8):
        s.add_request(Request(f"r{i}", [3, 4], SamplingParams(max_tokens=100, ignore_eos=True)))
    sizes = []
    for _ in range(12):
        out = s.schedule()
        assert out is not None
        sizes.append(out.num_draft_tokens)
        result = StepResult(out.step_id, {rid: 4 for rid in out.sample_request_ids},
                            num_accepted={rid: len(d) for rid, d in out.draft_token_ids.items()},
                            stage_seconds=(0.01 + 0.01 * out.num_draft_tokens,), timed_step_id=out.step_id)
        s.step_done(out, result, timed=out)
    assert sizes[1] > 0 and sizes[-1] == 0
    assert s.spec is not None and s.spec.draft_cost_s is not None and s.spec.draft_cost_s > 0.005
