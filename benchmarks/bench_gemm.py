"""bf16 GEMMs of the default model through ppserve's panel kernel and through oneDNN, side by side (issue 22).

A decode step multiplies a few rows by every weight once. This times one pass over SmolLM2-135M's bf16
linears, the 30 layers' four projections (distinct weights, so the pass streams them from memory as the
model does) and the tied LM head, at decode and prefill row counts, three ways, interleaved:

- `panels`: ppserve's panel GEMM (`native.panel_gemm`: AMX tiles, else AVX512-BF16 dot products), what
  a bf16 stage runs on such a CPU; the gate/up weight with its SiLU-and-mul epilogue, as the MLP runs it;
- `onednn served`: oneDNN as ppserve ran it before the AVX512-BF16 kernel (and still runs it on CPUs with
  neither): per weight and row bucket the fastest of prepacked / plain `F.linear` at the bucket's row
  count, and prepacked at 64 rows below 64 (`PackedWeight.linear`'s timed choice), the rows zero-padded;
  the gate/up product then ppserve's SiLU-and-mul kernel;
- `onednn exact`: oneDNN's prepacked primitive at the exact row count (no bucket), what oneDNN itself
  could do if every row count got its own primitive (ppserve buckets them to bound oneDNN's memory).

    python benchmarks/bench_gemm.py [--rows 1,4,8,16,32,64,128,256,512] [--threads 2] [--repeats 15]

Prints ms per pass, weight GB/s and GFLOP/s per way and row count, the ratios, and the largest
difference from a float32 reference. Writes results/bench_gemm.json (or --out). Not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ppserve.bench.report import write_json
from ppserve.model.ops import gemm, native, silu_mul
from ppserve.model.ops.gemm import PackedWeight, can_prepack

LAYERS, HIDDEN, INTER, QKV, VOCAB = 30, 576, 1536, 960, 49152
PROJECTIONS = {
    "qkv": (QKV, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}


class Weight:
    """One weight and its layouts: the panel kernel's and oneDNN's (PackedWeight), side by side."""

    def __init__(self, name: str, out: int, inp: int, g: torch.Generator, panel: native.PanelGemm) -> None:
        self.name = name
        self.w = (torch.randn(out, inp, generator=g) * inp ** -0.5).bfloat16()
        self.onednn = PackedWeight()
        self.onednn.pack(self.w, use_panels=False)
        self.panels = panel.pack_gate_up(self.w) if name == "gate_up" else panel.pack(self.w)

    def run_panels(self, panel: native.PanelGemm, x: torch.Tensor) -> torch.Tensor:
        return panel(x, self.panels, None, silu_mul=self.name == "gate_up")

    def run_onednn(self, x: torch.Tensor) -> torch.Tensor:
        out = self.onednn.linear(x, self.w, None)  # the timed choice per (shape, bucket), rows padded
        return silu_mul(out) if self.name == "gate_up" else out

    def run_exact(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x, self.onednn.packed, None, "none", [], "")
        return silu_mul(out) if self.name == "gate_up" else out


def one_pass(
    weights: list[Weight], inputs: dict[int, torch.Tensor], run: Callable[[Weight, torch.Tensor], object]
) -> None:
    for weight in weights:
        run(weight, inputs[weight.w.shape[1]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,256,512")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="results/bench_gemm.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    panel = native.panel_gemm()
    probe = torch.zeros(32, 32, dtype=torch.bfloat16)
    if panel is None or not can_prepack(probe):
        raise SystemExit(
            "this CPU has no panel GEMM (AMX or AVX512-BF16) or no native bf16: nothing to compare"
        )
    g = torch.Generator().manual_seed(0)
    weights = [Weight(name, *shape, g, panel) for _ in range(LAYERS) for name, shape in PROJECTIONS.items()]
    weights.append(Weight("lm_head", VOCAB, HIDDEN, g, panel))
    weight_bytes = sum(w.w.numel() * 2 for w in weights)
    macs_per_row = sum(w.w.numel() for w in weights)
    ways: dict[str, Callable[[Weight, torch.Tensor], object]] = {
        "panels": lambda w, x: w.run_panels(panel, x), "onednn_served": lambda w, x: w.run_onednn(x),
        "onednn_exact": lambda w, x: w.run_exact(x)}
    results = []
    print(f"panel kernel: {panel.kernel}; {args.threads} threads; one pass = {len(weights)} GEMMs over "
          f"{weight_bytes / 1e6:.0f} MB of bf16 weights; load {os.getloadavg()[0]:.2f}")
    print(
        "| rows | panels ms | oneDNN served ms | oneDNN exact ms | served / panels | exact / panels | panels "
        "GB/s | "
        "panels GFLOP/s | max rel. diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in (HIDDEN, INTER)}
            err = 0.0
            for w in (weights[0], weights[2], weights[3], weights[-1]):  # agreement, one of each shape
                x = inputs[w.w.shape[1]]
                ref = x.float() @ w.w.float().T
                if w.name == "gate_up":
                    gate, up = ref.bfloat16().chunk(2, dim=-1)
                    ref = (F.silu(gate) * up).float()
                err = max(err, ((w.run_panels(panel, x).float() - ref).abs().max() / ref.abs().max()).item())
            for run in ways.values():  # untimed: JIT-compiles oneDNN's primitives and times its paths
                one_pass(weights, inputs, run)
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(args.repeats):  # interleaved, so all three see the same load
                for name, run in ways.items():
                    start = time.perf_counter()
                    one_pass(weights, inputs, run)
                    times[name].append(time.perf_counter() - start)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            row = {"rows": rows, **{f"{name}_ms": v for name, v in ms.items()},
                   "served_over_panels": ms["onednn_served"] / ms["panels"],
                   "exact_over_panels": ms["onednn_exact"] / ms["panels"],
                   "panels_weight_gb_s": weight_bytes / ms["panels"] / 1e6,
                   "panels_gflop_s": 2 * macs_per_row * rows / ms["panels"] / 1e6, "max_rel_diff": err}
            results.append(row)
            print(f"| {rows} | {ms['panels']:.2f} | {ms['onednn_served']:.2f} | {ms['onednn_exact']:.2f} | "
                  f"{row['served_over_panels']:.2f}x | {row['exact_over_panels']:.2f}x | "
                  f"{row['panels_weight_gb_s']:.1f} | {row['panels_gflop_s']:.0f} | {err:.1e} |", flush=True)
    served_paths = sorted({f"{k[0]}x{k[1]}@{k[2]}: {v[0]}@{v[1]}" for k, v in gemm._FASTEST.items()})
    write_json(
        args.out,
        {
            "args": vars(args),
            "kernel": panel.kernel,
            "weight_bytes": weight_bytes,
            "load_avg": os.getloadavg(),
            "results": results,
            "onednn_served_paths": served_paths,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
