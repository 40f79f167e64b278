"""benchmarks/bench_structured.py end to end on its --quick settings: the compile and rate parts on the
default model offline (pp 1), and, marked slow, the validity and tool-call parts through a `ppserve
serve` subprocess and the openai client. Figures are not checked, only that the parts produce their
files and sane shapes; the mask-exposure arithmetic is checked on spans made up here."""

from __future__ import annotations

import json

import pytest

from ppserve.metrics.spans import Span
from tests.bench_scripts import load_benchmark

bench = load_benchmark("bench_structured")


def test_check_json_reports_parse_schema_and_format_failures():
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]}
    assert bench.check_json('{"d": "2020-01-31"}', schema)["valid_formats"]
    assert not bench.check_json("{", schema)["parses"]
    assert not bench.check_json("{}", schema)["valid"]
    bad_date = bench.check_json('{"d": "yesterday"}', schema)
    assert bad_date["valid"] and not bad_date["valid_formats"]


def test_mask_exposure_counts_only_the_mask_after_the_hidden_states():
    def s(kind, start, end, stage, step, decode=0):
        return Span(kind, start, end, stage, 0, step, num_decode_tokens=decode)

    spans = [
        # step 1: stage 0's send ends at 105, the mask runs to 110: 5 ns of 100 ns of compute exposed
        s("send", 95, 105, 0, 1), s("grammar_mask", 100, 110, 1, 1), s("recv_wait", 110, 112, 1, 1),
        s("compute", 112, 212, 1, 1, decode=4),
        # step 2: the mask ends before stage 0's send: hidden (the stage waits after it)
        s("grammar_mask", 300, 310, 1, 2), s("recv_wait", 310, 330, 1, 2), s("send", 310, 328, 0, 2),
        s("compute", 330, 430, 1, 2, decode=4),
        # step 3: a prefill only: left out
        s("grammar_mask", 500, 510, 1, 3), s("send", 400, 505, 0, 3), s("compute", 510, 610, 1, 3),
    ]
    m = bench.mask_exposure(spans)
    assert m["microbatches"] == 2
    assert m["exposed_fraction_mean"] == pytest.approx(0.025)
    assert m["exposed_fraction_p90"] == pytest.approx(0.05)
    assert m["hidden_pct"] == pytest.approx(50.0)
    assert m["mask_ms_mean"] == pytest.approx(1e-5)


def test_quick_compile_and_rate(tmp_path):
    res = bench.main(["--quick", "--parts", "compile,rate", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "structured.json").read_text())
    assert len(saved["compile"]["rows"]) == 3
    assert all(r["cold_ms"] > 0 for r in saved["compile"]["rows"])
    (rate,) = res["rate"]
    assert rate["pp"] == 1 and rate["constraints"]["regex"]["output_tok_s"]["ratio"] > 0
    for run in rate["runs"]:  # both sides produce exactly max_tokens tokens per request
        assert run["lengths"] == [rate["max_tokens"]] and run["finish_reasons"] == ["length"]


@pytest.mark.slow
def test_quick_validity_and_tools_over_http(tmp_path):
    pytest.importorskip("openai")
    res = bench.main(["--quick", "--parts", "validity,tools", "--out", str(tmp_path)])
    v = res["validity"]
    assert v["path"] == "http" and len(v["rows"]) == 2 * 3
    assert v["summary"]["all"]["requests"] == 6
    assert "summary" in res["tools"] or "skipped" in res["tools"]
    assert (tmp_path / "structured.json").is_file()
