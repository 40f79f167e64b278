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
           "--out", str(out), "--engine-timeout", "300"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    engines = [r["engine"] for r in report["rows"]]
    assert engines == ["ppserve-pp1", "hf-generate-b8"], proc.stdout[-2000:]
    for row in report["rows"]:
        assert row["wall_s"] > 0 and row["output_tok_s"] > 0 and row["peak_rss_mib"] > 0
    assert report["matmul_rate"]["bf16_peak_gflops"] > 0
    assert "| ppserve-pp1 |" in proc.stdout
