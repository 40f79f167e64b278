"""The steps a live `ppserve serve` formed and what each cost, read off the Chrome trace it writes (issue 22).

Run the serving benchmark with the trace on, e.g.

    python benchmarks/bench_serving.py --engines ppserve-pp1 --scenarios moderate \\
        --ppserve-set trace.path=/tmp/serve_trace.json
    python benchmarks/analysis_serve_trace.py /tmp/serve_trace.json [more traces...]

and this prints, per trace: the number of steps, the prefill steps and their median prefill tokens, the median
decode rows, and the median stage compute time of prefill steps and of decode-only steps (by decode-row
bucket). These are the same figures `analysis_step_time.py --arrivals` prints for the offline replay of that
load, so the two can be set side by side: the same steps costing more inside the server points at contention
on the cores (the client, the event loop), not at step composition.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def compute_spans(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    spans = [e for e in events if e.get("ph") == "X" and e.get("name") == "compute"]
    if not spans:
        raise SystemExit(f"{path}: no compute spans (was the server started with trace.enabled?)")
    return spans


def summary(spans: list[dict[str, Any]]) -> dict[str, Any]:
    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 1) if xs else None

    pre = [e for e in spans if e["args"]["num_prefill_tokens"] > 0]
    dec = [e for e in spans if e["args"]["num_prefill_tokens"] == 0]
    out: dict[str, Any] = {
        "steps": len(spans), "prefill_steps": len(pre),
        "prefill_tokens_median": med([e["args"]["num_prefill_tokens"] for e in pre]),
        "decode_rows_median": med([e["args"]["num_decode_tokens"] for e in spans]),
        "prefill_step_ms_median": med([e["dur"] / 1e3 for e in pre]),
        "decode_only_step_ms_median": med([e["dur"] / 1e3 for e in dec]),
        "s_in_prefill_steps": round(sum(e["dur"] for e in pre) / 1e6, 2),
        "s_in_decode_only_steps": round(sum(e["dur"] for e in dec) / 1e6, 2),
    }
    for lo, hi in ((1, 4), (5, 8), (9, 16), (17, 64)):
        xs = [e["dur"] / 1e3 for e in dec if lo <= e["args"]["num_decode_tokens"] <= hi]
        out[f"decode_only_ms_median_rows_{lo}_{hi}"] = med(xs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    args = ap.parse_args()
    for path in args.traces:
        print(f"{path}: {json.dumps(summary(compute_spans(path)))}")


if __name__ == "__main__":
    main()
