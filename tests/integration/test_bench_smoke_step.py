"""The step-efficiency benchmark runs end to end on a tiny input (it is not a performance test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_step_efficiency_benchmark_runs(default_model_dir, tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_step_efficiency.py"), "--num-requests", "2",
           "--min-len", "16", "--max-len", "32", "--output-len", "3", "--engines", "ppserve-pp1,hf",
           "--out", str(out), "--engine-timeout", "300", "--rounds", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    engines = [r["engine"] for r in report["rows"]]
    assert engines == ["ppserve-pp1", "hf-generate-b8"], proc.stdout[-2000:]
    for row in report["rows"]:
        assert row["wall_s"] > 0 and row["output_tok_s"] > 0 and row["peak_rss_mib"] > 0
    assert report["matmul_rate"]["bf16_peak_gflops"] > 0
    assert "| ppserve-pp1 |" in proc.stdout
    # two rounds, alternating: every engine ran twice, and each round gives one same-round ratio
    assert all(len(w) == 2 and None not in w for w in report["walls_per_round"].values())
    ratios = report["ratios_vs_ppserve_pp1"]["hf"]
    assert len(ratios["per_round"]) == 2 and ratios["median"] > 0


def test_paged_decode_benchmark_runs(tmp_path):
    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_paged_decode.py"), "--decodes", "4",
           "--min-ctx", "5", "--max-ctx", "40", "--calls", "2", "--repeats", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    for r in rows:
        assert r["native_ms"] > 0 and r["torch_gather_sdpa_ms"] > 0
        assert r["max_abs_diff"] < (1e-5 if r["dtype"] == "float32" else 2e-2)
