"""benchmarks/bench_serving.py's own bookkeeping (no server, no client)."""

from __future__ import annotations

from tests.bench_scripts import load_benchmark


def test_every_scenario_is_seeded_apart_and_alike_for_every_server() -> None:
    """The scenarios run one after another on one server: a scenario that re-sent an earlier one's prompts
    would be served from the prefix cache. Seeds differ per scenario, and depend on nothing but --seed and
    the scenario (so every server gets the same prompts)."""
    bench = load_benchmark("bench_serving")
    seeds = [bench.scenario_seed(0, name) for name in bench.SCENARIOS]
    assert len(set(seeds)) == len(seeds)
    assert bench.scenario_seed(7, "saturation") == bench.scenario_seed(7, "saturation")
    assert bench.scenario_seed(7, "saturation") != bench.scenario_seed(0, "saturation")
