"""Cost-model budgets: the online step-cost fit, time budgets, the TBT-target controller. No torch."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from ppserve.config import SchedulerConfig
from ppserve.sched import StepResult
from ppserve.sched.budget import (
    AdaptiveTokenBudget,
    FixedTokenBudget,
    TimeBudget,
    TimeBudgetMode,
    TokenBudget,
    make_budget_mode,
)
from ppserve.sched.cost import (
    DECODE_ONLY_WEIGHT,
    BatchShape,
    LayerCosts,
    OnlinePipelineCost,
    PipelineCost,
    StepCost,
    StepCostFit,
    WorkFeatures,
    features,
    fit_layer_costs,
    solve_linear,
    solve_nonnegative,
)
from ppserve.sim import SimConfig, WorkloadRequest, simulate
from tests.unit.sched_helpers import assert_drained, drive, make_request, make_scheduler, random_scheduler

# floor, per token, per prefill key, per decode key, per sampled token
TRUE = StepCost(2e-3, 40e-6, 3e-9, 20e-9, 0.0)
LAST = StepCost(2.5e-3, 40e-6, 3e-9, 20e-9, 150e-6)  # the last stage: the LM head per sampled token
PIPE = PipelineCost((TRUE, LAST))


def true_time(chunks) -> float:
    return TRUE.predict(BatchShape(tuple(chunks), 0))


def random_shape(rng: random.Random) -> BatchShape:
    chunks = [(1, rng.randint(0, 4000)) for _ in range(rng.randint(0, 40))]
    if rng.random() < 0.8:
        chunks.append((rng.randint(2, 512), rng.randint(0, 3500)))
    chunks = chunks or [(1, 10)]
    decodes = sum(1 for n, _ in chunks if n == 1)
    return BatchShape(tuple(chunks), decodes + (rng.random() < 0.5))


def assert_close(got: StepCost, want: StepCost) -> None:
    """Coefficient by coefficient; the sampled-token one absolutely (it is nearly collinear with the
    decodes, so the weak ridge shares a little of it with them)."""
    assert got.coefficients[:4] == pytest.approx(want.coefficients[:4], rel=1e-2)
    assert got.sample_s == pytest.approx(want.sample_s, abs=1e-6)


def calibrated(n: int = 200, seed: int = 0) -> OnlinePipelineCost:
    cost = OnlinePipelineCost(2, forgetting=1.0)
    rng = random.Random(seed)
    for _ in range(n):
        shape = random_shape(rng)
        cost.observe(shape, PIPE.stage_times(shape))
    return cost


def test_online_fit_recovers_every_stage_coefficients():
    cost = calibrated()
    assert cost.calibrated
    for fit, true in zip(cost.fits, PIPE.stages, strict=True):
        assert_close(fit.cost, true)
        assert fit.rms_residual() < 1e-6
    shape = BatchShape(((300, 1000), (1, 50), (1, 3000)), 3)
    assert cost.current.stage_times(shape) == pytest.approx(PIPE.stage_times(shape), rel=1e-4)
    # the head's stage is slowest
    assert cost.current.pace(shape) == pytest.approx(LAST.predict(shape), rel=1e-4)


def test_online_fit_follows_drift_and_ignores_garbage():
    fit = StepCostFit(forgetting=0.95)
    rng = random.Random(1)
    for scale in (1.0, 2.0):  # then the hardware got twice as slow
        for _ in range(400):
            shape = random_shape(rng)
            fit.observe(features(shape.chunks, shape.num_sampled), scale * TRUE.predict(shape))
    fit.observe(features([(10, 0)], 1), float("nan"))
    fit.observe(features([(10, 0)], 1), -1.0)
    assert_close(fit.cost, TRUE.times(2.0))


def test_fit_with_identical_microbatches_stays_finite():
    fit = StepCostFit()
    for _ in range(50):
        fit.observe(features([(64, 0)], 1), 0.01)
    assert fit.cost.predict(BatchShape(((64, 0),), 1)) == pytest.approx(0.01, rel=1e-3)
    assert all(x >= 0 for x in fit.cost.coefficients)


def _brute_force_nonnegative(a, b):
    """The constrained optimum by trying every support: its free part solves the sub-system."""
    import itertools

    n, best = len(b), None
    for r in range(n + 1):
        for support in itertools.combinations(range(n), r):
            x = [0.0] * n
            if support:
                sub = solve_linear([[a[i][j] for j in support] for i in support], [b[i] for i in support])
                if sub is None or min(sub) < 0:
                    continue
                for i, v in zip(support, sub, strict=True):
                    x[i] = v
            value = (sum(x[i] * a[i][j] * x[j] for i in range(n) for j in range(n)) / 2
                     - sum(bi * xi for bi, xi in zip(b, x, strict=True)))
            if best is None or value < best[0] - 1e-15:
                best = (value, x)
    assert best is not None
    return best[1]


def _random_normal_equations(rng: random.Random) -> tuple[list[list[float]], list[float]]:
    """The normal equations (XtX, Xty) of a random least-squares problem of 1-5 unknowns."""
    n, m = rng.randint(1, 5), rng.randint(5, 9)
    rows = [[rng.gauss(0, 1) for _ in range(n)] for _ in range(m)]
    ys = [rng.gauss(0, 1) for _ in range(m)]
    a = [[sum(r[i] * r[j] for r in rows) + (1e-9 if i == j else 0.0) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    return a, b


def test_solve_nonnegative_finds_the_constrained_least_squares_optimum():
    rng = random.Random(5)
    for _ in range(300):
        a, b = _random_normal_equations(rng)
        x = solve_nonnegative(a, b)
        assert x is not None and min(x) >= 0
        assert x == pytest.approx(_brute_force_nonnegative(a, b), abs=1e-7)


def test_solve_nonnegative_with_any_free_hint_gives_the_same_optimum():
    """A hint (the free set of a previous solution) is a shortcut, never a different answer: the right
    set returns the optimum after one solve, a wrong one falls back to the run from zero."""
    from unittest import mock

    import ppserve.sched.cost as cost_mod

    rng = random.Random(7)
    shortcuts = 0
    for _ in range(200):
        a, b = _random_normal_equations(rng)
        n = len(b)
        x = solve_nonnegative(a, b)
        assert x is not None
        right = [v > 0 for v in x]
        wrong = [rng.random() < 0.5 for _ in range(n)]
        for hint in (right, wrong, [True] * n, [False] * n):
            with mock.patch.object(cost_mod, "solve_linear", wraps=cost_mod.solve_linear) as solves:
                got = solve_nonnegative(a, b, hint)
            assert got == pytest.approx(x, abs=1e-9)
            if hint is right and any(right):
                assert solves.call_count == 1  # the hinted set was the optimum: one solve
                shortcuts += 1
    assert shortcuts > 100


def test_a_fit_that_would_go_negative_refits_the_others_instead_of_clamping():
    """Noise sends the token column (nearly collinear with prefill keys over chunks at one context) below
    zero: the fit sets it to zero and refits the keys, where clamping left the keys' overshoot standing."""
    fit = StepCostFit(forgetting=1.0, min_samples=1, refit_every=1)
    samples = [([(32, 33)], 0.040), ([(64, 33)], 0.050), ([(48, 33)], 0.047), ([(1, 33)], 0.030)]
    for chunks, seconds in samples:
        fit.observe(features(chunks, 1), seconds)
    free = solve_linear(*fit.normal_equations())
    assert free is not None and min(free) < 0  # the unconstrained fit has a negative coefficient
    cost = fit.cost
    assert min(cost.coefficients) >= 0
    clamped = StepCost.of([w / s for w, s in zip(free, StepCostFit._SCALE, strict=True)])
    sse = [sum((c.of_features(features(ch, 1)) - y) ** 2 for ch, y in samples) for c in (cost, clamped)]
    assert sse[0] < sse[1]


def test_prior_is_used_until_data_overrules_it_and_stage_counts_must_match():
    cost = OnlinePipelineCost(2, PipelineCost((LAST, LAST)))
    assert cost.calibrated and cost.current.stages == (LAST, LAST)  # a prior predicts from the start
    rng = random.Random(3)
    for _ in range(100):
        shape = random_shape(rng)
        cost.observe(shape, PIPE.stage_times(shape))
        cost.observe(shape, (1.0,))  # measured on another pipeline: ignored
    assert_close(cost.fits[0].cost, TRUE)
    cost.reset(None)
    assert not cost.calibrated
    with pytest.raises(ValueError, match="stages"):
        OnlinePipelineCost(3, PIPE)
    with pytest.raises(ValueError, match=">= 0"):
        StepCost(floor_s=-1.0)


def test_max_tokens_is_the_largest_fitting_chunk():
    rng = random.Random(2)
    for _ in range(200):
        secs, ctx, limit = rng.uniform(0, 0.05), rng.randint(0, 4000), rng.randint(1, 2000)
        n = TRUE.max_tokens(secs, ctx, limit)
        brute = max([k for k in range(0, limit + 1) if k == 0 or TRUE.chunk_s(k, ctx, False) <= secs])
        assert n == brute, (secs, ctx, limit)


def test_layer_costs_round_trip_through_a_pipeline_split():
    layers = LayerCosts(StepCost(1e-4, 2e-6, 1e-10, 5e-10), StepCost(3e-4, 0.0, 0.0, 0.0, 4e-5))
    ranges = [(0, 12), (12, 22), (22, 30)]
    pipe = layers.pipeline(ranges)
    assert pipe.stages[0] == layers.layer.times(12)
    assert pipe.stages[2].coefficients == pytest.approx(layers.layer.times(8).plus(layers.head).coefficients)
    back = fit_layer_costs(pipe, ranges)
    assert back.layer.coefficients == pytest.approx(layers.layer.coefficients)
    assert back.head.coefficients == pytest.approx(layers.head.coefficients, abs=1e-15)
    assert LayerCosts.from_json(back.to_json()) == back
    with pytest.raises(ValueError):
        fit_layer_costs(PipelineCost((TRUE,)), [(0, 30)])


def test_time_budget_grants_fewer_tokens_to_long_context_chunks_on_the_slowest_stage():
    time_s = PIPE.pace(BatchShape(((512, 0),), 0))
    short = TimeBudget(4096, None, PIPE, time_s).chunk(4000, context=0)
    long = TimeBudget(4096, None, PIPE, time_s).chunk(4000, context=3000)
    assert short == 512  # the last stage (higher floor) is the one that limits
    assert 0 < long < short
    b = TimeBudget(4096, None, PIPE, time_s)
    b.spend(b.chunk(4000, context=3000), context=3000)
    assert b.time_used_s == pytest.approx(time_s, rel=0.02) and b.time_used_s <= time_s + 1e-12
    assert b.stage_used_s[1] == b.time_used_s > b.stage_used_s[0]
    # A chunk that ends its prompt samples: the head's cost counts, so one token less fits.
    assert TimeBudget(4096, None, PIPE, time_s).chunk(512, context=0) == 511
    # ... unless the rest it would leave is under min_rest: then it takes the rest within the tokens.
    assert TimeBudget(4096, None, PIPE, time_s, min_rest=8).chunk(512, context=0) == 512
    # A request the time leaves out entirely leaves no rest: a short prompt waits whole, however short.
    full = TimeBudget(4096, None, PIPE, time_s, min_rest=32)
    full.spend(512, context=0)
    assert full.num_seqs == 1 and full.chunk(24, context=0) == 0
    # The token cap stays a hard cap; an empty microbatch always gets one token.
    assert TimeBudget(100, None, PIPE, time_s).chunk(4000, context=0) == 100
    assert TimeBudget(100, None, PIPE, 1e-9).chunk(4000, context=0) == 1
    assert not TimeBudget(100, 1, PIPE, time_s).can_fit(200)


def test_even_chunks_cut_a_prompt_into_equal_chunks_at_most_a_token_over_the_grant():
    """`even_chunks`: a prompt that does not fit whole takes the rest divided by the chunks the grant
    needs."""
    time_s = PIPE.pace(BatchShape(((100, 0),), 0))
    grant = TimeBudget(4096, None, PIPE, time_s).chunk(4000, context=0)
    assert 90 < grant <= 100

    def even(wanted: int) -> int:
        return TimeBudget(4096, None, PIPE, time_s, min_rest=8, even_chunks=True).chunk(wanted, context=0)

    assert even(250) == -(-250 // 3) == 84  # 84 + 83 + 83, not grant + grant + the rest
    assert even(grant + 20) == -(-(grant + 20) // 2)  # a rest a little over the grant: two halves
    assert even(2 * grant + 2) == grant + 1  # two grants and a token each: two chunks, not three
    # a share that lets no rest past it
    tight = TimeBudget(4096, None, PIPE, time_s, min_rest=1, even_chunks=True)
    # ... gets no token over the grant
    assert tight.chunk(2 * grant + 2, context=0) == -(-(2 * grant + 2) // 3)
    assert even(grant + 5) == grant + 5  # a rest under min_rest is still taken whole
    assert even(grant) == grant and even(30) == 30  # what fits is taken whole
    for wanted in range(1, 1200, 7):  # at most a token over the grant, and the chunks it implies are level
        n, plain = even(wanted), TimeBudget(4096, None, PIPE, time_s, min_rest=8).chunk(wanted, context=0)
        assert n == plain or (n <= plain + 1 and -(-wanted // n) == -(-wanted // (plain + 1)))


def test_a_decode_is_priced_by_the_fast_path_exactly_as_by_the_general_chunk():
    """`decode_fits` / `spend_decode` (the decode path of `BatchBuilder.add_decodes`) give what
    `chunk(1, ctx) == 1` / `spend(1, ctx, sampled=True)` give, float for float: seats, the token cap, an
    empty microbatch's one token, every stage's time, at and around the edge, a budget below the floor too."""
    rng = random.Random(7)
    for _ in range(3000):
        stages = tuple(StepCost(rng.uniform(0, 3e-3), rng.uniform(0, 60e-6), rng.uniform(0, 4e-9),
                                rng.choice([0.0, rng.uniform(0, 30e-9)]),
                                rng.choice([0.0, rng.uniform(0, 2e-4)]))
                       for _ in range(rng.randint(1, 4)))
        pipe = PipelineCost(stages)
        fast = TimeBudget(rng.choice([None, rng.randint(1, 40)]), rng.choice([None, rng.randint(1, 12)]),
                          pipe, pipe.floor_s + rng.uniform(-1e-4, 3e-3), min_rest=rng.choice([0, 8]))
        slow = TimeBudget(fast.token_budget, fast.max_seqs, pipe, fast.time_budget_s, min_rest=fast.min_rest)
        for _ in range(rng.randint(0, 3)):  # a prefill chunk first, sometimes
            n = rng.randint(2, 64)
            if slow.can_fit(n):
                slow.spend(n, 100)
                fast.spend(n, 100)
        for _ in range(50):
            ctx = rng.choice([0, rng.randint(0, 8000)])
            fits = slow.chunk(1, ctx) == 1
            assert fast.decode_fits(ctx) == fits
            if not fits:
                break
            slow.spend(1, ctx, sampled=True)
            fast.spend_decode(ctx)
            assert (fast.tokens_used, fast.num_seqs, fast.stage_used_s) == (slow.tokens_used, slow.num_seqs,
                                                                            slow.stage_used_s)


def test_summed_work_features_merge_exactly():
    rng = random.Random(3)
    one, parts = WorkFeatures(), [WorkFeatures() for _ in range(5)]
    for _ in range(400):
        n, ctx, sampled = rng.choice([1, rng.randint(2, 2048)]), rng.randint(0, 100_000), rng.random() < 0.5
        one.add(n, ctx, sampled)
        rng.choice(parts).add(n, ctx, sampled)
    merged = WorkFeatures()
    for part in parts:
        merged.merge(part)
    fields = ("tokens", "prefill_keys", "decode_keys", "sampled")
    assert [getattr(merged, f) for f in fields] == [getattr(one, f) for f in fields]


def test_work_features_plus_copies_and_leaves_the_sum_alone():
    base = WorkFeatures()
    for ctx in (5, 900, 31):
        base.add(1, ctx, True)
    before = (base.tokens, base.prefill_keys, base.decode_keys, base.sampled)
    added = WorkFeatures()
    added.merge(base)
    added.add(48, 0, False)
    plus = base.plus(48, 0, False)
    fields = ("tokens", "prefill_keys", "decode_keys", "sampled")
    assert [getattr(plus, f) for f in fields] == [getattr(added, f) for f in fields]
    assert (base.tokens, base.prefill_keys, base.decode_keys, base.sampled) == before
    assert plus.tokens == 51 and plus.sampled == 3


def test_a_pipeline_fit_equals_one_fit_per_stage_fed_alone():
    """`OnlinePipelineCost` forms the scaled features once for all stages: the same sums as each
    stage's `StepCostFit.observe`, a decode-only microbatch weighed `DECODE_ONLY_WEIGHT`."""
    rng = random.Random(5)
    pipe = OnlinePipelineCost(2, forgetting=0.99)
    alone = [StepCostFit(forgetting=0.99), StepCostFit(forgetting=0.99)]
    for _ in range(300):
        shape = random_shape(rng)
        times = PIPE.stage_times(shape)
        pipe.observe(shape, times)
        weight = 1.0 if any(n > 1 for n, _ in shape.chunks) else DECODE_ONLY_WEIGHT
        for fit, t in zip(alone, times, strict=True):
            fit.observe(features(shape.chunks, shape.num_sampled), t, weight)
    assert [f.cost for f in pipe.fits] == [f.cost for f in alone]
    assert [f.normal_equations() for f in pipe.fits] == [f.normal_equations() for f in alone]


def test_time_mode_counts_tokens_until_calibrated():
    cost = OnlinePipelineCost(2, min_samples=8)
    mode = TimeBudgetMode(64, 1e-9, cost)
    assert type(mode.new_budget(64, 3)) is TokenBudget
    rng = random.Random(4)
    for _ in range(8):
        shape = random_shape(rng)
        cost.observe(shape, PIPE.stage_times(shape))
    b = mode.new_budget(64, 3)
    assert isinstance(b, TimeBudget) and b.chunk(10) == 1  # 1e-9 s: only the one token an empty batch gets


def test_budget_modes_from_config():
    assert isinstance(make_budget_mode(SchedulerConfig()), FixedTokenBudget)
    assert isinstance(make_budget_mode(SchedulerConfig(budget_mode="time")), TimeBudgetMode)
    ad = make_budget_mode(SchedulerConfig(tbt_slo_ms=100, max_num_seqs=64), num_stages=4)
    assert isinstance(ad, AdaptiveTokenBudget) and ad.min_budget == 16 and ad.token_budget == 512
    for bad in (dict(budget_mode="flops"), dict(time_budget_ms=5.0),
                dict(budget_mode="time", time_budget_ms=-1.0), dict(tbt_slo_ms=0.0),
                dict(tbt_slo_ms=50.0, budget_mode="time"),
                dict(tbt_slo_ms=50.0, token_budget=1024, max_token_budget=512)):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)


def test_default_mode_ignores_feedback():
    s = make_scheduler("sarathi", token_budget=8)
    s.add_request(make_request("a", 20))
    out = s.schedule()
    assert not s.needs_step_feedback
    s.update_from_output(out, StepResult(out.step_id, {}))
    s.observe_step(out, (0.1,))
    assert s.budget_mode.token_budget == 8


def test_step_chunks_use_context_before_the_step():
    s = make_scheduler("sarathi", token_budget=8)
    s.add_request(make_request("a", 20))
    o1 = s.schedule()
    s.update_from_output(o1, StepResult(o1.step_id, {}))
    o2 = s.schedule()
    assert o1.chunks() == [(8, 0)] and o2.chunks() == [(8, 8)]
    assert BatchShape.of(o2).chunks == ((8, 8),)


@pytest.mark.parametrize("mode", ["time", "tbt"])
@pytest.mark.parametrize("pp", [1, 3])
def test_random_traces_hold_invariants_with_new_modes(mode, pp):
    for seed in range(4):
        rng = random.Random(seed * 17 + pp)
        kw = dict(budget_mode="time") if mode == "time" else dict(tbt_slo_ms=rng.choice([0.5, 5.0, 50.0]),
                                                                      max_token_budget=256)
        s = random_scheduler(rng, "sarathi", pp, **kw)
        clock = [0.0]
        s.clock = lambda clock=clock: clock[0]

        def complete(done, result, s=s, clock=clock):
            secs = true_time(done.chunks())  # on a clock that advances by the stages' true time
            clock[0] += secs
            s.update_from_output(done, result)
            s.observe_step(done, [secs * 0.9] * (s.num_stages - 1) + [secs])

        drive(s, rng, eos_prob=0.05, cancel_prob=0.02, complete=complete)
        assert_drained(s)


# --- the TBT controller on a synthetic latency model, through the simulator ---------------------


@dataclass(frozen=True)
class LinearStages:
    """Every stage takes a + b * tokens: a synthetic latency model with a known best budget."""

    num_stages: int
    a: float = 2e-3
    b: float = 50e-6

    def stage_time(self, stage: int, shape: BatchShape) -> float:
        return self.a + self.b * shape.num_tokens

    def transfer_time(self, shape: BatchShape) -> float:
        return 0.0


def _heavy_workload(n: int = 160) -> list[WorkloadRequest]:
    rng = random.Random(5)
    return [WorkloadRequest(0.0, rng.randint(200, 1500), rng.randint(20, 60)) for _ in range(n)]


@pytest.mark.parametrize("slo_ms", [40.0, 150.0])
def test_adaptive_budget_meets_the_tbt_target(slo_ms):
    pp = 2
    cost = LinearStages(pp)
    cfg = SchedulerConfig(token_budget=512, max_token_budget=4096, tbt_slo_ms=slo_ms, max_num_seqs=64)
    res = simulate(_heavy_workload(), cost,
                   SimConfig(cfg, num_blocks=20_000, block_size=16, check_invariants=True))
    p99 = res.latency()["tbt_s"]["p99"]
    assert p99 <= slo_ms * 1e-3
    # The largest budget whose full microbatches meet the target (pp full steps per token, 10% safety).
    best = (0.9 * slo_ms * 1e-3 / pp - cost.a) / cost.b
    assert res.budget_mode is not None
    assert 0.7 * best <= res.budget_mode.token_budget <= 1.05 * best
    fixed = simulate(_heavy_workload(), cost, SimConfig(SchedulerConfig(token_budget=512, max_num_seqs=64),
                                                        num_blocks=20_000, block_size=16))
    if best < 512:  # the fixed budget misses a tight target ...
        assert fixed.latency()["tbt_s"]["p99"] > slo_ms * 1e-3
    else:  # ... and leaves a loose one unused: the controller takes a larger budget
        assert res.budget_mode.token_budget > 512


def test_adaptive_feedback_alone_shrinks_the_budget():
    """Without stage times (Ray executor) only the measured TBT steers: misses shrink the budget."""
    from ppserve.sched.output import SchedulerOutput

    ad = AdaptiveTokenBudget(0.05, start=1000, min_samples=4)
    out = SchedulerOutput(0, ("a", "b"), (1, 1), (5, 5), (), (), ("a", "b"))
    for t in range(1, 6):
        ad.observe(out, (), now=0.2 * t, finished=())
    assert ad.token_budget < 1000 and ad.history and ad.history[0][1] == pytest.approx(0.2)


def _knee_seconds(shape: BatchShape) -> float:
    """A step that costs its floor up to a 96-token knee (the weights' read) and its compute past it:
    what a GPU stage looks like, and what one line through every microbatch cannot follow."""
    _, tokens, prefill_keys, decode_keys, _ = features(shape.chunks, shape.num_sampled)
    return 5e-3 + 40e-6 * max(0.0, tokens - 96) + 1e-9 * prefill_keys + 10e-9 * decode_keys


def _serving_shape(rng: random.Random, with_chunk: bool) -> BatchShape:
    decodes = [(1, rng.randint(100, 3000)) for _ in range(8)]
    chunk = [(rng.randint(150, 504), rng.randint(0, 3000))] if with_chunk else []
    return BatchShape(tuple(decodes + chunk), 8)


def test_the_online_fit_prices_chunks_and_decodes_each_with_its_own_piece():
    """Nine microbatches in ten decode only, below the knee. Weighed alike, they bend the one line away
    from the chunks the balanced share sizes; weighed down (`DECODE_ONLY_WEIGHT`), the chunk piece is
    true for chunks, and the decode-only piece, fitted on them alone, for them."""
    rng = random.Random(11)
    two_piece = OnlinePipelineCost(1)
    one_line = OnlinePipelineCost(1, decode_only_weight=1.0)
    assert one_line.current.decode_stages is None
    for _ in range(2000):
        shape = _serving_shape(rng, with_chunk=rng.random() < 0.1)
        for cost in (two_piece, one_line):
            cost.observe(shape, [_knee_seconds(shape)])

    def worst_error(cost: OnlinePipelineCost, with_chunk: bool) -> float:
        shapes = [_serving_shape(rng, with_chunk) for _ in range(200)]
        return max(abs(cost.current.pace(s) - _knee_seconds(s)) / _knee_seconds(s) for s in shapes)

    assert worst_error(two_piece, with_chunk=True) < 0.08
    assert worst_error(one_line, with_chunk=True) > 2 * worst_error(two_piece, with_chunk=True)
    assert worst_error(two_piece, with_chunk=False) < 0.02
    # A budget adds chunks with the chunk piece: its per-token price is the compute past the knee.
    assert two_piece.current.stages[0].token_s == pytest.approx(40e-6, rel=0.1)


def test_the_decode_only_piece_prices_with_the_chunk_piece_until_it_has_samples():
    cost = OnlinePipelineCost(1)
    chunk = BatchShape(((300, 0), (1, 50)), 1)
    for _ in range(16):
        cost.observe(chunk, [_knee_seconds(chunk)])
    assert cost.current.decode_stages is None  # no decode-only microbatch seen yet: one piece prices all
    decode = BatchShape(((1, 50),), 1)
    for _ in range(8):
        cost.observe(decode, [_knee_seconds(decode)])
    assert cost.current.decode_stages is not None
    assert cost.current.pace(decode) == pytest.approx(_knee_seconds(decode), rel=0.02)
    with pytest.raises(ValueError, match="decode-only stage costs"):
        PipelineCost((TRUE, LAST), decode_stages=(TRUE,))
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError, match="decode_only_weight"):
            OnlinePipelineCost(1, decode_only_weight=bad)


def test_decode_only_microbatches_do_not_wear_out_the_chunk_pieces_memory():
    """A sample forgets the history by the forgetting factor raised to its weight: a decode-only
    microbatch, which counts `DECODE_ONLY_WEIGHT` in the chunk piece, forgets that much. Forgotten at the
    full rate, the few chunks of a conversation trace (one microbatch in ten, or fewer, between runs of
    decodes) wore out in a few hundred decodes, and the chunk piece fitted what was left: a handful of
    chunks and the decodes' weak pull (in the simulator's conversation trace it read 11 us a token and
    7 ns a prefill key where the chunks cost 35 us and 1 ns, and priced a 491-token chunk at 11 ms that
    ran 24 ms)."""
    rng = random.Random(5)
    cost = OnlinePipelineCost(1)
    for _ in range(300):
        shape = _serving_shape(rng, with_chunk=True)
        cost.observe(shape, [_knee_seconds(shape)])
    for _ in range(3000):  # fifteen memories' worth of decode-only microbatches, at the default forgetting
        shape = _serving_shape(rng, with_chunk=False)
        cost.observe(shape, [_knee_seconds(shape)])
    assert cost.current.stages[0].token_s == pytest.approx(40e-6, rel=0.1)
    shapes = [_serving_shape(rng, with_chunk=True) for _ in range(200)]
    assert max(abs(cost.current.pace(s) - _knee_seconds(s)) / _knee_seconds(s) for s in shapes) < 0.08
    # Full-weight samples forget at the full rate, as before: the fit still follows drift.
    fit = StepCostFit(forgetting=0.9)
    x = (1.0, 100.0, 0.0, 0.0, 0.0)
    for seconds in [0.01] * 200 + [0.02] * 200:
        fit.observe(x, seconds)
    assert sum(c * f for c, f in zip(fit.cost.coefficients, x, strict=True)) == pytest.approx(0.02, rel=1e-3)
