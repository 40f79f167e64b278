"""Layer partition: even, explicit, cost-aware (pure Python)."""

import pytest

from ppserve.sched.partition import StageCostModel, partition_layers, stage_costs


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
    layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    cost = StageCostModel.for_llama(576, 1536, 9, 3, 49152, logits_fraction=1.0)
    assert cost.lm_head == pytest.approx(49152 * 576 / layer) == 8.0
    # Two stages balance when n = (30 - n) + 8 layers: n = 19.
    ranges = partition_layers(30, 2, mode="cost", cost=cost)
    assert ranges == [(0, 19), (19, 30)]
    costs = stage_costs(ranges, 30, cost)
    even_costs = stage_costs(partition_layers(30, 2), 30, cost)
    assert max(costs) < max(even_costs)


def test_cost_aware_without_head_cost_is_even():
    assert partition_layers(12, 3, mode="cost", cost=StageCostModel()) == [(0, 4), (4, 8), (8, 12)]


def test_cost_partition_is_optimal_by_brute_force():
    import itertools

    cost = StageCostModel(layer=1.0, embedding=0.5, lm_head=2.7)
    for n, p in [(7, 3), (9, 2), (6, 4)]:
        best = min(
            max(stage_costs(_ranges(c), n, cost))
            for cuts in itertools.combinations(range(1, n), p - 1)
            for c in [_counts(cuts, n)]
        )
        got = max(stage_costs(partition_layers(n, p, mode="cost", cost=cost), n, cost))
        assert got == pytest.approx(best)


def _counts(cuts, n):
    b = [0, *cuts, n]
    return [b[i + 1] - b[i] for i in range(len(b) - 1)]


def _ranges(counts):
    from ppserve.sched.partition import ranges_from_counts

    return ranges_from_counts(counts)


def test_fit_stage_costs_recovers_layer_and_head_costs():
    from ppserve.sched.partition import MeasuredStageCosts, fit_stage_costs

    ranges = [(0, 8), (8, 15), (15, 30)]
    layer, head = [0.002, 0.003, 0.001], [0.010, 0.004, 0.0]  # per microbatch: mixed, decode-heavy, prefill
    times = [(8 * lay, 7 * lay, 15 * lay + h) for lay, h in zip(layer, head, strict=True)]
    costs = fit_stage_costs(times + [(1.0,)], ranges, source="test")  # a short tuple is skipped
    assert costs.num_microbatches == 3
    assert costs.layer_s == pytest.approx(sum(layer) / 3)
    assert costs.head_s == pytest.approx(sum(head) / 3)
    assert costs.cost_model().lm_head == pytest.approx(sum(head) / sum(layer))
    again = MeasuredStageCosts.from_json(costs.to_json())
    assert again == costs
    with pytest.raises(ValueError, match="two stages"):
        fit_stage_costs(times, [(0, 30)])
    with pytest.raises(ValueError, match="no microbatch"):
        fit_stage_costs([(1.0,)], ranges)
    with pytest.raises(ValueError, match="stage-cost profile"):
        MeasuredStageCosts.from_json({"layer_s": 1.0})


def test_calibrated_costs_split_like_the_measured_head():
    """A head measured at 4 layers' cost moves 2 layers off the last of two stages (30 layers: 17 / 13)."""
    from ppserve.sched.partition import fit_stage_costs

    times = [(15 * 0.001, 15 * 0.001 + 0.004)] * 5
    costs = fit_stage_costs(times, [(0, 15), (15, 30)])
    assert partition_layers(30, 2, mode="cost", cost=costs.cost_model()) == [(0, 17), (17, 30)]


def test_initial_ranges_follow_the_mode():
    from types import SimpleNamespace

    from ppserve.sched.partition import initial_ranges

    shape = SimpleNamespace(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                            vocab_size=49152)
    par = SimpleNamespace(pipeline_parallel_size=2, layer_partition=None, partition_mode="cost")
    assert initial_ranges(par, shape) == [(0, 19), (19, 30)]
    par.partition_mode = "calibrated"  # starts even, refined by the engine from measured stage times
    assert initial_ranges(par, shape) == [(0, 15), (15, 30)]
    par.layer_partition = (10, 20)
    assert initial_ranges(par, shape) == [(0, 10), (10, 30)]
