"""Layer partition: even, explicit, cost-aware (pure Python)."""

import pytest

from ppserve.sched.cost import BatchShape, LayerCosts, StepCost, features
from ppserve.sched.partition import (
    DECODE_REFERENCE,
    CostProfile,
    fit_cost_profile,
    partition_layers,
    stage_costs,
    weight_costs,
)


def test_even():
    assert partition_layers(30, 2) == [(0, 15), (15, 30)]
    assert partition_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert partition_layers(5, 5) == [(i, i + 1) for i in range(5)]


def test_explicit():
    assert partition_layers(30, 2, explicit=[14, 16]) == [(0, 14), (14, 30)]
    with pytest.raises(ValueError, match="summing to 30"):
        partition_layers(30, 2, explicit=[14, 15])
    with pytest.raises(ValueError, match="positive"):
        partition_layers(4, 2, explicit=[0, 4])


def test_too_many_stages():
    with pytest.raises(ValueError, match="every stage needs a layer"):
        partition_layers(2, 3)


def test_cost_aware_moves_layers_off_the_head_stage():
    # SmolLM2-135M shapes. A layer's weights: q and o (576 x 576), k and v (576 x 192), gate, up and down
    # (576 x 1536); the tied head is 49152 x 576: exactly 8 layers' worth of weights per token with logits.
    from types import SimpleNamespace

    layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    shape = SimpleNamespace(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                            num_kv_heads=3, vocab_size=49152)
    costs = weight_costs(shape)
    assert (costs.head.of_features(DECODE_REFERENCE) / costs.layer.of_features(DECODE_REFERENCE)
            == 49152 * 576 / layer == 8.0)
    # Two stages balance when n = (30 - n) + 8 layers: n = 19.
    ranges = partition_layers(30, 2, mode="cost", costs=costs)
    assert ranges == [(0, 19), (19, 30)]
    assert (max(stage_costs(ranges, costs, DECODE_REFERENCE))
            < max(stage_costs(partition_layers(30, 2), costs, DECODE_REFERENCE)))
    # Prefill-heavy work (one sampled token in 512) barely prices the head: the split is nearly even.
    prefill = features(((512, 0),), 1)
    assert partition_layers(30, 2, mode="cost", costs=costs, reference=prefill) == [(0, 15), (15, 30)]


def test_cost_aware_without_head_cost_is_even():
    assert partition_layers(12, 3, mode="cost") == [(0, 4), (4, 8), (8, 12)]


def test_cost_partition_is_optimal_by_brute_force():
    import itertools

    costs = LayerCosts(StepCost(floor_s=0.1, token_s=1.0), StepCost(floor_s=0.5, sample_s=2.2))
    ref = features(((1, 0),), 1)
    for n, p in [(7, 3), (9, 2), (6, 4)]:
        best = min(
            max(stage_costs(_ranges(c), costs, ref))
            for cuts in itertools.combinations(range(1, n), p - 1)
            for c in [_counts(cuts, n)]
        )
        got = max(stage_costs(partition_layers(n, p, mode="cost", costs=costs, reference=ref), costs, ref))
        assert got == pytest.approx(best)


def test_robust_partition_bounds_the_worst_regime():
    """SmolLM2's shapes on two stages: the decode split (19 / 11) runs a prefill-heavy step 1.27x slower
    than the even split does; the robust split (17 / 13) is within 1.11x of decode's best and 1.13x of
    prefill's."""
    from types import SimpleNamespace

    from ppserve.sched.partition import cost_partition, prefill_reference, robust_partition

    shape = SimpleNamespace(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                            num_kv_heads=3, vocab_size=49152)
    costs = weight_costs(shape)
    refs = (DECODE_REFERENCE, prefill_reference(512))

    def regret(ranges, ref):
        return (max(stage_costs(ranges, costs, ref))
                / max(stage_costs(cost_partition(30, 2, costs, ref), costs, ref)))

    robust = robust_partition(30, 2, costs, refs)
    assert robust == [(0, 17), (17, 30)]
    assert [round(regret(robust, r), 3) for r in refs] == [1.105, 1.132]
    decode_split = cost_partition(30, 2, costs, DECODE_REFERENCE)
    assert decode_split == [(0, 19), (19, 30)] and round(regret(decode_split, refs[1]), 3) == 1.265
    # One reference: the plain cost split.
    assert robust_partition(30, 2, costs, refs[:1]) == decode_split


def test_robust_partition_is_minimax_by_brute_force():
    import itertools

    from ppserve.sched.partition import cost_partition, robust_partition

    costs = LayerCosts(StepCost(floor_s=0.1, token_s=1.0), StepCost(floor_s=0.5, sample_s=2.2))
    refs = (features(((1, 0),), 1), features(((64, 0),), 1), features(((1, 0),) * 8, 8))
    for n, p in [(7, 3), (9, 2), (6, 4), (12, 3)]:
        best = {r: max(stage_costs(cost_partition(n, p, costs, r), costs, r)) for r in refs}

        def worst(ranges, best=best):
            return max(max(stage_costs(ranges, costs, r)) / best[r] for r in refs)

        optimum = min(worst(_ranges(_counts(cuts, n))) for cuts in itertools.combinations(range(1, n), p - 1))
        assert worst(robust_partition(n, p, costs, refs)) == pytest.approx(optimum)


def _counts(cuts, n):
    b = [0, *cuts, n]
    return [b[i + 1] - b[i] for i in range(len(b) - 1)]


def _ranges(counts):
    from ppserve.sched.partition import ranges_from_counts

    return ranges_from_counts(counts)


LAYER = StepCost(floor_s=2e-5, token_s=3e-6, prefill_key_s=1e-10, decode_key_s=4e-10)
HEAD = StepCost(floor_s=3e-4, token_s=1e-7, sample_s=6e-5)


def _measured(ranges, n=60, seed=0):
    """Microbatches of a calibration-like run (prefill chunks, decodes) priced by LAYER and HEAD."""
    import random

    rng = random.Random(seed)
    pipe = LayerCosts(LAYER, HEAD).pipeline(ranges)
    samples = []
    for _ in range(n):
        chunks = tuple((1, rng.randint(10, 300)) for _ in range(rng.randint(0, 16)))
        if rng.random() < 0.6:
            chunks += ((rng.randint(8, 128), rng.randint(0, 128)),)
        shape = BatchShape(chunks or ((1, 5),), sum(1 for c, _ in chunks if c == 1) + (rng.random() < 0.3))
        samples.append((shape, pipe.stage_times(shape)))
    return samples


def test_fit_cost_profile_recovers_layer_and_head_costs():
    ranges = [(0, 8), (8, 15), (15, 30)]
    samples = _measured(ranges)
    profile = fit_cost_profile(samples + [(samples[0][0], (1.0,))], ranges, source="test")  # short: skipped
    assert profile.num_microbatches == len(samples)
    assert profile.costs.layer.coefficients == pytest.approx(LAYER.coefficients, rel=1e-3, abs=1e-10)
    assert profile.costs.head.coefficients == pytest.approx(HEAD.coefficients, rel=1e-3, abs=1e-9)
    assert CostProfile.from_json(profile.to_json()) == profile
    with pytest.raises(ValueError, match="two stages"):
        fit_cost_profile(samples, [(0, 30)])
    with pytest.raises(ValueError, match="no microbatch"):
        fit_cost_profile([(samples[0][0], (1.0,))], ranges)
    with pytest.raises(ValueError, match="cost profile"):
        CostProfile.from_json({"layer_s": 1.0})


def test_calibration_prices_the_split_at_its_decodes_even_when_the_fit_is_collinear():
    """A calibration run like the real one: two prefill microbatches, then decodes that all carry the
    same four requests (floor, tokens and samples move together: the per-stage fits cannot tell them
    apart). The profile's reference is the mean decode, and the head it gives at that reference is the
    head the stages measured, so the split is the decode-balanced one (the default model on this CPU:
    layers ~0.95 ms, head ~5.8 ms at four decodes -> 18 / 12)."""
    import random

    rng = random.Random(1)
    ranges = [(0, 15), (15, 30)]
    layer_ms, head_ms = 0.95, 5.8
    samples = [(BatchShape.uniform(num_prefill_tokens=256), (15 * 9.0e-3, 15 * 9.0e-3 + 2e-3))] * 2
    for step in range(60):
        shape = BatchShape(((1, 40 + step),) * 4, 4, 0, 4)
        noise = [1.0 + rng.uniform(-0.1, 0.1) for _ in range(2)]  # a shared machine's +-10 %
        samples.append((shape,
                        (15 * layer_ms * 1e-3 * noise[0], (15 * layer_ms + head_ms) * 1e-3 * noise[1])))
    profile = fit_cost_profile(samples, ranges)
    assert profile.reference[1] == pytest.approx(4.0)  # four tokens: the decodes', not the prefill's mean
    assert profile.head_in_layers == pytest.approx(head_ms / layer_ms, rel=0.1)
    assert profile.ranges(30, 2) == [(0, 18), (18, 30)]


def test_calibration_profile_reproduces_each_stage_at_its_reference():
    """The head is a difference of two stage fits; where one stage's time grows with context and the
    other's does not (what a shared machine makes of two processes), the per-coefficient difference is
    negative in one term and clamped: alone, that prices the last stage ~2.8 ms above what it measured
    at the reference. The profile prices each stage of the calibrated split at the reference as
    measured there."""
    ranges = [(0, 15), (15, 30)]
    samples = []
    for step in range(60):
        shape = BatchShape(((1, 40 + step),) * 4, 4, 0, 4)
        keys = 4 * (41 + step)
        samples.append((shape, (15 * 0.95e-3 + 1e-5 * keys, 15 * 0.95e-3 + 5.8e-3)))
    profile = fit_cost_profile(samples, ranges)
    measured = [sum(t[s] for _, t in samples) / len(samples) for s in range(2)]
    predicted = [c.of_features(profile.reference) for c in profile.costs.pipeline(ranges).stages]
    assert predicted == pytest.approx(measured, rel=1e-3)


def test_calibrated_costs_split_like_the_measured_head():
    """A head measured at 4 layers' cost (at the run's mean microbatch) moves 2 layers off the last of
    two stages (30 layers: 17 / 13)."""
    ref = features(((64, 0),), 1)
    layer = StepCost(token_s=1e-3 / 64)
    head = StepCost(sample_s=4e-3)
    profile = CostProfile(LayerCosts(layer, head), ref, 5)
    assert profile.head_in_layers == pytest.approx(4.0)
    assert profile.ranges(30, 2) == [(0, 17), (17, 30)]


def test_initial_ranges_follow_the_mode():
    from types import SimpleNamespace

    from ppserve.sched.partition import initial_ranges

    shape = SimpleNamespace(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                            num_kv_heads=3, vocab_size=49152)
    par = SimpleNamespace(pipeline_parallel_size=2, layer_partition=None, partition_mode="cost")
    # Robust over decode (best 19 / 11) and a full-budget prefill chunk (best 15 / 15).
    assert initial_ranges(par, shape) == [(0, 17), (17, 30)]
    assert initial_ranges(par, shape, token_budget=1) == [(0, 19), (19, 30)]  # a 1-token chunk is a decode
    par.partition_mode = "calibrated"  # starts even, refined by the engine from measured stage times
    assert initial_ranges(par, shape) == [(0, 15), (15, 30)]
    par.layer_partition = (10, 20)
    assert initial_ranges(par, shape) == [(0, 10), (10, 30)]


def test_profile_cache_is_keyed_and_honours_the_cache_variables(tmp_path, monkeypatch):
    from pathlib import Path
    from types import SimpleNamespace

    from ppserve.cache import cache_root
    from ppserve.config import EngineConfig, ParallelConfig, SchedulerConfig
    from ppserve.engine.calibration import profile_cache_path

    def engine(**sched):
        cfg = EngineConfig(parallel=ParallelConfig(pipeline_parallel_size=2),
                           scheduler=SchedulerConfig(**sched))
        return SimpleNamespace(config=cfg, model_dir=Path("/models/tiny"))

    monkeypatch.delenv("PPSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "ppserve"
    monkeypatch.setenv("PPSERVE_CACHE_DIR", str(tmp_path / "pp"))
    path = profile_cache_path(engine())
    assert path.parent == tmp_path / "pp" / "partition" and path.name.startswith("tiny-")
    assert profile_cache_path(engine()) == path  # the same settings: the same file
    assert profile_cache_path(engine(token_budget=64)) != path
    assert profile_cache_path(engine(max_num_seqs=8)) != path
    # measured with other kernels: other costs (a new CPU GEMM moved the default model's head by 3 layers)
    monkeypatch.setattr("ppserve.model.ops.build.library_key", lambda: "other kernels")
    assert profile_cache_path(engine()) != path
