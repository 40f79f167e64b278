"""`ppserve demo`, the README's main job, end to end on the default model (few, short requests)."""

from __future__ import annotations

import json
import sys

import pytest


def test_the_demo_serves_its_requests_and_reports_the_pipeline(default_model_dir, ray_session, tmp_path,
                                                               capsys):
    from ppserve.cli import main

    out = tmp_path / "demo"
    assert main(["demo", "--num-requests", "3", "--max-tokens", "6", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "shut down cleanly" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert [o["request_id"] for o in summary["outputs"]] == ["demo-0", "demo-1", "demo-2"]
    assert all(1 <= len(o["token_ids"]) <= 6 and o["text"] for o in summary["outputs"])
    stages = summary["bubbles_active"]["stages"]
    assert len(stages) == 2 and all(s["busy_ns"] > 0 for s in stages)
    assert (out / "trace.json").is_file()
    if sys.platform != "linux":
        assert summary["host_cpu"] is None
        return
    # Where the machine's CPU went while the requests ran: the two stage processes did the compute.
    cpu = summary["host_cpu"]
    assert cpu["stages"] > 0.0 and cpu["cores"] >= 1
    assert cpu["stages"] + cpu["own"] + cpu["other"] + cpu["idle"] == pytest.approx(1.0)
    assert "host CPU over" in printed and "stage processes" in printed
