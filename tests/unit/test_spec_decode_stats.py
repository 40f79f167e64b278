"""Speculative decoding's figures in the engine stats and the benchmark reports: a run's own counts from
two stats readings, the derived rates, and the report table shown only when drafts happened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppserve.bench.harness import RunResult
from ppserve.bench.report import policy_table, spec_decode_table, write_json
from ppserve.engine.stats import EngineCounts, acceptance_fields, spec_decode_since
from ppserve.metrics.latency import RequestTiming


def counts(drafts: int, tokens: int, accepted: int, per_pos: tuple[int, ...]) -> EngineCounts:
    return EngineCounts(spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=tokens,
                        spec_decode_num_accepted_tokens=accepted,
                        spec_decode_num_accepted_tokens_per_pos=per_pos,
                        **acceptance_fields(drafts, tokens, accepted))


def test_acceptance_figures_are_zero_without_drafts() -> None:
    assert acceptance_fields(0, 0, 0) == {"spec_decode_acceptance_rate": 0.0,
                                          "spec_decode_mean_acceptance_length": 0.0}
    c = counts(4, 12, 6, (3, 2, 1))
    assert c.speculated and not EngineCounts().speculated
    assert (c.spec_decode_acceptance_rate, c.spec_decode_mean_acceptance_length) == (0.5, 2.5)


def test_a_runs_own_figures_are_the_difference() -> None:
    assert spec_decode_since(EngineCounts(), EngineCounts()) is None
    assert spec_decode_since(counts(2, 6, 1, (1, 0)), counts(2, 6, 1, (1, 0))) is None
    run = spec_decode_since(counts(2, 6, 1, (1,)), counts(6, 18, 7, (4, 2, 1)))
    assert run == {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6,
                   "num_accepted_tokens_per_pos": [3, 2, 1], "acceptance_rate": 0.5,
                   "mean_acceptance_length": 2.5}


def test_reports_show_speculation_only_for_runs_that_drafted(tmp_path: Path) -> None:
    timing = {"r": RequestTiming(0.0, 0.0, [0.1, 0.2])}
    plain = RunResult("plain", timing, [], [], 1).summary()
    run = spec_decode_since(EngineCounts(), counts(4, 12, 6, (3, 2, 1)))
    drafted = RunResult("drafted", timing, [], [], 1, meta={"spec_decode": run}).summary()
    assert spec_decode_table([plain]) == "" and "acceptance" not in policy_table([plain])
    table = policy_table([plain, drafted])
    assert "| mean acceptance length |" in table
    assert "| drafted | 4 | 12 | 6 | 50.0% | 2.50 | 3 / 2 / 1 |" in table and "| plain | 4 |" not in table
    data = json.loads(write_json(tmp_path / "r.json", {"summaries": {"drafted": drafted}}).read_text())
    assert data["summaries"]["drafted"]["spec_decode"]["mean_acceptance_length"] == pytest.approx(2.5)
