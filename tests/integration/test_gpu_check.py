"""The GPU check runs end to end on CPU (`--device cpu`), so it cannot rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_gpu_check_on_cpu(default_model_dir, tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "-m", "ppserve.gpu_check", "--device", "cpu", "--out", str(out),
                           "--prompts", "2", "--max-tokens", "6"], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    report = json.loads((out / "gpu_check.json").read_text())
    phases = report["phases"]
    assert list(phases) == ["environment", "gpu_tests", "default_model_pp1", "default_model_pp2", "throughput"]
    assert "needs CUDA" in phases["gpu_tests"]["skipped"]
    for pp in (1, 2):
        run = phases[f"default_model_pp{pp}"]
        assert run["ok"], run
        assert len(run["stages"]) == pp and len(run["decode_step_timing"]) == pp
        assert [e["phase"] for e in run["stages"][0]["memory"]][:2] == ["weights loaded", "KV cache allocated"]
        assert all(t["decode_steps"] > 0 and t["median_device_ms"] > 0 for t in run["decode_step_timing"])
        assert len(run["tokens_before_first_difference"]) == 2
    tput = phases["throughput"]
    assert tput["ok"] and tput["output_tokens_per_s"] > 0 and tput["model"]["weights"] == "random"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["ok"] is True
