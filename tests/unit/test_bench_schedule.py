"""bench_schedule's pure measurement runs at every pipeline depth it offers (it once asserted p microbatches
in flight where the token ring keeps p + 1, and failed at pp = 4)."""

from __future__ import annotations

import pytest

from tests.bench_scripts import load_benchmark


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_the_pure_schedule_measurement_runs_at_every_depth(pp):
    bench = load_benchmark("bench_schedule")
    both = bench.pure_schedule_us(32, steps=6, pp=pp)
    assert set(both) == {"on", "off"}
    for figures in both.values():
        assert figures["schedule_us_median"] > 0 and figures["update_us_median"] > 0
    s = bench.settled_scheduler(32, pp, prefix_caching=False)
    assert len(s.in_flight) == s.max_in_flight == (pp + 1 if pp > 1 else 1)
